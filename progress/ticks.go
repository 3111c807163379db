package progress

import (
	"context"
	"errors"
	"fmt"
	"io"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/backoff"
	"github.com/etcd-snapcache/etcd-snapcache/internal/broadcast"
	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
)

// progressTicker learns etcd's periodic progress interval
// (--watch-progress-notify-interval), which no etcd API reports, by keeping
// one idle upstream watch with progress_notify on a key nobody writes (the
// probe key): etcd sends it a notification every interval, and each one
// ticks the proxy's periodic notifications to its own idle watchers. That
// is a second upstream watch in all, whatever the number of clients.
type progressTicker struct {
	wc    pb.WatchClient
	lg    *zap.Logger
	ticks broadcast.Signal
}

// run keeps the idle watch open until ctx is done.
func (t *progressTicker) run(ctx context.Context) {
	bo := backoff.New(minRetryPause, maxRetryPause)
	for ctx.Err() == nil {
		err := t.watch(ctx, bo)
		if ctx.Err() != nil {
			return
		}
		t.lg.Debug("the upstream progress tick watch broke; reopening", zap.Error(err))
		bo.Wait(ctx)
	}
}

// watch runs one idle watch until it breaks, ticking on each of etcd's
// periodic notifications.
func (t *progressTicker) watch(ctx context.Context, bo *backoff.Backoff) error {
	ctx, cancel := drain.Context(ctx) // see Follower.follow
	defer cancel()
	stream, err := t.wc.Watch(ctx)
	if err != nil {
		return fmt.Errorf("opening the progress tick watch: %w", err)
	}
	err = stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{
		Key:            probeKey,
		ProgressNotify: true,
	}}})
	if err != nil {
		return fmt.Errorf("creating the progress tick watch: %w", err)
	}
	for {
		resp, err := stream.Recv()
		switch {
		case errors.Is(err, io.EOF):
			return io.ErrUnexpectedEOF
		case err != nil:
			return err
		case resp.Canceled:
			return fmt.Errorf("progress tick watch canceled: %s", resp.CancelReason)
		case resp.Created:
			bo.Reset()
		case len(resp.Events) == 0:
			t.ticks.Notify()
		}
	}
}

// PeriodicProgress returns a channel closed at etcd's next periodic
// progress notification, so that the proxy notifies its idle watchers at
// etcd's interval.
func (f *Follower) PeriodicProgress() <-chan struct{} { return f.ticker.ticks.Wait() }
