package revtree

import (
	"bytes"
	"sort"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// The key index: every key's versions, as etcd's keyIndex keeps them.
//
// The store's index is a copy-on-write B-tree of *keyHistory ordered by
// key, holding every key that has a version some retained revision can
// see: the live keys, and the deleted ones until the snapshot of their
// delete is dropped and the sweep comes by (sweep.go). A read at revision R walks the
// index over the requested range and takes, of each key, its newest
// version at or below R (keyHistory.at); a delete's version has no
// KeyValue, so the key is absent from R on. No tree is copied per
// revision: a revision costs its version (16 bytes), its event and the
// KeyValue it displaced.
//
// Writers (Apply, the sweep, Reset) change the index one at a time under
// Store.writeMu. Readers never lock it:
//
//   - a version is appended to a key's history in place: the writer
//     writes the slot past the published ones, then publishes the new
//     count (versions.n), so a reader sees whole versions only, and a
//     reader at R ignores every version above R anyway;
//   - a new key is inserted, and a deleted one removed, in the writer's
//     own tree; the store then publishes a Clone of it (O(1)), which a
//     View keeps. The writer's next change copies the nodes it touches
//     rather than change a published tree;
//   - dropping history (the sweep) never changes a keyHistory a reader may
//     hold: a key whose old versions are no longer needed gets a new
//     keyHistory with the rest of its versions, in a new array, put in
//     place in the writer's tree. A View taken before keeps the old
//     tree, whose histories still hold every version it can read: views
//     stay readable however long they are held, as with trees.

// version is one state of a key: the KeyValue a put stored at rev, or nil
// for a delete at rev.
type version struct {
	rev int64
	kv  *mvccpb.KeyValue
}

// versions is a key's versions in revision order (a Txn that touches a
// key twice leaves two at one revision; the later one wins). v[:n] is
// published and never changes; the writer appends by filling v[n] and
// then storing n+1, or, when v is full, by publishing a new versions.
type versions struct {
	n atomic.Int32
	v []version // len(v) is the capacity
}

// keyHistory is one key of the index and its versions.
type keyHistory struct {
	// key is immutable. It is the key of one of the KeyValues of its
	// versions (whose buffer holds it), so it costs no memory of its own.
	key  []byte
	list atomic.Pointer[versions]
}

func keyHistoryLess(a, b *keyHistory) bool { return bytes.Compare(a.key, b.key) < 0 }

// newKeyHistory returns the history of a key whose versions are vs (at
// least one, of which at least one is a put), in an array of cap slots.
func newKeyHistory(vs []version, capacity int) *keyHistory {
	h := &keyHistory{}
	for _, v := range vs {
		if v.kv != nil {
			h.key = v.kv.Key
			break
		}
	}
	l := &versions{v: make([]version, max(capacity, len(vs)))}
	copy(l.v, vs)
	l.n.Store(int32(len(vs)))
	h.list.Store(l)
	return h
}

// published returns the key's published versions.
func (h *keyHistory) published() []version {
	l := h.list.Load()
	return l.v[:l.n.Load()]
}

// at returns the key's KeyValue at rev: its newest version at or below
// rev, nil if that is a delete or the key had no version yet.
func (h *keyHistory) at(rev int64) *mvccpb.KeyValue {
	vs := h.published()
	if last := vs[len(vs)-1]; last.rev <= rev {
		return last.kv // the common case: the key's newest version
	}
	i := sort.Search(len(vs), func(i int) bool { return vs[i].rev > rev })
	if i == 0 {
		return nil
	}
	return vs[i-1].kv
}

// latest returns the key's newest KeyValue, nil if it is deleted.
func (h *keyHistory) latest() *mvccpb.KeyValue {
	vs := h.published()
	return vs[len(vs)-1].kv
}

// add appends a version; only the writer calls it. It returns the bytes
// the key's version array grew by (memory.go).
func (h *keyHistory) add(v version) int64 {
	l := h.list.Load()
	n := int(l.n.Load())
	if n < len(l.v) {
		l.v[n] = v
		l.n.Store(int32(n + 1))
		return 0
	}
	grown := &versions{v: make([]version, 2*len(l.v))}
	copy(grown.v, l.v)
	grown.v[n] = v
	grown.n.Store(int32(n + 1))
	h.list.Store(grown)
	return versionArrayBytes(len(grown.v)) - versionArrayBytes(len(l.v))
}

// versionCap is the capacity a swept history of n versions gets: room
// to grow by doubling, as append would have left it.
func versionCap(n int) int { return pow2(n) }
