package integration

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/persist"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// persistIn makes the proxy keep its copy on disk in dir. The interval is
// long on purpose: the tests' copies are the ones a clean stop writes,
// unless a test flushes.
func persistIn(dir string) func(*server.Config) {
	return func(cfg *server.Config) {
		cfg.PersistDir = dir
		cfg.PersistInterval = time.Hour
	}
}

// restores returns the proxy's count of starts from its copy on disk with
// result.
func restores(tb testing.TB, p *server.Server, result string) float64 {
	tb.Helper()
	return metricSum(tb, p.Registry(), "etcd_snapcache_disk_restores_total", map[string]string{"result": result})
}

// loadsFromEtcd returns the proxy's count of whole-keyspace loads.
func loadsFromEtcd(tb testing.TB, p *server.Server) float64 {
	tb.Helper()
	return metricSum(tb, p.Registry(), "etcd_snapcache_loads_total", nil)
}

// TestWarmStartAfterCleanStop: a proxy stopped cleanly leaves its copy on
// disk; the next one restores it, reads from etcd only the revisions
// written while it was down, keeps the history it had (ranges at every
// retained revision served from the cache and equal to etcd's), and
// serves watches from that history with etcd's events.
func TestWarmStartAfterCleanStop(t *testing.T) {
	c := newCluster(t, clusterOptions{configure: persistIn(t.TempDir())})
	writeSome(t, c, "r/", 25)
	if _, err := c.direct.Compact(context.Background(), c.etcdRev(t)-15); err != nil {
		t.Fatal(err)
	}
	writeDirect(t, c, 10)
	c.waitSynced(t)
	historyStart := c.proxy.Store().HistoryStart()
	c.proxy.Stop()
	writeDirect(t, c, 10)
	c.startProxy(t)
	c.waitSynced(t)

	if n := restores(t, c.proxy, "warm"); n != 1 {
		t.Fatalf("warm restores %v, want 1", n)
	}
	if n := loadsFromEtcd(t, c.proxy); n != 0 {
		t.Fatalf("the warm start loaded the keyspace from etcd %v times", n)
	}
	if got := c.proxy.Store().HistoryStart(); got != historyStart {
		t.Fatalf("history starts at %d after the restart, want %d as before it", got, historyStart)
	}
	head := c.etcdRev(t)
	compact := c.etcdCompactRev(t)
	cache0, fwd0, rej0 := c.rangeSources(t)
	n := sweep(t, c, compact-1, head+1)
	cache1, fwd1, rej1 := c.rangeSources(t)
	k := len(sweepShapes)
	// Below the compaction and the future revision refused; nothing
	// forwarded: every retained revision is the cache's.
	if int(rej1-rej0) != 2*k || int(fwd1-fwd0) != 0 || int(cache1-cache0) != n-2*k {
		t.Fatalf("after a warm start: cache %v forwarded %v rejected %v of %d; want every retained revision from the cache",
			cache1-cache0, fwd1-fwd0, rej1-rej0, n)
	}
	sameWatch(t, c, historyStart, head)
}

// sameWatch compares a watch of the whole keyspace with prev_kv from rev
// up to head through the proxy with etcd's.
func sameWatch(t *testing.T, c *cluster, rev, head int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	collect := func(cli *clientv3.Client) []*clientv3.Event {
		var evs []*clientv3.Event
		for resp := range cli.Watch(ctx, "", clientv3.WithPrefix(), clientv3.WithRev(rev), clientv3.WithPrevKV()) {
			if err := resp.Err(); err != nil {
				t.Fatalf("watch from %d: %v", rev, err)
			}
			evs = append(evs, resp.Events...)
			if len(evs) > 0 && evs[len(evs)-1].Kv.ModRevision >= head {
				return evs
			}
		}
		t.Fatalf("watch from %d ended before revision %d", rev, head)
		return nil
	}
	want, got := collect(c.direct), collect(c.viaProxy)
	if diff := servertest.DiffEvents(want, got); diff != "" {
		t.Fatalf("watch from %d through a warm-started proxy: %s", rev, diff)
	}
}

// TestWarmStartRefusesCompactedCopy: etcd compacted past the copy's
// revision while the proxy was down: the copy cannot be compared with
// etcd, so it is thrown away and the keyspace loaded from etcd.
func TestWarmStartRefusesCompactedCopy(t *testing.T) {
	dir := t.TempDir()
	c := newCluster(t, clusterOptions{configure: persistIn(dir)})
	writeSome(t, c, "r/", 20)
	c.waitSynced(t)
	c.proxy.Stop()
	writeDirect(t, c, 10)
	if _, err := c.direct.Compact(context.Background(), c.etcdRev(t)); err != nil {
		t.Fatal(err)
	}
	c.startProxy(t)
	c.waitSynced(t)
	if n := restores(t, c.proxy, "compacted"); n != 1 {
		t.Fatalf("copies refused as compacted: %v, want 1", n)
	}
	if n := loadsFromEtcd(t, c.proxy); n != 1 {
		t.Fatalf("loads from etcd %v, want 1", n)
	}
	sweep(t, c, c.etcdCompactRev(t)-1, c.etcdRev(t)+1)
}

