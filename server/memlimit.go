package server

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/etcd-snapcache/etcd-snapcache/internal/memlimit"
)

// MemoryLimitMode is how Config.MemoryLimit sets the Go runtime's soft
// memory limit.
type MemoryLimitMode int

const (
	// MemoryLimitNone leaves the runtime's default pacing
	// (--memory-limit=0), which lets the heap grow to twice the live data.
	MemoryLimitNone MemoryLimitMode = iota
	// MemoryLimitFixed is MemoryLimit.Bytes (--memory-limit=3GiB).
	MemoryLimitFixed
	// MemoryLimitAuto follows the store's estimate of its memory
	// (Store.ApproxBytes: the live keyspace and retained history, and a
	// load in progress) and the cached responses in flight, with the
	// headroom of package memlimit, within 90% of the cgroup's memory
	// limit: --memory-limit=auto.
	MemoryLimitAuto
	// MemoryLimitCgroup is 90% of the cgroup's memory limit alone (none
	// without one), for a process whose heap holds more than the store
	// (an embedded etcd).
	MemoryLimitCgroup
)

// MemoryLimit is the Go runtime's soft memory limit a server sets.
type MemoryLimit struct {
	Mode  MemoryLimitMode
	Bytes int64 // with MemoryLimitFixed: more than 0
}

// FixedMemoryLimit is a limit of n bytes; 0 is none, as --memory-limit=0.
func FixedMemoryLimit(n int64) MemoryLimit {
	if n == 0 {
		return MemoryLimit{Mode: MemoryLimitNone}
	}
	return MemoryLimit{Mode: MemoryLimitFixed, Bytes: n}
}

// String is the limit as --memory-limit writes it.
func (l MemoryLimit) String() string {
	switch l.Mode {
	case MemoryLimitNone:
		return "0"
	case MemoryLimitFixed:
		return memlimit.FormatSize(l.Bytes)
	case MemoryLimitAuto:
		return "auto"
	case MemoryLimitCgroup:
		return "cgroup"
	}
	return fmt.Sprintf("MemoryLimitMode(%d)", int(l.Mode))
}

// liveEstimate is the heap an automatic limit follows: the store's (its
// live keyspace, retained history and a load in progress) and the
// responses from the cache being built and sent, so that a burst of large
// reads, bounded by --max-cached-read-bytes, raises the limit rather than
// making the collector run again and again under it (a response from the
// cache is sent as pieces of the store's own bytes, which the store
// counts: the bytes held for it stand for its pieces, the small key-values
// copied beside them, and what it keeps alive of what the store drops
// meanwhile); the records of the copy on disk's append until it commits;
// and at least the heap the last collection found live
// (heapLive). The estimate moves as the store does, ahead of any
// collection; the live heap holds what the store does not count (client
// connections and their gRPC buffers, watch streams), which would
// otherwise keep the heap above a limit that follows the store alone,
// with the collector running without end: 2,000 idle watch connections on
// a small store cost 0.75 s of CPU a second that way.
func (s *Server) liveEstimate() int64 {
	n := s.store.ApproxBytes()
	if s.svc.kv != nil {
		n += s.svc.kv.CachedReadBytes()
	}
	if s.persister != nil {
		n += s.persister.InFlightBytes() // an append's records until it commits
	}
	return max(n, s.heapLive())
}

// startMemoryLimit registers etcd_snapcache_memory_limit_bytes and sets
// the Go runtime's soft memory limit as Config.MemoryLimit says, unless
// GOMEMLIMIT is set (the runtime has applied it) or another server of the
// process manages it; an automatic limit is kept in line with the store on
// a goroutine of the server until ctx ends, and the limit found at the
// start is restored then.
func (s *Server) startMemoryLimit(ctx context.Context) {
	s.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_memory_limit_bytes",
		Help: "The Go runtime's soft memory limit (--memory-limit, or GOMEMLIMIT); 0: none.",
	}, func() float64 { return float64(memlimit.RuntimeLimit()) }))
	// The ceiling is what the limit may grow to: the alert on memory
	// compares the cache with it, not with an automatic limit that
	// follows the cache.
	var ceiling atomic.Int64
	s.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_memory_limit_max_bytes",
		Help: "The most the Go runtime's soft memory limit may be: a fixed --memory-limit or GOMEMLIMIT, or, with --memory-limit=auto, 90% of the cgroup's memory limit; 0: no bound.",
	}, func() float64 { return float64(ceiling.Load()) }))
	ceiling.Store(memlimit.RuntimeLimit()) // GOMEMLIMIT, or another server's
	lg := s.lg.Named("memlimit")
	if s.cfg.MemoryLimit.Mode == MemoryLimitNone {
		lg.Info("no memory limit (--memory-limit=0): the Go runtime's default pacing, which lets the heap grow to twice the live data")
		return
	}
	if env, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		lg.Info("the memory limit is GOMEMLIMIT's; --memory-limit is not applied", zap.String("GOMEMLIMIT", env))
		return
	}
	rt, ok := memlimit.AcquireRuntime()
	if !ok {
		lg.Info("another server of this process manages the memory limit")
		return
	}
	var p memlimit.Policy
	mode := "fixed"
	switch s.cfg.MemoryLimit.Mode {
	case MemoryLimitAuto, MemoryLimitCgroup:
		mode, p.FollowLive = s.cfg.MemoryLimit.String(), s.cfg.MemoryLimit.Mode == MemoryLimitAuto
		cg, err := memlimit.CgroupLimit()
		if err != nil {
			lg.Debug("no cgroup memory limit read", zap.Error(err))
		}
		p.Cgroup = cg
	default:
		p.Fixed = s.cfg.MemoryLimit.Bytes
	}
	t := &memlimit.Tracker{
		Policy: p,
		Live:   s.liveEstimate,
		Set:    rt.Set,
		Changed: func(l, prev int64) {
			lg.Debug("memory limit moved", zap.Int64("memory-limit-bytes", l), zap.Int64("previous-bytes", prev))
		},
	}
	ceiling.Store(p.Ceiling())
	fields := []zap.Field{zap.String("mode", mode), zap.Int64("cgroup-limit-bytes", p.Cgroup)}
	if p.Limit(s.liveEstimate()) == 0 {
		lg.Info("no memory limit: no cgroup memory limit", fields...)
		rt.Release()
		return
	}
	initial := t.Start()
	fields = append(fields, zap.String("memory-limit", memlimit.FormatSize(initial)), zap.Int64("memory-limit-bytes", initial))
	if p.FollowLive {
		lg.Info("memory limit set; it follows the cache's memory estimate", append(fields,
			zap.Float64("headroom", memlimit.Headroom), zap.String("floor", memlimit.FormatSize(memlimit.Floor)))...)
	} else {
		lg.Info("memory limit set", fields...)
	}
	s.run(func() {
		defer rt.Release()
		t.Run(ctx)
	})
}
