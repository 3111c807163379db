package progress

import (
	"context"
	"errors"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

var (
	// ErrAhead is returned by WaitRevision when etcd answered a progress
	// request, sent after the call began, with a revision below the one
	// waited for: as far as the cache can tell, that revision is in the
	// future.
	ErrAhead = errors.New("progress: revision is ahead of etcd")
	// ErrNotFollowing is returned by WaitRevision while the upstream watch is
	// down, so that callers go to etcd instead of waiting.
	ErrNotFollowing = errors.New("progress: not following etcd")
)

// progressResend is how long a RequestProgress may go unanswered before it
// is sent again: etcd drops, rather than defers, a request that arrives
// while the watcher is catching up. kube-apiserver re-sends at this pace.
const progressResend = 100 * time.Millisecond

// progressState coalesces RequestProgress calls on the upstream watch.
//
// A waiter counts only answers to requests sent after it arrived
// (generation > sent at arrival). etcd's answers carry no request id, so an
// answer is taken to answer the latest request sent. If it was really an
// older one's, the waiter may give up early. WaitRevision's callers then ask
// etcd, which is always correct; only latency is lost. At most one request
// is in flight; later waiters share the next one.
type progressState struct {
	sent     uint64    // generation of the latest request sent
	answered uint64    // generation of the latest request answered
	wanted   uint64    // highest generation any waiter needs
	inFlight bool      // a request is unanswered
	sentAt   time.Time // when the request in flight was sent

	readyTarget int64 // revision at which the first load counts as caught up
}

// requestProgress asks for a progress notification sent after this call and
// returns the generation whose answer will prove it.
func (f *Follower) requestProgress() uint64 {
	f.mu.Lock()
	need := f.progress.sent + 1
	f.progress.wanted = max(f.progress.wanted, need)
	f.mu.Unlock()
	f.wake()
	return need
}

func (f *Follower) answeredGeneration() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.progress.answered
}

func (f *Follower) wake() {
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// sendProgressRequests sends a RequestProgress whenever a waiter needs one
// and none is in flight, re-sending one left unanswered, until ctx is done
// or a send fails.
func (f *Follower) sendProgressRequests(ctx context.Context, stream pb.Watch_WatchClient) error {
	req := &pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}}
	resend := time.NewTimer(progressResend)
	resend.Stop()
	defer resend.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-f.kick:
		case <-resend.C:
		}
		if !f.Following() {
			continue // re-kicked once the watch is created
		}
		f.mu.Lock()
		p := &f.progress
		expired := p.inFlight && time.Since(p.sentAt) >= progressResend
		send := p.wanted > p.answered && (!p.inFlight || expired)
		if send {
			p.sent++
			p.inFlight = true
			p.sentAt = time.Now()
		}
		inFlight := p.inFlight
		f.mu.Unlock()
		if send {
			if f.m != nil {
				f.m.progressRequests.Inc()
			}
			if err := stream.Send(req); err != nil {
				return err
			}
		}
		if inFlight {
			resend.Reset(progressResend)
		}
	}
}

// resendProgressAfterReconnect forgets a request lost with a broken stream
// and asks again for the waiters that still need an answer.
func (f *Follower) resendProgressAfterReconnect() {
	f.mu.Lock()
	f.progress.inFlight = false
	f.mu.Unlock()
	f.wake()
}

// onProgress handles a progress notification at rev; requested says it
// answers our RequestProgress (watch id -1) rather than being periodic.
func (f *Follower) onProgress(rev int64, requested bool) {
	f.store.Advance(rev)
	if requested {
		f.mu.Lock()
		if f.progress.inFlight {
			f.progress.answered = f.progress.sent
			f.progress.inFlight = false
		}
		f.mu.Unlock()
		f.wake()
	}
	f.advanced()
}

// WaitRevision waits until the store has applied rev. It returns nil once it
// has; ErrAhead if etcd proved, after the call began, that it is below rev;
// ErrNotFollowing if the upstream watch is down; or ctx's error. Concurrent
// waiters share one RequestProgress.
func (f *Follower) WaitRevision(ctx context.Context, rev int64) error {
	if f.store.Rev() >= rev {
		return nil
	}
	if !f.Following() {
		return ErrNotFollowing
	}
	gen := f.requestProgress()
	for {
		changed := f.Changed()
		if f.store.Rev() >= rev {
			return nil
		}
		if f.answeredGeneration() >= gen {
			return ErrAhead
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// WaitFresh waits until etcd has answered a progress request sent after the
// call began, and returns the store's revision then: every event etcd had
// committed when the call began is in the store. It fails with
// ErrNotFollowing while the upstream watch is down, or with ctx's error.
func (f *Follower) WaitFresh(ctx context.Context) (int64, error) {
	if !f.Following() {
		return 0, ErrNotFollowing
	}
	gen := f.requestProgress()
	for {
		changed := f.Changed()
		if f.answeredGeneration() >= gen {
			return f.store.Rev(), nil
		}
		if !f.Following() {
			return 0, ErrNotFollowing
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}
