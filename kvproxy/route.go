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

// route decides where r is answered. The store answers only what it
// provably holds as etcd would answer it: at a revision it retains, after
// the read fence for a linearizable read, or serializable at a revision it
// has reached.
func (s *Server) route(ctx context.Context, r *pb.RangeRequest, rules releaseRules) route {
	// A linearizable read the store may serve needs both the read fence
	// and, with auth on, a permission check at a fresh auth revision. Each
	// waits on etcd, so they run together, and the read waits for the
	// slower one rather than for both in turn.
	var fence fenceCall
	forwarding := s.gate.Forwarding()
	if !r.Serializable && !forwarding && s.follower.Serving() && !s.inconsistent() && (!r.KeysOnly || rules.known) {
		fence = s.beginFence(r.Revision)
	}
	// etcd's handler validates (done), then checks permissions.
	switch err := s.gate.AuthorizeRead(ctx, r.Key, r.RangeEnd, !r.Serializable); {
	case errors.Is(err, gate.ErrAskEtcd) && forwarding:
		return forwarded(reasonForwarding)
	case errors.Is(err, gate.ErrAskEtcd):
		return forwarded(reasonAuth)
	case err != nil:
		return refused(reasonAuth, err)
	}
	switch {
	case forwarding:
		return forwarded(reasonForwarding)
	case !s.follower.Serving():
		// KEP-4568: delegate what etcd answers cheaply, refuse the rest
		// rather than hang or flood etcd.
		if isSmall(r) {
			return forwarded(reasonLoading)
		}
		return refused(reasonLoading, errLoading)
	case s.inconsistent():
		return forwarded(reasonInconsistent)
	case r.KeysOnly && !rules.known:
		// Whether keys-only results carry the lease depends on the
		// release.
		return forwarded(reasonVersionUnknown)
	case !r.Serializable:
		if !fence.begun { // the state changed since: fence now
			fence = s.beginFence(r.Revision)
		}
		return s.routeLinearizable(r, s.waitFence(ctx, &fence))
	}
	// A serializable read is answered, with the store's revision in its
	// header, once the store is no lower than any revision etcd has
	// reported to the proxy, so that a client reads its own writes and
	// never goes back in time through it: etcd's member does not answer
	// below what it has acknowledged, at the head or at a revision.
	why, need := reasonHistorical, max(r.Revision, s.follower.HeadSeen())
	if r.Revision <= 0 {
		// That also covers etcd's compaction revision, which the store
		// may learn before its watch delivers that revision.
		why, need = reasonSerializable, max(s.store.CompactRev(), s.follower.HeadSeen())
	}
	if s.store.Rev() < need {
		wctx, cancel := context.WithTimeout(ctx, s.wait)
		err := s.follower.WaitRevision(wctx, need)
		cancel()
		if err != nil {
			return forwarded(reasonAhead)
		}
		why = reasonWaited
	}
	return s.routeView(r.Revision, why)
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

func (s *Server) beginFence(rev int64) fenceCall {
	return fenceCall{begun: true, deadline: time.Now().Add(s.fresh), call: s.follower.BeginFence(rev)}
}

// waitFence waits for f and returns its error.
func (s *Server) waitFence(ctx context.Context, f *fenceCall) error {
	_, err := f.call.Wait(ctx, f.deadline)
	return err
}

// routeLinearizable serves a linearizable read (etcd reads revision <= 0 as
// its head) from the store once a read fence (whose error is err) proves
// the store holds every write etcd acknowledged before the read arrived.
func (s *Server) routeLinearizable(r *pb.RangeRequest, err error) route {
	switch {
	case errors.Is(err, revtree.ErrCompacted):
		return refused(reasonCompacted, togRPCError(err))
	case errors.Is(err, revtree.ErrFutureRev):
		return refused(reasonFuture, togRPCError(err))
	case err != nil:
		why := reasonFreshTimeout
		if !errors.Is(err, context.DeadlineExceeded) {
			why = reasonFreshError
		}
		if s.fallback == FallbackFail {
			return refused(why, errNotFresh)
		}
		return forwarded(why)
	}
	return s.routeView(r.Revision, reasonLinearizable)
}

// routeView serves from the snapshot of rev, if the store holds it.
func (s *Server) routeView(rev int64, why reason) route {
	view, err := s.store.View(rev)
	switch {
	case err == nil:
		return cached(view, why)
	case errors.Is(err, revtree.ErrCompacted):
		return refused(reasonCompacted, togRPCError(err))
	case errors.Is(err, revtree.ErrNotRetained):
		return forwarded(reasonNotRetained)
	default:
		// ErrNotLoaded; or ErrFutureRev, which cannot follow the wait or
		// the fence above unless a reload intervened: etcd decides.
		return forwarded(reasonNotReady)
	}
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
