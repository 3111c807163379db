package watchproxy

import (
	"bytes"
	"sync"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// notifyScanRevs bounds the revisions one scan of the notifier reads at
// once.
const notifyScanRevs = 256

// notifier wakes the send loops that the store's new events concern, as
// etcd's watchableStore.notify hands an event only to the watchers of its
// key, rather than every send loop at every revision: with hundreds of
// streams (a kube-apiserver opens one per resource), waking them all for
// each write costs more than the writes' delivery.
//
// Like etcd's synced watchers, which move with the head whatever its
// writes' keys, a synced watcher moves past the revisions the scans found
// nothing of its in without reading the history (skipQuiet), whenever its
// send loop runs a pass. A quiet watcher's position may therefore lag
// behind the store for as long as nothing wakes its stream; the scans'
// record (interest) is what lets it move later, so the record is kept
// true across every pass (delivered), and the follower has the notifier
// scan before it compacts (Server.SyncWatchers): a compaction, which
// drops the history below it at once, drops nothing the record lacks, and
// never strands a quiet watcher behind it. A stream whose requested
// progress waits for its watchers to reach a revision is woken once the
// scans have (wakeWhenScanned).
//
// Why no event is missed: a stream registers a watcher's range before its
// next deliver reads the store's revision. Every revision up to scanned
// was in the store by then and is delivered from the history; every later
// one is scanned with the range registered, and what the scan finds for
// it is recorded (interest.revs) until the send loop has delivered it.
type notifier struct {
	store    Store
	follower Follower

	// scanning is held by the one scan at a time: the notifier's own, or
	// a Sync's.
	scanning sync.Mutex

	mu sync.Mutex
	// interests are each stream's watchers' ranges and what the scans
	// found for them, by watcher id; guarded by mu.
	interests map[*stream]map[int64]*interest
	// scanned is the revision up to which every event has woken the
	// streams it concerns; guarded by mu.
	scanned int64
	// scanWaiters are the streams to wake once scanned reaches a
	// revision (wakeWhenScanned); guarded by mu.
	scanWaiters map[*stream]int64

	bg background // the scanning goroutine
}

// interestRevs bounds the revisions an interest records. A watcher with
// more events than that between two passes of its send loop is busy: its
// loop reads them from the history, and nothing needs to skip them.
const interestRevs = 16

// interest is a watcher's range, and what the scans know of it: from
// known up to the notifier's scanned revision, the range's events are at
// revs, and, if overflow, also after the last of revs.
type interest struct {
	keyRange
	// known is the first revision whose events the scans have recorded
	// for the range: the notifier knows nothing of its events below.
	known int64
	// revs are the revisions from known on with an event in the range,
	// ascending, at most interestRevs of them.
	revs []int64
	// overflow says the range has events after the last of revs, which
	// revs had no room for.
	overflow bool
	// last is the latest revision from known on in which the scans found
	// an event of the range, recorded or not; 0 while none.
	last int64
}

// next is the first revision from rev on that may have an event in the
// range, as far as the scans up to scanned know: rev itself when unsure,
// scanned+1 when the scans found none. rev is at least known.
func (it *interest) next(rev, scanned int64) int64 {
	for _, r := range it.revs {
		if r >= rev {
			return r
		}
	}
	if it.overflow {
		return rev
	}
	return max(rev, scanned+1)
}

// forget starts the record afresh at rev.
func (it *interest) forget(rev int64) {
	it.known, it.revs, it.overflow, it.last = rev, it.revs[:0], false, 0
}

// record notes an event of the range at rev, a revision after every one
// recorded before. Once the record has overflowed it records nothing more:
// a revision after the ones it had no room for would hide those.
func (it *interest) record(rev int64) {
	if rev < it.known {
		return
	}
	it.last = max(it.last, rev)
	switch n := len(it.revs); {
	case it.overflow, n > 0 && it.revs[n-1] == rev:
	case n < interestRevs:
		it.revs = append(it.revs, rev)
	default:
		it.overflow = true
	}
}

// keyRange is a watched range: end nil for one key, empty for every key
// from key on.
type keyRange struct{ key, end []byte }

func (r keyRange) contains(key []byte) bool {
	switch {
	case r.end == nil:
		return bytes.Equal(key, r.key)
	case len(r.end) == 0:
		return bytes.Compare(key, r.key) >= 0
	default:
		return bytes.Compare(key, r.key) >= 0 && bytes.Compare(key, r.end) < 0
	}
}

func newNotifier(store Store, follower Follower) *notifier {
	return &notifier{
		store:       store,
		follower:    follower,
		interests:   map[*stream]map[int64]*interest{},
		scanWaiters: map[*stream]int64{},
		bg:          newBackground(),
	}
}

// start starts the scanning goroutine once, with the first stream; close
// stops it.
func (n *notifier) start() {
	n.bg.start(func() {
		n.mu.Lock()
		n.scanned = n.store.Rev()
		n.mu.Unlock()
	}, n.run)
}

// close stops the scanning goroutine and waits for it.
func (n *notifier) close() { n.bg.close() }

// watch registers (or replaces) the range of watcher id of st.
func (n *notifier) watch(st *stream, id int64, r keyRange) {
	n.mu.Lock()
	defer n.mu.Unlock()
	rs := n.interests[st]
	if rs == nil {
		rs = map[int64]*interest{}
		n.interests[st] = rs
	}
	rs[id] = &interest{keyRange: r, known: n.scanned + 1}
}

// skipQuiet moves each synced watcher of st past the revisions the scans
// found no event of its in, from its position on: to its next event, or
// past the scanned revision. etcd's synced watchers move with the head
// likewise. Only st's send loop calls it (it owns the watchers), before
// it reads the history.
func (n *notifier) skipQuiet(st *stream) {
	n.mu.Lock()
	defer n.mu.Unlock()
	rs := n.interests[st]
	for id, w := range st.watchers {
		it := rs[id]
		if it == nil || !w.synced || !w.active() || w.nextRev < it.known {
			continue
		}
		w.nextRev = it.next(w.nextRev, n.scanned)
	}
}

// delivered keeps the scans' record of st's watchers true after its send
// loop moved them: a record now starts at its watcher's position, keeping
// what the scans found from there on. The quiet revisions behind a
// watcher's next event stay skippable even when the scans ran past what
// its loop read (a loop is not stopped for them); forgotten, the watcher
// could move past them only by reading the history, which a compaction
// may drop first, canceling a synced watcher that etcd keeps. Only st's
// send loop calls it.
func (n *notifier) delivered(st *stream) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for id, it := range n.interests[st] {
		w := st.watchers[id]
		switch {
		case w == nil:
			it.forget(n.scanned + 1)
		case w.nextRev < it.known:
			// Behind the record (a pass cut short): the record stays,
			// and the next pass reads on from the history.
		case w.nextRev > n.scanned, w.nextRev > it.last:
			// No event the scans found is at or after its position:
			// the record starts afresh there, overflowed or not, and
			// a watcher that was busy moves with the head again.
			it.forget(w.nextRev)
		default:
			pos := w.nextRev
			unsent := it.revs[:0]
			for _, r := range it.revs {
				if r >= pos {
					unsent = append(unsent, r)
				}
			}
			it.known, it.revs = pos, unsent
			if it.overflow && len(unsent) == 0 {
				// The events past the record may start at pos.
				it.revs = append(it.revs, pos)
			}
		}
	}
}

