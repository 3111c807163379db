package hashcheck

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/broadcast"
	"github.com/etcd-snapcache/etcd-snapcache/internal/etcderr"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// DefaultInterval between periodic checks.
const DefaultInterval = 5 * time.Minute

// Follower is what the checker needs of the upstream follower
// (progress.Follower).
type Follower interface {
	// IsReady reports whether the first load has caught up.
	IsReady() bool
	// Changed returns a channel closed the next time the store advances or
	// is reloaded.
	Changed() <-chan struct{}
	// Loads counts the loads of the keyspace completed.
	Loads() int64
	// Reload has the keyspace loaded again; reason labels the metric.
	Reload(reason string)
}

// Store is what the checker reads of the cache (revtree.Store).
type Store interface {
	View(rev int64) (revtree.View, error)
}

// Config configures a Checker.
type Config struct {
	Store    Store
	Follower Follower
	// Upstream is etcd's KV service.
	Upstream pb.KVClient
	// Interval between periodic checks (0: none; Run returns at once).
	Interval   time.Duration
	Logger     *zap.Logger
	Registerer prometheus.Registerer
}

// Checker checks the cache against etcd periodically and holds the proxy in
// fallback from a failed check until a later one passes.
type Checker struct {
	cfg      Config
	lg       *zap.Logger
	fallback atomic.Bool // set by a failed check, cleared by a passing one
	// failures counts the failed checks: a fallback can begin and end
	// between two looks at Fallback, and a watch stream that ran across
	// it must still end.
	failures atomic.Uint64
	// failedSignal is notified at every failed check, after failures
	// and fallback are set: the watch streams wait on it instead of
	// polling Failures.
	failedSignal broadcast.Signal
	checks       *prometheus.CounterVec
	// failedAt is the follower's load count when a check failed: the next
	// check waits for the reload that follows.
	failedAt atomic.Int64
	failed   chan struct{} // buffered 1: wakes Run after a failed check made by Check's other callers
	// pageSize is the number of the cache's keys in each chunk read from
	// etcd (viewEntries); tests make it small.
	pageSize int
}

// New returns a Checker; call Run to check periodically.
func New(cfg Config) *Checker {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	c := &Checker{cfg: cfg, lg: cfg.Logger, failed: make(chan struct{}, 1), pageSize: pageSize}
	c.checks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "etcd_snapcache_consistency_checks_total",
		Help: "Checks of the cache against etcd, by result (success, failure, error).",
	}, []string{"result"})
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(c.checks, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "etcd_snapcache_consistency_fallback",
			Help: "1 while reads go to etcd because a check found the cache inconsistent.",
		}, func() float64 {
			if c.Fallback() {
				return 1
			}
			return 0
		}))
	}
	return c
}

// Failures returns how many checks have found the cache inconsistent.
func (c *Checker) Failures() uint64 { return c.failures.Load() }

// NextFailure returns a channel closed when a check next finds the cache
// inconsistent, once Failures and Fallback say so.
func (c *Checker) NextFailure() <-chan struct{} { return c.failedSignal.Wait() }

// Fallback reports whether every read must go to etcd: the last check
// found the cache inconsistent and none has passed since.
func (c *Checker) Fallback() bool { return c.fallback.Load() }

// Run checks every interval until ctx is done. After a failed check it
// checks again as soon as the cache has reloaded.
func (c *Checker) Run(ctx context.Context) {
	if c.cfg.Interval <= 0 {
		return
	}
	t := time.NewTimer(c.cfg.Interval)
	defer t.Stop()
	for {
		if c.Fallback() {
			if !c.waitReload(ctx) {
				return
			}
		} else {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			case <-c.failed:
				continue // a check made elsewhere failed: wait for the reload
			}
		}
		c.Check(ctx)
		t.Reset(c.cfg.Interval)
	}
}

