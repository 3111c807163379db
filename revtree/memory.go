package revtree

import (
	"unsafe"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/allocsize"
	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// Memory estimates.
//
// The store counts its memory as it goes, with a deterministic estimate of
// every object it keeps: no runtime.MemStats, no walk of the index. Each
// estimate is the object's size rounded up to the Go allocator's size class
// (allocsize), which is what the heap really spends on it.
//
//   - A stored KeyValue (storedkv): its encoding after its length and
//     tag, which holds its key and value (Version.Bytes; less in a slab,
//     whose bytes the index no longer holds count until the slab is
//     evacuated: SlabSet.Dead), plus, for an entry, the entry (128 bytes:
//     the KeyValue struct and its encoding's length; storedkv.Bytes). A
//     read's KeyValues made of bare encodings are the read's, in slabs
//     (storedkv.KVMaker), counted only when the
//     flattened-range cache keeps them. A delete's
//     tombstone is as the protobuf decoder of a watch response makes it:
//     the struct (120 bytes, class 128), its key and its value, each a
//     separate allocation (kvBytes).
//   - An Event: the struct (64 bytes), plus its slot in the events slice of
//     the watch response (8 bytes). A delete's Kv is a tombstone KeyValue
//     of its own (a key, no value); a put's Kv is the stored KeyValue.
//   - A key's history (keyindex.go): the keyHistory (8 bytes: its key is
//     an encoding's) and its array of 16-byte versions after a header
//     (24 bytes for one version: storedkv.VersionArrayBytes), whose
//     capacity doubles as it fills (keyHistoryBytes).
//   - The index's B-tree (github.com/google/btree): each node is the node
//     struct (56 bytes, class 64), its items array and, for an inner node,
//     its children array. Arrays grow by append, so a node of degree d
//     holds capacity for 2d-1 items and 2d children rounded up to a power
//     of two (16 and 16 at degree 8: 128 bytes each). A load inserts keys
//     in order, which leaves every node half full, d-1 items, and every
//     inner node with d children; the root holds what is left.
//     shape.levels computes the levels for n items from that. Trees grown
//     by random inserts are fuller (about 0.7 of 2d-1 items per node) and
//     a little shallower. (A load that filled the leaves would not keep
//     them full: btree splits a full node on the way to any item below
//     it, even to replace one, as the sweep does.) A revision that inserts or removes a key copies
//     the nodes on its path while a view shares them: garbage once no
//     view holds the old tree, so not counted.
//   - A snapshot: the snapshot struct and its slot in the index of
//     snapshots.
//
// The live keyspace is its KeyValues, one history of one version per live
// key and the index's tree of the live keys. History, which the budget
// bounds, is what each retained revision added (its snapshot, its events
// and the KeyValues it displaced, a put's or delete's previous one, which
// from then on only history holds), the versions and deleted keys the
// index keeps for it, and the flattened-range cache. Dropping the oldest
// snapshot frees its snapshot and events at once; the KeyValues it
// displaced, and the versions that held them, once the index's sweep
// prunes their keys (sweep.go). Until then ApproxBytes counts them
// (pendingBytes), the budget does not.
//
// TestMemoryEstimate checks these estimates against the live heap
// (runtime.MemStats.HeapAlloc after a GC) for several degrees, value sizes
// and workloads.

var (
	kvStructBytes    = allocsize.Class(int64(unsafe.Sizeof(mvccpb.KeyValue{})))
	eventBytes       = allocsize.Class(int64(unsafe.Sizeof(mvccpb.Event{}))) + 8 // + its slot in the events slice
	nodeStructBytes  = allocsize.Class(2*24 + 8)                                 // items, children (slices), cow (pointer)
	snapshotOverhead = allocsize.Class(int64(unsafe.Sizeof(snapshot{}))) +
		20 // the slot in the snapshot index: a degree-32 B-tree of pointers, appended in order, so half-full nodes
	keyHistoryStructBytes = allocsize.Class(int64(unsafe.Sizeof(keyHistory{})))
)

// dirtyKeyBytes estimates a key marked for the sweep: its entry in the
// map of marks (a string header and a control byte, in a table at most
// 7/8 full that doubles as it grows) and in the sweep's sorted list.
const dirtyKeyBytes = 48

// keyHistoryBytes estimates a key's history with an array of capacity
// versions.
func keyHistoryBytes(capacity int) int64 {
	return keyHistoryStructBytes + storedkv.VersionArrayBytes(capacity)
}

// kvBytes estimates a decoded KeyValue's memory (a delete's tombstone):
// the struct, its key and value.
func kvBytes(kv *mvccpb.KeyValue) int64 {
	return kvStructBytes + allocsize.Bytes(len(kv.Key)) + allocsize.Bytes(len(kv.Value))
}

// pow2 returns the least power of two >= n (n >= 1).
func pow2(n int) int {
	p := 1
	for p < n {
		p *= 2
	}
	return p
}

// shape is the estimated cost of the nodes of a tree of degree d.
type shape struct {
	degree      int
	leaf, inner int64 // a node at full capacity
}

func newShape(degree int) shape {
	items := allocsize.Class(int64(8 * pow2(2*degree-1)))
	children := allocsize.Class(int64(8 * pow2(2*degree)))
	return shape{degree: degree, leaf: nodeStructBytes + items, inner: nodeStructBytes + items + children}
}

// level is one level of an estimated tree.
type level struct {
	nodes int   // how many nodes
	bytes int64 // of each node
	items int   // the level holds
}

// levels returns the levels of the estimated tree of n items, leaves
// first, into buf.
func (sh shape) levels(n int, buf *[64]level) []level {
	d := sh.degree
	out := buf[:0]
	switch {
	case n == 0:
		return out
	case n <= 2*d-1: // a leaf root
		return append(out, level{1, nodeStructBytes + allocsize.Class(int64(8*pow2(n))), n})
	}
	// Half-full nodes: each leaf holds d-1 items and gives one to its
	// parent, each inner node has d children and d-1 items.
	nodes := (n + d - 1) / d
	out = append(out, level{nodes, sh.leaf, 0})
	inner := 0
	for nodes > 2*d && len(out) < len(buf)-1 {
		nodes = (nodes + d - 1) / d
		out = append(out, level{nodes, sh.inner, nodes * (d - 1)})
		inner += nodes * (d - 1)
	}
	// The root holds what is left: one child per node below.
	out = append(out, level{1, nodeStructBytes + allocsize.Class(int64(8*pow2(nodes-1))) + allocsize.Class(int64(8*pow2(nodes))), nodes - 1})
	inner += nodes - 1
	out[0].items = max(n-inner, 0)
	return out
}

// tree estimates every node of a tree of n items.
func (sh shape) tree(n int) int64 {
	var buf [64]level
	var all int64
	for _, l := range sh.levels(n, &buf) {
		all += int64(l.nodes) * l.bytes
	}
	return all
}
