package integration

import (
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"

	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// httpPaths are grpc-proxy's HTTP endpoints and the Kubernetes-style
// probes, with what each answers once the proxy is ready.
var httpPaths = []struct{ path, want string }{
	{"/metrics", "etcd_server_has_leader"},              // etcd's, relayed
	{"/health", `"health":"true"`},                      // etcd's health
	{"/proxy/metrics", "etcd_snapcache_cache_revision"}, // the proxy's own
	{"/proxy/health", `"health":"true"`},                // a Get and a Watch through the proxy
	{"/proxy/status", `"mode":"cache"`},                 // the proxy's status document
	{"/livez", "ok"},
	{"/readyz", "ok"},
	{"/readyz?verbose", "[+]cache ok"},
	{"/readyz/cache", "ok"},
	{"/readyz/auth", "ok"},
	{"/debug/pprof/", "goroutine"},
}

// TestHTTPEndpoints: every HTTP path is served on the client port, beside
// gRPC, with and without TLS, and on --metrics-addr given as grpc-proxy's
// URL; gRPC works on the same port.
func TestHTTPEndpoints(t *testing.T) {
	pki := newTestPKI(t, t.TempDir())
	for _, tc := range []struct {
		name        string
		tls         bool
		metricsAddr string
	}{
		{"plaintext", false, "http://127.0.0.1:0"},
		{"tls", true, "https://127.0.0.1:0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := servertest.StartEtcd(t, server.EmbeddedConfig{})
			cfg := servertest.Config("http://"+e.Clients[0].Addr().String(), func(cfg *server.Config) {
				cfg.MetricsAddr = tc.metricsAddr
				cfg.EnablePprof = true
				cfg.Logger = zaptest.NewLogger(t)
			})
			scheme, httpc := "http", http.DefaultClient
			var clientTLS *tls.Config
			if tc.tls {
				cfg.ServerTLS = transport.TLSInfo{CertFile: pki.serverCert, KeyFile: pki.serverKey, TrustedCAFile: pki.ca}
				var err error
				if clientTLS, err = (transport.TLSInfo{TrustedCAFile: pki.ca, CertFile: pki.clientCert, KeyFile: pki.clientKey}).ClientConfig(); err != nil {
					t.Fatal(err)
				}
				scheme, httpc = "https", &http.Client{Transport: &http.Transport{TLSClientConfig: clientTLS}}
			}
			p := servertest.StartProxy(t, cfg)
			get := func(addr, path string) (int, string) {
				resp, err := httpc.Get(scheme + "://" + addr + path)
				if err != nil {
					t.Fatalf("GET %s: %v", path, err)
				}
				defer resp.Body.Close()
				body, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, string(body)
			}
			for _, addr := range []string{p.Addr(), p.MetricsAddr()} {
				for _, h := range httpPaths {
					if h.path == "/debug/pprof/" && addr == p.MetricsAddr() {
						continue // pprof is served on the client port, as grpc-proxy serves it
					}
					code, body := get(addr, h.path)
					if code != http.StatusOK || !strings.Contains(body, h.want) {
						t.Errorf("%s%s = %d %.200q, want 200 with %q", addr, h.path, code, body, h.want)
					}
				}
				if code, _ := get(addr, "/no-such-path"); code != http.StatusNotFound {
					t.Errorf("%s/no-such-path = %d, want 404", addr, code)
				}
			}
			// gRPC on the same port.
			cli, err := clientv3.New(clientv3.Config{Endpoints: []string{scheme + "://" + p.Addr()}, TLS: clientTLS, DialTimeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer cli.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := cli.Put(ctx, "k", "v"); err != nil {
				t.Fatal(err)
			}
			if resp, err := cli.Get(ctx, "k"); err != nil || len(resp.Kvs) != 1 {
				t.Fatalf("get through the client port: %v, %v", resp, err)
			}
		})
	}
}

// TestTLSIdentityReachesHandlers: over TLS, a gRPC handler sees the
// caller's verified certificate in peer.AuthInfo, as etcd's handlers do
// (the identity auth takes from a certificate's common name).
func TestTLSIdentityReachesHandlers(t *testing.T) {
	pki := newTestPKI(t, t.TempDir())
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	var mu sync.Mutex
	var seen []string
	record := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if p, ok := peer.FromContext(ctx); ok {
			if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.VerifiedChains) > 0 {
				mu.Lock()
				seen = append(seen, info.FullMethod+" "+ti.State.VerifiedChains[0][0].Subject.CommonName)
				mu.Unlock()
			}
		}
		return handler(ctx, req)
	}
	p := servertest.StartProxy(t, servertest.Config("http://"+e.Clients[0].Addr().String(), func(cfg *server.Config) {
		cfg.ServerTLS = transport.TLSInfo{CertFile: pki.serverCert, KeyFile: pki.serverKey, TrustedCAFile: pki.ca}
		cfg.GRPCServerOptions = []grpc.ServerOption{grpc.ChainUnaryInterceptor(record)}
		cfg.Logger = zaptest.NewLogger(t)
	}))
	cli := callerClient(t, "https://"+p.Addr(), "", "", pki.tlsConfig(t, pki.clientCert, pki.clientKey))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cli.Get(ctx, "k", clientv3.WithSerializable()); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	want := "/etcdserverpb.KV/Range client"
	for _, s := range seen {
		if s == want {
			return
		}
	}
	t.Fatalf("handlers saw %q, want %q", seen, want)
}

