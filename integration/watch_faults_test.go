package integration

// The watch-path faults of issue 11, against real etcd: a compaction
// mirrored above the cache's head, catch-ups that stall on clients that do
// not read, and a catch-up that fails.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// prefixWatch is a create request for every key under prefix.
func prefixWatch(prefix string, start int64, prevKV bool) *pb.WatchCreateRequest {
	return &pb.WatchCreateRequest{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), StartRevision: start, PrevKv: prevKV}
}

// TestWatchCompactionAboveHeadKeepsSyncedWatchers: etcd compacts at a
// revision the proxy's feed has not delivered yet, and the proxy mirrors
// it (as it mirrors a Compact sent through it during a write burst): the
// watchers at the head, and one created at the head afterwards, are not
// canceled, and get exactly etcd's events, but for prev_kv, which etcd
// reads when it sends an event: the proxy sends these events after the
// compaction, as an etcd whose send loop ran after it would, without the
// prev_kv of revisions up to the compaction. A watch that starts below the
// compaction is canceled, as etcd cancels it.
func TestWatchCompactionAboveHeadKeepsSyncedWatchers(t *testing.T) {
	var relay *testsupport.Relay
	c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) {
		relay = testsupport.NewRelay(t, strings.TrimPrefix(cfg.Endpoints[0], "http://"))
		cfg.Endpoints = []string{"http://" + relay.Addr()}
	}})
	w := etcdWriter{t, c.direct}
	w.put("ca/a", "0")
	c.waitSynced(t)
	head := c.proxy.Store().Rev()
	pr := openStreamPair(t, c)
	pr.create(prefixWatch("ca/", 0, true))
	pr.waitCreated(1)

	// The feed falls behind without breaking; etcd writes and compacts.
	relay.Stall()
	for i := range 10 {
		w.put(fmt.Sprintf("ca/%d", i%3), fmt.Sprint("v", i))
	}
	compactRev := head + 6
	if _, err := c.direct.Compact(context.Background(), compactRev); err != nil {
		t.Fatal(err)
	}
	c.proxy.Follower().ObserveCompaction(compactRev, "proxy") // what kvproxy does once etcd acknowledged it
	if rev := c.proxy.Store().Rev(); rev != head {
		t.Fatalf("the proxy's feed moved to %d while stalled at %d", rev, head)
	}
	late := openWatchStream(t, c.viaProxy.ActiveConnection(), "proxy, created after the compaction")
	late.create(prefixWatch("ca/", 0, true))          // 0: at the proxy's head
	late.create(prefixWatch("ca/", head+1, true))     // 1: below the compaction, which etcd's head is past
	late.create(prefixWatch("ca/", compactRev, true)) // 2: from the compaction
	late.waitCreated(3)
	relay.Flow()
	late.waitUntil("the cancel of the watch below the compaction", cancelsAtLeast(1))
	late.cancelWatch(1) // else, as in etcd, no progress request is answered

	final := w.put("ca/a", "final")
	c.waitSynced(t)
	pr.syncTo(final)
	late.syncTo(final)
	d := pr.d.responses()
	// etcd's send loop, fast, read those prev_kv before the compaction.
	d = sentAfterCompaction(d, compactRev)
	compareStreams(t, "a compaction above the proxy's head", d, pr.p.responses(), compareOpts{quiescent: true})

	_, dw, _ := splitResponses(d)
	want := dw[0].events
	_, lw, _ := splitResponses(late.responses())
	if lw[0].canceled != nil || lw[2].canceled != nil {
		t.Fatalf("a synced watch created after the compaction was canceled:\n%s", dumpResponses(late.responses()))
	}
	if diff := servertest.DiffEvents(want, lw[0].events); diff != "" {
		t.Fatalf("watch created at the proxy's head after the compaction: %s", diff)
	}
	var fromCompaction []*mvccpb.Event
	for _, ev := range want {
		if ev.Kv.ModRevision >= compactRev {
			fromCompaction = append(fromCompaction, ev)
		}
	}
	if diff := servertest.DiffEvents(fromCompaction, lw[2].events); diff != "" {
		t.Fatalf("watch from the compaction revision: %s", diff)
	}
	if r := lw[1].canceled; r == nil || r.CompactRevision != compactRev || r.Header.GetRevision() != 0 || len(lw[1].events) != 0 {
		t.Fatalf("the watch from %d, below the compaction at %d, was not canceled as etcd cancels it:\n%s", head+1, compactRev, dumpResponses(late.responses()))
	}
}

// sentAfterCompaction returns etcd's watch responses as etcd would send
// them after compacting at compactRev: its send loop reads each event's
// prev_kv at mod_revision-1 then, and sends the event without it where
// that revision is compacted.
func sentAfterCompaction(resps []*pb.WatchResponse, compactRev int64) []*pb.WatchResponse {
	out := make([]*pb.WatchResponse, len(resps))
	for i, r := range resps {
		r = proto.Clone(r).(*pb.WatchResponse)
		for _, ev := range r.Events {
			if ev.Kv.ModRevision <= compactRev {
				ev.PrevKv = nil
			}
		}
		out[i] = r
	}
	return out
}

