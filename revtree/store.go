package revtree

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/google/btree"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// DefaultDegree is the B-tree degree of the key index. Memory per retained
// revision does not depend on it; a 10,000-key scan takes about a quarter
// less time than at 8 (BenchmarkRangePast), and the live keyspace a few
// bytes less per key. A revision that creates or removes a key copies
// larger nodes, which are garbage at once; see docs/architecture.md.
const DefaultDegree = 32

// DefaultMaxHistoryBytes is the default history budget (--max-history-bytes):
// 256 MiB, about 650,000 revisions of single-key writes of 100-byte
// values (about 400 bytes each, BenchmarkRetainedRevisionBytes). See
// docs/architecture.md for why a 2-core, 4 GiB node survives it.
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

// Store is an MVCC key-value store that retains every revision from its
// oldest snapshot on: a key index with each key's versions (keyindex.go)
// and one snapshot per revision with its events. The zero value is not
// usable; call New.
//
// Lock order: writeMu, then mu, then flat.mu.
type Store struct {
	degree int
	shape  shape // the memory estimate of the key index's tree

	// writeMu serialises the writers: Apply, Reset, Unload, and the
	// sweeps of the index after Compact and the budget drop history.
	writeMu sync.Mutex
	// Guarded by writeMu.
	index *btree.BTreeG[*keyHistory] // the writer's; readers get clones
	// indexChanged: a key was inserted, removed or given a new history
	// since the index was last published.
	indexChanged bool
	// sweep is the running prune of the keys dropped history marked
	// (sweep.go).
	sweep sweep
	// slabs is the slabs of the packed encodings of the last load
	// (storedkv).
	slabs storedkv.SlabSet

	mu sync.RWMutex
	// Guarded by mu: the published state.
	snapshots  *btree.BTreeG[*snapshot] // ordered by rev
	published  *btree.BTreeG[*keyHistory]
	rev        int64 // store is complete up to rev
	compactRev int64
	loaded     bool
	// liveBytes estimates the KeyValues of the newest revision, liveKeys
	// counts them; indexKeys counts the index's keys (live, and deleted
	// ones history still reaches) and indexBytes their histories;
	// historyBytes is the sum of the retained snapshots' bytes (see
	// memory.go).
	liveBytes, historyBytes, indexBytes int64
	liveKeys, indexKeys                 int
	// maxHistoryBytes bounds HistoryBytes (0: no bound); trimmed counts
	// the snapshots dropped to keep within it.
	maxHistoryBytes int64
	trimmed         int64
	// gen counts the Resets and Unloads: a View's generation tells the
	// flattened-range cache whether its snapshot can still be the store's.
	gen uint64
	// pendingBytes is what dropped snapshots displaced and left in the
	// index: the KeyValues that the index's sweep frees (sweep.go), and
	// the marks of their keys.
	pendingBytes int64
	// dirty marks the keys of the snapshots dropped since the running
	// sweep, if any, took the marks: the keys whose versions it prunes.
	dirty map[string]struct{}
	// slabDead is slabs.Dead() when the writer last published.
	slabDead int64

	flat flatRanges // pages of recent paginated reads; its own lock

	// loadingBytes estimates the copies of the loads in progress
	// (load.go), counted in ApproxBytes.
	loadingBytes atomic.Int64
}

// snapshot is one retained revision: the events that produced it. The
// keyspace at rev is read from the key index (each key's newest version at
// or below rev).
type snapshot struct {
	rev    int64
	events []*mvccpb.Event // nil for the snapshot of a load
	bytes  int64           // estimated memory this revision added to history
	// displaced is the part of bytes that the KeyValues this revision
	// replaced or deleted take: their versions hold them until the
	// index's sweep after the snapshot is dropped.
	displaced int64
}

func snapshotLess(a, b *snapshot) bool { return a.rev < b.rev }

// New returns an empty, unloaded store whose key index has the given B-tree
// degree (DefaultDegree if degree < 2).
func New(degree int) *Store {
	if degree < 2 {
		degree = DefaultDegree
	}
	s := &Store{
		degree:    degree,
		shape:     newShape(degree),
		index:     btree.NewG(degree, keyHistoryLess),
		snapshots: btree.NewG(32, snapshotLess),
	}
	s.published = s.index.Clone()
	s.flat.limit = maxFlatBytes
	s.flat.onGrow = s.enforceBudget
	s.flat.minKVs = defaultMinFlatKVs
	return s
}

