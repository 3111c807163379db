package kvproxy

import (
	"context"
	"errors"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// action is where a route sends a Range.
type action int

const (
	serveFromCache action = iota // answer from route.view
	forward                      // send to etcd
	refuse                       // answer route.err
)

// route is the decision for one Range: where it is answered, and why.
type route struct {
	action action
	reason reason
	view   revtree.View // with serveFromCache
	err    error        // with refuse: etcd's error, or the proxy's Unavailable
}

func cached(view revtree.View, why reason) route {
	return route{action: serveFromCache, reason: why, view: view}
}
func forwarded(why reason) route          { return route{action: forward, reason: why} }
func refused(why reason, err error) route { return route{action: refuse, reason: why, err: err} }

// routeState is what decide reads: the world of one Range as route found
// it, and what route has learned since by taking the steps decide asked
// for. decide only reads it; route fills it in.
type routeState struct {
	// Read before the permission check.
	forwarding bool                   // the cache is off (Gate.Forwarding)
	rules      releaseRules           // the upstream release's
	fallback   ConsistentReadFallback // what an unproven linearizable read does
	// auth is the gate's answer to the permission check (AuthorizeRead).
	auth error
	// Read after the permission check.
	serving      bool // the store answers for etcd (Follower.Serving)
	inconsistent bool // the consistency checker holds the fallback
	// Read after the permission check, for a serializable read only (the
	// one they decide): the store's mirrored compaction revision, the
	// highest revision etcd has reported to the proxy, and the store's
	// revision.
	compactRev, headSeen, storeRev int64
	// The answers to the steps decide asked for.
	fence    learned // the read fence's (nextFence)
	caughtUp learned // WaitRevision's (nextCatchUp)
	view     learned // the store's, for the view (nextView)
}

// learned is the answer to one step, once route has taken it.
type learned struct {
	done bool
	err  error
}

// next is what route does with a decision: answer (forward, refuse,
// serve), or take a step and decide again.
type next int

const (
	nextForward next = iota // send to etcd
	nextRefuse              // answer decision.err
	nextServe               // serve the view taken
	nextView                // take the store's view of decision.rev
	nextFence               // wait for the read fence at decision.rev
	nextCatchUp             // wait for the store to reach decision.rev
)

// decision is decide's answer.
type decision struct {
	next   next
	reason reason // why: with nextForward, nextRefuse, nextServe and nextView
	rev    int64  // with nextView, nextFence and nextCatchUp
	err    error  // with nextRefuse: etcd's error, or the proxy's Unavailable
}

func forwardFor(why reason) decision { return decision{next: nextForward, reason: why} }
func refuseFor(why reason, err error) decision {
	return decision{next: nextRefuse, reason: why, err: err}
}

// decide is where r is answered, and why, as a pure function of r and st;
// or, when st does not tell yet, the step route must take first (wait for
// the read fence, wait for the store to reach a revision, take the
// store's view), whose answer route puts in st before it decides again.
// A step once answered is never asked for again, so route ends. The store
// answers only what it provably holds as etcd would answer it: at a
// revision it retains, after the read fence for a linearizable read, or
// serializable at a revision it has reached.
func decide(r *pb.RangeRequest, st routeState) decision {
	switch {
	case errors.Is(st.auth, gate.ErrAskEtcd) && st.forwarding:
		return forwardFor(reasonForwarding)
	case errors.Is(st.auth, gate.ErrMirrorStale):
		// The mirror is too old to judge the caller: etcd does.
		return forwardFor(reasonAuthStale)
	case errors.Is(st.auth, gate.ErrAskEtcd):
		return forwardFor(reasonAuth)
	case st.auth != nil:
		return refuseFor(reasonAuth, st.auth)
	case st.forwarding:
		return forwardFor(reasonForwarding)
	case !st.serving:
		// KEP-4568: delegate what etcd answers cheaply, refuse the rest
		// rather than hang or flood etcd.
		if isSmall(r) {
			return forwardFor(reasonLoading)
		}
		return refuseFor(reasonLoading, errLoading)
	case st.inconsistent:
		return forwardFor(reasonInconsistent)
	case r.KeysOnly && !st.rules.known:
		// Whether keys-only results carry the lease depends on the
		// release.
		return forwardFor(reasonVersionUnknown)
	case !r.Serializable:
		return decideLinearizable(r, st)
	}
	// A serializable read is answered, with the store's revision in its
	// header, once the store is no lower than any revision etcd has
	// reported to the proxy, so that a client reads its own writes and
	// never goes back in time through it: etcd's member does not answer
	// below what it has acknowledged, at the head or at a revision.
	why, need := reasonHistorical, max(r.Revision, st.headSeen)
	if r.Revision <= 0 {
		// That also covers etcd's compaction revision, which the store
		// may learn before its watch delivers that revision.
		why, need = reasonSerializable, max(st.compactRev, st.headSeen)
	}
	if st.storeRev < need {
		switch {
		case !st.caughtUp.done:
			return decision{next: nextCatchUp, rev: need}
		case st.caughtUp.err != nil:
			return forwardFor(reasonAhead)
		}
		why = reasonWaited
	}
	return decideView(r.Revision, why, st.view)
}

// decideLinearizable serves a linearizable read (etcd reads revision <= 0
// as its head) from the store once a read fence proves the store holds
// every write etcd acknowledged before the read arrived.
func decideLinearizable(r *pb.RangeRequest, st routeState) decision {
	switch err := st.fence.err; {
	case !st.fence.done:
		return decision{next: nextFence, rev: r.Revision}
	case errors.Is(err, revtree.ErrCompacted):
		return refuseFor(reasonCompacted, togRPCError(err))
	case errors.Is(err, revtree.ErrFutureRev):
		return refuseFor(reasonFuture, togRPCError(err))
	case errors.Is(err, progress.ErrLagging):
		// Only a fence with a patience gives up so, and only a read that
		// falls back to etcd gets one.
		return forwardFor(reasonFreshLagging)
	case err != nil:
		why := reasonFreshTimeout
		if !errors.Is(err, context.DeadlineExceeded) {
			why = reasonFreshError
		}
		if st.fallback == FallbackFail {
			return refuseFor(why, errNotFresh)
		}
		return forwardFor(why)
	}
	return decideView(r.Revision, reasonLinearizable, st.view)
}

// decideView serves from the store's view of rev, if the store holds it.
func decideView(rev int64, why reason, view learned) decision {
	switch err := view.err; {
	case !view.done:
		return decision{next: nextView, reason: why, rev: rev}
	case err == nil:
		return decision{next: nextServe, reason: why}
	case errors.Is(err, revtree.ErrCompacted):
		return refuseFor(reasonCompacted, togRPCError(err))
	case errors.Is(err, revtree.ErrNotRetained):
		return forwardFor(reasonNotRetained)
	default:
		// ErrNotLoaded; or ErrFutureRev, which cannot follow the wait or
		// the fence unless a reload intervened: etcd decides.
		return forwardFor(reasonNotReady)
	}
}

// route decides where r is answered (decide), reading the state the
// decision needs and taking the steps it asks for.
func (s *Server) route(ctx context.Context, r *pb.RangeRequest, rules releaseRules) route {
	st := routeState{forwarding: s.gate.Forwarding(), rules: rules, fallback: s.fallback}
	// A linearizable read the store may serve needs both the read fence
	// and, with auth on, a permission check at a fresh auth revision. Each
	// waits on etcd, so they run together, and the read waits for the
	// slower one rather than for both in turn: the fence begins now if the
	// decision, were the read allowed, would wait for it.
	var fence fenceCall
	if !r.Serializable {
		st.serving, st.inconsistent = s.follower.Serving(), s.inconsistent()
		if d := decide(r, st); d.next == nextFence {
			fence = s.beginFence(ctx, d.rev)
		}
	}
	// etcd's handler validates (done), then checks permissions.
	st.auth = s.gate.AuthorizeRead(ctx, r.Key, r.RangeEnd, !r.Serializable)
	st.serving, st.inconsistent = s.follower.Serving(), s.inconsistent()
	if r.Serializable {
		st.compactRev, st.headSeen, st.storeRev = s.store.CompactRev(), s.follower.HeadSeen(), s.store.Rev()
	}
	var view revtree.View
	for {
		d := decide(r, st)
		switch d.next {
		case nextForward:
			return forwarded(d.reason)
		case nextRefuse:
			return refused(d.reason, d.err)
		case nextServe:
			return cached(view, d.reason)
		case nextFence:
			if !fence.begun { // the state changed since: fence now
				fence = s.beginFence(ctx, d.rev)
			}
			st.fence = learned{done: true, err: s.waitFence(ctx, &fence)}
		case nextCatchUp:
			wctx, cancel := context.WithTimeout(ctx, s.wait)
			began := time.Now()
			st.caughtUp = learned{done: true, err: s.follower.WaitRevision(wctx, d.rev)}
			cancel()
			progress.TraceRevisionWait(ctx, time.Since(began))
		case nextView:
			var err error
			view, err = s.store.View(d.rev)
			st.view = learned{done: true, err: err}
		}
	}
}

// fenceCall is a read fence begun beside a request, bounded by the
// freshness timeout from when it began. Its quorum read runs on the
// follower's probe goroutine while the request checks permissions, so a
// read costs no goroutine, channel or context of its own: most readers
// never block anywhere else.
type fenceCall struct {
	begun    bool
	deadline time.Time
	call     progress.FenceCall
}

func (s *Server) beginFence(ctx context.Context, rev int64) fenceCall {
	return fenceCall{begun: true, deadline: time.Now().Add(s.fresh), call: s.follower.BeginFence(ctx, rev)}
}

// fencePatience is how long a linearizable read that may fall back to
// etcd waits for the store to apply the head its fence's quorum read
// reported, before it goes to etcd: the upstream watch delivers an event
// within milliseconds, tens under load, so a store still behind after
// 250 ms waits on a watched member that lags the cluster (one being
// defragmented applies nothing until it ends). etcd's other members answer
// such a read at once.
const fencePatience = 250 * time.Millisecond

// waitFence waits for f and returns its error. A read that falls back to
// etcd when freshness is not proven waits for the store to catch up for
// fencePatience at most; one that fails instead waits until the deadline.
func (s *Server) waitFence(ctx context.Context, f *fenceCall) error {
	patience := fencePatience
	if s.fallback == FallbackFail {
		patience = 0
	}
	_, err := f.call.Wait(ctx, f.deadline, patience)
	return err
}

// togRPCError is etcd's gRPC error for the store's and the read fence's
// answers that etcd gives too (as etcd's v3rpc togRPCError): the one place
// they are translated. Other errors are not etcd's answers, and are
// returned as they are.
func togRPCError(err error) error {
	switch {
	case errors.Is(err, revtree.ErrCompacted):
		return rpctypes.ErrGRPCCompacted
	case errors.Is(err, revtree.ErrFutureRev):
		return rpctypes.ErrGRPCFutureRev
	}
	return err
}

// isSmall reports whether etcd answers r cheaply: one key, a small limit,
// or a count.
func isSmall(r *pb.RangeRequest) bool {
	return len(r.RangeEnd) == 0 || r.CountOnly || (r.Limit > 0 && r.Limit <= smallReadLimit)
}
