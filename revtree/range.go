package revtree

import (
	"bytes"
	"math"
	"slices"
	"sort"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// RangeOptions selects behaviour that differs between etcd releases.
type RangeOptions struct {
	// KeysOnlyWithoutLease reproduces etcd 3.7's keys-only fast path, which
	// builds results from its index and so leaves lease at 0, unless the
	// sort target is VALUE. etcd 3.6 and older keep the lease.
	KeysOnlyWithoutLease bool
}

// Range executes r as etcd does (server/etcdserver/txn/range.go): the range
// forms, limit pushed into the scan only for key order without revision
// filters, count over the whole range before filtering, etcd's sort and its
// tie order, keys_only and count_only. The response header carries only the
// store revision; the caller fills in the cluster fields.
func (s *Store) Range(r *pb.RangeRequest, opts RangeOptions) (*pb.RangeResponse, error) {
	v, err := s.View(r.Revision)
	if err != nil {
		return nil, err
	}
	return v.Range(r, opts), nil
}

// Range executes r on the view, ignoring r.Revision (see Store.Range).
func (v View) Range(r *pb.RangeRequest, opts RangeOptions) *pb.RangeResponse {
	resp := &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: v.StoreRev}}
	if r.CountOnly {
		resp.Count = v.count(r.Key, r.RangeEnd)
		resp.Kvs = []*mvccpb.KeyValue{}
		return resp
	}
	kvs, count := v.collect(r.Key, r.RangeEnd, rangeLimit(r))
	kvs = filterKVs(kvs, r)
	sortKVs(kvs, r)
	if r.Limit > 0 && len(kvs) > int(r.Limit) {
		kvs = kvs[:r.Limit]
		resp.More = true
	}
	if r.KeysOnly {
		dropLease := opts.KeysOnlyWithoutLease && r.SortTarget != pb.RangeRequest_VALUE
		for i, kv := range kvs {
			// Copy: the stored KeyValue is shared by every snapshot.
			stripped := &mvccpb.KeyValue{
				Key:            kv.Key,
				CreateRevision: kv.CreateRevision,
				ModRevision:    kv.ModRevision,
				Version:        kv.Version,
				Lease:          kv.Lease,
			}
			if dropLease {
				stripped.Lease = 0
			}
			kvs[i] = stripped
		}
	}
	resp.Count = count
	resp.Kvs = kvs
	return resp
}

// rangeLimit is how many results the scan keeps: everything when results
// are re-sorted or filtered afterwards, otherwise one past the limit to
// learn whether there are more.
func rangeLimit(r *pb.RangeRequest) int64 {
	limit := r.Limit
	if !isDefaultOrdering(r.SortTarget, r.SortOrder) || hasRevisionFilters(r) {
		limit = 0
	}
	if limit > 0 && limit < math.MaxInt64 {
		limit++
	}
	return limit
}

// KeyOrdered reports whether r's sort fields leave results in the store's
// own order, ascending by key: no sort order, or ascending by key.
func KeyOrdered(r *pb.RangeRequest) bool { return isDefaultOrdering(r.SortTarget, r.SortOrder) }

// HasRevisionFilters reports whether r filters results by mod or create
// revision.
func HasRevisionFilters(r *pb.RangeRequest) bool { return hasRevisionFilters(r) }

func isDefaultOrdering(target pb.RangeRequest_SortTarget, order pb.RangeRequest_SortOrder) bool {
	return order == pb.RangeRequest_NONE || (target == pb.RangeRequest_KEY && order == pb.RangeRequest_ASCEND)
}

func hasRevisionFilters(r *pb.RangeRequest) bool {
	return r.MinModRevision != 0 || r.MaxModRevision != 0 || r.MinCreateRevision != 0 || r.MaxCreateRevision != 0
}

// isSingleKey reports whether rangeEnd names a single key. etcd's index
// tells nil (an absent range_end: one key) from a present but empty one,
// which like "\x00" means every key from key on.
func isSingleKey(rangeEnd []byte) bool { return rangeEnd == nil }

func upperBound(rangeEnd []byte) []byte {
	if len(rangeEnd) == 1 && rangeEnd[0] == 0 {
		return nil
	}
	return rangeEnd
}

