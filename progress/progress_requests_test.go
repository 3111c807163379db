package progress

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"
)

// sendCounter is the send side of an upstream watch stream: it counts the
// requests sent.
type sendCounter struct {
	grpc.ClientStream
	sent atomic.Int64
}

func (s *sendCounter) Send(*pb.WatchRequest) error { s.sent.Add(1); return nil }
func (s *sendCounter) Recv() (*pb.WatchResponse, error) {
	return nil, errors.New("not received by sendLoop")
}

// TestSendLoopEndsAStalledStream: a request left unanswered is sent again,
// and the loop ends with errWatchStalled once the stream has delivered
// nothing for watchStallTimeout while it waited; a stream that delivers
// responses meanwhile (events it catches up with) is not stalled.
func TestSendLoopEndsAStalledStream(t *testing.T) {
	p := newProgressRequests()
	stream := &sendCounter{}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ended := make(chan error, 1)
	go func() {
		ended <- p.sendLoop(ctx, stream, func() bool { return true }, func() {})
	}()
	p.request()

	// Responses arrive (not the answer) for twice the timeout: no stall.
	tick := time.NewTicker(watchStallTimeout / 20)
	defer tick.Stop()
	for range 40 {
		<-tick.C
		p.receivedResponse()
	}
	select {
	case err := <-ended:
		t.Fatalf("sendLoop ended while the stream delivered responses: %v", err)
	default:
	}

	// Then nothing: the loop ends, after re-sending the request.
	select {
	case err := <-ended:
		if !errors.Is(err, errWatchStalled) {
			t.Fatalf("sendLoop: %v, want errWatchStalled", err)
		}
	case <-time.After(10 * watchStallTimeout):
		t.Fatal("sendLoop did not end on a stalled stream")
	}
	if n := stream.sent.Load(); n < 2 {
		t.Errorf("%d requests sent, want the unanswered one sent again", n)
	}

	// An answered request leaves nothing to stall on.
	p2 := newProgressRequests()
	ctx2, cancel2 := context.WithCancel(t.Context())
	ended2 := make(chan error, 1)
	go func() { ended2 <- p2.sendLoop(ctx2, &sendCounter{}, func() bool { return true }, func() {}) }()
	gen := p2.request()
	for p2.answeredGeneration() < gen {
		p2.answer()
	}
	<-time.After(2 * watchStallTimeout)
	cancel2()
	if err := <-ended2; !errors.Is(err, context.Canceled) {
		t.Errorf("sendLoop with its request answered: %v, want context.Canceled", err)
	}
}
