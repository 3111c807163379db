package watchproxy

import (
	"bytes"
	"errors"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/server/v3/storage/mvcc"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// checkRefused checks etcd's answer to a create it refuses: created and
// canceled, watch id -1, the reason, and the store's revision in the header.
func checkRefused(t *testing.T, r *pb.WatchResponse, reason string, storeRev int64) {
	t.Helper()
	if !r.Created || !r.Canceled || r.WatchId != -1 || r.CancelReason != reason || len(r.Events) != 0 {
		t.Fatalf("refused create: got %v, want created+canceled, watch id -1, reason %q", r, reason)
	}
	checkHeader(t, r, storeRev)
	if r.Header.Revision != storeRev {
		t.Fatalf("refused create: header revision %d, want the store's %d", r.Header.Revision, storeRev)
	}
}

// checkCreated checks a created response: the id, not canceled, and the
// store's revision in the header, as etcd's watchStream.Rev().
func checkCreated(t *testing.T, r *pb.WatchResponse, id, storeRev int64) {
	t.Helper()
	if !r.Created || r.Canceled || r.WatchId != id || len(r.Events) != 0 {
		t.Fatalf("create: got %v, want created with watch id %d", r, id)
	}
	checkHeader(t, r, storeRev)
	if r.Header.Revision != storeRev {
		t.Fatalf("created: header revision %d, want the store's %d", r.Header.Revision, storeRev)
	}
}

// TestWatchCreatedBeforeEventsAtStoreRevision: a create is answered with
// created and its id, at the store's revision, before any event of that
// watch, even when its start revision has events to send at once.
func TestWatchCreatedBeforeEventsAtStoreRevision(t *testing.T) {
	w := newWorld(t)
	w.apply(put("k", "1")) // 2
	w.apply(put("k", "2")) // 3
	fs := w.watch()

	fs.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 2}))
	checkCreated(t, fs.next(t), 0, 3)
	if got := revs(fs.eventsOf(t, 0, 3)); !slices.Equal(got, []int64{2, 3}) {
		t.Fatalf("events of revisions %v, want [2 3]", got)
	}
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchAutoIDsIncreaseAndDuplicateIDRefused: automatic ids are 0, 1,
// 2, ..., skipping ids taken explicitly; an explicit id already in use is
// refused with etcd's duplicate-id reason and takes no id.
func TestWatchAutoIDsIncreaseAndDuplicateIDRefused(t *testing.T) {
	w := newWorld(t)
	w.apply(put("k", "1")) // 2
	fs := w.watch()

	for id := int64(0); id < 3; id++ {
		checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), id, 2)
	}
	checkRefused(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), WatchId: 1}), mvcc.ErrWatcherDuplicateID.Error(), 2)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), WatchId: 4}), 4, 2)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 3, 2)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 5, 2) // 4 is taken
	checkRefused(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), WatchId: 4}), mvcc.ErrWatcherDuplicateID.Error(), 2)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 6, 2)
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchCreateRefusesNegativeStartAndEmptyRange: a negative start
// revision is refused with etcd's compacted reason, a range whose end is not
// above its key with mvcc.ErrEmptyWatcherRange; neither takes an id.
func TestWatchCreateRefusesNegativeStartAndEmptyRange(t *testing.T) {
	w := newWorld(t)
	w.apply(put("k", "1")) // 2
	fs := w.watch()

	checkRefused(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: -1}), rpctypes.ErrCompacted.Error(), 2)
	checkRefused(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("b"), RangeEnd: []byte("a")}), mvcc.ErrEmptyWatcherRange.Error(), 2)
	checkRefused(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("b"), RangeEnd: []byte("b")}), mvcc.ErrEmptyWatcherRange.Error(), 2)
	// An empty key is the smallest key, "\x00": below any end.
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{RangeEnd: []byte("a")}), 0, 2)
	// "\x00" as the end means every key from the key on.
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("b"), RangeEnd: []byte{0}}), 1, 2)
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// expectedEvents is the model's answer: the events of revisions from..upTo
// in [key, end) (one key if end is nil; every key from key on if end is
// "\x00"), filtered and with PrevKv as asked.
func (w *world) expectedEvents(cr *pb.WatchCreateRequest, upTo int64) []*mvccpb.Event {
	var out []*mvccpb.Event
	noPut := slices.Contains(cr.Filters, pb.WatchCreateRequest_NOPUT)
	noDelete := slices.Contains(cr.Filters, pb.WatchCreateRequest_NODELETE)
	for rev := cr.StartRevision; rev <= upTo; rev++ {
		for _, ev := range w.applied[rev] {
			k := ev.Kv.Key
			switch {
			case cr.RangeEnd == nil && !bytes.Equal(k, cr.Key):
				continue
			case cr.RangeEnd != nil && bytes.Compare(k, cr.Key) < 0:
				continue
			case len(cr.RangeEnd) > 0 && !bytes.Equal(cr.RangeEnd, []byte{0}) && bytes.Compare(k, cr.RangeEnd) >= 0:
				continue
			case ev.Type == mvccpb.PUT && noPut, ev.Type == mvccpb.DELETE && noDelete:
				continue
			}
			e := proto.Clone(ev).(*mvccpb.Event)
			if !cr.PrevKv {
				e.PrevKv = nil
			}
			out = append(out, e)
		}
	}
	return out
}

