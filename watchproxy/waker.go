package watchproxy

import (
	"sync"
	"time"
)

// streamWaker is the one place that wakes send loops for what no event of
// the store announces: the periodic progress tick, a failed consistency
// check, a change of etcd's history. A send loop has no timer of its own,
// so that a stream with nothing to send costs nothing, however many there
// are; etcd likewise syncs every unsynced watcher from one loop
// (watchableStore.syncWatchersLoop). Events wake only the streams they
// concern (notifier).
//
// A tick wakes only the streams that have a progress_notify watcher, after
// marking their tick due (stream.progressDue); a failed check or a new
// epoch wakes every stream, each of which then looks for itself.
type streamWaker struct {
	follower    Follower
	consistency Consistency
	// interval returns the next periodic progress interval (jittered);
	// followEtcd makes etcd's own ticks the clock, the interval only the
	// fallback while etcd sends none.
	interval   func() time.Duration
	followEtcd bool

	mu      sync.Mutex
	streams map[*stream]struct{} // the running streams; guarded by mu

	bg background // the waking goroutine
}

func newStreamWaker(follower Follower, consistency Consistency, interval func() time.Duration, followEtcd bool) *streamWaker {
	return &streamWaker{
		follower:    follower,
		consistency: consistency,
		interval:    interval,
		followEtcd:  followEtcd,
		streams:     map[*stream]struct{}{},
		bg:          newBackground(),
	}
}

// start starts the waking goroutine once, with the first stream; close
// stops it. The epoch and the failures it wakes the streams on a change
// of are read before the first stream is, so that a change between the
// stream's start and the goroutine's is not taken for the starting state.
func (w *streamWaker) start() {
	var epoch, failures uint64
	w.bg.start(func() {
		epoch, _ = w.follower.Epoch()
		failures = w.consistency.Failures()
	}, func() { w.run(epoch, failures) })
}

// close stops the waking goroutine and waits for it.
func (w *streamWaker) close() { w.bg.close() }

// join adds st to the streams woken; leave removes it.
func (w *streamWaker) join(st *stream) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.streams[st] = struct{}{}
}

func (w *streamWaker) leave(st *stream) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.streams, st)
}

func (w *streamWaker) run(epoch, failures uint64) {
	timer := time.NewTimer(w.interval())
	defer timer.Stop()
	for {
		var etcdTick <-chan struct{}
		if w.followEtcd {
			etcdTick = w.follower.PeriodicProgress()
		}
		// The channels are taken before the values are read, so that a
		// change between two reads is never missed.
		failed := w.consistency.NextFailure()
		nowEpoch, epochMoved := w.follower.Epoch()
		if nowFailures := w.consistency.Failures(); nowEpoch != epoch || nowFailures != failures {
			epoch, failures = nowEpoch, nowFailures
			w.wakeAll()
		}
		select {
		case <-timer.C:
			timer.Reset(w.interval())
			w.tick()
		case <-etcdTick:
			// etcd's own tick; the timer stays the fallback.
			timer.Reset(w.interval())
			w.tick()
		case <-failed:
		case <-epochMoved:
		case <-w.bg.stop:
			return
		}
	}
}

// tick marks the periodic progress due on every stream with a
// progress_notify watcher, and wakes it.
func (w *streamWaker) tick() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for st := range w.streams {
		if st.progressWatchers.Load() > 0 {
			st.progressDue.Store(true)
			st.wakeUp()
		}
	}
}

// wakeAll wakes every stream.
func (w *streamWaker) wakeAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for st := range w.streams {
		st.wakeUp()
	}
}
