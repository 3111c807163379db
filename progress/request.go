package progress

import (
	"context"
	"errors"

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

// progressState coalesces RequestProgress calls on the upstream watch.
//
// Invariant: a waiter is satisfied only by the answer to a request sent after
// it arrived (generation > sent at arrival), so that the answer proves the
// cache fresh as of a moment after the waiter began. At most one request is
// in flight; later waiters share the next one.
type progressState struct {
	sent     uint64 // generation of the latest request sent
	answered uint64 // generation of the latest request answered
	wanted   uint64 // highest generation any waiter needs
	inFlight bool

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
// and none is in flight, until ctx is done or a send fails.
func (f *Follower) sendProgressRequests(ctx context.Context, stream pb.Watch_WatchClient) error {
	req := &pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-f.kick:
		}
		if !f.Following() {
			continue // re-kicked once the watch is created
		}
		f.mu.Lock()
		send := !f.progress.inFlight && f.progress.wanted > f.progress.sent
		if send {
			f.progress.sent++
			f.progress.inFlight = true
		}
		f.mu.Unlock()
		if !send {
			continue
		}
		if f.m != nil {
			f.m.progressRequests.Inc()
		}
		if err := stream.Send(req); err != nil {
			return err
		}
	}
}

// resendProgressAfterReconnect forgets a request lost with a broken stream
// and asks again for the waiters that still need an answer.
func (f *Follower) resendProgressAfterReconnect() {
	f.mu.Lock()
	f.progress.inFlight = false
	if f.progress.answered < f.progress.wanted {
		f.progress.wanted = f.progress.sent + 1
	}
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
		changed := f.changedChan()
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
