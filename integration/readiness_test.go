package integration

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// probeClient reads a proxy's /readyz (on its metrics address) and its
// gRPC health service.
type probeClient struct {
	t      *testing.T
	p      *server.Server
	health healthpb.HealthClient
}

func newProbeClient(t *testing.T, p *server.Server) *probeClient {
	t.Helper()
	conn, err := grpc.NewClient(p.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &probeClient{t: t, p: p, health: healthpb.NewHealthClient(conn)}
}

// readyz returns /readyz?verbose's status code and body.
func (c *probeClient) readyz() (int, string) {
	c.t.Helper()
	resp, err := http.Get("http://" + c.p.MetricsAddr() + "/readyz?verbose")
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// serving returns the gRPC health service's status.
func (c *probeClient) serving() healthpb.HealthCheckResponse_ServingStatus {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Status
}

// waitNotReady waits until /readyz fails with the check named failed and
// the health service says NOT_SERVING.
func (c *probeClient) waitNotReady(failed string) {
	c.t.Helper()
	testsupport.WaitFor(c.t, waitTimeout, "/readyz to fail "+failed, func() bool {
		code, body := c.readyz()
		return code == http.StatusServiceUnavailable && strings.Contains(body, "[-]"+failed+" failed")
	})
	testsupport.WaitFor(c.t, waitTimeout, "health NOT_SERVING", func() bool { return c.serving() == healthpb.HealthCheckResponse_NOT_SERVING })
}

// waitReady waits until /readyz passes and the health service says
// SERVING.
func (c *probeClient) waitReady() {
	c.t.Helper()
	testsupport.WaitFor(c.t, waitTimeout, "/readyz to pass", func() bool {
		code, _ := c.readyz()
		return code == http.StatusOK
	})
	testsupport.WaitFor(c.t, waitTimeout, "health SERVING", func() bool { return c.serving() == healthpb.HealthCheckResponse_SERVING })
}

// TestReadinessUpstreamLost: once the upstream watch has been down longer
// than the threshold, /readyz fails its upstream check and the gRPC health
// service says NOT_SERVING, while the proxy still answers; both recover
// when the watch is back.
func TestReadinessUpstreamLost(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	r := testsupport.NewRelay(t, e.Clients[0].Addr().String())
	p := servertest.StartProxy(t, servertest.Config(r.Addr(), func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.UpstreamLostThreshold = 300 * time.Millisecond
		cfg.Logger = zaptest.NewLogger(t)
	}))
	c := newProbeClient(t, p)
	c.waitReady()

	r.Cut()
	c.waitNotReady("upstream")
	if code, body := c.readyz(); !strings.Contains(body, "[+]cache ok") {
		t.Fatalf("/readyz = %d %q: the cache check should still pass", code, body)
	}
	// Still serving what it holds.
	kv := pb.NewKVClient(rawConn(t, p.Addr()))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := kv.Range(ctx, &pb.RangeRequest{Key: []byte("k"), Serializable: true}); err != nil {
		t.Fatalf("serializable read with the upstream lost: %v", err)
	}

	r.Restore()
	c.waitReady()
}

// TestReadinessDuringReload: while the cache reloads (here, held on its
// first page), /readyz fails its cache check and the gRPC health service
// says NOT_SERVING; both recover once the reload is done.
func TestReadinessDuringReload(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	var hold atomic.Bool
	held := make(chan struct{}, 1)
	gate := make(chan struct{})
	var openGate sync.Once
	p := servertest.StartProxy(t, servertest.Config("http://"+e.Clients[0].Addr().String(), func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.BeforeLoadPage = func() {
			if hold.Load() {
				select {
				case held <- struct{}{}:
				default:
				}
				<-gate
			}
		}
		cfg.Logger = zaptest.NewLogger(t)
	}))
	// Cleanups run last first: the gate opens before the proxy stops.
	t.Cleanup(func() { openGate.Do(func() { close(gate) }) })
	c := newProbeClient(t, p)
	c.waitReady()

	hold.Store(true)
	p.Follower().Reload("test")
	<-held
	c.waitNotReady("cache")
	if _, body := c.readyz(); !strings.Contains(body, "reloading") {
		t.Fatalf("/readyz during a reload: %q", body)
	}
	openGate.Do(func() { close(gate) })
	c.waitReady()
}

