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

// TestSkipQuietAfterReadingPastTheScans: a send loop that read the history
// past the notifier's scans (its watcher's event among what it read) still
// skips the quiet revisions after its position: the event it was already
// sent is not taken for its next.
func TestSkipQuietAfterReadingPastTheScans(t *testing.T) {
	w := newWorld(t)
	n := newNotifier(w.store, w.follower)
	n.scanned = w.store.Rev()
	wt := &watcher{keyRange: keyRange{key: []byte("b")}, synced: true}
	st := &stream{wake: make(chan struct{}, 1), watchers: map[int64]*watcher{0: wt}}
	n.watch(st, 0, wt.keyRange)

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
