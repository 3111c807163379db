package storedkv

import (
	"sync/atomic"
	"unsafe"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/allocsize"
)

// Version is one state of a key at a revision: what a put stored (an
// entry, or a bare encoding), or nothing for a delete. The zero Version is
// no version.
type Version struct {
	// tagged is the revision; for a bare encoding, -(rev<<1 | packed),
	// packed being 1 for one in a slab.
	tagged int64
	p      unsafe.Pointer // *Entry, a bare encoding, or nil for a delete
}

// VersionSize is the size of a Version, a slot in an array of them.
const VersionSize = int64(unsafe.Sizeof(Version{}))

// Put returns the version of a put at rev that stored kv, an entry
// (invariant 1).
func Put(rev int64, kv *mvccpb.KeyValue) Version {
	return Version{tagged: rev, p: unsafe.Pointer(entryOf(kv))}
}

// Delete returns the version of a delete at rev.
func Delete(rev int64) Version { return Version{tagged: rev} }

func bareVersion(rev int64, bare unsafe.Pointer) Version {
	return Version{tagged: -(rev << 1), p: bare}
}

func packedVersion(rev int64, bare unsafe.Pointer) Version {
	return Version{tagged: -(rev<<1 | 1), p: bare}
}

// Loaded returns the version the store keeps of kv, a key-value of a
// keyspace it loads, at kv.ModRevision: its bare encoding, or a copy as an
// entry if it has none.
func Loaded(kv *mvccpb.KeyValue) Version {
	if p := newBare(kv); p != nil {
		return bareVersion(kv.ModRevision, p)
	}
	return Put(kv.ModRevision, New(kv))
}

// Stored returns the version of kv, an entry the store keeps as a key's
// only one, at kv.ModRevision: its bare encoding if it has one.
func Stored(kv *mvccpb.KeyValue) Version {
	if p := entryOf(kv).bare(); p != nil {
		return bareVersion(kv.ModRevision, p)
	}
	return Put(kv.ModRevision, kv)
}

// Rev is the version's revision.
func (v Version) Rev() int64 {
	if v.tagged < 0 {
		return -v.tagged >> 1
	}
	return v.tagged
}

// IsPut reports whether the version is a put's.
func (v Version) IsPut() bool { return v.p != nil }

// IsBare reports whether the version holds a bare encoding, not an entry.
func (v Version) IsBare() bool { return v.tagged < 0 }

// IsPacked reports whether the version holds a bare encoding in a slab.
func (v Version) IsPacked() bool { return v.tagged < 0 && -v.tagged&1 == 1 }

// entry returns the version's entry; the version is a put's and not bare.
func (v Version) entry() *Entry { return (*Entry)(v.p) }

// EntryKV returns the KeyValue of the version's entry; the version is a
// put's and not bare.
func (v Version) EntryKV() *mvccpb.KeyValue { return &v.entry().kv }

// KV returns the version's KeyValue, made in m if the version holds a
// bare encoding; the version is a put's.
func (v Version) KV(m *KVMaker) *mvccpb.KeyValue {
	if v.IsBare() {
		return m.make(v.p)
	}
	return &v.entry().kv
}

// KVIn returns the version's KeyValue, made in e, which it overwrites, if
// the version holds a bare encoding; the version is a put's.
func (v Version) KVIn(e *Entry) *mvccpb.KeyValue {
	if !v.IsBare() {
		return &v.entry().kv // the common case inlined: no parse
	}
	return v.bareKVIn(e)
}

func (v Version) bareKVIn(e *Entry) *mvccpb.KeyValue {
	*e = Entry{}
	bareEntry(v.p, e)
	return &e.kv
}

// KVVersion returns the Version field of the version's KeyValue without
// making one; the version is a put's.
func (v Version) KVVersion() int64 {
	if v.IsBare() {
		var e Entry
		bareEntry(v.p, &e)
		return e.kv.Version
	}
	return v.entry().kv.Version
}

// Key returns the key of the version; the version is a put's.
func (v Version) Key() []byte {
	if v.IsBare() {
		return bareKey(v.p)
	}
	return v.entry().kv.Key
}

// Encoding returns the encoding of what a put's version holds, nil for an
// entry without one.
func (v Version) Encoding() []byte {
	if v.IsBare() {
		return bareEncoding(v.p)
	}
	return Encoding(&v.entry().kv)
}

