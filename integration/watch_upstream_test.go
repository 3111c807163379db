package integration

// The proxy serves every client watch from its own history: etcd sees one
// watch, the follower's, however many clients watch through the proxy.

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// etcd's gauge of its watchers; process-wide, over every embedded etcd of
// the test binary (one at a time: the tests are not parallel).
const etcdWatcherGauge = "etcd_debugging_mvcc_watcher_total"

func etcdWatcherCount(t *testing.T) float64 {
	t.Helper()
	return metricSum(t, prometheus.DefaultGatherer, etcdWatcherGauge, nil)
}

// openWatchers opens streams streams on conn with perStream watches each,
// of several shapes and start revisions from first on, and waits for their
// created responses.
func openWatchers(t *testing.T, c *cluster, name string, streams, perStream int, first int64, useProxy bool) []*watchStream {
	t.Helper()
	var out []*watchStream
	for i := range streams {
		conn := c.direct.ActiveConnection()
		if useProxy {
			conn = c.viaProxy.ActiveConnection()
		}
		s := openWatchStream(t, conn, fmt.Sprintf("%s stream %d", name, i))
		for j := range perStream {
			cr := &pb.WatchCreateRequest{Key: []byte(fmt.Sprintf("up/%d", j%10))}
			switch j % 4 {
			case 1:
				cr.Key, cr.RangeEnd, cr.PrevKv = []byte("up/"), []byte(clientv3.GetPrefixRangeEnd("up/")), true
			case 2:
				cr.StartRevision = first + int64(j%5)
			case 3:
				cr.Key, cr.RangeEnd, cr.ProgressNotify = []byte("up/5"), fromKeyEnd, true
			}
			s.create(cr)
		}
		out = append(out, s)
	}
	for _, s := range out {
		s.waitCreated(perStream)
	}
	return out
}

// TestWatchUpstreamSingleWatch: 200 watches on 10 proxy streams add no
// watcher to etcd, receive their events, and leave none behind; the same
// watches straight on etcd do add 200 (the gauge is live).
func TestWatchUpstreamSingleWatch(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	first := w.putEach("up/", 10, "0")
	c.waitSynced(t)
	base := etcdWatcherCount(t)

	streams := openWatchers(t, c, "proxy", 10, 20, first, true)
	var head int64
	for i := range 10 {
		head = w.put(fmt.Sprintf("up/%d", i), "1")
	}
	c.waitSynced(t)
	for _, s := range streams {
		log := s.syncTo(head)
		checkStream(t, s.name, log, true)
		_, ws, _ := splitResponses(log)
		if len(ws) != 20 {
			t.Fatalf("%s: %d watches", s.name, len(ws))
		}
		for id, w := range ws {
			if len(w.events) == 0 {
				t.Fatalf("%s: watch %d got no events:\n%s", s.name, id, dumpResponses(log))
			}
		}
	}
	if got := etcdWatcherCount(t); got != base {
		t.Fatalf("etcd has %v watchers with 200 watches through the proxy, %v before: want the same", got, base)
	}
	if got := c.proxyMetric(t, "etcd_snapcache_watchers", nil); got != 200 {
		t.Fatalf("the proxy counts %v watchers, want 200", got)
	}
	for _, s := range streams {
		s.close()
	}
	testsupport.WaitFor(t, waitTimeout, "the proxy's watchers to go", func() bool { return c.proxyMetric(t, "etcd_snapcache_watchers", nil) == 0 })
	if got := etcdWatcherCount(t); got != base {
		t.Fatalf("etcd has %v watchers after the proxy's streams closed, %v before", got, base)
	}

	// The gauge is live: the same watches straight on etcd count.
	direct := openWatchers(t, c, "etcd", 2, 20, first, false)
	if got := etcdWatcherCount(t); got != base+40 {
		t.Fatalf("etcd has %v watchers with 40 direct watches, %v before", got, base)
	}
	for _, s := range direct {
		s.close()
	}
	testsupport.WaitFor(t, waitTimeout, "etcd's direct watchers to go", func() bool { return etcdWatcherCount(t) == base })
}

// TestWatchCatchupReleasesUpstreamWatches: watches caught up from etcd after
// a restart use upstream watches only while they catch up: once they are
// served from the proxy's history, etcd is back to the follower's watch.
func TestWatchCatchupReleasesUpstreamWatches(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	first := w.putEach("up/", 10, "0")
	c.waitSynced(t)
	base := etcdWatcherCount(t)
	c.restartProxy(t, func() {
		for i := range 10 {
			w.put(fmt.Sprintf("up/%d", i), "down")
		}
	})
	// The old follower's watch ends asynchronously on etcd's side.
	testsupport.WaitFor(t, waitTimeout, "etcd to count the restarted proxy's one watch", func() bool { return etcdWatcherCount(t) == base })

	streams := openWatchers(t, c, "proxy", 4, 20, first, true)
	head := w.put("up/1", "after")
	c.waitSynced(t)
	for _, s := range streams {
		// Answered only once no watcher of the stream is catching up.
		checkStream(t, s.name, s.syncTo(head), true)
	}
	if n := c.proxyMetric(t, catchupMetric, nil); n == 0 {
		t.Fatal("no watcher was caught up from etcd: the test does not exercise catch-ups")
	}
	testsupport.WaitFor(t, waitTimeout, "etcd to be back to the follower's one watch", func() bool { return etcdWatcherCount(t) == base })

	// Catch-ups cut short: watches canceled, and a stream gone, while they
	// are being caught up.
	canceled := openWatchStream(t, c.viaProxy.ActiveConnection(), "canceled")
	gone := openWatchStream(t, c.viaProxy.ActiveConnection(), "gone")
	for i := range 10 {
		cr := &pb.WatchCreateRequest{Key: []byte("up/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("up/")), StartRevision: first + int64(i)}
		canceled.create(cr)
		canceled.cancelWatch(int64(i))
		gone.create(cr)
	}
	gone.close()
	log := canceled.waitUntil("10 cancels", cancelsAtLeast(10))
	checkStream(t, canceled.name, log, true)
	testsupport.WaitFor(t, waitTimeout, "etcd to be back to the follower's one watch after cut-short catch-ups", func() bool { return etcdWatcherCount(t) == base })
}