// TestWatchPastRevisionGetsExactlyMatchingEventsInOrder: a watcher from a
// past revision the store retains is sent exactly the events of its range
// from that revision on, in revision order, with prev_kv only if asked, and
// without the types its filters exclude.
func TestWatchPastRevisionGetsExactlyMatchingEventsInOrder(t *testing.T) {
	w := newWorld(t)
	w.apply(put("a", "1"))                // 2
	w.apply(put("b", "1"))                // 3
	w.apply(put("a", "2"))                // 4
	w.apply(put("c", "1"), del("a"))      // 5: one revision, two events
	w.apply(put("a", "3"))                // 6
	w.apply(del("b"))                     // 7
	w.apply(put("z", "1"), put("d", "1")) // 8: outside [a, d)
	w.apply(put("c", "2"))                // 9
	const head = 9
	fs := w.watch()

	for i, cr := range []*pb.WatchCreateRequest{
		{Key: []byte("a"), RangeEnd: []byte("d"), StartRevision: 3},
		{Key: []byte("a"), RangeEnd: []byte("d"), StartRevision: 3, PrevKv: true},
		{Key: []byte("a"), RangeEnd: []byte("d"), StartRevision: 3, PrevKv: true, Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NOPUT}},
		{Key: []byte("a"), RangeEnd: []byte("d"), StartRevision: 3, Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NODELETE}},
		{Key: []byte("a"), StartRevision: 2, PrevKv: true},
		{Key: []byte("b"), RangeEnd: []byte{0}, StartRevision: 5},
	} {
		id := int64(i)
		want := w.expectedEvents(cr, head)
		if len(want) == 0 {
			t.Fatalf("watcher %d: the model expects no events", id)
		}
		checkCreated(t, fs.create(t, cr), id, head)
		got := fs.eventsOf(t, id, want[len(want)-1].Kv.ModRevision)
		if len(got) != len(want) {
			t.Fatalf("watcher %d (%v): got events %v, want %v", id, cr, got, want)
		}
		for j := range got {
			if !proto.Equal(got[j], want[j]) {
				t.Fatalf("watcher %d (%v): event %d is %v, want %v", id, cr, j, got[j], want[j])
			}
		}
	}
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchCancelAnsweredAndStopsEvents: a cancel is answered with a
// canceled response for the id, and the watcher is sent nothing after it.
func TestWatchCancelAnsweredAndStopsEvents(t *testing.T) {
	w := newWorld(t)
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 1, 1)
	w.apply(put("k", "1")) // 2
	seen := map[int64]bool{}
	for len(seen) < 2 {
		r := fs.next(t)
		if len(r.Events) != 1 || r.Events[0].Kv.ModRevision != 2 || seen[r.WatchId] {
			t.Fatalf("want one event of revision 2 for each watcher, got %v", r)
		}
		seen[r.WatchId] = true
	}

	fs.send(t, cancelReq(0))
	r := fs.next(t)
	if !r.Canceled || r.Created || r.WatchId != 0 || len(r.Events) != 0 {
		t.Fatalf("answer to cancel: %v, want canceled watch 0", r)
	}
	checkHeader(t, r, 2)

	w.apply(put("k", "2")) // 3
	if got := revs(fs.eventsOf(t, 1, 3)); !slices.Equal(got, []int64{3}) {
		t.Fatalf("watcher 1 got revisions %v, want [3]", got)
	}
	// A second cancel of the same id is a cancel of an unknown id.
	fs.send(t, cancelReq(0))
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("after the cancel: %v, want nothing", before)
	}
}

// TestWatchCancelOfUnknownIDAnswersNothing: etcd answers nothing to the
// cancel of an id the stream does not have.
func TestWatchCancelOfUnknownIDAnswersNothing(t *testing.T) {
	w := newWorld(t)
	fs := w.watch()
	fs.send(t, cancelReq(99))
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	fs.send(t, cancelReq(99))
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("answers to the cancel of an unknown id: %v", before)
	}
}

