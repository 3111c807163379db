package progress

import "sync"

// leaderState tracks whether the upstream has a leader, as its answers show:
// the follower's watch requires one, so etcd ends it with "no leader" when it
// loses it, and a new watch is created only once there is one again.
type leaderState struct {
	mu     sync.Mutex
	isLost bool
	lostc  chan struct{} // closed when the leader is lost
}

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

func (l *leaderState) found() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.isLost || l.lostc == nil {
		l.isLost = false
		l.lostc = make(chan struct{})
	}
}

// LeaderLost returns whether etcd has reported that it has no leader (and no
// watch has been created since), and a channel closed when it next does.
// Streams that require a leader end on it, as etcd ends them.
func (f *Follower) LeaderLost() (bool, <-chan struct{}) {
	l := &f.leader
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lostc == nil {
		l.lostc = make(chan struct{})
	}
	return l.isLost, l.lostc
}
