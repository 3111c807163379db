package kvproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Header fields the fake follower fills in, to tell a header served from
// the store from one relayed from etcd.
const (
	fakeClusterID = 7
	fakeMemberID  = 8
	fakeRaftTerm  = 9
	upstreamRev   = 999 // the revision the fake etcd answers at
)

// fakeFollower is a Follower whose answers the test sets.
type fakeFollower struct {
	serving    bool
	version    string
	leaderLost bool
	headSeen   int64
	// fence and waitRevision replace Fence and WaitRevision when set.
	fence        func(ctx context.Context, rev int64) (int64, error)
	waitRevision func(ctx context.Context, rev int64) error
	store        *revtree.Store
	// begun counts the fences begun (BeginFence); patience is the last
	// fence's.
	begun    int
	patience time.Duration

	mu       sync.Mutex
	observed []*pb.ResponseHeader
}

func (f *fakeFollower) Serving() bool { return f.serving }

func (f *fakeFollower) WaitRevision(ctx context.Context, rev int64) error {
	if f.waitRevision != nil {
		return f.waitRevision(ctx, rev)
	}
	if f.store.Rev() >= rev {
		return nil
	}
	// The store never gets there: as if the wait timed out.
	return context.DeadlineExceeded
}

func (f *fakeFollower) BeginFence(_ context.Context, rev int64) progress.FenceCall {
	f.begun++
	return progress.FenceOf(func(ctx context.Context, deadline time.Time, patience time.Duration) (int64, error) {
		f.patience = patience
		ctx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		if f.fence != nil {
			return f.fence(ctx, rev)
		}
		return f.store.Rev(), nil
	})
}

func (f *fakeFollower) FillHeader(h *pb.ResponseHeader) {
	h.ClusterId, h.MemberId, h.RaftTerm = fakeClusterID, fakeMemberID, fakeRaftTerm
}

func (f *fakeFollower) ObserveHeader(h *pb.ResponseHeader) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.observed = append(f.observed, h)
}

func (f *fakeFollower) ObserveCompaction(int64, string) {}
func (f *fakeFollower) HeadSeen() int64                 { return f.headSeen }
func (f *fakeFollower) UpstreamVersion() string         { return f.version }
func (f *fakeFollower) WatchMember() string             { return "" }

func (f *fakeFollower) LeaderLost() (bool, <-chan struct{}) {
	return f.leaderLost, nil
}

// fakeKV is etcd's KV service: it answers Range and RangeStream at
// upstreamRev (or as answer says), and records the calls.
type fakeKV struct {
	pb.KVClient
	// answer, if set, answers Range.
	answer func(r *pb.RangeRequest) (*pb.RangeResponse, error)

	mu                   sync.Mutex
	ranges, rangeStreams int
	requests             []*pb.RangeRequest // of Range and RangeStream, in order
}

func (u *fakeKV) Range(ctx context.Context, r *pb.RangeRequest, _ ...grpc.CallOption) (*pb.RangeResponse, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.ranges++
	u.requests = append(u.requests, r)
	if u.answer != nil {
		return u.answer(r)
	}
	return &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: upstreamRev}}, nil
}

func (u *fakeKV) RangeStream(ctx context.Context, r *pb.RangeRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[pb.RangeStreamResponse], error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.rangeStreams++
	u.requests = append(u.requests, r)
	return &fakeRangeStreamClient{resps: []*pb.RangeStreamResponse{
		{RangeResponse: &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: upstreamRev}}},
	}}, nil
}

func (u *fakeKV) calls() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.ranges + u.rangeStreams
}

// fakeRangeStreamClient is etcd's side of a RangeStream: its responses,
// then io.EOF.
type fakeRangeStreamClient struct {
	grpc.ClientStream
	resps []*pb.RangeStreamResponse
}

func (c *fakeRangeStreamClient) Recv() (*pb.RangeStreamResponse, error) {
	if len(c.resps) == 0 {
		return nil, io.EOF
	}
	r := c.resps[0]
	c.resps = c.resps[1:]
	return r, nil
}

// fakeRangeStreamServer is the client's side of a RangeStream: it records
// what the server sends.
type fakeRangeStreamServer struct {
	grpc.ServerStream
	ctx  context.Context
	sent []*pb.RangeStreamResponse
}

func (s *fakeRangeStreamServer) Context() context.Context { return s.ctx }
func (s *fakeRangeStreamServer) Send(r *pb.RangeStreamResponse) error {
	s.sent = append(s.sent, r)
	return nil
}

// SendMsg takes what the server sends on the stream, a response or its
// encoding, as gRPC would (and as the client would decode it).
func (s *fakeRangeStreamServer) SendMsg(m any) error { return s.Send(asRangeStreamResponse(m)) }

func asRangeStreamResponse(m any) *pb.RangeStreamResponse {
	if r, ok := m.(*pb.RangeStreamResponse); ok {
		return r
	}
	b, err := proto.Marshal(m.(proto.Message))
	if err != nil {
		panic(err)
	}
	r := &pb.RangeStreamResponse{}
	if err := proto.Unmarshal(b, r); err != nil {
		panic(err)
	}
	return r
}

func putKV(key, value string, rev, create, version int64) *mvccpb.KeyValue {
	return &mvccpb.KeyValue{Key: []byte(key), Value: []byte(value), ModRevision: rev, CreateRevision: create, Version: version}
}

// routeEnv is one row's world: a real store at revision 13 (loaded at 10,
// then a put of "a" at each of 11..13, nothing compacted), a fake follower
// serving for etcd 3.7.3, and a fake etcd.
type routeEnv struct {
	store    *revtree.Store
	follower *fakeFollower
	upstream *fakeKV
	cfg      Config
	reg      *prometheus.Registry
}

