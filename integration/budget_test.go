package integration

import (
	"context"
	"flag"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// budgetRevisions is how many revisions TestHistoryBudget writes: 10^4 in
// `make test` (with the race detector), 10^5 in `make integration`.
var budgetRevisions = flag.Int("snapcache.budget.revisions", 10_000, "revisions TestHistoryBudget writes")

// newBudgetCluster is an embedded etcd without fsync (many revisions,
// quickly) and the proxy in front of it with a history budget; configure,
// if set, adjusts the proxy's configuration.
func newBudgetCluster(tb testing.TB, budget int64, configure func(*server.Config)) *cluster {
	tb.Helper()
	e := servertest.StartEtcd(tb, server.EmbeddedConfig{UnsafeNoFsync: true})
	c := &cluster{etcd: e, etcdAddr: e.Clients[0].Addr().String()}
	c.proxyCfg = servertest.Config("http://"+c.etcdAddr, func(cfg *server.Config) {
		cfg.CompactionProbeInterval = 20 * time.Millisecond
		cfg.MaxHistoryBytes = budget
		cfg.Logger = zaptest.NewLogger(tb)
	})
	if configure != nil {
		configure(&c.proxyCfg)
	}
	c.startProxy(tb)
	c.direct = newClient(tb, c.etcdAddr)
	c.directKV = pb.NewKVClient(c.direct.ActiveConnection())
	return c
}

// writeConcurrently puts n values to keyOf(i) with workers goroutines and
// returns the highest revision written, or the first error.
func writeConcurrently(cli *clientv3.Client, n, workers int, keyOf func(i int) string) (int64, error) {
	return servertest.PutConcurrently(pb.NewKVClient(cli.ActiveConnection()), n, workers, func(i int) *pb.PutRequest {
		return &pb.PutRequest{Key: []byte(keyOf(i)), Value: fmt.Appendf(nil, "value %d of %s", i, keyOf(i))}
	})
}

// TestHistoryBudget writes 10^5 revisions (`make integration`; 10^4 in
// `make test`) with concurrent writers through etcd while the proxy keeps
// its history within a 1 MiB budget (about 3,000 revisions here). The floor (the oldest retained revision) moves,
// etcd's compaction revision is untouched, and the metrics say so. Every
// read below the floor is forwarded (not_retained) and equals etcd's, as
// does every read above it, served from memory. Watches from below the
// floor, created while writers keep moving it, catch up from etcd and
// deliver exactly etcd's events.
func TestHistoryBudget(t *testing.T) {
	const (
		keys    = 1000
		writers = 8
		budget  = 1 << 20
		prefix  = "/budget/"
	)
	revs := *budgetRevisions
	more := revs / 10 // revisions written while the watches catch up
	c := newBudgetCluster(t, budget, nil)
	keyOf := func(i int) string { return fmt.Sprintf("%s%04d", prefix, (i*7919)%keys) }
	first := c.etcdRev(t) + 1
	began := time.Now()
	head, err := writeConcurrently(c.direct, revs, writers, keyOf)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d revisions by %d writers in %v", head-first+1, writers, time.Since(began))
	c.waitSynced(t)

	st := c.proxy.Store()
	floor := st.OldestRev()
	t.Logf("history: %d revisions retained from %d to %d, %d bytes (%d per revision), %d trimmed",
		st.Snapshots(), floor, st.Rev(), st.HistoryBytes(), st.HistoryBytes()/int64(st.Snapshots()), st.HistoryTrimmed())
	switch {
	case floor <= first+int64(revs)/2 || floor >= head:
		t.Fatalf("oldest retained revision %d of %d..%d under a %d-byte budget", floor, first, head, budget)
	case st.HistoryBytes() > budget:
		t.Fatalf("history %d bytes over the budget %d", st.HistoryBytes(), budget)
	case st.CompactRev() != 0 || c.etcdCompactRev(t) != 0:
		t.Fatalf("compaction revision %d (etcd %d): the budget must not compact", st.CompactRev(), c.etcdCompactRev(t))
	}
	for name, want := range map[string]float64{
		"etcd_snapcache_oldest_snapshot_revision":        float64(floor),
		"etcd_snapcache_max_history_bytes":               budget,
		"etcd_snapcache_history_bytes":                   float64(st.HistoryBytes()),
		"etcd_snapcache_history_trimmed_revisions_total": float64(st.HistoryTrimmed()),
		"etcd_snapcache_compact_revision":                0,
		"etcd_snapcache_snapshots_retained":              float64(st.Snapshots()),
	} {
		if got := c.proxyMetric(t, name, nil); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if st.HistoryTrimmed() < floor-first {
		t.Errorf("%d revisions trimmed, want at least the %d below the floor", st.HistoryTrimmed(), floor-first)
	}

	// Reads at revisions below and above the floor, as etcd answers them.
	notRetained := map[string]string{"source": "forwarded", "reason": "not_retained"}
	historical := map[string]string{"source": "cache", "reason": "historical"}
	fwd0, cached0 := c.proxyMetric(t, "etcd_snapcache_range_requests_total", notRetained), c.proxyMetric(t, "etcd_snapcache_range_requests_total", historical)
	var below, above int
	for _, rev := range []int64{first, first + 1, (first + floor) / 2, floor - 2, floor - 1, floor, floor + 1, (floor + head) / 2, head - 1} {
		for _, req := range []*pb.RangeRequest{
			{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix))},
			{Key: []byte(prefix + "0500"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), Limit: 100},
			{Key: []byte(prefix + "0042")},
			{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), CountOnly: true},
			{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), SortTarget: pb.RangeRequest_MOD, SortOrder: pb.RangeRequest_DESCEND, Limit: 10, KeysOnly: true},
		} {
			req.Revision, req.Serializable = rev, true
			// A flattened page counts in the budget, and may move the
			// floor once it is served: judge each read by the floor
			// before it.
			if rev < st.OldestRev() {
				below++
			} else {
				above++
			}
			if _, err := c.mustSameRange(t, req); err != nil {
				t.Fatalf("range at %d: %v", rev, err)
			}
		}
	}
	if fwd := c.proxyMetric(t, "etcd_snapcache_range_requests_total", notRetained) - fwd0; int(fwd) != below {
		t.Errorf("%v reads forwarded as not_retained, want the %d below the floor", fwd, below)
	}
	if cached := c.proxyMetric(t, "etcd_snapcache_range_requests_total", historical) - cached0; int(cached) != above {
		t.Errorf("%v reads served from the cache, want the %d at or above the floor", cached, above)
	}
	// A linearizable read below the floor too.
	c.mustSameRange(t, &pb.RangeRequest{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), Revision: floor - 1})

	// Watches from below the floor, created while writers keep moving it:
	// each catches up from etcd, then continues from the history.
	catchups0 := c.proxyMetric(t, "etcd_snapcache_watch_catchups_total", nil)
	written := make(chan error, 1)
	var head2 int64
	go func() {
		h, err := writeConcurrently(c.direct, more, writers, keyOf)
		head2 = h
		written <- err
	}()
	starts := []int64{first, (first + floor) / 2, floor - 1}
	s := openWatchStream(t, c.viaProxy.ActiveConnection(), "proxy")
	for _, from := range starts {
		s.create(&pb.WatchCreateRequest{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), StartRevision: from, PrevKv: true})
	}
	s.waitCreated(len(starts))
	if err := <-written; err != nil {
		t.Fatal(err)
	}
	if floor2 := c.proxy.Store().OldestRev(); floor2 <= floor {
		t.Errorf("the floor stayed at %d while %d more revisions were written", floor, more)
	}
	log := s.syncTo(head2)
	_, watches, _ := splitResponses(log)
	for i, from := range starts {
		w := watches[int64(i)]
		if w == nil || w.canceled != nil {
			t.Fatalf("watch %d from %d: %v", i, from, w)
		}
		want := referenceEvents(t, c, &pb.WatchCreateRequest{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), StartRevision: from, PrevKv: true}, head2)
		if diff := servertest.DiffEvents(want, eventsUpTo(w.events, head2)); diff != "" {
			t.Fatalf("watch from %d (floor %d): %s", from, floor, diff)
		}
		t.Logf("watch from %d: %d events, as etcd's", from, len(want))
	}
	if n := c.proxyMetric(t, "etcd_snapcache_watch_catchups_total", nil) - catchups0; n < float64(len(starts)) {
		t.Errorf("%v catch-ups from etcd, want at least %d", n, len(starts))
	}
	checkStream(t, "proxy", log, false)
}

