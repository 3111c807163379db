//go:build snapcachetest

package revtree

import (
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// CorruptForTest replaces the key-value of kv.Key at the store's newest
// snapshot and in every later one with kv, without an event: it makes the
// store disagree with etcd. It exists only so that tests can prove the
// consistency checker detects and repairs such a divergence; nothing else
// may call it. It is built only with the snapcachetest build tag (make
// test sets it), so that no binary contains it.
func (s *Store) CorruptForTest(kv *mvccpb.KeyValue) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	newest, ok := s.snapshots.Max()
	if !ok {
		return
	}
	// A new history for the key, as the sweep makes one, whose version at
	// the newest revision is kv: views taken before keep the old one.
	kv = storedkv.New(kv) // the store's own copy, as every key-value it holds
	var vs []version
	if h, ok := s.index.Get(searchFor(kv.Key)); ok {
		vs = slices.Clone(h.published())
	}
	if n := len(vs); n > 0 && vs[n-1].Rev() == newest.rev {
		vs[n-1] = storedkv.Put(newest.rev, kv)
	} else {
		vs = append(vs, storedkv.Put(newest.rev, kv))
	}
	// The index's memory estimate follows the new history.
	nh := newKeyHistory(vs, len(vs))
	s.indexBytes += keyHistoryBytes(len(vs))
	if old, replaced := s.index.ReplaceOrInsert(nh); replaced {
		s.indexBytes -= keyHistoryBytes(old.capacity())
	} else {
		s.indexKeys++
	}
	s.indexChanged = true
	s.publishLocked()
	// The snapshot's flattened ranges no longer hold: drop every range.
	s.gen++
	oldest, _ := s.snapshots.Min()
	s.flat.dropBelow(s.gen, oldest.rev)
}