func newRouteEnv(t *testing.T) *routeEnv {
	t.Helper()
	store := revtree.New(0)
	store.Reset(10, []*mvccpb.KeyValue{
		putKV("a", "a10", 10, 10, 1),
		putKV("b", "b", 5, 5, 1),
		putKV("c", "c", 6, 6, 1),
	}, 0)
	for rev := int64(11); rev <= 13; rev++ {
		applyPut(t, store, rev, "a", rev-9)
	}
	e := &routeEnv{
		store:    store,
		follower: &fakeFollower{serving: true, version: "3.7.3", store: store},
		upstream: &fakeKV{},
		reg:      prometheus.NewRegistry(),
	}
	e.cfg = Config{
		Store:              store,
		Follower:           e.follower,
		Upstream:           e.upstream,
		Metrics:            NewMetrics(e.reg),
		RevisionWait:       DefaultRevisionWait,
		FreshnessTimeout:   DefaultFreshnessTimeout,
		MaxForwardedReads:  DefaultMaxForwardedReads,
		MaxCachedReadBytes: DefaultMaxCachedReadBytes,
		Gate:               gate.Unchecked{},
	}
	return e
}

// forwardingGate is the gate of a proxy whose cache is off: no identity
// of its own in front of an etcd with auth enabled.
type forwardingGate struct{ gate.Unchecked }

func (forwardingGate) Forwarding() bool { return true }

// applyPut applies a put of key at rev, the key's version-th.
func applyPut(t *testing.T, store *revtree.Store, rev int64, key string, version int64) {
	t.Helper()
	kv := putKV(key, key+strconv.FormatInt(rev, 10), rev, 10, version)
	if _, err := store.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}); err != nil {
		t.Fatalf("apply %d: %v", rev, err)
	}
}

// via is the entry point a row goes through.
type via int

const (
	viaRoute       via = iota // route itself (and Range for the metrics)
	viaRange                  // only Range decides it (settle)
	viaRangeStream            // RangeStream's own routing
)

type routeCase struct {
	name string
	via  via
	// setup changes the world before the server is made; prepare the
	// server before the request.
	setup   func(t *testing.T, e *routeEnv)
	prepare func(s *Server)
	req     *pb.RangeRequest
	// auth sends the request with a token; timeout bounds it.
	auth    bool
	timeout time.Duration

	action action
	reason reason
	err    error // for refuse
	// viewRev is the view's revision for serveFromCache.
	viewRev int64
}

func key(k string) *pb.RangeRequest { return &pb.RangeRequest{Key: []byte(k)} }

func serializable(k string, rev int64) *pb.RangeRequest {
	return &pb.RangeRequest{Key: []byte(k), Serializable: true, Revision: rev}
}

func fenceReturns(err error) func(*testing.T, *routeEnv) {
	return func(_ *testing.T, e *routeEnv) {
		e.follower.fence = func(context.Context, int64) (int64, error) { return 0, err }
	}
}

func failUnproven(err error) func(*testing.T, *routeEnv) {
	return func(t *testing.T, e *routeEnv) {
		fenceReturns(err)(t, e)
		e.cfg.ConsistentReadFallback = FallbackFail
	}
}

