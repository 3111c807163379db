package drain_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// waitTimeout bounds each wait; no test relies on how long a step takes.
const waitTimeout = 30 * time.Second

func dial(t *testing.T, endpoints ...string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: drain.DialOptions(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// openWatch opens a watch stream with ctx and waits until etcd created its
// watch, and returns the member address it runs on.
func openWatch(t *testing.T, ctx context.Context, cli *clientv3.Client) string {
	t.Helper()
	stream, err := pb.NewWatchClient(cli.ActiveConnection()).Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{Key: []byte("k")}}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil || !resp.Created {
		t.Fatalf("watch not created: %v %v", resp, err)
	}
	p, ok := peer.FromContext(stream.Context())
	if !ok {
		t.Fatal("no peer in the stream's context")
	}
	return p.Addr.String()
}

// member is an embedded etcd that a test stops (or the cleanup does).
type member struct {
	addr  string
	close func()
}

func startEtcd(t *testing.T) member {
	t.Helper()
	e, err := server.StartEmbedded(server.EmbeddedConfig{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	closeOnce := sync.OnceFunc(e.Close)
	t.Cleanup(closeOnce)
	return member{addr: e.Clients[0].Addr().String(), close: closeOnce}
}

// closeAsync closes m as SIGTERM would, and returns a channel closed once
// it is closed.
func (m member) closeAsync() <-chan struct{} {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		m.close()
	}()
	return closed
}

func waitDone(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitTimeout):
		t.Fatalf("%s: not within %v", what, waitTimeout)
	}
}

// TestGracefulStopEndsTheStream: etcd closing (as on SIGTERM) sends GOAWAY
// and waits for open streams; a stream opened with drain.Context ends at
// the GOAWAY, with ErrDraining as its context's cause, so etcd's close is
// not held by it.
func TestGracefulStopEndsTheStream(t *testing.T) {
	m := startEtcd(t)
	cli := dial(t, m.addr)

	ctx, cancel := drain.Context(t.Context())
	defer cancel()
	openWatch(t, ctx, cli)
	// A unary call made with the stream's context (as the follower checks
	// etcd's version on its watch's context) ends without untracking the
	// stream.
	if _, err := pb.NewKVClient(cli.ActiveConnection()).Range(ctx, &pb.RangeRequest{Key: []byte("k")}); err != nil {
		t.Fatal(err)
	}

	closed := m.closeAsync()
	waitDone(t, "the stream's context canceled", ctx.Done())
	if cause := context.Cause(ctx); !errors.Is(cause, drain.ErrDraining) {
		t.Fatalf("cause %v, want ErrDraining", cause)
	}
	waitDone(t, "etcd closed", closed)
}

// TestOnlyTheDrainingMembersStreamsEnd: with two members, streams picked
// on the member that stops end, and those on the other stay open.
func TestOnlyTheDrainingMembersStreamsEnd(t *testing.T) {
	a, b := startEtcd(t), startEtcd(t)
	addrA, addrB := a.addr, b.addr
	cli := dial(t, addrA, addrB)

	streams := openOnBoth(t, cli, addrA, addrB)

	waitDone(t, "a closed", a.closeAsync())
	for _, s := range streams {
		switch s.addr {
		case addrA:
			waitDone(t, "a stream on the stopped member canceled", s.ctx.Done())
			cause := context.Cause(s.ctx)
			if !errors.Is(cause, drain.ErrDraining) || !strings.Contains(cause.Error(), addrA) {
				t.Errorf("stream on %s: cause %v, want ErrDraining naming it", addrA, cause)
			}
		case addrB:
			if err := s.ctx.Err(); err != nil {
				t.Errorf("stream on the member still serving ended: %v", context.Cause(s.ctx))
			}
		}
	}
}

// rangeOn makes a serializable Range through cli and returns the member
// address it was served by.
func rangeOn(ctx context.Context, cli *clientv3.Client) (string, error) {
	var p peer.Peer
	_, err := pb.NewKVClient(cli.ActiveConnection()).Range(ctx, &pb.RangeRequest{Key: []byte("k"), Serializable: true}, grpc.Peer(&p))
	if err != nil {
		return "", err
	}
	return p.Addr.String(), nil
}