// unwatch forgets watcher id of st.
func (n *notifier) unwatch(st *stream, id int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.interests[st], id)
}

// leave forgets st.
func (n *notifier) leave(st *stream) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.interests, st)
	delete(n.scanWaiters, st)
}

// wakeWhenScanned wakes st once the scans have reached rev, at once if
// they have. Only st's send loop calls it.
func (n *notifier) wakeWhenScanned(st *stream, rev int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.scanned >= rev {
		// Scanned since the pass's skipQuiet: another pass moves the
		// quiet watchers that far.
		st.wakeUp()
		return
	}
	n.scanWaiters[st] = rev
}

// wakeScanWaiters wakes the streams waiting for the scans to reach
// scanned. Called with mu held.
func (n *notifier) wakeScanWaiters() {
	for st, rev := range n.scanWaiters {
		if n.scanned >= rev {
			st.wakeUp()
			delete(n.scanWaiters, st)
		}
	}
}

func (n *notifier) run() {
	for {
		changed := n.follower.Changed()
		n.sync()
		select {
		case <-changed:
		case <-n.bg.stop:
			return
		}
	}
}

// sync scans up to the store's revision now.
func (n *notifier) sync() {
	n.scanning.Lock()
	defer n.scanning.Unlock()
	n.scan()
}

// scan wakes the streams concerned by the events after scanned, up to the
// store's revision. Whatever it cannot read (the store reloaded, or moved
// back, or no longer holds them) wakes every stream, as a revision did
// before.
func (n *notifier) scan() {
	for {
		n.mu.Lock()
		from := n.scanned + 1
		n.mu.Unlock()
		rev := n.store.Rev()
		if rev < from-1 {
			n.wakeAll(rev)
			return
		}
		if rev < from {
			return
		}
		batches, complete, err := n.store.EventsHeld(from, rev, notifyScanRevs)
		if err != nil {
			n.wakeAll(rev)
			return
		}
		n.wakeConcerned(batches, complete)
		if complete >= rev {
			return
		}
	}
}

// wakeConcerned wakes each stream with a watcher of a key of batches,
// records each watcher's first such revision, and moves scanned to
// complete.
func (n *notifier) wakeConcerned(batches []revtree.Batch, complete int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for st, rs := range n.interests {
		if concerns(rs, batches) {
			st.wakeUp()
		}
	}
	n.scanned = complete
	n.wakeScanWaiters()
}

// wakeAll wakes every stream and moves scanned to rev: the revisions up
// to rev were not read. What the scans found up to the old scanned stays
// on record (the store's history is etcd's: a reload that moved it back
// brings the same revisions again), so that a quiet watcher still moves
// past the revisions they found quiet, which a compaction may have
// dropped; what lies after is unknown (overflow).
func (n *notifier) wakeAll(rev int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for st, rs := range n.interests {
		for _, it := range rs {
			if len(it.revs) == 0 {
				it.revs = append(it.revs, max(it.known, n.scanned+1))
			}
			it.overflow, it.last = true, max(it.last, rev, n.scanned+1)
		}
		st.wakeUp()
	}
	n.scanned = rev
	clear(n.scanWaiters) // every stream is woken
}

// concerns reports whether any event of batches is in any of rs, and
// records in each the revisions of its events.
func concerns(rs map[int64]*interest, batches []revtree.Batch) bool {
	found := false
	for _, b := range batches {
		for _, ev := range b.Events {
			for _, it := range rs {
				if it.contains(ev.Kv.Key) {
					it.record(b.Rev)
					found = true
				}
			}
		}
	}
	return found
}
