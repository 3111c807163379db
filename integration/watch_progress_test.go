package integration

// Progress notifications through the proxy: requested (watch id -1) and
// periodic (progress_notify). A notification at R promises that every event
// at or below R has been sent on the stream (etcd bug #15220, kine #731),
// and a requested one reports at least etcd's revision when the request was
// sent (kube-apiserver's consistent reads from its watch cache rely on it).

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3rpc"
)

// progressCount counts requested progress notifications in log.
func progressCount(log []*pb.WatchResponse) int {
	n := 0
	for _, r := range log {
		if isProgress(r) && r.WatchId == clientv3.InvalidWatchID {
			n++
		}
	}
	return n
}

// nthProgress returns the index in log of the n-th (from 1) requested
// progress notification, or -1.
func nthProgress(log []*pb.WatchResponse, n int) int {
	for i, r := range log {
		if isProgress(r) && r.WatchId == clientv3.InvalidWatchID {
			n--
			if n == 0 {
				return i
			}
		}
	}
	return -1
}

// TestWatchProgressRequestedSynced: on a stream whose watchers are all
// synced, RequestProgress is answered as etcd answers it (watch id -1, the
// current revision, etcd's header); after a write straight to etcd, with at
// least that write's revision, after its event.
func TestWatchProgressRequestedSynced(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	for i := range 5 {
		w.put(fmt.Sprintf("p/%d", i), "0")
	}
	c.waitSynced(t)
	pr := openStreamPair(t, c)
	pr.create(&pb.WatchCreateRequest{Key: []byte("p/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("p/")), PrevKv: true})
	pr.create(&pb.WatchCreateRequest{Key: []byte("p/3")})
	pr.create(&pb.WatchCreateRequest{Key: []byte("q/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("q/"))}) // never an event
	pr.waitCreated(3)

	// Quiescent: the same answer as etcd's, at etcd's revision.
	head := c.etcdRev(t)
	pr.d.requestProgress()
	pr.p.requestProgress()
	d := pr.d.waitUntil("a progress notification", func(l []*pb.WatchResponse) bool { return progressCount(l) == 1 })
	p := pr.p.waitUntil("a progress notification", func(l []*pb.WatchResponse) bool { return progressCount(l) == 1 })
	dp, pp := d[nthProgress(d, 1)], p[nthProgress(p, 1)]
	if !proto.Equal(dp, pp) || pp.Header.Revision != head {
		t.Fatalf("progress at etcd's revision %d:\netcd:  %s\nproxy: %s", head, fmtMsg(dp), fmtMsg(pp))
	}

	// After writes straight to etcd: at least the write's revision, and
	// only after its event.
	s := pr.p
	want := 1
	for i := range 40 {
		var rev int64
		switch i % 3 {
		case 0:
			rev = w.put(fmt.Sprintf("p/%d", i%5), fmt.Sprint(i))
		case 1:
			rev = w.txn(clientv3.OpPut("p/3", fmt.Sprint(i)), clientv3.OpPut("x", "y"))
		case 2:
			rev = w.put("elsewhere", fmt.Sprint(i)) // no watcher's event
		}
		s.requestProgress()
		want++
		log := s.waitUntil("a progress notification", func(l []*pb.WatchResponse) bool { return progressCount(l) >= want })
		r := log[nthProgress(log, want)]
		if r.Header.Revision < rev {
			t.Fatalf("progress requested after etcd's write at %d reports %d:\n%s", rev, r.Header.Revision, dumpResponses(log))
		}
	}
	head = c.etcdRev(t)
	pr.syncTo(head)
	compareStreams(t, "progress while synced", pr.d.responses(), pr.p.responses(), compareOpts{quiescent: true})
}

// TestWatchProgressUnsyncedWatcher: a requested progress notification on a
// stream whose watcher still has hundreds of revisions of history to send
// (more than one pass of the send loop) comes after all of them.
func TestWatchProgressUnsyncedWatcher(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	first := c.etcdRev(t) + 1
	parallelPuts(t, c.direct, 700, 8, func(i int) string { return fmt.Sprintf("u/%02d", i%40) })
	c.waitSynced(t)
	head := c.etcdRev(t)
	cr := &pb.WatchCreateRequest{Key: []byte("u/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("u/")), StartRevision: first, PrevKv: true}
	want := referenceEvents(t, c, cr, head)

	checkProgressBehindHistory(t, c, "u/", cr, want, head)
}

// TestWatchProgressUnderWrites: while another goroutine writes 500 times,
// RequestProgress is sent after every acknowledged write (up to four
// unanswered). For every
// requested notification at R: R > 0, R never goes back, no event at or
// below R follows it on the stream, and R is at least the revision of
// every write etcd had acknowledged before the request was sent. Each
// watch's events equal etcd's.
func TestWatchProgressUnderWrites(t *testing.T) { testWatchProgressUnderWrites(t, clusterOptions{}) }

func testWatchProgressUnderWrites(t *testing.T, opts clusterOptions) {
	c := newCluster(t, opts)
	w := etcdWriter{t, c.direct}
	first := w.put("c/0", "0")
	for i := 1; i < 30; i++ {
		w.put(fmt.Sprintf("c/%d", i%10), "0")
	}
	c.waitSynced(t)
	pr := openStreamPair(t, c)
	creates := []*pb.WatchCreateRequest{
		{Key: []byte("c/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("c/")), PrevKv: true},
		{Key: []byte("c/1")},
		{Key: []byte{0}, RangeEnd: fromKeyEnd, Filters: filterNoDelete},
		{Key: []byte("c/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("c/")), StartRevision: first}, // from the past
		{Key: []byte("c/5"), RangeEnd: fromKeyEnd, Filters: filterNoPut, PrevKv: true},
	}
	for _, cr := range creates {
		pr.create(cr)
	}
	pr.waitCreated(len(creates))

	var acked atomic.Int64
	acked.Store(c.etcdRev(t))
	var wg sync.WaitGroup
	ackc := make(chan struct{}, 1) // a write was acknowledged
	writerDone := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(writerDone)
		ctx := context.Background()
		for i := range 500 {
			k := fmt.Sprintf("c/%d", i%10)
			var err error
			var rev int64
			switch i % 5 {
			case 3:
				var r *clientv3.DeleteResponse
				if r, err = c.direct.Delete(ctx, k); err == nil {
					rev = r.Header.Revision
				}
			case 4:
				var r *clientv3.TxnResponse
				if r, err = c.direct.Txn(ctx).Then(clientv3.OpPut(k, "t"), clientv3.OpPut("d/"+k, "t")).Commit(); err == nil {
					rev = r.Header.Revision
				}
			default:
				var r *clientv3.PutResponse
				if r, err = c.direct.Put(ctx, k, fmt.Sprint(i)); err == nil {
					rev = r.Header.Revision
				}
			}
			if err != nil {
				t.Error(err)
				return
			}
			acked.Store(rev) // one writer: revisions only grow
			select {
			case ackc <- struct{}{}:
			default:
			}
		}
	}()
	defer wg.Wait()

	// A request right after each acknowledged write, up to four unanswered:
	// the moment where an answer below that write would show.
	s := pr.p
	var floors []int64 // etcd's acknowledged revision before each request
loop:
	for len(floors) < 2000 {
		select {
		case <-ackc:
		case <-writerDone:
			break loop
		}
		floors = append(floors, acked.Load())
		s.requestProgress()
		n := len(floors) - 3
		s.waitUntil("progress answers", func(l []*pb.WatchResponse) bool { return progressCount(l) >= n })
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	n := len(floors)
	s.waitUntil("every progress answer", func(l []*pb.WatchResponse) bool { return progressCount(l) >= n })
	head := c.etcdRev(t)
	c.waitSynced(t)
	pr.syncTo(head)
	p := pr.p.responses()
	if got := progressCount(p); got < n+1 {
		t.Fatalf("%d progress notifications for %d requests", got, n+1)
	}
	for k, floor := range floors {
		i := nthProgress(p, k+1)
		if r := p[i].Header.Revision; r < floor {
			t.Fatalf("progress request %d, sent after etcd acknowledged revision %d, answered with revision %d (response %d):\n%s",
				k+1, floor, r, i, dumpResponses(p[max(0, i-20):min(len(p), i+5)]))
		}
	}
	t.Logf("%d progress requests during 500 writes", n)
	compareStreams(t, "progress under writes", pr.d.responses(), p, compareOpts{})
}

// TestWatchProgressNotifyPeriodic: with a progress interval of 200 ms, an
// idle progress_notify watcher gets periodic notifications with its own
// watch id at the current revision, as from etcd with the same interval;
// a watcher without progress_notify gets none.
func TestWatchProgressNotifyPeriodic(t *testing.T) {
	const interval = 200 * time.Millisecond
	c := newCluster(t, clusterOptions{progressNotifyInterval: interval})
	// etcd's interval is process-wide and read when a stream starts; the
	// embedded etcds of the other tests use the default.
	v3rpc.SetProgressReportInterval(interval)
	t.Cleanup(func() { v3rpc.SetProgressReportInterval(10 * time.Minute) })
	w := etcdWriter{t, c.direct}
	w.put("pn/idle", "0")
	head := w.put("pn/busy", "0")
	c.waitSynced(t)

	pr := openStreamPair(t, c)
	pr.create(&pb.WatchCreateRequest{Key: []byte("pn/idle"), ProgressNotify: true})                                                  // 0
	pr.create(&pb.WatchCreateRequest{Key: []byte("pn/idle")})                                                                        // 1: none
	pr.create(&pb.WatchCreateRequest{Key: []byte("pn/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("pn/")), ProgressNotify: true}) // 2
	pr.waitCreated(3)
	periodic := func(id int64, atLeast int, rev int64) func([]*pb.WatchResponse) bool {
		return func(l []*pb.WatchResponse) bool {
			n := 0
			for _, r := range l {
				if isProgress(r) && r.WatchId == id && r.Header.Revision >= rev {
					n++
				}
			}
			return n >= atLeast
		}
	}
	for _, s := range []*watchStream{pr.d, pr.p} {
		log := s.waitUntil("two periodic notifications of watch 0", periodic(0, 2, 0))
		_, ws, req := splitResponses(log)
		if len(req) != 0 {
			t.Fatalf("%s: requested progress notifications without a request:\n%s", s.name, dumpResponses(log))
		}
		if len(ws[1].progress) != 0 {
			t.Fatalf("%s: periodic progress for a watcher without progress_notify:\n%s", s.name, dumpResponses(log))
		}
		for _, r := range ws[0].progress {
			if r.Header.Revision != head {
				t.Fatalf("%s: periodic progress at %d, etcd's revision is %d:\n%s", s.name, r.Header.Revision, head, dumpResponses(log))
			}
		}
	}
	// Quiescent notifications are etcd's, header included.
	dl, pl := pr.d.responses(), pr.p.responses()
	_, dw, _ := splitResponses(dl)
	_, pw, _ := splitResponses(pl)
	if !proto.Equal(dw[0].progress[0], pw[0].progress[0]) {
		t.Fatalf("periodic progress:\netcd:  %s\nproxy: %s", fmtMsg(dw[0].progress[0]), fmtMsg(pw[0].progress[0]))
	}

	// After a write: an event for watch 2, then notifications at the new
	// revision for both progress_notify watchers, none older after it.
	head = w.put("pn/busy", "1")
	for _, s := range []*watchStream{pr.d, pr.p} {
		log := s.waitUntil("periodic notifications at the new revision", func(l []*pb.WatchResponse) bool {
			return periodic(0, 1, head)(l) && periodic(2, 1, head)(l)
		})
		checkStream(t, s.name, log, s == pr.p)
		_, ws, _ := splitResponses(log)
		if len(ws[1].progress) != 0 {
			t.Fatalf("%s: periodic progress for a watcher without progress_notify:\n%s", s.name, dumpResponses(log))
		}
		if len(ws[2].events) != 1 {
			t.Fatalf("%s: watch 2 got %d events, want 1:\n%s", s.name, len(ws[2].events), dumpResponses(log))
		}
	}
}

// TestWatchProgressNotifyFollowsEtcd: without an interval of its own, the
// proxy sends periodic notifications at etcd's interval (etcd's e2e
// TestWatchDelayForPeriodicProgressNotification runs etcd with a short
// one), which it learns from an idle upstream watch: an idle
// progress_notify watcher gets them as often as from etcd, and etcd serves
// two upstream watches whatever the number of client watchers.
func TestWatchProgressNotifyFollowsEtcd(t *testing.T) {
	const interval = 200 * time.Millisecond
	// etcd reads its interval when a watch stream starts: set it before
	// the proxy opens its upstream watches.
	v3rpc.SetProgressReportInterval(interval)
	t.Cleanup(func() { v3rpc.SetProgressReportInterval(10 * time.Minute) })
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	head := w.put("pf/idle", "0")
	c.waitSynced(t)

	pr := openStreamPair(t, c)
	pr.create(&pb.WatchCreateRequest{Key: []byte("pf/idle"), ProgressNotify: true})
	pr.waitCreated(1)
	for _, s := range []*watchStream{pr.d, pr.p} {
		log := s.waitUntil("three periodic notifications", func(l []*pb.WatchResponse) bool {
			n := 0
			for _, r := range l {
				if isProgress(r) && r.WatchId == 0 && r.Header.Revision == head {
					n++
				}
			}
			return n >= 3
		})
		checkStream(t, s.name, log, s == pr.p)
	}
}
