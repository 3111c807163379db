package watchproxy

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/backoff"
)

// catchupProgressResend is how often the catch-up watch asks etcd for
// progress; etcd drops requests while the watcher is still catching up.
const catchupProgressResend = 100 * time.Millisecond

// The pauses between attempts of a catch-up whose upstream watch broke.
const (
	catchupRetryMin = 100 * time.Millisecond
	catchupRetryMax = 5 * time.Second
)

// catchupBatch is what a catch-up goroutine hands its stream's send loop.
type catchupBatch struct {
	// w is the watcher the batch is for: a later watcher may reuse its id.
	w      *watcher
	events []*mvccpb.Event // of revisions <= upTo, with PrevKv
	upTo   int64           // the watcher is complete up to upTo
	// The final batch says how the catch-up ended, by one of:
	done       bool   // the store's history holds every later event
	compactRev int64  // etcd compacted the watcher's next revision
	reason     string // etcd canceled the watch, or it failed for good
	err        error  // the stream or the watcher ended meanwhile
}

// attempt is how one upstream watch of a catch-up ended.
type attempt struct {
	final   *catchupBatch // the catch-up is over
	pending *catchupBatch // events the send loop did not take within catchupStall
	done    bool          // and after them, the store's history holds the rest
	next    int64         // the revision to go on from
	err     error         // the watch broke: go on from next after a pause
}

// startCatchup relays etcd's history of w's range, from w.nextRev up to
// where the store's history begins, through one upstream watch at a time.
func (st *stream) startCatchup(w *watcher) {
	until := st.s.store.HistoryStart()
	ctx, cancel := context.WithCancel(st.ctx)
	// Behind the history, as an etcd watcher behind its channel: unsynced.
	w.catchingUp, w.cancelCatchup, w.synced = true, cancel, false
	st.s.m.caughtUp()
	st.s.lg.Debug("catching a watcher up from etcd",
		zap.Int64("watch-id", w.id), zap.Int64("from", w.nextRev), zap.Int64("history-start", until))
	if st.traced() {
		st.event("watch catch-up from etcd", attrWatchID.Int64(w.id), attrFrom.Int64(w.nextRev), attrHistoryStart.Int64(until))
	}
	from := w.nextRev
	st.wg.Add(1)
	go func() {
		defer st.wg.Done()
		b := st.catchup(ctx, w, from, until)
		b.w = w
		select {
		case st.catchupc <- b:
		case <-ctx.Done():
		}
	}()
}

// wireRangeEnd turns a watcher's range end back into the request's form.
func wireRangeEnd(end []byte) []byte {
	if end != nil && len(end) == 0 {
		return []byte{0}
	}
	return end
}

// catchup runs upstream watches from `from` until the watcher is complete
// up to until-1, and returns the final batch. A watch that breaks is
// opened again from where it got to, after a pause, as an etcd watcher
// that is not synced yet just waits; one that stalls on its client gives
// its slot up until the client has taken its events. The loop ends with
// ctx (the watcher canceled, or the stream ended) if not before.
func (st *stream) catchup(ctx context.Context, w *watcher, from, until int64) catchupBatch {
	bo := backoff.New(catchupRetryMin, catchupRetryMax)
	for {
		if from >= until {
			return catchupBatch{done: true, upTo: until - 1}
		}
		a := st.catchupOnce(ctx, w, from, until)
		switch {
		case a.final != nil:
			return *a.final
		case a.pending != nil:
			st.s.m.catchupRestarted("stalled")
			select {
			case st.catchupc <- *a.pending:
			case <-ctx.Done():
				return catchupBatch{err: ctx.Err()}
			}
			if a.done {
				return catchupBatch{done: true, upTo: until - 1}
			}
		default:
			st.s.m.catchupRestarted("broken")
			st.s.lg.Info("catch-up watch broken; resuming it",
				zap.Int64("watch-id", w.id), zap.Int64("from", a.next), zap.Error(a.err))
			if a.next > from {
				bo.Reset() // it got somewhere: not a failing upstream
			}
			if !bo.Wait(ctx) {
				return catchupBatch{err: ctx.Err()}
			}
		}
		from = a.next
	}
}

// retryable reports whether a catch-up watch that failed with err is worth
// opening again, as clientv3 judges a broken watch stream (isHaltErr).
func retryable(err error) bool {
	if errors.Is(err, io.EOF) {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.Internal:
		return true
	}
	return false
}

