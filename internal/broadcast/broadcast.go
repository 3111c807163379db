// Package broadcast is a wake-up that any number of goroutines wait for at
// once: each takes the channel of the next Notify and selects on it beside
// its own contexts and channels, so that a change reaches every waiter
// without anyone polling for it.
package broadcast

import "sync"

// Signal hands out a channel that the next Notify closes; waiters after
// it get a fresh one. The zero value is ready to use.
type Signal struct {
	mu sync.Mutex
	ch chan struct{} // guarded by mu; made by Wait, closed and cleared by Notify
}

// Wait returns the channel the next Notify closes.
func (s *Signal) Wait() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch == nil {
		s.ch = make(chan struct{})
	}
	return s.ch
}

// Notify wakes every waiter. The next channel is made by the next Wait:
// the follower notifies at every revision it applies, most often with no
// one waiting.
func (s *Signal) Notify() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch != nil {
		close(s.ch)
		s.ch = nil
	}
}
