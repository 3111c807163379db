package progress

import "sync"

// leaderState tracks whether the upstream has a leader, as its answers show:
// the follower's watch requires one, so etcd ends it with "no leader" when it
// loses it, and a new watch is created only once there is one again.
type leaderState struct {
	mu sync.Mutex
	// Guarded by mu.
	isLost bool
	lostc  chan struct{} // closed when the leader is lost; replaced once found
}

// lost records that etcd reported having no leader.
func (l *leaderState) lost() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lostc == nil {
		l.lostc = make(chan struct{})
	}
	if !l.isLost {
		l.isLost = true
		close(l.lostc)
	}
}

// found records that a watch requiring a leader was created.
func (l *leaderState) found() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.isLost || l.lostc == nil {
		l.isLost = false
		l.lostc = make(chan struct{})
	}
}

// state returns whether the leader is lost, and a channel closed when it is
// next lost.
func (l *leaderState) state() (bool, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lostc == nil {
		l.lostc = make(chan struct{})
	}
	return l.isLost, l.lostc
}
