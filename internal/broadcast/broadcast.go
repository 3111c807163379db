// Package broadcast is a wake-up that any number of goroutines wait for at
// once: each takes the channel of the next Notify and selects on it beside
// its own contexts and channels, so that a change reaches every waiter
// without anyone polling for it.
package broadcast

import "sync"

// Signal hands out a channel that the next Notify closes, and replaces it
// with a fresh one. The zero value is ready to use.
type Signal struct {
	mu sync.Mutex
	ch chan struct{} // guarded by mu; closed and replaced by Notify
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

// Notify wakes every waiter.
func (s *Signal) Notify() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch != nil {
		close(s.ch)
	}
	s.ch = make(chan struct{})
}
