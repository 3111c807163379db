package kvproxy

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
	"github.com/etcd-snapcache/etcd-snapcache/internal/kvcheck"
	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// DefaultRevisionWait bounds how long a serializable Range at a revision the
// store has not reached yet waits for it before going to etcd.
const DefaultRevisionWait = time.Second

// DefaultFreshnessTimeout bounds how long a linearizable Range waits for
// proof that the store is fresh, as kube-apiserver waits for its cache.
const DefaultFreshnessTimeout = 3 * time.Second

// DefaultMaxForwardedReads bounds the reads in flight to etcd at once.
const DefaultMaxForwardedReads = 128

// smallReadLimit is the largest limit of a read forwarded to etcd while the
// cache loads: GETs, kube-apiserver's revision probe (limit 1), health checks.
const smallReadLimit = 100

// maxQueueWait bounds how long a read waits for a forwarding slot, or for
// room under the bound of cached read bytes, when its own context has no
// deadline.
const maxQueueWait = 5 * time.Second

var (
	errLoading  = status.Error(codes.Unavailable, "etcd-snapcache: the cache is loading; only small reads are forwarded meanwhile; retry")
	errOverload = status.Error(codes.Unavailable, "etcd-snapcache: too many reads forwarded to etcd; retry")
	errMemory   = status.Error(codes.Unavailable, "etcd-snapcache: too many bytes of reads in flight from the cache; retry")
	// errNotFresh is returned, with FallbackFail, when freshness was not
	// proven in time.
	errNotFresh = status.Error(codes.Unavailable, "etcd-snapcache: could not prove the cache fresh in time; retry")
)

// ConsistentReadFallback is what a linearizable read does when the cache
// could not be proven fresh in time: the --consistent-read-fallback flag.
type ConsistentReadFallback int

const (
	// FallbackForward sends the read to etcd ("forward").
	FallbackForward ConsistentReadFallback = iota
	// FallbackFail fails the read with Unavailable ("fail"): under
	// overload, falling back multiplies etcd's load (KEP-2340).
	FallbackFail
)

// ParseConsistentReadFallback parses the flag's values, forward and fail.
func ParseConsistentReadFallback(v string) (ConsistentReadFallback, error) {
	switch v {
	case "forward":
		return FallbackForward, nil
	case "fail":
		return FallbackFail, nil
	}
	return 0, fmt.Errorf("%q: want forward or fail", v)
}

// String is the flag's value.
func (f ConsistentReadFallback) String() string {
	if f == FallbackFail {
		return "fail"
	}
	return "forward"
}

// Follower is what the KV service needs of the upstream follower
// (progress.Follower).
type Follower interface {
	// Serving reports whether the store answers for etcd (loaded, not
	// reloading).
	Serving() bool
	// WaitRevision waits until the store has applied rev.
	WaitRevision(ctx context.Context, rev int64) error
	// BeginFence begins proving the store fresh for a linearizable read
	// at rev, and returns the proof to wait for: the read checks
	// permissions meanwhile.
	BeginFence(ctx context.Context, rev int64) progress.FenceCall
	// FillHeader sets the member fields of a header served from the store.
	FillHeader(h *pb.ResponseHeader)
	// ObserveHeader records an upstream response's header.
	ObserveHeader(h *pb.ResponseHeader)
	// HeadSeen is the highest revision etcd has reported to the proxy.
	HeadSeen() int64
	// ObserveCompaction mirrors a compaction etcd acknowledged.
	ObserveCompaction(rev int64, source string)
	// UpstreamVersion is etcd's release, "" while unknown.
	UpstreamVersion() string
	// LeaderLost reports whether etcd has no leader.
	LeaderLost() (bool, <-chan struct{})
	// WatchMember is the member the upstream watch runs on ("": none).
	WatchMember() string
}

// Store is what the KV service reads of the cache (revtree.Store).
type Store interface {
	Rev() int64
	CompactRev() int64
	View(rev int64) (revtree.View, error)
}

// Config configures a Server.
type Config struct {
	Store    Store
	Follower Follower
	// Upstream is etcd's KV service.
	Upstream pb.KVClient
	Logger   *zap.Logger
	Metrics  *Metrics
	// RevisionWait bounds the wait of a serializable read for a revision
	// ahead of the store (0: it goes to etcd at once).
	RevisionWait time.Duration
	// FreshnessTimeout bounds the wait of a linearizable read for proof
	// that the store is fresh (0: it falls back at once).
	FreshnessTimeout time.Duration
	// ConsistentReadFallback is what a linearizable read does when
	// freshness was not proven in time.
	ConsistentReadFallback ConsistentReadFallback
	// MaxForwardedReads bounds the Ranges in flight to etcd at once (at
	// least 1), so that a reload cannot turn into a storm of forwarded
	// reads.
	MaxForwardedReads int
	// MaxCachedReadBytes bounds the bytes of responses served from the
	// store that are being built and handed to gRPC at once
	// (0: no bound). Beyond it,
	// reads wait for room, as forwarded reads wait for a slot.
	MaxCachedReadBytes int64
	// Inconsistent, if set, reports that every read must go to etcd: the
	// consistency checker found the store inconsistent.
	Inconsistent func() bool
	// Gate is the auth gate (gate.Gate): etcd's permission check of each
	// read, and whether the cache is off; gate.Unchecked in front of an
	// etcd without auth. Required.
	Gate Gate
}

