package revtree

import (
	"bytes"
	"sort"
	"sync/atomic"
	"unsafe"

	"go.etcd.io/etcd/api/v3/mvccpb"
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
// entry, or a bare encoding: entry.go), or nothing for a delete.
type version struct {
	// tagged is the revision; for a bare encoding, -(rev<<1 | packed),
	// packed being 1 for one in a slab (pack.go).
	tagged int64
	p      unsafe.Pointer // *entry, a bare encoding, or nil for a delete
}

func putVersion(rev int64, kv *mvccpb.KeyValue) version {
	return version{tagged: rev, p: unsafe.Pointer(entryOf(kv))}
}

func bareVersion(rev int64, bare unsafe.Pointer) version {
	return version{tagged: -(rev << 1), p: bare}
}

func packedVersion(rev int64, bare unsafe.Pointer) version {
	return version{tagged: -(rev<<1 | 1), p: bare}
}

func deleteVersion(rev int64) version { return version{tagged: rev} }

// rev is the version's revision.
func (v version) rev() int64 {
	if v.tagged < 0 {
		return -v.tagged >> 1
	}
	return v.tagged
}

// isPut reports whether the version is a put's.
func (v version) isPut() bool { return v.p != nil }

// isBare reports whether the version holds a bare encoding, not an entry.
func (v version) isBare() bool { return v.tagged < 0 }

// isPacked reports whether the version holds a bare encoding in a slab.
func (v version) isPacked() bool { return v.tagged < 0 && -v.tagged&1 == 1 }

// entry returns the version's entry; the version is a put's and not bare.
func (v version) entry() *entry { return (*entry)(v.p) }

// kv returns the version's KeyValue, made in m if the version holds a
// bare encoding; the version is a put's.
func (v version) kv(m *kvMaker) *mvccpb.KeyValue {
	if v.isBare() {
		return m.make(v.p)
	}
	return &v.entry().kv
}

// kvVersion returns the Version field of the version's KeyValue without
// making one; the version is a put's.
func (v version) kvVersion() int64 {
	if v.isBare() {
		var e entry
		bareEntry(v.p, &e)
		return e.kv.Version
	}
	return v.entry().kv.Version
}

// key returns the key of the version; the version is a put's.
func (v version) key() []byte {
	if v.isBare() {
		return bareKey(v.p)
	}
	return v.entry().kv.Key
}

// versionArray is a key's versions in revision order (a Txn that touches a
// key twice leaves two at one revision; the later one wins), in one
// allocation: the header, then the slots. The header holds the capacity in
// its high 32 bits and the count published in its low 32; the published
// slots never change. The writer appends by filling the slot past the
// count and then storing the header, or, when the array is full, by
// publishing a new array.
//
// An array of one slot (most keys have one version) is a versionArray1,
// its slot right after the header; a larger one is a []version whose
// first element holds the header (so that the allocation's pointers are
// where a []version has them).
type versionArray struct {
	header atomic.Int64
}

type versionArray1 struct {
	versionArray
	slot version
}

func newVersionArray(capacity int) *versionArray {
	var a *versionArray
	if capacity == 1 {
		a = &(&versionArray1{}).versionArray
	} else {
		vs := make([]version, capacity+1)
		a = (*versionArray)(unsafe.Pointer(&vs[0]))
	}
	a.publish(capacity, 0)
	return a
}

// load returns the array's capacity and published count.
func (a *versionArray) load() (capacity, n int) {
	h := a.header.Load()
	return int(h >> 32), int(uint32(h))
}

// publish makes the first n slots readable.
func (a *versionArray) publish(capacity, n int) { a.header.Store(int64(capacity)<<32 | int64(n)) }

// slots returns the first n slots of the array, of the capacity given.
func (a *versionArray) slots(capacity, n int) []version {
	offset := unsafe.Sizeof(version{})
	if capacity == 1 {
		offset = unsafe.Offsetof(versionArray1{}.slot)
	}
	return unsafe.Slice((*version)(unsafe.Add(unsafe.Pointer(a), offset)), n)
}

// keyHistory is one key of the index: its versions.
type keyHistory struct {
	list atomic.Pointer[versionArray]
}

func keyHistoryLess(a, b *keyHistory) bool { return bytes.Compare(a.key(), b.key()) < 0 }

// newKeyHistory returns the history of a key whose versions are vs (at
// least one, of which at least one is a put), in an array of cap slots.
func newKeyHistory(vs []version, capacity int) *keyHistory {
	capacity = max(capacity, len(vs))
	a := newVersionArray(capacity)
	copy(a.slots(capacity, len(vs)), vs)
	a.publish(capacity, len(vs))
	h := &keyHistory{}
	h.list.Store(a)
	return h
}

// searchKey is a keyHistory to search the index with (set): its one
// version is an entry of the key alone. A search's own, not shared.
type searchKey struct {
	h keyHistory
	a versionArray1
	e entry
}

func newSearchKey() *searchKey {
	k := &searchKey{}
	k.a.slot = version{tagged: 1, p: unsafe.Pointer(&k.e)}
	k.a.publish(1, 1)
	k.h.list.Store(&k.a.versionArray)
	return k
}

// set returns the keyHistory to search for key with.
func (k *searchKey) set(key []byte) *keyHistory {
	k.e.kv.Key = key
	return &k.h
}

// searchFor returns a keyHistory to search the index for key with.
func searchFor(key []byte) *keyHistory { return newSearchKey().set(key) }

// key returns the key: that of its first put, every history having one.
func (h *keyHistory) key() []byte {
	for _, v := range h.published() {
		if v.isPut() {
			return v.key()
		}
	}
	return nil
}

// capacity returns the capacity of the key's version array.
func (h *keyHistory) capacity() int {
	c, _ := h.list.Load().load()
	return c
}

// published returns the key's published versions.
func (h *keyHistory) published() []version {
	a := h.list.Load()
	capacity, n := a.load()
	return a.slots(capacity, n)
}

// at returns the key's version at rev: its newest at or below rev, and
// false if that is a delete or the key had no version yet.
func (h *keyHistory) at(rev int64) (version, bool) {
	vs := h.published()
	if last := vs[len(vs)-1]; last.rev() <= rev {
		return last, last.isPut() // the common case: the key's newest version
	}
	i := sort.Search(len(vs), func(i int) bool { return vs[i].rev() > rev })
	if i == 0 {
		return version{}, false
	}
	return vs[i-1], vs[i-1].isPut()
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
	capacity, n := a.load()
	if n < capacity {
		a.slots(capacity, n+1)[n] = v
		a.publish(capacity, n+1)
		return 0
	}
	grown := newVersionArray(2 * capacity)
	s := grown.slots(2*capacity, n+1)
	copy(s, a.slots(capacity, n))
	s[n] = v
	grown.publish(2*capacity, n+1)
	h.list.Store(grown)
	return versionArrayBytes(2*capacity) - versionArrayBytes(capacity)
}

// versionCap is the capacity a swept history of n versions gets: room
// to grow by doubling, as append would have left it.
func versionCap(n int) int { return pow2(n) }