// catchupOnce runs one upstream watch from `from`, holding one of the
// server's slots. It hands events over as they come.
func (st *stream) catchupOnce(ctx context.Context, w *watcher, from, until int64) attempt {
	select {
	case st.s.catchups <- struct{}{}:
		st.s.m.catchupRunning(1)
		defer func() {
			<-st.s.catchups
			st.s.m.catchupRunning(-1)
		}()
	case <-ctx.Done():
		return attempt{final: &catchupBatch{err: ctx.Err()}}
	}
	// fail says how an error ends the attempt: for good if the catch-up
	// is no longer wanted or etcd refuses it, else it is tried again.
	fail := func(err error) attempt {
		switch {
		case ctx.Err() != nil:
			return attempt{final: &catchupBatch{err: ctx.Err()}}
		case retryable(err):
			return attempt{next: from, err: err}
		}
		return attempt{final: &catchupBatch{reason: "etcd-snapcache: catching the watch up from etcd: " + err.Error()}}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	up, err := st.s.upstream.Watch(ctx)
	if err != nil {
		return fail(err)
	}
	create := &pb.WatchCreateRequest{Key: w.key, RangeEnd: wireRangeEnd(w.end), StartRevision: from, PrevKv: true}
	if err := up.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: create}}); err != nil {
		return fail(err)
	}
	// The progress sender shares up.Send with nothing after the create; it
	// ends with ctx, and this function waits for it.
	created := make(chan struct{})
	var sender sync.WaitGroup
	sender.Add(1)
	go func() {
		defer sender.Done()
		askProgress(ctx, up, created)
	}()
	defer sender.Wait()
	defer cancel()
	for {
		resp, err := up.Recv()
		if err != nil {
			return fail(err)
		}
		switch {
		case resp.CompactRevision != 0:
			return attempt{final: &catchupBatch{compactRev: resp.CompactRevision}}
		case resp.Canceled:
			// etcd's own reason (permission denied, say) is the watcher's.
			reason := resp.CancelReason
			if reason == "" {
				reason = "etcd-snapcache: etcd canceled the catch-up watch"
			}
			return attempt{final: &catchupBatch{reason: reason}}
		case resp.Created:
			close(created)
			continue
		}
		// Only a progress notification promises every event up to its
		// header revision: etcd heads each batch of an unsynced watcher
		// (at most 1000 revisions) with its current revision.
		done := len(resp.Events) == 0 && resp.Header.Revision >= until-1
		var evs []*mvccpb.Event
		for _, ev := range resp.Events {
			if ev.Kv.ModRevision >= until {
				done = true // the rest is in the store's history
				break
			}
			evs = append(evs, ev)
		}
		if len(evs) > 0 {
			b := catchupBatch{w: w, events: evs, upTo: evs[len(evs)-1].Kv.ModRevision}
			if !st.handOver(ctx, b) {
				if ctx.Err() != nil {
					return attempt{final: &catchupBatch{err: ctx.Err()}}
				}
				return attempt{pending: &b, done: done, next: b.upTo + 1}
			}
			from = b.upTo + 1
		}
		if done {
			return attempt{final: &catchupBatch{done: true, upTo: until - 1}}
		}
	}
}

// handOver gives the send loop a batch of events, waiting at most
// catchupStall: a send loop blocked on a client that does not read must
// not keep the slot.
func (st *stream) handOver(ctx context.Context, b catchupBatch) bool {
	stall := time.NewTimer(st.s.catchupStall)
	defer stall.Stop()
	select {
	case st.catchupc <- b:
		return true
	case <-stall.C:
		return false
	case <-ctx.Done():
		return false
	}
}

// askProgress asks the catch-up watch for progress every
// catchupProgressResend from its creation until ctx is done: only a progress
// notification proves the watcher complete up to a revision.
func askProgress(ctx context.Context, up pb.Watch_WatchClient, created <-chan struct{}) {
	select {
	case <-created:
	case <-ctx.Done():
		return
	}
	t := time.NewTicker(catchupProgressResend)
	defer t.Stop()
	req := &pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}}
	for {
		if up.Send(req) != nil {
			return
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// onCatchup applies a catch-up batch to its watcher, if still there.
func (st *stream) onCatchup(b catchupBatch) error {
	w := b.w
	if st.watchers[w.id] != w || !w.catchingUp {
		return nil // canceled meanwhile (its id may be in use again)
	}
	switch {
	case b.compactRev != 0:
		return st.cancelCompacted(w, b.compactRev)
	case b.reason != "":
		st.s.lg.Warn("catching a watcher up from etcd failed; canceling the watcher",
			zap.Int64("watch-id", w.id), zap.Int64("next-revision", w.nextRev), zap.String("reason", b.reason))
		return st.cancelFailed(w, b.reason)
	case b.err != nil:
		return nil // the stream is ending
	case b.done:
		w.nextRev = max(w.nextRev, b.upTo+1)
		// Its catch-up watch reached etcd's head: as etcd's watcher, it
		// is synced, and a compaction etcd makes now does not cancel it.
		// The store holds what comes next, or it has moved past it
		// (deliverEach cancels a synced watcher whose events are gone).
		w.synced = true
		w.cancelCatchup() // its goroutine is done; free its context
		w.catchingUp, w.cancelCatchup = false, nil
		return nil
	}
	evs := w.matching(nil, b.events, st.s.store.CompactRev())
	w.nextRev = b.upTo + 1
	if len(evs) == 0 {
		return nil
	}
	return st.sendWatcherEvents(w, evs, b.upTo)
}