// routeCases has at least one row per reason of metrics.go
// (TestRouteCoversEveryReason checks it).
func routeCases() []routeCase {
	errUnreachable := errors.New("etcd unreachable")
	wide := &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")}
	return []routeCase{
		// Served from the cache.
		{name: "linearizable after the fence", req: key("a"),
			action: serveFromCache, reason: reasonLinearizable, viewRev: 13},
		{name: "historical at a retained revision", req: serializable("a", 11),
			action: serveFromCache, reason: reasonHistorical, viewRev: 11},
		{name: "serializable at the head", req: serializable("a", 0),
			action: serveFromCache, reason: reasonSerializable, viewRev: 13},
		{name: "waited for a revision the store then reached", req: serializable("a", 14),
			setup: func(t *testing.T, e *routeEnv) {
				e.follower.waitRevision = func(ctx context.Context, rev int64) error {
					applyPut(t, e.store, 14, "a", 5)
					return nil
				}
			},
			action: serveFromCache, reason: reasonWaited, viewRev: 14},

		// Forwarded to etcd.
		{name: "auth token", req: serializable("a", 0), auth: true,
			action: forward, reason: reasonAuth},
		{name: "auth mirror too old to judge the caller", req: serializable("a", 0),
			setup:  func(_ *testing.T, e *routeEnv) { e.cfg.Gate = staleMirrorGate{} },
			action: forward, reason: reasonAuthStale},
		{name: "store found inconsistent", req: serializable("a", 0),
			setup:  func(_ *testing.T, e *routeEnv) { e.cfg.Inconsistent = func() bool { return true } },
			action: forward, reason: reasonInconsistent},
		{name: "older than the retained snapshots", req: serializable("a", 9),
			action: forward, reason: reasonNotRetained},
		{name: "store did not reach the revision in time", req: serializable("a", 20),
			action: forward, reason: reasonAhead},
		{name: "store not loaded", req: serializable("a", 0),
			setup: func(_ *testing.T, e *routeEnv) {
				e.store = revtree.New(0)
				e.cfg.Store, e.follower.store = e.store, e.store
			},
			action: forward, reason: reasonNotReady},
		{name: "keys-only with the release unknown",
			req:    &pb.RangeRequest{Key: []byte("a"), KeysOnly: true, Serializable: true},
			setup:  func(_ *testing.T, e *routeEnv) { e.follower.version = "" },
			action: forward, reason: reasonVersionUnknown},
		{name: "RangeStream with the release unknown", via: viaRangeStream, req: serializable("a", 0),
			setup:  func(_ *testing.T, e *routeEnv) { e.follower.version = "" },
			action: forward, reason: reasonVersionUnknown},
		{name: "RangeStream before etcd 3.7", via: viaRangeStream, req: serializable("a", 0),
			setup:  func(_ *testing.T, e *routeEnv) { e.follower.version = "3.6.16" },
			action: forward, reason: reasonRangeStream},

		{name: "large read while etcd refuses the proxy the keyspace", req: wide,
			setup: func(_ *testing.T, e *routeEnv) {
				e.follower.serving = false
				e.cfg.Gate = forwardingGate{}
			},
			action: forward, reason: reasonForwarding},
		{name: "token caller while etcd refuses the proxy the keyspace", req: key("a"), auth: true,
			setup:  func(_ *testing.T, e *routeEnv) { e.cfg.Gate = forwardingGate{} },
			action: forward, reason: reasonForwarding},

		// Forwarded or refused.
		{name: "small read while loading", req: key("a"),
			setup:  func(_ *testing.T, e *routeEnv) { e.follower.serving = false },
			action: forward, reason: reasonLoading},
		{name: "large read while loading", req: wide,
			setup:  func(_ *testing.T, e *routeEnv) { e.follower.serving = false },
			action: refuse, reason: reasonLoading, err: errLoading},
		{name: "fence timed out, fallback forward", req: key("a"),
			setup:  fenceReturns(context.DeadlineExceeded),
			action: forward, reason: reasonFreshTimeout},
		{name: "fence timed out, fallback fail", req: key("a"),
			setup:  failUnproven(context.DeadlineExceeded),
			action: refuse, reason: reasonFreshTimeout, err: errNotFresh},
		{name: "fence failed, fallback forward", req: key("a"),
			setup:  fenceReturns(errUnreachable),
			action: forward, reason: reasonFreshError},
		{name: "fence failed, fallback fail", req: key("a"),
			setup:  failUnproven(errUnreachable),
			action: refuse, reason: reasonFreshError, err: errNotFresh},
		{name: "store lagged past the fence's patience", req: key("a"),
			setup:  fenceReturns(progress.ErrLagging),
			action: forward, reason: reasonFreshLagging},

		// Refused.
		{name: "fence: etcd compacted the revision", req: &pb.RangeRequest{Key: []byte("a"), Revision: 3},
			setup:  fenceReturns(progress.ErrCompacted),
			action: refuse, reason: reasonCompacted, err: rpctypes.ErrGRPCCompacted},
		{name: "store compacted the revision", req: serializable("a", 11),
			setup:  func(_ *testing.T, e *routeEnv) { e.store.Compact(12) },
			action: refuse, reason: reasonCompacted, err: rpctypes.ErrGRPCCompacted},
		{name: "fence: future revision", req: &pb.RangeRequest{Key: []byte("a"), Revision: 1000},
			setup:  fenceReturns(progress.ErrFutureRev),
			action: refuse, reason: reasonFuture, err: rpctypes.ErrGRPCFutureRev},
		{name: "forwarded read with no slot free in time", via: viaRange, req: serializable("a", 0), auth: true,
			setup: func(_ *testing.T, e *routeEnv) { e.cfg.MaxForwardedReads = 1 },
			// The one slot is taken for the whole request.
			prepare: func(s *Server) { s.forwards <- struct{}{}; s.queueWait = 20 * time.Millisecond },
			action:  refuse, reason: reasonOverload, err: errOverload},
		{name: "forwarded read with no slot free by its deadline", via: viaRange, req: serializable("a", 0), auth: true,
			setup:   func(_ *testing.T, e *routeEnv) { e.cfg.MaxForwardedReads = 1 },
			prepare: func(s *Server) { s.forwards <- struct{}{} },
			timeout: 20 * time.Millisecond,
			action:  refuse, reason: reasonOverload, err: errDeadline},
		{name: "cached read with no room in time", via: viaRange, req: serializable("a", 0),
			setup:   func(_ *testing.T, e *routeEnv) { e.cfg.MaxCachedReadBytes = 100 },
			prepare: func(s *Server) { holdBudget(s, 100); s.queueWait = 20 * time.Millisecond },
			action:  refuse, reason: reasonMemory, err: errMemory},
		{name: "cached read with no room by its deadline", via: viaRange, req: serializable("a", 0),
			setup:   func(_ *testing.T, e *routeEnv) { e.cfg.MaxCachedReadBytes = 100 },
			prepare: func(s *Server) { holdBudget(s, 100) },
			timeout: 20 * time.Millisecond,
			action:  refuse, reason: reasonMemory, err: errDeadline},
		{name: "cached RangeStream with no room by its deadline", via: viaRangeStream, req: &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Serializable: true},
			setup:   func(_ *testing.T, e *routeEnv) { e.cfg.MaxCachedReadBytes = 100 },
			prepare: func(s *Server) { holdBudget(s, 100) },
			timeout: 20 * time.Millisecond,
			action:  refuse, reason: reasonMemory, err: errDeadline},
	}
}

// staleMirrorGate is the gate while its mirror of etcd's auth state is
// too old to judge any caller.
type staleMirrorGate struct{}

func (staleMirrorGate) Forwarding() bool { return false }
func (staleMirrorGate) AuthorizeRead(context.Context, []byte, []byte, bool) error {
	return gate.ErrMirrorStale
}

// errDeadline is etcd's answer to a request whose deadline passed.
var errDeadline = status.FromContextError(context.DeadlineExceeded).Err()

// holdBudget takes n bytes of the server's cached read budget, for good.
func holdBudget(s *Server, n int64) {
	if _, err := s.budget.acquire(context.Background(), n); err != nil {
		panic(err)
	}
}

func (tc routeCase) server(t *testing.T) (*routeEnv, *Server) {
	t.Helper()
	e := newRouteEnv(t)
	if tc.setup != nil {
		tc.setup(t, e)
	}
	s := New(e.cfg)
	if tc.prepare != nil {
		tc.prepare(s)
	}
	return e, s
}

