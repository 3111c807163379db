package revtree_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// overlayRequests are compared between checkpoint intervals: every
// response form, over ranges that the overlaid keys start, end and cut.
func overlayRequests() []*pb.RangeRequest {
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

// overlayWorkload writes random revisions to several stores: puts,
// deletes, Txns that write a key twice or put and then delete it, and
// rarely a Txn over every key (more events than a read may overlay).
type overlayWorkload struct {
	rng  *rand.Rand
	rev  int64
	live map[string]*mvccpb.KeyValue
}

func (w *overlayWorkload) put(key string, evs []*mvccpb.Event, state map[string]*mvccpb.KeyValue) []*mvccpb.Event {
	kv := &mvccpb.KeyValue{Key: []byte(key), Value: fmt.Appendf(nil, "%s@%d/%d", key, w.rev, w.rng.IntN(1000)), CreateRevision: w.rev, ModRevision: w.rev, Version: 1}
	if prev := state[key]; prev != nil {
		kv.CreateRevision, kv.Version = prev.CreateRevision, prev.Version+1
	}
	state[key] = kv
	return append(evs, &mvccpb.Event{Type: mvccpb.PUT, Kv: kv})
}

func (w *overlayWorkload) next() (int64, []*mvccpb.Event) {
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

// TestCheckpointIntervals: a store that keeps a tree every few revisions
// and overlays the events in between answers every request at every
// retained revision as one that keeps a tree per revision, through
// compaction and the history budget; its memory estimate is at most the
// latter's; and a view keeps answering as it did after the store dropped
// its revision.
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

func TestCheckpointIntervals(t *testing.T) {
	intervals := []int{1, 2, 3, 7, revtree.DefaultCheckpointInterval}
	stores := make([]*revtree.Store, len(intervals))
	w := &overlayWorkload{rng: rand.New(rand.NewPCG(7, 11)), rev: 1, live: map[string]*mvccpb.KeyValue{}}
	var load []*mvccpb.KeyValue
	for i := 0; i < 40; i += 2 {
		w.rev++
		k := fmt.Sprintf("k%02d", i)
		w.live[k] = &mvccpb.KeyValue{Key: []byte(k), Value: []byte(k), CreateRevision: w.rev, ModRevision: w.rev, Version: 1}
		load = append(load, w.live[k])
	}
	for i, every := range intervals {
		stores[i] = revtree.New(3)
		stores[i].SetCheckpointInterval(every)
		stores[i].Reset(w.rev, load, 0)
	}
	compare := func(stage string) {
		t.Helper()
		ref := stores[0]
		for _, s := range stores[1:] {
			if s.OldestRev() != ref.OldestRev() || s.Snapshots() != ref.Snapshots() || s.HistoryStart() != ref.HistoryStart() {
				t.Fatalf("%s: oldest %d, %d snapshots, history from %d; per revision: %d, %d, %d", stage,
					s.OldestRev(), s.Snapshots(), s.HistoryStart(), ref.OldestRev(), ref.Snapshots(), ref.HistoryStart())
			}
		}
		for rev := ref.OldestRev() - 1; rev <= ref.Rev()+1; rev++ {
			for _, req := range overlayRequests() {
				req.Revision = rev
				want, wantErr := ref.Range(req, revtree.RangeOptions{})
				for i, s := range stores[1:] {
					got, err := s.Range(req, revtree.RangeOptions{})
					if err != wantErr || !proto.Equal(got, want) {
						t.Fatalf("%s: every=%d: %v at %d:\n got %v, %v\nwant %v, %v", stage, intervals[i+1], req, rev, got, err, want, wantErr)
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
			for _, s := range stores {
				s.Compact(at)
			}
		}
	}
	if got, per := stores[len(stores)-1].HistoryBytes(), stores[0].HistoryBytes(); got >= per {
		t.Errorf("history of %d bytes, %d with a tree per revision", got, per)
	}

	// Views taken before the budget drops their revisions still answer
	// as they did.
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
			for _, req := range overlayRequests() {
				h.want = append(h.want, v.Range(req, revtree.RangeOptions{}))
			}
			views = append(views, h)
		}
	}
	for _, s := range stores {
		s.SetMaxHistoryBytes(1)
	}
	for range 3 * revtree.DefaultCheckpointInterval {
		rev, evs := w.next()
		applyToAll(t, stores, rev, evs)
	}
	compare("under a budget of 1 byte")
	for _, h := range views {
		for i, req := range overlayRequests() {
			if got := h.view.Range(req, revtree.RangeOptions{}); !proto.Equal(got, h.want[i]) {
				t.Fatalf("view at %d, %v after its revision was dropped: %v, want %v", h.view.Rev, req, got, h.want[i])
			}
		}
	}
}
