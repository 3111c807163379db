package integration

// Watches that start before the proxy's history: after a restart the proxy
// holds events only from its load revision + 1 on, and catches older
// watches up from etcd (watchproxy/catchup.go). Their events must be
// exactly etcd's: no gap, no duplicate at the seam, the compaction cancel
// for a compacted start revision.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

const catchupMetric = "etcd_snapcache_watch_catchups_total"

// TestWatchDifferentialBeforeProxyHistory: after a restart, watches from
// revisions etcd retains but the proxy does not hold get every event as
// etcd sends it (every create shape), and watches from compacted revisions
// the compaction cancel.
func TestWatchDifferentialBeforeProxyHistory(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	write := func(n int, tag string) int64 {
		var rev int64
		for i := range n {
			k := fmt.Sprintf("h/%d", i%5)
			switch i % 6 {
			case 2:
				rev = w.del(k)
			case 4:
				rev = w.txn(clientv3.OpPut(k, tag), clientv3.OpPut("other/"+k, tag), clientv3.OpPut(k+"/x", tag))
			default:
				rev = w.put(k, fmt.Sprint(tag, i))
			}
		}
		return rev
	}
	write(12, "a")
	compactRev := write(3, "b") // a delete: the catch-up must show it (etcd bug #18089)
	if _, err := c.direct.Compact(context.Background(), compactRev); err != nil {
		t.Fatal(err)
	}
	write(10, "c")
	historyStart := c.restartProxy(t, func() { write(12, "d") })
	loadRev := historyStart - 1
	if loadRev <= compactRev+5 {
		t.Fatalf("the restarted proxy's history starts at %d, too close to the compaction at %d", historyStart, compactRev)
	}
	catchups0 := c.proxyMetric(t, catchupMetric, nil)

	pr := openStreamPair(t, c)
	h := func(start int64) *pb.WatchCreateRequest {
		return &pb.WatchCreateRequest{Key: []byte("h/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("h/")), StartRevision: start}
	}
	creates := []*pb.WatchCreateRequest{
		h(compactRev - 1), // 0: compacted
		{Key: []byte("h/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("h/")), StartRevision: compactRev, PrevKv: true},                 // 1: from the compaction
		{Key: []byte("h/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("h/")), StartRevision: compactRev + 3, Filters: filterNoPut},     // 2
		{Key: []byte("h/1"), StartRevision: compactRev + 1},                                                                              // 3: one key
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: loadRev},                                                                   // 4: exactly the load revision
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: historyStart},                                                              // 5: no catch-up
		{Key: []byte("h/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("h/")), StartRevision: compactRev, PrevKv: true, Fragment: true}, // 6
		h(1), // 7: long compacted
		{Key: []byte("h/2"), RangeEnd: fromKeyEnd, StartRevision: compactRev + 2, PrevKv: true, Filters: filterNoDelete}, // 8
		{Key: []byte("h/3"), RangeEnd: []byte("h/4\x00"), StartRevision: loadRev - 1},                                    // 9
	}
	for _, cr := range creates {
		pr.create(cr)
	}
	pr.waitCreated(len(creates))
	for _, s := range []*watchStream{pr.d, pr.p} {
		s.waitUntil("the compaction cancels", cancelsAtLeast(2))
	}
	for _, id := range []int64{0, 7} { // else no progress request is answered (see TestWatchDifferentialCompaction)
		pr.cancelWatch(id)
	}
	head := write(9, "e")
	c.waitSynced(t)
	pr.syncTo(head)
	d, p := pr.d.responses(), pr.p.responses()
	compareStreams(t, "before the proxy's history", d, p, compareOpts{quiescent: true})
	_, dw, _ := splitResponses(d)
	if evs := dw[1].events; len(evs) == 0 || evs[0].Kv.ModRevision != compactRev || evs[0].Type != mvccpb.DELETE {
		t.Fatalf("etcd's watch from the compaction revision %d does not start with the DELETE there:\n%s", compactRev, dumpResponses(d))
	}
	if n := c.proxyMetric(t, catchupMetric, nil) - catchups0; n < 7 {
		t.Fatalf("%v watches caught up from etcd, want the 7 that start before the proxy's history", n)
	}
}

// TestWatchCatchupUnderWrites: watches caught up from etcd while etcd keeps
// writing, so that the seam between etcd's history and the proxy's moves
// under them: still exactly etcd's events, none lost or repeated.
func TestWatchCatchupUnderWrites(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	start := w.put("s/0", "0")
	for i := 1; i < 20; i++ {
		w.put(fmt.Sprintf("s/%d", i%4), fmt.Sprint(i))
	}
	historyStart := c.restartProxy(t, func() {
		for i := range 20 {
			w.put(fmt.Sprintf("s/%d", i%4), fmt.Sprint("down", i))
		}
	})

	var wg sync.WaitGroup
	var stop atomic.Bool
	var last atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < 300 && !stop.Load(); i++ {
			r, err := c.direct.Put(context.Background(), fmt.Sprintf("s/%d", i%4), fmt.Sprint("live", i))
			if err != nil {
				t.Error(err)
				return
			}
			last.Store(r.Header.Revision)
		}
	}()
	defer func() { stop.Store(true); wg.Wait() }()

	pr := openStreamPair(t, c)
	var n int
	for _, from := range []int64{start, start + 7, historyStart - 3, historyStart - 1, historyStart} {
		pr.create(&pb.WatchCreateRequest{Key: []byte("s/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("s/")), StartRevision: from, PrevKv: true})
		pr.create(&pb.WatchCreateRequest{Key: []byte("s/1"), StartRevision: from})
		n += 2
	}
	pr.waitCreated(n)
	wg.Wait()
	head := last.Load()
	c.waitSynced(t)
	pr.syncTo(head)
	compareStreams(t, "catch-up under writes", pr.d.responses(), pr.p.responses(), compareOpts{})
}

// TestWatchCatchupLongHistory: a watch that starts more than 1000
// revisions before the proxy's history. etcd sends an unsynced watcher at
// most 1000 revisions per response (mvcc watchBatchMaxRevs) but heads each
// with its current revision, which is therefore no promise that the
// watcher has everything up to it: the catch-up must not stop there.
func TestWatchCatchupLongHistory(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	var first int64
	historyStart := c.restartProxy(t, func() {
		first = c.etcdRev(t) + 1
		parallelPuts(t, c.direct, 1100, 8, func(i int) string { return fmt.Sprintf("long/%03d", i%50) })
	})
	if historyStart-first < 1050 {
		t.Fatalf("only %d revisions before the proxy's history", historyStart-first)
	}
	pr := openStreamPair(t, c)
	pr.create(&pb.WatchCreateRequest{Key: []byte("long/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("long/")), StartRevision: first})
	pr.waitCreated(1)
	w := etcdWriter{t, c.direct}
	for i := range 3 {
		w.put(fmt.Sprintf("long/%03d", i), "after")
	}
	head := c.etcdRev(t)
	c.waitSynced(t)
	pr.syncTo(head)
	d, p := pr.d.responses(), pr.p.responses()
	_, dw, _ := splitResponses(d)
	_, pw, _ := splitResponses(p)
	if diff := servertest.DiffEvents(dw[0].events, pw[0].events); diff != "" {
		got := pw[0].events
		var gap string
		for i := 1; i < len(got); i++ {
			if got[i].Kv.ModRevision > got[i-1].Kv.ModRevision+1 {
				gap = fmt.Sprintf(" (the proxy jumps from revision %d to %d)", got[i-1].Kv.ModRevision, got[i].Kv.ModRevision)
				break
			}
		}
		t.Fatalf("watch from %d, %d revisions before the proxy's history at %d%s: %s", first, historyStart-first, historyStart, gap, diff)
	}
	compareStreams(t, "long catch-up", d, p, compareOpts{quiescent: true})
}

// TestWatchProgressAfterCatchup: a progress request right behind the create
// of a watch caught up from etcd is answered only after all of its events
// up to the notification's revision.
func TestWatchProgressAfterCatchup(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	first := w.put("pc/0", "0")
	c.restartProxy(t, func() {
		parallelPuts(t, c.direct, 300, 8, func(i int) string { return fmt.Sprintf("pc/%d", i%7) })
	})
	head := w.put("pc/1", "after")
	c.waitSynced(t)
	cr := &pb.WatchCreateRequest{Key: []byte("pc/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("pc/")), StartRevision: first, PrevKv: true}
	want := referenceEvents(t, c, cr, head)

	checkProgressBehindHistory(t, c, "pc/", cr, want, head)
}

// TestWatchDifferentialRetainedHistory: a proxy started with
// LoadRetainedHistory loads at etcd's compaction revision and replays the
// rest, so watches from any retained revision get etcd's events: the one
// from the compaction revision, whose events the load did not see, through
// a catch-up, with the DELETE at that revision.
func TestWatchDifferentialRetainedHistory(t *testing.T) {
	c := newCluster(t, clusterOptions{loadRetainedHistory: true})
	w := etcdWriter{t, c.direct}
	w.put("rh/a", "1")
	w.put("rh/b", "1")
	w.txn(clientv3.OpPut("rh/a", "2"), clientv3.OpPut("rh/c", "1"))
	compactRev := w.del("rh/b")
	w.put("rh/b", "2")
	if _, err := c.direct.Compact(context.Background(), compactRev); err != nil {
		t.Fatal(err)
	}
	historyStart := c.restartProxy(t, func() {
		w.txn(clientv3.OpDelete("rh/a"), clientv3.OpPut("rh/d", "1"))
		w.put("rh/c", "2")
	})
	if historyStart != compactRev+1 {
		t.Fatalf("the proxy's history starts at %d, want after the compaction at %d", historyStart, compactRev)
	}
	pr := openStreamPair(t, c)
	for _, start := range []int64{compactRev - 1, compactRev, compactRev + 1, compactRev + 2} {
		pr.create(&pb.WatchCreateRequest{Key: []byte("rh/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("rh/")), StartRevision: start})
		pr.create(&pb.WatchCreateRequest{Key: []byte("rh/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("rh/")), StartRevision: start, PrevKv: true})
	}
	pr.waitCreated(8)
	for _, s := range []*watchStream{pr.d, pr.p} {
		s.waitUntil("the compaction cancels", cancelsAtLeast(2))
	}
	pr.cancelWatch(0)
	pr.cancelWatch(1)
	head := w.put("rh/a", "3")
	c.waitSynced(t)
	pr.syncTo(head)
	d, p := pr.d.responses(), pr.p.responses()
	compareStreams(t, "retained history", d, p, compareOpts{quiescent: true})
	_, pw, _ := splitResponses(p)
	if evs := pw[2].events; len(evs) == 0 || evs[0].Kv.ModRevision != compactRev || evs[0].Type != mvccpb.DELETE {
		t.Fatalf("the proxy's watch from the compaction revision %d does not start with the DELETE there:\n%s", compactRev, dumpResponses(p))
	}
}

// TestWatchCatchupWatchIDReuse: a client-chosen watch id canceled while its
// watch is being caught up from etcd, and created again at once: what the
// first catch-up still had in flight must not reach the new watch. Each
// incarnation of the id gets only events from its own start revision, in
// order, and the last one exactly etcd's.
func TestWatchCatchupWatchIDReuse(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	var first int64
	historyStart := c.restartProxy(t, func() {
		first = c.etcdRev(t) + 1
		parallelPuts(t, c.direct, 400, 8, func(i int) string { return fmt.Sprintf("reuse/%02d", i%20) })
	})
	const cycles = 100
	starts := make([]int64, 0, cycles+1)
	s := openWatchStream(t, c.viaProxy.ActiveConnection(), "proxy")
	create := func(start int64) {
		starts = append(starts, start)
		s.create(&pb.WatchCreateRequest{Key: []byte("reuse/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("reuse/")), WatchId: 5, StartRevision: start, PrevKv: true})
	}
	for i := range cycles {
		create(first + int64(i*9)%(historyStart-first))
		s.cancelWatch(5)
	}
	final := first + 100
	create(final)
	s.waitCreated(cycles + 1)
	head := etcdWriter{t, c.direct}.put("reuse/00", "after")
	c.waitSynced(t)
	want := referenceEvents(t, c, &pb.WatchCreateRequest{Key: []byte("reuse/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("reuse/")), StartRevision: final, PrevKv: true}, head)
	log := s.syncTo(head)
	checkStream(t, "proxy", log, true)

	// Sort the events by incarnation of id 5.
	k := -1
	var evs [][]*pb.WatchResponse
	for i, r := range log {
		switch {
		case r.Created:
			k++
			evs = append(evs, nil)
		case len(r.Events) > 0:
			if k < 0 {
				t.Fatalf("events before any created response:\n%s", dumpResponses(log))
			}
			if r.Events[0].Kv.ModRevision < starts[k] {
				t.Fatalf("response %d: incarnation %d of watch 5 starts at %d but gets an event at %d (of an earlier incarnation's catch-up):\n%s",
					i, k, starts[k], r.Events[0].Kv.ModRevision, dumpResponses(log[max(0, i-10):min(len(log), i+5)]))
			}
			evs[k] = append(evs[k], r)
		}
	}
	var got []*mvccpb.Event
	for _, r := range evs[cycles] {
		got = append(got, r.Events...)
	}
	if diff := servertest.DiffEvents(want, got); diff != "" {
		t.Fatalf("the last incarnation of watch 5, from %d: %s", final, diff)
	}
}