func (tc routeCase) context(t *testing.T) context.Context {
	ctx := t.Context()
	if tc.auth {
		ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(rpctypes.TokenFieldNameGRPC, "token"))
	}
	if tc.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, tc.timeout)
		t.Cleanup(cancel)
	}
	return ctx
}

// TestRoute: one row per reason (and per action a reason can take); each
// asserts the action, the reason and, for refusals, the exact error. Rows
// that only Range or RangeStream decide are run through them and read back
// from the metrics.
func TestRoute(t *testing.T) {
	for _, tc := range routeCases() {
		t.Run(tc.name, func(t *testing.T) {
			if tc.via != viaRoute {
				got := tc.runEntry(t)
				if got.action != tc.action || got.reason != tc.reason || !errors.Is(got.err, tc.err) {
					t.Fatalf("got %v/%s/%v, want %v/%s/%v", got.action, got.reason, got.err, tc.action, tc.reason, tc.err)
				}
				return
			}
			_, s := tc.server(t)
			rt := s.route(tc.context(t), tc.req, s.rules())
			if rt.action != tc.action || rt.reason != tc.reason {
				t.Fatalf("route = %v/%s (err %v), want %v/%s", rt.action, rt.reason, rt.err, tc.action, tc.reason)
			}
			switch tc.action {
			case refuse:
				if !errors.Is(rt.err, tc.err) || rt.err.Error() != tc.err.Error() {
					t.Fatalf("refused with %v, want %v", rt.err, tc.err)
				}
			case serveFromCache:
				if rt.err != nil || rt.view.Rev != tc.viewRev {
					t.Fatalf("served view of revision %d (err %v), want %d", rt.view.Rev, rt.err, tc.viewRev)
				}
			case forward:
				if rt.err != nil {
					t.Fatalf("forwarded with error %v", rt.err)
				}
			}
		})
	}
}

// TestFencePatience: a linearizable read that falls back to etcd gives
// the store fencePatience to catch up with etcd's head; one that fails
// instead (--consistent-read-fallback=fail) waits until its deadline, as
// giving up early would refuse it.
func TestFencePatience(t *testing.T) {
	for _, tc := range []struct {
		fallback ConsistentReadFallback
		want     time.Duration
	}{{FallbackForward, fencePatience}, {FallbackFail, 0}} {
		e := newRouteEnv(t)
		e.cfg.ConsistentReadFallback = tc.fallback
		s := New(e.cfg)
		if rt := s.route(t.Context(), &pb.RangeRequest{Key: []byte("a")}, s.rules()); rt.action != serveFromCache {
			t.Fatalf("fallback %v: route = %v/%s, want served", tc.fallback, rt.action, rt.reason)
		}
		if e.follower.patience != tc.want {
			t.Errorf("fallback %v: fence patience %v, want %v", tc.fallback, e.follower.patience, tc.want)
		}
	}
}

// outcome is what one request through Range or RangeStream came to, as the
// metrics counted it.
type outcome struct {
	action action
	reason reason
	err    error
}

// runEntry sends the row's request through Range (or RangeStream) on a
// fresh server and reads back where it went. It fails unless the request
// was counted exactly once, and unless etcd was asked exactly when the
// request was counted as forwarded.
func (tc routeCase) runEntry(t *testing.T) outcome {
	t.Helper()
	e, s := tc.server(t)
	ctx := tc.context(t)
	var err error
	var header *pb.ResponseHeader
	if tc.via == viaRangeStream {
		stream := &fakeRangeStreamServer{ctx: ctx}
		err = s.RangeStream(tc.req, stream)
		if len(stream.sent) > 0 {
			header = stream.sent[len(stream.sent)-1].RangeResponse.Header
		}
	} else {
		var resp *pb.RangeResponse
		resp, err = s.Range(ctx, tc.req)
		if resp != nil {
			header = resp.Header
		}
	}
	if n := seriesCount(t, e.reg); n != 1 {
		t.Fatalf("%d series counted, want exactly one:\n%s", n, dumpRanges(t, e.reg))
	}
	var got outcome
	found := false
	for _, src := range []struct {
		source
		action
	}{{sourceCache, serveFromCache}, {sourceForwarded, forward}, {sourceRejected, refuse}} {
		for _, why := range reasons {
			if v := counted(t, e.reg, src.source, why); v != 0 {
				if v != 1 || found {
					t.Fatalf("counted %v as %s/%s, want one count in all:\n%s", v, src.source, why, dumpRanges(t, e.reg))
				}
				got, found = outcome{action: src.action, reason: why, err: err}, true
			}
		}
	}
	if !found {
		t.Fatalf("request not counted:\n%s", dumpRanges(t, e.reg))
	}
	calls := e.upstream.calls()
	switch got.action {
	case forward:
		if calls != 1 || err != nil || header == nil || header.Revision != upstreamRev {
			t.Fatalf("forwarded: %d calls to etcd, err %v, header %v; want etcd's answer", calls, err, header)
		}
	case serveFromCache:
		if calls != 0 || err != nil || header == nil || header.Revision != e.store.Rev() || header.ClusterId != fakeClusterID {
			t.Fatalf("from the cache: %d calls to etcd, err %v, header %v; want the store's answer", calls, err, header)
		}
	case refuse:
		if calls != 0 || err == nil {
			t.Fatalf("refused: %d calls to etcd, err %v", calls, err)
		}
	}
	return got
}

// seriesCount is the number of source/reason series of the ranges counter.
// (prometheus/testutil would need github.com/kylelemons/godebug in go.mod,
// so the registry is read directly.)
func seriesCount(t *testing.T, reg *prometheus.Registry) int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		if mf.GetName() == "etcd_snapcache_range_requests_total" {
			n += len(mf.GetMetric())
		}
	}
	return n
}

