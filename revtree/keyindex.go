package revtree

import (
	"bytes"
	"sort"
	"sync/atomic"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// The key index: every key's versions, as etcd's keyIndex keeps them.
//
// The store's index is a copy-on-write B-tree of *keyHistory ordered by
// key, holding every key that has a version some retained revision can
// see: the live keys, and the deleted ones until the snapshot of their
// delete is dropped and the sweep comes by (sweep.go). A read at revision R walks the
// index over the requested range and takes, of each key, its newest
// version at or below R (keyHistory.at); a delete's version holds
// nothing, so the key is absent from R on. No tree is copied per
// revision: a revision costs its version (16 bytes), its event and the
// KeyValue it displaced.
//
// A key costs the index 8 bytes (its keyHistory) and its array of
// versions; its key is not stored apart: it is read from the encoding of
// one of its puts (keyHistory.key). Only the live keyspace's size depends
// on that: at a million keys, every byte per key is a MiB.
//
// Writers (Apply, the sweep, Reset) change the index one at a time under
// Store.writeMu. Readers never lock it:
//
//   - a version is appended to a key's history in place: the writer
//     writes the slot past the published ones, then publishes the new
//     count (the array's header), so a reader sees whole versions only,
//     and a reader at R ignores every version above R anyway;
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

// version is one state of a key at a revision: what a put stored (an
// entry, or a bare encoding), or nothing for a delete. storedkv owns its
// layout.
type version = storedkv.Version

// keyHistory is one key of the index: its versions.
type keyHistory struct {
	list atomic.Pointer[storedkv.VersionArray]
}

func keyHistoryLess(a, b *keyHistory) bool { return bytes.Compare(a.key(), b.key()) < 0 }

// newKeyHistory returns the history of a key whose versions are vs (at
// least one, of which at least one is a put), in an array of cap slots.
func newKeyHistory(vs []version, capacity int) *keyHistory {
	capacity = max(capacity, len(vs))
	a := storedkv.NewVersionArray(capacity)
	copy(a.Slots(capacity, len(vs)), vs)
	a.Publish(capacity, len(vs))
	h := &keyHistory{}
	h.list.Store(a)
	return h
}

// searchKey is a keyHistory to search the index with (set): its one
// version is an entry of the key alone. A search's own, not shared.
type searchKey struct {
	h keyHistory
	p storedkv.Probe
}

func newSearchKey() *searchKey {
	k := &searchKey{}
	k.h.list.Store(k.p.Array())
	return k
}

// set returns the keyHistory to search for key with.
func (k *searchKey) set(key []byte) *keyHistory {
	k.p.SetKey(key)
	return &k.h
}

// searchFor returns a keyHistory to search the index for key with.
func searchFor(key []byte) *keyHistory { return newSearchKey().set(key) }

// key returns the key: that of its first put, every history having one.
func (h *keyHistory) key() []byte {
	for _, v := range h.published() {
		if v.IsPut() {
			return v.Key()
		}
	}
	return nil
}

// capacity returns the capacity of the key's version array.
func (h *keyHistory) capacity() int {
	c, _ := h.list.Load().Load()
	return c
}

// published returns the key's published versions.
func (h *keyHistory) published() []version {
	a := h.list.Load()
	capacity, n := a.Load()
	return a.Slots(capacity, n)
}

// at returns the key's version at rev: its newest at or below rev, and
// false if that is a delete or the key had no version yet.
func (h *keyHistory) at(rev int64) (version, bool) {
	vs := h.published()
	if last := vs[len(vs)-1]; last.Rev() <= rev {
		return last, last.IsPut() // the common case: the key's newest version
	}
	i := sort.Search(len(vs), func(i int) bool { return vs[i].Rev() > rev })
	if i == 0 {
		return version{}, false
	}
	return vs[i-1], vs[i-1].IsPut()
}

// latest returns the key's newest version.
func (h *keyHistory) latest() version {
	vs := h.published()
	return vs[len(vs)-1]
}

// add appends a version; only the writer calls it. It returns the bytes
// the key's version array grew by (memory.go).
func (h *keyHistory) add(v version) int64 {
	a := h.list.Load()
	capacity, n := a.Load()
	if n < capacity {
		a.Slots(capacity, n+1)[n] = v
		a.Publish(capacity, n+1)
		return 0
	}
	grown := storedkv.NewVersionArray(2 * capacity)
	s := grown.Slots(2*capacity, n+1)
	copy(s, a.Slots(capacity, n))
	s[n] = v
	grown.Publish(2*capacity, n+1)
	h.list.Store(grown)
	return storedkv.VersionArrayBytes(2*capacity) - storedkv.VersionArrayBytes(capacity)
}

// versionCap is the capacity a swept history of n versions gets: room
// to grow by doubling, as append would have left it.
func versionCap(n int) int { return pow2(n) }
