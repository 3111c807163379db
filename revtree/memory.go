package revtree

import (
	"unsafe"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Memory estimates.
//
// The store counts its memory as it goes, with a deterministic estimate of
// every object it keeps: no runtime.MemStats, no walk of the index. Each
// estimate is the object's size rounded up to the Go allocator's size class
// (sizeClass), which is what the heap really spends on it.
//
//   - A stored KeyValue (entry.go): its encoding after its length and
//     tag, which holds its key and value (encodingBytes; packedBytes in a slab,
//     pack.go, whose bytes the index no longer holds count until the
//     slab is evacuated: slabSet.dead), plus, for an entry, the entry
//     (unsafe.Sizeof, 128 bytes: the KeyValue struct and its encoding's
//     length; storedBytes). A read's KeyValues made of bare encodings
//     are the read's, in slabs (kvMaker), counted only when the
//     flattened-range cache keeps them. A delete's
//     tombstone is as the protobuf decoder of a watch response makes it:
//     the struct (120 bytes, class 128), its key and its value, each a
//     separate allocation (kvBytes).
//   - An Event: the struct (64 bytes), plus its slot in the events slice of
//     the watch response (8 bytes). A delete's Kv is a tombstone KeyValue
//     of its own (a key, no value); a put's Kv is the stored KeyValue.
//   - A key's history (keyindex.go): the keyHistory (8 bytes: its key is
//     an encoding's) and its array of 16-byte versions after a header
//     (24 bytes for one version), whose capacity doubles as it fills
//     (keyHistoryBytes).
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

// sizeClasses are the Go allocator's small object size classes
// (internal/runtime/gc/sizeclasses.go, Go 1.26). Larger objects take whole
// 8 KiB pages.
var sizeClasses = [...]int64{
	8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256,
	288, 320, 352, 384, 416, 448, 480, 512, 576, 640, 704, 768, 896, 1024, 1152, 1280,
	1408, 1536, 1792, 2048, 2304, 2688, 3072, 3200, 3456, 4096, 4864, 5376, 6144, 6528,
	6784, 6912, 8192, 9472, 9728, 10240, 10880, 12288, 13568, 14336, 16384, 18432, 19072,
	20480, 21760, 24576, 27264, 28672, 32768,
}

// sizeClass returns the heap bytes an allocation of n bytes takes.
func sizeClass(n int64) int64 {
	switch {
	case n <= 0:
		return 0
	case n > sizeClasses[len(sizeClasses)-1]:
		const page = 8192
		return (n + page - 1) / page * page
	}
	lo, hi := 0, len(sizeClasses)-1
	for lo < hi {
		mid := (lo + hi) / 2
		if sizeClasses[mid] < n {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return sizeClasses[lo]
}

// bytesAlloc is the heap an allocation of a []byte of n bytes takes. Below
// 16 bytes the allocator packs pointer-free objects together (its tiny
// allocator), so they cost about their length.
func bytesAlloc(n int) int64 {
	if n < 16 {
		return int64(n)
	}
	return sizeClass(int64(n))
}

var (
	kvStructBytes    = sizeClass(int64(unsafe.Sizeof(mvccpb.KeyValue{})))
	entryBytes       = sizeClass(int64(unsafe.Sizeof(entry{})))
	eventBytes       = sizeClass(int64(unsafe.Sizeof(mvccpb.Event{}))) + 8 // + its slot in the events slice
	nodeStructBytes  = sizeClass(2*24 + 8)                                 // items, children (slices), cow (pointer)
	snapshotOverhead = sizeClass(int64(unsafe.Sizeof(snapshot{}))) +
		20 // the slot in the snapshot index: a degree-32 B-tree of pointers, appended in order, so half-full nodes
	keyHistoryStructBytes = sizeClass(int64(unsafe.Sizeof(keyHistory{})))
)

// dirtyKeyBytes estimates a key marked for the sweep: its entry in the
// map of marks (a string header and a control byte, in a table at most
// 7/8 full that doubles as it grows) and in the sweep's sorted list.
const dirtyKeyBytes = 48

// versionArrayBytes is the heap an array of capacity versions takes: the
// slots after the header (versionArray).
func versionArrayBytes(capacity int) int64 {
	if capacity == 1 {
		return sizeClass(int64(unsafe.Sizeof(versionArray1{})))
	}
	return sizeClass(int64(capacity+1) * int64(unsafe.Sizeof(version{})))
}

// keyHistoryBytes estimates a key's history with an array of capacity
// versions.
func keyHistoryBytes(capacity int) int64 {
	return keyHistoryStructBytes + versionArrayBytes(capacity)
}

// kvBytes estimates a decoded KeyValue's memory (a delete's tombstone):
// the struct, its key and value.
func kvBytes(kv *mvccpb.KeyValue) int64 {
	return kvStructBytes + bytesAlloc(len(kv.Key)) + bytesAlloc(len(kv.Value))
}

// storedBytes estimates an entry's memory (entry.go): the entry, the size
// of a KeyValue, and its encoding after its length, which holds its key
// and value.
func storedBytes(kv *mvccpb.KeyValue) int64 {
	if n := entryOf(kv).encLen; n != 0 {
		return entryBytes + encodingBytes(int(n))
	}
	return entryBytes + bytesAlloc(len(kv.Key)) + bytesAlloc(len(kv.Value))
}

// encodingBytes is the heap a bare encoding of an encoding of n bytes
// takes, allocated alone.
func encodingBytes(n int) int64 { return bytesAlloc(bareLen(n)) }

// versionBytes estimates what a version holds: its entry or its bare
// encoding; nothing for a delete.
func versionBytes(v version) int64 {
	switch {
	case !v.isPut():
		return 0
	case v.isPacked():
		return packedBytes(len(bareEncoding(v.p)))
	case v.isBare():
		return encodingBytes(len(bareEncoding(v.p)))
	}
	return storedBytes(&v.entry().kv)
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
	items := sizeClass(int64(8 * pow2(2*degree-1)))
	children := sizeClass(int64(8 * pow2(2*degree)))
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
		return append(out, level{1, nodeStructBytes + sizeClass(int64(8*pow2(n))), n})
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
	out = append(out, level{1, nodeStructBytes + sizeClass(int64(8*pow2(nodes-1))) + sizeClass(int64(8*pow2(nodes))), nodes - 1})
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
