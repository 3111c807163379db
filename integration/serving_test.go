package integration

import (
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestReadinessFollowsTheLoad: /readyz and the gRPC health service say "not
// ready" while the cache cannot load (etcd unreachable), /livez says the
// process is up, and both turn green once the load is done. The upstream is
// given as a bare host:port.
func TestReadinessFollowsTheLoad(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	r := testsupport.NewRelay(t, e.Clients[0].Addr().String())
	r.Cut()
	p, err := server.Start(servertest.Config(r.Addr() /* host:port, no scheme */, func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)

	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + p.MetricsAddr() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	conn, err := grpc.NewClient(p.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := func() healthpb.HealthCheckResponse_ServingStatus {
		resp, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Status
	}

	if code, _ := get("/livez"); code != http.StatusOK {
		t.Fatalf("/livez = %d while loading, want 200", code)
	}
	if code, _ := get("/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d before the load, want 503", code)
	}
	if s := health(); s != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health = %v before the load, want NOT_SERVING", s)
	}

	r.Restore()
	servertest.WaitReady(t, p)
	// Ready once the auth mirror's next probe (up to 500 ms after etcd
	// is back) has learned etcd's auth state too.
	testsupport.WaitFor(t, waitTimeout, "/readyz 200 after the load", func() bool {
		code, _ := get("/readyz")
		return code == http.StatusOK
	})
	testsupport.WaitFor(t, waitTimeout, "health SERVING", func() bool { return health() == healthpb.HealthCheckResponse_SERVING })
	// As grpc-proxy: the proxy's own metrics at /proxy/metrics, etcd's
	// relayed at /metrics.
	if _, body := get("/proxy/metrics"); !strings.Contains(body, "etcd_snapcache_cache_revision") {
		t.Fatal("/proxy/metrics lacks etcd_snapcache_cache_revision")
	}
	if _, body := get("/metrics"); !strings.Contains(body, "etcd_server_has_leader") {
		t.Fatal("/metrics lacks etcd's etcd_server_has_leader")
	}
}

// TestTLSBothWays: etcd serves TLS and requires client certificates; the
// proxy dials it with --cacert/--cert/--key, and serves TLS itself with
// --cert-file/--key-file/--trusted-ca-file, requiring client certificates.
// A client with a certificate reads and writes through it; one without is
// refused.
func TestTLSBothWays(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir)

	curl := startTLSEtcd(t, pki, dir)

	p := servertest.StartProxy(t, servertest.Config(curl.String(), func(cfg *server.Config) {
		cfg.UpstreamTLS = transport.TLSInfo{TrustedCAFile: pki.ca, CertFile: pki.clientCert, KeyFile: pki.clientKey}
		cfg.ServerTLS = transport.TLSInfo{CertFile: pki.serverCert, KeyFile: pki.serverKey, TrustedCAFile: pki.ca}
		cfg.Logger = zaptest.NewLogger(t)
	}))

	cli := callerClient(t, "https://"+p.Addr(), "", "", pki.tlsConfig(t, pki.clientCert, pki.clientKey))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	put, err := cli.Put(ctx, "tls", "yes")
	if err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the cache to apply the put", func() bool { return p.Store().Rev() >= put.Header.Revision })
	got, err := cli.Get(ctx, "tls", clientv3.WithRev(put.Header.Revision))
	if err != nil || len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "yes" {
		t.Fatalf("get through TLS: %v %v", got, err)
	}

	// No client certificate: the TLS handshake is refused.
	noCert, err := transport.TLSInfo{TrustedCAFile: pki.ca}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := tls.Dial("tcp", p.Addr(), noCert)
	if err == nil {
		// TLS 1.3 reports a missing client certificate on the first read.
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
	}
	if err == nil {
		t.Fatal("a client without a certificate was served")
	}
}

// startTLSEtcd starts an etcd that serves TLS with pki's server
// certificate and requires client certificates signed by its CA
// (--client-cert-auth), with its data under dir; it returns its client URL.
func startTLSEtcd(t *testing.T, pki testPKI, dir string) *url.URL {
	t.Helper()
	cfg := embed.NewConfig()
	cfg.Dir = filepath.Join(dir, "etcd")
	curl, _ := url.Parse("https://" + testsupport.FreeAddr(t))
	purl, _ := url.Parse("http://" + testsupport.FreeAddr(t))
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*curl}, []url.URL{*curl}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*purl}, []url.URL{*purl}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ClientTLSInfo = transport.TLSInfo{CertFile: pki.serverCert, KeyFile: pki.serverKey, TrustedCAFile: pki.ca, ClientCertAuth: true}
	cfg.LogLevel = "error"
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	<-e.Server.ReadyNotify()
	return curl
}

// tlsConfig is a client TLS configuration that trusts the CA and presents
// cert and key.
func (p testPKI) tlsConfig(t *testing.T, cert, key string) *tls.Config {
	t.Helper()
	c, err := transport.TLSInfo{TrustedCAFile: p.ca, CertFile: cert, KeyFile: key}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

type testPKI struct {
	ca, serverCert, serverKey, clientCert, clientKey string
	// client issues a client certificate with the given common name and
	// returns its certificate and key files.
	client func(commonName string) (cert, key string)
}

// newTestPKI writes a CA, a server certificate for 127.0.0.1 (a client
// certificate too, as etcd's fixtures: grpc-proxy and the proxy present it
// to themselves) and a client certificate with common name "client", all
// signed by the CA, into dir.
func newTestPKI(t *testing.T, dir string) testPKI {
	t.Helper()
	pki := testsupport.NewPKI(t)
	p := testPKI{ca: filepath.Join(dir, "ca.crt")}
	pki.WriteCA(t, p.ca)
	pair := func(cn string, usage testsupport.Usage) (string, string) {
		name := cn
		if name == "" {
			name = "no-cn"
		}
		cert, key := filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
		pki.WritePair(t, cn, usage, cert, key)
		return cert, key
	}
	p.serverCert, p.serverKey = pair("server", testsupport.Server|testsupport.Client)
	p.clientCert, p.clientKey = pair("client", testsupport.Client)
	p.client = func(cn string) (string, string) { return pair(cn, testsupport.Client) }
	return p
}
