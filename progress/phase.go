package progress

import (
	"sync"
	"sync/atomic"
)

// Phase is where the follower is in its life, as kube-apiserver's cacher
// draws its ready state (storage/cacher/ready.go):
//
//	Loading ──► Serving ◄──► Reloading
//	   │           │             │
//	   └───────────┴─────────────┴──► Stopped
//
// Only Serving answers for etcd. Loading is left once, the first time the
// store catches up; Stopped is never left. lifecycle refuses every other
// transition.
type Phase int32

const (
	// PhaseLoading: the first load has not yet caught up with etcd.
	PhaseLoading Phase = iota
	// PhaseServing: the store answers for etcd.
	PhaseServing
	// PhaseReloading: the store is being loaded again, after a watch that
	// could not resume, an inconsistency, or another history.
	PhaseReloading
	// PhaseStopped: Run has returned.
	PhaseStopped
)

func (p Phase) String() string {
	switch p {
	case PhaseLoading:
		return "loading"
	case PhaseServing:
		return "serving"
	case PhaseReloading:
		return "reloading"
	case PhaseStopped:
		return "stopped"
	}
	return "unknown"
}

// canMove reports whether the diagram has an edge from one phase to
// another; staying in a phase is no move.
func canMove(from, to Phase) bool {
	switch to {
	case PhaseServing:
		return from == PhaseLoading || from == PhaseReloading
	case PhaseReloading:
		return from == PhaseServing
	case PhaseStopped:
		return from != PhaseStopped
	}
	return false // nothing leads back to Loading
}

// lifecycle holds the follower's phase. The feed moves it (a reload
// begins, a load ends, the store catches up), and so may whoever finds
// another timeline (a reload begins); Run's end stops it.
type lifecycle struct {
	// phase is written only under mu, by move, and read without it:
	// Serving is asked on every request.
	phase atomic.Int32
	// ready is closed on the move from Loading to Serving, the store's
	// first catch-up, and never reopened: it says the cache has been
	// ready, which Stopped alone no longer tells.
	ready chan struct{}

	mu sync.Mutex
	// Guarded by mu.
	// caughtUpAt is the revision the store must reach for the first load
	// to count as caught up: set by a load that ends below it (one that
	// replays etcd's history), 0 once Loading is left or while no load
	// holds the store.
	caughtUpAt int64
}

func newLifecycle() *lifecycle {
	return &lifecycle{ready: make(chan struct{})}
}

// load returns the phase.
func (l *lifecycle) load() Phase { return Phase(l.phase.Load()) }

// move moves the phase to to if the diagram has that edge, and reports
// whether it did. mu must be held.
func (l *lifecycle) move(to Phase) bool {
	from := l.load()
	if !canMove(from, to) {
		return false
	}
	l.phase.Store(int32(to))
	if from == PhaseLoading {
		l.caughtUpAt = 0
		if to == PhaseServing {
			// After the phase: whoever Ready wakes finds it serving.
			close(l.ready)
		}
	}
	return true
}

// reloading records that the store is to be loaded again: a serving store
// stops serving. A load not yet caught up no longer counts: the next one
// decides when the store is ready.
func (l *lifecycle) reloading() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.load() == PhaseLoading {
		l.caughtUpAt = 0
		return
	}
	l.move(PhaseReloading)
}

// loaded records a load that reset the store to rev and must reach target
// to count as caught up, and reports whether the store became ready.
// A reload serves again at once.
func (l *lifecycle) loaded(rev, target int64) (ready bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch l.load() {
	case PhaseReloading:
		l.move(PhaseServing)
	case PhaseLoading:
		if rev >= target {
			return l.move(PhaseServing)
		}
		l.caughtUpAt = target
	}
	return false
}

// advanced records that the store reached rev, and reports whether that
// made it ready.
func (l *lifecycle) advanced(rev int64) (ready bool) {
	if l.load() != PhaseLoading {
		return false // only the first load waits to catch up
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.caughtUpAt == 0 || rev < l.caughtUpAt {
		return false
	}
	return l.move(PhaseServing)
}

// stop ends the lifecycle.
func (l *lifecycle) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.move(PhaseStopped)
}

// Phase returns the follower's phase.
func (f *Follower) Phase() Phase { return f.life.load() }