func (v View) count(key, rangeEnd []byte) int64 {
	if isSingleKey(rangeEnd) {
		if _, ok := v.Get(key); ok {
			return 1
		}
		return 0
	}
	end := upperBound(rangeEnd)
	if len(end) > 0 && bytes.Compare(key, end) >= 0 {
		return 0
	}
	if v.flat != nil {
		if e := v.flat.get(v.snap, key, end); e != nil {
			return e.count(key)
		}
	}
	var n int64
	v.ascendTree(key, end, func(*mvccpb.KeyValue) bool {
		n++
		return true
	})
	if v.overlay {
		// Each overlaid key adds one if it is absent from the tree and
		// present at the view's revision, takes one away if the reverse.
		for _, e := range v.overlayRange(key, end) {
			_, had := v.kvs.Get(&mvccpb.KeyValue{Key: e.key})
			switch {
			case e.kv != nil && !had:
				n++
			case e.kv == nil && had:
				n--
			}
		}
	}
	return n
}

// collect returns up to limit key-values of the range (all if limit <= 0)
// and the number of keys in the whole range.
func (v View) collect(key, rangeEnd []byte, limit int64) ([]*mvccpb.KeyValue, int64) {
	if isSingleKey(rangeEnd) {
		if kv, ok := v.Get(key); ok {
			return []*mvccpb.KeyValue{kv}, 1
		}
		return []*mvccpb.KeyValue{}, 0
	}
	end := upperBound(rangeEnd)
	if limit > 0 && v.flat != nil {
		// A page: serve it from a flattened range if a previous page
		// made one, else make one if this range has more pages.
		if e := v.flat.get(v.snap, key, end); e != nil {
			return e.page(key, limit)
		}
		all := v.scan(key, end, 0)
		if int64(len(all)) > limit {
			e := newFlatRange(v.snap, v.gen, key, end, all, false)
			v.flat.put(e)
			return e.page(key, limit)
		}
		return all, int64(len(all))
	}
	if limit <= 0 {
		if v.flat == nil {
			all := v.scan(key, end, 0)
			return all, int64(len(all))
		}
		// A large range read again at the same revision (the LISTs of
		// a quiet keyspace, or at one revision) is a copy of the
		// flattened range the first read made.
		if e := v.flat.get(v.snap, key, end); e != nil {
			return e.page(key, math.MaxInt64)
		}
		all := v.scan(key, end, 0)
		if len(all) >= v.flat.minKVs {
			// The caller may truncate or rewrite its results.
			v.flat.put(newFlatRange(v.snap, v.gen, key, end, slices.Clone(all), true))
		}
		return all, int64(len(all))
	}
	var kvs []*mvccpb.KeyValue
	var n int64
	v.Ascend(key, end, func(kv *mvccpb.KeyValue) bool {
		if limit <= 0 || int64(len(kvs)) < limit {
			kvs = append(kvs, kv)
		}
		n++
		return true
	})
	if kvs == nil {
		kvs = []*mvccpb.KeyValue{}
	}
	return kvs, n
}

// scan returns every key-value of [key, end): the tree's, with the
// overlaid keys' states merged in afterwards by binary search, which costs
// a copy of the slice instead of a key comparison per key-value.
func (v View) scan(key, end []byte, sizeHint int) []*mvccpb.KeyValue {
	kvs := make([]*mvccpb.KeyValue, 0, sizeHint)
	if len(end) > 0 && bytes.Compare(key, end) >= 0 {
		return kvs
	}
	v.ascendTree(key, end, func(kv *mvccpb.KeyValue) bool {
		kvs = append(kvs, kv)
		return true
	})
	if v.overlay {
		if ov := v.overlayRange(key, end); len(ov) > 0 {
			kvs = mergeOverlay(kvs, ov)
		}
	}
	return kvs
}

