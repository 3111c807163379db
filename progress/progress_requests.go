package progress

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// progressResend is how long a RequestProgress may go unanswered before it
// is sent again: etcd drops, rather than defers, a request that arrives
// while the watcher is catching up. kube-apiserver re-sends at this pace.
const progressResend = 100 * time.Millisecond

// watchStallTimeout is how long the upstream watch may deliver nothing at
// all while a RequestProgress is unanswered before the stream counts as
// stalled and is moved to another member. A member answers a request at
// once when its watcher is synced, and while it is not it sends the events
// it catches up with: a stream silent that long while a reader waits is on
// a member that hangs (a stopped process, a stalled disk or path), which
// drain's probe would find only after ProbeInterval+ProbeTimeout.
const watchStallTimeout = time.Second

// errWatchStalled ends an upstream watch whose member fell behind: it
// delivered nothing for watchStallTimeout while a progress request waited,
// or had not applied for as long a revision a quorum read reported.
var errWatchStalled = errors.New("the upstream watch's member fell behind")

// progressRequests coalesces RequestProgress calls on the upstream watch
// under the rule stated in package coalesce's doc. It keeps a shape of its
// own, not a coalesce.Call: the request is sent, and sent again, by the
// watch stream's sender, and its answer arrives on the watch, not as a
// call's return.
//
// Requests are numbered by generation: a waiter counts only the answer to
// a generation above the one sent when it arrived. etcd's answers carry no
// request id, so an answer is taken to answer the latest request sent. If
// it was really an older one's, the waiter may give up early;
// WaitRevision's callers then ask etcd, which is always correct, so only
// latency is lost.
type progressRequests struct {
	// kick wakes the sender; buffered 1, so a kick is never lost and never
	// blocks.
	kick chan struct{}

	mu sync.Mutex
	// All fields below are guarded by mu.
	sent     uint64    // generation of the latest request sent; written by the sender
	answered uint64    // generation of the latest request answered; written by answer
	wanted   uint64    // highest generation any waiter needs; written by request
	inFlight bool      // a request was sent and is unanswered
	sentAt   time.Time // when the request in flight was sent
	// waitingSince is when the request in flight was first sent: re-sends
	// keep it.
	waitingSince time.Time

	// responses counts the stream's responses (receivedResponse): the
	// sender tells a stalled stream by a count that stops moving, so that
	// receiving costs one atomic add and no clock read.
	responses atomic.Uint64
}

func newProgressRequests() *progressRequests {
	return &progressRequests{kick: make(chan struct{}, 1)}
}

// request asks for a progress notification sent after this call and returns
// the generation whose answer will prove it.
func (p *progressRequests) request() uint64 {
	p.mu.Lock()
	need := p.sent + 1
	p.wanted = max(p.wanted, need)
	p.mu.Unlock()
	p.wake()
	return need
}

// answeredGeneration is the generation of the latest request answered.
func (p *progressRequests) answeredGeneration() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.answered
}

func (p *progressRequests) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// answer records a progress notification that answers our RequestProgress.
func (p *progressRequests) answer() {
	p.mu.Lock()
	if p.inFlight {
		p.answered = p.sent
		p.inFlight = false
	}
	p.mu.Unlock()
	p.wake()
}

// receivedResponse records that the stream delivered a response.
func (p *progressRequests) receivedResponse() { p.responses.Add(1) }

// streamLost forgets a request lost with a broken stream, and asks again for
// the waiters that still need an answer.
func (p *progressRequests) streamLost() {
	p.mu.Lock()
	p.inFlight = false
	p.mu.Unlock()
	p.wake()
}

// sendLoop sends a RequestProgress on stream whenever a waiter needs one
// and none is in flight, re-sending one left unanswered, until ctx is done
// or a send fails, or, with errWatchStalled, the stream delivered nothing
// for watchStallTimeout while a request was in flight. ready reports
// whether the stream's watch is created: a request sent before that would
// be dropped. sent is called per request.
func (p *progressRequests) sendLoop(ctx context.Context, stream pb.Watch_WatchClient, ready func() bool, sent func()) error {
	req := &pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}}
	resend := time.NewTimer(progressResend)
	resend.Stop()
	defer resend.Stop()
	// The response count as the sender last saw it change, and when: it
	// wakes every progressResend while a request is in flight, so it sees
	// a response within that of its arrival.
	var seenResponses uint64
	var seenAt time.Time
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-p.kick:
		case <-resend.C:
		}
		if !ready() {
			continue // kicked again once the watch is created
		}
		now := time.Now()
		p.mu.Lock()
		expired := p.inFlight && now.Sub(p.sentAt) >= progressResend
		send := p.wanted > p.answered && (!p.inFlight || expired)
		if send {
			if !p.inFlight {
				p.waitingSince = now
			}
			p.sent++
			p.inFlight = true
			p.sentAt = now
		}
		inFlight := p.inFlight
		silentSince := p.waitingSince
		p.mu.Unlock()
		if n := p.responses.Load(); n != seenResponses {
			seenResponses, seenAt = n, now
		}
		if seenAt.After(silentSince) {
			silentSince = seenAt
		}
		if inFlight && now.Sub(silentSince) >= watchStallTimeout {
			return errWatchStalled
		}
		if send {
			sent()
			if err := stream.Send(req); err != nil {
				return err
			}
		}
		if inFlight {
			resend.Reset(progressResend)
		}
	}
}
