package integration

// The upstream watch breaks and resumes; etcd compacts while the proxy is
// away; the proxy restarts. In every case reads at every revision etcd still
// has must agree with etcd, either from the cache or forwarded to etcd, and
// never be refused when etcd would serve them.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

const (
	mRanges        = "etcd_snapcache_range_requests_total"
	mReloads       = "etcd_snapcache_reloads_total"
	mLoads         = "etcd_snapcache_loads_total"
	mWatchRestarts = "etcd_snapcache_upstream_watch_restarts_total"
)

// sweepShapes are compared at every revision of a sweep.
var sweepShapes = []*pb.RangeRequest{
	{Key: []byte{0}, RangeEnd: []byte{0}},
	{Key: []byte("r/"), RangeEnd: []byte("r0"), KeysOnly: true, SortTarget: pb.RangeRequest_MOD, SortOrder: pb.RangeRequest_DESCEND, Limit: 3},
	{Key: []byte("r/1")},
}

// sweep compares sweepShapes at every revision in [from, to] and returns
// how many requests it sent.
func sweep(tb testing.TB, c *cluster, from, to int64) int {
	tb.Helper()
	n := 0
	for rev := from; rev <= to; rev++ {
		for _, shape := range sweepShapes {
			req := cloneRange(shape)
			req.Revision = rev
			c.mustSameRange(tb, req)
			n++
		}
	}
	return n
}

// writeDirect writes n changes straight to etcd (the proxy cannot see them
// while its upstream is cut) and returns etcd's revision after them.
func writeDirect(tb testing.TB, c *cluster, n int) int64 {
	tb.Helper()
	ctx := context.Background()
	var rev int64
	for i := range n {
		key := fmt.Sprintf("r/%d", i%4)
		var hdr *pb.ResponseHeader
		switch i % 5 {
		case 2:
			r, err := c.direct.Delete(ctx, key)
			if err != nil {
				tb.Fatal(err)
			}
			hdr = r.Header
		case 4:
			r, err := c.direct.Txn(ctx).Then(clientv3.OpPut(key, fmt.Sprint("t", i)), clientv3.OpPut(key+"x", fmt.Sprint("t", i))).Commit()
			if err != nil {
				tb.Fatal(err)
			}
			hdr = r.Header
		default:
			r, err := c.direct.Put(ctx, key, fmt.Sprint("v", i))
			if err != nil {
				tb.Fatal(err)
			}
			hdr = r.Header
		}
		rev = max(rev, hdr.Revision)
	}
	return rev
}

// cut breaks the proxy's upstream connection and waits until its follower
// has noticed.
func (c *cluster) cut(tb testing.TB) {
	tb.Helper()
	c.relay.Cut()
	testsupport.WaitFor(tb, waitTimeout, "the upstream watch to break", func() bool { return !c.proxy.Follower().Following() })
}

// TestResumeAfterUpstreamBreak cuts the proxy's connection to etcd, writes
// straight to etcd meanwhile and restores it: the watch resumes where it
// stopped (a restart, no reload), every revision, those written during the
// cut included, is served from the cache and equal to etcd's.
func TestResumeAfterUpstreamBreak(t *testing.T) {
	c := newCluster(t, clusterOptions{relay: true})
	writeSome(t, c, "r/", 20)
	c.waitSynced(t)
	before := c.proxy.Store().Rev()
	restarts0 := c.proxyMetric(t, mWatchRestarts, nil)

	c.cut(t)
	head := writeDirect(t, c, 30)
	if got := c.proxy.Store().Rev(); got != before {
		t.Fatalf("the cache moved to %d while cut off at %d", got, before)
	}
	// While cut off, a linearizable read fails, as it would against an
	// unreachable etcd: the cache cannot prove it fresh.
	lctx, lcancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err := c.proxyKV.Range(lctx, &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, Revision: before})
	lcancel()
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("linearizable read while cut off: %v, want Unavailable", err)
	}
	// Serializable reads of what the cache holds are still served, equal
	// to etcd's keys (the header is the cache's revision: it cannot know
	// etcd's).
	cache0, _, _ := c.rangeSources(t)
	for rev := int64(1); rev <= before; rev++ {
		req := &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, Revision: rev, Serializable: true}
		want, err := c.directKV.Range(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.proxyKV.Range(context.Background(), req)
		if err != nil {
			t.Fatalf("revision %d while cut off: %v", rev, err)
		}
		got.Header, want.Header = nil, nil
		if diff := sameOutcome(req, want, nil, got, nil); diff != "" {
			t.Fatalf("while cut off: %s", diff)
		}
	}
	if cache1, _, _ := c.rangeSources(t); int64(cache1-cache0) != before {
		t.Fatalf("while cut off, %v of %d historical reads were served from the cache", cache1-cache0, before)
	}

	c.relay.Restore()
	c.waitSynced(t)
	cache0, fwd0, rej0 := c.rangeSources(t)
	n := sweep(t, c, 1, head+1)
	cache1, fwd1, rej1 := c.rangeSources(t)
	k := len(sweepShapes)
	if int(cache1-cache0) != n-k || fwd1 != fwd0 || int(rej1-rej0) != k {
		t.Fatalf("after resuming: %v from cache, %v forwarded, %v refused of %d; want all but the future revision from cache",
			cache1-cache0, fwd1-fwd0, rej1-rej0, n)
	}
	if r := c.proxyMetric(t, mWatchRestarts, nil); r <= restarts0 {
		t.Fatalf("upstream watch restarts %v, want > %v", r, restarts0)
	}
	if r := c.proxyMetric(t, mReloads, nil); r != 0 {
		t.Fatalf("%v reloads; resuming after a break must not reload", r)
	}
	if l := c.proxyMetric(t, mLoads, nil); l != 1 {
		t.Fatalf("%v loads, want 1", l)
	}
}

