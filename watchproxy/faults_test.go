package watchproxy

// The watch-path faults of issue 11: a compaction mirrored above the
// store's head, catch-ups that stall on their clients or fail, and the
// consistency checker's fallback under running streams.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// checkCompactCancel checks etcd's compaction cancel of watch id.
func checkCompactCancel(t *testing.T, r *pb.WatchResponse, id, compactRev int64) {
	t.Helper()
	if !r.Canceled || r.Created || r.WatchId != id || r.CompactRevision != compactRev || len(r.Events) != 0 || r.Header.GetRevision() != 0 {
		t.Fatalf("got %v, want watch %d canceled with compact revision %d and header revision 0", r, id, compactRev)
	}
}

// eventsByWatch reads responses until each of the watchers has been sent
// the events of revision upTo, failing on anything but events.
func (s *fakeStream) eventsByWatch(t *testing.T, upTo int64, ids ...int64) map[int64][]int64 {
	t.Helper()
	got := map[int64][]int64{}
	last := func(id int64) int64 {
		if r := got[id]; len(r) > 0 {
			return r[len(r)-1]
		}
		return 0
	}
	for slices.ContainsFunc(ids, func(id int64) bool { return last(id) < upTo }) {
		r := s.next(t)
		if r.Created || r.Canceled || len(r.Events) == 0 || !slices.Contains(ids, r.WatchId) {
			t.Fatalf("waiting for events up to %d of watches %v (so far %v): got %v", upTo, ids, got, r)
		}
		got[r.WatchId] = append(got[r.WatchId], revs(r.Events)...)
	}
	return got
}

// TestWatchCompactionAboveHeadCancelsOnlyUnsynced: a compaction mirrored
// above the store's head (a Compact acknowledged before the feed delivered
// the revisions up to it) cancels no synced watcher: not one that was at
// the head, not one created at the head afterwards, not one whose start is
// beyond the compaction. As etcd, it cancels a watcher that starts below
// the compaction (etcd's head is past it, so etcd counts it unsynced), and
// one created at a past revision below it.
func TestWatchCompactionAboveHeadCancelsOnlyUnsynced(t *testing.T) {
	w := newWorld(t)
	w.srv = New(testConfig(heldStore{w.store, w}, w.follower))
	w.apply(put("k", "a")) // 2
	w.apply(put("k", "b")) // 3
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 3) // at the head

	w.store.Compact(6)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 1, 3)                   // at the head, after
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 6}), 2, 3) // from the compaction
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 4}), 3, 3) // below it
	checkCompactCancel(t, fs.next(t), 3, 6)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 3}), 4, 3) // in the past
	checkCompactCancel(t, fs.next(t), 4, 6)

	for range 4 {
		w.apply(put("k", "c")) // 4..7
	}
	got := fs.eventsByWatch(t, 7, 0, 1, 2)
	for id, want := range map[int64][]int64{0: {4, 5, 6, 7}, 1: {4, 5, 6, 7}, 2: {6, 7}} {
		if !slices.Equal(got[id], want) {
			t.Fatalf("watch %d got revisions %v, want %v", id, got[id], want)
		}
	}
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchCompactionCancelsSyncedWatcherOnlyOnceItsEventsAreGone: a synced
// watcher whose client fell behind a compaction is served while the store
// holds its events, and canceled only once they are gone.
func TestWatchCompactionCancelsSyncedWatcherOnlyOnceItsEventsAreGone(t *testing.T) {
	w := newWorld(t)
	w.srv = New(testConfig(heldStore{w.store, w}, w.follower))
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)

	// The send loop is held in a Send while 2..5 arrive and 4 is
	// compacted: the store still holds 4 and 5, not 2 and 3.
	blocked, release := fs.block()
	fs.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("barrier"), StartRevision: -1}))
	waitClosed(t, blocked, "the send loop to send")
	for range 4 {
		w.applySilently(put("k", "v")) // 2..5
	}
	w.store.Compact(4)
	w.follower.notify()
	release()
	checkRefused(t, fs.next(t), errCompactedReason, 1)
	checkCompactCancel(t, fs.next(t), 0, 4)

	// The same with its events still there: a compaction at 8, above the
	// head at 6, keeps 6 on, and the slow synced watcher gets 6, 7, 8.
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 1, 5)
	blocked, release = fs.block()
	fs.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("barrier"), StartRevision: -1}))
	waitClosed(t, blocked, "the send loop to send")
	w.applySilently(put("k", "v")) // 6
	w.store.Compact(8)
	w.applySilently(put("k", "v")) // 7
	w.applySilently(put("k", "v")) // 8
	w.follower.notify()
	release()
	checkRefused(t, fs.next(t), errCompactedReason, 5)
	if got := revs(fs.eventsOf(t, 1, 8)); !slices.Equal(got, []int64{6, 7, 8}) {
		t.Fatalf("watch 1 got revisions %v, want [6 7 8]", got)
	}
}

