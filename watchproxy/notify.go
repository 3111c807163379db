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
// A send loop still wakes on its own at least every inconsistentPoll and
// then reads the history up to the store's revision, so that its watchers
// never fall far behind the history the store holds.
//
// Why no event is missed: a stream registers a watcher's range before its
// next deliver reads the store's revision. Every revision up to scanned
// was in the store by then and is delivered; every later one is scanned
// with the range registered.
type notifier struct {
	store    Store
	follower Follower

	mu sync.Mutex
	// interests are the key ranges of each stream's watchers, by watcher
	// id; guarded by mu.
	interests map[*stream]map[int64]keyRange
	// scanned is the revision up to which every event has woken the
	// streams it concerns; guarded by mu.
	scanned int64

	startOnce sync.Once
	stop      chan struct{} // closed by close
	done      chan struct{} // closed when run returns; nil until started
}

// keyRange is a watched range as watcher holds it: end nil for one key,
// empty for every key from key on.
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
		store:     store,
		follower:  follower,
		interests: map[*stream]map[int64]keyRange{},
		stop:      make(chan struct{}),
	}
}

// start starts the scanning goroutine once, with the first stream; close
// stops it.
func (n *notifier) start() {
	n.startOnce.Do(func() {
		n.mu.Lock()
		n.scanned = n.store.Rev()
		n.done = make(chan struct{})
		n.mu.Unlock()
		go n.run()
	})
}

// close stops the scanning goroutine and waits for it.
func (n *notifier) close() {
	n.startOnce.Do(func() {}) // never start after close
	close(n.stop)
	n.mu.Lock()
	done := n.done
	n.mu.Unlock()
	if done != nil {
		<-done
	}
}

// watch registers (or replaces) the range of watcher id of st.
func (n *notifier) watch(st *stream, id int64, r keyRange) {
	n.mu.Lock()
	defer n.mu.Unlock()
	rs := n.interests[st]
	if rs == nil {
		rs = map[int64]keyRange{}
		n.interests[st] = rs
	}
	rs[id] = r
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
}

func (n *notifier) run() {
	defer close(n.done)
	for {
		changed := n.follower.Changed()
		n.scan()
		select {
		case <-changed:
		case <-n.stop:
			return
		}
	}
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

// wakeConcerned wakes each stream with a watcher of a key of batches, and
// moves scanned to complete.
func (n *notifier) wakeConcerned(batches []revtree.Batch, complete int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for st, rs := range n.interests {
		if concerns(rs, batches) {
			st.wakeUp()
		}
	}
	n.scanned = complete
}

// wakeAll wakes every stream and moves scanned to rev.
func (n *notifier) wakeAll(rev int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for st := range n.interests {
		st.wakeUp()
	}
	n.scanned = rev
}

// concerns reports whether any event of batches is in any of rs.
func concerns(rs map[int64]keyRange, batches []revtree.Batch) bool {
	for _, b := range batches {
		for _, ev := range b.Events {
			for _, r := range rs {
				if r.contains(ev.Kv.Key) {
					return true
				}
			}
		}
	}
	return false
}
