package server

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/internal/backoff"
	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
	"github.com/etcd-snapcache/etcd-snapcache/internal/streamrelay"
	"github.com/etcd-snapcache/etcd-snapcache/internal/tracing"
)

// keepAliveBuffer bounds the responses queued for one client stream. A
// client sends a keepalive every TTL/3 and reads each answer, so a full
// buffer means a client that stopped reading; its stream is ended rather
// than letting it hold the shared upstream stream.
const keepAliveBuffer = 64

var errKeepAliveBacklog = status.Error(codes.ResourceExhausted, "etcd-snapcache: lease keepalive responses not read")

// leaseServer forwards the Lease service. Unary calls are relayed as they
// are. KeepAlive streams are multiplexed onto one upstream stream per
// identity by keepAlives coalescers: the anonymous callers' (ka) and, for
// certificate callers, whose every request the gate checked, the proxy's
// (asProxyKA). A token caller's stream is relayed to etcd, which checks
// each keepalive under that token; so is a stream in a sampled trace.
type leaseServer struct {
	pb.UnsafeLeaseServer
	upstream  pb.LeaseClient
	ka        *keepAlives
	asProxyKA *keepAlives
	callerOf  func(ctx context.Context) gate.Caller
}

var _ pb.LeaseServer = (*leaseServer)(nil)

func (l *leaseServer) LeaseGrant(ctx context.Context, r *pb.LeaseGrantRequest) (*pb.LeaseGrantResponse, error) {
	return l.upstream.LeaseGrant(ctx, r)
}

func (l *leaseServer) LeaseRevoke(ctx context.Context, r *pb.LeaseRevokeRequest) (*pb.LeaseRevokeResponse, error) {
	return l.upstream.LeaseRevoke(ctx, r)
}

func (l *leaseServer) LeaseTimeToLive(ctx context.Context, r *pb.LeaseTimeToLiveRequest) (*pb.LeaseTimeToLiveResponse, error) {
	return l.upstream.LeaseTimeToLive(ctx, r)
}

func (l *leaseServer) LeaseLeases(ctx context.Context, r *pb.LeaseLeasesRequest) (*pb.LeaseLeasesResponse, error) {
	return l.upstream.LeaseLeases(ctx, r)
}

