package authcache_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
)

// slowEtcd answers the mirror's calls (the probe of auth enabled, and
// AuthStatus) with auth disabled, each once the test releases it, and
// tells when each arrived.
type slowEtcd struct {
	pb.AuthClient
	probed, statused chan time.Time
	release          chan struct{}
}

func (e *slowEtcd) answer(ctx context.Context, arrived chan<- time.Time) error {
	select {
	case arrived <- time.Now():
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-e.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *slowEtcd) probe(ctx context.Context) (bool, error) { return false, e.answer(ctx, e.probed) }

func (e *slowEtcd) AuthStatus(ctx context.Context, _ *pb.AuthStatusRequest, _ ...grpc.CallOption) (*pb.AuthStatusResponse, error) {
	if err := e.answer(ctx, e.statused); err != nil {
		return nil, err
	}
	return &pb.AuthStatusResponse{}, nil
}

// TestMirrorPolledIsWhenSent: the mirror's state is dated from when the
// call that read it was sent, not from when it was answered, so that a
// slow answer does not look fresh to the gate (authcache.MaxMirrorAge):
// for the mirror's own poll, and for the shared AuthStatus of Status.
func TestMirrorPolledIsWhenSent(t *testing.T) {
	etcd := &slowEtcd{probed: make(chan time.Time), statused: make(chan time.Time), release: make(chan struct{})}
	m := authcache.NewMirror(authcache.MirrorConfig{Auth: etcd, EnabledProbe: etcd.probe, Interval: time.Hour})
	if !m.Polled().IsZero() {
		t.Fatalf("Polled = %v before any poll", m.Polled())
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { m.Run(ctx) })
	defer func() {
		cancel()
		wg.Wait()
	}()

	// The first poll: the probe of auth enabled.
	sent := <-etcd.probed
	etcd.release <- struct{}{}
	<-m.Known()
	first := m.Polled()
	if first.IsZero() || first.After(sent) {
		t.Fatalf("after the poll that arrived at %v, Polled = %v: want its sending", sent, first)
	}

	// A shared AuthStatus, answered after the test read the time.
	done := make(chan error, 1)
	go func() {
		_, _, err := m.Status(ctx)
		done <- err
	}()
	sent = <-etcd.statused
	etcd.release <- struct{}{}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if p := m.Polled(); !p.After(first) || p.After(sent) {
		t.Fatalf("after the AuthStatus that arrived at %v, Polled = %v: want its sending, after the poll's %v", sent, p, first)
	}
}
