package hashcheck

import (
	"context"
	"iter"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Hooks for the tests against a real etcd (etcd_test.go).

// BoundedEntries is viewEntries: etcd's keys at rev read in chunks cut at
// every page-th key of v.
func BoundedEntries(ctx context.Context, kv pb.KVClient, v revtree.View, rev int64, page int) iter.Seq2[Entry, error] {
	return viewEntries(ctx, kv, v, rev, page)
}

// UnboundedEntries is RangeEntries with pages of page keys.
func UnboundedEntries(ctx context.Context, kv pb.KVClient, rev int64, page int) iter.Seq2[Entry, error] {
	return rangeEntries(ctx, kv, rev, page)
}

// CacheEntries is cacheEntries.
func CacheEntries(v revtree.View) iter.Seq2[Entry, error] { return cacheEntries(v) }

// SetPageSize sets the number of the cache's keys in each chunk v reads
// from etcd.
func (v *Verifier) SetPageSize(n int) { v.pageSize = n }
