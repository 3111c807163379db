package progress

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

var (
	// ErrCompacted: etcd refused the read revision as compacted.
	ErrCompacted = errors.New("progress: revision compacted in etcd")
	// ErrFutureRev: the read revision is above etcd's head.
	ErrFutureRev = errors.New("progress: revision is a future revision in etcd")
)

// Fence makes a linearizable read at rev (0: the head) safe to serve from
// the store. It learns etcd's head H with a quorum read started after the
// call, waits until the store has applied H, and returns the store revision
// the read may use (>= H). Because the quorum read is at rev, etcd's own
// answer decides whether rev is compacted (ErrCompacted) or in the future
// (ErrFutureRev), exactly as a read sent to etcd. Other errors (etcd
// unreachable, no leader, ctx done) mean freshness could not be proven.
func (f *Follower) Fence(ctx context.Context, rev int64) (int64, error) {
	start := time.Now()
	head, err := f.probes.do(ctx, rev)
	if err == nil {
		err = f.WaitRevision(ctx, head)
		if errors.Is(err, ErrAhead) {
			// etcd answered a progress request below the head it reported
			// earlier: impossible unless the member we watch lags the
			// one that answered; wait on for the events.
			err = f.waitApplied(ctx, head)
		}
	}
	if f.m != nil {
		f.m.fenceWait.Observe(time.Since(start).Seconds())
	}
	if err != nil {
		return 0, err
	}
	return f.store.Rev(), nil
}

// waitApplied waits for the store to reach rev through events alone.
func (f *Follower) waitApplied(ctx context.Context, rev int64) error {
	for {
		changed := f.Changed()
		if f.store.Rev() >= rev {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// headProbe runs the quorum reads that tell readers etcd's head, shared by
// concurrent readers.
//
// Invariant: a reader only shares a probe that started after the reader
// arrived. A probe already in flight may have been answered by etcd before
// a write the reader saw acknowledged, so a reader that arrives while one is
// in flight joins the next probe, which starts when the one in flight ends.
// At most one probe is in flight and one waits.
type headProbe struct {
	read func(ctx context.Context, rev int64) (int64, error)

	mu       sync.Mutex
	inFlight *probeCall
	next     *probeCall
}

// probeCall is one quorum read shared by the readers that joined it.
type probeCall struct {
	done chan struct{}
	// minRev is the least revision its readers want (0: only the head).
	minRev  int64
	waiters int // readers that joined
	head    int64
	err     error
}

// do returns etcd's head from a probe that started after the call, or the
// probe's verdict on rev.
func (p *headProbe) do(ctx context.Context, rev int64) (int64, error) {
	p.mu.Lock()
	var c *probeCall
	switch {
	case p.inFlight == nil:
		c = &probeCall{done: make(chan struct{}), minRev: rev}
		p.inFlight = c
		go p.run(c)
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

// run performs a probe, then starts the one that waited behind it. The
// probe has its own bounded context: its readers come and go.
func (p *headProbe) run(c *probeCall) {
	for c != nil {
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		c.head, c.err = p.read(ctx, c.minRev)
		cancel()
		p.mu.Lock()
		close(c.done)
		c = p.next
		p.inFlight, p.next = c, nil
		p.mu.Unlock()
	}
}

// probeTimeout bounds one quorum read; readers give up earlier with their
// own contexts.
const probeTimeout = 10 * time.Second

func minPositive(a, b int64) int64 {
	switch {
	case a <= 0:
		return b
	case b <= 0:
		return a
	}
	return min(a, b)
}

// readHead is the quorum read: a linearizable count-only Range of one key at
// rev, whose header carries etcd's head.
func (f *Follower) readHead(ctx context.Context, rev int64) (int64, error) {
	resp, err := f.kv.Range(ctx, &pb.RangeRequest{Key: probeKey, Revision: rev, CountOnly: true})
	switch {
	case err == nil:
		f.ObserveHeader(resp.Header)
		f.observeHead(resp.Header.Revision)
		return resp.Header.Revision, nil
	case errors.Is(rpctypes.Error(err), rpctypes.ErrCompacted):
		return 0, ErrCompacted
	case errors.Is(rpctypes.Error(err), rpctypes.ErrFutureRev):
		return 0, ErrFutureRev
	default:
		return 0, fmt.Errorf("reading etcd's revision: %w", err)
	}
}

// observeHead records a revision etcd reported as its head, for the lag
// metric.
func (f *Follower) observeHead(rev int64) {
	for {
		cur := f.head.Load()
		if rev <= cur || f.head.CompareAndSwap(cur, rev) {
			return
		}
	}
}
