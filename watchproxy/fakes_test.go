package watchproxy

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/internal/broadcast"
	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// errCompactedReason is etcd's cancel reason for a negative start revision.
var errCompactedReason = rpctypes.ErrCompacted.Error()

// waitTimeout bounds every wait of the tests; it is only reached when a
// test fails.
const waitTimeout = 5 * time.Second

// Header fields the fake follower fills in.
const (
	fakeClusterID = 7
	fakeMemberID  = 8
	fakeRaftTerm  = 9
)

// fakeFollower is a Follower over a real store. The test applies revisions
// to the store and then calls notify, which closes the Changed channel, as
// the follower does after applying.
type fakeFollower struct {
	store *revtree.Store

	mu      sync.Mutex
	changed chan struct{}
	// waitFresh replaces WaitFresh when set; freshCalls counts the calls.
	waitFresh  func(ctx context.Context) (int64, error)
	freshCalls int
	epoch      uint64
	epochMoved chan struct{} // closed when epoch moves, and replaced, as the follower's
}

func newFakeFollower(store *revtree.Store) *fakeFollower {
	return &fakeFollower{store: store, changed: make(chan struct{}), epochMoved: make(chan struct{})}
}

func (f *fakeFollower) Serving() bool { return true }

func (f *fakeFollower) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

func (f *fakeFollower) notify() {
	f.mu.Lock()
	defer f.mu.Unlock()
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakeFollower) WaitFresh(ctx context.Context) (int64, error) {
	f.mu.Lock()
	f.freshCalls++
	fn := f.waitFresh
	f.mu.Unlock()
	if fn != nil {
		return fn(ctx)
	}
	return f.store.Rev(), nil
}

func (f *fakeFollower) freshCallCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.freshCalls
}

func (f *fakeFollower) FillHeader(h *pb.ResponseHeader) {
	h.ClusterId, h.MemberId, h.RaftTerm = fakeClusterID, fakeMemberID, fakeRaftTerm
}

func (f *fakeFollower) LeaderLost() (bool, <-chan struct{}) { return false, nil }

func (f *fakeFollower) PeriodicProgress() <-chan struct{} { return nil }

func (f *fakeFollower) Epoch() (uint64, <-chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.epoch, f.epochMoved
}

func (f *fakeFollower) CompactRevAtEpochChange() int64 { return 0 }

// fakeConsistency is a consistency checker whose checks fail on demand.
type fakeConsistency struct {
	fallback atomic.Bool
	failures atomic.Uint64
	failed   broadcast.Signal
}

func (c *fakeConsistency) Fallback() bool               { return c.fallback.Load() }
func (c *fakeConsistency) Failures() uint64             { return c.failures.Load() }
func (c *fakeConsistency) NextFailure() <-chan struct{} { return c.failed.Wait() }

// fail is a failed check, as hashcheck.Checker records one.
func (c *fakeConsistency) fail() {
	c.failures.Add(1)
	c.fallback.Store(true)
	c.failed.Notify()
}

// changeEpoch moves the epoch, as a restore of etcd does.
func (f *fakeFollower) changeEpoch() {
	f.mu.Lock()
	f.epoch++
	close(f.epochMoved)
	f.epochMoved = make(chan struct{})
	f.mu.Unlock()
}

// fakeStream is a client's watch stream: the test sends requests through
// reqs and reads responses from out. Send can be made to block until
// released, as a client that does not read.
type fakeStream struct {
	grpc.ServerStream
	ctx    context.Context
	cancel context.CancelFunc
	reqs   chan *pb.WatchRequest
	out    chan *pb.WatchResponse

	mu      sync.Mutex
	gate    chan struct{} // non-nil: Send waits for it to close
	blocked chan struct{} // closed when a Send first waits on gate
}

func newFakeStream() *fakeStream {
	ctx, cancel := context.WithCancel(context.Background())
	return &fakeStream{
		ctx:    ctx,
		cancel: cancel,
		reqs:   make(chan *pb.WatchRequest),
		out:    make(chan *pb.WatchResponse, 1024),
	}
}

func (s *fakeStream) Context() context.Context { return s.ctx }

// Recv returns the test's next request; it fails once the stream's context
// is done, as gRPC's Recv fails once the handler returned.
func (s *fakeStream) Recv() (*pb.WatchRequest, error) {
	select {
	case r := <-s.reqs:
		return r, nil
	case <-s.ctx.Done():
		return nil, status.FromContextError(s.ctx.Err()).Err()
	}
}

func (s *fakeStream) Send(r *pb.WatchResponse) error {
	s.mu.Lock()
	gate, blocked := s.gate, s.blocked
	if gate != nil && blocked != nil {
		close(blocked)
		s.blocked = nil
	}
	s.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-s.ctx.Done():
			return s.ctx.Err()
		}
	}
	// The response is handed over as is: the server must not change it
	// afterwards (the race detector would tell).
	select {
	case s.out <- r:
		return nil
	case <-s.ctx.Done():
		return s.ctx.Err()
	}
}

