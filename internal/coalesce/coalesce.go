// Package coalesce shares one call among concurrent callers, each of whom
// needs an answer produced after it arrived: a proof of freshness that
// many readers can share, such as one AuthStatus for every linearizable
// read waiting for it, or one quorum read of etcd's head for every read
// fence.
//
// The rule: a caller shares only a call that started after it arrived.
// Unlike singleflight, a caller never joins a call already in flight: etcd
// may have answered it before a write the caller saw acknowledged. It
// joins the next one, which starts when the one in flight ends, and which
// every caller arriving meanwhile shares. At most one call runs and one
// waits.
//
// This is the one statement of the rule. The protocols whose answer
// arrives on a stream rather than as a call's return keep it in their own
// shape and point here: RequestProgress on the follower's watch
// (progress/progress_requests.go), lease keepalives (server/lease.go), and
// RequestProgress on a client's watch stream (watchproxy/stream.go).
//
// A caller may ask for a revision (Join): the call then runs at the least
// revision its callers asked for, and each caller judges the answer for
// its own revision (Run.Rev).
//
// Traced (Trace), each run a sampled caller joined is a span of its own,
// in a trace of its own: it serves many callers, so it is no one caller's
// child. Each caller links to it once it has the answer (Run.Link), and
// the run's span links to the sampled callers that joined it before it
// started, which make it sampled (package tracing's sampler).
package coalesce

import (
	"context"
	"errors"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// maxLinks bounds the callers a run's span links to: enough to find a
// sampled caller's trace from the run, few enough that a burst of
// thousands of callers costs the span nothing more.
const maxLinks = 8

// The attributes of a run's span.
const (
	attrCallers = attribute.Key("snapcache.callers")  // callers that joined the run
	attrRev     = attribute.Key("snapcache.revision") // the least revision they asked for; 0 none
)

// ErrStopped is returned once the owner stopped the Call, or before it
// started it.
var ErrStopped = errors.New("coalesce: stopped")

// Call runs fn for the callers that join it, on one goroutine that the
// Call owns from Start to Stop. The goroutine lives as long as the Call
// rather than per burst of calls, so that its stack, grown by fn's RPC, is
// not grown again each time.
type Call[T any] struct {
	fn func(ctx context.Context, rev int64) (T, error)
	// tracer and spanName, set by Trace before Start, make each run a
	// span; nil: untraced.
	tracer   trace.Tracer
	spanName string

	wg   sync.WaitGroup // the goroutine running calls, from Start to Stop
	kick chan struct{}  // buffered 1: a run was put in flight
	quit chan struct{}  // closed by Stop

	mu sync.Mutex
	// Guarded by mu.
	ctx      context.Context // calls run under it; nil until Start
	stopped  bool            // set by Stop; no run is put in flight after it
	inFlight *Run[T]         // the run in flight; nil if none
	next     *Run[T]         // the run that starts when inFlight ends
}

// Run is one run of fn, shared by the callers that joined it.
type Run[T any] struct {
	done chan struct{} // closed once val and err are set
	// rev is the least revision its callers asked for (0: none asked).
	// Written under Call.mu by callers that join while the run is next;
	// read by the runner when the run starts, no longer changing.
	rev     int64
	waiters int // callers that joined; under Call.mu
	// links are the sampled callers that joined, at most maxLinks; under
	// Call.mu until the run starts, no longer changing then.
	links []trace.Link
	// span is the run's span, written by the runner before fn runs and
	// read after done is closed; invalid when untraced.
	span trace.SpanContext
	// val and err are fn's answer, written by the runner before done is
	// closed and read only after.
	val T
	err error
}

// New returns a Call of fn, for callers that ask for no revision.
func New[T any](fn func(ctx context.Context) (T, error)) *Call[T] {
	return NewAtRev(func(ctx context.Context, _ int64) (T, error) { return fn(ctx) })
}

// NewAtRev returns a Call of fn, which is given the least revision that
// the run's callers asked for (0: none asked).
func NewAtRev[T any](fn func(ctx context.Context, rev int64) (T, error)) *Call[T] {
	return &Call[T]{fn: fn, kick: make(chan struct{}, 1), quit: make(chan struct{})}
}

// Trace makes each run a span named name of tracer, which fn's context
// carries (its calls to etcd are the span's children). It is called
// before Start; a nil tracer leaves the Call untraced.
func (c *Call[T]) Trace(tracer trace.Tracer, name string) {
	c.tracer, c.spanName = tracer, name
}

// Start lets calls run, under ctx, on the Call's goroutine. It is called
// once.
func (c *Call[T]) Start(ctx context.Context) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ctx = ctx
	c.wg.Add(1)
	go c.loop(ctx)
}

