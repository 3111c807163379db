package progress

import "sync"

// notifier hands out a channel that is closed the next time something
// changes, after which waiters get a fresh one: a broadcast that any
// number of waiters can select on alongside their own contexts.
type notifier struct {
	mu sync.Mutex
	ch chan struct{} // guarded by mu; made by wait, closed and cleared by notify
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

// notify wakes every waiter. The next channel is made by the next wait:
// the feed notifies at every revision, most often with no one waiting.
func (n *notifier) notify() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ch != nil {
		close(n.ch)
		n.ch = nil
	}
}
