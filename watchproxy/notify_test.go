package watchproxy

import (
	"fmt"
	"slices"
	"sync"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// woken reports whether st was woken, and takes the wake.
func woken(st *stream) bool {
	select {
	case <-st.wake:
		return true
	default:
		return false
	}
}

// syncedWatcher is a notifier of w's store scanned to its head, with one
// synced watcher of key at the head, on a stream of its own: what a send
// loop's pass does to it is the test's.
func syncedWatcher(w *world, key string) (*notifier, *watcher, *stream) {
	n := newNotifier(w.store, w.follower)
	n.scanned = w.store.Rev()
	wt := &watcher{keyRange: keyRange{key: []byte(key)}, synced: true, nextRev: w.store.Rev() + 1}
	st := &stream{wake: make(chan struct{}, 1), watchers: map[int64]*watcher{0: wt}}
	n.watch(st, 0, wt.keyRange)
	return n, wt, st
}

// TestNotifierWakesOnlyConcernedStreams: a write wakes the streams with a
// watcher of its key (one key, a range, every key from a key on), and no
// other; a revision the notifier cannot read wakes them all.
func TestNotifierWakesOnlyConcernedStreams(t *testing.T) {
	w := newWorld(t)
	n := newNotifier(w.store, w.follower)
	n.scanned = w.store.Rev()
	one, prefix, from, other, none := &stream{wake: make(chan struct{}, 1)}, &stream{wake: make(chan struct{}, 1)},
		&stream{wake: make(chan struct{}, 1)}, &stream{wake: make(chan struct{}, 1)}, &stream{wake: make(chan struct{}, 1)}
	n.watch(one, 0, keyRange{key: []byte("/a/1")})
	n.watch(prefix, 0, keyRange{key: []byte("/a/"), end: []byte("/a0")})
	n.watch(from, 3, keyRange{key: []byte("/b/"), end: []byte{}})
	n.watch(other, 0, keyRange{key: []byte("/c/"), end: []byte("/c0")})
	n.watch(other, 1, keyRange{key: []byte("/a/1/x")})
	_ = none // a stream with no watcher

	check := func(what string, want ...*stream) {
		t.Helper()
		n.scan()
		for name, st := range map[string]*stream{"one": one, "prefix": prefix, "from": from, "other": other, "none": none} {
			if got := woken(st); got != slices.Contains(want, st) {
				t.Errorf("%s: stream %q woken %v, want %v", what, name, got, !got)
			}
		}
	}
	w.applySilently(put("/a/1", "v"))
	check("a write of /a/1", one, prefix)
	w.applySilently(put("/a/2", "v"))
	w.applySilently(put("/z", "v"))
	check("writes of /a/2 and /z", prefix, from)
	w.applySilently(put("/a0", "v"))
	check("a write of /a0, past the prefix and before /b/")

	n.unwatch(one, 0)
	n.leave(prefix)
	w.applySilently(put("/a/1", "v"))
	check("a write of /a/1 once its watchers left")

	w.store.Reset(w.store.Rev()+10, nil, 0) // a reload: no history to read
	check("a reload", one, from, other)
}

// TestNotifiedStreamsMissNoEvent: watchers created on many streams while
// revisions are written, each on its own keys, are sent every event after
// the revision they were created at, and nothing else.
func TestNotifiedStreamsMissNoEvent(t *testing.T) {
	w := newWorld(t)
	const streams, writes = 8, 200
	var (
		mu    sync.Mutex // guards w's applies against each other
		wg    sync.WaitGroup
		start = make(chan struct{})
	)
	wg.Go(func() {
		<-start
		for i := range writes {
			mu.Lock()
			w.apply(put(fmt.Sprintf("/k/%d", i%streams), fmt.Sprint(i)))
			mu.Unlock()
		}
	})
	fss := make([]*fakeStream, streams)
	created := make([]int64, streams)
	for i := range streams {
		fss[i] = w.watch()
	}
	close(start)
	for i, fs := range fss {
		r := fs.create(t, &pb.WatchCreateRequest{Key: fmt.Appendf(nil, "/k/%d", i)})
		created[i] = r.Header.Revision
	}
	wg.Wait()
	head := w.store.Rev()
	for i, fs := range fss {
		var want []int64
		for rev := created[i] + 1; rev <= head; rev++ {
			if string(w.applied[rev][0].Kv.Key) == fmt.Sprintf("/k/%d", i) {
				want = append(want, rev)
			}
		}
		var got []int64
		if len(want) > 0 {
			got = revs(fs.eventsOf(t, 0, want[len(want)-1]))
		}
		if !slices.Equal(got, want) {
			t.Errorf("stream %d (created at %d) got revisions %v, want %v", i, created[i], got, want)
		}
		if extra := fs.barrier(t); len(extra) != 0 {
			t.Errorf("stream %d: unexpected responses %v", i, extra)
		}
	}
}

// TestQuietWatcherSurvivesCompaction: a synced watcher that no event
// concerns moves with the head, as etcd's synced watchers do, so a
// compaction at the head, which drops the history below it at once, does
// not cancel it, even while its send loop has not run since its last
// event. (A watcher whose client has not read its events is canceled, as
// in etcd: TestWatchCompactionCancelsSyncedWatcherOnlyOnceItsEventsAreGone.)
func TestQuietWatcherSurvivesCompaction(t *testing.T) {
	w := newWorld(t)
	busy, quiet := w.watch(), w.watch()
	checkCreated(t, busy.create(t, &pb.WatchCreateRequest{Key: []byte("a")}), 0, 1)
	checkCreated(t, quiet.create(t, &pb.WatchCreateRequest{Key: []byte("b")}), 0, 1)
	first := w.apply(put("b", "v"))
	if got := revs(quiet.eventsOf(t, 0, first)); !slices.Equal(got, []int64{first}) {
		t.Fatalf("quiet watcher got revisions %v, want [%d]", got, first)
	}
	var head int64
	for range 50 {
		head = w.apply(put("a", "v"))
	}
	if got := busy.eventsOf(t, 0, head); len(got) != 50 {
		t.Fatalf("busy watcher got %d events, want 50", len(got))
	}
	// As the follower does before it compacts (SetBeforeCompact).
	w.srv.SyncWatchers()
	w.store.Compact(head)
	w.follower.notify()
	next := w.apply(put("b", "w"))
	if got := revs(quiet.eventsOf(t, 0, next)); !slices.Equal(got, []int64{next}) {
		t.Fatalf("quiet watcher got revisions %v after the compaction, want [%d]", got, next)
	}
}

// TestSkipQuietAfterTheScansRanPastAPass: the scans that run while a send
// loop is still in the pass that sent its watcher's event (it read the
// history up to that event, the scans went on to the head) stay on record,
// so that the watcher moves past the quiet revisions after a compaction
// dropped them, as etcd keeps a synced watcher, instead of finding its
// position compacted.
func TestSkipQuietAfterTheScansRanPastAPass(t *testing.T) {
	w := newWorld(t)
	n, wt, st := syncedWatcher(w, "b")

	own := w.applySilently(put("b", "v"))
	n.scan()
	n.skipQuiet(st)
	if wt.nextRev != own {
		t.Fatalf("watcher at %d after skipQuiet, want its event's %d", wt.nextRev, own)
	}
	wt.nextRev = own + 1 // the pass read the history up to its event
	var head int64
	for range 50 { // while it sends, the scans go on
		head = w.applySilently(put("a", "v"))
		n.scan()
	}
	n.delivered(st)
	w.store.Compact(head)
	n.skipQuiet(st)
	if wt.nextRev != head+1 {
		t.Fatalf("watcher at %d after skipQuiet, want %d: past the quiet revisions", wt.nextRev, head+1)
	}
	next := w.applySilently(put("b", "w"))
	n.scan()
	n.skipQuiet(st)
	if wt.nextRev != next {
		t.Fatalf("watcher at %d after skipQuiet, want its next event's %d", wt.nextRev, next)
	}
}

// TestInterestRecord: what a watcher's record says of the revisions from
// a position on: its next recorded event, past the scans when none, and
// no move when its events outnumber the record (a busy watcher reads the
// history).
func TestInterestRecord(t *testing.T) {
	it := &interest{known: 5}
	it.record(4) // below the record: the loop reads it from the history
	it.record(7)
	it.record(7) // two events of one revision
	it.record(9)
	if !slices.Equal(it.revs, []int64{7, 9}) || it.overflow {
		t.Fatalf("record %v overflow %v, want [7 9] and no overflow", it.revs, it.overflow)
	}
	for _, c := range []struct{ from, want int64 }{{5, 7}, {7, 7}, {8, 9}, {10, 21}, {30, 30}} {
		if got := it.next(c.from, 20); got != c.want {
			t.Errorf("next(%d) = %d, want %d", c.from, got, c.want)
		}
	}
	full := &interest{known: 1}
	for rev := int64(1); rev <= interestRevs+2; rev++ {
		full.record(rev)
	}
	if len(full.revs) != interestRevs || !full.overflow {
		t.Fatalf("%d revisions recorded, overflow %v: want %d and an overflow", len(full.revs), full.overflow, interestRevs)
	}
	if got := full.next(interestRevs+1, 40); got != interestRevs+1 {
		t.Fatalf("next past the record of an overflowed interest = %d, want %d: unknown, so no move", got, interestRevs+1)
	}

	// delivered keeps what is still to send, and an overflow's unknown
	// events as a possible one at the position.
	w := newWorld(t)
	n := newNotifier(w.store, w.follower)
	n.scanned = 40
	wt := &watcher{keyRange: keyRange{key: []byte("b")}, synced: true}
	st := &stream{wake: make(chan struct{}, 1), watchers: map[int64]*watcher{0: wt}}
	n.watch(st, 0, wt.keyRange)
	rec := n.interests[st][0]
	for _, rev := range []int64{41, 45} {
		rec.record(rev)
	}
	n.scanned = 50 // the scans that found them
	wt.nextRev = 42
	n.delivered(st)
	if rec.known != 42 || !slices.Equal(rec.revs, []int64{45}) {
		t.Fatalf("after delivering up to 41: known %d, revs %v; want 42, [45]", rec.known, rec.revs)
	}
	rec.overflow = true
	rec.last = 48 // an event the record had no room for
	wt.nextRev = 46
	n.delivered(st)
	if rec.known != 46 || !slices.Equal(rec.revs, []int64{46}) {
		t.Fatalf("after delivering an overflowed record up to 45: known %d, revs %v; want 46, [46]", rec.known, rec.revs)
	}
	// An overflowed record takes no later revision: it would be taken for
	// the next event, over the ones the record had no room for.
	rec.record(47)
	if !slices.Equal(rec.revs, []int64{46}) || rec.next(46, 50) != 46 || rec.next(47, 50) != 47 {
		t.Fatalf("overflowed record %v after an event at 47: next(46) %d, next(47) %d; want [46], 46, 47",
			rec.revs, rec.next(46, 50), rec.next(47, 50))
	}
	// A loop that read past the scans starts the record afresh.
	wt.nextRev = 51
	n.delivered(st)
	if rec.known != 51 || len(rec.revs) != 0 || rec.overflow {
		t.Fatalf("after reading past the scans: known %d, revs %v, overflow %v; want 51, none, no overflow", rec.known, rec.revs, rec.overflow)
	}
}

// TestBusyWatcherTurnedQuietSurvivesCompaction: a watcher whose events
// overflowed its record, once its loop has sent them all, moves with the
// head again, even when the scans ran past its pass: a compaction at the
// head then does not find it behind the history.
func TestBusyWatcherTurnedQuietSurvivesCompaction(t *testing.T) {
	w := newWorld(t)
	n, wt, st := syncedWatcher(w, "a")

	var last int64
	for range interestRevs + 4 {
		last = w.applySilently(put("a", "v"))
	}
	n.scan()
	n.skipQuiet(st)
	wt.nextRev = last + 1 // the pass read every event of the burst
	w.applySilently(put("z", "v"))
	n.scan() // the scans ran past the pass by a quiet revision
	n.delivered(st)
	var head int64
	for range 50 {
		head = w.applySilently(put("z", "v"))
		n.scan()
	}
	w.store.Compact(head)
	n.skipQuiet(st)
	if wt.nextRev != head+1 {
		t.Fatalf("watcher at %d after skipQuiet, want %d: past the quiet revisions", wt.nextRev, head+1)
	}
}

// TestQuietWatcherKeepsItsRecordThroughAReload: a quiet watcher whose
// stream has not run since a compaction keeps what the scans found quiet
// when a reload makes the notifier wake every stream: it moves past those
// revisions (and catches up from etcd from there, as etcd keeps a synced
// watcher) rather than finding its position compacted.
func TestQuietWatcherKeepsItsRecordThroughAReload(t *testing.T) {
	w := newWorld(t)
	n, wt, st := syncedWatcher(w, "b")

	own := w.applySilently(put("b", "v"))
	n.scan()
	n.skipQuiet(st)
	wt.nextRev = own + 1
	n.delivered(st)
	var head int64
	for range 50 {
		head = w.applySilently(put("a", "v"))
		n.scan()
	}
	w.store.Compact(head)
	w.store.Reset(head+5, nil, head) // reloaded: the revisions after head are not in the history
	n.scan()                         // cannot read them: wakes every stream
	n.skipQuiet(st)
	if wt.nextRev != head+1 {
		t.Fatalf("watcher at %d after a reload, want %d: past the revisions the scans found quiet", wt.nextRev, head+1)
	}
}

// TestSkipQuietNeverSkipsABusyWatchersEvents: a busy watcher, more of whose
// events come between two passes than the record holds, is moved only to
// events the record has, never across the ones it had no room for, however
// its passes and the scans interleave. Each pass delivers part of what is
// in the history; at the end every revision was delivered exactly once.
func TestSkipQuietNeverSkipsABusyWatchersEvents(t *testing.T) {
	w := newWorld(t)
	n, wt, st := syncedWatcher(w, "a")

	next := wt.nextRev
	for round := range 40 {
		// A burst of the watcher's events, scanned, then a pass that
		// reads a few of them and stops (cut short, as maxRevisionsPerPass
		// cuts a pass).
		for range 3 + round%int(2*interestRevs) {
			w.applySilently(put("a", "v"))
		}
		n.scan()
		n.skipQuiet(st)
		if wt.nextRev != next {
			t.Fatalf("round %d: skipQuiet moved the watcher from %d to %d over its events", round, next, wt.nextRev)
		}
		next = min(next+int64(1+round%5), w.store.Rev()+1)
		wt.nextRev = next
		n.delivered(st)
	}
}

// TestSkipQuietAfterReadingPastTheScans: a send loop that read the history
// past the notifier's scans (its watcher's event among what it read) still
// skips the quiet revisions after its position: the event it was already
// sent is not taken for its next.
func TestSkipQuietAfterReadingPastTheScans(t *testing.T) {
	w := newWorld(t)
	n, wt, st := syncedWatcher(w, "b")

	w.applySilently(put("b", "v"))                  // 2, the watcher's
	wt.nextRev = w.applySilently(put("a", "v")) + 1 // the loop read 2..3 before any scan
	n.delivered(st)
	n.scan()
	w.applySilently(put("a", "v"))
	head := w.applySilently(put("a", "v"))
	n.scan()
	n.skipQuiet(st)
	if wt.nextRev != head+1 {
		t.Fatalf("watcher at %d after skipQuiet, want %d: past the quiet revisions", wt.nextRev, head+1)
	}
}
