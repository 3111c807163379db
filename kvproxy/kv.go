package kvproxy

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-semver/semver"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// DefaultRevisionWait bounds how long a serializable Range at a revision the
// store has not reached yet waits for it before going to etcd.
const DefaultRevisionWait = time.Second

// DefaultFreshnessTimeout bounds how long a linearizable Range waits for
// proof that the store is fresh, as kube-apiserver waits for its cache.
const DefaultFreshnessTimeout = 3 * time.Second

// SmallReadLimit is the largest limit of a read forwarded to etcd while the
// cache loads: GETs, kube-apiserver's revision probe (limit 1), health checks.
const SmallReadLimit = 100

// DefaultMaxForwardedReads bounds the reads in flight to etcd at once.
const DefaultMaxForwardedReads = 128

// maxForwardQueueWait bounds how long a read waits for a forwarding slot
// when its own context has no deadline.
const maxForwardQueueWait = 5 * time.Second

var (
	errLoading  = status.Error(codes.Unavailable, "etcd-snapcache: the cache is loading; only small reads are forwarded meanwhile; retry")
	errOverload = status.Error(codes.Unavailable, "etcd-snapcache: too many reads forwarded to etcd; retry")
)

// errNotFresh is returned, with FailUnproven, when freshness was not proven
// in time.
var errNotFresh = status.Error(codes.Unavailable, "etcd-snapcache: could not prove the cache fresh in time; retry")

// Config configures a Server.
type Config struct {
	Store    *revtree.Store
	Follower *progress.Follower
	// Upstream is etcd's KV service.
	Upstream pb.KVClient
	Logger   *zap.Logger
	Metrics  *Metrics
	// RevisionWait bounds the wait of a serializable read for a revision
	// ahead of the store.
	RevisionWait time.Duration
	// FreshnessTimeout bounds the wait of a linearizable read for proof
	// that the store is fresh.
	FreshnessTimeout time.Duration
	// MaxForwardedReads bounds the Ranges in flight to etcd at once
	// (DefaultMaxForwardedReads if 0), so that a reload cannot turn into a
	// storm of forwarded reads.
	MaxForwardedReads int
	// Fallback, if set, reports that every read must go to etcd (the
	// consistency checker found the store inconsistent).
	Fallback func() bool
	// FailUnproven makes a linearizable read that could not be proven
	// fresh in time fail with Unavailable instead of going to etcd: under
	// overload, falling back multiplies etcd's load (KEP-2340).
	FailUnproven bool
}

// Server implements etcdserverpb.KVServer.
type Server struct {
	pb.UnsafeKVServer

	store    *revtree.Store
	follower *progress.Follower
	upstream pb.KVClient
	lg       *zap.Logger
	m        *Metrics
	wait     time.Duration
	fresh    time.Duration
	failFast bool
	fallback func() bool
	forwards chan struct{} // semaphore of reads in flight to etcd

	optsMu      sync.Mutex
	optsVersion string
	opts        revtree.RangeOptions
}

// New returns a KV server.
func New(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.RevisionWait <= 0 {
		cfg.RevisionWait = DefaultRevisionWait
	}
	if cfg.MaxForwardedReads <= 0 {
		cfg.MaxForwardedReads = DefaultMaxForwardedReads
	}
	if cfg.FreshnessTimeout <= 0 {
		cfg.FreshnessTimeout = DefaultFreshnessTimeout
	}
	return &Server{
		store:    cfg.Store,
		follower: cfg.Follower,
		upstream: cfg.Upstream,
		lg:       cfg.Logger,
		m:        cfg.Metrics,
		wait:     cfg.RevisionWait,
		fresh:    cfg.FreshnessTimeout,
		failFast: cfg.FailUnproven,
		fallback: cfg.Fallback,
		forwards: make(chan struct{}, cfg.MaxForwardedReads),
	}
}

// Range serves r from the store when it can, else from etcd.
func (s *Server) Range(ctx context.Context, r *pb.RangeRequest) (*pb.RangeResponse, error) {
	if err := checkRangeRequest(r); err != nil {
		return nil, err
	}
	if err := s.checkLeader(ctx); err != nil {
		return nil, err
	}
	view, reason, err := s.route(ctx, r)
	if err != nil {
		return s.answerWithout(ctx, r, reason, err)
	}
	s.m.observe(sourceCache, reason)
	resp := view.Range(r, s.rangeOptions())
	s.follower.FillHeader(resp.Header)
	return resp, nil
}