// TestReloadAfterCompactionWhileCut: etcd compacts past the proxy's revision
// while the proxy is cut off, so the watch cannot resume: the proxy reloads,
// and reads at revisions older than the reload that etcd still retains are
// forwarded (not refused) and equal to etcd's.
func TestReloadAfterCompactionWhileCut(t *testing.T) {
	c := newCluster(t, clusterOptions{relay: true})
	writeSome(t, c, "r/", 20)
	c.waitSynced(t)
	before := c.proxy.Store().Rev()

	c.cut(t)
	writeDirect(t, c, 20)
	compactRev := before + 10
	if _, err := c.direct.Compact(context.Background(), compactRev); err != nil {
		t.Fatal(err)
	}
	writeDirect(t, c, 10)
	c.relay.Restore()

	testsupport.WaitFor(t, waitTimeout, "a reload for the compaction", func() bool {
		return c.proxyMetric(t, mReloads, map[string]string{"reason": "compacted"}) >= 1
	})
	c.waitSynced(t)
	if n := c.proxyMetric(t, mReloads, nil); n != 1 {
		t.Fatalf("%v reloads, want exactly one (compacted)", n)
	}
	head := c.etcdRev(t)
	st := c.proxy.Store()
	if st.CompactRev() != compactRev {
		t.Fatalf("proxy compact revision %d, want %d", st.CompactRev(), compactRev)
	}
	loadRev := st.OldestRev()
	if loadRev <= compactRev {
		t.Fatalf("after the reload the oldest snapshot is %d, not after the compaction at %d", loadRev, compactRev)
	}
	t.Logf("compacted at %d, reloaded at %d, head %d", compactRev, loadRev, head)

	cache0, fwd0, rej0 := c.rangeSources(t)
	notRetained0 := c.proxyMetric(t, mRanges, map[string]string{"source": "forwarded", "reason": "not_retained"})
	sweep(t, c, compactRev-2, head+1)
	cache1, fwd1, rej1 := c.rangeSources(t)
	notRetained1 := c.proxyMetric(t, mRanges, map[string]string{"source": "forwarded", "reason": "not_retained"})
	k := float64(len(sweepShapes))
	if got, want := notRetained1-notRetained0, float64(loadRev-compactRev)*k; got != want {
		t.Fatalf("%v reads forwarded as not retained, want %v (revisions %d..%d)", got, want, compactRev, loadRev-1)
	}
	if got, want := fwd1-fwd0, float64(loadRev-compactRev)*k; got != want {
		t.Fatalf("%v reads forwarded, want %v", got, want)
	}
	if got, want := cache1-cache0, float64(head-loadRev+1)*k; got != want {
		t.Fatalf("%v reads served from the cache, want %v", got, want)
	}
	// Two compacted revisions and the future one: etcd's verdicts through
	// the read fence's quorum read.
	if got, want := rej1-rej0, 3*k; got != want {
		t.Fatalf("%v reads refused as compacted or future, want %v", got, want)
	}
	// A read below the compaction is refused by both with etcd's error.
	_, err := c.mustSameRange(t, &pb.RangeRequest{Key: []byte("r/1"), Revision: compactRev - 1})
	if !isErr(err, rpctypes.ErrGRPCCompacted) {
		t.Fatalf("read below the compaction: %v", err)
	}
}

// TestRestartForwardsHistory: a restarted proxy without history replay
// forwards reads at revisions from before its load, equal to etcd's.
func TestRestartForwardsHistory(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	writeSome(t, c, "r/", 25)
	c.restartProxy(t, func() { writeDirect(t, c, 10) })
	head := c.etcdRev(t)
	loadRev := c.proxy.Store().OldestRev()
	if loadRev != head {
		t.Fatalf("restarted proxy loaded at %d, want etcd's head %d", loadRev, head)
	}
	cache0, fwd0, rej0 := c.rangeSources(t)
	n := sweep(t, c, 1, head+1)
	cache1, fwd1, rej1 := c.rangeSources(t)
	k := len(sweepShapes)
	// The head from the cache, the future revision refused with etcd's
	// verdict, every older one forwarded.
	if int(cache1-cache0) != k || int(fwd1-fwd0) != n-2*k || int(rej1-rej0) != k {
		t.Fatalf("after restart: cache %v forwarded %v rejected %v of %d; want only the head from cache", cache1-cache0, fwd1-fwd0, rej1-rej0, n)
	}
}