// SendMsg takes the pre-encoded responses of the event sends: the client
// gets them decoded, as gRPC's client decodes them. Their bytes must be
// proto.Marshal's, which the client cannot tell apart (TestEncodedResponses).
func (s *fakeStream) SendMsg(m any) error {
	switch m := m.(type) {
	case *pb.WatchResponse:
		return s.Send(m)
	case *wirecodec.Encoded:
		r := &pb.WatchResponse{}
		if err := proto.Unmarshal(m.Bytes(), r); err != nil {
			return fmt.Errorf("decoding a pre-encoded watch response: %w", err)
		}
		return s.Send(r)
	default:
		return fmt.Errorf("fakeStream: sending a %T", m)
	}
}

// block makes Send wait until release is called; blocked is closed when a
// Send first waits.
func (s *fakeStream) block() (blocked <-chan struct{}, release func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	gate, b := make(chan struct{}), make(chan struct{})
	s.gate, s.blocked = gate, b
	var once sync.Once
	return b, func() {
		once.Do(func() {
			s.mu.Lock()
			s.gate, s.blocked = nil, nil
			s.mu.Unlock()
			close(gate)
		})
	}
}

// waitClosed waits for ch to be closed.
func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitTimeout):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// send hands the stream one request.
func (s *fakeStream) send(t *testing.T, req *pb.WatchRequest) {
	t.Helper()
	select {
	case s.reqs <- req:
	case <-time.After(waitTimeout):
		t.Fatalf("request %v not received by the server", req)
	}
}

// next returns the next response sent on the stream.
func (s *fakeStream) next(t *testing.T) *pb.WatchResponse {
	t.Helper()
	select {
	case r := <-s.out:
		return r
	case <-time.After(waitTimeout):
		t.Fatal("no response from the server")
		return nil
	}
}

// barrier sends a request the server refuses at once without registering
// anything (a negative start revision), and returns every response sent
// before its answer. The send loop handles requests in order, so whatever
// the requests before it caused, in the loop iterations before it, was sent
// first.
func (s *fakeStream) barrier(t *testing.T) []*pb.WatchResponse {
	t.Helper()
	s.send(t, createReq(&pb.WatchCreateRequest{Key: []byte("barrier"), StartRevision: -1}))
	var before []*pb.WatchResponse
	for {
		r := s.next(t)
		if r.Created && r.Canceled && r.WatchId == -1 && r.CancelReason == errCompactedReason {
			return before
		}
		before = append(before, r)
	}
}

// world is a real store, a fake follower over it and a Server, with a model
// of the keyspace to build events from.
type world struct {
	t        *testing.T
	store    *revtree.Store
	follower *fakeFollower
	srv      *Server
	live     map[string]*mvccpb.KeyValue
	// applied holds the events of every applied revision, with PrevKv
	// from the model. It is written before the store applies the revision
	// (a heldStore reads it from send loops), under appliedMu.
	appliedMu sync.Mutex
	applied   map[int64][]*mvccpb.Event
}

// newWorld loads the store empty at revision 1: its history starts at 2.
// testConfig is the Config of a test's server: etcd's progress interval
// followed, as the proxy's default, and no auth.
func testConfig(store Store, f Follower) Config {
	return Config{
		Store:                  store,
		Follower:               f,
		ProgressNotifyInterval: DefaultProgressNotifyInterval,
		FollowEtcdProgress:     true,
		Gate:                   gate.Unchecked{},
	}
}

func newWorld(t *testing.T) *world {
	store := revtree.New(0)
	store.Reset(1, nil, 0)
	f := newFakeFollower(store)
	w := &world{
		t:        t,
		store:    store,
		follower: f,
		srv:      New(testConfig(store, f)),
		live:     map[string]*mvccpb.KeyValue{},
		applied:  map[int64][]*mvccpb.Event{},
	}
	// The server a test ends with (some replace it) stops its notifier.
	t.Cleanup(func() { w.srv.Close() })
	return w
}

// op is one write of a revision: a put when del is false.
type op struct {
	key, value string
	del        bool
}

func put(key, value string) op { return op{key: key, value: value} }
func del(key string) op        { return op{key: key, del: true} }

