package progress

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/coalesce"
	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
)

// errStopped is returned by a head probe once its owner stopped it.
var errStopped = errors.New("progress: the follower is stopped")

// probeTimeout bounds one quorum read; readers give up earlier with their
// own contexts.
const probeTimeout = 10 * time.Second

// headProbe runs the quorum reads that tell readers etcd's head, shared by
// concurrent readers under the rule of package coalesce: a reader shares
// only a probe that started after it arrived. A probe is made at the least
// revision its readers asked for, and each reader judges the verdict for
// its own (wait).
//
// The probes run on the goroutine of a coalesce.Call, which the follower's
// Run owns through start and stop.
type headProbe struct {
	read  func(ctx context.Context, rev int64) (int64, error)
	calls *coalesce.Call[int64]
}

func newHeadProbe(read func(ctx context.Context, rev int64) (int64, error)) *headProbe {
	return &headProbe{
		read: read,
		calls: coalesce.NewAtRev(func(ctx context.Context, rev int64) (int64, error) {
			// Each probe has its own bounded context: its readers come and go.
			pctx, cancel := context.WithTimeout(ctx, probeTimeout)
			defer cancel()
			return read(pctx, rev)
		}),
	}
}

// start lets probes run, under ctx. It is called once.
func (p *headProbe) start(ctx context.Context) { p.calls.Start(ctx) }

// stop refuses new probes and waits for the running one to end; its
// context must be done, or the probe in flight must end by itself. A probe
// put in flight before stop still runs, so that its readers get an answer.
func (p *headProbe) stop() { p.calls.Stop() }

// do returns etcd's head from a probe that started after the call, or the
// probe's verdict on rev.
func (p *headProbe) do(ctx context.Context, rev int64) (int64, error) {
	c, err := p.join(ctx, rev)
	if err != nil {
		return 0, err
	}
	return p.wait(ctx, c, rev, nil, nil)
}

// join joins the reader of ctx to a probe that starts after the call,
// without waiting for it: the probe runs on the probe's goroutine while
// the reader does other work, and wait collects its answer.
func (p *headProbe) join(ctx context.Context, rev int64) (*coalesce.Run[int64], error) {
	c, err := p.calls.Join(ctx, rev)
	if err != nil {
		return nil, errStopped // Join's one refusal: not started, or stopped
	}
	return c, nil
}

// wait returns the answer of c, which the reader joined for rev: etcd's
// head, or the probe's verdict on rev. It gives up when ctx is done, or
// with context.DeadlineExceeded when expired fires (nil: never); readCtx,
// if set, makes the context of a quorum read of the reader's own, made
// when the verdict was on another reader's revision.
func (p *headProbe) wait(ctx context.Context, c *coalesce.Run[int64], rev int64, expired <-chan time.Time, readCtx func() (context.Context, context.CancelFunc)) (int64, error) {
	select {
	case <-c.Done():
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-expired:
		return 0, context.DeadlineExceeded
	}
	c.Link(ctx)
	head, err := c.Answer()
	if err != nil && rev != c.Rev() && (errors.Is(err, ErrCompacted) || errors.Is(err, ErrFutureRev)) {
		// The verdict was on another reader's revision: ask for ours.
		if readCtx != nil {
			rctx, cancel := readCtx()
			defer cancel()
			ctx = rctx
		}
		return p.read(ctx, rev)
	}
	if err == nil && rev > head {
		return 0, ErrFutureRev // the probe read a lower revision than ours
	}
	return head, err
}

// headHedgeDelay is how long a quorum read waits for its member before a
// second one goes to another member, the first answer winning. A member
// can hang (a stopped process, a stalled disk) for seconds before drain's
// probe finds it unresponsive, and holds its reads for all of a
// defragmentation; on a healthy etcd a linearizable read takes a few
// milliseconds, tens under load (etcd warns of an apply over 100 ms). So a
// read still waiting after 250 ms most likely waits on its member, and the
// second read costs etcd one more quorum read at most per probe.
const headHedgeDelay = 250 * time.Millisecond

// hedgedRead returns read's answer at rev. If the read has not answered
// within delay, or failed (its member stopping, drain moving it off a
// member that stopped answering, a leader election seen by that member),
// a second read goes to another member (drain.Avoid), and the first answer
// of the two wins; the other is canceled and waited for. A verdict on rev
// (compacted, future) is an answer. A quorum read changes nothing, so a
// second one is safe; without it the probe's readers would all go to etcd.
// Both reads start after the call, so either one's head serves the readers
// of a probe.
func hedgedRead(ctx context.Context, rev int64, delay time.Duration, read func(ctx context.Context, rev int64) (int64, error)) (int64, error) {
	type answer struct {
		head int64
		err  error
	}
	ctx, cancel := context.WithCancel(ctx)
	var reads sync.WaitGroup
	defer reads.Wait()
	defer cancel()
	answers := make(chan answer, 2)
	start := func(rctx context.Context) {
		reads.Add(1)
		go func() {
			defer reads.Done()
			head, err := read(rctx, rev)
			answers <- answer{head, err}
		}()
	}
	first, cancelFirst := drain.Context(ctx)
	defer cancelFirst()
	start(first)
	running, hedged := 1, false
	hedge := func() {
		hedged = true
		running++
		start(drain.Avoid(ctx, drain.Member(first)))
	}
	timer := time.NewTimer(delay)
	defer timer.Stop()
	for {
		select {
		case a := <-answers:
			running--
			if a.err == nil || errors.Is(a.err, ErrCompacted) || errors.Is(a.err, ErrFutureRev) {
				return a.head, a.err
			}
			if !hedged && ctx.Err() == nil {
				hedge()
				continue
			}
			if running == 0 {
				return 0, a.err
			}
		case <-timer.C:
			if !hedged {
				hedge()
			}
		}
	}
}