// TestLockAndElectionForwarded: the Lock and Election services are served,
// forwarded to etcd as grpc-proxy forwards them.
func TestLockAndElectionForwarded(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	lease, err := c.viaProxy.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	conn := c.viaProxy.ActiveConnection()
	locks := v3lockpb.NewLockClient(conn)
	lock, err := locks.Lock(ctx, &v3lockpb.LockRequest{Name: []byte("l"), Lease: int64(lease.ID)})
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := c.direct.Get(ctx, string(lock.Key)); err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("lock key %q in etcd: %v, %v", lock.Key, resp, err)
	}
	if _, err := locks.Unlock(ctx, &v3lockpb.UnlockRequest{Key: lock.Key}); err != nil {
		t.Fatal(err)
	}

	elections := v3electionpb.NewElectionClient(conn)
	campaign, err := elections.Campaign(ctx, &v3electionpb.CampaignRequest{Name: []byte("e"), Lease: int64(lease.ID), Value: []byte("me")})
	if err != nil {
		t.Fatal(err)
	}
	leader, err := elections.Leader(ctx, &v3electionpb.LeaderRequest{Name: []byte("e")})
	if err != nil || string(leader.Kv.Value) != "me" {
		t.Fatalf("leader: %v, %v", leader, err)
	}
	if _, err := elections.Resign(ctx, &v3electionpb.ResignRequest{Leader: campaign.Leader}); err != nil {
		t.Fatal(err)
	}
}

// TestMemberListForwardedWithoutAdvertiseURL: with an explicitly empty
// --advertise-client-url, MemberList is etcd's own, as grpc-proxy answers
// it, so that member management tools see the cluster.
func TestMemberListForwardedWithoutAdvertiseURL(t *testing.T) {
	c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) { cfg.ForwardMemberList = true }})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	direct, err := c.direct.MemberList(ctx)
	if err != nil {
		t.Fatal(err)
	}
	proxied, err := pb.NewClusterClient(c.viaProxy.ActiveConnection()).MemberList(ctx, &pb.MemberListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(proxied.Members) != len(direct.Members) || proxied.Members[0].ID != direct.Members[0].ID ||
		strings.Join(proxied.Members[0].ClientURLs, ",") != strings.Join(direct.Members[0].ClientURLs, ",") {
		t.Fatalf("MemberList through the proxy %v, etcd's %v", proxied.Members, direct.Members)
	}
}