// TestReloadUnloadsFirst: a reload drops the old keyspace and history
// before it reads etcd's keyspace again, so that it never holds two stores:
// at every page of the reload, the store holds only the pages read so far.
// Reads and watches afterwards are etcd's.
func TestReloadUnloadsFirst(t *testing.T) {
	const prefix = "/reload/"
	var proxy atomic.Pointer[server.Server]
	var reloading atomic.Bool
	type state struct {
		loaded          bool
		bytes, snaps    int64
		rev, compactRev int64
	}
	var mu sync.Mutex
	var pages []state
	c := newBudgetCluster(t, 0, func(cfg *server.Config) {
		cfg.LoadPageSize = 100
		cfg.BeforeLoadPage = func() {
			p := proxy.Load()
			if p == nil || !reloading.Load() {
				return
			}
			st := p.Store()
			mu.Lock()
			pages = append(pages, state{st.Loaded(), st.ApproxBytes(), int64(st.Snapshots()), st.Rev(), st.CompactRev()})
			mu.Unlock()
		}
	})
	proxy.Store(c.proxy)
	if _, err := writeConcurrently(c.direct, 2000, 4, func(i int) string { return fmt.Sprintf("%s%03d", prefix, i%500) }); err != nil {
		t.Fatal(err)
	}
	if _, err := c.direct.Compact(context.Background(), c.etcdRev(t)-500); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	st := c.proxy.Store()
	before, rev, compactRev := st.ApproxBytes(), st.Rev(), st.CompactRev()
	if st.Snapshots() < 500 || before == 0 {
		t.Fatalf("before the reload: %d snapshots, %d bytes", st.Snapshots(), before)
	}

	loads := c.proxy.Follower().Loads()
	reloading.Store(true)
	c.proxy.Follower().Reload("inconsistent")
	testsupport.WaitFor(t, waitTimeout, "the reload", func() bool { return c.proxy.Follower().Loads() > loads && c.proxy.Follower().Serving() })
	reloading.Store(false)

	mu.Lock()
	defer mu.Unlock()
	if len(pages) < 5 {
		t.Fatalf("the reload read %d pages, want 5 or more", len(pages))
	}
	// The store counts the load in progress (its copies of the pages read
	// so far), and nothing of what it held before: no bytes before the
	// first page, then a page's worth more at each, give or take the slab
	// the load packs its copies into (revtree/pack.go: at most 64 KiB),
	// which it counts whole from the start.
	perPage := pages[1].bytes
	const slab = 64 << 10
	for i, p := range pages {
		if p.loaded || i == 0 && p.bytes != 0 || p.bytes > int64(i)*perPage*11/10+slab || p.snaps != 0 || p.rev < rev || p.compactRev != compactRev {
			t.Fatalf("page %d of the reload: store %+v; want it unloaded (was %d bytes; the first page loaded counts %d), at revision %d or later, compacted at %d", i, p, before, perPage, rev, compactRev)
		}
	}
	t.Logf("reload: %d pages read with the store unloaded (it held %d bytes before)", len(pages), before)
	for _, req := range []*pb.RangeRequest{
		{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix))},
		{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), Revision: compactRev},
		{Key: []byte(prefix + "042"), Revision: rev - 10, Serializable: true},
	} {
		c.mustSameRange(t, req)
	}
}