// Gate is what the KV service asks of the auth gate.
type Gate interface {
	// Forwarding reports that the cache is off (the proxy has no
	// identity of its own, and etcd has auth enabled): every read the
	// gate lets through goes to etcd, none is refused for a load that
	// cannot happen.
	Forwarding() bool
	// AuthorizeRead is etcd's permission check of a read of
	// [key, rangeEnd) by the caller of ctx, linearizable or not: nil lets
	// the store answer; gate.ErrAskEtcd sends the read to etcd, which
	// judges the caller itself (gate.ErrMirrorStale, when the gate's
	// mirror of etcd's auth state is too old to judge it); another error
	// is etcd's refusal, answered as it is.
	AuthorizeRead(ctx context.Context, key, rangeEnd []byte, linearizable bool) error
}

// Server implements etcdserverpb.KVServer.
type Server struct {
	pb.UnsafeKVServer

	store        Store
	follower     Follower
	upstream     pb.KVClient
	lg           *zap.Logger
	m            *Metrics
	wait         time.Duration
	fresh        time.Duration
	fallback     ConsistentReadFallback
	inconsistent func() bool
	gate         Gate
	forwards     chan struct{} // semaphore of reads in flight to etcd
	budget       *byteBudget   // bytes of cached responses in flight; nil: no bound
	queueWait    time.Duration // bound of a wait for admission without a deadline; maxQueueWait if 0
	releases     releaseCache
}

var _ pb.KVServer = (*Server)(nil)

// New returns a KV server.
func New(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Inconsistent == nil {
		cfg.Inconsistent = func() bool { return false }
	}
	if cfg.Gate == nil {
		panic("kvproxy: no Gate (gate.Unchecked is the gate of an etcd without auth)")
	}
	return &Server{
		store:        cfg.Store,
		follower:     cfg.Follower,
		upstream:     cfg.Upstream,
		lg:           cfg.Logger,
		m:            cfg.Metrics,
		wait:         cfg.RevisionWait,
		fresh:        cfg.FreshnessTimeout,
		fallback:     cfg.ConsistentReadFallback,
		inconsistent: cfg.Inconsistent,
		gate:         cfg.Gate,
		forwards:     make(chan struct{}, cfg.MaxForwardedReads),
		budget:       newByteBudget(cfg.MaxCachedReadBytes, cfg.Metrics.setCachedReadBytes),
	}
}

// Range serves r from the store when it can, else from etcd.
func (s *Server) Range(ctx context.Context, r *pb.RangeRequest) (*pb.RangeResponse, error) {
	resp, _, err := s.serveRange(ctx, r, false)
	return resp, err
}

// rangeMessage is Range for the gRPC server (Register): a response from
// the store comes already encoded, a wirecodec.Encoded whose pieces are
// its header and the store's own bytes of its key-values (Result.
// AppendPieces), byte for byte what proto.Marshal gives for the response
// Range would return. Its own bytes (the header, small key-values) are in
// a pooled buffer that gRPC gives back once it has written them
// (wirecodec.NewEncodedOnce): a unary interceptor reads the response
// before gRPC writes it (the payload logger does), and nothing may read it
// after (no stats handler or binary log that keeps sent messages).
func (s *Server) rangeMessage(ctx context.Context, r *pb.RangeRequest) (proto.Message, error) {
	resp, enc, err := s.serveRange(ctx, r, true)
	switch {
	case err != nil:
		return nil, err
	case enc != nil:
		return enc, nil
	}
	return resp, nil
}

