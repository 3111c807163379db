package integration

// Differential Watch tests: the same raw Watch requests on a stream to etcd
// and on a stream to the proxy, the same writes, and a comparison of what
// etcd determines (see compareStreams): the created responses, each watch's exact
// events, and its cancel. How etcd batches events into responses depends on
// timing and is not compared, except for fragmenting watchers.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/storage/mvcc"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

var (
	filterNoPut    = []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NOPUT}
	filterNoDelete = []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NODELETE}
	fromKeyEnd     = []byte{0}
)

// TestWatchDifferentialCreateOptions: every shape of create request, on one
// stream, against history and live writes: single key, [key, end), prefix,
// from key, whole keyspace, empty key; start revision past, 0, exactly the
// head, the next one and future; prev_kv; NOPUT and NODELETE; progress_notify;
// fragment; client-chosen and duplicate ids; refused creates (inverted or
// empty range, negative start revision); cancels, of a known and an
// unknown id.
func TestWatchDifferentialCreateOptions(t *testing.T) {
	testWatchDifferentialCreateOptions(t, clusterOptions{})
}

func testWatchDifferentialCreateOptions(t *testing.T, opts clusterOptions) {
	c := newCluster(t, opts)
	ctx := context.Background()
	w := etcdWriter{t, c.direct}
	lease, err := c.direct.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}

	// History: single and multi-event revisions, deletes, a range delete.
	first := w.put("a", "1")
	w.put("a/1", "x")
	past := w.txn(clientv3.OpPut("a/2", "y"), clientv3.OpPut("b/1", "z"), clientv3.OpPut("c", "c1"))
	w.del("a/1")
	w.put("\x00", "smallest key")
	w.put("a/1", "again")
	w.txn(clientv3.OpPut("a", "2"), clientv3.OpDelete("b/1"), clientv3.OpPut("zz", "last"))
	w.put("a/3", "leased", clientv3.WithLease(lease.ID))
	w.put("b", "b1")
	w.del("a/", clientv3.WithPrefix())
	head := w.put("a/2", "back", clientv3.WithLease(lease.ID))
	c.waitSynced(t)

	pr := openStreamPair(t, c)
	creates := []*pb.WatchCreateRequest{
		{Key: []byte("a"), StartRevision: past}, // 0: single key from the past
		{Key: []byte("a")},                      // 1: single key from now
		{Key: []byte("a/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("a/")), StartRevision: past}, // 2: prefix
		{Key: []byte("a"), RangeEnd: []byte("b/1"), StartRevision: first},                            // 3: [key, end)
		{Key: []byte("b"), RangeEnd: fromKeyEnd, StartRevision: past},                                // 4: from key
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: first},                                 // 5: whole keyspace
		{StartRevision: first}, // 6: empty key: "\x00"
		{RangeEnd: fromKeyEnd, StartRevision: past, PrevKv: true},                                                          // 7: empty key from key: all
		{RangeEnd: []byte("b"), StartRevision: first},                                                                      // 8: empty key to "b"
		{Key: []byte("a/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("a/")), StartRevision: past, PrevKv: true},         // 9: prefix, prev_kv
		{Key: []byte("a/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("a/")), StartRevision: past, Filters: filterNoPut}, // 10: NOPUT
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: first, PrevKv: true, Filters: filterNoDelete},                // 11: NODELETE
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: first,
			Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NOPUT, pb.WatchCreateRequest_NODELETE}}, // 12: nothing
		{Key: []byte("a/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("a/")), StartRevision: head + 4, PrevKv: true}, // 13: future
		{Key: []byte("a"), StartRevision: head + 1},                                                   // 14: the next revision
		{Key: []byte("a"), RangeEnd: fromKeyEnd, StartRevision: head},                                 // 15: exactly the head
		{Key: []byte("b"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("b")), ProgressNotify: true},   // 16: progress_notify
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: first, PrevKv: true, Fragment: true},    // 17: fragment (small)
		{Key: []byte("c"), WatchId: 100, StartRevision: past},                                         // 18: client id
		{Key: []byte("zz"), WatchId: 100},                                                             // 19: duplicate id
		{Key: []byte("b"), RangeEnd: []byte("a")},                                                     // 20: inverted range
		{Key: []byte("b"), RangeEnd: []byte("b")},                                                     // 21: empty range
		{Key: []byte("a"), StartRevision: -5},                                                         // 22: negative start
		{Key: []byte("zz"), WatchId: 18, StartRevision: first},                                        // 23: client id = the next auto id
		{Key: []byte("zz"), StartRevision: first},                                                     // 24: auto id skips 18: 19
		{Key: []byte("zz"), RangeEnd: []byte("zz\x00"), StartRevision: past, Filters: filterNoDelete}, // 25: 20
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: 1, PrevKv: true},                        // 26 (21): from revision 1, before the proxy's history
		{StartRevision: 1}, // 27 (22): the empty key from revision 1
	}
	for _, cr := range creates {
		pr.create(cr)
	}
	pr.waitCreated(len(creates))
	pr.cancelWatch(999) // unknown: answered by neither

	// Live writes, up to and past the future revision, including a lease
	// revoke (a delete event of the lessor).
	w.put("a/1", "live")
	w.txn(clientv3.OpPut("a/4", "t"), clientv3.OpPut("b/2", "t"), clientv3.OpDelete("c"))
	w.put("a", "3")
	w.put("a/4", "t2")
	if _, err := c.direct.Revoke(ctx, lease.ID); err != nil {
		t.Fatal(err)
	}
	w.put("\x00", "again")
	w.del("a/", clientv3.WithPrefix())
	head = w.put("zz", "end")
	c.waitSynced(t)
	pr.syncTo(head)

	// Cancels at a quiescent point: the header of the answer is comparable.
	pr.cancelWatch(2)
	pr.cancelWatch(100)
	pr.d.waitUntil("two cancels", cancelsAtLeast(2))
	pr.p.waitUntil("two cancels", cancelsAtLeast(2))
	d, p := pr.d.responses(), pr.p.responses()
	compareStreams(t, "create options", d, p, compareOpts{quiescent: true})

	// The refusals carry etcd's reasons.
	dc, _, _ := splitResponses(d)
	for i, want := range map[int]string{
		19: mvcc.ErrWatcherDuplicateID.Error(),
		20: mvcc.ErrEmptyWatcherRange.Error(),
		21: mvcc.ErrEmptyWatcherRange.Error(),
		22: rpctypes.ErrCompacted.Error(),
	} {
		if !dc[i].Canceled || dc[i].CancelReason != want {
			t.Fatalf("create %d: etcd answered %s, want the cancel reason %q", i, fmtMsg(dc[i]), want)
		}
	}
	// Every watch got something, so that the comparison above is not vacuous.
	_, dw, _ := splitResponses(d)
	for _, id := range []int64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 100, 18, 19, 20, 21, 22} {
		if len(dw[id].events) == 0 {
			t.Errorf("watch %d got no events from etcd: the workload does not exercise it", id)
		}
	}
}

