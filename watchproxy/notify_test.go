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