// TestWatchCatchupCanceledByEtcdEndsOnlyThatWatcher: a catch-up that etcd
// cancels, or that fails for good, ends its watcher with a canceled
// response and the reason; the stream and its other watchers go on.
func TestWatchCatchupCanceledByEtcdEndsOnlyThatWatcher(t *testing.T) {
	up := newFakeUpstream()
	w := newWorldAt(t, 10, up, nil)
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 10)

	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 3}), 1, 10)
	us := up.next(t)
	if cr := us.create(t); cr.StartRevision != 3 || string(cr.Key) != "k" || !cr.PrevKv {
		t.Fatalf("catch-up create %v", cr)
	}
	us.created(t, 12)
	const reason = "rpc error: code = PermissionDenied desc = etcdserver: permission denied"
	us.answer(t, &pb.WatchResponse{Header: &pb.ResponseHeader{Revision: 12}, Canceled: true, CancelReason: reason}, nil)
	r := fs.next(t)
	if !r.Canceled || r.Created || r.WatchId != 1 || r.CancelReason != reason || r.CompactRevision != 0 || len(r.Events) != 0 {
		t.Fatalf("got %v, want watch 1 canceled with etcd's reason", r)
	}
	checkHeader(t, r, 10)

	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 3}), 2, 10)
	us = up.next(t)
	us.create(t)
	tooLarge := status.Error(codes.ResourceExhausted, "grpc: received message larger than max")
	us.answer(t, nil, tooLarge)
	r = fs.next(t)
	if !r.Canceled || r.WatchId != 2 || !strings.Contains(r.CancelReason, tooLarge.Error()) || r.CompactRevision != 0 {
		t.Fatalf("got %v, want watch 2 canceled with the error", r)
	}

	w.apply(put("k", "v")) // 11
	if got := revs(fs.eventsOf(t, 0, 11)); !slices.Equal(got, []int64{11}) {
		t.Fatalf("watch 0 got revisions %v, want [11]", got)
	}
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchCatchupResumesAfterUpstreamBreaks: a catch-up whose upstream
// watch breaks is opened again from the revision after the last events it
// relayed, and the watcher gets every event once, with no response of any
// other kind.
func TestWatchCatchupResumesAfterUpstreamBreaks(t *testing.T) {
	up := newFakeUpstream()
	w := newWorldAt(t, 10, up, nil)
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 3}), 0, 10)

	us := up.next(t)
	us.create(t)
	us.created(t, 10)
	us.events(t, 10, putEvent("k", 4), putEvent("k", 5))
	if got := revs(fs.eventsOf(t, 0, 5)); !slices.Equal(got, []int64{4, 5}) {
		t.Fatalf("got revisions %v, want [4 5]", got)
	}
	us.answer(t, nil, status.Error(codes.Unavailable, "error reading from server: EOF"))

	us = up.next(t)
	if cr := us.create(t); cr.StartRevision != 6 {
		t.Fatalf("the catch-up resumed from %d, want 6", cr.StartRevision)
	}
	us.created(t, 10)
	us.events(t, 10, putEvent("k", 7))
	us.progress(t, 10)
	w.apply(put("k", "v")) // 11
	if got := revs(fs.eventsOf(t, 0, 11)); !slices.Equal(got, []int64{7, 11}) {
		t.Fatalf("got revisions %v after the resume, want [7 11]", got)
	}
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchCatchupStalledClientsDoNotStarveOthers: eight streams whose
// clients stopped reading while their catch-ups still had events to hand
// over do not keep the ninth stream's catch-up from running: each gives its
// slot up after a while, and goes on once its client reads again.
func TestWatchCatchupStalledClientsDoNotStarveOthers(t *testing.T) {
	up := newFakeUpstream()
	w := newWorldAt(t, 10, up, nil)
	w.srv.catchupStall = 20 * time.Millisecond

	type stalled struct {
		fs      *fakeStream
		us      *fakeUpstreamStream
		release func()
	}
	var all []stalled
	for i := range maxCatchups {
		fs := w.watch()
		checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 3}), 0, 10)
		blocked, release := fs.block()
		us := up.next(t)
		us.create(t)
		us.created(t, 10)
		us.events(t, 10, putEvent("k", 4)) // the send loop takes it, and blocks sending it
		waitClosed(t, blocked, fmt.Sprintf("stalled stream %d to block", i))
		us.events(t, 10, putEvent("k", 5)) // the catch-up cannot hand this over
		all = append(all, stalled{fs, us, release})
	}

	ninth := w.watch()
	checkCreated(t, ninth.create(t, &pb.WatchCreateRequest{Key: []byte("j"), StartRevision: 3}), 0, 10)
	us := up.next(t)
	if cr := us.create(t); string(cr.Key) != "j" {
		t.Fatalf("upstream create %v, want the ninth stream's", cr)
	}
	testsupport.WaitFor(t, waitTimeout, "the stalled catch-ups to close their upstream watches", func() bool {
		return !slices.ContainsFunc(all, func(s stalled) bool { return !s.us.ended() })
	})
	us.created(t, 10)
	us.events(t, 10, putEvent("j", 6))
	us.progress(t, 10)
	w.apply(put("j", "v")) // 11
	if got := revs(ninth.eventsOf(t, 0, 11)); !slices.Equal(got, []int64{6, 11}) {
		t.Fatalf("the ninth stream got revisions %v, want [6 11]", got)
	}

	// A stalled stream that reads again gets the rest, the catch-up going
	// on from where it was.
	s := all[0]
	s.release()
	if got := revs(s.fs.eventsOf(t, 0, 5)); !slices.Equal(got, []int64{4, 5}) {
		t.Fatalf("the released stream got revisions %v, want [4 5]", got)
	}
	us = up.next(t)
	if cr := us.create(t); cr.StartRevision != 6 || string(cr.Key) != "k" {
		t.Fatalf("the released stream's catch-up resumed with %v, want from 6", cr)
	}
	us.created(t, 11)
	us.progress(t, 11)
	w.apply(put("k", "v")) // 12
	if got := revs(s.fs.eventsOf(t, 0, 12)); !slices.Equal(got, []int64{12}) {
		t.Fatalf("the released stream got revisions %v after the catch-up, want [12]", got)
	}
	for _, s := range all[1:] {
		s.release()
	}
}

