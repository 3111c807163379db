package watchproxy

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// catchupProgressResend is how often the catch-up watch asks etcd for
// progress; etcd drops requests while the watcher is still catching up.
const catchupProgressResend = 100 * time.Millisecond

// catchupBatch is what a catch-up goroutine hands its stream's send loop.
type catchupBatch struct {
	// w is the watcher the batch is for: a later watcher may reuse its id.
	w          *watcher
	events     []*mvccpb.Event // of revisions <= upTo, with PrevKv
	upTo       int64           // the watcher is complete up to upTo
	done       bool            // the store's history holds every later event
	compactRev int64           // etcd compacted the watcher's next revision
	err        error
}

// startCatchup relays etcd's history of w's range, from w.nextRev up to
// where the store's history begins, through one upstream watch.
func (st *stream) startCatchup(w *watcher) {
	until := st.s.store.HistoryStart()
	ctx, cancel := context.WithCancel(st.ctx)
	w.catchingUp, w.cancelCatchup = true, cancel
	st.s.m.caughtUp()
	st.s.lg.Debug("catching a watcher up from etcd",
		zap.Int64("watch-id", w.id), zap.Int64("from", w.nextRev), zap.Int64("history-start", until))
	create := &pb.WatchCreateRequest{Key: w.key, RangeEnd: wireRangeEnd(w.end), StartRevision: w.nextRev, PrevKv: true}
	st.wg.Add(1)
	go func() {
		defer st.wg.Done()
		b := st.catchup(ctx, w, create, until)
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

// catchup runs the upstream watch. It hands over events as they come and
// returns the final batch: done, compacted, or an error.
func (st *stream) catchup(ctx context.Context, w *watcher, create *pb.WatchCreateRequest, until int64) catchupBatch {
	select {
	case st.s.catchups <- struct{}{}:
		defer func() { <-st.s.catchups }()
	case <-ctx.Done():
		return catchupBatch{err: ctx.Err()}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	up, err := st.s.upstream.Watch(ctx)
	if err != nil {
		return catchupBatch{err: err}
	}
	if err := up.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: create}}); err != nil {
		return catchupBatch{err: err}
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
			return catchupBatch{err: err}
		}
		switch {
		case resp.CompactRevision != 0:
			return catchupBatch{compactRev: resp.CompactRevision}
		case resp.Canceled:
			return catchupBatch{err: fmt.Errorf("etcd canceled the catch-up watch: %s", resp.CancelReason)}
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
			select {
			case st.catchupc <- catchupBatch{w: w, events: evs, upTo: evs[len(evs)-1].Kv.ModRevision}:
			case <-ctx.Done():
				return catchupBatch{err: ctx.Err()}
			}
		}
		if done {
			return catchupBatch{done: true, upTo: until - 1}
		}
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
	case b.err != nil:
		// etcd is unreachable: end the stream, as a broken etcd stream
		// ends; clients resume their watches on a new one.
		return status.Errorf(codes.Unavailable, "etcd-snapcache: catching up watch %d from etcd: %v", w.id, b.err)
	case b.done:
		w.nextRev = max(w.nextRev, b.upTo+1)
		w.catchingUp, w.cancelCatchup = false, nil
		return nil
	}
	evs := w.matching(nil, b.events)
	w.nextRev = b.upTo + 1
	if len(evs) == 0 {
		return nil
	}
	return st.sendWatcherEvents(w, evs, b.upTo)
}