func cancelsAtLeast(n int) func([]*pb.WatchResponse) bool {
	return func(log []*pb.WatchResponse) bool {
		k := 0
		for _, r := range log {
			if r.Canceled && !r.Created {
				k++
			}
		}
		return k >= n
	}
}

// TestWatchDifferentialCompaction: watches starting around etcd's
// compaction revision. A key deleted at exactly the compaction revision
// must show its DELETE to a watch from that revision (etcd bug #18089); a
// watch from the revision before is created, then canceled with
// compact_revision; a watch live across a compaction is not disturbed.
func TestWatchDifferentialCompaction(t *testing.T) {
	testWatchDifferentialCompaction(t, clusterOptions{})
}

func testWatchDifferentialCompaction(t *testing.T, opts clusterOptions) {
	c := newCluster(t, opts)
	ctx := context.Background()
	w := etcdWriter{t, c.direct}
	w.put("k/a", "1")
	w.put("k/del", "doomed")
	w.txn(clientv3.OpPut("k/b", "1"), clientv3.OpPut("other", "1"))
	w.put("k/a", "2")
	compactRev := w.del("k/del") // deleted at exactly the compaction revision
	w.put("k/b", "2")
	w.txn(clientv3.OpPut("k/del", "reborn"), clientv3.OpDelete("k/a"))

	live := openStreamPair(t, c)
	c.waitSynced(t)
	live.create(&pb.WatchCreateRequest{Key: []byte("k/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("k/")), StartRevision: compactRev - 2, PrevKv: true})
	live.waitCreated(1)
	live.syncTo(c.etcdRev(t)) // caught up, before the compaction

	if _, err := c.direct.Compact(ctx, compactRev); err != nil {
		t.Fatal(err)
	}
	w.put("k/a", "3")
	c.waitSynced(t)

	pr := openStreamPair(t, c)
	prefix := func(start int64) *pb.WatchCreateRequest {
		return &pb.WatchCreateRequest{Key: []byte("k/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("k/")), StartRevision: start}
	}
	creates := []*pb.WatchCreateRequest{
		prefix(compactRev), // 0: from the compaction revision: the DELETE
		{Key: []byte("k/del"), StartRevision: compactRev}, // 1: the deleted key alone
		prefix(compactRev - 1),                            // 2: compacted
		prefix(compactRev + 1),                            // 3: just after
		prefix(1),                                         // 4: long compacted
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: compactRev, Filters: filterNoPut},                                           // 5: deletes only
		{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: compactRev, Filters: filterNoDelete},                                        // 6: puts only
		{Key: []byte("k/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("k/")), StartRevision: compactRev - 1, WatchId: 50, PrevKv: true}, // 7: compacted, client id
		{Key: []byte("k/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("k/")), StartRevision: compactRev + 1, PrevKv: true},              // 8 (id 7): prev_kv
		{Key: []byte("k/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("k/")), StartRevision: compactRev, PrevKv: true},                  // 9 (id 8): prev_kv
	}
	for _, cr := range creates {
		pr.create(cr)
	}
	pr.waitCreated(len(creates))
	for _, s := range []*watchStream{pr.d, pr.p} {
		s.waitUntil("the compaction cancels", cancelsAtLeast(3))
	}
	// etcd keeps a compacted watcher on its stream until the client cancels
	// it (clientv3 does at once), and answers no RequestProgress meanwhile
	// (progressIfSync finds it unsynced); so does the proxy. Both answer
	// the client's cancel.
	for _, id := range []int64{2, 4, 50} {
		pr.cancelWatch(id)
	}
	w.put("k/b", "3")
	head := w.del("k/del")
	c.waitSynced(t)
	pr.syncTo(head)
	live.syncTo(head)

	d, p := pr.d.responses(), pr.p.responses()
	compareStreams(t, "around the compaction", d, p, compareOpts{quiescent: true})
	compareStreams(t, "live across the compaction", live.d.responses(), live.p.responses(), compareOpts{quiescent: true})

	// etcd's answers are the ones the design expects.
	_, dw, _ := splitResponses(d)
	// The DELETE at the compaction revision goes without prev_kv: etcd
	// reads it at the revision before, which is compacted. The one at the
	// head keeps it.
	if evs := dw[8].events; len(evs) < 2 || evs[0].Kv.ModRevision != compactRev || evs[0].PrevKv != nil || evs[len(evs)-1].PrevKv == nil {
		t.Errorf("etcd's events from the compaction revision with prev_kv: %s", dumpResponses(dw[8].resps))
	}
	for _, id := range []int64{2, 3, 50} { // ids: 0 1 2 3 4 5 6, then 50
		if id == 3 {
			continue
		}
		if cr := dw[id].canceled; cr == nil || cr.CompactRevision != compactRev {
			t.Fatalf("watch %d from below the compaction: etcd's cancel %v, want compact_revision %d", id, cr, compactRev)
		}
	}
	for _, id := range []int64{0, 1, 5} {
		if evs := dw[id].events; len(evs) == 0 || evs[0].Kv.ModRevision != compactRev || evs[0].Type != mvccpb.DELETE {
			t.Errorf("watch %d from the compaction revision: etcd's first event is not the DELETE at %d: %s", id, compactRev, dumpResponses(dw[id].resps))
		}
	}
}

// TestWatchDifferentialCompactedWatchID: after a watch is canceled for
// compaction, etcd keeps its id on the stream until the client cancels it
// (clientv3 does, at once): the client's cancel is answered with a cancel
// response, and the id cannot be reused before (duplicate watch id).
func TestWatchDifferentialCompactedWatchID(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	for i := range 4 {
		w.put("id/k", fmt.Sprint(i))
	}
	compactRev := w.put("id/k", "compacted")
	if _, err := c.direct.Compact(context.Background(), compactRev); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)

	pr := openStreamPair(t, c)
	pr.create(&pb.WatchCreateRequest{Key: []byte("id/k"), WatchId: 7, StartRevision: compactRev - 1})
	pr.create(&pb.WatchCreateRequest{Key: []byte("id/other"), WatchId: 8})
	pr.waitCreated(2)
	for _, s := range []*watchStream{pr.d, pr.p} {
		s.waitUntil("the compaction cancel", cancelsAtLeast(1))
	}
	pr.create(&pb.WatchCreateRequest{Key: []byte("id/k"), WatchId: 7}) // reuse before the client's cancel
	pr.cancelWatch(7)                                                  // the client acknowledges, as clientv3 does
	pr.cancelWatch(8)                                                  // a marker: answered by both
	pr.create(&pb.WatchCreateRequest{Key: []byte("id/k"), WatchId: 7}) // reuse after
	pr.waitCreated(4)
	pr.d.waitUntil("the marker's cancel", canceledWatch(8))
	pr.p.waitUntil("the marker's cancel", canceledWatch(8))
	d, p := pr.d.responses(), pr.p.responses()
	checkStream(t, "etcd", d, false)
	checkStream(t, "proxy", p, true)
	// The compaction cancel's place among the answers to later requests is
	// a matter of timing: it is compared apart.
	for name, log := range map[string][]*pb.WatchResponse{"etcd": d, "proxy": p} {
		n := 0
		for _, r := range log {
			if r.CompactRevision != 0 {
				n++
				if r.WatchId != 7 || r.CompactRevision != compactRev || !r.Canceled {
					t.Fatalf("%s: compaction cancel %s, want watch 7 at %d", name, fmtMsg(r), compactRev)
				}
			}
		}
		if n != 1 {
			t.Fatalf("%s: %d compaction cancels, want 1", name, n)
		}
	}
	ctl := func(log []*pb.WatchResponse) []string {
		var out []string
		for _, r := range log {
			if (r.Created || r.Canceled) && r.CompactRevision == 0 {
				out = append(out, fmt.Sprintf("id=%d created=%v canceled=%v compact=%d reason=%q", r.WatchId, r.Created, r.Canceled, r.CompactRevision, r.CancelReason))
			}
		}
		return out
	}
	if a, b := strings.Join(ctl(d), "\n  "), strings.Join(ctl(p), "\n  "); a != b {
		t.Fatalf("created and cancel responses differ:\netcd:\n  %s\nproxy:\n  %s", a, b)
	}
}

func canceledWatch(id int64) func([]*pb.WatchResponse) bool {
	return func(log []*pb.WatchResponse) bool {
		for _, r := range log {
			if r.Canceled && !r.Created && r.WatchId == id {
				return true
			}
		}
		return false
	}
}

// TestWatchDifferentialManyWatchers: 50 watches of every shape on one
// stream, created in rounds between writes, with cancels interleaved; each
// watch's events, the created and the cancel responses equal etcd's.
func TestWatchDifferentialManyWatchers(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	first := w.putEach("m/", 10, "0")
	c.waitSynced(t)
	pr := openStreamPair(t, c)
	const n = 50
	created, canceled := 0, 0
	gone := map[int64]bool{}
	head := c.etcdRev(t)
	for round := range n / 5 {
		for j := range 5 {
			i := round*5 + j
			cr := &pb.WatchCreateRequest{}
			switch i % 5 {
			case 0:
				cr.Key = []byte(fmt.Sprintf("m/%d", i%10))
			case 1:
				cr.Key, cr.RangeEnd = []byte("m/"), []byte(clientv3.GetPrefixRangeEnd("m/"))
			case 2:
				cr.Key, cr.RangeEnd = []byte("m/2"), []byte("m/6")
			case 3:
				cr.Key, cr.RangeEnd, cr.Filters = []byte("m/5"), fromKeyEnd, filterNoPut
			case 4:
				cr.Key, cr.RangeEnd, cr.PrevKv = []byte{0}, fromKeyEnd, true
			}
			switch i % 3 {
			case 1:
				cr.StartRevision = max(first, head-int64(i%7))
			case 2:
				cr.StartRevision = head + 1
			}
			pr.create(cr)
			created++
		}
		pr.waitCreated(created)
		k := fmt.Sprintf("m/%d", round%10)
		w.put(k, fmt.Sprint("r", round))
		w.txn(clientv3.OpPut(fmt.Sprintf("m/%d", (round+3)%10), "t"), clientv3.OpDelete(fmt.Sprintf("m/%d", (round+6)%10)))
		head = w.put(fmt.Sprintf("m/%d", (round+6)%10), "back")
		c.waitSynced(t)
		pr.syncTo(head)
		// Cancel two of the watches created so far; some stay to the end.
		for _, id := range []int64{int64(round*5 + 1), int64(round*5 + 3 - 5*(round%2))} {
			if id >= 0 && !gone[id] {
				gone[id] = true
				pr.cancelWatch(id)
				canceled++
			}
		}
		pr.d.waitUntil("the cancels", cancelsAtLeast(canceled))
		pr.p.waitUntil("the cancels", cancelsAtLeast(canceled))
	}
	head = w.put("m/9", "end")
	c.waitSynced(t)
	pr.syncTo(head)
	d, p := pr.d.responses(), pr.p.responses()
	compareStreams(t, "50 watches", d, p, compareOpts{quiescent: true})
	_, dw, _ := splitResponses(d)
	if len(dw) != n {
		t.Fatalf("etcd has %d watches, want %d", len(dw), n)
	}
}

// TestWatchDifferentialFutureRevision: watches on future revisions wait
// for them, then get exactly etcd's events; a progress request on their
// stream is not answered below their start revision (etcd answers none
// while a watcher starts beyond its head).
func TestWatchDifferentialFutureRevision(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	head := w.put("fut/a", "0")
	c.waitSynced(t)
	pr := openStreamPair(t, c)
	pr.create(&pb.WatchCreateRequest{Key: []byte("fut/a"), StartRevision: head + 1})
	pr.create(&pb.WatchCreateRequest{Key: []byte("fut/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("fut/")), StartRevision: head + 5, PrevKv: true})
	pr.create(&pb.WatchCreateRequest{Key: []byte{0}, RangeEnd: fromKeyEnd, StartRevision: head + 30})
	pr.waitCreated(3)
	mark := pr.p.len()
	pr.p.requestProgress()
	var last int64
	for i := range 35 {
		switch i % 4 {
		case 3:
			last = w.del(fmt.Sprintf("fut/%c", 'a'+i%3))
		default:
			last = w.put(fmt.Sprintf("fut/%c", 'a'+i%3), fmt.Sprint(i))
		}
	}
	c.waitSynced(t)
	pr.syncTo(last)
	d, p := pr.d.responses(), pr.p.responses()
	compareStreams(t, "future revisions", d, p, compareOpts{quiescent: true})
	for _, r := range p[mark:] {
		if isProgress(r) {
			if r.Header.Revision < head+30 {
				t.Fatalf("progress at %d while a watcher starts at %d:\n%s", r.Header.Revision, head+30, dumpResponses(p))
			}
			break
		}
	}
	_, dw, _ := splitResponses(d)
	for id, start := range map[int64]int64{0: head + 1, 1: head + 5, 2: head + 30} {
		if evs := dw[id].events; len(evs) == 0 || evs[0].Kv.ModRevision != start {
			t.Fatalf("watch %d from %d: etcd's events %s", id, start, dumpResponses(dw[id].resps))
		}
	}
}

// TestWatchDifferentialFragment: with a small --max-request-bytes, large
// responses to fragmenting watchers are split as etcd splits them: the
// same events, the same boundaries, fragment=true on all but the last.
// etcd splits at max-request-bytes plus its 512 KiB gRPC overhead
// (ServerConfig.MaxRequestBytesWithOverhead), so a response must exceed
// 576 KiB here: a catch-up of 32 values of 20 KiB, and a range delete of
// them with prev_kv. A 3-value Txn with prev_kv (~120 KiB) is not split.
func TestWatchDifferentialFragment(t *testing.T) {
	const maxRequestBytes = 64 * 1024
	c := newCluster(t, clusterOptions{maxRequestBytes: maxRequestBytes})
	w := etcdWriter{t, c.direct}
	big := func(i int) string { return strings.Repeat(string(rune('a'+i%26)), 20*1024) }
	var first int64
	for i := 0; i < 32; i += 2 {
		rev := w.txn(clientv3.OpPut(fmt.Sprintf("f/%02d", i), big(i)), clientv3.OpPut(fmt.Sprintf("f/%02d", i+1), big(i+1)))
		if first == 0 {
			first = rev
		}
	}
	c.waitSynced(t)
	pr := openStreamPair(t, c)
	f := func(start int64, prevKV, fragment bool) *pb.WatchCreateRequest {
		return &pb.WatchCreateRequest{Key: []byte("f/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("f/")), StartRevision: start, PrevKv: prevKV, Fragment: fragment}
	}
	pr.create(f(first, true, true))  // 0: catch-up of 640 KiB, fragmented
	pr.create(f(first, true, false)) // 1: the same, whole
	pr.create(f(0, true, true))      // 2: the range delete with prev_kv, fragmented
	pr.create(f(0, true, false))     // 3: the same, whole
	pr.create(f(0, false, true))     // 4: the range delete without prev_kv: small
	pr.create(f(0, true, true))      // 5: also a 3-value Txn with prev_kv (~120 KiB)
	pr.waitCreated(6)
	pr.syncTo(c.etcdRev(t))
	head := w.txn(clientv3.OpPut("f/00", big(1)), clientv3.OpPut("f/01", big(2)), clientv3.OpPut("f/02", big(3)))
	c.waitSynced(t)
	pr.syncTo(head)
	head = w.del("f/", clientv3.WithPrefix())
	c.waitSynced(t)
	pr.syncTo(head)
	d, p := pr.d.responses(), pr.p.responses()
	compareStreams(t, "fragments: events", d, p, compareOpts{quiescent: true})

	// Fragments rebuild etcd's responses.
	_, dw, _ := splitResponses(d)
	if got := responseSplit(dw[0]); !strings.Contains(got, "f") {
		t.Fatalf("etcd did not fragment the 640 KiB catch-up (%s): the test does not exercise fragments", got)
	}
	compareStreams(t, "fragments: boundaries", d, p, compareOpts{quiescent: true, boundaries: []int64{0, 1, 2, 3, 4, 5}})
}

// TestWatchDifferentialHalfClose: requests etcd does not know are ignored,
// not fatal, and a client that half-closes its stream (CloseSend) still
// gets its watches' events, as from etcd, until it goes away.
func TestWatchDifferentialHalfClose(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	w := etcdWriter{t, c.direct}
	w.put("hc/a", "0")
	c.waitSynced(t)
	pr := openStreamPair(t, c)
	for _, s := range []*watchStream{pr.d, pr.p} {
		s.send(&pb.WatchRequest{}) // no request at all
		s.send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{}})
		s.send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CancelRequest{}})
		s.send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{}})
	}
	pr.create(&pb.WatchCreateRequest{Key: []byte("hc/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("hc/")), PrevKv: true})
	pr.waitCreated(1)
	for _, s := range []*watchStream{pr.d, pr.p} {
		s.sendMu.Lock()
		err := s.cs.CloseSend()
		s.sendMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
	}
	var head int64
	for i := range 5 {
		head = w.put("hc/a", fmt.Sprint(i))
	}
	has := func(l []*pb.WatchResponse) bool {
		for _, r := range l {
			for _, ev := range r.Events {
				if ev.Kv.ModRevision == head {
					return true
				}
			}
		}
		return false
	}
	pr.d.waitUntil("the last event", has)
	pr.p.waitUntil("the last event", has)
	compareStreams(t, "half-closed", pr.d.responses(), pr.p.responses(), compareOpts{quiescent: true})
}

// TestWatchDifferentialUpstreamCut: the proxy's link to etcd breaks while
// clients watch through it and etcd goes on writing.
//   - When the follower can resume, the watches get exactly etcd's events,
//     those written during the break included, and a progress request sent
//     during the break is never answered below etcd's revision of then.
//   - When etcd compacts past the proxy's revision during the break, the
//     follower reloads and the watches, which cannot be served the events
//     they missed, are canceled with etcd's compaction revision after
//     exactly etcd's events up to where they stood: nothing is skipped.
//     The proxy learns the compaction from its probe or from the resumed
//     watch's answer, whichever comes first; each subtest makes one of
//     them certain.
func TestWatchDifferentialUpstreamCut(t *testing.T) {
	for _, learned := range []struct {
		name  string
		probe time.Duration
	}{{"probe", 20 * time.Millisecond}, {"watch", time.Hour}} {
		t.Run(learned.name, func(t *testing.T) {
			testWatchUpstreamCut(t, learned.probe)
		})
	}
}

func testWatchUpstreamCut(t *testing.T, probeInterval time.Duration) {
	c := newCluster(t, clusterOptions{relay: true, configure: func(cfg *server.Config) {
		cfg.CompactionProbeInterval = probeInterval
	}})
	w := etcdWriter{t, c.direct}
	for i := range 10 {
		w.put(fmt.Sprintf("cut/%d", i%4), fmt.Sprint(i))
	}
	c.waitSynced(t)
	pr := openStreamPair(t, c)
	pr.create(&pb.WatchCreateRequest{Key: []byte("cut/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("cut/")), PrevKv: true})
	pr.create(&pb.WatchCreateRequest{Key: []byte("cut/1")})
	pr.create(&pb.WatchCreateRequest{Key: []byte("cut/2"), RangeEnd: fromKeyEnd, Filters: filterNoDelete})
	pr.waitCreated(3)
	write := func(i int) int64 {
		k := fmt.Sprintf("cut/%d", i%4)
		if i%3 == 2 {
			return w.del(k)
		}
		return w.put(k, fmt.Sprint("v", i))
	}

	// A break the follower resumes from.
	c.cut(t)
	var floor int64
	for i := range 12 {
		floor = write(i)
	}
	mark := pr.p.len()
	pr.p.requestProgress()
	c.relay.Restore()
	c.waitSynced(t)
	head := write(12)
	c.waitSynced(t)
	pr.syncTo(head)
	p := pr.p.responses()
	for _, r := range p[mark:] {
		if isProgress(r) && r.Header.Revision < floor {
			t.Fatalf("progress requested during the break, after etcd's write at %d, answered at %d:\n%s", floor, r.Header.Revision, dumpResponses(p))
		}
	}
	compareStreams(t, "after a break", pr.d.responses(), p, compareOpts{quiescent: true})

	// A break etcd compacts past.
	stood := c.proxy.Store().Rev()
	c.cut(t)
	var compactRev int64
	for i := range 12 {
		rev := write(i)
		if i == 5 {
			compactRev = rev
		}
	}
	if _, err := c.direct.Compact(context.Background(), compactRev); err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		head = write(i)
	}
	c.relay.Restore()
	c.waitSynced(t)
	p = pr.p.waitUntil("the compaction cancels", func(l []*pb.WatchResponse) bool {
		n := 0
		for _, r := range l {
			if r.CompactRevision != 0 {
				n++
			}
		}
		return n == 3
	})
	d := pr.d.syncTo(head)
	checkStream(t, "etcd", d, false)
	checkStream(t, "proxy", p, true)
	_, dw, _ := splitResponses(d)
	_, pw, _ := splitResponses(p)
	for id := range int64(3) {
		if cr := pw[id].canceled; cr == nil || cr.CompactRevision != compactRev {
			t.Fatalf("watch %d: the proxy's cancel %s, want compact_revision %d", id, fmtMsg(cr), compactRev)
		}
		if diff := servertest.DiffEvents(eventsUpTo(dw[id].events, stood), pw[id].events); diff != "" {
			t.Fatalf("watch %d stood at %d when etcd compacted at %d: %s\netcd:\n%s\nproxy:\n%s", id, stood, compactRev, diff, dumpResponses(d), dumpResponses(p))
		}
	}
}

// TestWatchDifferentialPrevKVAtCompaction: a watch with prev_kv from etcd's
// compaction revision C gets the event at C without prev_kv (etcd reads it
// at C-1, compacted), a PUT and a DELETE alike, and the later events with
// theirs, however the proxy learned the compaction: a Compact through it,
// kube-apiserver's compact_rev_key Txn followed by a Compact straight to
// etcd, or its probe of a Compact straight to etcd.
func TestWatchDifferentialPrevKVAtCompaction(t *testing.T) {
	for _, source := range []string{"proxy", "compact_rev_key", "probe"} {
		t.Run(source, func(t *testing.T) {
			c := newCluster(t, clusterOptions{})
			ctx := context.Background()
			w := etcdWriter{t, c.direct}
			w.put("p/put", "1")
			w.put("p/del", "1")
			w.put("p/put", "2")
			w.put("p/del", "2")
			putRev := w.put("p/put", "3") // its previous version, at 4, is below it
			delRev := w.del("p/del")
			w.put("p/put", "4")
			w.put("p/del", "reborn")
			for _, compactRev := range []int64{putRev, delRev} {
				switch source {
				case "proxy":
					if _, err := c.viaProxy.Compact(ctx, compactRev); err != nil {
						t.Fatal(err)
					}
				case "compact_rev_key":
					// kube-apiserver's compactor: the revision in
					// compact_rev_key, then a Compact straight to etcd.
					w.put("compact_rev_key", strconv.FormatInt(compactRev, 10))
					if _, err := c.direct.Compact(ctx, compactRev); err != nil {
						t.Fatal(err)
					}
				case "probe":
					if _, err := c.direct.Compact(ctx, compactRev); err != nil {
						t.Fatal(err)
					}
				}
				testsupport.WaitFor(t, waitTimeout, "the proxy to mirror the compaction", func() bool {
					return c.proxy.Store().CompactRev() == compactRev
				})
				head := w.put("p/zz-end", strconv.FormatInt(compactRev, 10))
				c.waitSynced(t)
				pr := openStreamPair(t, c)
				pr.create(&pb.WatchCreateRequest{Key: []byte("p/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("p/")), StartRevision: compactRev, PrevKv: true})
				pr.create(&pb.WatchCreateRequest{Key: []byte("p/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("p/")), StartRevision: compactRev + 1, PrevKv: true})
				pr.waitCreated(2)
				pr.syncTo(head)
				d, p := pr.d.responses(), pr.p.responses()
				compareStreams(t, fmt.Sprintf("from the compaction revision %d", compactRev), d, p, compareOpts{quiescent: true})
				_, dw, _ := splitResponses(d)
				if evs := dw[0].events; len(evs) == 0 || evs[0].Kv.ModRevision != compactRev || evs[0].PrevKv != nil {
					t.Fatalf("etcd's first event from the compaction revision %d: %s", compactRev, dumpResponses(dw[0].resps))
				}
			}
			if n := c.proxyMetric(t, "etcd_snapcache_compactions_observed_total", map[string]string{"source": source}); n == 0 {
				t.Errorf("no compaction was learned through %s", source)
			}
		})
	}
}