// counted reads the ranges counter of one source and reason without
// creating the series.
func counted(t *testing.T, reg *prometheus.Registry, src source, why reason) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["source"] == string(src) && labels["reason"] == string(why) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func dumpRanges(t *testing.T, reg *prometheus.Registry) string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out string
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			out += m.String() + "\n"
		}
	}
	return out
}

// TestRouteCoversEveryReason: every reason of the ranges metric has a row
// in TestRoute.
func TestRouteCoversEveryReason(t *testing.T) {
	rows := map[reason]bool{}
	for _, tc := range routeCases() {
		rows[tc.reason] = true
	}
	for _, why := range reasons {
		if !rows[why] {
			t.Errorf("reason %q has no row in routeCases", why)
		}
	}
}

// TestRangeCountsEachRequestOnce: every row's request, through Range (or
// RangeStream), is counted exactly once, with the source of its action and
// its reason, and etcd is asked exactly when it is counted as forwarded.
func TestRangeCountsEachRequestOnce(t *testing.T) {
	for _, tc := range routeCases() {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.runEntry(t)
			if got.action != tc.action || got.reason != tc.reason {
				t.Fatalf("counted as %v/%s, want %v/%s", got.action, got.reason, tc.action, tc.reason)
			}
			if tc.action == refuse && (!errors.Is(got.err, tc.err) || got.err.Error() != tc.err.Error()) {
				t.Fatalf("refused with %v, want %v", got.err, tc.err)
			}
		})
	}
}

// TestOverloadedForwardCountedOnceAsRejected: a read routed to etcd that
// finds no forwarding slot is counted once, as rejected/overload, and not
// also as forwarded; it never reaches etcd. Once the slot is free, the same
// read is counted as forwarded.
func TestOverloadedForwardCountedOnceAsRejected(t *testing.T) {
	e := newRouteEnv(t)
	e.cfg.MaxForwardedReads = 1
	s := New(e.cfg)
	s.forwards <- struct{}{} // the one slot is taken
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(rpctypes.TokenFieldNameGRPC, "token"))
	tctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()

	if _, err := s.Range(tctx, serializable("a", 0)); !errors.Is(err, errDeadline) {
		t.Fatalf("Range with no slot by its deadline: %v, want %v", err, errDeadline)
	}
	if n := seriesCount(t, e.reg); n != 1 {
		t.Fatalf("%d series after one overloaded read, want 1:\n%s", n, dumpRanges(t, e.reg))
	}
	if v := counted(t, e.reg, sourceRejected, reasonOverload); v != 1 {
		t.Fatalf("rejected/overload = %v, want 1", v)
	}
	if v := counted(t, e.reg, sourceForwarded, reasonAuth); v != 0 {
		t.Fatalf("forwarded/auth = %v after an overloaded read, want 0", v)
	}
	if c := e.upstream.calls(); c != 0 {
		t.Fatalf("etcd was asked %d times, want 0", c)
	}

	<-s.forwards // the slot is freed
	if _, err := s.Range(ctx, serializable("a", 0)); err != nil {
		t.Fatalf("Range with a free slot: %v", err)
	}
	if v := counted(t, e.reg, sourceForwarded, reasonAuth); v != 1 {
		t.Fatalf("forwarded/auth = %v, want 1", v)
	}
	if v := counted(t, e.reg, sourceRejected, reasonOverload); v != 1 {
		t.Fatalf("rejected/overload = %v, want still 1", v)
	}
	if n := seriesCount(t, e.reg); n != 2 {
		t.Fatalf("%d series after two reads, want 2:\n%s", n, dumpRanges(t, e.reg))
	}
	if len(s.forwards) != 0 {
		t.Fatalf("%d forwarding slots still taken after the read, want 0", len(s.forwards))
	}
}

// TestRangeNoLeaderRefusedBeforeValidation: etcd's unary and stream
// interceptors refuse a request that requires a leader while there is none
// (ErrGRPCNoLeader) before its handler validates the request, so an invalid
// request then gets ErrGRPCNoLeader, not the validation error.
func TestRangeNoLeaderRefusedBeforeValidation(t *testing.T) {
	e := newRouteEnv(t)
	e.follower.leaderLost = true
	s := New(e.cfg)
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(rpctypes.MetadataRequireLeaderKey, rpctypes.MetadataHasLeader))

	// A valid request: refused for the lost leader, as etcd.
	if _, err := s.Range(ctx, key("a")); !errors.Is(err, rpctypes.ErrGRPCNoLeader) {
		t.Fatalf("Range without a leader: %v, want %v", err, rpctypes.ErrGRPCNoLeader)
	}
	// An invalid one: etcd's interceptor answers before key.go validates.
	for _, r := range []*pb.RangeRequest{
		{}, // empty key
		{Key: []byte("a"), SortOrder: 99},
	} {
		if _, err := s.Range(ctx, r); !errors.Is(err, rpctypes.ErrGRPCNoLeader) {
			t.Errorf("Range(%v) without a leader: %v, want %v, as etcd's interceptor answers first", r, err, rpctypes.ErrGRPCNoLeader)
		}
		if err := s.RangeStream(r, &fakeRangeStreamServer{ctx: ctx}); !errors.Is(err, rpctypes.ErrGRPCNoLeader) {
			t.Errorf("RangeStream(%v) without a leader: %v, want %v, as etcd's interceptor answers first", r, err, rpctypes.ErrGRPCNoLeader)
		}
	}
	if c := e.upstream.calls(); c != 0 {
		t.Fatalf("etcd was asked %d times, want 0", c)
	}
}

