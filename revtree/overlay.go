package revtree

import (
	"bytes"
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Reads between checkpoints.
//
// A view of a snapshot that has no tree of its own reads its checkpoint's
// tree overlaid with the events of the snapshots after the checkpoint up
// to its own: a key's newest event in that window is its state at the
// view's revision (a put's KeyValue, or absent after a delete), any other
// key is as in the checkpoint. The window holds fewer revisions than the
// checkpoint interval and fewer events than maxOverlayEvents, so the
// overlay is a small sorted set (overlayRange), applied so that Range's
// reads pay no key comparison per key-value on top of the tree's own:
//
//   - Get looks for the key's newest event, then in the tree;
//   - scan (a Range without a limit, and the flattened ranges of pages)
//     collects the tree's key-values, then puts each overlaid key's
//     state in place by binary search (mergeOverlay in range.go);
//   - count counts the tree's, then adds or takes one per overlaid key
//     that the window created or deleted;
//   - Ascend (a page without the flattened-range cache, and callers
//     that iterate) walks the tree in stretches between overlaid keys,
//     each bounded by the next: a comparison per key-value.
//
// Every result (count, limit, filters, sort orders, keys-only) is then
// computed from those exactly as from a tree.

// overlayEntry is a key's state at a view's revision, from its newest
// event in the view's window: kv, or nil if that event deleted it.
type overlayEntry struct {
	key []byte
	kv  *mvccpb.KeyValue
}

// Get returns the key-value of key in the view, if it exists.
func (v View) Get(key []byte) (*mvccpb.KeyValue, bool) {
	if v.overlay {
		for sn := v.snap; sn.prev != nil; sn = sn.prev {
			for i := len(sn.events) - 1; i >= 0; i-- {
				if ev := sn.events[i]; bytes.Equal(ev.Kv.Key, key) {
					if ev.Type != mvccpb.PUT {
						return nil, false
					}
					return ev.Kv, true
				}
			}
		}
	}
	return v.kvs.Get(&mvccpb.KeyValue{Key: key})
}

// Ascend calls fn for every key-value in [key, end) in key order until fn
// returns false. An empty end means no upper bound.
func (v View) Ascend(key, end []byte, fn func(*mvccpb.KeyValue) bool) {
	if len(end) > 0 && bytes.Compare(key, end) >= 0 {
		return
	}
	var ov []overlayEntry
	if v.overlay {
		ov = v.overlayRange(key, end)
	}
	if len(ov) == 0 {
		v.ascendTree(key, end, fn)
		return
	}
	// The tree's key-values between two overlaid keys (a stretch), then
	// the second one's state. Each stretch starts at the previous
	// overlaid key, whose key-value in the tree it skips. Overlaid keys
	// are never empty (etcd has no empty key), so none reads as an
	// unbounded end.
	more := true
	var skip []byte
	each := func(kv *mvccpb.KeyValue) bool {
		if skip != nil {
			k := skip
			skip = nil
			if bytes.Equal(kv.Key, k) {
				return true
			}
		}
		more = fn(kv)
		return more
	}
	// Two pivots for all the stretches: a pivot escapes to the heap.
	lo, hi := &mvccpb.KeyValue{Key: key}, &mvccpb.KeyValue{}
	for _, e := range ov {
		hi.Key = e.key
		v.kvs.AscendRange(lo, hi, each)
		if !more || e.kv != nil && !fn(e.kv) {
			return
		}
		lo.Key, skip = e.key, e.key
	}
	if len(end) == 0 {
		v.kvs.AscendGreaterOrEqual(lo, each)
		return
	}
	hi.Key = end
	v.kvs.AscendRange(lo, hi, each)
}

// ascendTree is Ascend over the view's tree alone; key < end if end is
// not empty.
func (v View) ascendTree(key, end []byte, fn func(*mvccpb.KeyValue) bool) {
	pivot := &mvccpb.KeyValue{Key: key}
	if len(end) == 0 {
		v.kvs.AscendGreaterOrEqual(pivot, fn)
		return
	}
	v.kvs.AscendRange(pivot, &mvccpb.KeyValue{Key: end}, fn)
}

// overlayRange returns the overlaid keys of the view in [key, end), in key
// order, each with its state at the view's revision.
func (v View) overlayRange(key, end []byte) []overlayEntry {
	var out []overlayEntry
	// Newest first, so that a stable sort leaves each key's newest
	// event first among its own.
	for sn := v.snap; sn.prev != nil; sn = sn.prev {
		for i := len(sn.events) - 1; i >= 0; i-- {
			ev := sn.events[i]
			k := ev.Kv.Key
			if bytes.Compare(k, key) < 0 || len(end) > 0 && bytes.Compare(k, end) >= 0 {
				continue
			}
			e := overlayEntry{key: k}
			if ev.Type == mvccpb.PUT {
				e.kv = ev.Kv
			}
			out = append(out, e)
		}
	}
	slices.SortStableFunc(out, func(a, b overlayEntry) int { return bytes.Compare(a.key, b.key) })
	return slices.CompactFunc(out, func(a, b overlayEntry) bool { return bytes.Equal(a.key, b.key) })
}
