package revtree_test

import (
	"errors"
	"testing"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// TestEventsHeld: below the compaction revision, EventsHeld reads what the
// store still holds, where EventsFrom refuses; a compaction above the head
// keeps the newest snapshot's events and every later one applied.
func TestEventsHeld(t *testing.T) {
	s, _ := workedExample(t, 8) // loaded at 4, events at 5, 6, 7
	s.Compact(9)                // above the head: floor(9) = 7 stays
	if _, _, err := s.EventsFrom(7, 100, 0); !errors.Is(err, revtree.ErrCompacted) {
		t.Fatalf("EventsFrom(7) below the compaction: %v, want ErrCompacted", err)
	}
	batches, complete, err := s.EventsHeld(7, 100, 0)
	if err != nil || len(batches) != 1 || batches[0].Rev != 7 || complete != 7 {
		t.Fatalf("EventsHeld(7): %v, %d, %v; want [7] complete 7", batches, complete, err)
	}
	if _, _, err := s.EventsHeld(6, 100, 0); !errors.Is(err, revtree.ErrNotRetained) {
		t.Fatalf("EventsHeld(6), dropped by the compaction: %v, want ErrNotRetained", err)
	}
}