// LeaseKeepAlive answers each request of the client stream with the
// response to an upstream keepalive of that lease sent after the request
// arrived, so the lease's new deadline is never earlier than etcd would give.
func (l *leaseServer) LeaseKeepAlive(stream pb.Lease_LeaseKeepAliveServer) error {
	ctx := stream.Context()
	ka := l.ka
	kind := l.callerOf(ctx).Kind
	switch {
	case kind == gate.TokenCaller:
		return l.relayKeepAlive(ctx, stream)
	case tracing.CallerSampled(ctx):
		// A stream in a sampled trace goes to etcd whole, with its trace
		// context, so that etcd's spans of it join the caller's trace as
		// they do directly: a shared stream has no one caller's context.
		// Few are (kube-apiserver keeps one per process).
		if kind == gate.CertCaller {
			ctx = gate.AsProxy(ctx)
		}
		return l.relayKeepAlive(ctx, stream)
	case kind == gate.CertCaller:
		ka = l.asProxyKA
	}
	w := newKeepAliveWaiter(ctx.Done())
	errc := make(chan error, 1)
	// The receive goroutine is owned by the client stream: it ends when
	// Recv fails, which gRPC makes happen once this handler returns.
	go func() {
		for {
			req, err := stream.Recv()
			if err != nil {
				errc <- err
				return
			}
			ka.request(req.ID, w)
		}
	}()
	halfClosed := false
	for {
		if halfClosed && w.outstanding.Load() == 0 && len(w.respc) == 0 {
			return nil // half-closed and every request answered, as etcd ends it
		}
		select {
		case resp := <-w.respc:
			if err := stream.Send(resp); err != nil {
				return err
			}
		case err := <-errc:
			if !errors.Is(err, io.EOF) {
				return err
			}
			halfClosed = true
		case <-w.overflow:
			return errKeepAliveBacklog
		case err := <-w.failed:
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// relayKeepAlive relays a client's keepalive stream to etcd as a stream of
// its own, under ctx.
func (l *leaseServer) relayKeepAlive(ctx context.Context, stream pb.Lease_LeaseKeepAliveServer) error {
	up, err := l.upstream.LeaseKeepAlive(ctx)
	if err != nil {
		return err
	}
	return streamrelay.Relay[pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse](up, stream)
}

// keepAliveWaiter is one client stream waiting for keepalive responses.
// deliver is called by the upstream stream's receiver; the client stream's
// handler reads respc and overflow.
type keepAliveWaiter struct {
	respc       chan *pb.LeaseKeepAliveResponse // buffered keepAliveBuffer
	done        <-chan struct{}                 // the client stream's context
	outstanding atomic.Int64                    // requests not yet answered
	overflow    chan struct{}                   // closed once respc was full: the client stopped reading
	overOnce    sync.Once
	failed      chan error // buffered 1: etcd refused the keepalives of this caller's identity
}

func newKeepAliveWaiter(done <-chan struct{}) *keepAliveWaiter {
	return &keepAliveWaiter{
		respc:    make(chan *pb.LeaseKeepAliveResponse, keepAliveBuffer),
		done:     done,
		overflow: make(chan struct{}),
		failed:   make(chan error, 1),
	}
}

// fail ends the client stream with err, etcd's refusal.
func (w *keepAliveWaiter) fail(err error) {
	select {
	case w.failed <- err:
	default:
	}
}

func (w *keepAliveWaiter) deliver(resp *pb.LeaseKeepAliveResponse) {
	select {
	case w.respc <- resp:
	case <-w.done:
	default:
		w.overOnce.Do(func() { close(w.overflow) })
	}
	w.outstanding.Add(-1)
}

// keepAlives multiplexes the keepalives of every client onto one upstream
// LeaseKeepAlive stream, coalesced per lease under the rule stated in
// package coalesce's doc: a lease's inFlight waiters share the upstream
// request in flight, its next waiters the one after. It keeps a shape of
// its own, not a coalesce.Call: the requests of every lease share one
// stream, whose responses arrive keyed by lease, and a broken stream's
// requests are sent again on the next.
type keepAlives struct {
	ctx      context.Context // ends run and the upstream stream
	upstream pb.LeaseClient
	lg       *zap.Logger
	kick     chan struct{} // buffered 1: wakes the sender when queue grows

	mu sync.Mutex
	// Guarded by mu.
	leases map[int64]*leaseKeepAlive // leases with waiters or a request in flight
	queue  []int64                   // leases whose request is to be sent
}

// leaseKeepAlive is one lease's waiters; guarded by keepAlives.mu.
type leaseKeepAlive struct {
	inFlight []*keepAliveWaiter // covered by the request in flight
	next     []*keepAliveWaiter // arrived after it was sent
	sent     bool               // a request is queued or in flight
}

func newKeepAlives(ctx context.Context, upstream pb.LeaseClient, lg *zap.Logger) *keepAlives {
	return &keepAlives{ctx: ctx, upstream: upstream, lg: lg, leases: map[int64]*leaseKeepAlive{}, kick: make(chan struct{}, 1)}
}

// request queues a keepalive of lease id for w.
func (k *keepAlives) request(id int64, w *keepAliveWaiter) {
	w.outstanding.Add(1)
	k.mu.Lock()
	defer k.mu.Unlock()
	la := k.leases[id]
	if la == nil {
		la = &leaseKeepAlive{}
		k.leases[id] = la
	}
	la.next = append(la.next, w)
	if !la.sent {
		k.scheduleLocked(id, la)
	}
}

// scheduleLocked moves the lease's next waiters in flight and queues a send.
func (k *keepAlives) scheduleLocked(id int64, la *leaseKeepAlive) {
	la.inFlight, la.next = la.next, nil
	la.sent = true
	k.queue = append(k.queue, id)
	select {
	case k.kick <- struct{}{}:
	default:
	}
}

// Bounds of the pause before the upstream keepalive stream is reopened.
const (
	minReopenPause = 50 * time.Millisecond
	maxReopenPause = 2 * time.Second
)

// run owns the upstream stream: it opens it, sends queued requests,
// dispatches responses and reopens it after a failure, until ctx is done.
func (k *keepAlives) run() {
	bo := backoff.New(minReopenPause, maxReopenPause)
	for k.ctx.Err() == nil {
		err := k.serveStream()
		if k.ctx.Err() != nil {
			return
		}
		if k.failRefused(err) {
			bo.Reset()
			continue
		}
		k.lg.Warn("upstream lease keepalive stream broken; reopening", zap.Error(err))
		bo.Wait(k.ctx)
	}
}

func (k *keepAlives) serveStream() error {
	// The stream reopens elsewhere as soon as its connection drains,
	// rather than hold a stopping member for its request timeout.
	ctx, cancel := drain.Context(k.ctx)
	defer cancel()
	stream, err := k.upstream.LeaseKeepAlive(ctx)
	if err != nil {
		return err
	}
	// Requests in flight on a previous stream were lost with it: queue
	// every lease with waiters again.
	k.mu.Lock()
	k.queue = k.queue[:0]
	for id, la := range k.leases {
		la.next = append(la.inFlight, la.next...)
		la.inFlight, la.sent = nil, false
		if len(la.next) > 0 {
			k.scheduleLocked(id, la)
		}
	}
	k.mu.Unlock()

	recvErr := make(chan error, 1)
	go func() { // ends when the stream breaks or ctx is canceled
		for {
			resp, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			k.dispatch(resp)
		}
	}()
	defer func() {
		cancel()
		<-recvErr
	}()
	for {
		select {
		case <-k.kick:
			k.mu.Lock()
			ids := k.queue
			k.queue = nil
			k.mu.Unlock()
			for _, id := range ids {
				if err := stream.Send(&pb.LeaseKeepAliveRequest{ID: id}); err != nil {
					return err
				}
			}
		case err := <-recvErr:
			recvErr <- err // for the deferred wait
			return err
		case <-k.ctx.Done():
			return k.ctx.Err()
		}
	}
}

// failRefused ends every waiting client stream with err if it is etcd's
// refusal of the coalesced callers' identity (auth enabled for anonymous
// callers: "user name is empty"), as etcd ends each such caller's stream.
func (k *keepAlives) failRefused(err error) bool {
	switch e := rpctypes.Error(err); {
	case errors.Is(e, rpctypes.ErrUserEmpty), errors.Is(e, rpctypes.ErrPermissionDenied),
		errors.Is(e, rpctypes.ErrInvalidAuthToken), errors.Is(e, rpctypes.ErrAuthOldRevision):
	default:
		return false
	}
	k.mu.Lock()
	var waiters []*keepAliveWaiter
	for id, la := range k.leases {
		waiters = append(waiters, la.inFlight...)
		waiters = append(waiters, la.next...)
		delete(k.leases, id)
	}
	k.queue = k.queue[:0]
	k.mu.Unlock()
	for _, w := range waiters {
		w.fail(err)
	}
	return true
}

// dispatch answers the waiters of the request a response belongs to, and
// sends the next request if more waiters arrived meanwhile.
func (k *keepAlives) dispatch(resp *pb.LeaseKeepAliveResponse) {
	k.mu.Lock()
	la := k.leases[resp.ID]
	if la == nil || !la.sent {
		k.mu.Unlock()
		return
	}
	waiters := la.inFlight
	la.inFlight, la.sent = nil, false
	if len(la.next) > 0 {
		k.scheduleLocked(resp.ID, la)
	} else {
		delete(k.leases, resp.ID)
	}
	k.mu.Unlock()
	for _, w := range waiters {
		w.deliver(resp)
	}
}
