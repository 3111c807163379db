package revtree

import (
	"sort"
)

// The sweep: freeing what dropped snapshots leave in the key index.
//
// Dropping a snapshot frees its events at once, but the KeyValues it
// displaced are still held by their keys' versions. The sweep walks the
// index in key order and prunes each key (pruned): every version before
// its newest at or below the oldest retained revision goes, that one too
// if it is a delete, and the key itself if nothing is left. A key whose
// versions change gets a new keyHistory with the rest of its versions, put
// in place in the writer's tree, so that views taken before keep reading
// the old one (keyindex.go).
//
// A sweep starts once dropped snapshots have left a 64th of retained
// history to it (sweepShare), so that a key written by every revision has
// its versions copied a bounded number of times over its life in history,
// not once per dropped revision, and what awaits the sweep, which the
// budget does not count, stays small beside it. It then advances a stretch of keys per Apply
// (sweepStretch), outside the store's lock, so that neither readers nor
// the watch feed wait for a whole sweep: with 100,000 keys and 256 MiB of
// history, freeing a sixteenth at once held Apply for up to 173 ms.
// Compact and SetMaxHistoryBytes sweep the whole index before they return
// (sweepAll), so that what they drop is freed when they return.
//
// At that pace a sweep of a large index takes up to sweepApplies
// revisions, and a key it has passed keeps what later drops displace
// until the next sweep comes by: with large values rewritten at every
// revision, that could grow past the budget (100,000 keys, a 64 KiB value
// per revision: 55 MiB awaited the sweep under a 4 MiB budget). So once
// pendingBytes passes sweepCapShare sweep thresholds, Apply finishes the
// sweep at once (sweepAll), holding up the watch feed, not readers: what
// awaits the sweep stays under an eighth of the budget whatever is
// written.

// sweep is the state of the index's sweep; guarded by Store.writeMu.
type sweep struct {
	running bool
	next    []byte // the first key of the next stretch; nil: from the start
	// freeing is the pendingBytes the sweep frees once it has walked
	// the whole index: what was pending when it began.
	freeing int64
}

// Sweep pacing: a sweep starts when pendingBytes reaches a sweepShare-th
// of retained history (plus sweepMinBytes, so that small stores do not
// sweep every few revisions; sweepThresholdLocked), and walks at least
// sweepMinStretch keys per Apply, more in a large index, so that any sweep
// ends within sweepApplies revisions.
const (
	sweepCapShare   = 4
	sweepShare      = 64
	sweepMinBytes   = 64 << 10
	sweepMinStretch = 256
	sweepApplies    = 1024
)

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
		s.sweep = sweep{running: true, freeing: s.pendingBytes}
	}
}

// sweepStep walks the next stretch of the running sweep, if any. writeMu
// is held, mu is not.
func (s *Store) sweepStep() {
	if s.sweep.running {
		s.sweepStretch(max(sweepMinStretch, s.index.Len()/sweepApplies))
	}
}

// sweepAll finishes the running sweep, if any, and sweeps the whole index
// again if that leaves anything pending: everything dropped so far is
// freed when it returns. writeMu is held, mu is not.
func (s *Store) sweepAll() {
	for {
		if !s.sweep.running {
			s.mu.RLock()
			pending := s.pendingBytes
			s.mu.RUnlock()
			if pending == 0 {
				return
			}
			s.sweep = sweep{running: true, freeing: pending}
		}
		s.sweepStretch(s.index.Len() + 1)
	}
}

// sweepStretch prunes the next n keys of the running sweep and publishes
// the index if that changed it. writeMu is held, mu is not.
func (s *Store) sweepStretch(n int) {
	s.mu.RLock()
	oldest, ok := s.snapshots.Min() // enforceBudget drops snapshots under mu alone
	s.mu.RUnlock()
	if !ok {
		s.sweep = sweep{}
		return
	}
	type change struct {
		old, new *keyHistory // new is nil when the key goes
	}
	var changes []change
	var next []byte
	s.index.AscendGreaterOrEqual(&keyHistory{key: s.sweep.next}, func(h *keyHistory) bool {
		if n == 0 {
			next = h.key
			return false
		}
		n--
		if vs, ok := pruned(h.published(), oldest.rev); ok {
			var nh *keyHistory
			if len(vs) > 0 {
				nh = newKeyHistory(vs, versionCap(len(vs)))
			}
			changes = append(changes, change{old: h, new: nh})
		}
		return true
	})
	if len(changes) == 0 && next != nil {
		s.sweep.next = next // nothing to publish or count yet
		return
	}
	var bytes int64
	var keys int
	for _, c := range changes {
		bytes -= keyHistoryBytes(len(c.old.list.Load().v))
		if c.new == nil {
			s.index.Delete(c.old)
			keys--
			continue
		}
		s.index.ReplaceOrInsert(c.new)
		bytes += keyHistoryBytes(len(c.new.list.Load().v))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(changes) > 0 {
		s.indexChanged = true
		s.publishLocked()
	}
	s.indexBytes += bytes
	s.indexKeys += keys
	s.sweep.next = next
	if next == nil {
		s.pendingBytes -= s.sweep.freeing
		s.sweep = sweep{}
	}
}

// pruned returns what is left of the versions vs once those that no
// revision from oldest on can read are gone, and whether that is fewer:
// the versions from the newest at or below oldest on, without it if it is
// a delete (the key is absent until its next version either way).
func pruned(vs []version, oldest int64) ([]version, bool) {
	i := sort.Search(len(vs), func(i int) bool { return vs[i].rev > oldest }) - 1
	if i < 0 {
		return vs, false
	}
	keep := vs[i:]
	if keep[0].kv == nil {
		keep = keep[1:]
	}
	return keep, len(keep) < len(vs)
}
