package revtree_test

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

func mkKV(key string, create, mod, ver int64) *mvccpb.KeyValue {
	return &mvccpb.KeyValue{Key: []byte(key), Value: []byte(fmt.Sprintf("%s@%d", key, mod)), CreateRevision: create, ModRevision: mod, Version: ver}
}

func putEv(kv *mvccpb.KeyValue) *mvccpb.Event { return &mvccpb.Event{Type: mvccpb.PUT, Kv: kv} }

func delEv(key string, rev int64) *mvccpb.Event {
	return &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(key), ModRevision: rev}}
}

var everything = &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}

// keysAt renders the keyspace at rev as "key@mod ..." (etcd's header
// revision after a '|'), or the error.
func keysAt(s *revtree.Store, rev int64) (string, error) {
	req := proto.Clone(everything).(*pb.RangeRequest)
	req.Revision = rev
	resp, err := s.Range(req, revtree.RangeOptions{})
	if err != nil {
		return "", err
	}
	out := ""
	for _, kv := range resp.Kvs {
		out += fmt.Sprintf("%s@%d ", kv.Key, kv.ModRevision)
	}
	if int(resp.Count) != len(resp.Kvs) {
		return "", fmt.Errorf("count %d for %d kvs", resp.Count, len(resp.Kvs))
	}
	return fmt.Sprintf("%s|%d", out, resp.Header.Revision), nil
}

type read struct {
	rev  int64
	want string // keysAt output, if err is nil
	err  error
}

func checkReads(t *testing.T, s *revtree.Store, stage string, reads []read) {
	t.Helper()
	for _, r := range reads {
		got, err := keysAt(s, r.rev)
		if r.err != nil {
			if !errors.Is(err, r.err) {
				t.Errorf("%s: read at %d: got %q, %v; want error %v", stage, r.rev, got, err, r.err)
			}
			if _, verr := s.View(r.rev); !errors.Is(verr, r.err) {
				t.Errorf("%s: View(%d): %v, want %v", stage, r.rev, verr, r.err)
			}
			continue
		}
		if err != nil || got != r.want {
			t.Errorf("%s: read at %d: got %q, %v; want %q", stage, r.rev, got, err, r.want)
		}
	}
}

func checkState(t *testing.T, s *revtree.Store, stage string, rev, compactRev, oldest int64, snapshots int) {
	t.Helper()
	if s.Rev() != rev || s.CompactRev() != compactRev || s.OldestRev() != oldest || s.Snapshots() != snapshots {
		t.Errorf("%s: Rev %d CompactRev %d OldestRev %d Snapshots %d; want %d %d %d %d", stage,
			s.Rev(), s.CompactRev(), s.OldestRev(), s.Snapshots(), rev, compactRev, oldest, snapshots)
	}
}

// sameKV reports whether a and b are the same key-value: both nil, or
// equal (the store keeps its own copy of each key-value it is given).
func sameKV(a, b *mvccpb.KeyValue) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return proto.Equal(a, b)
}

// workedExample builds the store of doc.go's worked example: load at 4 with
// {a@2, b@4}, then put(c)@5, del(a)@6, Txn put(b),put(d)@7.
func workedExample(t *testing.T, degree int) (*revtree.Store, map[string]*mvccpb.KeyValue) {
	t.Helper()
	kvs := map[string]*mvccpb.KeyValue{
		"a2": mkKV("a", 2, 2, 1),
		"b4": mkKV("b", 3, 4, 2),
		"c5": mkKV("c", 5, 5, 1),
		"b7": mkKV("b", 3, 7, 3),
		"d7": mkKV("d", 7, 7, 1),
	}
	s := revtree.New(degree)
	s.Reset(4, []*mvccpb.KeyValue{kvs["b4"], kvs["a2"]}, 0)
	steps := []struct {
		rev      int64
		events   []*mvccpb.Event
		wantPrev []*mvccpb.KeyValue
	}{
		{5, []*mvccpb.Event{putEv(kvs["c5"])}, []*mvccpb.KeyValue{nil}},
		{6, []*mvccpb.Event{delEv("a", 6)}, []*mvccpb.KeyValue{kvs["a2"]}},
		{7, []*mvccpb.Event{putEv(kvs["b7"]), putEv(kvs["d7"])}, []*mvccpb.KeyValue{kvs["b4"], nil}},
	}
	for _, st := range steps {
		out, err := s.Apply(st.rev, st.events)
		if err != nil {
			t.Fatalf("Apply(%d): %v", st.rev, err)
		}
		for i, ev := range out {
			if ev != st.events[i] || !sameKV(ev.PrevKv, st.wantPrev[i]) {
				t.Fatalf("Apply(%d) event %d: %v (PrevKv %p), want PrevKv %v (%p)", st.rev, i, ev, ev.PrevKv, st.wantPrev[i], st.wantPrev[i])
			}
		}
	}
	return s, kvs
}

