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

// DefaultCheckpointInterval is how many revisions apart the store keeps a
// tree of the keyspace (a checkpoint); the revisions between two
// checkpoints are read from the older one overlaid with their events. It
// was chosen with BenchmarkRetainedRevisionBytesByInterval and
// BenchmarkRangePastByInterval: memory per retained revision falls by only
// about 100 bytes per doubling past 16 (the writes of a window land on
// distinct leaves and distinct lower inner nodes, so each still copies
// about a leaf and an inner node), while a read at a revision between
// checkpoints merges up to DefaultCheckpointInterval-1 revisions of events.
const DefaultCheckpointInterval = 64

// maxOverlayEvents bounds the events a read overlays on a checkpoint,
// whatever the interval: a revision with many events (a DeleteRange, a
// big Txn) closes its window early with a checkpoint.
const maxOverlayEvents = 256

// DefaultMaxHistoryBytes is the default history budget (--max-history-bytes):
// 256 MiB, about 215,000 revisions of single-key writes over 100,000 keys
// at degree 8 and the default checkpoint interval (1.25 KB each with
// 64-byte values, BenchmarkRetainedRevisionBytes). See docs/architecture.md
// for why a 2-core, 4 GiB node survives it.
const DefaultMaxHistoryBytes = 256 << 20

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

// Store is an MVCC key-value store with one snapshot per retained
// revision, a tree of the keyspace every few (see DefaultCheckpointInterval).
// The zero value is not usable; call New.
//
// Lock order: writeMu, then mu, then flat.mu.
type Store struct {
	degree int
	shape  shape // the memory estimate of the key trees

	// writeMu serialises writers.
	writeMu sync.Mutex
	// Guarded by writeMu.
	latest *btree.BTreeG[*mvccpb.KeyValue]
	// newest is the newest snapshot: the one the next revision's
	// snapshot links back to (nil before Reset, after Unload).
	newest *snapshot
	// window counts what was applied since the newest checkpoint.
	window struct{ revs, events int }
	// checkpointEvery is the checkpoint interval (SetCheckpointInterval).
	checkpointEvery int

	mu sync.RWMutex
	// Guarded by mu: the published state.
	snapshots  *btree.BTreeG[*snapshot] // ordered by rev
	rev        int64                    // store is complete up to rev
	compactRev int64
	loaded     bool
	// liveBytes estimates the KeyValues of the newest snapshot, liveKeys
	// counts them; historyBytes is the sum of the retained snapshots'
	// bytes: what history adds to the live keyspace (see memory.go).
	liveBytes, historyBytes int64
	liveKeys                int
	// maxHistoryBytes bounds historyBytes plus the flattened ranges'
	// bytes (0: no bound); trimmed counts the snapshots dropped to keep
	// within it.
	maxHistoryBytes int64
	trimmed         int64
	// gen counts the Resets and Unloads: a View's generation tells the
	// flattened-range cache whether its snapshot can still be the store's.
	gen uint64

	flat flatRanges // pages of recent paginated reads; its own lock
}

// snapshot is one retained revision: the events that produced it and how
// to read the keyspace as of rev. A checkpoint (prev == nil) holds its own
// tree; any other snapshot is read from the checkpoint its prev links
// lead to, overlaid with the events of the snapshots on the way
// (overlay.go). The newest snapshot also holds a tree of its own while it
// is the newest, so that reads at the head merge nothing.
type snapshot struct {
	rev    int64
	events []*mvccpb.Event // nil for the snapshot of a load
	bytes  int64           // estimated memory this revision added
	// prev is the snapshot of the revision applied before this one; nil
	// for a checkpoint. Immutable: a snapshot dropped from the store
	// stays reachable through it while later ones of its window are.
	prev *snapshot
	// kvs is the keyspace at rev. For a checkpoint: immutable, never nil.
	// For any other snapshot: guarded by Store.mu; set while the snapshot
	// is the newest, cleared when the next revision is applied, since its
	// tree would keep a copied path per revision alive.
	kvs *btree.BTreeG[*mvccpb.KeyValue]
}

// checkpoint returns the checkpoint s is read from: s itself or the
// nearest one before it.
func (s *snapshot) checkpoint() *snapshot {
	for s.prev != nil {
		s = s.prev
	}
	return s
}

func kvLess(a, b *mvccpb.KeyValue) bool { return bytes.Compare(a.Key, b.Key) < 0 }

func snapshotLess(a, b *snapshot) bool { return a.rev < b.rev }

