//go:build cluster_proxy

package e2e

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/tests/v3/framework/config"
	"go.etcd.io/etcd/tests/v3/framework/e2e"
)

// TestGrpcProxyMetricsAddr is not one of etcd's tests: none that
// cluster_proxy builds gives its members a metrics URL, which is when
// cluster_proxy.go passes the proxy --metrics-addr, a URL: the member's
// client URL with its port + 4. Three members, so three proxies on one host,
// each with its own metrics address, over http and over https (with the
// proxy's serving TLS, as etcd's grpc-proxy). It checks what etcd's
// grpc-proxy serves there (grpcproxy.HandleMetrics, HandleHealth): /metrics
// and /health. E2E_PROXY=etcd run.sh runs it against etcd's grpc-proxy.
func TestGrpcProxyMetricsAddr(t *testing.T) {
	e2e.BeforeTest(t)
	for _, tc := range []struct {
		name string
		opts []e2e.EPClusterOption
		tls  *tls.Config
	}{
		{name: "NoTLS"},
		{
			name: "ClientTLS_PeerTLS",
			opts: []e2e.EPClusterOption{e2e.WithClientConnType(e2e.ClientTLS), e2e.WithIsPeerTLS(true)},
			tls:  clientTLS(t),
		},
		{
			name: "ClientAutoTLS_PeerAutoTLS",
			opts: []e2e.EPClusterOption{
				e2e.WithClientConnType(e2e.ClientTLS), e2e.WithClientAutoTLS(true),
				e2e.WithIsPeerTLS(true), e2e.WithIsPeerAutoTLS(true),
			},
			tls: &tls.Config{InsecureSkipVerify: true},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := append([]e2e.EPClusterOption{e2e.WithClusterSize(3), e2e.WithMetricsURLScheme("http")}, tc.opts...)
			epc, err := e2e.NewEtcdProcessCluster(t.Context(), t, opts...)
			require.NoError(t, err)
			defer epc.Close()

			_, err = epc.Etcdctl().Put(t.Context(), "k", "v", config.PutOptions{})
			require.NoError(t, err)

			hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: tc.tls}}
			for _, p := range epc.Procs {
				murl := proxyMetricsURL(t, p.Config().ClientURL)
				for _, c := range []struct{ path, want string }{
					{"/metrics", "# TYPE "},
					{"/health", `"health":"true"`},
				} {
					resp, err := hc.Get(murl + c.path)
					if err != nil {
						t.Errorf("GET %s%s: %v", murl, c.path, err)
						continue
					}
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), c.want) {
						t.Errorf("GET %s%s: %s, want 200 and a body with %q; body: %.200q", murl, c.path, resp.Status, c.want, body)
					}
				}
			}
		})
	}
}

// proxyMetricsURL is cluster_proxy.go's proxyListenURL(cfg, 4).
func proxyMetricsURL(t *testing.T, clientURL string) string {
	u, err := url.Parse(clientURL)
	require.NoError(t, err)
	host, port, err := net.SplitHostPort(u.Host)
	require.NoError(t, err)
	p, err := strconv.Atoi(port)
	require.NoError(t, err)
	u.Host = net.JoinHostPort(host, fmt.Sprint(p+4))
	return u.String()
}

// clientTLS: the framework's client certificate, which etcdctl uses.
func clientTLS(t *testing.T) *tls.Config {
	c, err := transport.TLSInfo{CertFile: e2e.CertPath, KeyFile: e2e.PrivateKeyPath, TrustedCAFile: e2e.CaPath}.ClientConfig()
	require.NoError(t, err)
	return c
}
