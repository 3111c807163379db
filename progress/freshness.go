package progress

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/coalesce"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

var (
	// ErrCompacted: etcd refused the read revision as compacted. It is
	// the store's error for the same answer, so that consumers translate
	// one error, wherever it came from.
	ErrCompacted = revtree.ErrCompacted
	// ErrFutureRev: the read revision is above etcd's head (the store's
	// error for the same answer).
	ErrFutureRev = revtree.ErrFutureRev
	// ErrAhead is returned by WaitRevision when etcd answered a progress
	// request, sent after the call began, with a revision below the one
	// waited for: as far as the cache can tell, that revision is in the
	// future.
	ErrAhead = errors.New("progress: revision is ahead of etcd")
	// ErrNotFollowing is returned by WaitRevision and WaitFresh while the
	// upstream watch is down, so that callers go to etcd instead of waiting.
	ErrNotFollowing = errors.New("progress: not following etcd")
	// ErrLagging is returned by FenceCall.Wait when the store has not
	// applied etcd's head within the patience its caller gave: the
	// upstream watch lags the cluster (its member is defragmented, or
	// slow), and the read is better sent to etcd than held.
	ErrLagging = errors.New("progress: the upstream watch lags etcd's head")
)

// Fence makes a linearizable read at rev (0: the head) safe to serve from
// the store. It learns etcd's head H with a quorum read started after the
// call, waits until the store has applied H, and returns the store revision
// the read may use (>= H). Because the quorum read is at rev, etcd's own
// answer decides whether rev is compacted (ErrCompacted) or in the future
// (ErrFutureRev), exactly as a read sent to etcd. Other errors (etcd
// unreachable, no leader, ctx done, the follower stopped) mean freshness
// could not be proven.
func (f *Follower) Fence(ctx context.Context, rev int64) (int64, error) {
	c := f.BeginFence(ctx, rev)
	return c.Wait(ctx, time.Time{}, 0)
}

// FenceCall is a read fence begun (BeginFence) and not yet waited for.
type FenceCall struct {
	// wait, if set, is the whole fence: a FenceCall of another follower
	// (FenceOf); the fields below are then unset.
	wait  func(ctx context.Context, deadline time.Time, patience time.Duration) (int64, error)
	f     *Follower
	start time.Time
	gen   uint64               // f.verified when it began
	rev   int64                // the read's revision
	probe *coalesce.Run[int64] // the quorum read joined; nil with err
	err   error                // why it failed as it began
}

// FenceOf returns a FenceCall whose Wait is wait: the fence of a follower
// other than Follower (tests' fakes), which consumers then begin and wait
// for as they do Follower's.
func FenceOf(wait func(ctx context.Context, deadline time.Time, patience time.Duration) (int64, error)) FenceCall {
	return FenceCall{wait: wait}
}

// BeginFence begins Fence for a read at rev without blocking: the quorum
// read it joins runs on the probe's goroutine, so that the reader can do
// other work meanwhile (a permission check) and then Wait, with no
// goroutine or context of its own. ctx is the reader's, for its span
// (the proof's links to the readers that sampled it).
func (f *Follower) BeginFence(ctx context.Context, rev int64) FenceCall {
	c := FenceCall{f: f, start: time.Now(), gen: f.verified.Load(), rev: rev}
	if c.gen == 0 {
		// No stream known to continue the store's history: etcd's head
		// proves nothing about the store (it may come from a restored
		// etcd that the follower has not reconnected to yet).
		c.err = ErrNotFollowing
		return c
	}
	c.probe, c.err = f.probes.join(ctx, rev)
	return c
}

// timers are reused by Wait: a read's bound on its fence then costs no
// allocation. Stop leaves no stale tick in a timer's channel (Go 1.23).
var timers = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return t
}}

