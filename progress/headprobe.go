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
// The probes run on one goroutine at a time, owned by the probe: start
// gives it the context probes run under, and stop waits for it.
type headProbe struct {
	read func(ctx context.Context, rev int64) (int64, error)

	wg sync.WaitGroup // the goroutine running probes, if any

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
	return &headProbe{read: read}
}

// start lets probes run, under ctx.
func (p *headProbe) start(ctx context.Context) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ctx = ctx
}

// stop refuses new probes and waits for the running one to end; its
// context must be done, or the probe in flight must end by itself.
func (p *headProbe) stop() {
	p.mu.Lock()
	p.stopped = true
	p.mu.Unlock()
	p.wg.Wait()
}

// do returns etcd's head from a probe that started after the call, or the
// probe's verdict on rev.
func (p *headProbe) do(ctx context.Context, rev int64) (int64, error) {
	p.mu.Lock()
	if p.stopped || p.ctx == nil {
		p.mu.Unlock()
		return 0, errStopped
	}
	var c *probeCall
	switch {
	case p.inFlight == nil:
		c = &probeCall{done: make(chan struct{}), minRev: rev}
		p.inFlight = c
		p.wg.Add(1)
		go p.run(p.ctx, c)
	case p.next == nil:
		c = &probeCall{done: make(chan struct{}), minRev: rev}
		p.next = c
	default:
		c = p.next
		c.minRev = minPositive(c.minRev, rev)
	}
	c.waiters++
	p.mu.Unlock()

	select {
	case <-c.done:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	if c.err != nil && rev != c.minRev && (errors.Is(c.err, ErrCompacted) || errors.Is(c.err, ErrFutureRev)) {
		// The verdict was on another reader's revision: ask for ours.
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
	defer p.wg.Done()
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
