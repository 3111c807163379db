package watchproxy

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// fakeUpstream is etcd's Watch service as catch-ups and relays see it: the
// test takes each stream they open with next, reads what they send, and
// answers for etcd.
type fakeUpstream struct {
	streams chan *fakeUpstreamStream
}

func newFakeUpstream() *fakeUpstream {
	return &fakeUpstream{streams: make(chan *fakeUpstreamStream)}
}

// Watch waits until the test takes the stream (or ctx is done), as a
// connection that is not ready makes a WaitForReady call wait.
func (u *fakeUpstream) Watch(ctx context.Context, _ ...grpc.CallOption) (pb.Watch_WatchClient, error) {
	s := &fakeUpstreamStream{ctx: ctx, creates: make(chan *pb.WatchCreateRequest, 1), resps: make(chan upstreamResp)}
	select {
	case u.streams <- s:
		return s, nil
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// next returns the next stream opened upstream.
func (u *fakeUpstream) next(t *testing.T) *fakeUpstreamStream {
	t.Helper()
	select {
	case s := <-u.streams:
		return s
	case <-time.After(waitTimeout):
		t.Fatal("no watch stream opened upstream")
		return nil
	}
}

type upstreamResp struct {
	resp *pb.WatchResponse
	err  error
}

// fakeUpstreamStream is one upstream watch stream. Progress requests are
// accepted and dropped, as etcd drops them while a watcher is unsynced; the
// test answers with progress notifications when it chooses.
type fakeUpstreamStream struct {
	grpc.ClientStream
	ctx     context.Context
	creates chan *pb.WatchCreateRequest
	resps   chan upstreamResp
}

func (s *fakeUpstreamStream) Context() context.Context { return s.ctx }

func (s *fakeUpstreamStream) Send(r *pb.WatchRequest) error {
	if err := s.ctx.Err(); err != nil {
		return status.FromContextError(err).Err()
	}
	if cr := r.GetCreateRequest(); cr != nil {
		select {
		case s.creates <- cr:
		default: // a catch-up sends one create per stream
		}
	}
	return nil
}

func (s *fakeUpstreamStream) Recv() (*pb.WatchResponse, error) {
	select {
	case r := <-s.resps:
		return r.resp, r.err
	case <-s.ctx.Done():
		return nil, status.FromContextError(s.ctx.Err()).Err()
	}
}

// create returns the create request sent on the stream.
func (s *fakeUpstreamStream) create(t *testing.T) *pb.WatchCreateRequest {
	t.Helper()
	select {
	case cr := <-s.creates:
		return cr
	case <-time.After(waitTimeout):
		t.Fatal("no create request sent upstream")
		return nil
	}
}

// answer hands the proxy one response (or, with err, ends the stream), and
// returns once the proxy received it.
func (s *fakeUpstreamStream) answer(t *testing.T, resp *pb.WatchResponse, err error) {
	t.Helper()
	select {
	case s.resps <- upstreamResp{resp, err}:
	case <-time.After(waitTimeout):
		t.Fatalf("the proxy did not receive %v, %v from upstream", resp, err)
	}
}

// created answers the create with etcd's created response.
func (s *fakeUpstreamStream) created(t *testing.T, rev int64) {
	t.Helper()
	s.answer(t, &pb.WatchResponse{Header: &pb.ResponseHeader{Revision: rev}, Created: true}, nil)
}

// events sends etcd's events of the given revisions, at header revision rev.
func (s *fakeUpstreamStream) events(t *testing.T, rev int64, evs ...*mvccpb.Event) {
	t.Helper()
	s.answer(t, &pb.WatchResponse{Header: &pb.ResponseHeader{Revision: rev}, Events: evs}, nil)
}

// progress sends a progress notification at rev.
func (s *fakeUpstreamStream) progress(t *testing.T, rev int64) {
	t.Helper()
	s.answer(t, &pb.WatchResponse{Header: &pb.ResponseHeader{Revision: rev}, WatchId: -1}, nil)
}

// ended reports whether the proxy closed the stream.
func (s *fakeUpstreamStream) ended() bool { return s.ctx.Err() != nil }

// putEvent is a PUT of key at rev, as etcd sends it to a catch-up (with
// prev_kv, which the proxy drops for watchers without it).
func putEvent(key string, rev int64) *mvccpb.Event {
	return &mvccpb.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(key), Value: []byte("v"), CreateRevision: 1, ModRevision: rev, Version: rev},
		PrevKv: &mvccpb.KeyValue{Key: []byte(key), Value: []byte("v"), CreateRevision: 1, ModRevision: rev - 1, Version: rev - 1}}
}

// newWorldAt is newWorld with the store loaded at rev: its history starts
// at rev+1, and watchers from earlier revisions are caught up through up.
func newWorldAt(t *testing.T, rev int64, up pb.WatchClient, configure func(*Config)) *world {
	w := newWorld(t)
	w.store.Reset(rev, nil, 0)
	cfg := testConfig(w.store, w.follower)
	cfg.Upstream = up
	if configure != nil {
		configure(&cfg)
	}
	w.srv = New(cfg)
	return w
}

// heldStore is a store that also reads the events it still holds below its
// compaction revision (Store.EventsHeld), from the world's record of what was
// applied.
type heldStore struct {
	*revtree.Store
	w *world
}

func (h heldStore) EventsHeld(from, upTo int64, max int) ([]revtree.Batch, int64, error) {
	if !h.Loaded() {
		return nil, 0, revtree.ErrNotLoaded
	}
	if from < h.HistoryStart() {
		return nil, 0, revtree.ErrNotRetained
	}
	upTo = min(upTo, h.Rev())
	h.w.appliedMu.Lock()
	defer h.w.appliedMu.Unlock()
	var out []revtree.Batch
	for rev := from; rev <= upTo; rev++ {
		evs, ok := h.w.applied[rev]
		if !ok {
			continue
		}
		if max > 0 && len(out) == max {
			return out, out[len(out)-1].Rev, nil
		}
		out = append(out, revtree.Batch{Rev: rev, Events: evs})
	}
	return out, upTo, nil
}
