package revtree

import (
	"bytes"
	"slices"
	"sort"
	"sync"
	"unsafe"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/allocsize"
	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// Bounds of the flattened-range cache. A kube-apiserver LIST reads one range
// at one revision in pages; a handful of LISTs run at once. With a history
// budget, the cache counts in it and takes at most half of it. A read
// without a limit is cached when it has at least defaultMinFlatKVs
// key-values: smaller ones cost less to walk again than they would evict.
const (
	maxFlatRanges     = 8
	maxFlatBytes      = 16 << 20 // 2 Mi pointers
	defaultMinFlatKVs = 512
)

// flatRanges caches key-ordered slices of ranges of snapshots. The pages of
// a paginated LIST (one range end, one revision, each page starting after
// the previous one) then cost a binary search for their count and a copy of
// limit pointers for their keys, instead of a walk of the rest of the range
// per page, which makes a LIST quadratic in etcd. A large read without a
// limit, again at the same revision, costs a copy of the slice instead of
// a walk of the tree (a key comparison per key-value for the range's end),
// and its count, for the budget's estimate, a binary search.
//
// Entries are immutable once cached: a snapshot never changes, and neither
// do its versions. An entry never outlives its snapshot in the store: it
// would keep a tree alive that history no longer counts. An entry costs
// its slice of versions (what they hold is the store's): flatRange.bytes,
// which the history budget counts.
//
// Which snapshots are still the store's: those of the store's current
// generation (a Reset or Unload starts a new one) from revision floor on,
// since compaction and the budget drop the oldest first.
type flatRanges struct {
	// onGrow is called, without mu, after an entry was added; set once by
	// New (the store enforces its budget).
	onGrow func()
	// minKVs is the fewest key-values of a read without a limit that is
	// cached; set once by New.
	minKVs int

	mu sync.Mutex
	// Guarded by mu.
	entries []*flatRange // least recently used first
	bytes   int64        // of the entries
	limit   int64        // most bytes the entries may hold
	gen     uint64       // the store's generation
	floor   int64        // the store's oldest snapshot in it
}

type flatRange struct {
	snap  *snapshot // whose tree the slice flattens
	gen   uint64    // the store's generation when the snapshot was read
	start []byte    // first key the slice may hold
	end   []byte    // exclusive; empty means unbounded
	vs    []version // each key's, all puts
	bytes int64     // estimated memory of the entry
	// whole marks an entry made by a read without a limit: evicted
	// before any made for pages, so that unlimited reads at ever new
	// revisions (LISTs at the head while etcd is written) never push out
	// the pages of a LIST in progress, which would then each walk the
	// rest of the range again.
	whole bool
}

func newFlatRange(snap *snapshot, gen uint64, start, end []byte, vs []version, whole bool) *flatRange {
	return &flatRange{snap: snap, gen: gen, start: start, end: end, vs: vs, whole: whole,
		bytes: allocsize.Class(storedkv.VersionSize*int64(cap(vs))) + allocsize.Class(int64(unsafe.Sizeof(flatRange{}))) + allocsize.Bytes(len(start)) + allocsize.Bytes(len(end))}
}

// get returns the cached slice of [start, end) of snap that covers key on,
// if any.
func (f *flatRanges) get(snap *snapshot, key, end []byte) *flatRange {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, e := range f.entries {
		if e.snap == snap && bytes.Equal(e.end, end) && bytes.Compare(e.start, key) <= 0 {
			f.entries = append(append(f.entries[:i:i], f.entries[i+1:]...), e)
			return e
		}
	}
	return nil
}

// put caches e, unless its snapshot was dropped meanwhile, and evicts the
// least recently used entries past the bounds.
func (f *flatRanges) put(e *flatRange) {
	f.mu.Lock()
	if e.bytes > f.limit || f.droppedLocked(e) {
		f.mu.Unlock()
		return
	}
	f.entries = append(f.entries, e)
	f.bytes += e.bytes
	f.evictLocked()
	f.mu.Unlock()
	if f.onGrow != nil {
		f.onGrow()
	}
}

// evictLocked drops entries while the cache is past its bounds: the least
// recently used of unlimited reads first, then of pages.
func (f *flatRanges) evictLocked() {
	for len(f.entries) > maxFlatRanges || f.bytes > f.limit {
		i := slices.IndexFunc(f.entries, func(e *flatRange) bool { return e.whole })
		if i < 0 {
			i = 0
		}
		f.bytes -= f.entries[i].bytes
		f.entries = slices.Delete(f.entries, i, i+1)
	}
}

// setLimit bounds the entries' bytes.
func (f *flatRanges) setLimit(limit int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.limit = limit
	f.evictLocked()
}

// droppedLocked reports whether e's snapshot is no longer the store's.
func (f *flatRanges) droppedLocked(e *flatRange) bool {
	return e.gen != f.gen || e.snap.rev < f.floor
}

// dropBelow records that the store's snapshots are those of generation
// gen from revision floor on, and drops the entries of the others.
func (f *flatRanges) dropBelow(gen uint64, floor int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gen, f.floor = gen, floor
	kept := f.entries[:0]
	for _, e := range f.entries {
		if f.droppedLocked(e) {
			f.bytes -= e.bytes
			continue
		}
		kept = append(kept, e)
	}
	clear(f.entries[len(kept):])
	f.entries = kept
}

// size returns the entries' bytes.
func (f *flatRanges) size() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.bytes
}

// page returns up to limit versions of the entry from key on, and how
// many it holds from key on.
func (e *flatRange) page(key []byte, limit int64) ([]version, int64) {
	rest := e.vs[e.search(key):]
	n := min(int64(len(rest)), limit)
	return rest[:n:n], int64(len(rest)) // readers never change versions
}

// count returns how many versions the entry holds from key on.
func (e *flatRange) count(key []byte) int64 { return int64(len(e.vs) - e.search(key)) }

// search returns the index of the entry's first version from key on.
func (e *flatRange) search(key []byte) int {
	return sort.Search(len(e.vs), func(i int) bool { return bytes.Compare(e.vs[i].Key(), key) >= 0 })
}