// TestStopEndsEndlessStreams: a graceful stop does not wait the full
// graceful period for streams that never end by themselves: watches served
// from the cache and relayed to etcd, lease keepalives coalesced and
// relayed, and election observers all end at once with etcd's "server
// stopped" (Unavailable), which clients retry elsewhere.
func TestStopEndsEndlessStreams(t *testing.T) {
	// stream is one open client stream: recv returns its next error.
	type stream struct {
		name string
		recv func() error
	}
	// openStreams opens a watch, a lease keepalive and an election
	// observer on conn under ctx (token metadata for token callers), and
	// waits until each has answered once.
	openStreams := func(t *testing.T, ctx context.Context, conn *grpc.ClientConn, observe bool) []stream {
		t.Helper()
		ws, err := pb.NewWatchClient(conn).Watch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := ws.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{Key: []byte("k")}}}); err != nil {
			t.Fatal(err)
		}
		if resp, err := ws.Recv(); err != nil || !resp.Created {
			t.Fatalf("watch create: %v, %v", resp, err)
		}
		lease, err := pb.NewLeaseClient(conn).LeaseGrant(ctx, &pb.LeaseGrantRequest{TTL: 60})
		if err != nil {
			t.Fatal(err)
		}
		ka, err := pb.NewLeaseClient(conn).LeaseKeepAlive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := ka.Send(&pb.LeaseKeepAliveRequest{ID: lease.ID}); err != nil {
			t.Fatal(err)
		}
		if resp, err := ka.Recv(); err != nil || resp.TTL <= 0 {
			t.Fatalf("keepalive: %v, %v", resp, err)
		}
		streams := []stream{
			{"watch", func() error { _, err := ws.Recv(); return err }},
			{"keepalive", func() error { _, err := ka.Recv(); return err }},
		}
		if observe {
			el := v3electionpb.NewElectionClient(conn)
			if _, err := el.Campaign(ctx, &v3electionpb.CampaignRequest{Name: []byte("e"), Lease: lease.ID, Value: []byte("v")}); err != nil {
				t.Fatal(err)
			}
			obs, err := el.Observe(ctx, &v3electionpb.LeaderRequest{Name: []byte("e")})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := obs.Recv(); err != nil {
				t.Fatalf("observe: %v", err)
			}
			streams = append(streams, stream{"observe", func() error { _, err := obs.Recv(); return err }})
		}
		return streams
	}
	stopQuickly := func(t *testing.T, p *server.Server, streams []stream) {
		t.Helper()
		start := time.Now()
		p.Stop()
		d := time.Since(start)
		if d > 5*time.Second {
			t.Fatalf("Stop took %v with only endless streams open", d)
		}
		t.Logf("Stop took %v", d)
		for _, s := range streams {
			if err := s.recv(); status.Code(err) != codes.Unavailable {
				t.Errorf("%s after Stop: %v, want Unavailable", s.name, err)
			}
		}
	}

	t.Run("cached and coalesced", func(t *testing.T) {
		e := servertest.StartEtcd(t, server.EmbeddedConfig{})
		p := servertest.StartProxy(t, servertest.Config("http://"+e.Clients[0].Addr().String(), func(cfg *server.Config) {
			cfg.Logger = zaptest.NewLogger(t)
		}))
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		streams := openStreams(t, ctx, rawConn(t, p.Addr()), true)
		stopQuickly(t, p, streams)
	})

	t.Run("relayed", func(t *testing.T) {
		e := servertest.StartEtcd(t, server.EmbeddedConfig{})
		etcdEP := "http://" + e.Clients[0].Addr().String()
		enableRootAuth(t, rawConn(t, e.Clients[0].Addr().String()))
		p := servertest.StartProxy(t, servertest.Config(etcdEP, func(cfg *server.Config) {
			cfg.User = "root"
			cfg.Password = "rootpw"
			cfg.Logger = zaptest.NewLogger(t)
		}))
		// A token etcd issued, not the proxy: the proxy cannot attribute
		// it, so it relays the caller's streams to etcd.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		auth, err := pb.NewAuthClient(rawConn(t, e.Clients[0].Addr().String())).
			Authenticate(ctx, &pb.AuthenticateRequest{Name: "root", Password: "rootpw"})
		if err != nil {
			t.Fatal(err)
		}
		tctx := metadata.AppendToOutgoingContext(ctx, rpctypes.TokenFieldNameGRPC, auth.Token)
		streams := openStreams(t, tctx, rawConn(t, p.Addr()), false)
		relayed := proxyMetricValue(t, p, "etcd_snapcache_watch_relayed_streams_total")
		if relayed != 1 {
			t.Fatalf("watch_relayed_streams_total = %v, want the watch relayed", relayed)
		}
		stopQuickly(t, p, streams)
	})
}

