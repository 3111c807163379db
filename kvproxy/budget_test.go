package kvproxy

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

func (b *byteBudget) queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.waiters.Len()
}

// acquireAsync acquires n bytes on a goroutine the test waits for; the
// result arrives on the channel.
func acquireAsync(t *testing.T, b *byteBudget, ctx context.Context, n int64) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, err := b.acquire(ctx, n)
		done <- err
	}()
	return done
}

// TestByteBudgetFirstComeFirstServed: a request that does not fit waits,
// and so does every later one, even one that would fit, so that a large
// request is not starved; released bytes admit them in order. A request
// larger than the whole budget is admitted alone. A waiter whose context
// ends leaves the queue and lets the next one in.
func TestByteBudgetFirstComeFirstServed(t *testing.T) {
	var reported []int64
	b := newByteBudget(100, func(used int64) { reported = append(reported, used) })
	if _, err := b.acquire(t.Context(), 60); err != nil {
		t.Fatal(err)
	}
	large := acquireAsync(t, b, t.Context(), 1000) // clamped to 100: alone
	testsupport.WaitFor(t, 5*time.Second, "the large request to queue", func() bool { return b.queued() == 1 })
	if b.tryAcquire(10) {
		t.Fatal("a small request got in ahead of a waiting one")
	}
	small := acquireAsync(t, b, t.Context(), 10)
	testsupport.WaitFor(t, 5*time.Second, "the small request to queue", func() bool { return b.queued() == 2 })

	b.release(60)
	if err := <-large; err != nil {
		t.Fatal(err)
	}
	if b.inUse() != 100 || b.queued() != 1 {
		t.Fatalf("after the large request got in: %d bytes held, %d waiting; want 100 and 1", b.inUse(), b.queued())
	}
	b.release(100)
	if err := <-small; err != nil {
		t.Fatal(err)
	}

	// A waiter that gives up lets the one behind it in.
	ctx, cancel := context.WithCancel(t.Context())
	first := acquireAsync(t, b, ctx, 95)
	testsupport.WaitFor(t, 5*time.Second, "the first waiter", func() bool { return b.queued() == 1 })
	second := acquireAsync(t, b, t.Context(), 50)
	testsupport.WaitFor(t, 5*time.Second, "the second waiter", func() bool { return b.queued() == 2 })
	cancel()
	if err := <-first; !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled waiter: %v", err)
	}
	if err := <-second; err != nil {
		t.Fatal(err)
	}
	if b.inUse() != 60 || b.queued() != 0 {
		t.Fatalf("%d bytes held, %d waiting; want 60 and 0", b.inUse(), b.queued())
	}
	if last := reported[len(reported)-1]; last != 60 {
		t.Fatalf("last reported %d bytes, want 60", last)
	}
}

// TestByteBudgetResize: a holding shrinks to the measured size at once,
// grows if room is free, and otherwise waits only after giving back what
// it held, so two growing requests never wait for each other.
func TestByteBudgetResize(t *testing.T) {
	b := newByteBudget(100, nil)
	held, _ := b.acquire(t.Context(), 50)
	if held, _ = b.resize(t.Context(), held, 20); held != 20 || b.inUse() != 20 {
		t.Fatalf("shrunk to %d, %d in use; want 20", held, b.inUse())
	}
	if held, _ = b.resize(t.Context(), held, 70); held != 70 || b.inUse() != 70 {
		t.Fatalf("grown to %d, %d in use; want 70", held, b.inUse())
	}
	other, _ := b.acquire(t.Context(), 30)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if _, err := b.resize(ctx, held, 80); !errors.Is(err, context.DeadlineExceeded) || b.inUse() != other {
		t.Fatalf("growing past the budget: %v, %d in use; want a timeout holding nothing (%d in use)", err, b.inUse(), other)
	}
}

