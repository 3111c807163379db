package revtree

// ForgetCompaction clears the compaction revision before a Reset from
// another history (etcd restored from a snapshot, or another cluster),
// whose compaction revision may be lower: Reset otherwise keeps the
// highest it has seen.
func (s *Store) ForgetCompaction() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.compactRev = 0
}