func TestWorkedExample(t *testing.T) {
	for _, degree := range []int{0, 2, 3, 32} {
		t.Run(fmt.Sprintf("degree=%d", degree), func(t *testing.T) {
			s, _ := workedExample(t, degree)
			checkState(t, s, "after apply", 7, 0, 4, 4)
			checkReads(t, s, "after apply", []read{
				{rev: 3, err: revtree.ErrNotRetained},
				{rev: 4, want: "a@2 b@4 |7"},
				{rev: 5, want: "a@2 b@4 c@5 |7"},
				{rev: 6, want: "b@4 c@5 |7"},
				{rev: 7, want: "b@7 c@5 d@7 |7"},
				{rev: 0, want: "b@7 c@5 d@7 |7"},
				{rev: -1, want: "b@7 c@5 d@7 |7"},
				{rev: 8, err: revtree.ErrFutureRev},
				{rev: 1 << 62, err: revtree.ErrFutureRev},
			})

			// Advance: 8 and 9 read from snapshot 7; the header says 9.
			s.Advance(9)
			s.Advance(8) // never backwards
			checkState(t, s, "after Advance(9)", 9, 0, 4, 4)
			checkReads(t, s, "after Advance(9)", []read{
				{rev: 7, want: "b@7 c@5 d@7 |9"},
				{rev: 8, want: "b@7 c@5 d@7 |9"},
				{rev: 9, want: "b@7 c@5 d@7 |9"},
				{rev: 0, want: "b@7 c@5 d@7 |9"},
				{rev: 10, err: revtree.ErrFutureRev},
				{rev: 4, want: "a@2 b@4 |9"},
			})

			// Compact(6): 4 and 5 go, 6 stays (a read at exactly the
			// compaction revision is valid); reads below 6 are compacted,
			// even below the oldest snapshot.
			s.Compact(6)
			s.Compact(5) // never backwards
			checkState(t, s, "after Compact(6)", 9, 6, 6, 2)
			checkReads(t, s, "after Compact(6)", []read{
				{rev: 3, err: revtree.ErrCompacted},
				{rev: 4, err: revtree.ErrCompacted},
				{rev: 5, err: revtree.ErrCompacted},
				{rev: 6, want: "b@4 c@5 |9"},
				{rev: 7, want: "b@7 c@5 d@7 |9"},
				{rev: 10, err: revtree.ErrFutureRev},
			})

			// Compact between snapshots keeps the floor snapshot: 8 reads
			// from snapshot 7, so 7 stays although 7 is now compacted.
			s.Compact(8)
			checkState(t, s, "after Compact(8)", 9, 8, 7, 1)
			checkReads(t, s, "after Compact(8)", []read{
				{rev: 6, err: revtree.ErrCompacted},
				{rev: 7, err: revtree.ErrCompacted},
				{rev: 8, want: "b@7 c@5 d@7 |9"},
				{rev: 9, want: "b@7 c@5 d@7 |9"},
			})

			// Compact at the store revision and beyond what is applied.
			s.Compact(9)
			checkState(t, s, "after Compact(9)", 9, 9, 7, 1)
			checkReads(t, s, "after Compact(9)", []read{
				{rev: 8, err: revtree.ErrCompacted},
				{rev: 9, want: "b@7 c@5 d@7 |9"},
				{rev: 0, want: "b@7 c@5 d@7 |9"},
			})

			// Applying after Advance continues from the advanced revision.
			e10 := mkKV("e", 10, 10, 1)
			if _, err := s.Apply(10, []*mvccpb.Event{putEv(e10)}); err != nil {
				t.Fatalf("Apply(10): %v", err)
			}
			checkState(t, s, "after Apply(10)", 10, 9, 7, 2)
			checkReads(t, s, "after Apply(10)", []read{
				{rev: 9, want: "b@7 c@5 d@7 |10"},
				{rev: 10, want: "b@7 c@5 d@7 e@10 |10"},
			})

			// Reset discards every snapshot; the compaction revision never
			// moves backwards.
			s.Reset(20, []*mvccpb.KeyValue{mkKV("x", 15, 20, 2)}, 3)
			checkState(t, s, "after Reset(20)", 20, 9, 20, 1)
			checkReads(t, s, "after Reset(20)", []read{
				{rev: 8, err: revtree.ErrCompacted},
				{rev: 10, err: revtree.ErrNotRetained},
				{rev: 19, err: revtree.ErrNotRetained},
				{rev: 20, want: "x@20 |20"},
				{rev: 21, err: revtree.ErrFutureRev},
			})
			s.Reset(30, nil, 25)
			checkState(t, s, "after Reset(30)", 30, 25, 30, 1)
			checkReads(t, s, "after Reset(30)", []read{
				{rev: 24, err: revtree.ErrCompacted},
				{rev: 29, err: revtree.ErrNotRetained},
				{rev: 30, want: "|30"},
			})
		})
	}
}