// TestHungMemberIsAvoided: with two members each behind a relay, the
// relay of one stalls (as a SIGSTOPped member or a stalled path does: the
// connection stays open and READY). Within ProbeInterval+ProbeTimeout the
// streams with drain.Context on it end with ErrUnresponsive naming it,
// those on the other stay, and calls are served by the other; once the
// relay flows again the member is used again.
func TestHungMemberIsAvoided(t *testing.T) {
	a, b := startEtcd(t), startEtcd(t)
	ra, rb := testsupport.NewRelay(t, a.addr), testsupport.NewRelay(t, b.addr)
	addrA, addrB := ra.Addr(), rb.Addr()
	cli := dial(t, addrA, addrB)

	streams := openOnBoth(t, cli, addrA, addrB)

	ra.Stall()
	for _, s := range streams {
		if s.addr != addrA {
			continue
		}
		waitDone(t, "a stream on the hung member canceled", s.ctx.Done())
		cause := context.Cause(s.ctx)
		if !errors.Is(cause, drain.ErrUnresponsive) || !strings.Contains(cause.Error(), addrA) {
			t.Errorf("stream on %s: cause %v, want ErrUnresponsive naming it", addrA, cause)
		}
	}
	for _, s := range streams {
		if s.addr == addrB && s.ctx.Err() != nil {
			t.Errorf("stream on the member still answering ended: %v", context.Cause(s.ctx))
		}
	}
	// Its streams ended once it was unresponsive: from then on every call
	// goes to the other.
	for range 10 {
		ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
		addr, err := rangeOn(ctx, cli)
		cancel()
		if err != nil || addr != addrB {
			t.Fatalf("Range while %s hangs: served by %q, %v; want %s", addrA, addr, err, addrB)
		}
	}

	ra.Flow()
	testsupport.Poll(t, waitTimeout, 10*time.Millisecond, "a call served by the member again", func() (bool, error) {
		ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
		defer cancel()
		addr, err := rangeOn(ctx, cli)
		return addr == addrA, err
	})
}

// TestCancelIsPlain: cancel ends a context from Context as
// context.WithCancel's would.
func TestCancelIsPlain(t *testing.T) {
	ctx, cancel := drain.Context(t.Context())
	cancel()
	if !errors.Is(context.Cause(ctx), context.Canceled) {
		t.Fatalf("cause %v, want context.Canceled", context.Cause(ctx))
	}
}

// TestAvoid: a call made with Avoid goes to another member while one
// answers, and to the avoided member when it is the only one that answers.
func TestAvoid(t *testing.T) {
	a, b := startEtcd(t), startEtcd(t)
	ra, rb := testsupport.NewRelay(t, a.addr), testsupport.NewRelay(t, b.addr)
	addrA, addrB := ra.Addr(), rb.Addr()
	cli := dial(t, addrA, addrB)
	served := func(avoid string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(drain.Avoid(t.Context(), avoid), waitTimeout)
		defer cancel()
		addr, err := rangeOn(ctx, cli)
		if err != nil {
			t.Fatal(err)
		}
		return addr
	}
	// Both members READY first: round_robin connects to them in turn.
	testsupport.Poll(t, waitTimeout, 10*time.Millisecond, "calls on both members", func() (bool, error) {
		seen := map[string]bool{}
		for range 4 {
			seen[served("")] = true
		}
		return len(seen) == 2, nil
	})
	for range 10 {
		if got := served(addrA); got != addrB {
			t.Fatalf("avoiding %s: served by %s", addrA, got)
		}
		if got := served(addrB); got != addrA {
			t.Fatalf("avoiding %s: served by %s", addrB, got)
		}
	}

	// B hangs: once it is found unresponsive, a call avoiding A still goes
	// to A, the one member that answers.
	rb.Stall()
	testsupport.Poll(t, 2*drain.ProbeInterval+drain.ProbeTimeout+waitTimeout, 50*time.Millisecond, addrB+" unresponsive", func() (bool, error) {
		return slices.Equal(drain.Unresponsive(), []string{addrB}), fmt.Errorf("unresponsive %v", drain.Unresponsive())
	})
	for range 10 {
		if got := served(addrA); got != addrA {
			t.Fatalf("avoiding %s while %s hangs: served by %s", addrA, addrB, got)
		}
	}
	rb.Flow()
}

// opened is a watch stream opened with a context from drain.Context, and
// the member it runs on.
type opened struct {
	ctx  context.Context
	addr string
}

// openOnBoth opens watch streams with contexts from drain.Context until
// each of the two members has some (round_robin spreads them once both are
// connected); drain.Member must name each stream's peer. The streams end
// with the test.
func openOnBoth(t *testing.T, cli *clientv3.Client, addrA, addrB string) []opened {
	t.Helper()
	var streams []opened
	on := map[string]int{}
	for i := 0; i < 100 && (on[addrA] < 2 || on[addrB] < 2); i++ {
		ctx, cancel := drain.Context(t.Context())
		t.Cleanup(cancel)
		addr := openWatch(t, ctx, cli)
		if m := drain.Member(ctx); m != addr {
			t.Fatalf("drain.Member %q, the stream's peer %q", m, addr)
		}
		on[addr]++
		streams = append(streams, opened{ctx, addr})
	}
	if on[addrA] == 0 || on[addrB] == 0 {
		t.Fatalf("streams per member %v: round_robin never used both", on)
	}
	return streams
}