// TestSerializableReadNeverBelowHeadSeen: a serializable read at the head
// is answered at a revision no lower than any etcd reported to the proxy (a
// write acknowledged through it): it waits for the store to get there, or
// goes to etcd. Etcd's own e2e tests read their writes this way.
func TestSerializableReadNeverBelowHeadSeen(t *testing.T) {
	e := newRouteEnv(t)
	e.follower.headSeen = 14 // acknowledged, not yet applied
	s := New(e.cfg)
	rt := s.route(context.Background(), &pb.RangeRequest{Key: []byte("a"), Serializable: true}, rulesFor("3.7.3"))
	if rt.action != forward || rt.reason != reasonAhead {
		t.Fatalf("store at 13, etcd acknowledged 14: %v %s, want forwarded (ahead)", rt.action, rt.reason)
	}
	applyPut(t, e.store, 14, "a", 5)
	rt = s.route(context.Background(), &pb.RangeRequest{Key: []byte("a"), Serializable: true}, rulesFor("3.7.3"))
	if rt.action != serveFromCache || rt.view.StoreRev != 14 {
		t.Fatalf("store at 14: %v %s at %d, want served at 14", rt.action, rt.reason, rt.view.StoreRev)
	}
}

// decideCase is one row of TestDecide: a request, the state decide reads
// (servingState changed by st), and the decision.
type decideCase struct {
	name string
	req  *pb.RangeRequest
	st   func(st *routeState)
	want decision
}

// servingState is a store at revision 13 serving for etcd 3.7.3, nothing
// compacted, no revision reported above it, nothing learned yet.
func servingState() routeState {
	return routeState{serving: true, rules: rulesFor("3.7.3"), storeRev: 13}
}

// answered marks a step taken, with its answer.
func answered(err error) learned { return learned{done: true, err: err} }

func viewTaken(err error) func(*routeState) {
	return func(st *routeState) { st.view = answered(err) }
}

// fenced is the read fence answered with err, and the view, if taken,
// with viewErr.
func fenced(err error, view ...error) func(*routeState) {
	return func(st *routeState) {
		st.fence = answered(err)
		for _, v := range view {
			st.view = answered(v)
		}
	}
}

func stateWith(fs ...func(*routeState)) func(*routeState) {
	return func(st *routeState) {
		for _, f := range fs {
			f(st)
		}
	}
}