func TestNotLoaded(t *testing.T) {
	s := revtree.New(0)
	if s.Loaded() || s.OldestRev() != 0 || s.Snapshots() != 0 || s.Rev() != 0 {
		t.Fatalf("new store: Loaded %v OldestRev %d Snapshots %d Rev %d", s.Loaded(), s.OldestRev(), s.Snapshots(), s.Rev())
	}
	if _, err := s.Range(everything, revtree.RangeOptions{}); !errors.Is(err, revtree.ErrNotLoaded) {
		t.Errorf("Range before Reset: %v", err)
	}
	if _, err := s.View(0); !errors.Is(err, revtree.ErrNotLoaded) {
		t.Errorf("View before Reset: %v", err)
	}
	if _, err := s.Apply(1, []*mvccpb.Event{putEv(mkKV("a", 1, 1, 1))}); !errors.Is(err, revtree.ErrInconsistent) {
		t.Errorf("Apply before Reset: %v", err)
	}
	s.Advance(5)
	s.Compact(3)
	if _, err := s.View(0); !errors.Is(err, revtree.ErrNotLoaded) {
		t.Errorf("View after Advance/Compact before Reset: %v", err)
	}
	// The compaction recorded before the load still counts.
	s.Reset(10, nil, 0)
	if !s.Loaded() || s.Rev() != 10 || s.CompactRev() != 3 {
		t.Errorf("after Reset: Loaded %v Rev %d CompactRev %d", s.Loaded(), s.Rev(), s.CompactRev())
	}
}