// SetMaxHistoryBytes bounds the memory retained history may use on top of
// the live keyspace: the past revisions' KeyValues, versions and events,
// and the flattened-range cache (which may take up to half of it). When
// the bound is passed, the oldest snapshots are dropped, as Compact drops
// them, but the compaction revision stays: reads below the new oldest
// snapshot get ErrNotRetained (etcd still answers them), and EventsFrom
// below the new history start too. The newest snapshot always stays.
// max <= 0 removes the bound. What the snapshots it drops displaced is
// freed before it returns.
func (s *Store) SetMaxHistoryBytes(max int64) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.mu.Lock()
	s.maxHistoryBytes = 0
	limit := int64(maxFlatBytes)
	if max > 0 {
		s.maxHistoryBytes = max
		limit = min(limit, max/2)
	}
	s.flat.setLimit(limit)
	s.trimLocked()
	s.mu.Unlock()
	s.sweepAll()
}

// enforceBudget drops the oldest snapshots while history is over the
// budget. Readers call it (the flattened ranges grew): the sweep that
// frees what the drops leave in the index is left to the writer.
func (s *Store) enforceBudget() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.trimLocked()
}

// historyBytesLocked is what retained history adds to the live keyspace:
// the retained snapshots, the index's versions and keys beyond one live
// version per live key, and the flattened ranges. What dropped snapshots
// left to the sweep (pendingBytes) is not retained history: the budget
// does not count it, ApproxBytes does.
func (s *Store) historyBytesLocked() int64 {
	return s.historyBytes +
		s.indexBytes - int64(s.liveKeys)*keyHistoryBytes(1) +
		s.shape.tree(s.indexKeys) - s.shape.tree(s.liveKeys) +
		s.flat.size()
}

// trimLocked drops the oldest snapshots, never the newest, while history
// uses more than maxHistoryBytes. mu is held.
func (s *Store) trimLocked() {
	for s.maxHistoryBytes > 0 && s.historyBytesLocked() > s.maxHistoryBytes && s.snapshots.Len() > 1 {
		s.dropOldestLocked()
		s.trimmed++
	}
}

// dropOldestLocked drops the oldest snapshot, and the flattened ranges of
// it. The KeyValues it displaced stay in the index until the sweep. mu is
// held.
func (s *Store) dropOldestLocked() {
	oldest, _ := s.snapshots.DeleteMin()
	s.historyBytes -= oldest.bytes
	s.pendingBytes += oldest.displaced
	s.markDirtyLocked(oldest.events)
	next, _ := s.snapshots.Min()
	s.flat.dropBelow(s.gen, next.rev)
}

// publishLocked makes the writer's index the one new views read, if it
// changed. writeMu and mu are held.
func (s *Store) publishLocked() {
	if s.indexChanged {
		s.published = s.index.Clone()
		s.indexChanged = false
	}
}

// Reset replaces the whole store with kvs as the keyspace at rev, discarding
// every snapshot. The store keeps copies of kvs (storedkv). compactRev is
// etcd's compaction revision as known to the caller; it never moves the
// store's compaction revision backwards.
func (s *Store) Reset(rev int64, kvs []*mvccpb.KeyValue, compactRev int64) {
	l := s.NewLoad()
	l.Add(kvs)
	s.ResetLoad(rev, l, compactRev)
}

// reset is Reset of vs, the versions of the keyspace, each a put's, whose
// packed encodings are in slabs.
func (s *Store) reset(rev int64, vs []version, slabs []*storedkv.Slab, compactRev int64) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	set := storedkv.NewSlabSet(slabs)
	index, live, indexBytes := s.newIndex(vs, &set)
	s.slabs = set
	s.index, s.indexChanged = index, true
	snaps := btree.NewG(32, snapshotLess)
	snaps.ReplaceOrInsert(&snapshot{rev: rev})

	s.mu.Lock()
	defer s.mu.Unlock()
	s.publishLocked()
	s.replaceLocked(snaps, rev, compactRev)
	s.slabDead = s.slabs.Dead()
	s.liveBytes, s.historyBytes, s.indexBytes = live, 0, indexBytes
	s.liveKeys, s.indexKeys = index.Len(), index.Len()
}

