package storedkv

import (
	"slices"
	"sort"
	"unsafe"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/allocsize"
)

// Packed encodings.
//
// A load's bare encodings are packed one after the other into slabs of
// slabBytes, rather than allocated one by one: the allocator rounds each
// allocation up to its size class, 7% for a 1 KiB value (1,076 bytes take
// 1,152), and a slab, a large object, is not rounded.
//
// A slab lives while anything points into it. So that the encodings the
// index no longer holds (a rewritten or deleted key's, once the sweep
// prunes its old version) do not keep the rest of their slab alive for
// ever, the store registers each slab (SlabSet) and counts the bytes of it
// the writer's index holds (invariant 5): the sweep releases what it
// prunes, and once a slab holds less than half of its bytes, the sweep
// moves those that are left into allocations of their own (revtree's
// evacuate, with Slab.Each and Version.Unpacked) and forgets the slab,
// which is garbage once no view, event or read still points into it. Until
// then its bytes that the index does not hold count in the store's
// estimate (SlabSet.Dead). A KeyValue an event or a read makes of a packed
// encoding points into its slab too, as does a Range response sent as
// pieces of the stored bytes; events are what history counts, reads,
// responses and views are short-lived.

const (
	// slabBytes is the size of a slab: a large object (over 32 KiB),
	// which the allocator does not round to a size class. A load's first
	// slabs are smaller (Packer.newSlab), so that a small keyspace does
	// not take 64 KiB.
	slabBytes    = 64 << 10
	minSlabBytes = 1 << 10
	// MaxPackedBytes is the largest bare encoding packed: larger ones
	// waste little to their size class, and would leave slabs' tails
	// empty.
	MaxPackedBytes = 4 << 10
)

// packedBytes is the heap a bare encoding of an encoding of n bytes takes
// in a slab.
func packedBytes(n int) int64 { return int64(bareLen(n)) }

// Slab is a buffer of packed encodings. Its last byte is never written
// (invariant 4).
type Slab struct {
	buf  []byte // len: the bytes written; cap: the slab
	live int64  // bytes of its encodings the writer's index holds
}

// base is the address of the slab's first byte, for finding the slab of
// an encoding: the store holds the slab, so the address stays its own.
func (sl *Slab) base() uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(sl.buf))) }

// Live returns the bytes of the slab's encodings the writer's index holds.
func (sl *Slab) Live() int64 { return sl.live }

// Cap returns the slab's size.
func (sl *Slab) Cap() int { return cap(sl.buf) }

// Contains reports whether b starts in the slab, and where the slab ends
// if so.
func (sl *Slab) Contains(b []byte) (end uintptr, ok bool) {
	a := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	end = sl.base() + uintptr(cap(sl.buf))
	return end, a >= sl.base() && a < end
}

// Each calls fn with the packed version, at revision 0, and the key of
// every encoding in the slab, in the order they were packed. A version of
// the index holds one of them if Version.Same reports so.
func (sl *Slab) Each(fn func(at Version, key []byte)) {
	for off := 0; off < len(sl.buf); {
		p := bareAt(sl.buf, off)
		enc := bareEncoding(p)
		off = int(uintptr(unsafe.Pointer(unsafe.SliceData(enc)))-sl.base()) + len(enc)
		fn(packedVersion(0, p), bareKey(p))
	}
}

// Same reports whether v is packed and holds the encoding at does.
func (v Version) Same(at Version) bool { return v.IsPacked() && v.p == at.p }

// Unpacked returns a packed version with its encoding copied into an
// allocation of its own (invariant 3: a copy is what moves).
func (v Version) Unpacked() Version {
	enc := bareEncoding(v.p)
	return bareVersion(v.Rev(), bareAt(appendBareEncoding(make([]byte, 0, bareLen(len(enc))), enc), 0))
}

// Packer packs the bare encodings of a load into slabs. The zero Packer
// is ready to use.
type Packer struct {
	slabs  []*Slab // the last one is being filled
	packed int     // bytes packed
	bytes  int64   // heap of the slabs and their records
}

// Pack returns the packed version of kv, at kv.ModRevision, or false if kv
// is not packed: one with no key or unknown fields, or past
// MaxPackedBytes.
func (k *Packer) Pack(kv *mvccpb.KeyValue) (Version, bool) {
	size, ok := bareSize(kv)
	if !ok {
		return Version{}, false
	}
	sl, off := k.room(size)
	if sl == nil {
		return Version{}, false
	}
	// Within the slab's capacity: the buffer is never reallocated.
	sl.buf = appendBare(sl.buf, kv, size)
	return packedVersion(kv.ModRevision, bareAt(sl.buf, off)), true
}