// Wait ends the fence as Fence does, giving up when ctx is done or, with
// context.DeadlineExceeded, at deadline (zero: none). With a patience
// (zero: none), it gives up with ErrLagging if the store has not applied
// etcd's head that long after the quorum read reported it: a watch
// delivers an event within milliseconds, tens under load, so a store
// still behind then waits on a member that lags, and the reader is
// better served by etcd. The watch itself moves once it has lagged
// watchStallTimeout, whichever readers were waiting. Wait is called once.
func (c *FenceCall) Wait(ctx context.Context, deadline time.Time, patience time.Duration) (int64, error) {
	if c.wait != nil {
		return c.wait(ctx, deadline, patience)
	}
	f := c.f
	if c.gen == 0 {
		return 0, c.err
	}
	var expired <-chan time.Time
	if !deadline.IsZero() {
		t := timers.Get().(*time.Timer)
		t.Reset(time.Until(deadline))
		defer func() { t.Stop(); timers.Put(t) }()
		expired = t.C
	}
	// bounded is ctx bounded by deadline, for the waits that need a
	// context: made only when the fast path does not do.
	bounded := func() (context.Context, context.CancelFunc) {
		if deadline.IsZero() {
			return ctx, func() {}
		}
		return context.WithDeadline(ctx, deadline)
	}
	var head int64
	err := c.err
	if err == nil {
		head, err = f.probes.wait(ctx, c.probe, c.rev, expired, bounded)
	}
	var applying time.Duration // timed only when the store is behind: most fences never are
	if err == nil && f.store.Rev() < head {
		proven := time.Now()
		wctx, cancel := bounded()
		if patience > 0 {
			var cancelPatience context.CancelFunc
			wctx, cancelPatience = context.WithTimeoutCause(wctx, patience, ErrLagging)
			defer cancelPatience()
		}
		err = f.WaitRevision(wctx, head)
		if errors.Is(err, ErrAhead) {
			// etcd answered a progress request below the head it reported
			// earlier: impossible unless the member we watch lags the
			// one that answered; wait on for the events, and move the
			// watch if they do not come.
			err = f.waitApplied(wctx, head, c.gen)
		}
		if err != nil && ctx.Err() == nil && errors.Is(context.Cause(wctx), ErrLagging) {
			err = ErrLagging
		}
		cancel()
		applying = time.Since(proven)
	}
	waited := time.Since(c.start)
	f.m.observeFenceWait(waited)
	traceFence(ctx, waited, applying, head)
	if err != nil {
		return 0, err
	}
	if f.verified.Load() != c.gen {
		return 0, ErrNotFollowing // the stream changed while the fence waited
	}
	return f.store.Rev(), nil
}

// The attributes a read fence puts on its reader's span.
const (
	attrFreshnessWait = attribute.Key("snapcache.freshness_wait") // seconds from the fence's start to its end
	attrRevisionWait  = attribute.Key("snapcache.revision_wait")  // seconds of it waiting for the store to apply the head
	attrProofHead     = attribute.Key("snapcache.proof_head")     // etcd's head, as the quorum read reported it
)

// traceFence says on the reader's span, if it records, how long its fence
// took, how much of that the store took to apply etcd's head, and the
// head (0: the proof failed).
func traceFence(ctx context.Context, waited, applying time.Duration, head int64) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attrFreshnessWait.Float64(waited.Seconds()), attrRevisionWait.Float64(applying.Seconds()), attrProofHead.Int64(head))
	}
}

// TraceRevisionWait says on the span of ctx, if it records, how long a
// read waited for the store to reach the revision it asked for.
func TraceRevisionWait(ctx context.Context, waited time.Duration) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attrRevisionWait.Float64(waited.Seconds()))
	}
}

