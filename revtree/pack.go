package revtree

import (
	"slices"
	"sort"
	"unsafe"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Packed encodings.
//
// A load's bare encodings (entry.go) are packed one after the other into
// slabs of slabBytes, rather than allocated one by one: the allocator
// rounds each allocation up to its size class, 7% for a 1 KiB value
// (1,076 bytes take 1,152), and a slab, a large object, is not rounded.
//
// A slab lives while anything points into it. So that the encodings the
// index no longer holds (a rewritten or deleted key's, once the sweep
// prunes its old version) do not keep the rest of their slab alive for
// ever, the store registers each slab (slabSet) and counts the bytes of
// it the writer's index holds: the sweep releases what it prunes, and
// once a slab holds less than half of its bytes, the sweep moves those
// that are left into allocations of their own (evacuate) and forgets the
// slab, which is garbage once no view, event or read still points into
// it. Until then its bytes that the index does not hold count in
// ApproxBytes (slabSet.dead). A KeyValue an event or a read makes of a
// packed encoding points into its slab too, as does a Range response sent
// as pieces of the stored bytes (Result.AppendPieces); events are what
// history counts, reads, responses and views are short-lived.

const (
	// slabBytes is the size of a slab: a large object (over 32 KiB),
	// which the allocator does not round to a size class. A load's first
	// slabs are smaller (packer.newSlab), so that a small keyspace does
	// not take 64 KiB.
	slabBytes    = 64 << 10
	minSlabBytes = 1 << 10
	// maxPackedBytes is the largest encoding packed: larger ones waste
	// little to their size class, and would leave slabs' tails empty.
	maxPackedBytes = 4 << 10
)

// packedBytes is the heap a bare encoding of an encoding of n bytes takes
// in a slab.
func packedBytes(n int) int64 { return int64(bareLen(n)) }

// slab is a buffer of packed encodings. Its last byte is never written: a
// bare encoding in it always ends inside it, so that one that starts where
// another ends is in the same slab (Result.AppendPieces sends the two as
// one piece).
type slab struct {
	buf  []byte // len: the bytes written; cap: the slab
	live int64  // bytes of its encodings the writer's index holds
}

// base is the address of the slab's first byte, for finding the slab of
// an encoding: the store holds the slab, so the address stays its own.
func (sl *slab) base() uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(sl.buf))) }

// packer packs the bare encodings of a load into slabs.
type packer struct {
	slabs  []*slab // the last one is being filled
	packed int     // bytes packed
}

// pack returns the packed bare encoding of kv, or nil if kv is not
// packed: newBare's cases and encodings over maxPackedBytes.
func (k *packer) pack(kv *mvccpb.KeyValue) unsafe.Pointer {
	size, ok := bareSize(kv)
	if !ok {
		return nil
	}
	sl, off := k.room(size)
	if sl == nil {
		return nil
	}
	// Within the slab's capacity: the buffer is never reallocated.
	sl.buf = appendBare(sl.buf, kv, size)
	return bareAt(sl.buf, off)
}

// packEncoding returns the packed bare encoding of enc, an encoding as
// newBare makes it, or nil if it is over maxPackedBytes.
func (k *packer) packEncoding(enc []byte) unsafe.Pointer {
	sl, off := k.room(len(enc))
	if sl == nil {
		return nil
	}
	sl.buf = appendBareEncoding(sl.buf, enc)
	return bareAt(sl.buf, off)
}

// room returns the slab and the offset in it where a bare encoding of an
// encoding of size bytes goes, counting it in the slab's live bytes; nil
// if it is not packed.
func (k *packer) room(size int) (*slab, int) {
	n := bareLen(size)
	if n > maxPackedBytes {
		return nil, 0
	}
	var sl *slab
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
func (k *packer) newSlab(n int) *slab {
	size := max(min(minSlabBytes+k.packed, slabBytes), n)
	sl := &slab{buf: make([]byte, 0, size)}
	k.slabs = append(k.slabs, sl)
	return sl
}

// slabAllocBytes is the heap a slab of capacity n takes.
func slabAllocBytes(n int) int64 { return sizeClass(int64(n)) }

// slabSet is the store's slabs, ordered by address; guarded by
// Store.writeMu, and its counts by Store.mu too (ApproxBytes reads dead).
type slabSet struct {
	slabs []*slab
	size  int64 // of the slabs
	live  int64 // of their encodings the writer's index holds
}

// slabStructBytes is what the store's record of a slab costs: the struct
// and its slot in slabSet.slabs.
var slabStructBytes = sizeClass(int64(unsafe.Sizeof(slab{}))) + 8

func newSlabSet(slabs []*slab) slabSet {
	set := slabSet{slabs: slices.Clone(slabs)}
	slices.SortFunc(set.slabs, func(a, b *slab) int {
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

// dead is what the slabs take beyond what the index holds of them: their
// records, and the bytes only evacuation frees.
func (set *slabSet) dead() int64 {
	return set.size - set.live + int64(len(set.slabs))*slabStructBytes
}

// find returns the slab holding the encoding at p, nil if none does.
func (set *slabSet) find(p unsafe.Pointer) *slab {
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

// release counts out a packed encoding the writer's index no longer
// holds, and returns its slab if that now holds less than half of its
// bytes: the sweep evacuates it.
func (set *slabSet) release(v version) *slab {
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

// forget drops a slab the index no longer holds anything of.
func (set *slabSet) forget(sl *slab) {
	i := slices.Index(set.slabs, sl)
	if i < 0 {
		return
	}
	set.slabs = slices.Delete(set.slabs, i, i+1)
	set.size -= slabAllocBytes(cap(sl.buf))
	set.live -= sl.live
}

// evacuate moves the encodings of sl that the writer's index holds into
// allocations of their own, giving their keys new histories as the sweep
// does, and forgets sl. It returns what that adds to the live keyspace's
// estimate (the size classes of the copies of live keys' newest
// versions). writeMu is held; the caller publishes the index.
func (s *Store) evacuate(sl *slab) (live int64) {
	search := newSearchKey()
	for off := 0; off < len(sl.buf); {
		p := bareAt(sl.buf, off)
		enc := bareEncoding(p)
		off = int(uintptr(unsafe.Pointer(unsafe.SliceData(enc)))-sl.base()) + len(enc)
		h, ok := s.index.Get(search.set(bareKey(p)))
		if !ok {
			continue
		}
		vs := h.published()
		var moved []version
		for i, v := range vs {
			if !v.isPacked() || v.p != p {
				continue
			}
			if moved == nil {
				moved = slices.Clone(vs)
			}
			moved[i] = bareVersion(v.rev(), copyBare(enc))
			n := packedBytes(len(enc))
			sl.live -= n
			s.slabs.live -= n
			if i == len(vs)-1 {
				live += encodingBytes(len(enc)) - n
			}
		}
		if moved != nil {
			s.index.ReplaceOrInsert(newKeyHistory(moved, h.capacity()))
			s.indexChanged = true
		}
	}
	s.slabs.forget(sl)
	return live
}

// copyBare returns a bare encoding of enc in an allocation of its own.
func copyBare(enc []byte) unsafe.Pointer {
	return bareAt(appendBareEncoding(make([]byte, 0, bareLen(len(enc))), enc), 0)
}
