package revtree

import "go.etcd.io/etcd/api/v3/mvccpb"

// The event history, as the Watch service reads it: which revisions'
// events the store holds (HistoryStart), and the events of a run of them
// (EventsFrom, with etcd's compaction check; EventsHeld, without).

// HistoryStart returns the first revision whose events the store holds:
// every event from it up to Rev is retained. 0 if the store is not loaded.
func (s *Store) HistoryStart() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.historyStartLocked()
}

// historyStartLocked: the oldest snapshot holds the events of its revision,
// unless it is a load, whose events were never seen.
func (s *Store) historyStartLocked() int64 {
	oldest, ok := s.snapshots.Min()
	if !ok {
		return 0
	}
	if oldest.events == nil {
		return oldest.rev + 1
	}
	return oldest.rev
}

// Batch is the events of one revision.
type Batch struct {
	Rev    int64
	Events []*mvccpb.Event // with PrevKv; shared, never to be modified
}

// EventsFrom returns the events of revisions from..upTo (inclusive), at most
// max revisions of them if max > 0, in revision order, and the revision the
// result is complete up to (upTo, or the last revision returned when max
// cut it short). It fails with ErrCompacted if from is below the compaction
// revision, and with ErrNotRetained if events from `from` on are no longer
// all held (a reload or trimming dropped them); the check and the read are
// atomic.
func (s *Store) EventsFrom(from, upTo int64, max int) ([]Batch, int64, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.loaded && from < s.compactRev {
		return nil, 0, ErrCompacted
	}
	return s.eventsLocked(from, upTo, max)
}

// eventsLocked is EventsFrom and EventsHeld without the compaction check;
// s.mu is held.
func (s *Store) eventsLocked(from, upTo int64, max int) ([]Batch, int64, error) {
	switch {
	case !s.loaded:
		return nil, 0, ErrNotLoaded
	case from < s.historyStartLocked():
		return nil, 0, ErrNotRetained
	}
	upTo = min(upTo, s.rev)
	var out []Batch
	complete := upTo
	s.snapshots.AscendRange(&snapshot{rev: from}, &snapshot{rev: upTo + 1}, func(sn *snapshot) bool {
		if sn.events == nil {
			return true
		}
		if max > 0 && len(out) == max {
			complete = out[len(out)-1].Rev
			return false
		}
		out = append(out, Batch{Rev: sn.rev, Events: sn.events})
		return true
	})
	return out, complete, nil
}

// EventsHeld is EventsFrom without etcd's compaction check: it returns the
// events the store still holds, even below the compaction revision, and
// fails only with ErrNotLoaded, or ErrNotRetained if events from `from` on
// are no longer all held. The Watch service reads synced watchers' events
// with it: etcd never cancels a synced watcher for a compaction, and a
// compaction mirrored above the store's head leaves the revisions up to it
// still to be applied.
func (s *Store) EventsHeld(from, upTo int64, max int) ([]Batch, int64, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.eventsLocked(from, upTo, max)
}
