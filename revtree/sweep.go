package revtree

import (
	"slices"
	"sort"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/allocsize"
	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// The sweep: freeing what dropped snapshots leave in the key index.
//
// Dropping a snapshot frees its events at once, but the KeyValues it
// displaced are still held by their keys' versions. Those keys are the
// keys of its events: dropping it marks them (Store.dirty), and the sweep
// prunes each marked key (pruned): every version before its newest at or
// below the oldest retained revision goes, that one too if it is a
// delete, and the key itself if nothing is left. A key left with one
// version, whose event history no longer holds, keeps its bare encoding
// rather than its entry (storedkv): from then on it costs the live
// keyspace what a loaded key does. A key whose versions
// change gets a new keyHistory with the rest of its versions, put in place
// in the writer's tree, so that views taken before keep reading the old
// one (keyindex.go). A sweep visits the keys that history dropped, not the
// whole index: its cost follows what was written, not the keyspace. (A
// version a snapshot's events displaced is unreadable once the snapshot
// before it goes, and freed once the snapshot itself goes: the budget
// counts it, in the snapshot's bytes, until then.)
//
// A sweep starts once dropped snapshots have left a 64th of retained
// history to it (sweepShare), so that a key written by every revision has
// its versions copied a bounded number of times over its life in history,
// not once per dropped revision, and what awaits the sweep, which the
// budget does not count, stays small beside it. It takes every marked key
// at once, and then prunes a stretch of them per Apply (sweepStretch),
// outside the store's lock, so that neither readers nor the watch feed
// wait for a whole sweep. Compact and SetMaxHistoryBytes sweep everything
// marked before they return (sweepAll), so that what they drop is freed
// when they return, and so does Apply once what awaits the sweep passes
// sweepCapShare start thresholds (large values rewritten faster than the
// stretches go): what awaits the sweep stays under an eighth of the budget
// whatever is written.

// sweep is the state of the running sweep; guarded by Store.writeMu.
type sweep struct {
	running bool
	marked  map[string]struct{} // the marks it took, until keys lists them
	keys    []string            // the keys it prunes, in key order
	next    int                 // keys[next:] are still to prune
	// freeing is the pendingBytes the sweep frees once it has pruned
	// every key: what was pending when it took the keys.
	freeing int64
}

// Sweep pacing: a sweep starts when pendingBytes reaches a sweepShare-th
// of retained history (plus sweepMinBytes, so that small stores do not
// sweep every few revisions; sweepThresholdLocked), and prunes at least
// sweepMinStretch keys per Apply, more in a large sweep, so that any sweep
// ends within sweepApplies revisions. Apply finishes a sweep at once when
// pendingBytes passes sweepCapShare thresholds.
const (
	sweepCapShare   = 4
	sweepShare      = 64
	sweepMinBytes   = 64 << 10
	sweepMinStretch = 256
	sweepApplies    = 1024
)

// markDirtyLocked marks the keys of a dropped snapshot's events for the
// sweep, counting each newly marked key in pendingBytes. The marks alias
// the events' keys, which never change: a put's is its stored entry's
// (storedkv), a delete's its tombstone's, which the mark then keeps alive
// and counts. mu is held.
func (s *Store) markDirtyLocked(events []*mvccpb.Event) {
	for _, ev := range events {
		key := ev.Kv.Key
		if len(key) == 0 {
			continue
		}
		k := storedkv.KeyString(key)
		if _, ok := s.dirty[k]; !ok {
			if s.dirty == nil {
				s.dirty = make(map[string]struct{})
			}
			s.dirty[k] = struct{}{}
			s.pendingBytes += dirtyKeyBytes
			if ev.Type == mvccpb.DELETE {
				s.pendingBytes += allocsize.Bytes(len(key))
			}
		}
	}
}

// sweepThresholdLocked is the pendingBytes at which a sweep starts: a
// sweepShare-th of retained history, plus sweepMinBytes or, under a budget
// small enough, a sweepShare-th of the budget. mu is held.
func (s *Store) sweepThresholdLocked() int64 {
	floor := int64(sweepMinBytes)
	if s.maxHistoryBytes > 0 {
		floor = min(floor, s.maxHistoryBytes/sweepShare)
	}
	return s.historyBytes/sweepShare + floor
}

// sweepOverdueLocked reports whether what awaits the sweep has passed
// sweepCapShare thresholds: at most an eighth of the budget, since history
// is within it. mu is held.
func (s *Store) sweepOverdueLocked() bool {
	return s.pendingBytes > sweepCapShare*s.sweepThresholdLocked()
}

// startSweepLocked starts a sweep if none runs and one is due: dropped
// snapshots left enough to it, or trimming reached the newest snapshot
// and only the sweep can bring history back within the budget. writeMu
// and mu are held.
func (s *Store) startSweepLocked() {
	if s.sweep.running || s.pendingBytes == 0 {
		return
	}
	if s.pendingBytes >= s.sweepThresholdLocked() || s.maxHistoryBytes > 0 && s.historyBytesLocked() > s.maxHistoryBytes {
		s.takeDirtyLocked()
	}
}

// takeDirtyLocked starts a sweep of every marked key. No sweep runs.
// writeMu and mu are held; the sweep lists the keys once mu is not.
func (s *Store) takeDirtyLocked() {
	s.sweep = sweep{running: true, marked: s.dirty, freeing: s.pendingBytes}
	s.dirty = nil
}

// sweepStep prunes the next stretch of the running sweep, if any. writeMu
// is held, mu is not.
func (s *Store) sweepStep() {
	if s.sweep.running {
		s.listMarked()
		s.sweepStretch(max(sweepMinStretch, len(s.sweep.keys)/sweepApplies))
	}
}

// listMarked lists the running sweep's marks in key order, so that each
// stretch walks one region of the tree, if it has not yet. writeMu is
// held, mu is not: sorting many keys does not hold up readers.
func (s *Store) listMarked() {
	if s.sweep.marked == nil {
		return
	}
	keys := make([]string, 0, len(s.sweep.marked))
	for k := range s.sweep.marked {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	s.sweep.keys, s.sweep.marked = keys, nil
}

// sweepAll finishes the running sweep, if any, and sweeps again while that
// leaves anything pending: everything dropped so far is freed when it
// returns. writeMu is held, mu is not.
func (s *Store) sweepAll() {
	for {
		if !s.sweep.running {
			s.mu.Lock()
			if s.pendingBytes == 0 {
				s.mu.Unlock()
				return
			}
			s.takeDirtyLocked()
			s.mu.Unlock()
		}
		s.listMarked()
		s.sweepStretch(len(s.sweep.keys))
	}
}

// sweepStretch prunes the next n keys of the running sweep and publishes
// the index if that changed it. writeMu is held, mu is not.
func (s *Store) sweepStretch(n int) {
	s.mu.RLock()
	oldest, ok := s.snapshots.Min() // enforceBudget drops snapshots under mu alone
	s.mu.RUnlock()
	if !ok {
		// Never while loaded (the newest snapshot always stays; Unload
		// clears what is pending): end the sweep so that sweepAll ends.
		s.mu.Lock()
		s.pendingBytes -= s.sweep.freeing
		s.sweep = sweep{}
		s.mu.Unlock()
		return
	}
	type change struct {
		old, new *keyHistory // new is nil when the key goes
		bared    bool        // its one version went from entry to bare
	}
	var changes []change
	end := min(s.sweep.next+n, len(s.sweep.keys))
	search := newSearchKey()
	for _, k := range s.sweep.keys[s.sweep.next:end] {
		h, ok := s.index.Get(search.set(storedkv.StringKey(k)))
		if !ok {
			continue // an earlier sweep removed it
		}
		if vs, bared, ok := pruned(h.published(), oldest.rev); ok {
			var nh *keyHistory
			if len(vs) > 0 {
				nh = newKeyHistory(vs, versionCap(len(vs)))
			}
			changes = append(changes, change{old: h, new: nh, bared: bared})
		}
	}
	done := end == len(s.sweep.keys)
	if len(changes) == 0 && !done {
		s.sweep.next = end // nothing to publish or count yet
		return
	}
	var bytes, live int64
	var keys int
	var evacuate map[*storedkv.Slab]bool
	for _, c := range changes {
		bytes -= keyHistoryBytes(c.old.capacity())
		// The versions pruned, before those kept: the packed ones
		// leave their slabs (storedkv).
		old, kept := c.old.published(), 0
		if c.new != nil {
			kept = len(c.new.published())
		}
		for _, v := range old[:len(old)-kept] {
			if !v.IsPacked() {
				continue
			}
			if sl := s.slabs.Release(v); sl != nil {
				if evacuate == nil {
					evacuate = map[*storedkv.Slab]bool{}
				}
				evacuate[sl] = true
			}
		}
		if c.new == nil {
			s.index.Delete(c.old)
			keys--
			continue
		}
		s.index.ReplaceOrInsert(c.new)
		bytes += keyHistoryBytes(c.new.capacity())
		if c.bared {
			live -= storedkv.EntryBytes
		}
	}
	for sl := range evacuate {
		live += s.evacuate(sl)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(changes) > 0 {
		s.indexChanged = true
		s.publishLocked()
	}
	s.indexBytes += bytes
	s.indexKeys += keys
	s.liveBytes += live
	s.slabDead = s.slabs.Dead()
	s.sweep.next = end
	if done {
		s.pendingBytes -= s.sweep.freeing
		s.sweep = sweep{}
	}
}

// pruned returns what is left of the versions vs once those that no
// revision from oldest on can read are gone, and whether that changes
// them: the versions from the newest at or below oldest on, without it if
// it is a delete (the key is absent until its next version either way).
// A key left with one version, an entry whose event is older than oldest
// (no retained event holds it), keeps its bare encoding instead: bared.
func pruned(vs []version, oldest int64) (keep []version, bared, changed bool) {
	i := sort.Search(len(vs), func(i int) bool { return vs[i].Rev() > oldest }) - 1
	if i < 0 {
		return vs, false, false
	}
	keep = vs[i:]
	if !keep[0].IsPut() {
		keep = keep[1:]
	}
	if len(keep) == 1 && keep[0].Rev() < oldest {
		if v, ok := keep[0].Bared(); ok {
			// A new slice: vs is published.
			return []version{v}, true, true
		}
	}
	return keep, false, len(keep) < len(vs)
}

// evacuate moves the encodings of sl that the writer's index holds into
// allocations of their own, giving their keys new histories as the sweep
// does, and forgets sl. It returns what that adds to the live keyspace's
// estimate (the size classes of the copies of live keys' newest
// versions). writeMu is held; the caller publishes the index.
func (s *Store) evacuate(sl *storedkv.Slab) (live int64) {
	search := newSearchKey()
	sl.Each(func(at version, key []byte) {
		h, ok := s.index.Get(search.set(key))
		if !ok {
			return
		}
		vs := h.published()
		var moved []version
		for i, v := range vs {
			if !v.Same(at) {
				continue
			}
			if moved == nil {
				moved = slices.Clone(vs)
			}
			moved[i] = v.Unpacked()
			if i == len(vs)-1 {
				live += moved[i].Bytes() - v.Bytes()
			}
		}
		if moved != nil {
			s.index.ReplaceOrInsert(newKeyHistory(moved, h.capacity()))
			s.indexChanged = true
		}
	})
	s.slabs.Forget(sl)
	return live
}