// mergeOverlay returns the key-ordered base with each overlaid key's
// state in place of the base's: replaced, inserted or removed. When every
// overlaid key replaces one of the base (updates, the common case), base
// is updated in place.
func mergeOverlay(base []*mvccpb.KeyValue, ov []overlayEntry) []*mvccpb.KeyValue {
	pos := make([]int, len(ov)) // where each overlaid key is or would be in base
	replaceOnly := true
	for t, e := range ov {
		from := 0
		if t > 0 {
			from = pos[t-1]
		}
		pos[t] = from + sort.Search(len(base)-from, func(k int) bool { return bytes.Compare(base[from+k].Key, e.key) >= 0 })
		if found := pos[t] < len(base) && bytes.Equal(base[pos[t]].Key, e.key); !found || e.kv == nil {
			replaceOnly = false
		}
	}
	if replaceOnly {
		for t, e := range ov {
			base[pos[t]] = e.kv
		}
		return base
	}
	out := make([]*mvccpb.KeyValue, 0, len(base)+len(ov))
	i := 0
	for t, e := range ov {
		out = append(out, base[i:pos[t]]...)
		i = pos[t]
		if i < len(base) && bytes.Equal(base[i].Key, e.key) {
			i++
		}
		if e.kv != nil {
			out = append(out, e.kv)
		}
	}
	return append(out, base[i:]...)
}

func filterKVs(kvs []*mvccpb.KeyValue, r *pb.RangeRequest) []*mvccpb.KeyValue {
	if !hasRevisionFilters(r) {
		return kvs
	}
	out := kvs[:0]
	for _, kv := range kvs {
		switch {
		case r.MaxModRevision != 0 && kv.ModRevision > r.MaxModRevision:
		case r.MinModRevision != 0 && kv.ModRevision < r.MinModRevision:
		case r.MaxCreateRevision != 0 && kv.CreateRevision > r.MaxCreateRevision:
		case r.MinCreateRevision != 0 && kv.CreateRevision < r.MinCreateRevision:
		default:
			out = append(out, kv)
		}
	}
	return out
}

// sortKVs sorts as etcd does: sort.Sort (not stable) over the key-ordered
// results with etcd's comparisons, so that ties come out in etcd's order.
func sortKVs(kvs []*mvccpb.KeyValue, r *pb.RangeRequest) {
	order := r.SortOrder
	if r.SortTarget != pb.RangeRequest_KEY && order == pb.RangeRequest_NONE {
		order = pb.RangeRequest_ASCEND
	}
	if isDefaultOrdering(r.SortTarget, order) {
		return
	}
	var sorter sort.Interface
	switch r.SortTarget {
	case pb.RangeRequest_KEY:
		sorter = kvSortByKey{kvSort(kvs)}
	case pb.RangeRequest_VERSION:
		sorter = kvSortByVersion{kvSort(kvs)}
	case pb.RangeRequest_CREATE:
		sorter = kvSortByCreate{kvSort(kvs)}
	case pb.RangeRequest_MOD:
		sorter = kvSortByMod{kvSort(kvs)}
	case pb.RangeRequest_VALUE:
		sorter = kvSortByValue{kvSort(kvs)}
	default:
		return // rejected before reaching the store, as etcd's checkRangeRequest does
	}
	switch order {
	case pb.RangeRequest_ASCEND:
		sort.Sort(sorter)
	case pb.RangeRequest_DESCEND:
		sort.Sort(sort.Reverse(sorter))
	}
}

type kvSort []*mvccpb.KeyValue

func (s kvSort) Len() int      { return len(s) }
func (s kvSort) Swap(i, j int) { s[i], s[j] = s[j], s[i] }

type kvSortByKey struct{ kvSort }

func (s kvSortByKey) Less(i, j int) bool { return bytes.Compare(s.kvSort[i].Key, s.kvSort[j].Key) < 0 }

type kvSortByVersion struct{ kvSort }

func (s kvSortByVersion) Less(i, j int) bool { return (s.kvSort[i].Version - s.kvSort[j].Version) < 0 }

type kvSortByCreate struct{ kvSort }

func (s kvSortByCreate) Less(i, j int) bool {
	return (s.kvSort[i].CreateRevision - s.kvSort[j].CreateRevision) < 0
}

type kvSortByMod struct{ kvSort }

func (s kvSortByMod) Less(i, j int) bool {
	return (s.kvSort[i].ModRevision - s.kvSort[j].ModRevision) < 0
}

type kvSortByValue struct{ kvSort }

func (s kvSortByValue) Less(i, j int) bool {
	return bytes.Compare(s.kvSort[i].Value, s.kvSort[j].Value) < 0
}
