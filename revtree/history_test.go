package revtree_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// historyRequests are compared between stores: every response form, over
// ranges that the written keys start, end and cut.
func historyRequests() []*pb.RangeRequest {
	return []*pb.RangeRequest{
		{Key: []byte{0}, RangeEnd: []byte{0}},
		{Key: []byte{0}, RangeEnd: []byte{0}, KeysOnly: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, CountOnly: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, Limit: 3},
		{Key: []byte("k10"), RangeEnd: []byte("k20")},
		{Key: []byte("k10"), RangeEnd: []byte("k20"), CountOnly: true},
		{Key: []byte("k30"), RangeEnd: []byte{0}, Limit: 2},
		{Key: []byte("k05")},
		{Key: []byte("k05"), CountOnly: true},
		{Key: []byte("k39"), RangeEnd: []byte("k05")},
		{Key: []byte{0}, RangeEnd: []byte{0}, SortTarget: pb.RangeRequest_MOD, SortOrder: pb.RangeRequest_DESCEND, Limit: 5},
		{Key: []byte{0}, RangeEnd: []byte{0}, SortTarget: pb.RangeRequest_VALUE, Limit: 4},
		{Key: []byte{0}, RangeEnd: []byte{0}, MinModRevision: 60, MaxCreateRevision: 200},
	}
}

// historyWorkload writes random revisions to several stores: puts,
// deletes, Txns that write several keys, and rarely a Txn over 300 keys.
type historyWorkload struct {
	rng  *rand.Rand
	rev  int64
	live map[string]*mvccpb.KeyValue
}

func (w *historyWorkload) put(key string, evs []*mvccpb.Event, state map[string]*mvccpb.KeyValue) []*mvccpb.Event {
	kv := &mvccpb.KeyValue{Key: []byte(key), Value: fmt.Appendf(nil, "%s@%d/%d", key, w.rev, w.rng.IntN(1000)), CreateRevision: w.rev, ModRevision: w.rev, Version: 1}
	if prev := state[key]; prev != nil {
		kv.CreateRevision, kv.Version = prev.CreateRevision, prev.Version+1
	}
	state[key] = kv
	return append(evs, &mvccpb.Event{Type: mvccpb.PUT, Kv: kv})
}

func (w *historyWorkload) next() (int64, []*mvccpb.Event) {
	w.rev++
	key := func() string { return fmt.Sprintf("k%02d", w.rng.IntN(40)) }
	var evs []*mvccpb.Event
	switch op := w.rng.IntN(100); {
	case op < 55:
		evs = w.put(key(), evs, w.live)
	case op < 99:
		n := 1 + w.rng.IntN(5)
		for range n {
			k := key()
			if w.live[k] != nil && w.rng.IntN(3) == 0 {
				evs = append(evs, &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(k), ModRevision: w.rev}})
				delete(w.live, k)
				continue
			}
			evs = w.put(k, evs, w.live)
		}
	default:
		for i := range 300 {
			evs = w.put(fmt.Sprintf("k%02d/%03d", i%40, i), evs, w.live)
		}
	}
	return w.rev, evs
}

// applyToAll applies revision rev to every store, each with its own copy
// of the events (Apply fills in PrevKv).
func applyToAll(t *testing.T, stores []*revtree.Store, rev int64, evs []*mvccpb.Event) {
	t.Helper()
	for _, s := range stores {
		own := make([]*mvccpb.Event, len(evs))
		for i, ev := range evs {
			own[i] = proto.Clone(ev).(*mvccpb.Event)
		}
		if _, err := s.Apply(rev, own); err != nil {
			t.Fatalf("Apply(%d): %v", rev, err)
		}
	}
}