// answerWithout answers a Range the store must not: with etcd's error when
// the store knows it, else from etcd, or Unavailable when freshness could
// not be proven and falling back is off.
func (s *Server) answerWithout(ctx context.Context, r *pb.RangeRequest, reason string, err error) (*pb.RangeResponse, error) {
	switch {
	case errors.Is(err, revtree.ErrCompacted):
		s.m.observe(sourceRejected, reason)
		return nil, rpctypes.ErrGRPCCompacted
	case errors.Is(err, revtree.ErrFutureRev):
		s.m.observe(sourceRejected, reason)
		return nil, rpctypes.ErrGRPCFutureRev
	case errors.Is(err, errNotFresh) && s.failFast:
		s.m.observe(sourceRejected, reason)
		return nil, errNotFresh
	case errors.Is(err, errLoading):
		s.m.observe(sourceRejected, reason)
		return nil, errLoading
	case ctx.Err() != nil:
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	s.m.observe(sourceForwarded, reason)
	return s.forwardRange(ctx, r)
}

// errForward marks a Range the store must not answer; the reason says why.
var errForward = errors.New("forward to etcd")

// route picks the snapshot that answers r, or says why the store must not.
func (s *Server) route(ctx context.Context, r *pb.RangeRequest) (revtree.View, string, error) {
	switch {
	case hasAuthToken(ctx):
		// The store cannot check the caller's permissions; etcd can.
		return revtree.View{}, "auth", errForward
	case s.follower.Loading() || !s.follower.IsReady():
		// KEP-4568: delegate what etcd answers cheaply, refuse the rest
		// rather than hang or flood etcd.
		if isSmall(r) {
			return revtree.View{}, "loading", errForward
		}
		return revtree.View{}, "loading", errLoading
	case s.fallback != nil && s.fallback():
		return revtree.View{}, "inconsistent", errForward
	case !r.Serializable:
		return s.routeLinearizable(ctx, r)
	}
	reason, need := "historical", r.Revision
	if r.Revision <= 0 {
		// etcd's head is never below its compaction revision; the
		// store's may be, briefly, when it learns of a compaction before
		// its watch delivers that revision.
		reason, need = "serializable", s.store.CompactRev()
	}
	if s.store.Rev() < need {
		wctx, cancel := context.WithTimeout(ctx, s.wait)
		err := s.follower.WaitRevision(wctx, need)
		cancel()
		if err != nil {
			return revtree.View{}, "ahead", errForward
		}
		reason = "waited"
	}
	return s.view(r.Revision, reason)
}

// routeLinearizable serves a linearizable read (etcd reads revision <= 0 as
// its head) from the store once a read fence proves the store holds every
// write etcd acknowledged before the read arrived.
func (s *Server) routeLinearizable(ctx context.Context, r *pb.RangeRequest) (revtree.View, string, error) {
	fctx, cancel := context.WithTimeout(ctx, s.fresh)
	_, err := s.follower.Fence(fctx, r.Revision)
	cancel()
	switch {
	case errors.Is(err, progress.ErrCompacted):
		return revtree.View{}, "compacted", revtree.ErrCompacted
	case errors.Is(err, progress.ErrFutureRev):
		return revtree.View{}, "future", revtree.ErrFutureRev
	case err != nil:
		reason := "fresh_timeout"
		if !errors.Is(err, context.DeadlineExceeded) {
			reason = "fresh_error"
		}
		return revtree.View{}, reason, errNotFresh
	}
	return s.view(r.Revision, "linearizable")
}

func (s *Server) view(rev int64, reason string) (revtree.View, string, error) {
	view, err := s.store.View(rev)
	switch {
	case err == nil:
		return view, reason, nil
	case errors.Is(err, revtree.ErrCompacted):
		return revtree.View{}, "compacted", err
	case errors.Is(err, revtree.ErrNotRetained):
		return revtree.View{}, "not_retained", errForward
	default: // ErrNotLoaded; ErrFutureRev cannot follow a wait
		return revtree.View{}, "not_ready", errForward
	}
}

func (s *Server) forwardRange(ctx context.Context, r *pb.RangeRequest) (*pb.RangeResponse, error) {
	release, err := s.acquireForward(ctx)
	if err != nil {
		return nil, err
	}
	defer release()
	resp, err := s.upstream.Range(ctx, r)
	if err == nil {
		s.follower.ObserveHeader(resp.Header)
	}
	return resp, err
}

// acquireForward takes one of the slots of reads in flight to etcd, waiting
// for one up to the read's deadline (or maxForwardQueueWait).
func (s *Server) acquireForward(ctx context.Context) (func(), error) {
	select {
	case s.forwards <- struct{}{}:
		return func() { <-s.forwards }, nil
	default:
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, maxForwardQueueWait)
		defer cancel()
	}
	select {
	case s.forwards <- struct{}{}:
		return func() { <-s.forwards }, nil
	case <-ctx.Done():
		s.m.observe(sourceRejected, "overload")
		return nil, errOverload
	}
}