// TestWatchProgressFollowsEventsUpToItsRevision: a requested progress
// notification (watch id -1) is sent only after every event up to its
// revision was sent, and never at a revision below the one WaitFresh proved
// current, even while the store is below that revision.
//
// The test knows where the send loop is from what it sends: after the loop
// sent events, it has read the store for that iteration, and with nothing
// to wake it (revisions applied without notify) it then waits.
func TestWatchProgressFollowsEventsUpToItsRevision(t *testing.T) {
	w := newWorld(t)
	called, fresh := w.follower.controlWaitFresh()
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	w.apply(put("k", "1")) // 2
	events := revs(fs.eventsOf(t, 0, 2))

	fs.send(t, progressReq())
	select {
	case <-called:
	case <-time.After(waitTimeout):
		t.Fatal("WaitFresh not called for a progress request")
	}
	// Hold the loop in the answer to a barrier while revision 3 arrives;
	// once it sent 3, it waits.
	blocked, release := fs.block()
	fs.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("barrier"), StartRevision: -1}))
	waitClosed(t, blocked, "a blocked Send")
	w.applySilently(put("k", "2")) // 3
	release()
	checkRefused(t, fs.next(t), rpctypes.ErrCompacted.Error(), 2)
	events = append(events, revs(fs.eventsOf(t, 0, 3))...)

	// Revisions 4 and 5 arrive unannounced; then WaitFresh proves etcd at
	// 6, which the store has yet to receive. The loop wakes for the proof,
	// sends 4 and 5, and must not answer at 5.
	w.applySilently(put("k", "3")) // 4
	w.applySilently(put("k", "4")) // 5
	select {
	case fresh <- 6:
	case <-time.After(waitTimeout):
		t.Fatal("WaitFresh did not take its answer")
	}
	events = append(events, revs(fs.eventsOf(t, 0, 5))...)
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("with the store at %d, below the revision 6 WaitFresh returned: %v", w.store.Rev(), before)
	}

	// Revision 6 arrives; while the loop sends it, 7 arrives unannounced:
	// the answer is at 6, after 6's events, not at 7 before 7's.
	blocked, release = fs.block()
	w.apply(put("k", "5")) // 6
	waitClosed(t, blocked, "a blocked Send")
	w.applySilently(put("k", "6")) // 7
	release()
	var progress *pb.WatchResponse
	for progress == nil {
		r := fs.next(t)
		switch {
		case isProgress(r):
			progress = r
		case r.WatchId == 0 && len(r.Events) > 0:
			events = append(events, revs(r.Events)...)
		default:
			t.Fatalf("unexpected response %v", r)
		}
	}
	checkHeader(t, progress, 6)
	var want []int64
	for rev := int64(2); rev <= progress.Header.Revision; rev++ {
		want = append(want, rev)
	}
	if !slices.Equal(events, want) {
		t.Fatalf("events sent before the progress notification at %d: %v, want %v", progress.Header.Revision, events, want)
	}

	w.follower.notify()
	fs.eventsOf(t, 0, 7)
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("after the progress notification: %v, want nothing (one request, one answer)", before)
	}
}

// TestWatchProgressAnsweredOnceACheckBegunAfterItCompletes: a progress
// request is answered as soon as a freshness check that began after it
// arrived completes (and the watchers reached the revision it proved), even
// if a later request arrived meanwhile. etcd answers each request at once;
// a proxy that instead waits for a check begun after the latest request
// never answers a client that asks more often than a check takes
// (kube-apiserver asks every 100 ms while a consistent read waits).
func TestWatchProgressAnsweredOnceACheckBegunAfterItCompletes(t *testing.T) {
	w := newWorld(t)
	called, fresh := w.follower.controlWaitFresh()
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)

	fs.send(t, progressReq()) // R1: a check C1 begins after it
	select {
	case <-called:
	case <-time.After(waitTimeout):
		t.Fatal("WaitFresh not called for a progress request")
	}
	fs.send(t, progressReq()) // R2 arrives while C1 is under way

	// Hold the loop in the answer to a barrier while revision 2 arrives;
	// once it sent 2, it waits (nothing wakes it but C1's result).
	blocked, release := fs.block()
	fs.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("barrier"), StartRevision: -1}))
	waitClosed(t, blocked, "a blocked Send")
	w.applySilently(put("k", "1")) // 2
	release()
	checkRefused(t, fs.next(t), rpctypes.ErrCompacted.Error(), 1)
	fs.eventsOf(t, 0, 2)

	// C1 proves etcd was at 1 when R1 arrived. The loop wakes for it and
	// sends revision 3: R1 is then answerable, at 3.
	w.applySilently(put("k", "2")) // 3
	select {
	case fresh <- 1:
	case <-time.After(waitTimeout):
		t.Fatal("WaitFresh did not take its answer")
	}
	fs.eventsOf(t, 0, 3)
	before := fs.barrier(t)
	if len(before) != 1 || !isProgress(before[0]) {
		t.Fatalf("after the check begun after R1 completed at 1 and revision 3 was sent: %v, want R1's progress notification", before)
	}
	checkHeader(t, before[0], 1)
}

