package progress

import "sync"

// notifier hands out a channel that is closed the next time something
// changes, and replaced by a fresh one: a broadcast that any number of
// waiters can select on alongside their own contexts.
type notifier struct {
	mu sync.Mutex
	ch chan struct{} // guarded by mu; closed and replaced by notify
}

// wait returns the channel the next notify closes.
func (n *notifier) wait() <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ch == nil {
		n.ch = make(chan struct{})
	}
	return n.ch
}

// notify wakes every waiter.
func (n *notifier) notify() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ch != nil {
		close(n.ch)
	}
	n.ch = make(chan struct{})
}