// waitApplied waits for the store to reach rev through events alone.
// If the upstream watch of generation gen has lagged a revision etcd
// reported for watchStallTimeout, counted from the first fence that found
// it behind (each reader may give up sooner), its member lags the one
// that reported rev, and the watch is moved to another member (the fence
// then finds the stream changed).
func (f *Follower) waitApplied(ctx context.Context, rev int64, gen uint64) error {
	lag := time.NewTimer(f.lag.untilMove(gen, rev, f.store.Rev(), time.Now()))
	defer lag.Stop()
	for {
		changed := f.Changed()
		if f.store.Rev() >= rev {
			return nil
		}
		select {
		case <-changed:
		case <-lag.C:
			f.moveLaggingWatch(gen, rev)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// watchLag is when read fences first found the verified upstream watch
// behind a revision etcd reported, so that the watch moves once it has
// lagged watchStallTimeout, though readers with a patience each give up
// sooner.
type watchLag struct {
	mu    sync.Mutex
	gen   uint64    // guarded by mu: the stream generation found behind
	rev   int64     // guarded by mu: the revision it had not applied
	since time.Time // guarded by mu: when a fence first found it so
}

// untilMove records that the stream of generation gen had applied only
// applied when etcd had reported rev, and returns how long until it has
// lagged watchStallTimeout (0: move it now). A lag begins afresh
// on another stream, or once the store reached the revision the last lag
// began at.
func (l *watchLag) untilMove(gen uint64, rev, applied int64, now time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if gen < l.gen {
		// A fence of a stream already replaced: its move would be
		// refused, and the newer stream's lag goes on being timed.
		return watchStallTimeout
	}
	if l.gen != gen || applied >= l.rev {
		l.gen, l.rev, l.since = gen, rev, now
	}
	return max(watchStallTimeout-now.Sub(l.since), 0)
}

// readHead is the quorum read: a linearizable count-only Range of one key at
// rev, whose header carries etcd's head.
func (f *Follower) readHead(ctx context.Context, rev int64) (int64, error) {
	w := f.witness()
	resp, err := f.kv.Range(ctx, &pb.RangeRequest{Key: probeKey, Revision: rev, CountOnly: true})
	switch {
	case err == nil:
		if span := trace.SpanFromContext(ctx); span.IsRecording() {
			span.SetAttributes(attrProofHead.Int64(resp.Header.Revision))
		}
		f.observeHeader(resp.Header)
		f.upstream.observeHead(resp.Header.Revision)
		f.checkHead(w, resp.Header.Revision)
		return resp.Header.Revision, nil
	case errors.Is(rpctypes.Error(err), rpctypes.ErrCompacted):
		return 0, ErrCompacted
	case errors.Is(rpctypes.Error(err), rpctypes.ErrFutureRev):
		f.checkHead(w, rev-1) // etcd's head is below rev
		return 0, ErrFutureRev
	default:
		return 0, fmt.Errorf("reading etcd's revision: %w", err)
	}
}

// WaitRevision waits until the store has applied rev. It returns nil once it
// has; ErrAhead if etcd proved, after the call began, that it is below rev;
// ErrNotFollowing if the upstream watch is down; or ctx's error. Concurrent
// waiters share one RequestProgress.
func (f *Follower) WaitRevision(ctx context.Context, rev int64) error {
	if f.store.Rev() >= rev {
		return nil
	}
	if !f.Following() {
		return ErrNotFollowing
	}
	gen := f.requests.request()
	for {
		changed := f.Changed()
		if f.store.Rev() >= rev {
			return nil
		}
		if f.requests.answeredGeneration() >= gen {
			return ErrAhead
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// WaitFresh waits until etcd has answered a progress request sent after the
// call began, and returns the store's revision then: every event etcd had
// committed when the call began is in the store. It fails with
// ErrNotFollowing while the upstream watch is down, or with ctx's error.
func (f *Follower) WaitFresh(ctx context.Context) (int64, error) {
	if !f.Following() {
		return 0, ErrNotFollowing
	}
	gen := f.requests.request()
	for {
		changed := f.Changed()
		if f.requests.answeredGeneration() >= gen {
			return f.store.Rev(), nil
		}
		if !f.Following() {
			return 0, ErrNotFollowing
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}
