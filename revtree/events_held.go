package revtree

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