// isSmall reports whether etcd answers r cheaply: one key, a small limit,
// or a count.
func isSmall(r *pb.RangeRequest) bool {
	return len(r.RangeEnd) == 0 || r.CountOnly || (r.Limit > 0 && r.Limit <= SmallReadLimit)
}

// rangeOptions follows the upstream's release: etcd 3.7 drops the lease
// from keys-only results.
func (s *Server) rangeOptions() revtree.RangeOptions {
	v := s.follower.UpstreamVersion()
	s.optsMu.Lock()
	defer s.optsMu.Unlock()
	if v != s.optsVersion {
		s.optsVersion = v
		s.opts = rangeOptionsFor(v)
	}
	return s.opts
}

func rangeOptionsFor(version string) revtree.RangeOptions {
	v, err := semver.NewVersion(strings.TrimPrefix(version, "v"))
	if err != nil {
		return revtree.RangeOptions{KeysOnlyWithoutLease: true} // assume the release we are built with
	}
	return revtree.RangeOptions{KeysOnlyWithoutLease: !v.LessThan(semver.Version{Major: 3, Minor: 7})}
}

// checkLeader refuses a request that requires a leader (hasleader
// metadata, as clientv3.WithRequireLeader sets) while etcd reports having
// none, as etcd's own interceptor does for every request.
func (s *Server) checkLeader(ctx context.Context) error {
	md, ok := metadata.FromIncomingContext(ctx)
	if !ok {
		return nil
	}
	if v := md.Get(rpctypes.MetadataRequireLeaderKey); len(v) == 0 || v[0] != rpctypes.MetadataHasLeader {
		return nil
	}
	if lost, _ := s.follower.LeaderLost(); lost {
		return rpctypes.ErrGRPCNoLeader
	}
	return nil
}

// hasAuthToken reports whether the caller authenticated with a token.
func hasAuthToken(ctx context.Context) bool {
	md, ok := metadata.FromIncomingContext(ctx)
	return ok && len(md.Get(rpctypes.TokenFieldNameGRPC)) > 0
}

// checkRangeRequest is etcd's validation (api/v3rpc/key.go), which runs
// before anything else.
func checkRangeRequest(r *pb.RangeRequest) error {
	if len(r.Key) == 0 {
		return rpctypes.ErrGRPCEmptyKey
	}
	if _, ok := pb.RangeRequest_SortOrder_name[int32(r.SortOrder)]; !ok {
		return rpctypes.ErrGRPCInvalidSortOption
	}
	if _, ok := pb.RangeRequest_SortTarget_name[int32(r.SortTarget)]; !ok {
		return rpctypes.ErrGRPCInvalidSortOption
	}
	return nil
}

// Put is forwarded to etcd.
func (s *Server) Put(ctx context.Context, r *pb.PutRequest) (*pb.PutResponse, error) {
	resp, err := s.upstream.Put(ctx, r)
	if err == nil {
		s.follower.ObserveHeader(resp.Header)
	}
	return resp, err
}

// DeleteRange is forwarded to etcd.
func (s *Server) DeleteRange(ctx context.Context, r *pb.DeleteRangeRequest) (*pb.DeleteRangeResponse, error) {
	resp, err := s.upstream.DeleteRange(ctx, r)
	if err == nil {
		s.follower.ObserveHeader(resp.Header)
	}
	return resp, err
}

// Txn is forwarded to etcd.
func (s *Server) Txn(ctx context.Context, r *pb.TxnRequest) (*pb.TxnResponse, error) {
	resp, err := s.upstream.Txn(ctx, r)
	if err == nil {
		s.follower.ObserveHeader(resp.Header)
	}
	return resp, err
}

// Compact is forwarded to etcd and, once etcd has compacted, mirrored into
// the store so that the store refuses exactly what etcd refuses.
func (s *Server) Compact(ctx context.Context, r *pb.CompactionRequest) (*pb.CompactionResponse, error) {
	resp, err := s.upstream.Compact(ctx, r)
	if err != nil {
		return nil, err
	}
	s.follower.ObserveHeader(resp.Header)
	s.follower.ObserveCompaction(r.Revision, "proxy")
	return resp, nil
}

var _ pb.KVServer = (*Server)(nil)