// TestStopNotReadyFirstThenStopNow: Stop reports the proxy not ready
// before it waits for open requests (here a Lock that cannot be taken),
// and StopNow, a second signal, cuts them at once.
func TestStopNotReadyFirstThenStopNow(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	p := servertest.StartProxy(t, servertest.Config("http://"+e.Clients[0].Addr().String(), func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	c := newProbeClient(t, p)
	c.waitReady()
	conn := rawConn(t, p.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	lease := func() int64 {
		l, err := pb.NewLeaseClient(conn).LeaseGrant(ctx, &pb.LeaseGrantRequest{TTL: 60})
		if err != nil {
			t.Fatal(err)
		}
		return l.ID
	}
	locks := v3lockpb.NewLockClient(conn)
	if _, err := locks.Lock(ctx, &v3lockpb.LockRequest{Name: []byte("l"), Lease: lease()}); err != nil {
		t.Fatal(err)
	}
	second := lease()
	blocked := make(chan error, 1)
	go func() {
		_, err := locks.Lock(ctx, &v3lockpb.LockRequest{Name: []byte("l"), Lease: second})
		blocked <- err
	}()
	// The second Lock waits in etcd; Stop must wait for it.
	testsupport.WaitFor(t, waitTimeout, "the second Lock to be open", func() bool {
		return proxyMetricValue(t, p, "grpc_server_started_total") > proxyMetricValue(t, p, "grpc_server_handled_total")
	})

	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		p.Stop()
	}()
	testsupport.WaitFor(t, waitTimeout, "/readyz to fail shutdown", func() bool {
		code, body := c.readyz()
		return code == http.StatusServiceUnavailable && strings.Contains(body, "[-]shutdown failed: process is shutting down")
	})
	select {
	case <-stopped:
		t.Fatal("Stop returned while a Lock was open")
	default:
	}
	start := time.Now()
	p.StopNow()
	<-stopped
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("StopNow took %v", d)
	}
	if err := <-blocked; err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the open Lock after StopNow: %v, want it cut", err)
	}
}

// enableRootAuth creates user root (password rootpw) with the root role
// through conn, an etcd's, and enables auth.
func enableRootAuth(t *testing.T, conn *grpc.ClientConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	a := pb.NewAuthClient(conn)
	if _, err := a.UserAdd(ctx, &pb.AuthUserAddRequest{Name: "root", Password: "rootpw"}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.RoleAdd(ctx, &pb.AuthRoleAddRequest{Name: "root"}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.UserGrantRole(ctx, &pb.AuthUserGrantRoleRequest{User: "root", Role: "root"}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.AuthEnable(ctx, &pb.AuthEnableRequest{}); err != nil {
		t.Fatal(err)
	}
}

// proxyMetricValue sums the values of a counter or gauge of the proxy's
// registry over its series whose labels include labels (name, value
// pairs).
func proxyMetricValue(t *testing.T, p *server.Server, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := p.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || (l.GetName() == labels[i] && l.GetValue() == labels[i+1])
				}
				if !found {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}