// serveRange serves r from the store when it can, else from etcd. With
// encode, a response from the store is returned encoded (enc), not as
// resp.
func (s *Server) serveRange(ctx context.Context, r *pb.RangeRequest, encode bool) (resp *pb.RangeResponse, enc *wirecodec.Encoded, err error) {
	// etcd's interceptor refuses before its handler validates.
	if err := s.checkLeader(ctx); err != nil {
		return nil, nil, err
	}
	if err := kvcheck.Range(r); err != nil {
		return nil, nil, err
	}
	// Every revision the proxy has answered at so far is at most the
	// highest etcd has reported to it: no answer may be below it.
	served := s.follower.HeadSeen()
	rules := s.rules()
	rt := s.route(ctx, r, rules)
	if rt.action != serveFromCache {
		release, err := s.settle(ctx, rt)
		if err != nil {
			return nil, nil, err
		}
		defer release()
		fctx := ctx
		if rt.reason == reasonFreshLagging {
			// The member the upstream watch lags on is most likely slow
			// to answer reads too.
			fctx = drain.Avoid(ctx, s.follower.WatchMember())
		}
		resp, err := s.forwardRange(fctx, r, served)
		if err == nil {
			s.traceAnswer(ctx, resp.GetHeader().GetRevision(), len(resp.Kvs), -1, resp)
		}
		return resp, nil, err
	}
	held, err := s.admitCached(ctx, rt.view, r, rules.opts)
	if err != nil {
		s.observe(ctx, sourceRejected, reasonMemory)
		return nil, nil, err
	}
	result := rt.view.Result(r, rules.opts)
	// The header is filled before the response is sized, and nothing
	// changes it after: it is encoded at the size computed then.
	s.follower.FillHeader(result.Header)
	size := result.Size()
	if held, err = s.fitCached(ctx, held, size, result.Len()); err != nil {
		s.observe(ctx, sourceRejected, reasonMemory)
		return nil, nil, err
	}
	if encode {
		if size < minPiecesBytes {
			// A page: one copy into one pooled buffer costs less than
			// handing gRPC a piece a key-value.
			enc, err = wirecodec.NewEncodedOnce(rangeResponseType, size, func(own []byte) ([][]byte, error) {
				b, err := result.AppendTo(own)
				return [][]byte{b}, err
			})
		} else {
			enc, err = wirecodec.NewEncodedOnce(rangeResponseType, result.OwnSize(), func(own []byte) ([][]byte, error) {
				return result.AppendPieces(nil, own)
			})
		}
		if err != nil {
			s.releaseCached(held)
			return nil, nil, status.Errorf(codes.Internal, "etcd-snapcache: encoding a range response: %v", err)
		}
	} else {
		resp = result.Response()
	}
	// gRPC encodes and queues the response after the handler returns, and
	// ends the call's context once it has: hold the bytes until then. (A
	// response in pieces keeps what it points into of the store alive
	// until gRPC has written it, after the context ends, and most of it
	// is the store's, which the store counts: the bytes held are an
	// upper bound of what it adds.)
	s.releaseCachedWhenDone(ctx, held)
	s.observe(ctx, sourceCache, rt.reason)
	s.traceAnswer(ctx, result.Header.Revision, result.Len(), size, nil)
	if enc != nil {
		return nil, enc, nil
	}
	return resp, nil, nil
}

var rangeResponseType = (&pb.RangeResponse{}).ProtoReflect().Type()

// minPiecesBytes is the least response sent as pieces of the store's
// bytes (Result.AppendPieces) rather than copied into one buffer: a page
// of a paginated LIST (500 key-values of 1 KiB) cost 34% more of the
// proxy's CPU in pieces, a 10 MiB Range 44% less.
const minPiecesBytes = 1 << 20

// forwardRange asks etcd, never answering below served, a revision the
// proxy may already have answered at. etcd answers a serializable read
// from one member, whose revision never goes back; the proxy stands for
// one member to its clients, but its upstream connection spreads reads
// over the cluster, and a member that lags behind the others answers below
// what the cache (or another member) already served. Such an answer is
// asked again as a linearizable read: etcd answers that at a revision no
// lower than any it had committed when the read arrived, and every
// revision the proxy has seen was committed. The retry's answer stands,
// whatever its revision: it is etcd's own present.
func (s *Server) forwardRange(ctx context.Context, r *pb.RangeRequest, served int64) (*pb.RangeResponse, error) {
	resp, err := s.rangeUpstream(ctx, r)
	if !r.Serializable || !wentBack(resp, err, r.Revision, served) {
		return resp, err
	}
	s.m.observeWentBack()
	lr := proto.Clone(r).(*pb.RangeRequest)
	lr.Serializable = false
	return s.rangeUpstream(ctx, lr)
}

// rangeUpstream sends r to etcd. If the member it went to stops answering
// drain's probes (it hangs) or goes away while the read waits, the read is
// asked once more of another member: a Range changes nothing, so a second
// attempt is safe, and the caller does not wait out its deadline on a
// member the proxy no longer uses.
func (s *Server) rangeUpstream(ctx context.Context, r *pb.RangeRequest) (*pb.RangeResponse, error) {
	dctx, cancel := drain.Context(ctx)
	resp, err := s.upstream.Range(dctx, r)
	moved, member := drain.Moved(dctx), drain.Member(dctx)
	cancel()
	if err != nil && ctx.Err() == nil && moved {
		resp, err = s.upstream.Range(drain.Avoid(ctx, member), r)
	}
	if err == nil {
		s.follower.ObserveHeader(resp.Header)
	}
	return resp, err
}

