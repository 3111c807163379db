package watchproxy

import (
	"slices"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// prevKVRevs returns the revisions of the events that carry a prev_kv.
func prevKVRevs(evs []*mvccpb.Event) []int64 {
	var out []int64
	for _, ev := range evs {
		if ev.PrevKv != nil {
			out = append(out, ev.Kv.ModRevision)
		}
	}
	return out
}

// TestWatchPrevKVOmittedAtOrBelowCompaction: as etcd's send loop, which
// reads prev_kv at mod_revision-1 and sends the event without it when that
// read is compacted, the proxy sends an event of a revision at or below the
// compaction revision without prev_kv, PUT and DELETE alike, from the
// history it still holds; events above it keep theirs.
func TestWatchPrevKVOmittedAtOrBelowCompaction(t *testing.T) {
	w := newWorld(t)
	w.apply(put("k", "v1"))                // 2
	w.apply(put("k", "v2"))                // 3
	w.apply(put("k", "v3"), put("d", "x")) // 4
	w.apply(del("d"), put("k", "v4"))      // 5
	w.apply(put("k", "v5"))                // 6
	w.store.Compact(5)

	fs := w.watch()
	all := &pb.WatchCreateRequest{Key: []byte{0}, RangeEnd: []byte{0}, StartRevision: 5, PrevKv: true}
	checkCreated(t, fs.create(t, all), 0, 6)
	evs := fs.eventsOf(t, 0, 6)
	if got := revs(evs); !slices.Equal(got, []int64{5, 5, 6}) {
		t.Fatalf("events of revisions %v, want [5 5 6]", got)
	}
	if got := prevKVRevs(evs); !slices.Equal(got, []int64{6}) {
		t.Fatalf("events with prev_kv at %v, want only 6's (5-1 is compacted)", got)
	}
	if evs[2].PrevKv.ModRevision != 5 || string(evs[2].PrevKv.Value) != "v4" {
		t.Fatalf("event 6's prev_kv %v, want v4 at 5", evs[2].PrevKv)
	}

	// Without prev_kv the same events are the same bytes: the one bare
	// encoding serves both.
	bare := &pb.WatchCreateRequest{Key: []byte{0}, RangeEnd: []byte{0}, StartRevision: 5}
	checkCreated(t, fs.create(t, bare), 1, 6)
	for i, ev := range fs.eventsOf(t, 1, 6) {
		if ev.PrevKv != nil || ev.Kv.ModRevision != evs[i].Kv.ModRevision {
			t.Fatalf("bare watcher's event %d: %v", i, ev)
		}
	}
	if before := fs.barrier(t); len(before) != 0 {
		t.Fatalf("unexpected responses %v", before)
	}
}

// TestWatchPrevKVDecidedWhenSent: an event stored before a compaction and
// sent after it (the client was slow) goes out as etcd would send it then,
// without prev_kv if its previous revision is now compacted; the event
// encoded with prev_kv before the compaction, and shared by other streams,
// is not used for it.
func TestWatchPrevKVDecidedWhenSent(t *testing.T) {
	w := newWorld(t)
	w.apply(put("k", "v1")) // 2
	fast, slow := w.watch(), w.watch()
	cr := &pb.WatchCreateRequest{Key: []byte("k"), PrevKv: true}
	checkCreated(t, fast.create(t, cr), 0, 2)
	checkCreated(t, slow.create(t, cr), 0, 2)

	// The slow stream's send loop is held in a Send while 3 and 4 arrive;
	// the fast one encodes them with prev_kv and sends them.
	blocked, release := slow.block()
	slow.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("barrier"), StartRevision: -1}))
	waitClosed(t, blocked, "the slow stream to send")
	w.apply(put("k", "v2")) // 3
	w.apply(put("k", "v3")) // 4
	if got := prevKVRevs(fast.eventsOf(t, 0, 4)); !slices.Equal(got, []int64{3, 4}) {
		t.Fatalf("fast stream: prev_kv at %v, want [3 4]", got)
	}
	// etcd compacts at 3: 3's previous revision, 2, is gone; 4's is not.
	w.store.Compact(3)
	w.follower.notify()
	release()
	checkRefused(t, slow.next(t), errCompactedReason, 2)
	evs := slow.eventsOf(t, 0, 4)
	if got := revs(evs); !slices.Equal(got, []int64{3, 4}) {
		t.Fatalf("slow stream: events %v, want [3 4]", got)
	}
	if got := prevKVRevs(evs); !slices.Equal(got, []int64{4}) {
		t.Fatalf("slow stream: prev_kv at %v, want only 4's", got)
	}
}

// TestWatchCatchupPrevKVOmittedAtOrBelowCompaction: events relayed from
// etcd by a catch-up follow the same rule when the proxy sends them: etcd
// sent 5's prev_kv before it compacted at 5, and the proxy, which mirrors
// that compaction, drops it.
func TestWatchCatchupPrevKVOmittedAtOrBelowCompaction(t *testing.T) {
	up := newFakeUpstream()
	w := newWorldAt(t, 10, up, nil)
	w.store.Reset(10, nil, 5)
	fs := w.watch()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 5, PrevKv: true}), 0, 10)
	us := up.next(t)
	us.create(t)
	us.created(t, 10)
	us.events(t, 10, putEvent("k", 5), putEvent("k", 6))
	evs := fs.eventsOf(t, 0, 6)
	if got := prevKVRevs(evs); !slices.Equal(got, []int64{6}) {
		t.Fatalf("prev_kv at %v, want only 6's", got)
	}
}