// newIndex returns a key index of one version of each key, vs (each a
// put's; of a key given twice, the last), with the bytes of what they hold
// and of its keys' histories; a packed version replaced leaves its slab.
func (s *Store) newIndex(vs []version, slabs *storedkv.SlabSet) (index *btree.BTreeG[*keyHistory], live, indexBytes int64) {
	index = btree.NewG(s.degree, keyHistoryLess)
	for _, v := range vs {
		h := newKeyHistory([]version{v}, 1)
		if old, replaced := index.ReplaceOrInsert(h); replaced {
			live -= old.latest().Bytes()
			indexBytes -= keyHistoryBytes(1)
			if old.latest().IsPacked() {
				slabs.Release(old.latest())
			}
		}
		live += v.Bytes()
		indexBytes += keyHistoryBytes(1)
	}
	return index, live, indexBytes
}

// replaceLocked makes snaps the store's snapshots, at revision rev, in a
// new generation. writeMu and mu are held.
func (s *Store) replaceLocked(snaps *btree.BTreeG[*snapshot], rev, compactRev int64) {
	s.snapshots = snaps
	s.rev = rev
	s.compactRev = max(s.compactRev, compactRev)
	s.loaded = true
	s.pendingBytes, s.sweep, s.dirty = 0, sweep{}, nil
	s.gen++
	s.flat.dropBelow(s.gen, rev)
}

// Restore replaces the whole store with kvs as the keyspace at base and
// the events of the revisions after it, up to rev, as Reset(base, kvs,
// compactRev), an Apply of each batch and Advance(rev) would: for a
// keyspace and history read back from disk, with the index published once
// rather than at every revision. kvs, and the Kv of every put event, must
// be DecodeKeyValue's: the store keeps the events' as they are, and packs
// copies of kvs' encodings, as a load does. The events need
// no PrevKv: it is filled in from the store, as Apply fills it. Each batch must follow the one
// before, from base on, and rev must be at least the last batch's; else
// Restore returns ErrInconsistent and the store is unchanged. History
// over the budget is dropped, oldest first, as Apply drops it.
func (s *Store) Restore(base int64, kvs []*mvccpb.KeyValue, batches []Batch, rev, compactRev int64) error {
	l := s.NewLoad()
	for _, kv := range kvs {
		if enc := storedkv.CanonicalEncoding(kv); enc != nil {
			if _, err := l.AddEncoded(enc); err == nil {
				continue
			}
		}
		v := storedkv.Stored(kv)
		l.vs = append(l.vs, v)
		l.count(v.Bytes()+loadSlotBytes, l.packer.Bytes())
	}
	return s.RestoreLoad(base, []*Load{l}, batches, rev, compactRev)
}