// New returns an empty, unloaded store whose key trees have the given B-tree
// degree (DefaultDegree if degree < 2).
func New(degree int) *Store {
	if degree < 2 {
		degree = DefaultDegree
	}
	s := &Store{
		degree:          degree,
		shape:           newShape(degree),
		latest:          btree.NewG(degree, kvLess),
		checkpointEvery: DefaultCheckpointInterval,
		snapshots:       btree.NewG(32, snapshotLess),
	}
	s.flat.limit = maxFlatBytes
	s.flat.onGrow = s.enforceBudget
	s.flat.minKVs = defaultMinFlatKVs
	return s
}

// SetCheckpointInterval sets how many revisions apart the store keeps a
// tree of the keyspace (DefaultCheckpointInterval if every < 1); 1 keeps
// one per revision. It takes effect from the next revision applied: a
// larger interval costs less memory per retained revision, and more work
// per read of a revision between checkpoints.
func (s *Store) SetCheckpointInterval(every int) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if every < 1 {
		every = DefaultCheckpointInterval
	}
	s.checkpointEvery = every
}

// SetMaxHistoryBytes bounds the memory retained history may use on top of
// the live keyspace: the snapshots of past revisions, their events, and
// the flattened-range cache (which may take up to half of it). When the
// bound is passed, the oldest snapshots are dropped, as Compact drops
// them, but the compaction revision stays: reads below the new oldest
// snapshot get ErrNotRetained (etcd still answers them), and EventsFrom
// below the new history start too. The newest snapshot always stays.
// max <= 0 removes the bound.
func (s *Store) SetMaxHistoryBytes(max int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.maxHistoryBytes = 0
	limit := int64(maxFlatBytes)
	if max > 0 {
		s.maxHistoryBytes = max
		limit = min(limit, max/2)
	}
	s.flat.setLimit(limit)
	s.trimLocked()
}

// enforceBudget drops the oldest snapshots while history is over the
// budget.
func (s *Store) enforceBudget() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.trimLocked()
}

// trimLocked drops the oldest snapshots, never the newest, while history
// and the flattened ranges use more than maxHistoryBytes.
func (s *Store) trimLocked() {
	if s.maxHistoryBytes <= 0 {
		return
	}
	for s.snapshots.Len() > 1 && s.historyBytes+s.flat.size() > s.maxHistoryBytes {
		s.dropOldestLocked()
		s.trimmed++
	}
}

// dropOldestLocked drops the oldest snapshot, and the flattened ranges of
// it.
func (s *Store) dropOldestLocked() {
	oldest, _ := s.snapshots.DeleteMin()
	s.historyBytes -= oldest.bytes
	next, _ := s.snapshots.Min()
	s.flat.dropBelow(s.gen, next.rev)
}

// Reset replaces the whole store with kvs as the keyspace at rev, discarding
// every snapshot. The store keeps copies of kvs (entry.go). compactRev is etcd's compaction revision as known to the
// caller; it never moves the store's compaction revision backwards.
func (s *Store) Reset(rev int64, kvs []*mvccpb.KeyValue, compactRev int64) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	latest := btree.NewG(s.degree, kvLess)
	var live int64
	for _, kv := range kvs {
		kv = newEntry(kv)
		latest.ReplaceOrInsert(kv)
		live += storedBytes(kv)
	}
	s.latest = latest
	s.newest = &snapshot{rev: rev, kvs: latest.Clone()}
	s.window.revs, s.window.events = 0, 0
	snaps := btree.NewG(32, snapshotLess)
	snaps.ReplaceOrInsert(s.newest)

	s.mu.Lock()
	defer s.mu.Unlock()
	s.snapshots = snaps
	s.rev = rev
	s.compactRev = max(s.compactRev, compactRev)
	s.loaded = true
	s.liveBytes, s.historyBytes, s.liveKeys = live, 0, latest.Len()
	s.gen++
	s.flat.dropBelow(s.gen, rev)
}

// Unload discards the keyspace and every snapshot, and keeps the revision
// and the compaction revision: reads get ErrNotLoaded until the next
// Reset. A reload calls it before it reads the keyspace again, so that the
// old store, history included, is garbage before the new one is built,
// and a reload never needs the memory of two stores.
func (s *Store) Unload() {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.latest = btree.NewG(s.degree, kvLess)
	s.newest = nil
	s.window.revs, s.window.events = 0, 0
	s.mu.Lock()
	defer s.mu.Unlock()
	s.snapshots = btree.NewG(32, snapshotLess)
	s.loaded = false
	s.liveBytes, s.historyBytes, s.liveKeys = 0, 0, 0
	s.gen++
	s.flat.dropBelow(s.gen, 0)
}