// Bared returns the version as its entry's bare encoding, without a copy,
// and true; false if the version is not an entry or its entry has none.
func (v Version) Bared() (Version, bool) {
	if !v.IsPut() || v.IsBare() {
		return Version{}, false
	}
	if p := v.entry().bare(); p != nil {
		return bareVersion(v.Rev(), p), true
	}
	return Version{}, false
}

// EntryBytes is the heap an entry takes beside its encoding: the size of a
// KeyValue.
var EntryBytes = allocsize.Class(int64(unsafe.Sizeof(Entry{})))

// Bytes estimates the heap of an entry, kv (invariant 1): the entry and its
// encoding after its length, which holds its key and value.
func Bytes(kv *mvccpb.KeyValue) int64 {
	if n := entryOf(kv).encLen; n != 0 {
		return EntryBytes + encodingBytes(int(n))
	}
	return EntryBytes + allocsize.Bytes(len(kv.Key)) + allocsize.Bytes(len(kv.Value))
}

// encodingBytes is the heap a bare encoding of an encoding of n bytes
// takes, allocated alone.
func encodingBytes(n int) int64 { return allocsize.Bytes(bareLen(n)) }

// Bytes estimates what the version holds: its entry or its bare encoding
// (PackedBytes of it in a slab); nothing for a delete.
func (v Version) Bytes() int64 {
	switch {
	case !v.IsPut():
		return 0
	case v.IsPacked():
		return packedBytes(len(bareEncoding(v.p)))
	case v.IsBare():
		return encodingBytes(len(bareEncoding(v.p)))
	}
	return Bytes(&v.entry().kv)
}

// VersionArray is a key's versions in revision order, in one allocation:
// the header, then the slots. The header holds the capacity in its high 32
// bits and the count published in its low 32; the published slots never
// change (invariant 6). The writer appends by filling the slot past the
// count and then storing the header, or, when the array is full, by
// publishing a new array.
//
// An array of one slot (most keys have one version) is a versionArray1,
// its slot right after the header; a larger one is a []Version whose
// first element holds the header (so that the allocation's pointers are
// where a []Version has them).
type VersionArray struct {
	header atomic.Int64
}

type versionArray1 struct {
	VersionArray
	slot Version
}

// NewVersionArray returns an empty array of capacity slots.
func NewVersionArray(capacity int) *VersionArray {
	var a *VersionArray
	if capacity == 1 {
		a = &(&versionArray1{}).VersionArray
	} else {
		vs := make([]Version, capacity+1)
		a = (*VersionArray)(unsafe.Pointer(&vs[0]))
	}
	a.Publish(capacity, 0)
	return a
}

// Load returns the array's capacity and published count.
func (a *VersionArray) Load() (capacity, n int) {
	h := a.header.Load()
	return int(h >> 32), int(uint32(h))
}

// Publish makes the first n slots readable.
func (a *VersionArray) Publish(capacity, n int) { a.header.Store(int64(capacity)<<32 | int64(n)) }

// Slots returns the first n slots of the array, of the capacity given.
func (a *VersionArray) Slots(capacity, n int) []Version {
	offset := unsafe.Sizeof(Version{})
	if capacity == 1 {
		offset = unsafe.Offsetof(versionArray1{}.slot)
	}
	return unsafe.Slice((*Version)(unsafe.Add(unsafe.Pointer(a), offset)), n)
}

// VersionArrayBytes is the heap an array of capacity versions takes: the
// slots after the header.
func VersionArrayBytes(capacity int) int64 {
	if capacity == 1 {
		return allocsize.Class(int64(unsafe.Sizeof(versionArray1{})))
	}
	return allocsize.Class(int64(capacity+1) * VersionSize)
}

// Probe is an array of one version, a put of an entry of a key alone, to
// search an index ordered by Version.Key with. A search's own, not shared.
type Probe struct {
	a versionArray1
	e Entry
}

// Array returns the probe's array, of the key last set.
func (k *Probe) Array() *VersionArray {
	if k.a.slot.p == nil {
		k.a.slot = Version{tagged: 1, p: unsafe.Pointer(&k.e)}
		k.a.Publish(1, 1)
	}
	return &k.a.VersionArray
}

// SetKey makes key the probe's key.
func (k *Probe) SetKey(key []byte) { k.e.kv.Key = key }