// RestoreLoad is Restore of the keyspace of loads, one after the other
// (AddEncoded's: a copy on disk read in parts at once), and ends them.
func (s *Store) RestoreLoad(base int64, loads []*Load, batches []Batch, rev, compactRev int64) error {
	var vs []version
	var slabs []*storedkv.Slab
	for _, l := range loads {
		vs = append(vs, l.vs...)
		slabs = append(slabs, l.packer.Slabs()...)
	}
	defer func() {
		for _, l := range loads {
			l.Discard()
		}
	}()
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	set := storedkv.NewSlabSet(slabs)
	index, live, indexBytes := s.newIndex(vs, &set)
	snaps := btree.NewG(32, snapshotLess)
	snaps.ReplaceOrInsert(&snapshot{rev: base})
	total := indexDelta{live: live, indexBytes: indexBytes, liveKeys: index.Len(), indexKeys: index.Len()}
	var historyBytes int64
	// The checks and the index work on the writer's index, which readers
	// never see until it is published: swap the new one in, and back on
	// failure.
	old, oldChanged := s.index, s.indexChanged
	s.index = index
	last := base
	for _, b := range batches {
		first, err := s.checkEvents(b.Rev, b.Events)
		if err == nil && b.Rev <= last {
			err = fmt.Errorf("%w: revision %d follows %d", ErrInconsistent, b.Rev, last)
		}
		if err != nil {
			s.index, s.indexChanged = old, oldChanged
			return err
		}
		snap, d := s.indexEvents(b.Rev, b.Events, first, true)
		snaps.ReplaceOrInsert(snap)
		historyBytes += snap.bytes
		total.live += d.live
		total.indexBytes += d.indexBytes
		total.liveKeys += d.liveKeys
		total.indexKeys += d.indexKeys
		last = b.Rev
	}
	if rev < last {
		s.index, s.indexChanged = old, oldChanged
		return fmt.Errorf("%w: restored at revision %d below its last event's %d", ErrInconsistent, rev, last)
	}
	s.indexChanged = true
	s.slabs = set

	s.mu.Lock()
	s.publishLocked()
	s.replaceLocked(snaps, rev, compactRev)
	s.slabDead = s.slabs.Dead()
	s.liveBytes, s.historyBytes, s.indexBytes = total.live, historyBytes, total.indexBytes
	s.liveKeys, s.indexKeys = total.liveKeys, total.indexKeys
	s.mu.Unlock()
	// Over the budget, the oldest snapshots go, as Apply drops them; but
	// one at a time, each drop's versions swept before the next is
	// weighed: the index holds every restored version until a sweep, and
	// would weigh more than the applied store's, which sweeps as it goes.
	for {
		s.mu.Lock()
		over := s.maxHistoryBytes > 0 && s.historyBytesLocked() > s.maxHistoryBytes && s.snapshots.Len() > 1
		if over {
			s.dropOldestLocked()
			s.trimmed++
		}
		s.mu.Unlock()
		s.sweepAll()
		if !over {
			return nil
		}
	}
}

// Unload discards the keyspace and every snapshot, and keeps the revision
// and the compaction revision: reads get ErrNotLoaded until the next
// Reset. A reload calls it before it reads the keyspace again, so that the
// old store, history included, is garbage before the new one is built,
// and a reload never needs the memory of two stores.
func (s *Store) Unload() {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.index, s.indexChanged = btree.NewG(s.degree, keyHistoryLess), true
	s.slabs = storedkv.SlabSet{}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.publishLocked()
	s.snapshots = btree.NewG(32, snapshotLess)
	s.loaded = false
	s.slabDead = 0
	s.liveBytes, s.historyBytes, s.indexBytes = 0, 0, 0
	s.liveKeys, s.indexKeys = 0, 0
	s.pendingBytes, s.sweep, s.dirty = 0, sweep{}, nil
	s.gen++
	s.flat.dropBelow(s.gen, 0)
}

// Apply applies the events of exactly one revision, rev, which must be
// greater than the store's revision. It fills in each event's PrevKv from the
// store, replaces each put's Kv with the store's copy of it (storedkv), and
// returns the events. On ErrInconsistent the store is unchanged.
func (s *Store) Apply(rev int64, events []*mvccpb.Event) ([]*mvccpb.Event, error) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if cur := s.Rev(); !s.Loaded() || rev <= cur {
		return nil, fmt.Errorf("%w: revision %d applied at store revision %d", ErrInconsistent, rev, cur)
	}
	first, err := s.checkEvents(rev, events)
	if err != nil {
		return nil, err
	}
	snap, d := s.indexEvents(rev, events, first, false)

	s.mu.Lock()
	s.publishLocked()
	s.snapshots.ReplaceOrInsert(snap)
	s.rev = rev
	s.addLocked(snap, d)
	s.trimLocked()
	s.startSweepLocked()
	overdue := s.sweepOverdueLocked()
	s.mu.Unlock()
	// Readers are not held up by the sweep: it changes only the
	// writer's index until it publishes.
	if overdue {
		s.sweepAll()
	} else {
		s.sweepStep()
	}
	return events, nil
}

// indexDelta is what applying revisions changed in the store's counts.
type indexDelta struct {
	live, indexBytes    int64
	liveKeys, indexKeys int
}

