package revtree

import (
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Load is a keyspace read from etcd page by page, kept as the store's
// copies (entry.go: bare encodings): each page is copied as it arrives, so that what was
// decoded from etcd is garbage before the next page is read, and the load
// holds one copy of the keyspace, not two. The store counts a load's
// copies in ApproxBytes while it grows (a soft memory limit follows it).
// ResetLoad makes it the store's keyspace; Discard drops one that will not
// be. A Load is used by one goroutine.
type Load struct {
	s     *Store
	vs    []version // one put of each key
	bytes int64     // counted in s.loadingBytes
}

// loadSlotBytes is what a loaded key costs besides its copy until the
// index is built (ResetLoad): its version in the load's slice.
const loadSlotBytes = 16

// NewLoad starts a load of the keyspace into the store.
func (s *Store) NewLoad() *Load { return &Load{s: s} }

// Add copies kvs, a page of the keyspace in key order after the pages
// added before it, into the load; kvs are not kept.
func (l *Load) Add(kvs []*mvccpb.KeyValue) {
	var n int64
	for _, kv := range kvs {
		v := loadedVersion(kv)
		l.vs = append(l.vs, v)
		n += versionBytes(v) + loadSlotBytes
	}
	l.bytes += n
	l.s.loadingBytes.Add(n)
}

// Len is the number of keys added.
func (l *Load) Len() int { return len(l.vs) }

// Discard drops the load: its copies are no longer counted, and are
// garbage. A discarded (or reset) load cannot be used again.
func (l *Load) Discard() {
	l.s.loadingBytes.Add(-l.bytes)
	l.bytes, l.vs = 0, nil
}

// ResetLoad replaces the whole store with the load's keys as the keyspace
// at rev, as Reset(rev, kvs, compactRev) would with the pages added, and
// ends the load.
func (s *Store) ResetLoad(rev int64, l *Load, compactRev int64) {
	s.reset(rev, l.vs, compactRev)
	l.Discard()
}