// Stop refuses new callers and waits for the goroutine to end. A run put
// in flight before Stop still runs, so that its callers get an answer; the
// Start context must be done, or that run must end by itself.
func (c *Call[T]) Stop() {
	c.mu.Lock()
	first := !c.stopped
	c.stopped = true
	c.mu.Unlock()
	if first {
		close(c.quit)
	}
	c.wg.Wait()
}

// Do returns the answer of a run of fn that started after Do was called.
func (c *Call[T]) Do(ctx context.Context) (T, error) {
	r, err := c.Join(ctx, 0)
	if err != nil {
		var zero T
		return zero, err
	}
	return r.Wait(ctx)
}

// Join joins the caller to a run of fn that starts after the call, asking
// for rev (0: none), without waiting for it: the run goes on while the
// caller does other work, and Wait or Done collects its answer. ctx is the
// caller's only for its span, which a traced run links to if sampled.
func (c *Call[T]) Join(ctx context.Context, rev int64) (*Run[T], error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped || c.ctx == nil {
		return nil, ErrStopped
	}
	var r *Run[T]
	switch {
	case c.inFlight == nil:
		r = &Run[T]{done: make(chan struct{}), rev: rev}
		c.inFlight = r
		c.kick <- struct{}{} // never blocks: loop took the last kick before inFlight was cleared
	case c.next == nil:
		r = &Run[T]{done: make(chan struct{}), rev: rev}
		c.next = r
	default:
		r = c.next
		r.rev = minPositive(r.rev, rev)
	}
	r.waiters++
	if c.tracer != nil && len(r.links) < maxLinks {
		if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
			r.links = append(r.links, trace.Link{SpanContext: sc})
		}
	}
	return r, nil
}

// Waiting is the number of callers that joined the run waiting behind the
// one in flight.
func (c *Call[T]) Waiting() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.next == nil {
		return 0
	}
	return c.next.waiters
}

// loop runs each run put in flight, until Stop; a run put in flight before
// Stop still runs.
func (c *Call[T]) loop(ctx context.Context) {
	defer c.wg.Done()
	for stopped := false; !stopped; {
		select {
		case <-c.kick:
		case <-c.quit:
			stopped = true // no run is put in flight after this
		}
		c.mu.Lock()
		r := c.inFlight
		c.mu.Unlock()
		if r != nil {
			c.runFrom(ctx, r)
		}
	}
}

// runFrom runs r, then the run that waited behind it, until none waits.
func (c *Call[T]) runFrom(ctx context.Context, r *Run[T]) {
	for r != nil {
		r.val, r.err = c.run(ctx, r)
		c.mu.Lock()
		close(r.done)
		r = c.next
		c.inFlight, c.next = r, nil
		c.mu.Unlock()
	}
}

// run runs fn for r, in r's span when traced and a sampled caller joined
// it: the sampler drops the span of a run no sampled caller joined, so it
// is not started (a span costs allocations even unsampled). r's callers
// have all joined: their fields no longer change.
func (c *Call[T]) run(ctx context.Context, r *Run[T]) (T, error) {
	if c.tracer == nil || len(r.links) == 0 {
		return c.fn(ctx, r.rev)
	}
	ctx, span := c.tracer.Start(ctx, c.spanName, trace.WithNewRoot(), trace.WithLinks(r.links...))
	defer span.End()
	r.span = span.SpanContext()
	val, err := c.fn(ctx, r.rev)
	if span.IsRecording() {
		span.SetAttributes(attrCallers.Int(r.waiters), attrRev.Int64(r.rev))
		if err != nil {
			span.SetStatus(otelcodes.Error, err.Error())
		}
	}
	return val, err
}

// Link links the span of ctx, if it records, to the run's span: the
// caller's trace then shows the run that answered it. It is called after
// Done is closed.
func (r *Run[T]) Link(ctx context.Context) {
	if !r.span.IsValid() {
		return
	}
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.AddLink(trace.Link{SpanContext: r.span})
	}
}

// Done is closed once the run's answer is in.
func (r *Run[T]) Done() <-chan struct{} { return r.done }

// Answer is the run's answer; it is read after Done is closed.
func (r *Run[T]) Answer() (T, error) { return r.val, r.err }

// Rev is the revision the run was made at: the least its callers asked for
// (0: none asked). It is read after Done is closed.
func (r *Run[T]) Rev() int64 { return r.rev }

// Wait returns the run's answer, or ctx's error if ctx is done first.
func (r *Run[T]) Wait(ctx context.Context) (T, error) {
	select {
	case <-r.done:
		r.Link(ctx)
		return r.val, r.err
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}

// minPositive is the lesser of two revisions, 0 standing for none.
func minPositive(a, b int64) int64 {
	switch {
	case a <= 0:
		return b
	case b <= 0:
		return a
	}
	return min(a, b)
}
