package revtree

import (
	"bytes"
	"math"
	"sort"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
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
	return v.Result(r, opts).Response()
}

// Result executes r on the view, as Range does, and returns its answer
// kept as the store's key-values: a response in key order, without
// revision filters or keys_only (most are: every LIST) is sized and
// encoded straight from the stored encodings, without the KeyValues that
// Range makes of them.
func (v View) Result(r *pb.RangeRequest, opts RangeOptions) *Result {
	x := &Result{Header: &pb.ResponseHeader{Revision: v.StoreRev}, r: r}
	if r.CountOnly {
		x.Count = v.count(r.Key, r.RangeEnd)
		x.kvs, x.made = []*mvccpb.KeyValue{}, true
		return x
	}
	vs, count := v.collect(r.Key, r.RangeEnd, rangeLimit(r))
	x.Count = count
	if !r.KeysOnly && !hasRevisionFilters(r) && isDefaultOrdering(r.SortTarget, sortOrder(r)) {
		if r.Limit > 0 && len(vs) > int(r.Limit) {
			vs = vs[:r.Limit]
			x.More = true
		}
		x.vs = vs
		return x
	}
	kvs := makeKVs(vs)
	kvs = filterKVs(kvs, r)
	sortKVs(kvs, r)
	if r.Limit > 0 && len(kvs) > int(r.Limit) {
		kvs = kvs[:r.Limit]
		x.More = true
	}
	if r.KeysOnly {
		dropLease := opts.KeysOnlyWithoutLease && r.SortTarget != pb.RangeRequest_VALUE
		for i, kv := range kvs {
			// Copy: a stored KeyValue is shared by every snapshot.
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
	x.kvs, x.made = kvs, true
	return x
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
		if _, ok := v.at(key); ok {
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
	v.ascend(key, end, func(version) bool {
		n++
		return true
	})
	return n
}

// collect returns the versions of up to limit keys of the range (all if
// limit <= 0) and the number of keys in the whole range.
func (v View) collect(key, rangeEnd []byte, limit int64) ([]version, int64) {
	if isSingleKey(rangeEnd) {
		if ver, ok := v.at(key); ok {
			return []version{ver}, 1
		}
		return nil, 0
	}
	end := upperBound(rangeEnd)
	if limit > 0 && v.flat != nil {
		// A page: serve it from a flattened range if a previous page
		// made one, else make one if this range has more pages.
		if e := v.flat.get(v.snap, key, end); e != nil {
			return e.page(key, limit)
		}
		all := v.scan(key, end)
		if int64(len(all)) > limit {
			e := newFlatRange(v.snap, v.gen, key, end, all, false)
			v.flat.put(e)
			return e.page(key, limit)
		}
		return all, int64(len(all))
	}
	if limit <= 0 {
		if v.flat == nil {
			all := v.scan(key, end)
			return all, int64(len(all))
		}
		// A large range read again at the same revision (the LISTs of
		// a quiet keyspace, or at one revision) is a copy of the
		// flattened range the first read made.
		if e := v.flat.get(v.snap, key, end); e != nil {
			return e.page(key, math.MaxInt64)
		}
		all := v.scan(key, end)
		if len(all) >= v.flat.minKVs {
			v.flat.put(newFlatRange(v.snap, v.gen, key, end, all, true))
		}
		return all, int64(len(all))
	}
	var vs []version
	var n int64
	v.ascend(key, end, func(ver version) bool {
		if int64(len(vs)) < limit {
			vs = append(vs, ver)
		}
		n++
		return true
	})
	return vs, n
}

// scan returns the versions of every key of [key, end).
func (v View) scan(key, end []byte) []version {
	var vs []version
	v.ascend(key, end, func(ver version) bool {
		vs = append(vs, ver)
		return true
	})
	return vs
}

// makeKVs returns the KeyValues of vs, each a put's.
func makeKVs(vs []version) []*mvccpb.KeyValue {
	kvs := make([]*mvccpb.KeyValue, len(vs))
	m := storedkv.KVMaker{First: len(vs)}
	for i, ver := range vs {
		kvs[i] = ver.KV(&m)
	}
	return kvs
}

// at returns the version of key in the view, if the key exists.
func (v View) at(key []byte) (version, bool) {
	h, ok := v.index.Get(searchFor(key))
	if !ok {
		return version{}, false
	}
	return h.at(v.snap.rev)
}

// Get returns the key-value of key in the view, if it exists.
func (v View) Get(key []byte) (*mvccpb.KeyValue, bool) {
	ver, ok := v.at(key)
	if !ok {
		return nil, false
	}
	m := storedkv.KVMaker{First: 1}
	return ver.KV(&m), true
}

// Ascend calls fn for every key-value in [key, end) in key order until fn
// returns false. An empty end means no upper bound. kv is fn's for the
// call only: fn may keep kv.Key and kv.Value, which the store never
// changes, but not kv itself (a walk of the whole keyspace, a hash check's
// or a copy to disk, makes no garbage of a KeyValue per key).
func (v View) Ascend(key, end []byte, fn func(kv *mvccpb.KeyValue) bool) {
	e := &storedkv.Entry{}
	v.ascend(key, end, func(ver version) bool { return fn(ver.KVIn(e)) })
}

// ascend calls fn with the version at the view's revision of every key in
// [key, end) that has one, in key order, until fn returns false. An empty
// end means no upper bound.
func (v View) ascend(key, end []byte, fn func(version) bool) {
	rev := v.snap.rev
	each := func(h *keyHistory) bool {
		if ver, ok := h.at(rev); ok {
			return fn(ver)
		}
		return true
	}
	if len(end) == 0 {
		v.index.AscendGreaterOrEqual(searchFor(key), each)
		return
	}
	if bytes.Compare(key, end) >= 0 {
		return
	}
	v.index.AscendRange(searchFor(key), searchFor(end), each)
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
// sortOrder is the order sortKVs sorts r's results in: etcd sorts by any
// target but the key ascending when r gives no order.
func sortOrder(r *pb.RangeRequest) pb.RangeRequest_SortOrder {
	if r.SortTarget != pb.RangeRequest_KEY && r.SortOrder == pb.RangeRequest_NONE {
		return pb.RangeRequest_ASCEND
	}
	return r.SortOrder
}

func sortKVs(kvs []*mvccpb.KeyValue, r *pb.RangeRequest) {
	order := sortOrder(r)
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
