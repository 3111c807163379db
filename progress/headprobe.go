package progress

import (
	"context"
	"errors"
	"sync"
	"time"
)

// errStopped is returned by a head probe once its owner stopped it.
var errStopped = errors.New("progress: the follower is stopped")

// probeTimeout bounds one quorum read; readers give up earlier with their
// own contexts.
const probeTimeout = 10 * time.Second

// headProbe runs the quorum reads that tell readers etcd's head, shared by
// concurrent readers.
//
// Invariant: a reader only shares a probe that started after the reader
// arrived. A probe already in flight may have been answered by etcd before
// a write the reader saw acknowledged, so a reader that arrives while one is
// in flight joins the next probe, which starts when the one in flight ends.
// At most one probe is in flight and one waits.
//
// The probes run on one goroutine, owned by the probe from start to stop:
// start gives it the context probes run under, and stop waits for it. It
// lives as long as the probe rather than per burst of probes, so that its
// stack, grown by the quorum read's call, is not grown again each time.
type headProbe struct {
	read func(ctx context.Context, rev int64) (int64, error)

	wg   sync.WaitGroup // the goroutine running probes, from start to stop
	kick chan struct{}  // buffered 1: a probe is in flight to run
	quit chan struct{}  // closed by stop

	mu sync.Mutex
	// Guarded by mu.
	ctx      context.Context // probes run under it; nil until start
	stopped  bool            // set by stop; no probe starts after it
	inFlight *probeCall      // the probe running; nil if none
	next     *probeCall      // the probe that starts when inFlight ends
}

// probeCall is one quorum read shared by the readers that joined it.
type probeCall struct {
	// done is closed once head and err are set; they are read only after.
	done chan struct{}
	// minRev is the least revision its readers want (0: only the head).
	// Written under headProbe.mu by readers that join while the call is
	// next; read by the runner when the call starts, no longer changing.
	minRev int64
	// waiters counts the readers that joined; under headProbe.mu.
	waiters int
	// head and err are the probe's answer, written by the runner before
	// done is closed.
	head int64
	err  error
}

func newHeadProbe(read func(ctx context.Context, rev int64) (int64, error)) *headProbe {
	return &headProbe{read: read, kick: make(chan struct{}, 1), quit: make(chan struct{})}
}

// start lets probes run, under ctx. It is called once.
func (p *headProbe) start(ctx context.Context) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ctx = ctx
	p.wg.Add(1)
	go p.loop(ctx)
}

// stop refuses new probes and waits for the running one to end; its
// context must be done, or the probe in flight must end by itself. It is
// called once.
func (p *headProbe) stop() {
	p.mu.Lock()
	p.stopped = true
	p.mu.Unlock()
	close(p.quit)
	p.wg.Wait()
}

// loop runs each probe put in flight, until stop; a probe put in flight
// before stop still runs, so that its readers get an answer.
func (p *headProbe) loop(ctx context.Context) {
	defer p.wg.Done()
	for stopped := false; !stopped; {
		select {
		case <-p.kick:
		case <-p.quit:
			stopped = true // no probe is put in flight after this
		}
		p.mu.Lock()
		c := p.inFlight
		p.mu.Unlock()
		if c != nil {
			p.run(ctx, c)
		}
	}
}

// do returns etcd's head from a probe that started after the call, or the
// probe's verdict on rev.
func (p *headProbe) do(ctx context.Context, rev int64) (int64, error) {
	c, err := p.join(rev)
	if err != nil {
		return 0, err
	}
	return p.wait(ctx, c, rev, nil, nil)
}

// join joins the reader to a probe that starts after the call, without
// waiting for it: the probe runs on the probe's goroutine while the reader
// does other work, and wait collects its answer.
func (p *headProbe) join(rev int64) (*probeCall, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped || p.ctx == nil {
		return nil, errStopped
	}
	var c *probeCall
	switch {
	case p.inFlight == nil:
		c = &probeCall{done: make(chan struct{}), minRev: rev}
		p.inFlight = c
		p.kick <- struct{}{} // never blocks: loop took the last kick before inFlight was cleared
	case p.next == nil:
		c = &probeCall{done: make(chan struct{}), minRev: rev}
		p.next = c
	default:
		c = p.next
		c.minRev = minPositive(c.minRev, rev)
	}
	c.waiters++
	return c, nil
}

// wait returns the answer of c, which the reader joined for rev: etcd's
// head, or the probe's verdict on rev. It gives up when ctx is done, or
// with context.DeadlineExceeded when expired fires (nil: never); readCtx,
// if set, makes the context of a quorum read of the reader's own, made
// when the verdict was on another reader's revision.
func (p *headProbe) wait(ctx context.Context, c *probeCall, rev int64, expired <-chan time.Time, readCtx func() (context.Context, context.CancelFunc)) (int64, error) {
	select {
	case <-c.done:
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-expired:
		return 0, context.DeadlineExceeded
	}
	if c.err != nil && rev != c.minRev && (errors.Is(c.err, ErrCompacted) || errors.Is(c.err, ErrFutureRev)) {
		// The verdict was on another reader's revision: ask for ours.
		if readCtx != nil {
			rctx, cancel := readCtx()
			defer cancel()
			ctx = rctx
		}
		return p.read(ctx, rev)
	}
	if c.err == nil && rev > c.head {
		return 0, ErrFutureRev // the probe read a lower revision than ours
	}
	return c.head, c.err
}

// run performs a probe, then the one that waited behind it, until none
// waits. Each probe has its own bounded context: its readers come and go.
func (p *headProbe) run(ctx context.Context, c *probeCall) {
	for c != nil {
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		c.head, c.err = p.read(pctx, c.minRev)
		cancel()
		p.mu.Lock()
		close(c.done)
		c = p.next
		p.inFlight, p.next = c, nil
		p.mu.Unlock()
	}
}

func minPositive(a, b int64) int64 {
	switch {
	case a <= 0:
		return b
	case b <= 0:
		return a
	}
	return min(a, b)
}