// waitReload waits until the follower has loaded the keyspace again since
// the failed check, and is ready.
func (c *Checker) waitReload(ctx context.Context) bool {
	f := c.cfg.Follower
	for {
		changed := f.Changed()
		if f.Loads() > c.failedAt.Load() && f.IsReady() {
			return true
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return false
		}
	}
}

var errNotReady = errors.New("hashcheck: the cache is not loaded")

// SameHistory reports whether etcd's keys and mod revisions at rev are the
// store's: the follower's check of etcd's history on a resume. It changes
// no state of the checker.
func (c *Checker) SameHistory(ctx context.Context, rev int64) (bool, error) {
	view, err := c.cfg.Store.View(rev)
	if err != nil {
		return false, fmt.Errorf("the cache's revision %d: %w", rev, err)
	}
	res, err := Compare(rev, cacheEntries(view), viewEntries(ctx, c.cfg.Upstream, view, rev, c.pageSize))
	if err != nil {
		return false, err
	}
	if !res.Match() {
		c.lg.Warn("etcd's history differs from the cache's", zap.Int64("revision", rev), zap.String("first-difference", res.FirstDiff))
	}
	return res.Match(), nil
}

// SameHistoryAhead is SameHistory for a store being restored from a copy
// on disk: it reads etcd's keys at rev, in chunks cut at bounds (keys of
// the copy), while restored runs, and compares them with the store's
// once it has returned. It returns restored's error, if any.
func (c *Checker) SameHistoryAhead(ctx context.Context, rev int64, bounds [][]byte, restored func() error) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type fetched struct {
		entries []Entry
		err     error
	}
	got := make(chan fetched, 1)
	go func() {
		var f fetched
		for e, err := range boundsEntries(ctx, c.cfg.Upstream, bounds, rev, c.pageSize) {
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
	view, err := c.cfg.Store.View(rev)
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
		c.lg.Warn("etcd's history differs from the copy's on disk", zap.Int64("revision", rev), zap.String("first-difference", diff))
	}
	return diff == "", nil
}

// Check compares the cache with etcd now, at the cache's revision, and
// enters or lifts the fallback accordingly.
func (c *Checker) Check(ctx context.Context) (Result, error) {
	if !c.cfg.Follower.IsReady() {
		return Result{}, errNotReady
	}
	view, err := c.cfg.Store.View(0)
	if err != nil {
		return Result{}, err
	}
	res, err := Compare(view.Rev, cacheEntries(view), viewEntries(ctx, c.cfg.Upstream, view, view.Rev, c.pageSize))
	if etcderr.Is(err, rpctypes.ErrFutureRev) {
		// A linearizable read found etcd's head below the cache's
		// revision: etcd's history is not the cache's.
		res.FirstDiff, err = fmt.Sprintf("etcd's head is below the cache's revision %d", view.Rev), nil
	}
	switch {
	case err != nil:
		c.checks.WithLabelValues("error").Inc()
		if ctx.Err() == nil {
			c.lg.Warn("consistency check could not complete", zap.Int64("revision", view.Rev), zap.Error(err))
		}
		return res, err
	case res.Match():
		c.checks.WithLabelValues("success").Inc()
		if c.fallback.CompareAndSwap(true, false) {
			c.lg.Info("consistency check passed; reads are served from the cache again",
				zap.Int64("revision", res.Rev), zap.Int("keys", res.Keys))
		}
		return res, nil
	}
	c.checks.WithLabelValues("failure").Inc()
	c.lg.Error("consistency check failed: the cache differs from etcd; reads go to etcd while the cache reloads",
		zap.Int64("revision", res.Rev),
		zap.String("first-difference", res.FirstDiff),
		zap.Uint64("cache-hash", res.CacheHash),
		zap.Uint64("etcd-hash", res.EtcdHash))
	c.failedAt.Store(c.cfg.Follower.Loads())
	c.failures.Add(1)
	c.fallback.Store(true)
	c.failedSignal.Notify()
	c.cfg.Follower.Reload("inconsistent")
	select {
	case c.failed <- struct{}{}:
	default:
	}
	return res, nil
}