// decideCases cover every reason decide gives, each step it asks for,
// and the order in which its conditions are asked.
func decideCases() []decideCase {
	errUnreachable := errors.New("etcd unreachable")
	wide := &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")}
	keysOnly := &pb.RangeRequest{Key: []byte("a"), KeysOnly: true, Serializable: true}
	askEtcd := func(st *routeState) { st.auth = gate.ErrAskEtcd }
	denied := func(st *routeState) { st.auth = rpctypes.ErrGRPCPermissionDenied }
	mirrorStale := func(st *routeState) { st.auth = gate.ErrMirrorStale }
	forwarding := func(st *routeState) { st.forwarding = true }
	loading := func(st *routeState) { st.serving = false }
	inconsistent := func(st *routeState) { st.inconsistent = true }
	unknownRelease := func(st *routeState) { st.rules = rulesFor("") }
	failUnproven := func(st *routeState) { st.fallback = FallbackFail }
	headSeen := func(rev int64) func(*routeState) { return func(st *routeState) { st.headSeen = rev } }
	caughtUp := func(err error) func(*routeState) { return func(st *routeState) { st.caughtUp = answered(err) } }
	return []decideCase{
		// The permission check's answer comes first.
		{name: "caller only etcd can judge", req: key("a"), st: askEtcd,
			want: forwardFor(reasonAuth)},
		{name: "caller only etcd can judge, the cache off", req: key("a"), st: stateWith(askEtcd, forwarding),
			want: forwardFor(reasonForwarding)},
		{name: "auth mirror too old to judge the caller", req: wide, st: stateWith(mirrorStale, loading),
			want: forwardFor(reasonAuthStale)},
		{name: "caller refused", req: key("a"), st: denied,
			want: refuseFor(reasonAuth, rpctypes.ErrGRPCPermissionDenied)},
		{name: "caller refused, the cache off", req: key("a"), st: stateWith(denied, forwarding),
			want: refuseFor(reasonAuth, rpctypes.ErrGRPCPermissionDenied)},
		{name: "caller refused while loading", req: wide, st: stateWith(denied, loading),
			want: refuseFor(reasonAuth, rpctypes.ErrGRPCPermissionDenied)},

		// Then the state of the cache.
		{name: "cache off", req: wide, st: stateWith(forwarding, loading),
			want: forwardFor(reasonForwarding)},
		{name: "single key while loading", req: key("a"), st: stateWith(loading, inconsistent),
			want: forwardFor(reasonLoading)},
		{name: "small limit while loading", req: &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Limit: smallReadLimit}, st: loading,
			want: forwardFor(reasonLoading)},
		{name: "count while loading", req: &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), CountOnly: true}, st: loading,
			want: forwardFor(reasonLoading)},
		{name: "large limit while loading", req: &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Limit: smallReadLimit + 1}, st: loading,
			want: refuseFor(reasonLoading, errLoading)},
		{name: "range while loading", req: wide, st: loading,
			want: refuseFor(reasonLoading, errLoading)},
		{name: "store found inconsistent", req: key("a"), st: stateWith(inconsistent, unknownRelease),
			want: forwardFor(reasonInconsistent)},
		{name: "keys-only with the release unknown", req: keysOnly, st: unknownRelease,
			want: forwardFor(reasonVersionUnknown)},
		{name: "keys-only with the release known", req: keysOnly,
			want: decision{next: nextView, reason: reasonSerializable}},
		{name: "not keys-only with the release unknown", req: serializable("a", 0), st: unknownRelease,
			want: decision{next: nextView, reason: reasonSerializable}},

		// Linearizable: the read fence, then the view.
		{name: "linearizable: fence first", req: key("a"),
			want: decision{next: nextFence}},
		{name: "linearizable at a revision: fence at it", req: &pb.RangeRequest{Key: []byte("a"), Revision: 11},
			want: decision{next: nextFence, rev: 11}},
		{name: "linearizable, fenced: the view", req: key("a"), st: fenced(nil),
			want: decision{next: nextView, reason: reasonLinearizable}},
		{name: "linearizable at a revision, fenced: its view", req: &pb.RangeRequest{Key: []byte("a"), Revision: 11}, st: fenced(nil),
			want: decision{next: nextView, reason: reasonLinearizable, rev: 11}},
		{name: "linearizable, fenced, viewed", req: key("a"), st: fenced(nil, nil),
			want: decision{next: nextServe, reason: reasonLinearizable}},
		{name: "linearizable below the head seen: the fence alone decides", req: key("a"), st: stateWith(headSeen(20), fenced(nil)),
			want: decision{next: nextView, reason: reasonLinearizable}},
		{name: "fence timed out, fallback forward", req: key("a"), st: fenced(context.DeadlineExceeded),
			want: forwardFor(reasonFreshTimeout)},
		{name: "fence timed out, fallback fail", req: key("a"), st: stateWith(failUnproven, fenced(context.DeadlineExceeded)),
			want: refuseFor(reasonFreshTimeout, errNotFresh)},
		{name: "fence failed, fallback forward", req: key("a"), st: fenced(errUnreachable),
			want: forwardFor(reasonFreshError)},
		{name: "fence failed, fallback fail", req: key("a"), st: stateWith(failUnproven, fenced(errUnreachable)),
			want: refuseFor(reasonFreshError, errNotFresh)},
		{name: "store lagged past the fence's patience", req: key("a"), st: fenced(progress.ErrLagging),
			want: forwardFor(reasonFreshLagging)},
		{name: "fence: etcd compacted the revision", req: &pb.RangeRequest{Key: []byte("a"), Revision: 3}, st: fenced(progress.ErrCompacted),
			want: refuseFor(reasonCompacted, rpctypes.ErrGRPCCompacted)},
		{name: "fence: etcd compacted the revision, fallback fail", req: &pb.RangeRequest{Key: []byte("a"), Revision: 3}, st: stateWith(failUnproven, fenced(fmt.Errorf("fence: %w", progress.ErrCompacted))),
			want: refuseFor(reasonCompacted, rpctypes.ErrGRPCCompacted)},
		{name: "fence: future revision", req: &pb.RangeRequest{Key: []byte("a"), Revision: 1000}, st: fenced(progress.ErrFutureRev),
			want: refuseFor(reasonFuture, rpctypes.ErrGRPCFutureRev)},
		{name: "linearizable, view compacted since the fence", req: &pb.RangeRequest{Key: []byte("a"), Revision: 11}, st: fenced(nil, revtree.ErrCompacted),
			want: refuseFor(reasonCompacted, rpctypes.ErrGRPCCompacted)},

		// Serializable at the head: once the store is at what etcd reported.
		{name: "serializable at the head", req: serializable("a", 0),
			want: decision{next: nextView, reason: reasonSerializable}},
		{name: "serializable at the head, viewed", req: serializable("a", 0), st: viewTaken(nil),
			want: decision{next: nextServe, reason: reasonSerializable}},
		{name: "serializable, etcd reported a later revision", req: serializable("a", 0), st: headSeen(14),
			want: decision{next: nextCatchUp, rev: 14}},
		{name: "serializable, the store knows a later compaction", req: serializable("a", 0), st: func(st *routeState) { st.compactRev = 15 },
			want: decision{next: nextCatchUp, rev: 15}},
		{name: "serializable, the store caught up", req: serializable("a", 0), st: stateWith(headSeen(14), caughtUp(nil)),
			want: decision{next: nextView, reason: reasonWaited}},
		{name: "serializable, the store caught up, viewed", req: serializable("a", 0), st: stateWith(headSeen(14), caughtUp(nil), viewTaken(nil)),
			want: decision{next: nextServe, reason: reasonWaited}},
		{name: "serializable, the store did not catch up", req: serializable("a", 0), st: stateWith(headSeen(14), caughtUp(context.DeadlineExceeded)),
			want: forwardFor(reasonAhead)},
		{name: "store not loaded", req: serializable("a", 0), st: viewTaken(revtree.ErrNotLoaded),
			want: forwardFor(reasonNotReady)},

		// Serializable at a revision.
		{name: "historical at a retained revision", req: serializable("a", 11),
			want: decision{next: nextView, reason: reasonHistorical, rev: 11}},
		{name: "historical, viewed", req: serializable("a", 11), st: viewTaken(nil),
			want: decision{next: nextServe, reason: reasonHistorical}},
		{name: "historical, etcd reported a later revision", req: serializable("a", 11), st: headSeen(14),
			want: decision{next: nextCatchUp, rev: 14}},
		{name: "historical, the store caught up", req: serializable("a", 11), st: stateWith(headSeen(14), caughtUp(nil)),
			want: decision{next: nextView, reason: reasonWaited, rev: 11}},
		{name: "ahead of the store", req: serializable("a", 14),
			want: decision{next: nextCatchUp, rev: 14}},
		{name: "ahead of the store, which caught up", req: serializable("a", 14), st: caughtUp(nil),
			want: decision{next: nextView, reason: reasonWaited, rev: 14}},
		{name: "ahead of the store, which did not catch up", req: serializable("a", 20), st: caughtUp(context.DeadlineExceeded),
			want: forwardFor(reasonAhead)},
		{name: "older than the retained snapshots", req: serializable("a", 9), st: viewTaken(revtree.ErrNotRetained),
			want: forwardFor(reasonNotRetained)},
		{name: "store compacted the revision", req: serializable("a", 11), st: viewTaken(revtree.ErrCompacted),
			want: refuseFor(reasonCompacted, rpctypes.ErrGRPCCompacted)},
		{name: "future revision after a reload", req: serializable("a", 11), st: viewTaken(revtree.ErrFutureRev),
			want: forwardFor(reasonNotReady)},
	}
}