func TestApplyRejects(t *testing.T) {
	// The store is doc.go's example at 7: {b@7 (v3) c@5 d@7}.
	cases := []struct {
		name   string
		rev    int64
		events []*mvccpb.Event
	}{
		{"same revision", 7, []*mvccpb.Event{putEv(mkKV("e", 7, 7, 1))}},
		{"older revision", 5, []*mvccpb.Event{putEv(mkKV("e", 5, 5, 1))}},
		{"no events", 8, nil},
		{"empty events", 8, []*mvccpb.Event{}},
		{"nil kv", 8, []*mvccpb.Event{{Type: mvccpb.PUT}}},
		{"event of another revision", 8, []*mvccpb.Event{putEv(mkKV("e", 9, 9, 1))}},
		{"new key with version 2", 8, []*mvccpb.Event{putEv(mkKV("e", 8, 8, 2))}},
		{"existing key with version 1", 8, []*mvccpb.Event{putEv(mkKV("b", 8, 8, 1))}},
		{"existing key skipping a version", 8, []*mvccpb.Event{putEv(mkKV("b", 3, 8, 5))}},
		{"delete of absent key", 8, []*mvccpb.Event{delEv("a", 8)}},
		{"delete of another revision", 8, []*mvccpb.Event{delEv("b", 7)}},
		{"unknown event type", 8, []*mvccpb.Event{{Type: mvccpb.Event_EventType(7), Kv: mkKV("b", 3, 8, 4)}}},
		// Txns: the first events are fine, a later one is not, so nothing
		// may be applied.
		{"txn put twice with same version", 8, []*mvccpb.Event{putEv(mkKV("c", 5, 8, 2)), putEv(mkKV("c", 5, 8, 2))}},
		{"txn delete twice", 8, []*mvccpb.Event{putEv(mkKV("e", 8, 8, 1)), delEv("c", 8), delEv("c", 8)}},
		{"txn put after delete keeps version", 8, []*mvccpb.Event{delEv("c", 8), putEv(mkKV("c", 5, 8, 2))}},
		{"txn delete of key put in another revision", 8, []*mvccpb.Event{putEv(mkKV("e", 8, 8, 1)), delEv("e", 9)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := workedExample(t, 2)
			before, err := keysAt(s, 0)
			if err != nil {
				t.Fatal(err)
			}
			var prevs []*mvccpb.KeyValue
			for _, ev := range tc.events {
				prevs = append(prevs, ev.PrevKv)
			}
			if _, err := s.Apply(tc.rev, tc.events); !errors.Is(err, revtree.ErrInconsistent) {
				t.Fatalf("Apply: %v, want ErrInconsistent", err)
			}
			checkState(t, s, "after rejected Apply", 7, 0, 4, 4)
			if after, err := keysAt(s, 0); err != nil || after != before {
				t.Errorf("store changed: %q, %v; was %q", after, err, before)
			}
			for i, ev := range tc.events {
				if ev.PrevKv != prevs[i] {
					t.Errorf("event %d PrevKv set to %v by a rejected Apply", i, ev.PrevKv)
				}
			}
			batches, _, err := s.EventsFrom(s.HistoryStart(), 100, 0)
			if n := len(batches); err != nil || n != 3 {
				t.Errorf("%d revisions of events retained, want 3", n)
			}
			// The store still takes the correct next revision.
			if _, err := s.Apply(8, []*mvccpb.Event{putEv(mkKV("c", 5, 8, 2))}); err != nil {
				t.Errorf("Apply(8) after the rejection: %v", err)
			}
		})
	}
}

// TestApplyTxnSameKey covers a revision that touches one key several times:
// versions continue inside the Txn and PrevKv is the Txn's own earlier write.
func TestApplyTxnSameKey(t *testing.T) {
	s, kvs := workedExample(t, 2)
	c8a, c8b := mkKV("c", 5, 8, 2), mkKV("c", 5, 8, 3)
	c8b.Value = []byte("second")
	c8new := mkKV("c", 8, 8, 1)
	evs := []*mvccpb.Event{putEv(c8a), putEv(c8b), delEv("c", 8), putEv(c8new), delEv("b", 8)}
	out, err := s.Apply(8, evs)
	if err != nil {
		t.Fatalf("Apply: %v", err)
	}
	wantPrev := []*mvccpb.KeyValue{kvs["c5"], c8a, c8b, nil, kvs["b7"]}
	for i, ev := range out {
		if !sameKV(ev.PrevKv, wantPrev[i]) {
			t.Errorf("event %d: PrevKv %v, want %v", i, ev.PrevKv, wantPrev[i])
		}
	}
	checkReads(t, s, "after txn", []read{
		{rev: 7, want: "b@7 c@5 d@7 |8"},
		{rev: 8, want: "c@8 d@7 |8"},
	})
	v, err := s.View(8)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := v.Get([]byte("c")); !ok || !sameKV(got, c8new) {
		t.Errorf("Get(c) at 8: %v, %v; want %v", got, ok, c8new)
	}
	if _, ok := v.Get([]byte("b")); ok {
		t.Errorf("Get(b) at 8 found a deleted key")
	}
}

