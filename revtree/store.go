package revtree

import (
	"bytes"
	"errors"
	"fmt"
	"sync"

	"github.com/google/btree"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// DefaultDegree is the B-tree degree of the key trees. It was chosen with
// BenchmarkRetainedRevisionBytes: lower degrees copy smaller nodes per
// revision but make deeper trees and slower scans; see docs/architecture.md.
const DefaultDegree = 8

var (
	// ErrCompacted is returned for a revision below the compaction revision.
	ErrCompacted = errors.New("mvcc: required revision has been compacted")
	// ErrFutureRev is returned for a revision above the store's revision.
	ErrFutureRev = errors.New("mvcc: required revision is a future revision")
	// ErrNotRetained is returned for a revision that etcd still has but that
	// is older than the oldest snapshot the store retains.
	ErrNotRetained = errors.New("revtree: revision is older than the oldest retained snapshot")
	// ErrNotLoaded is returned by reads before the first Reset.
	ErrNotLoaded = errors.New("revtree: store is not loaded")
	// ErrInconsistent is returned by Apply when the events do not follow from
	// the store's state (a gap or duplicate in the upstream feed).
	ErrInconsistent = errors.New("revtree: events are inconsistent with the store")
)

// Store is an MVCC key-value store with one snapshot per retained revision.
// The zero value is not usable; call New.
type Store struct {
	degree int

	// writeMu serialises writers; latest is touched only under it.
	writeMu sync.Mutex
	latest  *btree.BTreeG[*mvccpb.KeyValue]

	// mu guards the published state below.
	mu         sync.RWMutex
	snapshots  *btree.BTreeG[*snapshot] // ordered by rev
	rev        int64                    // store is complete up to rev
	compactRev int64
	loaded     bool
	// liveBytes estimates the keyspace at the newest snapshot;
	// historyBytes what the retained snapshots add to it.
	liveBytes, historyBytes int64

	flat flatRanges // pages of recent paginated reads
}

// snapshot is the keyspace as of rev, and the events that produced it.
type snapshot struct {
	rev    int64
	kvs    *btree.BTreeG[*mvccpb.KeyValue]
	events []*mvccpb.Event // nil for the snapshot of a load
	bytes  int64           // estimated memory this revision added
}

// kvOverhead estimates a KeyValue's memory beyond its key and value bytes:
// the struct and its protobuf state.
const kvOverhead = 128

func kvBytes(kv *mvccpb.KeyValue) int64 {
	return int64(len(kv.Key)+len(kv.Value)) + kvOverhead
}

// pathBytes estimates the nodes a write copies in a tree of n items: one
// root-to-leaf path of nodes of items and child pointers.
func pathBytes(n, degree int) int64 {
	depth := 1
	for c := 2 * degree; c < n; c *= degree {
		depth++
	}
	node := int64((2*degree-1)*8 + 2*degree*8 + 64)
	return int64(depth) * node
}

func kvLess(a, b *mvccpb.KeyValue) bool { return bytes.Compare(a.Key, b.Key) < 0 }

func snapshotLess(a, b *snapshot) bool { return a.rev < b.rev }

// New returns an empty, unloaded store whose key trees have the given B-tree
// degree (DefaultDegree if degree < 2).
func New(degree int) *Store {
	if degree < 2 {
		degree = DefaultDegree
	}
	return &Store{
		degree:    degree,
		latest:    btree.NewG(degree, kvLess),
		snapshots: btree.NewG(32, snapshotLess),
	}
}

// Reset replaces the whole store with kvs as the keyspace at rev, discarding
// every snapshot. compactRev is etcd's compaction revision as known to the
// caller; it never moves the store's compaction revision backwards.
func (s *Store) Reset(rev int64, kvs []*mvccpb.KeyValue, compactRev int64) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	latest := btree.NewG(s.degree, kvLess)
	var live int64
	for _, kv := range kvs {
		latest.ReplaceOrInsert(kv)
		live += kvBytes(kv)
	}
	s.latest = latest
	snaps := btree.NewG(32, snapshotLess)
	snaps.ReplaceOrInsert(&snapshot{rev: rev, kvs: latest.Clone()})

	s.mu.Lock()
	defer s.mu.Unlock()
	s.snapshots = snaps
	s.rev = rev
	s.compactRev = max(s.compactRev, compactRev)
	s.loaded = true
	s.liveBytes, s.historyBytes = live, 0
}