// wentBack reports whether etcd's answer to a read at rev is older than
// served: a header below it, or a future-revision refusal of a revision
// the proxy has seen.
func wentBack(resp *pb.RangeResponse, err error, rev, served int64) bool {
	if err != nil {
		return rev > 0 && rev <= served && errors.Is(err, rpctypes.ErrGRPCFutureRev)
	}
	return resp.GetHeader().GetRevision() < served
}

// queueContext bounds a wait for admission: by the caller's deadline, or
// by queueWait if it has none.
func (s *Server) queueContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	wait := s.queueWait
	if wait <= 0 {
		wait = maxQueueWait
	}
	return context.WithTimeout(ctx, wait)
}

// admissionError is the answer to a read that waited for admission in
// vain: what etcd answers when the caller's own context ends
// (DeadlineExceeded, or Canceled), else the proxy's overload error.
func admissionError(ctx context.Context, overload error) error {
	if err := ctx.Err(); err != nil {
		return status.FromContextError(err).Err()
	}
	return overload
}

// settle answers a request the store must not serve: with the refusal the
// route decided, or with a forwarding slot for the request to go to etcd.
// It counts the request once, with where it went.
func (s *Server) settle(ctx context.Context, rt route) (release func(), err error) {
	if rt.action == refuse {
		s.observe(ctx, sourceRejected, rt.reason)
		return nil, rt.err
	}
	if ctx.Err() != nil {
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	release, err = s.acquireForward(ctx)
	if err != nil {
		s.observe(ctx, sourceRejected, reasonOverload)
		return nil, err
	}
	s.observe(ctx, sourceForwarded, rt.reason)
	return release, nil
}

// acquireForward takes one of the slots of reads in flight to etcd, waiting
// for one up to the read's deadline (or maxQueueWait). A read whose own
// deadline passes first gets DeadlineExceeded, as from etcd.
func (s *Server) acquireForward(ctx context.Context) (func(), error) {
	select {
	case s.forwards <- struct{}{}:
		return func() { <-s.forwards }, nil
	default:
	}
	wctx, cancel := s.queueContext(ctx)
	defer cancel()
	select {
	case s.forwards <- struct{}{}:
		return func() { <-s.forwards }, nil
	case <-wctx.Done():
		return nil, admissionError(ctx, errOverload)
	}
}

// rules are the upstream release's rules for answering from the store.
func (s *Server) rules() releaseRules { return s.releases.get(s.follower.UpstreamVersion()) }

// checkLeader refuses a request that requires a leader (hasleader
// metadata, as clientv3.WithRequireLeader sets) while etcd reports having
// none, as etcd's own interceptor does for every request.
func (s *Server) checkLeader(ctx context.Context) error {
	// ValueFromIncomingContext, unlike FromIncomingContext, copies no
	// more than the one key's values.
	if v := metadata.ValueFromIncomingContext(ctx, rpctypes.MetadataRequireLeaderKey); len(v) == 0 || v[0] != rpctypes.MetadataHasLeader {
		return nil
	}
	if lost, _ := s.follower.LeaderLost(); lost {
		return rpctypes.ErrGRPCNoLeader
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

// Register registers s as gs's KV service: etcd's, but for Range, whose
// responses from the store go out already encoded (rangeMessage). gs must
// send a wirecodec.Encoded as it is (wirecodec.ServerOption); a server
// without that codec still sends the same bytes, decoding and encoding
// each response again.
func Register(gs grpc.ServiceRegistrar, s *Server) {
	gs.RegisterService(&kvServiceDesc, s)
}

// kvServiceDesc is etcd's KV service with rangeHandler for Range.
var kvServiceDesc = func() grpc.ServiceDesc {
	desc := pb.KV_ServiceDesc
	desc.Methods = slices.Clone(desc.Methods)
	found := false
	for i := range desc.Methods {
		if desc.Methods[i].MethodName == "Range" {
			desc.Methods[i].Handler = rangeHandler
			found = true
		}
	}
	if !found {
		panic("kvproxy: etcd's KV service has no Range method")
	}
	return desc
}()

// rangeHandler is etcd's generated Range handler calling rangeMessage.
func rangeHandler(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
	in := new(pb.RangeRequest)
	if err := dec(in); err != nil {
		return nil, err
	}
	s := srv.(*Server)
	if interceptor == nil {
		return s.rangeMessage(ctx, in)
	}
	info := &grpc.UnaryServerInfo{Server: srv, FullMethod: pb.KV_Range_FullMethodName}
	return interceptor(ctx, in, info, func(ctx context.Context, req any) (any, error) {
		return s.rangeMessage(ctx, req.(*pb.RangeRequest))
	})
}