func TestEventsFrom(t *testing.T) {
	s, _ := workedExample(t, 8)
	collect := func(from, upTo int64, max int) string {
		batches, complete, err := s.EventsFrom(from, upTo, max)
		if err != nil {
			return err.Error()
		}
		var revs []int64
		for _, b := range batches {
			if len(b.Events) == 0 {
				t.Errorf("revision %d without events", b.Rev)
			}
			revs = append(revs, b.Rev)
		}
		return fmt.Sprint(revs, " complete ", complete)
	}
	check := func(from, upTo int64, max int, want string) {
		t.Helper()
		if got := collect(from, upTo, max); got != want {
			t.Errorf("EventsFrom(%d, %d, %d): %s, want %s", from, upTo, max, got, want)
		}
	}
	if got := s.HistoryStart(); got != 5 {
		t.Errorf("HistoryStart = %d, want 5: the load at 4 has no events", got)
	}
	check(5, 100, 0, "[5 6 7] complete 7") // upTo is capped at the store revision
	check(6, 7, 0, "[6 7] complete 7")
	check(6, 6, 0, "[6] complete 6")
	check(8, 100, 0, "[] complete 7")
	check(5, 100, 2, "[5 6] complete 6") // max cuts it short: complete up to 6 only
	check(4, 100, 0, revtree.ErrNotRetained.Error())

	s.Advance(9) // progress: no events at 8 or 9
	check(7, 100, 0, "[7] complete 9")

	s.Compact(6)
	if got := s.HistoryStart(); got != 6 {
		t.Errorf("HistoryStart after Compact(6) = %d, want 6: the floor keeps its events", got)
	}
	check(5, 100, 0, revtree.ErrCompacted.Error())
	check(6, 100, 0, "[6 7] complete 9") // a watch from exactly the compaction revision sees it
}

