package hashcheck

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/broadcast"
	"github.com/etcd-snapcache/etcd-snapcache/internal/etcderr"
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

// Config configures a Checker.
type Config struct {
	// Verifier compares the cache with etcd; the follower's checks of
	// etcd's history use the same one.
	Verifier *Verifier
	Follower Follower
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
}

// New returns a Checker; call Run to check periodically.
func New(cfg Config) *Checker {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	c := &Checker{cfg: cfg, lg: cfg.Logger, failed: make(chan struct{}, 1)}
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

// Check compares the cache with etcd now, at the cache's revision, and
// enters or lifts the fallback accordingly.
func (c *Checker) Check(ctx context.Context) (Result, error) {
	if !c.cfg.Follower.IsReady() {
		return Result{}, errNotReady
	}
	v := c.cfg.Verifier
	view, err := v.store.View(0)
	if err != nil {
		return Result{}, err
	}
	res, err := v.compare(ctx, view, view.Rev)
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
