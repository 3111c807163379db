package server

import (
	"context"
	"fmt"
	"math"
	"os"
	"runtime/debug"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/memlimit"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// memoryLimitServer is what startMemoryLimit needs of a server. Its live
// heap is the store's alone: the test process's own (an embedded etcd's
// among it) is not the proxy's.
func memoryLimitServer(limit MemoryLimit) *Server {
	return &Server{
		cfg:      Config{MemoryLimit: limit},
		lg:       zap.NewNop(),
		registry: prometheus.NewRegistry(),
		store:    revtree.New(revtree.DefaultDegree),
		heapLive: func() int64 { return 0 },
	}
}

func limitMetric(t *testing.T, s *Server) int64 {
	t.Helper()
	mfs, err := s.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "etcd_snapcache_memory_limit_bytes" && len(mf.GetMetric()) == 1 {
			return int64(mf.GetMetric()[0].GetGauge().GetValue())
		}
	}
	t.Fatal("no etcd_snapcache_memory_limit_bytes")
	return 0
}

// withoutGOMEMLIMIT unsets GOMEMLIMIT for the test (restored after it),
// which would otherwise make the server leave the limit alone.
func withoutGOMEMLIMIT(t *testing.T) {
	t.Setenv("GOMEMLIMIT", "") // restores the environment's value after the test
	os.Unsetenv("GOMEMLIMIT")
}

// TestMemoryLimitDefersToGOMEMLIMIT: with GOMEMLIMIT set, the server
// leaves the runtime's limit as it is and reports it as the ceiling.
func TestMemoryLimitDefersToGOMEMLIMIT(t *testing.T) {
	t.Setenv("GOMEMLIMIT", "1GiB")
	before := debug.SetMemoryLimit(1 << 30) // what the runtime took from it
	defer debug.SetMemoryLimit(before)
	s := memoryLimitServer(MemoryLimit{Mode: MemoryLimitAuto})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s.startMemoryLimit(ctx)
	if got := debug.SetMemoryLimit(-1); got != 1<<30 {
		t.Fatalf("limit %d, want GOMEMLIMIT's 1 GiB", got)
	}
	if got := limitMetric(t, s); got != 1<<30 {
		t.Fatalf("metric %d, want 1 GiB", got)
	}
	cancel()
	s.wg.Wait()
}

// TestMemoryLimitAuto: an automatic limit is set from the store's
// estimate (at least the floor), follows the store as it grows, is
// exported, is managed by one server of the process at a time, and is
// restored to what it was when the server stops.
func TestMemoryLimitAuto(t *testing.T) {
	withoutGOMEMLIMIT(t)
	before := debug.SetMemoryLimit(-1)
	s := memoryLimitServer(MemoryLimit{Mode: MemoryLimitAuto})
	ctx, cancel := context.WithCancel(context.Background())
	s.startMemoryLimit(ctx)
	first := debug.SetMemoryLimit(-1)
	cg, _ := memlimit.CgroupLimit()
	want := memlimit.Policy{FollowLive: true, Cgroup: cg}
	if first != want.Limit(0) {
		t.Fatalf("limit %d for an empty store, want %d", first, want.Limit(0))
	}
	if got := limitMetric(t, s); got != first {
		t.Fatalf("metric %d, limit %d", got, first)
	}

	// Another server of the process leaves it alone.
	other := memoryLimitServer(FixedMemoryLimit(1 << 40))
	other.startMemoryLimit(ctx)
	if got := debug.SetMemoryLimit(-1); got != first {
		t.Fatalf("a second server moved the limit to %d", got)
	}

	// The store grows: the limit follows (unless a cgroup caps it), to
	// within the 1/32 it moves by (a load's own estimate may have set it
	// close to the store's already).
	kvs := make([]*mvccpb.KeyValue, 0, 20_000)
	for i := range cap(kvs) {
		kvs = append(kvs, &mvccpb.KeyValue{Key: fmt.Appendf(nil, "/k/%06d", i), Value: make([]byte, 4096), CreateRevision: 2, ModRevision: 2, Version: 1})
	}
	s.store.Reset(2, kvs, 0)
	if grown := want.Limit(s.store.ApproxBytes()); grown != first {
		testsupport.WaitFor(t, 10*time.Second, "the limit to follow the store", func() bool {
			d := debug.SetMemoryLimit(-1) - grown
			return max(d, -d) <= grown/32
		})
	}
	cancel()
	s.wg.Wait()
	other.wg.Wait()
	if got := debug.SetMemoryLimit(-1); got != before {
		t.Fatalf("limit %d after the server stopped, want the %d it found", got, before)
	}
}

// TestMemoryLimitAutoFollowsTheLiveHeap: an automatic limit is never below
// what the live heap needs, whatever the store's estimate, so that what
// the store does not count (connections, streams) never holds the heap
// above the limit, with the collector running without end.
func TestMemoryLimitAutoFollowsTheLiveHeap(t *testing.T) {
	withoutGOMEMLIMIT(t)
	before := debug.SetMemoryLimit(-1)
	s := memoryLimitServer(MemoryLimit{Mode: MemoryLimitAuto})
	var live atomic.Int64
	s.heapLive = live.Load
	ctx, cancel := context.WithCancel(context.Background())
	s.startMemoryLimit(ctx)
	cg, _ := memlimit.CgroupLimit()
	want := memlimit.Policy{FollowLive: true, Cgroup: cg}
	if got := debug.SetMemoryLimit(-1); got != want.Limit(0) {
		t.Fatalf("limit %d for an empty store and heap, want %d", got, want.Limit(0))
	}
	live.Store(512 << 20) // an empty store, and 512 MiB of connections
	if grown := want.Limit(512 << 20); grown != want.Limit(0) {
		testsupport.WaitFor(t, 10*time.Second, "the limit to follow the live heap", func() bool {
			d := debug.SetMemoryLimit(-1) - grown
			return max(d, -d) <= grown/32
		})
	}
	cancel()
	s.wg.Wait()
	if got := debug.SetMemoryLimit(-1); got != before {
		t.Fatalf("limit %d after the server stopped, want %d as before", got, before)
	}
}

// TestMemoryLimitFixedAndOff: a fixed limit is set as given; 0 sets none
// and exports 0 (with no limit in the process).
func TestMemoryLimitFixedAndOff(t *testing.T) {
	withoutGOMEMLIMIT(t)
	before := debug.SetMemoryLimit(-1)
	s := memoryLimitServer(FixedMemoryLimit(3 << 30))
	ctx, cancel := context.WithCancel(context.Background())
	s.startMemoryLimit(ctx)
	if got := debug.SetMemoryLimit(-1); got != 3<<30 {
		t.Fatalf("limit %d, want 3 GiB", got)
	}
	cancel()
	s.wg.Wait()

	off := memoryLimitServer(MemoryLimit{Mode: MemoryLimitNone})
	off.startMemoryLimit(context.Background())
	if got := debug.SetMemoryLimit(-1); got != before {
		t.Fatalf("--memory-limit=0 moved the limit to %d", got)
	}
	if before == math.MaxInt64 {
		if got := limitMetric(t, off); got != 0 {
			t.Fatalf("metric %d without a limit, want 0", got)
		}
	}
}
