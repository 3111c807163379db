//go:build snapcachetest

package revtree

import "go.etcd.io/etcd/api/v3/mvccpb"

// CorruptForTest replaces the key-value of kv.Key at the store's newest
// snapshot and in every later one with kv, without an event: it makes the
// store disagree with etcd. It exists only so that tests can prove the
// consistency checker detects and repairs such a divergence; nothing else
// may call it. It is built only with the snapcachetest build tag (make
// test sets it), so that no binary contains it.
func (s *Store) CorruptForTest(kv *mvccpb.KeyValue) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.latest.ReplaceOrInsert(newEntry(kv)) // the store's own copy, as every key-value it holds
	s.mu.Lock()
	defer s.mu.Unlock()
	if newest, ok := s.snapshots.Max(); ok {
		// A checkpoint, so that the revisions after it are read from
		// the corrupted tree.
		s.newest = &snapshot{rev: newest.rev, kvs: s.latest.Clone(), events: newest.events, bytes: newest.bytes}
		s.window.revs, s.window.events = 0, 0
		s.snapshots.ReplaceOrInsert(s.newest)
		// The replaced snapshot's flattened ranges would never be hit
		// again: drop every range.
		s.gen++
		oldest, _ := s.snapshots.Min()
		s.flat.dropBelow(s.gen, oldest.rev)
	}
}