// Apply applies the events of exactly one revision, rev, which must be
// greater than the store's revision. It fills in each event's PrevKv from the
// store and returns the events. On ErrInconsistent the store is unchanged.
func (s *Store) Apply(rev int64, events []*mvccpb.Event) ([]*mvccpb.Event, error) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if cur := s.Rev(); !s.Loaded() || rev <= cur {
		return nil, fmt.Errorf("%w: revision %d applied at store revision %d", ErrInconsistent, rev, cur)
	}
	if err := s.checkEvents(rev, events); err != nil {
		return nil, err
	}
	var live, added int64
	for _, ev := range events {
		prev, _ := s.latest.Get(ev.Kv)
		ev.PrevKv = prev
		if prev != nil {
			live -= kvBytes(prev)
		}
		switch ev.Type {
		case mvccpb.PUT:
			s.latest.ReplaceOrInsert(ev.Kv)
			live += kvBytes(ev.Kv)
			added += kvBytes(ev.Kv)
		case mvccpb.DELETE:
			s.latest.Delete(ev.Kv)
		}
		added += pathBytes(s.latest.Len(), s.degree) + 64 // the event
	}
	snap := &snapshot{rev: rev, kvs: s.latest.Clone(), events: events, bytes: added}

	s.mu.Lock()
	defer s.mu.Unlock()
	s.snapshots.ReplaceOrInsert(snap)
	s.rev = rev
	s.liveBytes += live
	s.historyBytes += added
	return events, nil
}

// checkEvents verifies, without changing anything, that events can follow
// the latest tree: revisions match, versions continue and deletes hit live
// keys. A Txn may touch a key more than once, so it tracks its own writes.
func (s *Store) checkEvents(rev int64, events []*mvccpb.Event) error {
	if len(events) == 0 {
		return fmt.Errorf("%w: revision %d has no events", ErrInconsistent, rev)
	}
	var touched map[string]*mvccpb.KeyValue // key -> state after this Txn's earlier ops; nil value = deleted
	for _, ev := range events {
		if ev.Kv == nil || ev.Kv.ModRevision != rev {
			return fmt.Errorf("%w: event of revision %d applied as %d", ErrInconsistent, modRev(ev), rev)
		}
		prev, seen := touched[string(ev.Kv.Key)]
		if !seen {
			prev, _ = s.latest.Get(ev.Kv)
		}
		switch ev.Type {
		case mvccpb.PUT:
			want := int64(1)
			if prev != nil {
				want = prev.Version + 1
			}
			if ev.Kv.Version != want {
				return fmt.Errorf("%w: put %q at %d has version %d, want %d", ErrInconsistent, ev.Kv.Key, rev, ev.Kv.Version, want)
			}
		case mvccpb.DELETE:
			if prev == nil {
				return fmt.Errorf("%w: delete of absent key %q at %d", ErrInconsistent, ev.Kv.Key, rev)
			}
		default:
			return fmt.Errorf("%w: unknown event type %d at %d", ErrInconsistent, ev.Type, rev)
		}
		if len(events) > 1 {
			if touched == nil {
				touched = make(map[string]*mvccpb.KeyValue, len(events))
			}
			if ev.Type == mvccpb.PUT {
				touched[string(ev.Kv.Key)] = ev.Kv
			} else {
				touched[string(ev.Kv.Key)] = nil
			}
		}
	}
	return nil
}

func modRev(ev *mvccpb.Event) int64 {
	if ev.Kv == nil {
		return 0
	}
	return ev.Kv.ModRevision
}

// Advance records that etcd has no change after the store's revision up to
// rev (a progress notification), making those revisions readable.
func (s *Store) Advance(rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.loaded && rev > s.rev {
		s.rev = rev
	}
}