// PackEncoding returns the packed version of the key-value encoded in enc
// (Append's), at its ModRevision, or false if enc is not as New makes it
// or is over MaxPackedBytes.
func (k *Packer) PackEncoding(enc []byte) (Version, bool) {
	var e Entry
	if !parseCanonical(enc, &e) {
		return Version{}, false
	}
	sl, off := k.room(len(enc))
	if sl == nil {
		return Version{}, false
	}
	sl.buf = appendBareEncoding(sl.buf, enc)
	return packedVersion(e.kv.ModRevision, bareAt(sl.buf, off)), true
}

// room returns the slab and the offset in it where a bare encoding of an
// encoding of size bytes goes, counting it in the slab's live bytes; nil
// if it is not packed.
func (k *Packer) room(size int) (*Slab, int) {
	n := bareLen(size)
	if n > MaxPackedBytes {
		return nil, 0
	}
	var sl *Slab
	if len(k.slabs) > 0 {
		sl = k.slabs[len(k.slabs)-1]
	}
	if sl == nil || cap(sl.buf)-len(sl.buf) <= n { // not the last byte
		sl = k.newSlab(n + 1)
	}
	sl.live += int64(n)
	k.packed += n
	return sl, len(sl.buf)
}

// newSlab starts a slab for at least n bytes: minSlabBytes more than the
// load packed so far, at most slabBytes, so that slabs double until they
// are large.
func (k *Packer) newSlab(n int) *Slab {
	size := max(min(minSlabBytes+k.packed, slabBytes), n)
	sl := &Slab{buf: make([]byte, 0, size)}
	k.slabs = append(k.slabs, sl)
	k.bytes += slabAllocBytes(size) + slabStructBytes
	return sl
}

// Slabs returns the slabs packed into.
func (k *Packer) Slabs() []*Slab { return k.slabs }

// Bytes returns the heap the slabs take, and their records in a SlabSet.
func (k *Packer) Bytes() int64 { return k.bytes }

// slabAllocBytes is the heap a slab of capacity n takes.
func slabAllocBytes(n int) int64 { return allocsize.Class(int64(n)) }

// slabStructBytes is what the store's record of a slab costs: the struct
// and its slot in SlabSet.slabs.
var slabStructBytes = allocsize.Class(int64(unsafe.Sizeof(Slab{}))) + 8

// SlabSet is the store's slabs, ordered by address, and the bytes of them
// the writer's index holds (invariant 5). The zero SlabSet has none.
type SlabSet struct {
	slabs []*Slab
	size  int64 // of the slabs
	live  int64 // of their encodings the writer's index holds
}

// NewSlabSet returns the set of slabs.
func NewSlabSet(slabs []*Slab) SlabSet {
	set := SlabSet{slabs: slices.Clone(slabs)}
	slices.SortFunc(set.slabs, func(a, b *Slab) int {
		switch {
		case a.base() < b.base():
			return -1
		case a.base() > b.base():
			return 1
		}
		return 0
	})
	for _, sl := range set.slabs {
		set.size += slabAllocBytes(cap(sl.buf))
		set.live += sl.live
	}
	return set
}

// Slabs returns the slabs, by address.
func (set *SlabSet) Slabs() []*Slab { return set.slabs }

// Live returns the bytes of the slabs' encodings the writer's index
// holds.
func (set *SlabSet) Live() int64 { return set.live }

// Dead is what the slabs take beyond what the index holds of them: their
// records, and the bytes only evacuation frees.
func (set *SlabSet) Dead() int64 {
	return set.size - set.live + int64(len(set.slabs))*slabStructBytes
}

// Find returns the slab b starts in, nil if none does.
func (set *SlabSet) Find(b []byte) *Slab {
	return set.find(unsafe.Pointer(unsafe.SliceData(b)))
}

// find returns the slab holding the encoding at p, nil if none does.
func (set *SlabSet) find(p unsafe.Pointer) *Slab {
	a := uintptr(p)
	i := sort.Search(len(set.slabs), func(i int) bool { return set.slabs[i].base() > a }) - 1
	if i < 0 {
		return nil
	}
	if sl := set.slabs[i]; a < sl.base()+uintptr(cap(sl.buf)) {
		return sl
	}
	return nil
}

// Release counts out v, a packed version the writer's index no longer
// holds, and returns its slab if that now holds less than half of its
// bytes: the sweep evacuates it.
func (set *SlabSet) Release(v Version) *Slab {
	sl := set.find(v.p)
	if sl == nil {
		return nil // a slab forgotten already
	}
	n := packedBytes(len(bareEncoding(v.p)))
	sl.live -= n
	set.live -= n
	if 2*sl.live < int64(cap(sl.buf)) {
		return sl
	}
	return nil
}

// Forget drops a slab the index no longer holds anything of, or whose
// encodings it holds were all moved (Version.Unpacked).
func (set *SlabSet) Forget(sl *Slab) {
	i := slices.Index(set.slabs, sl)
	if i < 0 {
		return
	}
	set.slabs = slices.Delete(set.slabs, i, i+1)
	set.size -= slabAllocBytes(cap(sl.buf))
	set.live -= sl.live
}