// TestWatchProgressWithoutWatchersIsNotSent: as etcd, a progress request on
// a stream without watchers is answered by nothing, now or later; with a
// watcher it is answered.
func TestWatchProgressWithoutWatchersIsNotSent(t *testing.T) {
	w := newWorld(t)
	fs := w.watch()
	fs.send(t, progressReq())
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("answers to a progress request without watchers: %v", before)
	}
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("responses after a watcher was created: %v", before)
	}
	if n := w.follower.freshCallCount(); n != 0 {
		t.Fatalf("WaitFresh called %d times for a stream without watchers", n)
	}

	fs.send(t, progressReq())
	r := fs.next(t)
	if !isProgress(r) {
		t.Fatalf("answer to a progress request with a watcher: %v, want a progress notification", r)
	}
	checkHeader(t, r, 1)
}

// TestWatchCompactedWatcherCanceledAndKeepsItsID: a watcher whose next
// revision the store compacted before the stream sent it is canceled with
// compact_revision and header revision 0, is sent nothing more, and its id
// stays taken (for explicit and automatic ids) until the client cancels
// it, which is answered. (An explicit id of 0 is clientv3.AutoWatchID, so
// the watcher takes id 1.)
func TestWatchCompactedWatcherCanceledAndKeepsItsID(t *testing.T) {
	w := newWorld(t)
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), WatchId: 1}), 1, 1)

	// Hold the send loop in a Send while revisions 2..5 arrive and 4 is
	// compacted: the watcher's next revision, 2, is gone.
	blocked, release := fs.block()
	fs.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("barrier"), StartRevision: -1}))
	select {
	case <-blocked:
	case <-time.After(waitTimeout):
		t.Fatal("the send loop did not send")
	}
	for i := 0; i < 4; i++ {
		w.applySilently(put("k", "v"))
	}
	w.store.Compact(4)
	w.follower.notify()
	release()
	checkRefused(t, fs.next(t), rpctypes.ErrCompacted.Error(), 1)

	r := fs.next(t)
	if !r.Canceled || r.Created || r.WatchId != 1 || r.CompactRevision != 4 || len(r.Events) != 0 {
		t.Fatalf("got %v, want watch 1 canceled with compact revision 4", r)
	}
	if r.Header == nil || r.Header.Revision != 0 {
		t.Fatalf("compaction cancel header %v, want revision 0", r.Header)
	}
	checkHeader(t, r, 0)

	checkRefused(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), WatchId: 1}), mvcc.ErrWatcherDuplicateID.Error(), 5)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 5)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 2, 5) // 1 is still taken
	w.apply(put("k", "v"))                                                        // 6
	got := map[int64][]int64{}
	for len(got[0]) == 0 || len(got[2]) == 0 {
		r := fs.next(t)
		if r.WatchId != 0 && r.WatchId != 2 || len(r.Events) == 0 {
			t.Fatalf("want events of watchers 0 and 2, got %v", r)
		}
		got[r.WatchId] = append(got[r.WatchId], revs(r.Events)...)
	}
	if !slices.Equal(got[0], []int64{6}) || !slices.Equal(got[2], []int64{6}) {
		t.Fatalf("watchers 0 and 2 got revisions %v, want [6] each", got)
	}

	fs.send(t, cancelReq(1))
	r = fs.next(t)
	if !r.Canceled || r.Created || r.WatchId != 1 || r.CompactRevision != 0 || len(r.Events) != 0 {
		t.Fatalf("answer to the client's cancel of the compacted watcher: %v", r)
	}
	checkHeader(t, r, 6)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), WatchId: 1}), 1, 6)
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchCreatedBelowCompactionCanceledAfterCreated: a watcher created
// at a start revision below the store's compaction is answered created,
// then canceled with compact_revision, as etcd does.
func TestWatchCreatedBelowCompactionCanceledAfterCreated(t *testing.T) {
	w := newWorld(t)
	for i := 0; i < 4; i++ {
		w.apply(put("k", "v")) // 2..5
	}
	w.store.Compact(4)
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 3}), 0, 5)
	r := fs.next(t)
	if !r.Canceled || r.WatchId != 0 || r.CompactRevision != 4 || r.Header.GetRevision() != 0 || len(r.Events) != 0 {
		t.Fatalf("got %v, want watch 0 canceled with compact revision 4 and header revision 0", r)
	}
	// From the compaction revision itself, etcd still serves.
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 4}), 1, 5)
	if got := revs(fs.eventsOf(t, 1, 5)); !slices.Equal(got, []int64{4, 5}) {
		t.Fatalf("watcher from the compaction revision got %v, want [4 5]", got)
	}
}