// TestEstimate: a single key counts one key-value, a small limit its
// limit, and a larger or unlimited range its keys, counted; count-only
// none.
func TestEstimate(t *testing.T) {
	e := newRouteEnv(t)
	view, err := e.store.View(0)
	if err != nil {
		t.Fatal(err)
	}
	b := newByteBudget(1<<20, nil)
	kv := b.avgKV.Load()
	for _, tc := range []struct {
		r    *pb.RangeRequest
		want int64
	}{
		{key("a"), headerBytes + kv},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), CountOnly: true}, headerBytes},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Limit: 2}, headerBytes + 2*kv},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")}, headerBytes + 3*kv},
		{&pb.RangeRequest{Key: []byte("b"), RangeEnd: []byte("z"), Limit: countWalkLimit + 1}, headerBytes + 2*kv},
	} {
		if got := b.estimate(view, tc.r, revtree.RangeOptions{}); got != tc.want {
			t.Errorf("estimate(%v) = %d, want %d", tc.r, got, tc.want)
		}
	}
	// Measuring teaches it the size of a key-value.
	resp := view.Range(&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")}, revtree.RangeOptions{})
	for range 20 {
		b.learn(int64(proto.Size(resp)), len(resp.Kvs))
	}
	if got := b.avgKV.Load(); got >= kv/4 {
		t.Fatalf("average key-value %d bytes after measuring small ones, was %d", got, kv)
	}
}

// TestCachedReadHoldsBytesUntilTheCallEnds: a Range answered from the
// cache holds its bytes until its call ends (gRPC has then encoded and
// queued the response); meanwhile a read that does not fit waits for
// room, up to its deadline (DeadlineExceeded, as etcd), and gets in once
// the call ends. The bytes held are exported.
func TestCachedReadHoldsBytesUntilTheCallEnds(t *testing.T) {
	e := newRouteEnv(t)
	e.cfg.MaxCachedReadBytes = 200
	s := New(e.cfg)
	wide := &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Serializable: true}

	call, endCall := context.WithCancel(t.Context())
	resp, err := s.Range(call, wide)
	if err != nil || len(resp.Kvs) != 3 {
		t.Fatalf("first read: %v, %v", resp, err)
	}
	held := s.budget.inUse()
	if held == 0 || metricValue(t, e.reg, "etcd_snapcache_cached_read_bytes") != float64(held) {
		t.Fatalf("%d bytes held during the call (gauge %v), want the response's", held, metricValue(t, e.reg, "etcd_snapcache_cached_read_bytes"))
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if _, err := s.Range(ctx, wide); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("second read while the first holds the bytes: %v, want DeadlineExceeded", err)
	}
	if v := counted(t, e.reg, sourceRejected, reasonMemory); v != 1 {
		t.Fatalf("rejected/memory = %v, want 1", v)
	}
	waiting := make(chan error, 1)
	go func() {
		_, err := s.Range(t.Context(), wide)
		waiting <- err
	}()
	testsupport.WaitFor(t, 5*time.Second, "the third read to wait", func() bool { return s.budget.queued() == 1 })
	endCall()
	if err := <-waiting; err != nil {
		t.Fatalf("third read after the first call ended: %v", err)
	}
}

// blockingStream is a RangeStream client that stops reading: its Send
// blocks until unblocked.
type blockingStream struct {
	fakeRangeStreamServer
	sending chan struct{} // buffered 1: receives when Send first blocks
	unblock chan struct{}
}

func (s *blockingStream) SendMsg(m any) error { return s.Send(asRangeStreamResponse(m)) }

func (s *blockingStream) Send(r *pb.RangeStreamResponse) error {
	select {
	case s.sending <- struct{}{}:
	default:
	}
	<-s.unblock
	return s.fakeRangeStreamServer.Send(r)
}

// TestRangeStreamChunkHoldsBytesWhileSent: each chunk of a RangeStream
// served from the cache holds its bytes while it is sent, so a client
// that stops reading holds them, and other reads wait.
func TestRangeStreamChunkHoldsBytesWhileSent(t *testing.T) {
	e := newRouteEnv(t)
	e.cfg.MaxCachedReadBytes = 100
	s := New(e.cfg)
	stream := &blockingStream{
		fakeRangeStreamServer: fakeRangeStreamServer{ctx: t.Context()},
		sending:               make(chan struct{}, 1),
		unblock:               make(chan struct{}),
	}
	done := make(chan error, 1)
	go func() {
		done <- s.RangeStream(&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Serializable: true}, stream)
	}()
	<-stream.sending
	if s.budget.inUse() == 0 {
		t.Fatal("no bytes held while a chunk is sent")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if _, err := s.Range(ctx, &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Serializable: true}); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("read while a chunk is sent: %v, want DeadlineExceeded", err)
	}
	close(stream.unblock)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := s.budget.inUse(); n != 0 {
		t.Fatalf("%d bytes held after the stream ended", n)
	}
}
