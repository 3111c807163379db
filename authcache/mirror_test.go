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
	probed, statused                chan time.Time
	releaseProbe, releaseAuthStatus chan struct{}
}

func newSlowEtcd() *slowEtcd {
	return &slowEtcd{
		probed: make(chan time.Time), statused: make(chan time.Time),
		releaseProbe: make(chan struct{}), releaseAuthStatus: make(chan struct{}),
	}
}

func answer(ctx context.Context, arrived chan<- time.Time, release <-chan struct{}) error {
	select {
	case arrived <- time.Now():
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *slowEtcd) probe(ctx context.Context) (bool, error) {
	return false, answer(ctx, e.probed, e.releaseProbe)
}

func (e *slowEtcd) AuthStatus(ctx context.Context, _ *pb.AuthStatusRequest, _ ...grpc.CallOption) (*pb.AuthStatusResponse, error) {
	if err := answer(ctx, e.statused, e.releaseAuthStatus); err != nil {
		return nil, err
	}
	return &pb.AuthStatusResponse{}, nil
}

// TestMirrorPolledIsWhenSent: the mirror's state is dated from when the
// call that read it was sent, not from when it was answered, so that a
// slow answer does not look fresh to the gate (authcache.MaxMirrorAge):
// for the mirror's own poll, and for the shared AuthStatus of Status.
func TestMirrorPolledIsWhenSent(t *testing.T) {
	etcd := newSlowEtcd()
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
	etcd.releaseProbe <- struct{}{}
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
	etcd.releaseAuthStatus <- struct{}{}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if p := m.Polled(); !p.After(first) || p.After(sent) {
		t.Fatalf("after the AuthStatus that arrived at %v, Polled = %v: want its sending, after the poll's %v", sent, p, first)
	}
}

// TestMirrorKeepsTheNewerState: an answer to a call sent before the one
// whose answer the mirror keeps is dropped, so that the state is always
// etcd's as of Polled or later. Here the poll's probe, sent first, says
// auth is disabled after a Status sent later said it is enabled: the
// mirror keeps auth enabled.
func TestMirrorKeepsTheNewerState(t *testing.T) {
	etcd := newSlowEtcd()
	enabledEtcd := &enabledAuth{etcd}
	m := authcache.NewMirror(authcache.MirrorConfig{Auth: enabledEtcd, EnabledProbe: etcd.probe, Interval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { m.Run(ctx) })
	defer func() {
		cancel()
		wg.Wait()
	}()

	<-etcd.probed // the poll's probe, held
	done := make(chan error, 1)
	go func() {
		_, _, err := m.Status(ctx)
		done <- err
	}()
	<-etcd.statused
	etcd.releaseAuthStatus <- struct{}{} // Status: auth enabled
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if on, known := m.Enabled(); !on || !known {
		t.Fatalf("after Status said auth enabled: enabled %v, known %v", on, known)
	}
	statusSent := m.Polled()
	etcd.releaseProbe <- struct{}{} // the probe: auth disabled, sent earlier
	// The poll that Status asked for comes after the probe's answer was
	// taken or dropped: an AuthStatus while auth is enabled, another probe
	// if the mirror took the probe's answer.
	select {
	case <-etcd.statused:
	case <-etcd.probed:
		t.Fatal("the mirror took the earlier probe's answer: it polls as if auth were disabled")
	}
	if on, _ := m.Enabled(); !on || !m.Polled().Equal(statusSent) {
		t.Fatalf("after the earlier probe's answer: enabled %v, Polled %v; want auth enabled as of %v", on, m.Polled(), statusSent)
	}
}

// enabledAuth is slowEtcd's AuthStatus saying auth is enabled.
type enabledAuth struct{ *slowEtcd }

func (e *enabledAuth) AuthStatus(ctx context.Context, r *pb.AuthStatusRequest, opts ...grpc.CallOption) (*pb.AuthStatusResponse, error) {
	if _, err := e.slowEtcd.AuthStatus(ctx, r, opts...); err != nil {
		return nil, err
	}
	return &pb.AuthStatusResponse{Enabled: true, AuthRevision: 3}, nil
}

// TestMirrorPollGivesUpOnAHungMember: a poll whose call is not answered
// (sent to a member that hangs) gives up after CallTimeout, so that the
// next poll, which the balancer sends to a member that answers, keeps the
// mirror fresh; unbounded, it would wait for gRPC keepalive (50 s).
func TestMirrorPollGivesUpOnAHungMember(t *testing.T) {
	etcd := newSlowEtcd()
	m := authcache.NewMirror(authcache.MirrorConfig{Auth: etcd, EnabledProbe: etcd.probe, Interval: time.Millisecond, CallTimeout: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { m.Run(ctx) })
	defer func() {
		cancel()
		wg.Wait()
	}()
	// The first probe is never answered; the mirror must probe again.
	timeout := time.After(10 * time.Second)
	for range 2 {
		select {
		case <-etcd.probed:
		case <-timeout:
			t.Fatal("no second poll in 10s: the first, unanswered, holds the mirror")
		}
	}
}