// TestPrunedHistories: stores that drop history (compaction, and history
// budgets that prune the key index every few revisions) answer every
// request at every revision they retain as a store that keeps every
// revision, whatever the index's degree; and a view keeps answering as it
// did after the store dropped its revision and pruned the versions it
// read.
func TestPrunedHistories(t *testing.T) {
	type setup struct {
		name    string
		degree  int
		compact bool
		budget  int64
	}
	setups := []setup{
		{name: "every revision", degree: 3}, // the reference
		{name: "compacted", degree: 3, compact: true},
		{name: "budget 20 KB", degree: 2, budget: 20_000},
		{name: "budget 60 KB, compacted", degree: 8, compact: true, budget: 60_000},
		{name: "budget 200 KB", degree: 32, budget: 200_000},
	}
	stores := make([]*revtree.Store, len(setups))
	w := &historyWorkload{rng: rand.New(rand.NewPCG(7, 11)), rev: 1, live: map[string]*mvccpb.KeyValue{}}
	var load []*mvccpb.KeyValue
	for i := 0; i < 40; i += 2 {
		w.rev++
		k := fmt.Sprintf("k%02d", i)
		w.live[k] = &mvccpb.KeyValue{Key: []byte(k), Value: []byte(k), CreateRevision: w.rev, ModRevision: w.rev, Version: 1}
		load = append(load, w.live[k])
	}
	for i, su := range setups {
		stores[i] = revtree.New(su.degree)
		stores[i].SetMaxHistoryBytes(su.budget)
		stores[i].Reset(w.rev, load, 0)
	}
	compare := func(stage string) {
		t.Helper()
		ref := stores[0]
		for rev := ref.OldestRev() - 1; rev <= ref.Rev()+1; rev++ {
			for _, req := range historyRequests() {
				req.Revision = rev
				want, wantErr := ref.Range(req, revtree.RangeOptions{})
				for i, s := range stores[1:] {
					below := rev < max(s.OldestRev(), s.CompactRev()) // before the read, which may trim
					got, err := s.Range(req, revtree.RangeOptions{})
					if below {
						if !errors.Is(err, revtree.ErrNotRetained) && !errors.Is(err, revtree.ErrCompacted) {
							t.Fatalf("%s: %s: %v at %d, below its history: %v, %v", stage, setups[i+1].name, req, rev, got, err)
						}
						continue
					}
					if err != wantErr || !proto.Equal(got, want) {
						t.Fatalf("%s: %s: %v at %d:\n got %v, %v\nwant %v, %v", stage, setups[i+1].name, req, rev, got, err, want, wantErr)
					}
				}
			}
		}
	}
	for step := range 1500 {
		rev, evs := w.next()
		applyToAll(t, stores, rev, evs)
		switch {
		case step%500 == 499:
			compare(fmt.Sprintf("at %d", rev))
		case step%97 == 96:
			at := rev - int64(w.rng.IntN(60))
			for i, s := range stores {
				if setups[i].compact {
					s.Compact(at)
				}
			}
		}
	}
	for i, s := range stores[1:] {
		if s.OldestRev() <= stores[0].OldestRev()+100 {
			t.Errorf("%s: oldest revision %d: dropped too little to test (the reference's: %d)", setups[i+1].name, s.OldestRev(), stores[0].OldestRev())
		}
	}

	// Views taken before the budget drops their revisions, and the prune
	// removes their versions, still answer as they did.
	head := stores[0].Rev()
	type held struct {
		view revtree.View
		want []*pb.RangeResponse
	}
	var views []held
	for _, s := range stores {
		for rev := head - 9; rev <= head; rev++ {
			v, err := s.View(rev)
			if err != nil {
				t.Fatal(err)
			}
			h := held{view: v}
			for _, req := range historyRequests() {
				h.want = append(h.want, v.Range(req, revtree.RangeOptions{}))
			}
			views = append(views, h)
		}
	}
	for _, s := range stores {
		s.SetMaxHistoryBytes(1)
	}
	for range 200 {
		rev, evs := w.next()
		applyToAll(t, stores, rev, evs)
	}
	for i, s := range stores {
		if s.OldestRev() != s.Rev() {
			t.Fatalf("%s under a budget of 1 byte: oldest revision %d, head %d", setups[i].name, s.OldestRev(), s.Rev())
		}
	}
	for _, h := range views {
		for i, req := range historyRequests() {
			if got := h.view.Range(req, revtree.RangeOptions{}); !proto.Equal(got, h.want[i]) {
				t.Fatalf("view at %d, %v after its revision was dropped: %v, want %v", h.view.Rev, req, got, h.want[i])
			}
		}
	}
	// Each store's head, read again, is the same as every other's.
	for _, req := range historyRequests() {
		want, _ := stores[0].Range(req, revtree.RangeOptions{})
		for i, s := range stores[1:] {
			if got, err := s.Range(req, revtree.RangeOptions{}); err != nil || !proto.Equal(got, want) {
				t.Fatalf("%s at the head after pruning, %v: %v, %v, want %v", setups[i+1].name, req, got, err, want)
			}
		}
	}
}