// TestWatchSlowStreamDoesNotDelayOthers: a stream whose client does not
// read (Send blocks) does not delay another stream of the same server,
// and once it reads again it gets every event, in order, exactly once.
func TestWatchSlowStreamDoesNotDelayOthers(t *testing.T) {
	w := newWorld(t)
	slow, fast := w.watch(), w.watch()
	checkCreated(t, slow.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	checkCreated(t, fast.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)

	blocked, release := slow.block()
	defer release()
	w.apply(put("k", "1")) // 2
	select {
	case <-blocked:
	case <-time.After(waitTimeout):
		t.Fatal("the slow stream did not try to send")
	}
	var fastRevs []int64
	for rev := int64(3); rev <= 6; rev++ {
		w.apply(put("k", "v"))
	}
	fastRevs = revs(fast.eventsOf(t, 0, 6))
	if !slices.Equal(fastRevs, []int64{2, 3, 4, 5, 6}) {
		t.Fatalf("fast stream got %v, want [2 3 4 5 6]", fastRevs)
	}
	select {
	case r := <-slow.out:
		t.Fatalf("the blocked stream sent %v", r)
	default:
	}

	release()
	if got := revs(slow.eventsOf(t, 0, 6)); !slices.Equal(got, []int64{2, 3, 4, 5, 6}) {
		t.Fatalf("slow stream got %v once released, want [2 3 4 5 6]", got)
	}
	for _, fs := range []*fakeStream{slow, fast} {
		if before := fs.barrier(t); len(before) != 0 {
			t.Fatalf("unexpected responses %v", before)
		}
	}
}

// TestWatchCloseEndsStreamsWithStopped: Server.Close ends a running stream,
// and any stream opened afterwards, with etcd's "server stopped".
func TestWatchCloseEndsStreamsWithStopped(t *testing.T) {
	w := newWorld(t)
	fs := newFakeStream()
	defer fs.cancel()
	done := make(chan error, 1)
	go func() { done <- w.srv.Watch(fs) }()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)

	w.srv.Close()
	select {
	case err := <-done:
		if !errors.Is(err, rpctypes.ErrGRPCStopped) {
			t.Fatalf("Watch after Close: %v, want %v", err, rpctypes.ErrGRPCStopped)
		}
	case <-time.After(waitTimeout):
		t.Fatal("Watch did not return after Close")
	}

	late := newFakeStream()
	defer late.cancel()
	if err := w.srv.Watch(late); !errors.Is(err, rpctypes.ErrGRPCStopped) {
		t.Fatalf("Watch opened after Close: %v, want %v", err, rpctypes.ErrGRPCStopped)
	}
}

// TestWatchProgressAnsweredOnceAFutureStartIsReached: a requested progress
// waits while a watcher starts beyond the stream's revision, as etcd's
// does, and is answered once the store reaches that start, though no event
// concerns the stream: the stream has no timer to wake it then, and the
// notifier must.
func TestWatchProgressAnsweredOnceAFutureStartIsReached(t *testing.T) {
	w := newWorld(t)
	called, fresh := w.follower.controlWaitFresh()
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 4}), 1, 1)
	w.apply(put("other", "1")) // 2
	fs.send(t, progressReq())
	waitClosed(t, called, "WaitFresh for the progress request")
	select {
	case fresh <- 2:
	case <-time.After(waitTimeout):
		t.Fatal("WaitFresh did not take its answer")
	}
	// The loop has the proof once it asks to be woken at the start.
	testsupport.WaitFor(t, waitTimeout, "the send loop to wait for revision 4", func() bool {
		w.srv.notify.mu.Lock()
		defer w.srv.notify.mu.Unlock()
		return len(w.srv.notify.scanWaiters) == 1
	})
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("with the store at 2, below watcher 1's start 4: %v, want nothing", before)
	}
	w.apply(put("other", "2")) // 3
	w.apply(put("other", "3")) // 4
	r := fs.next(t)
	if !isProgress(r) {
		t.Fatalf("got %v, want the progress notification", r)
	}
	checkHeader(t, r, 4)
}
