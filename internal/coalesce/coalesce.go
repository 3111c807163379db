// Package coalesce shares one call among concurrent callers, each of whom
// needs an answer produced after it arrived: a proof of freshness that
// many readers can share, such as one AuthStatus for every linearizable
// read waiting for it.
//
// Unlike singleflight, a caller never joins a call already in flight (its
// answer may predate the caller); it joins the next one, which starts when
// the one in flight ends. At most one call runs and one waits.
package coalesce

import (
	"context"
	"errors"
	"sync"
)

// ErrStopped is returned once the owner stopped the Call.
var ErrStopped = errors.New("coalesce: stopped")

// Call runs fn for the callers of Do, on a goroutine it owns: Start gives
// it the context calls run under, Stop waits for it.
type Call[T any] struct {
	fn func(ctx context.Context) (T, error)

	wg sync.WaitGroup // the goroutine running calls, if any

	mu sync.Mutex
	// Guarded by mu.
	ctx      context.Context // calls run under it; nil until Start
	stopped  bool
	inFlight *result[T] // the call running; nil if none
	next     *result[T] // the call that starts when inFlight ends
}

// result is one run of fn; val and err are written before done is closed
// and read only after.
type result[T any] struct {
	done    chan struct{}
	waiters int // callers sharing it; under Call.mu
	val     T
	err     error
}

// New returns a Call of fn.
func New[T any](fn func(ctx context.Context) (T, error)) *Call[T] {
	return &Call[T]{fn: fn}
}

// Start lets calls run, under ctx.
func (c *Call[T]) Start(ctx context.Context) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ctx = ctx
}

// Stop refuses new calls and waits for the running one; the Start
// context must be done, or the call in flight must end by itself.
func (c *Call[T]) Stop() {
	c.mu.Lock()
	c.stopped = true
	c.mu.Unlock()
	c.wg.Wait()
}

// Do returns the answer of a run of fn that started after Do was called.
func (c *Call[T]) Do(ctx context.Context) (T, error) {
	var zero T
	c.mu.Lock()
	if c.stopped || c.ctx == nil {
		c.mu.Unlock()
		return zero, ErrStopped
	}
	var r *result[T]
	switch {
	case c.inFlight == nil:
		r = &result[T]{done: make(chan struct{})}
		c.inFlight = r
		c.wg.Add(1)
		go c.run(c.ctx, r)
	case c.next == nil:
		r = &result[T]{done: make(chan struct{})}
		c.next = r
	default:
		r = c.next
	}
	r.waiters++
	c.mu.Unlock()
	select {
	case <-r.done:
		return r.val, r.err
	case <-ctx.Done():
		return zero, ctx.Err()
	}
}

// run runs r, then the call that waited behind it, until none waits.
func (c *Call[T]) run(ctx context.Context, r *result[T]) {
	defer c.wg.Done()
	for r != nil {
		r.val, r.err = c.fn(ctx)
		c.mu.Lock()
		close(r.done)
		r = c.next
		c.inFlight, c.next = r, nil
		c.mu.Unlock()
	}
}