// applySilently applies one revision to the store without telling the
// follower's waiters, and returns it.
func (w *world) applySilently(ops ...op) int64 {
	w.t.Helper()
	rev := w.store.Rev() + 1
	var evs, want []*mvccpb.Event
	for _, o := range ops {
		prev := w.live[o.key]
		var ev *mvccpb.Event
		if o.del {
			ev = &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(o.key), ModRevision: rev}}
			delete(w.live, o.key)
		} else {
			kv := &mvccpb.KeyValue{Key: []byte(o.key), Value: []byte(o.value), ModRevision: rev, CreateRevision: rev, Version: 1}
			if prev != nil {
				kv.CreateRevision, kv.Version = prev.CreateRevision, prev.Version+1
			}
			ev = &mvccpb.Event{Type: mvccpb.PUT, Kv: kv}
			w.live[o.key] = kv
		}
		evs = append(evs, ev)
		want = append(want, &mvccpb.Event{Type: ev.Type, Kv: proto.Clone(ev.Kv).(*mvccpb.KeyValue), PrevKv: clonePtr(prev)})
	}
	w.appliedMu.Lock()
	w.applied[rev] = want
	w.appliedMu.Unlock()
	if _, err := w.store.Apply(rev, evs); err != nil {
		w.t.Fatalf("apply %d: %v", rev, err)
	}
	return rev
}

func clonePtr(kv *mvccpb.KeyValue) *mvccpb.KeyValue {
	if kv == nil {
		return nil
	}
	return proto.Clone(kv).(*mvccpb.KeyValue)
}

// apply applies one revision and wakes the streams, as the follower does.
func (w *world) apply(ops ...op) int64 {
	w.t.Helper()
	rev := w.applySilently(ops...)
	w.follower.notify()
	return rev
}

// watch runs srv.Watch on a new fake stream. At the end of the test it
// cancels the stream and waits for Watch to return.
func (w *world) watch() *fakeStream {
	w.t.Helper()
	fs := newFakeStream()
	done := make(chan error, 1)
	go func() { done <- w.srv.Watch(fs) }()
	w.t.Cleanup(func() {
		fs.cancel()
		select {
		case <-done:
		case <-time.After(waitTimeout):
			w.t.Error("Watch did not return after its stream was canceled")
		}
	})
	return fs
}

func createReq(cr *pb.WatchCreateRequest) *pb.WatchRequest {
	return &pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: cr}}
}

func cancelReq(id int64) *pb.WatchRequest {
	return &pb.WatchRequest{RequestUnion: &pb.WatchRequest_CancelRequest{CancelRequest: &pb.WatchCancelRequest{WatchId: id}}}
}

func progressReq() *pb.WatchRequest {
	return &pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}}
}

// isProgress reports whether r is a requested progress notification.
func isProgress(r *pb.WatchResponse) bool {
	return r.WatchId == -1 && !r.Created && !r.Canceled && len(r.Events) == 0
}

// create sends a create request and returns its answer, which must be the
// next response.
func (s *fakeStream) create(t *testing.T, cr *pb.WatchCreateRequest) *pb.WatchResponse {
	t.Helper()
	s.send(t, createReq(cr))
	r := s.next(t)
	if !r.Created {
		t.Fatalf("answer to create %v: %v, want a created response", cr, r)
	}
	return r
}

// eventsOf reads responses until watcher id has been sent the events of
// revision upTo, and returns its events in the order sent, failing on any
// response of another kind for it.
func (s *fakeStream) eventsOf(t *testing.T, id, upTo int64) []*mvccpb.Event {
	t.Helper()
	var evs []*mvccpb.Event
	for {
		r := s.next(t)
		if r.WatchId != id || r.Created || r.Canceled || len(r.Events) == 0 {
			t.Fatalf("waiting for events of watch %d up to %d: got %v", id, upTo, r)
		}
		checkHeader(t, r, r.Events[len(r.Events)-1].Kv.ModRevision)
		evs = append(evs, r.Events...)
		if evs[len(evs)-1].Kv.ModRevision >= upTo {
			return evs
		}
	}
}

// checkHeader checks the member fields of a header and that its revision
// is at least min.
func checkHeader(t *testing.T, r *pb.WatchResponse, min int64) {
	t.Helper()
	h := r.Header
	if h == nil || h.ClusterId != fakeClusterID || h.MemberId != fakeMemberID || h.RaftTerm != fakeRaftTerm {
		t.Fatalf("response %v: header without the follower's member fields", r)
	}
	if h.Revision < min {
		t.Fatalf("response %v: header revision %d below %d", r, h.Revision, min)
	}
}

func revs(evs []*mvccpb.Event) []int64 {
	out := make([]int64, len(evs))
	for i, ev := range evs {
		out[i] = ev.Kv.ModRevision
	}
	return out
}

// controlWaitFresh makes WaitFresh announce each call on called and return
// the revision the test sends on fresh.
func (f *fakeFollower) controlWaitFresh() (called <-chan struct{}, fresh chan<- int64) {
	calls := make(chan struct{}, 8)
	revs := make(chan int64)
	f.waitFresh = func(ctx context.Context) (int64, error) {
		calls <- struct{}{}
		select {
		case rev := <-revs:
			return rev, nil
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return calls, revs
}