// TestRangeNeverMutates checks that keys_only and sorting never touch the
// stored KeyValues, which every snapshot shares.
func TestRangeNeverMutates(t *testing.T) {
	s := revtree.New(2)
	var stored []*mvccpb.KeyValue
	for i := range 20 {
		kv := mkKV(fmt.Sprintf("k%02d", i), int64(2+i), int64(2+i), 1)
		kv.Lease = int64(100 + i%3)
		stored = append(stored, kv)
	}
	s.Reset(30, stored, 0)
	var clones []*mvccpb.KeyValue
	for _, kv := range stored {
		clones = append(clones, proto.Clone(kv).(*mvccpb.KeyValue))
	}
	for _, opts := range []revtree.RangeOptions{{}, {KeysOnlyWithoutLease: true}} {
		for target := range 5 {
			for order := range 3 {
				req := &pb.RangeRequest{
					Key: []byte{0}, RangeEnd: []byte{0}, KeysOnly: true, Limit: 7,
					SortTarget: pb.RangeRequest_SortTarget(target), SortOrder: pb.RangeRequest_SortOrder(order),
				}
				resp, err := s.Range(req, opts)
				if err != nil {
					t.Fatal(err)
				}
				wantLease := !opts.KeysOnlyWithoutLease || req.SortTarget == pb.RangeRequest_VALUE
				for _, kv := range resp.Kvs {
					if kv.Value != nil {
						t.Errorf("%v %v: keys_only returned value %q", opts, req, kv.Value)
					}
					if (kv.Lease != 0) != wantLease {
						t.Errorf("%v %v: lease %d, want lease kept: %v", opts, req, kv.Lease, wantLease)
					}
					kv.Key = []byte("scribbled") // the caller owns the response's KeyValues
				}
			}
		}
	}
	for i := range stored {
		if !proto.Equal(stored[i], clones[i]) {
			t.Errorf("stored KeyValue %d mutated: %v, was %v", i, stored[i], clones[i])
		}
	}
	resp, err := s.Range(everything, revtree.RangeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i, kv := range resp.Kvs {
		if !proto.Equal(kv, clones[i]) {
			t.Errorf("Range %d: %v, want %v", i, kv, clones[i])
		}
	}
}

// TestConcurrentReaders runs readers against a writer; with -race it checks
// that readers only see published, immutable snapshots, and every read is
// checked against the expected keyspace at its revision.
func TestConcurrentReaders(t *testing.T) {
	const keys, revs = 64, 3000
	s := revtree.New(2)
	s.Reset(1, nil, 0)
	// At revision r (>= 2) key (r-2)%keys has version (r-2)/keys+1 and the
	// keyspace holds min(r-1, keys) keys.
	var reads atomic.Int64
	readWhileApplying(t, 4, revs, func(r int64) {
		k := (r - 2) % keys
		ver := (r-2)/keys + 1
		create := r
		if ver > 1 {
			create = k + 2
		}
		kv := mkKV(fmt.Sprintf("k%02d", k), create, r, ver)
		if _, err := s.Apply(r, []*mvccpb.Event{putEv(kv)}); err != nil {
			t.Errorf("Apply(%d): %v", r, err)
		}
		if r%50 == 0 {
			s.Compact(r - 10)
		}
	}, func(g int, done <-chan struct{}) error {
		for i := 0; ; i++ {
			select {
			case <-done:
				return nil
			default:
			}
			runtime.Gosched() // the writer's turn comes sooner than at preemption
			reads.Add(1)
			cur := s.Rev()
			rev := cur - int64((i*7+g)%20)
			resp, err := s.Range(&pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, Revision: rev, SortTarget: pb.RangeRequest_MOD}, revtree.RangeOptions{})
			if errors.Is(err, revtree.ErrCompacted) {
				continue
			}
			if err != nil {
				return fmt.Errorf("Range at %d (store at %d): %v", rev, cur, err)
			}
			if rev < 1 {
				rev = resp.Header.Revision
			}
			want := min(max(rev-1, 0), keys)
			if int64(len(resp.Kvs)) != want || resp.Count != want {
				return fmt.Errorf("Range at %d: %d keys (count %d), want %d", rev, len(resp.Kvs), resp.Count, want)
			}
			for _, kv := range resp.Kvs {
				if kv.ModRevision > rev {
					return fmt.Errorf("Range at %d returned %s@%d", rev, kv.Key, kv.ModRevision)
				}
			}
		}
	})
	t.Logf("%d concurrent reads during %d applies", reads.Load(), revs-1)
}

// readWhileApplying runs read(g, done) on readers goroutines while it calls
// apply(r) for revisions 2..last, yielding between revisions so that the
// readers interleave; then it closes done, waits for the readers and
// fails t with their errors. A reader returns when done is closed (after
// checking what it held, if it likes) or at its first error.
func readWhileApplying(t *testing.T, readers int, last int64, apply func(r int64), read func(g int, done <-chan struct{}) error) {
	t.Helper()
	var wg sync.WaitGroup
	done := make(chan struct{})
	errc := make(chan error, readers)
	for g := range readers {
		wg.Go(func() {
			if err := read(g, done); err != nil {
				errc <- err
			}
		})
	}
	for r := int64(2); r <= last && !t.Failed(); r++ {
		apply(r)
		runtime.Gosched()
	}
	close(done)
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Error(err)
	}
}