// TestWatchInconsistentEndsRunningStreams: once the consistency checker
// finds the store inconsistent, a running stream cancels each of its
// watchers as compacted, at the revision it would go on from, and then
// ends with Unavailable; a new stream is relayed to etcd.
func TestWatchInconsistentEndsRunningStreams(t *testing.T) {
	up := newFakeUpstream()
	checker := &fakeConsistency{}
	w := newWorldAt(t, 1, up, func(cfg *Config) { cfg.Consistency = checker })
	recorder := tracetest.NewSpanRecorder()
	tracer := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder)).Tracer("test")
	fs := newFakeStream()
	defer fs.cancel()
	var span trace.Span
	fs.ctx, span = tracer.Start(fs.ctx, "served") // as the stream's span, with tracing on
	done := make(chan error, 1)
	go func() { done <- w.srv.Watch(fs) }()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("j")}), 1, 1)
	w.apply(put("k", "v")) // 2
	if got := revs(fs.eventsOf(t, 0, 2)); !slices.Equal(got, []int64{2}) {
		t.Fatalf("got revisions %v, want [2]", got)
	}

	checker.fail() // nothing else happens: no event, no reload
	cancels := map[int64]*pb.WatchResponse{}
	for range 2 {
		r := fs.next(t)
		cancels[r.WatchId] = r
	}
	checkCompactCancel(t, cancels[0], 0, 3)
	checkCompactCancel(t, cancels[1], 1, 3)
	select {
	case err := <-done:
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("the stream ended with %v, want Unavailable", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the stream did not end")
	}

	span.End()

	relayed := newFakeStream()
	defer relayed.cancel()
	var relayedSpan trace.Span
	relayed.ctx, relayedSpan = tracer.Start(relayed.ctx, "relayed")
	relayDone := make(chan error, 1)
	go func() { relayDone <- w.srv.Watch(relayed) }()
	up.next(t)
	relayed.cancel()
	select {
	case err := <-relayDone:
		if err != nil && !errors.Is(err, context.Canceled) && status.Code(err) != codes.Canceled {
			t.Fatalf("relayed stream: %v", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the relayed stream did not end")
	}
	relayedSpan.End()

	// Each stream's span says why the cache did not serve it: the running
	// one ended for clients to relist, the new one went to etcd.
	want := map[string]string{"served": "relist", "relayed": "inconsistent"}
	for _, sp := range recorder.Ended() {
		var reasons []string
		for _, ev := range sp.Events() {
			if ev.Name != fallbackEvent {
				continue
			}
			for _, kv := range ev.Attributes {
				if kv.Key == attrReason {
					reasons = append(reasons, kv.Value.AsString())
				}
			}
		}
		if !slices.Equal(reasons, []string{want[sp.Name()]}) {
			t.Errorf("the %s stream's span has fallback events %v, want [%s]", sp.Name(), reasons, want[sp.Name()])
		}
	}
}

// TestWatchTimelineChangeEndsStreams: when etcd's history changes under the
// store (a restore, another cluster), every running watcher gets the
// compacted cancel, so that clients relist, and the stream ends with
// Unavailable, as when the cache is found inconsistent.
func TestWatchTimelineChangeEndsStreams(t *testing.T) {
	w := newWorldAt(t, 1, newFakeUpstream(), nil)
	fs := newFakeStream()
	defer fs.cancel()
	done := make(chan error, 1)
	go func() { done <- w.srv.Watch(fs) }()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 1)
	w.apply(put("k", "v")) // 2
	if got := revs(fs.eventsOf(t, 0, 2)); !slices.Equal(got, []int64{2}) {
		t.Fatalf("got revisions %v, want [2]", got)
	}
	w.follower.changeEpoch()
	checkCompactCancel(t, fs.next(t), 0, 3)
	select {
	case err := <-done:
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("the stream ended with %v, want Unavailable", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the stream did not end")
	}
}

// TestWatchCaughtUpWatcherIsSynced: a watcher whose catch-up from etcd
// reached etcd's head (a progress notification on the catch-up watch) is
// synced, as etcd's: a compaction etcd makes after that, mirrored above the
// store's head before the feed has delivered up to it, does not cancel it,
// and it gets the events as the watcher synced at the head does.
func TestWatchCaughtUpWatcherIsSynced(t *testing.T) {
	up := newFakeUpstream()
	w := newWorldAt(t, 10, up, nil)
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 10)
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 3}), 1, 10)
	us := up.next(t)
	us.create(t)
	us.created(t, 15)
	blocked, release := fs.block()
	us.events(t, 15, putEvent("k", 4))
	waitClosed(t, blocked, "the send loop to block sending revision 4")
	us.progress(t, 15)  // etcd's catch-up watcher is synced at its head, 15
	w.store.Compact(13) // then etcd compacts at 13; the store is at 10
	release()
	if r := fs.next(t); r.WatchId != 1 || !slices.Equal(revs(r.Events), []int64{4}) {
		t.Fatalf("got %v, want watch 1's event at 4", r)
	}
	for range 5 {
		w.apply(put("k", "v")) // 11..15
	}
	got := map[int64][]int64{}
	for len(got[0]) < 5 || len(got[1]) < 5 {
		r := fs.next(t)
		if r.Canceled {
			t.Fatalf("after %v: %v; etcd sends both watchers 11..15", got, r)
		}
		got[r.WatchId] = append(got[r.WatchId], revs(r.Events)...)
	}
}
