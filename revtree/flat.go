package revtree

import (
	"bytes"
	"sort"
	"sync"

	"github.com/google/btree"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Bounds of the flattened-range cache. A kube-apiserver LIST reads one range
// at one revision in pages; a handful of LISTs run at once.
const (
	maxFlatRanges = 8
	maxFlatItems  = 1 << 21 // pointers held by all entries: 16 MiB
)

// flatRanges caches key-ordered slices of ranges of snapshots. The pages of
// a paginated LIST (one range end, one revision, each page starting after
// the previous one) then cost a binary search for their count and a copy of
// limit pointers for their keys, instead of a walk of the rest of the range
// per page, which makes a LIST quadratic in etcd.
//
// Entries are immutable once cached: a snapshot never changes, and neither
// do its KeyValues.
type flatRanges struct {
	mu      sync.Mutex
	entries []*flatRange // least recently used first
	items   int
}

type flatRange struct {
	tree  *btree.BTreeG[*mvccpb.KeyValue] // the snapshot
	start []byte                          // first key the slice may hold
	end   []byte                          // exclusive; empty means unbounded
	kvs   []*mvccpb.KeyValue
}

// get returns the cached slice of [start, end) of tree that covers key on,
// if any.
func (f *flatRanges) get(tree *btree.BTreeG[*mvccpb.KeyValue], key, end []byte) *flatRange {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, e := range f.entries {
		if e.tree == tree && bytes.Equal(e.end, end) && bytes.Compare(e.start, key) <= 0 {
			f.entries = append(append(f.entries[:i:i], f.entries[i+1:]...), e)
			return e
		}
	}
	return nil
}

func (f *flatRanges) put(e *flatRange) {
	if len(e.kvs) > maxFlatItems {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.entries = append(f.entries, e)
	f.items += len(e.kvs)
	for len(f.entries) > maxFlatRanges || f.items > maxFlatItems {
		f.items -= len(f.entries[0].kvs)
		f.entries[0] = nil
		f.entries = f.entries[1:]
	}
}

// page returns up to limit key-values of the entry from key on, and how
// many it holds from key on.
func (e *flatRange) page(key []byte, limit int64) ([]*mvccpb.KeyValue, int64) {
	i := sort.Search(len(e.kvs), func(i int) bool { return bytes.Compare(e.kvs[i].Key, key) >= 0 })
	rest := e.kvs[i:]
	n := min(int64(len(rest)), limit)
	// A copy: the caller may truncate or rewrite its results.
	out := make([]*mvccpb.KeyValue, n)
	copy(out, rest)
	return out, int64(len(rest))
}