// TestRestartWithRetainedHistory: with LoadRetainedHistory the restarted
// proxy replays etcd's retained history, so reads at revisions from before
// the restart are served from the cache, and below etcd's compaction refused.
func TestRestartWithRetainedHistory(t *testing.T) {
	c := newCluster(t, clusterOptions{loadRetainedHistory: true})
	writeSome(t, c, "r/", 25)
	compactRev := c.etcdRev(t) - 10
	if _, err := c.direct.Compact(context.Background(), compactRev); err != nil {
		t.Fatal(err)
	}
	writeSome(t, c, "r/", 10)
	c.restartProxy(t, func() { writeDirect(t, c, 10) })
	head := c.etcdRev(t)
	if got := c.proxy.Store().OldestRev(); got != compactRev {
		t.Fatalf("restarted proxy's oldest snapshot %d, want etcd's compaction %d", got, compactRev)
	}
	cache0, fwd0, rej0 := c.rangeSources(t)
	n := sweep(t, c, compactRev-2, head+1)
	cache1, fwd1, rej1 := c.rangeSources(t)
	k := len(sweepShapes)
	// Two compacted revisions and the future one refused, nothing forwarded.
	if int(rej1-rej0) != 3*k || int(fwd1-fwd0) != 0 || int(cache1-cache0) != n-3*k {
		t.Fatalf("after restart with history: cache %v forwarded %v rejected %v of %d; want all retained revisions from cache",
			cache1-cache0, fwd1-fwd0, rej1-rej0, n)
	}
}

// TestFutureRevisionPromptWhenIdle: a Range at a revision past etcd's head
// must get etcd's "future revision" error after one progress round trip,
// not after the proxy's RevisionWait, also when etcd has had no write since
// the proxy loaded. etcd answers RequestProgress only once every watcher on
// the stream has start_revision <= its head (watchable_store.go
// progressIfSync: "if rev < w.startRev return false"), and the follower's
// watch starts at load revision + 1.
func TestFutureRevisionPromptWhenIdle(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	writeSome(t, c, "r/", 5)
	c.waitSynced(t)
	c.proxy.Stop()
	const wait = 3 * time.Second
	c.proxyCfg.RevisionWait = wait
	c.startProxy(t)
	testsupport.WaitFor(t, waitTimeout, "the upstream watch", c.proxy.Follower().Following)

	check := func(when string) {
		t.Helper()
		head := c.etcdRev(t)
		req := &pb.RangeRequest{Key: []byte("r/1"), Revision: head + 1}
		start := time.Now()
		_, err := c.mustSameRange(t, req)
		took := time.Since(start)
		if !isErr(err, rpctypes.ErrGRPCFutureRev) {
			t.Fatalf("%s: %v", when, err)
		}
		if took >= wait/2 {
			t.Errorf("%s: a Range at future revision %d took %v (RevisionWait %v): the progress request was not answered", when, head+1, took, wait)
		}
	}
	check("idle etcd right after the proxy loaded")
	if _, err := c.direct.Put(context.Background(), "r/1", "x"); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	check("after one more write")
}

// TestResumeAtNextAfterCompactionAtNext: while the proxy is cut off, etcd
// compacts exactly at the revision after the cache's. The cache still holds
// every revision below the compaction, so the proxy resumes from the next
// revision instead of reloading, and its watchers go on.
func TestResumeAtNextAfterCompactionAtNext(t *testing.T) {
	c := newCluster(t, clusterOptions{relay: true})
	writeSome(t, c, "n/", 5)
	c.waitSynced(t)
	before := c.proxy.Store().Rev()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wc := c.viaProxy.Watch(ctx, "r/", clientv3.WithPrefix(), clientv3.WithRev(before+1))

	c.cut(t)
	next := writeDirect(t, c, 1)
	if next != before+1 {
		t.Fatalf("wrote at %d, want %d", next, before+1)
	}
	if _, err := c.direct.Compact(context.Background(), next); err != nil {
		t.Fatal(err)
	}
	after := writeDirect(t, c, 3)
	c.relay.Restore()
	c.waitSynced(t)
	if n := c.proxyMetric(t, mReloads, nil); n != 0 {
		t.Fatalf("%v reloads; a compaction at the revision after the cache's needs none", n)
	}
	if n := c.proxyMetric(t, "etcd_snapcache_timeline_changes_total", nil); n != 0 {
		t.Fatalf("%v timeline changes counted", n)
	}
	if c.proxy.Store().Rev() < after {
		t.Fatalf("cache at %d, want %d", c.proxy.Store().Rev(), after)
	}
	select {
	case resp := <-wc:
		if resp.Canceled || resp.CompactRevision != 0 {
			t.Fatalf("the watcher was ended: %+v", resp)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the watcher got nothing")
	}
}
