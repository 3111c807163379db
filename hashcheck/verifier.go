package hashcheck

import (
	"bytes"
	"context"
	"fmt"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Store is what the verifier reads of the cache (revtree.Store).
type Store interface {
	View(rev int64) (revtree.View, error)
}

// Verifier compares etcd's keys and mod revisions at one revision with the
// store's. The follower asks it on every resume of its watch, and of a
// copy on disk as it is restored (progress.HistoryVerifier); the Checker
// compares with it. It reads only the store and etcd, and keeps no state,
// so it exists before the follower that asks it.
type Verifier struct {
	store    Store
	upstream pb.KVClient // etcd's
	lg       *zap.Logger
	// pageSize is the number of the cache's keys in each chunk read from
	// etcd (viewEntries); tests make it small.
	pageSize int
}

// NewVerifier returns a Verifier of store against upstream, etcd's KV
// service; lg may be nil.
func NewVerifier(store Store, upstream pb.KVClient, lg *zap.Logger) *Verifier {
	if lg == nil {
		lg = zap.NewNop()
	}
	return &Verifier{store: store, upstream: upstream, lg: lg, pageSize: pageSize}
}

// compare compares etcd's keys at rev with view's, by their hashes.
func (v *Verifier) compare(ctx context.Context, view revtree.View, rev int64) (Result, error) {
	return Compare(rev, cacheEntries(view), viewEntries(ctx, v.upstream, view, rev, v.pageSize))
}

// SameHistory reports whether etcd's keys and mod revisions at rev are the
// store's: the follower's check of etcd's history on a resume.
func (v *Verifier) SameHistory(ctx context.Context, rev int64) (bool, error) {
	view, err := v.store.View(rev)
	if err != nil {
		return false, fmt.Errorf("the cache's revision %d: %w", rev, err)
	}
	res, err := v.compare(ctx, view, rev)
	if err != nil {
		return false, err
	}
	if !res.Match() {
		v.lg.Warn("etcd's history differs from the cache's", zap.Int64("revision", rev), zap.String("first-difference", res.FirstDiff))
	}
	return res.Match(), nil
}

// SameHistoryAhead is SameHistory for a store being restored from a copy
// on disk: it reads etcd's keys at rev, in chunks cut at bounds (keys of
// the copy), while restored runs, and compares them with the store's
// once it has returned. It returns restored's error, if any.
func (v *Verifier) SameHistoryAhead(ctx context.Context, rev int64, bounds [][]byte, restored func() error) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type fetched struct {
		entries []Entry
		err     error
	}
	got := make(chan fetched, 1)
	go func() {
		var f fetched
		for e, err := range boundsEntries(ctx, v.upstream, bounds, rev, v.pageSize) {
			if err != nil {
				f.err = err
				break
			}
			f.entries = append(f.entries, e)
		}
		got <- f
	}()
	if err := restored(); err != nil {
		cancel()
		<-got
		return false, err
	}
	view, err := v.store.View(rev)
	if err != nil {
		cancel()
		<-got
		return false, fmt.Errorf("the cache's revision %d: %w", rev, err)
	}
	f := <-got
	if f.err != nil {
		return false, f.err
	}
	// Side by side, without hashing: only whether they are the same
	// matters here, and at a million keys the hashes cost most of a
	// second the proxy is not ready for.
	i, diff := 0, ""
	view.Ascend([]byte{0}, nil, func(kv *mvccpb.KeyValue) bool {
		switch {
		case i == len(f.entries):
			diff = fmt.Sprintf("%q only in the copy", kv.Key)
		case !bytes.Equal(kv.Key, f.entries[i].Key) || kv.ModRevision != f.entries[i].ModRevision:
			diff = fmt.Sprintf("the copy has %q at %d, etcd %q at %d", kv.Key, kv.ModRevision, f.entries[i].Key, f.entries[i].ModRevision)
		}
		i++
		return diff == ""
	})
	if diff == "" && i < len(f.entries) {
		diff = fmt.Sprintf("%q only in etcd", f.entries[i].Key)
	}
	if diff != "" {
		v.lg.Warn("etcd's history differs from the copy's on disk", zap.Int64("revision", rev), zap.String("first-difference", diff))
	}
	return diff == "", nil
}