// writeRevisions writes n revisions to keys keys under prefix, with values
// of size bytes, from 8 writers, and returns the first revision written.
func writeRevisions(tb testing.TB, cli *clientv3.Client, prefix string, n, keys, size int) int64 {
	tb.Helper()
	value := strings.Repeat("x", size)
	var next atomic.Int64
	first := int64(0)
	var firstOnce sync.Once
	var wg sync.WaitGroup
	errc := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				r, err := cli.Put(context.Background(), fmt.Sprintf("%s%02d", prefix, i%int64(keys)), value)
				if err != nil {
					errc <- err
					return
				}
				if i == 0 {
					firstOnce.Do(func() { first = r.Header.Revision })
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	if err := <-errc; err != nil {
		tb.Fatal(err)
	}
	return first
}

// stalledConn dials addr with a fixed 64 KiB stream window, the least
// grpc-go allows: a stream that is never read blocks its sender after that
// much, however long it lasts (with the default dynamic window, up to
// megabytes are taken in first).
func stalledConn(tb testing.TB, addr string) *grpc.ClientConn {
	tb.Helper()
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(65535),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1<<30)))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	return conn
}

// TestWatchCatchupStalledClientsDoNotStarveOthers: after a restart, eight
// clients resume watches from before the proxy's history and then stop
// reading, with more of etcd's history still to relay to them; their
// catch-ups hold every catch-up slot. A ninth client that resumes from an
// old revision still gets all of etcd's events.
func TestWatchCatchupStalledClientsDoNotStarveOthers(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	var first int64
	c.restartProxy(t, func() {
		// More than 2000 revisions: etcd sends a watcher that is not synced
		// at most 1000 revisions per response, and a stalled catch-up must
		// have a third response to hand over while its stream's send loop
		// is blocked sending the second.
		first = writeRevisions(t, c.direct, "sc/", 2100, 40, 200)
	})
	running := func() float64 { return c.proxyMetric(t, "etcd_snapcache_watch_catchups_running", nil) }
	stalls := func() float64 {
		return c.proxyMetric(t, "etcd_snapcache_watch_catchup_restarts_total", map[string]string{"reason": "stalled"})
	}

	conn := stalledConn(t, c.proxyAddr)
	for i := range 8 {
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		ws, err := pb.NewWatchClient(conn).Watch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := ws.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: prefixWatch("sc/", first+int64(i), false)}}); err != nil {
			t.Fatal(err)
		}
	}
	// The eight catch-ups took every slot; the ninth's waits for one. (Each
	// is blocked before it could finish: its client reads nothing.)
	testsupport.WaitFor(t, waitTimeout, "eight catch-ups to start", func() bool {
		return c.proxyMetric(t, catchupMetric, nil) >= 8
	})

	head := c.etcdRev(t)
	cr := prefixWatch("sc/", first, true)
	want := referenceEvents(t, c, cr, head)
	ninth := openWatchStream(t, c.viaProxy.ActiveConnection(), "the ninth client")
	ninth.create(cr)
	ninth.waitCreated(1)
	ninth.syncTo(head)
	_, ws, _ := splitResponses(ninth.responses())
	if diff := servertest.DiffEvents(want, eventsUpTo(ws[0].events, head)); diff != "" {
		t.Fatalf("the ninth client's watch from %d: %s", first, diff)
	}
	testsupport.WaitFor(t, waitTimeout, "the eight stalled catch-ups to give their slots up", func() bool {
		return stalls() >= 8 && running() == 0
	})
}

// TestWatchCatchupFailureEndsOnlyThatWatcher: a catch-up that fails for
// good (here etcd's response is over the proxy's --max-recv-bytes) ends
// its own watcher, with a canceled response and the reason; the stream and
// its other watcher go on.
func TestWatchCatchupFailureEndsOnlyThatWatcher(t *testing.T) {
	c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) {
		cfg.MaxRecvBytes = 64 << 10
	}})
	w := etcdWriter{t, c.direct}
	var first int64
	c.restartProxy(t, func() {
		first = writeRevisions(t, c.direct, "cf/", 100, 4, 2000) // one catch-up response of about 400 KiB, with prev_kv
	})
	s := openWatchStream(t, c.viaProxy.ActiveConnection(), "proxy")
	s.create(&pb.WatchCreateRequest{Key: []byte("cf-live")})
	s.create(prefixWatch("cf/", first, false))
	s.waitCreated(2)
	s.waitUntil("the failed catch-up's cancel", cancelsAtLeast(1))

	rev := w.put("cf-live", "v")
	log := s.syncTo(rev)
	_, ws, _ := splitResponses(log)
	if r := ws[1].canceled; r == nil || r.CompactRevision != 0 || !strings.Contains(r.CancelReason, codes.ResourceExhausted.String()) || len(ws[1].events) != 0 {
		t.Fatalf("the failed catch-up's watch: want a cancel with the reason:\n%s", dumpResponses(log))
	}
	if evs := ws[0].events; len(evs) != 1 || evs[0].Kv.ModRevision != rev {
		t.Fatalf("the other watch of the stream: want the event at %d:\n%s", rev, dumpResponses(log))
	}
}