// TestReadersWhilePruning: readers at random retained revisions, and views
// held across drops, read exactly the keyspace of their revision while a
// writer creates, updates and deletes keys under a small history budget
// and compacts, so that the index is swept every few revisions (run it
// with -race: readers take no lock on the index).
func TestReadersWhilePruning(t *testing.T) {
	const keys, revs = 32, 2000
	rng := rand.New(rand.NewPCG(5, 8))
	// The workload and the keyspace after each revision, as "key@mod".
	type rev struct {
		evs  []*mvccpb.Event
		want string
	}
	live := map[string]*mvccpb.KeyValue{}
	plan := make([]rev, revs+1)
	for r := int64(2); r <= revs; r++ {
		k := fmt.Sprintf("k%02d", rng.IntN(keys))
		var ev *mvccpb.Event
		if prev := live[k]; prev != nil && rng.IntN(3) == 0 {
			ev = delEv(k, r)
			delete(live, k)
		} else {
			kv := mkKV(k, r, r, 1)
			if prev != nil {
				kv = mkKV(k, prev.CreateRevision, r, prev.Version+1)
			}
			live[k] = kv
			ev = putEv(kv)
		}
		var state []string
		for key, kv := range live {
			state = append(state, fmt.Sprintf("%s@%d", key, kv.ModRevision))
		}
		slices.Sort(state)
		plan[r] = rev{evs: []*mvccpb.Event{ev}, want: strings.Join(state, " ")}
	}
	plan[1].want = ""

	s := revtree.New(2)
	s.SetMaxHistoryBytes(30_000)
	// Every read flattens its range, whose growth drops snapshots from
	// the readers' side while the writer sweeps.
	s.SetMinFlatKVsForTest(1)
	s.Reset(1, nil, 0)
	read := func(v revtree.View) string {
		resp := v.Range(&pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}, revtree.RangeOptions{})
		var got []string
		for _, kv := range resp.Kvs {
			got = append(got, fmt.Sprintf("%s@%d", kv.Key, kv.ModRevision))
		}
		return strings.Join(got, " ")
	}
	readWhileApplying(t, 3, revs, func(r int64) {
		if _, err := s.Apply(r, plan[r].evs); err != nil {
			t.Errorf("Apply(%d): %v", r, err)
		}
		if r%200 == 0 {
			s.Compact(r - 50)
		}
	}, func(g int, done <-chan struct{}) error {
		rng := rand.New(rand.NewPCG(uint64(g), 1))
		var held []revtree.View
		for {
			select {
			case <-done:
				for _, v := range held {
					if got := read(v); got != plan[v.Rev].want {
						return fmt.Errorf("view at %d held across drops: %q, want %q", v.Rev, got, plan[v.Rev].want)
					}
				}
				return nil
			default:
			}
			runtime.Gosched() // the writer's turn comes sooner than at preemption
			head, oldest := s.Rev(), s.OldestRev()
			r := oldest + rng.Int64N(head-oldest+1)
			v, err := s.View(r)
			if errors.Is(err, revtree.ErrNotRetained) || errors.Is(err, revtree.ErrCompacted) {
				continue
			}
			if err != nil {
				return fmt.Errorf("View(%d): %v", r, err)
			}
			if got := read(v); got != plan[r].want {
				return fmt.Errorf("Range at %d: %q, want %q", r, got, plan[r].want)
			}
			if rng.IntN(50) == 0 && len(held) < 20 {
				held = append(held, v)
			}
		}
	})
	if s.HistoryTrimmed() == 0 {
		t.Errorf("the budget dropped nothing")
	}
}