// Apply applies the events of exactly one revision, rev, which must be
// greater than the store's revision. It fills in each event's PrevKv from the
// store, replaces each put's Kv with the store's copy of it (entry.go), and
// returns the events. On ErrInconsistent the store is unchanged.
func (s *Store) Apply(rev int64, events []*mvccpb.Event) ([]*mvccpb.Event, error) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if cur := s.Rev(); !s.Loaded() || rev <= cur {
		return nil, fmt.Errorf("%w: revision %d applied at store revision %d", ErrInconsistent, rev, cur)
	}
	if err := s.checkEvents(rev, events); err != nil {
		return nil, err
	}
	// What this revision adds to history (memory.go): its snapshot, the
	// nodes its writes copy that the window's earlier writes did not,
	// its events, and the KeyValues it displaces.
	n, w := s.latest.Len(), s.window.events
	live, added := int64(0), snapshotOverhead+s.shape.copied(n, w+len(events))-s.shape.copied(n, w)
	s.window.revs++
	s.window.events += len(events)
	checkpoint := s.window.revs >= s.checkpointEvery || s.window.events >= maxOverlayEvents
	if checkpoint {
		added += checkpointOverhead
		s.window.revs, s.window.events = 0, 0
	}
	for _, ev := range events {
		prev, _ := s.latest.Get(ev.Kv)
		ev.PrevKv = prev
		added += eventBytes
		if prev != nil {
			live -= storedBytes(prev)
			added += storedBytes(prev)
		}
		switch ev.Type {
		case mvccpb.PUT:
			ev.Kv = newEntry(ev.Kv)
			s.latest.ReplaceOrInsert(ev.Kv)
			live += storedBytes(ev.Kv)
		case mvccpb.DELETE:
			s.latest.Delete(ev.Kv)
			added += kvBytes(ev.Kv) // the tombstone
		}
	}
	// The head's tree: the newest snapshot's until the next revision,
	// and for good if this revision closes the window (a checkpoint).
	// Between checkpoints, the copies the next write makes of the nodes
	// this clone shares are garbage once it is cleared: only the nodes
	// the window's writes touch are copied for the checkpoint.
	snap := &snapshot{rev: rev, events: events, bytes: added, kvs: s.latest.Clone()}
	if !checkpoint {
		snap.prev = s.newest
	}
	replaced := s.newest
	s.newest = snap

	s.mu.Lock()
	defer s.mu.Unlock()
	if replaced.prev != nil {
		replaced.kvs = nil
	}
	s.snapshots.ReplaceOrInsert(snap)
	s.rev = rev
	s.liveBytes += live
	s.liveKeys = s.latest.Len()
	s.historyBytes += added
	s.trimLocked()
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
		s.dropOldestLocked()
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
// revision (its KeyValues and tree) plus HistoryBytes.
func (s *Store) ApproxBytes() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.liveBytes + s.shape.tree(s.liveKeys) + s.historyBytes + s.flat.size()
}

// HistoryBytes estimates the memory retained history uses on top of the
// live keyspace: what each retained revision adds (its snapshot, the tree
// nodes its writes copied, its events, the KeyValues it displaced) and the
// flattened-range cache. SetMaxHistoryBytes bounds it.
func (s *Store) HistoryBytes() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.historyBytes + s.flat.size()
}

// MaxHistoryBytes is the bound on HistoryBytes; 0 if none.
func (s *Store) MaxHistoryBytes() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.maxHistoryBytes
}

// HistoryTrimmed counts the snapshots dropped to keep history within
// MaxHistoryBytes.
func (s *Store) HistoryTrimmed() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.trimmed
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
	snap     *snapshot // the snapshot read: the floor of Rev
	gen      uint64    // the store's generation when the view was taken
	// kvs is the tree read: snap's own, or its checkpoint's, in which
	// case the events of the snapshots from snap back to (not
	// including) the checkpoint are overlaid on it.
	kvs     *btree.BTreeG[*mvccpb.KeyValue]
	overlay bool
	flat    *flatRanges
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
	v := View{Rev: rev, StoreRev: s.rev, snap: floor, gen: s.gen, kvs: floor.kvs, flat: &s.flat}
	if v.kvs == nil {
		// Outside the lock the walk would do too (prev and checkpoint
		// trees are immutable), but it is at most one window long.
		v.kvs, v.overlay = floor.checkpoint().kvs, true
	}
	return v, nil
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