// addLocked counts a revision's snapshot and changes in. mu is held.
func (s *Store) addLocked(snap *snapshot, d indexDelta) {
	s.liveBytes += d.live
	s.liveKeys += d.liveKeys
	s.indexKeys += d.indexKeys
	s.indexBytes += d.indexBytes
	s.historyBytes += snap.bytes
}

// indexEvents adds the events of revision rev, checked by checkEvents, to
// the writer's index, and returns the revision's snapshot and what it
// changed. first is the history checkEvents found for the first event's
// key (nil if none): a revision is most often one event, and its key is
// not looked up twice. It fills in each event's PrevKv and, unless
// stored, replaces each put's Kv with the store's copy of it. writeMu is
// held.
func (s *Store) indexEvents(rev int64, events []*mvccpb.Event, first *keyHistory, stored bool) (*snapshot, indexDelta) {
	// What this revision adds to history (memory.go): its snapshot, its
	// events and the KeyValues it displaces; and to the index, its
	// versions and new keys.
	snap := &snapshot{rev: rev, events: events, bytes: snapshotOverhead}
	var d indexDelta
	var search *searchKey
	for i, ev := range events {
		h := first
		if i > 0 {
			// An earlier event of the revision may have inserted it.
			if search == nil {
				search = newSearchKey()
			}
			h, _ = s.index.Get(search.set(ev.Kv.Key))
		}
		var prev version
		if h != nil {
			prev = h.latest()
		}
		ev.PrevKv = nil
		snap.bytes += eventBytes
		if prev.IsPut() {
			if prev.IsBare() {
				// The event's own KeyValue of it.
				ev.PrevKv = prev.KVIn(&storedkv.Entry{})
				snap.bytes += storedkv.EntryBytes
			} else {
				ev.PrevKv = prev.EntryKV()
			}
			d.live -= prev.Bytes()
			snap.displaced += prev.Bytes()
			d.liveKeys--
		}
		v := storedkv.Delete(rev)
		switch ev.Type {
		case mvccpb.PUT:
			kv := ev.Kv
			if !stored {
				kv = storedkv.New(kv)
				ev.Kv = kv
			}
			v = storedkv.Put(rev, kv)
			d.live += storedkv.Bytes(kv)
			d.liveKeys++
		case mvccpb.DELETE:
			snap.bytes += kvBytes(ev.Kv) // the tombstone
		}
		if h == nil {
			s.index.ReplaceOrInsert(newKeyHistory([]version{v}, 1))
			s.indexChanged = true
			d.indexBytes += keyHistoryBytes(1)
			d.indexKeys++
			continue
		}
		d.indexBytes += h.add(v)
	}
	snap.bytes += snap.displaced
	return snap, d
}

// checkEvents verifies, without changing anything, that events can follow
// the latest tree: revisions match, versions continue and deletes hit live
// keys. A Txn may touch a key more than once, so it tracks its own writes.
// It returns the index's history of the first event's key, nil if none,
// for indexEvents.
func (s *Store) checkEvents(rev int64, events []*mvccpb.Event) (first *keyHistory, err error) {
	if len(events) == 0 {
		return nil, fmt.Errorf("%w: revision %d has no events", ErrInconsistent, rev)
	}
	// The state of each key after this Txn's earlier ops.
	type state struct {
		live    bool
		version int64
	}
	var touched map[string]state
	search := newSearchKey()
	for i, ev := range events {
		if ev.Kv == nil || ev.Kv.ModRevision != rev {
			return nil, fmt.Errorf("%w: event of revision %d applied as %d", ErrInconsistent, modRev(ev), rev)
		}
		prev, seen := touched[string(ev.Kv.Key)]
		if !seen {
			h, ok := s.index.Get(search.set(ev.Kv.Key))
			if i == 0 {
				first = h
			}
			if ok {
				if l := h.latest(); l.IsPut() {
					prev = state{live: true, version: l.KVVersion()}
				}
			}
		}
		switch ev.Type {
		case mvccpb.PUT:
			want := int64(1)
			if prev.live {
				want = prev.version + 1
			}
			if ev.Kv.Version != want {
				return nil, fmt.Errorf("%w: put %q at %d has version %d, want %d", ErrInconsistent, ev.Kv.Key, rev, ev.Kv.Version, want)
			}
		case mvccpb.DELETE:
			if !prev.live {
				return nil, fmt.Errorf("%w: delete of absent key %q at %d", ErrInconsistent, ev.Kv.Key, rev)
			}
		default:
			return nil, fmt.Errorf("%w: unknown event type %d at %d", ErrInconsistent, ev.Type, rev)
		}
		if len(events) > 1 {
			if touched == nil {
				touched = make(map[string]state, len(events))
			}
			touched[string(ev.Kv.Key)] = state{live: ev.Type == mvccpb.PUT, version: ev.Kv.Version}
		}
	}
	return first, nil
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
// at rev or later can use, and the versions only they could read.
// Compacting at or below the current compaction revision does nothing.
func (s *Store) Compact(rev int64) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if s.compactLocked(rev) {
		s.sweepAll()
	}
}