// TestWarmStartRefusesDamagedCopy: a byte of the copy changed on disk: its
// checksum fails, nothing of it is served, and the keyspace is loaded from
// etcd.
func TestWarmStartRefusesDamagedCopy(t *testing.T) {
	dir := t.TempDir()
	c := newCluster(t, clusterOptions{configure: persistIn(dir)})
	marker := "marker-value-of-the-damaged-copy"
	if _, err := c.direct.Put(context.Background(), "damaged/key", marker); err != nil {
		t.Fatal(err)
	}
	writeSome(t, c, "r/", 10)
	c.waitSynced(t)
	c.proxy.Stop()
	path := filepath.Join(dir, persist.FileName)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Every place: bbolt's free pages may hold earlier versions of the
	// page, which are no part of the copy.
	n := 0
	for i := bytes.Index(data, []byte(marker)); i >= 0; i = bytes.Index(data, []byte(marker)) {
		data[i] ^= 0x20
		n++
	}
	if n == 0 {
		t.Fatalf("the copy does not hold the value %q", marker)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	c.startProxy(t)
	c.waitSynced(t)
	if n := restores(t, c.proxy, "damaged"); n != 1 {
		t.Fatalf("copies refused as damaged: %v, want 1", n)
	}
	c.mustSameRange(t, &pb.RangeRequest{Key: []byte("damaged/key")})
	sweep(t, c, c.etcdRev(t), c.etcdRev(t))
}

// TestWarmStartRefusesAnotherCluster: the copy on disk was written in front
// of another etcd cluster; its cluster id refuses it.
func TestWarmStartRefusesAnotherCluster(t *testing.T) {
	dir := t.TempDir()
	first := newCluster(t, clusterOptions{configure: persistIn(dir)})
	writeSome(t, first, "r/", 20)
	first.waitSynced(t)
	first.proxy.Stop()

	second := newCluster(t, clusterOptions{configure: persistIn(dir), peerURL: "http://" + testsupport.FreeAddr(t)})
	if first.proxy.Follower().ClusterID() == second.proxy.Follower().ClusterID() {
		t.Fatal("the two etcd clusters have one cluster id")
	}
	if n := restores(t, second.proxy, "cluster-id"); n != 1 {
		t.Fatalf("copies refused for their cluster id: %v, want 1", n)
	}
	writeSome(t, second, "r/", 30)
	second.waitSynced(t)
	sweep(t, second, second.proxy.Store().OldestRev(), second.etcdRev(t))
}

// TestWarmStartRefusesRestoredEtcd: etcd is restored from an older
// snapshot (the same cluster id) while the proxy is down. The copy is
// refused by etcd's head below it, by the keys at its revision once the
// restored etcd has written past it, or as compacted after a revision bump
// with --mark-compacted; nothing of the old history is answered.
func TestWarmStartRefusesRestoredEtcd(t *testing.T) {
	for _, tc := range []struct {
		name        string
		bump        uint64
		writesAfter int
		check       string
	}{
		{"below the copy's revision", 0, 3, "head-below-disk"},
		{"past the copy's revision", 0, 40, "history"},
		{"bump and mark compacted", 1000, 3, "compacted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			env := newTimelineEnvWith(t, persistIn(dir))
			env.put("/a/", 10)
			snap := env.snapshot()
			oldRev := env.put("/old/", 20)
			testsupport.WaitFor(t, waitTimeout, "the cache to reach the old head", func() bool { return env.proxy.Store().Rev() >= oldRev })
			env.proxy.Stop()

			env.restore(snap, tc.bump)
			env.put("/new/", tc.writesAfter)
			env.proxy = servertest.StartProxy(t, env.proxyCfg)
			if n := restores(t, env.proxy, tc.check); n != 1 {
				t.Fatalf("copies refused by %s: %v, want 1", tc.check, n)
			}
			env.neverOld(t, "/old/")
			if err := env.sameAnswers(false, "/a/", "/old/", "/new/"); err != nil {
				t.Fatal(err)
			}
			if err := env.sameAnswers(true, "/a/", "/old/", "/new/"); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestPersistReadOnlyDataDir: the copy's directory cannot be written; the
// proxy serves from memory as without a copy, and says why it cannot
// persist.
func TestPersistReadOnlyDataDir(t *testing.T) {
	dir := testsupport.ReadOnlyDir(t)
	c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) {
		cfg.PersistDir = filepath.Join(dir, "snapcache")
		cfg.PersistInterval = 10 * time.Millisecond
	}})
	writeSome(t, c, "r/", 10)
	c.waitSynced(t)
	testsupport.WaitFor(t, waitTimeout, "the proxy to report that it cannot write its copy", func() bool {
		return c.proxyMetric(t, "etcd_snapcache_disk_write_failing", nil) == 1
	})
	if !c.proxy.Follower().Serving() {
		t.Fatal("a proxy that cannot write its copy is not ready")
	}
	sweep(t, c, c.proxy.Store().OldestRev(), c.etcdRev(t)+1)
}