// Compact records etcd's compaction at rev and drops the snapshots no read
// at rev or later can use. Compacting at or below the current compaction
// revision does nothing.
func (s *Store) Compact(rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rev <= s.compactRev {
		return
	}
	s.compactRev = rev
	floor := s.floorLocked(rev)
	if floor == nil {
		return
	}
	for {
		oldest, ok := s.snapshots.Min()
		if !ok || oldest.rev >= floor.rev {
			return
		}
		s.snapshots.DeleteMin()
		s.historyBytes -= oldest.bytes
	}
}

// floorLocked returns the snapshot with the greatest revision <= rev.
func (s *Store) floorLocked(rev int64) *snapshot {
	var found *snapshot
	s.snapshots.DescendLessOrEqual(&snapshot{rev: rev}, func(sn *snapshot) bool {
		found = sn
		return false
	})
	return found
}

// Loaded reports whether the store holds a keyspace (Reset has been called).
func (s *Store) Loaded() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.loaded
}

// Rev returns the revision the store is complete up to.
func (s *Store) Rev() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.rev
}

// CompactRev returns the compaction revision the store mirrors.
func (s *Store) CompactRev() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.compactRev
}

// OldestRev returns the revision of the oldest retained snapshot, or 0 if
// the store is not loaded. Revisions from max(OldestRev, CompactRev) to Rev
// are readable.
func (s *Store) OldestRev() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if oldest, ok := s.snapshots.Min(); ok {
		return oldest.rev
	}
	return 0
}

// ApproxBytes estimates the memory of the store: the keyspace at its newest
// revision plus what each retained revision adds (its new KeyValues, the
// tree nodes its write copied, its events).
func (s *Store) ApproxBytes() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.liveBytes + s.historyBytes
}

// Snapshots returns the number of retained snapshots.
func (s *Store) Snapshots() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.snapshots.Len()
}

// View is an immutable keyspace at one revision.
type View struct {
	// Rev is the revision the view was asked for (resolved from 0).
	Rev int64
	// StoreRev is the store's revision when the view was taken: what etcd
	// puts in a response header.
	StoreRev int64
	kvs      *btree.BTreeG[*mvccpb.KeyValue]
	flat     *flatRanges
}

// View returns the keyspace at rev (0 means the store's revision), with
// etcd's errors for a compacted or future revision, ErrNotRetained for a
// revision older than the retained snapshots, and ErrNotLoaded before Reset.
func (s *Store) View(rev int64) (View, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if !s.loaded {
		return View{}, ErrNotLoaded
	}
	// Same order of checks as etcd's rangeKeys: future first, then compacted.
	if rev > s.rev {
		return View{}, ErrFutureRev
	}
	if rev <= 0 {
		rev = s.rev
	}
	if rev < s.compactRev {
		return View{}, ErrCompacted
	}
	floor := s.floorLocked(rev)
	if floor == nil {
		return View{}, ErrNotRetained
	}
	return View{Rev: rev, StoreRev: s.rev, kvs: floor.kvs, flat: &s.flat}, nil
}

// Get returns the key-value of key in the view, if it exists.
func (v View) Get(key []byte) (*mvccpb.KeyValue, bool) {
	return v.kvs.Get(&mvccpb.KeyValue{Key: key})
}

// Ascend calls fn for every key-value in [key, end) in key order until fn
// returns false. An empty end means no upper bound.
func (v View) Ascend(key, end []byte, fn func(*mvccpb.KeyValue) bool) {
	pivot := &mvccpb.KeyValue{Key: key}
	if len(end) == 0 {
		v.kvs.AscendGreaterOrEqual(pivot, fn)
		return
	}
	if bytes.Compare(key, end) >= 0 {
		return
	}
	v.kvs.AscendRange(pivot, &mvccpb.KeyValue{Key: end}, fn)
}

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
	switch {
	case !s.loaded:
		return nil, 0, ErrNotLoaded
	case from < s.compactRev:
		return nil, 0, ErrCompacted
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