// ForgetCompaction clears the compaction revision before a Reset from
// another history (etcd restored from a snapshot, or another cluster),
// whose compaction revision may be lower: Reset otherwise keeps the
// highest it has seen.
func (s *Store) ForgetCompaction() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.compactRev = 0
}

// compactLocked is Compact's change of the published state; it reports
// whether it dropped snapshots. writeMu is held.
func (s *Store) compactLocked(rev int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rev <= s.compactRev {
		return false
	}
	s.compactRev = rev
	floor := s.floorLocked(rev)
	if floor == nil {
		return false
	}
	dropped := false
	for {
		oldest, ok := s.snapshots.Min()
		if !ok || oldest.rev >= floor.rev {
			return dropped
		}
		s.dropOldestLocked()
		dropped = true
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

// Generation counts the Resets, Restores and Unloads: two reads of the
// store in one generation read one history.
func (s *Store) Generation() uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.gen
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
// revision (its KeyValues, one version of each and the index's tree), plus
// HistoryBytes, plus what dropped snapshots left in the index until its
// sweep frees it (about a 64th of history, at most an eighth of the budget),
// plus the copies of a load in progress (Load).
func (s *Store) ApproxBytes() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.liveBytes + int64(s.liveKeys)*keyHistoryBytes(1) + s.shape.tree(s.liveKeys) + s.historyBytesLocked() + s.pendingBytes +
		s.slabDead + s.loadingBytes.Load()
}

// HistoryBytes estimates the memory retained history uses on top of the
// live keyspace: what each retained revision adds (its snapshot, its
// events, the KeyValues it displaced, its versions, the deleted keys the
// index keeps for it) and the flattened-range cache. SetMaxHistoryBytes
// bounds it.
func (s *Store) HistoryBytes() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.historyBytesLocked()
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

// View is an immutable keyspace at one revision. It stays readable however
// long it is held, even after its revision is dropped from the store.
type View struct {
	// Rev is the revision the view was asked for (resolved from 0).
	Rev int64
	// StoreRev is the store's revision when the view was taken: what etcd
	// puts in a response header.
	StoreRev int64
	snap     *snapshot // the snapshot read: the floor of Rev
	gen      uint64    // the store's generation when the view was taken
	// index is the key index published when the view was taken: every
	// key with a version at snap.rev is in it (keyindex.go).
	index *btree.BTreeG[*keyHistory]
	flat  *flatRanges
}

// ViewHeld is View without etcd's compaction check: the keyspace at any
// revision the store still holds, for a copy of the store's history.
func (s *Store) ViewHeld(rev int64) (View, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.viewLocked(rev, false)
}

// View returns the keyspace at rev (0 means the store's revision), with
// etcd's errors for a compacted or future revision, ErrNotRetained for a
// revision older than the retained snapshots, and ErrNotLoaded before Reset.
func (s *Store) View(rev int64) (View, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.viewLocked(rev, true)
}

// viewLocked is View, with etcd's compaction check if compacted; mu is
// held.
func (s *Store) viewLocked(rev int64, compacted bool) (View, error) {
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
	if compacted && rev < s.compactRev {
		return View{}, ErrCompacted
	}
	floor := s.floorLocked(rev)
	if floor == nil {
		return View{}, ErrNotRetained
	}
	return View{Rev: rev, StoreRev: s.rev, snap: floor, gen: s.gen, index: s.published, flat: &s.flat}, nil
}
