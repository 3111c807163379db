package revtree_test

import (
	"errors"
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// TestHistoryBudget: under SetMaxHistoryBytes the store drops its oldest
// snapshots as it applies revisions, keeps history within the budget,
// never changes the compaction revision, and answers every revision it
// still holds exactly as a store without a budget; below its oldest
// snapshot, reads and EventsFrom get ErrNotRetained (etcd still has them),
// below the compaction revision ErrCompacted.
func TestHistoryBudget(t *testing.T) {
	const keys, revs, budget = 50, 2000, 60_000
	bounded, full := revtree.New(4), revtree.New(4)
	bounded.SetMaxHistoryBytes(budget)
	var load []*mvccpb.KeyValue
	for i := range keys {
		load = append(load, mkKV(fmt.Sprintf("k%03d", i), int64(i+1), int64(i+1), 1))
	}
	bounded.Reset(keys, load, 0)
	full.Reset(keys, load, 0)
	versions := make([]int64, keys)
	for i := range versions {
		versions[i] = 1
	}
	oldest := bounded.OldestRev()
	for rev := int64(keys + 1); rev <= keys+revs; rev++ {
		i := int(rev*7) % keys
		versions[i]++
		ev := putEv(mkKV(fmt.Sprintf("k%03d", i), int64(i+1), rev, versions[i]))
		for _, s := range []*revtree.Store{bounded, full} {
			if _, err := s.Apply(rev, []*mvccpb.Event{proto.Clone(ev).(*mvccpb.Event)}); err != nil {
				t.Fatalf("Apply(%d): %v", rev, err)
			}
		}
		if got := bounded.HistoryBytes(); got > budget {
			t.Fatalf("at %d: history %d bytes over the budget %d", rev, got, budget)
		}
		if o := bounded.OldestRev(); o < oldest {
			t.Fatalf("at %d: oldest snapshot went back from %d to %d", rev, oldest, o)
		}
		oldest = bounded.OldestRev()
	}
	head := int64(keys + revs)
	if oldest <= keys+revs/2 || oldest >= head {
		t.Fatalf("oldest snapshot %d after %d revisions of about 1 KB under a %d-byte budget", oldest, revs, budget)
	}
	if bounded.CompactRev() != 0 || bounded.HistoryTrimmed() != oldest-keys {
		t.Fatalf("compaction revision %d, %d snapshots trimmed; want 0, %d", bounded.CompactRev(), bounded.HistoryTrimmed(), oldest-keys)
	}
	t.Logf("budget %d: %d of %d revisions retained, %d bytes of history (%d per revision)",
		budget, head-oldest+1, revs, bounded.HistoryBytes(), bounded.HistoryBytes()/(head-oldest+1))

	for _, rev := range []int64{1, keys, oldest - 1} {
		if _, err := bounded.View(rev); !errors.Is(err, revtree.ErrNotRetained) {
			t.Errorf("View(%d) below the oldest snapshot %d: %v, want ErrNotRetained", rev, oldest, err)
		}
	}
	for rev := oldest; rev <= head; rev++ {
		got, err1 := keysAt(bounded, rev)
		want, err2 := keysAt(full, rev)
		if err1 != nil || err2 != nil || got != want {
			t.Fatalf("read at %d: %q, %v; without a budget %q, %v", rev, got, err1, want, err2)
		}
	}
	if start := bounded.HistoryStart(); start != oldest {
		t.Errorf("HistoryStart %d, want the oldest snapshot %d", start, oldest)
	}
	if _, _, err := bounded.EventsFrom(oldest-1, head, 0); !errors.Is(err, revtree.ErrNotRetained) {
		t.Errorf("EventsFrom(%d): %v, want ErrNotRetained", oldest-1, err)
	}
	batches, complete, err := bounded.EventsFrom(oldest, head, 0)
	if err != nil || complete != head || int64(len(batches)) != head-oldest+1 {
		t.Errorf("EventsFrom(%d): %d revisions, complete %d, %v", oldest, len(batches), complete, err)
	}

	// A compaction below the floor moves only the compaction revision; one
	// above it drops snapshots as ever.
	bounded.Compact(oldest - 10)
	checkErr := func(rev int64, want error) {
		t.Helper()
		if _, err := bounded.View(rev); !errors.Is(err, want) {
			t.Errorf("View(%d): %v, want %v", rev, err, want)
		}
	}
	checkErr(oldest-11, revtree.ErrCompacted)
	checkErr(oldest-10, revtree.ErrNotRetained)
	bounded.Compact(oldest + 5)
	checkErr(oldest+4, revtree.ErrCompacted)
	if bounded.OldestRev() != oldest+5 {
		t.Errorf("oldest snapshot %d after Compact(%d)", bounded.OldestRev(), oldest+5)
	}

	// The smallest budget keeps the newest snapshot.
	bounded.SetMaxHistoryBytes(1)
	if bounded.Snapshots() != 1 || bounded.OldestRev() != head || bounded.HistoryStart() != head {
		t.Errorf("budget of 1 byte: %d snapshots from %d, history from %d; want 1 from %d", bounded.Snapshots(), bounded.OldestRev(), bounded.HistoryStart(), head)
	}
	if got, err := keysAt(bounded, 0); err != nil || got == "" {
		t.Errorf("read at the head: %q, %v", got, err)
	}
	// No budget: history grows again.
	bounded.SetMaxHistoryBytes(0)
	versions[0]++
	if _, err := bounded.Apply(head+1, []*mvccpb.Event{putEv(mkKV("k000", 1, head+1, versions[0]))}); err != nil {
		t.Fatal(err)
	}
	if bounded.Snapshots() != 2 || bounded.MaxHistoryBytes() != 0 {
		t.Errorf("without a budget: %d snapshots, budget %d", bounded.Snapshots(), bounded.MaxHistoryBytes())
	}
}

// TestUnload: Unload drops the keyspace and history but keeps the
// revisions; the store answers ErrNotLoaded until the next Reset.
func TestUnload(t *testing.T) {
	s, _ := workedExample(t, 4)
	s.Compact(5)
	s.Unload()
	if s.Loaded() || s.Rev() != 7 || s.CompactRev() != 5 || s.Snapshots() != 0 || s.HistoryBytes() != 0 || s.ApproxBytes() != 0 {
		t.Fatalf("after Unload: Loaded %v Rev %d CompactRev %d Snapshots %d HistoryBytes %d ApproxBytes %d",
			s.Loaded(), s.Rev(), s.CompactRev(), s.Snapshots(), s.HistoryBytes(), s.ApproxBytes())
	}
	if _, err := s.View(7); !errors.Is(err, revtree.ErrNotLoaded) {
		t.Errorf("View after Unload: %v", err)
	}
	if _, _, err := s.EventsFrom(6, 7, 0); !errors.Is(err, revtree.ErrNotLoaded) {
		t.Errorf("EventsFrom after Unload: %v", err)
	}
	if _, err := s.Apply(8, []*mvccpb.Event{putEv(mkKV("e", 8, 8, 1))}); !errors.Is(err, revtree.ErrInconsistent) {
		t.Errorf("Apply after Unload: %v", err)
	}
	s.Reset(9, []*mvccpb.KeyValue{mkKV("x", 9, 9, 1)}, 0)
	checkState(t, s, "after Reset", 9, 5, 9, 1)
	checkReads(t, s, "after Reset", []read{{rev: 9, want: "x@9 |9"}, {rev: 8, err: revtree.ErrNotRetained}})
}