// TestDecide: decide's answer for each row's request and state: the
// action or step, its reason and revision, and for a refusal the exact
// error.
func TestDecide(t *testing.T) {
	for _, tc := range decideCases() {
		t.Run(tc.name, func(t *testing.T) {
			st := servingState()
			if tc.st != nil {
				tc.st(&st)
			}
			got := decide(tc.req, st)
			if got.next != tc.want.next || got.reason != tc.want.reason || got.rev != tc.want.rev {
				t.Fatalf("decide = next %d, %q at %d; want next %d, %q at %d", got.next, got.reason, got.rev, tc.want.next, tc.want.reason, tc.want.rev)
			}
			if !errors.Is(got.err, tc.want.err) || (got.err != nil && got.err.Error() != tc.want.err.Error()) {
				t.Fatalf("decide refused with %v, want %v", got.err, tc.want.err)
			}
		})
	}
}

// TestDecideCoversEveryReason: every reason of the ranges metric that
// route decides has a row in TestDecide. The others are decided after
// it: RangeStream's own routing, and admission (Range, RangeStream).
func TestDecideCoversEveryReason(t *testing.T) {
	decidedAfter := map[reason]bool{reasonRangeStream: true, reasonOverload: true, reasonMemory: true}
	rows := map[reason]bool{}
	for _, tc := range decideCases() {
		rows[tc.want.reason] = true
	}
	for _, why := range reasons {
		if !rows[why] && !decidedAfter[why] {
			t.Errorf("reason %q has no row in decideCases", why)
		}
	}
}

// TestDecideEnds: from every row's state, taking each step decide asks
// for (each answered without error) ends in an answer, and no step is
// asked for twice: route's loop ends.
func TestDecideEnds(t *testing.T) {
	for _, tc := range decideCases() {
		t.Run(tc.name, func(t *testing.T) {
			st := servingState()
			if tc.st != nil {
				tc.st(&st)
			}
			asked := map[next]bool{}
			for {
				d := decide(tc.req, st)
				if asked[d.next] {
					t.Fatalf("step %d asked for again", d.next)
				}
				asked[d.next] = true
				switch d.next {
				case nextForward, nextRefuse, nextServe:
					return
				case nextFence:
					st.fence = answered(nil)
				case nextCatchUp:
					st.caughtUp = answered(nil)
				case nextView:
					st.view = answered(nil)
				default:
					t.Fatalf("unknown step %d", d.next)
				}
			}
		})
	}
}

// TestFenceBeginsBeforeThePermissionCheck: route begins the read fence
// before the gate's check exactly when decide, the read allowed, would
// wait for it; a fence it did not begin then is begun once decide asks.
func TestFenceBeginsBeforeThePermissionCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  *pb.RangeRequest
		// setup changes the world before the server is made; during
		// changes it while the permission check runs.
		setup  func(e *routeEnv)
		during func(e *routeEnv)
		early  bool // begun before the check
		fences int  // begun in all
		action action
	}{
		{name: "linearizable", req: key("a"), early: true, fences: 1, action: serveFromCache},
		{name: "serializable", req: serializable("a", 0), action: serveFromCache},
		{name: "linearizable while loading", req: key("a"), action: forward,
			setup: func(e *routeEnv) { e.follower.serving = false }},
		{name: "linearizable, store inconsistent", req: key("a"), action: forward,
			setup: func(e *routeEnv) { e.cfg.Inconsistent = func() bool { return true } }},
		{name: "linearizable keys-only, release unknown", req: &pb.RangeRequest{Key: []byte("a"), KeysOnly: true}, action: forward,
			setup: func(e *routeEnv) { e.follower.version = "" }},
		{name: "linearizable, loaded during the check", req: key("a"), fences: 1, action: serveFromCache,
			setup:  func(e *routeEnv) { e.follower.serving = false },
			during: func(e *routeEnv) { e.follower.serving = true }},
		{name: "linearizable, reloading after the check began", req: key("a"), early: true, fences: 1, action: forward,
			during: func(e *routeEnv) { e.follower.serving = false }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newRouteEnv(t)
			if tc.setup != nil {
				tc.setup(e)
			}
			g := &recordingGate{follower: e.follower}
			if tc.during != nil {
				g.during = func() { tc.during(e) }
			}
			e.cfg.Gate = g
			s := New(e.cfg)
			rt := s.route(t.Context(), tc.req, s.rules())
			if g.calls != 1 {
				t.Fatalf("%d permission checks, want 1", g.calls)
			}
			if g.begunBefore != tc.early {
				t.Fatalf("fence begun before the permission check: %v, want %v", g.begunBefore, tc.early)
			}
			if e.follower.begun != tc.fences {
				t.Fatalf("%d fences begun, want %d", e.follower.begun, tc.fences)
			}
			if rt.action != tc.action {
				t.Fatalf("route = %v/%s, want %v", rt.action, rt.reason, tc.action)
			}
		})
	}
}

// recordingGate allows every read, and records whether a fence was begun
// before its check; during, if set, runs in the check.
type recordingGate struct {
	gate.Unchecked
	follower    *fakeFollower
	during      func()
	calls       int
	begunBefore bool
}

func (g *recordingGate) AuthorizeRead(context.Context, []byte, []byte, bool) error {
	g.calls++
	g.begunBefore = g.follower.begun > 0
	if g.during != nil {
		g.during()
	}
	return nil
}
