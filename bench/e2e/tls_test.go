package e2e

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"testing"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// mtlsPKI is the certificates of an mTLS run (-snapcache.e2e.tls, and
// BenchmarkKubeList's auth runs), as production runs both hops: one CA
// (testsupport.WriteKubeEtcdPKI's files) and
//
//   - etcd's and the proxy's serving certificates, for 127.0.0.1;
//   - a client certificate that names no user: the proxy's to its upstream
//     (it lends no identity to what it forwards), and kube-apiserver's but
//     in auth runs;
//   - a client certificate for the etcd user kube-apiserver, kube-apiserver's
//     in auth runs (it authenticates by certificate only);
//   - the load's, also naming no user: new ones, in memory (clientTLS).
type mtlsPKI struct {
	pki  *testsupport.PKI
	file func(name string) string
}

func newMTLSPKI(tb testing.TB) *mtlsPKI {
	tb.Helper()
	pki, file := testsupport.WriteKubeEtcdPKI(tb, tb.TempDir())
	return &mtlsPKI{pki: pki, file: file}
}

// serving is the flags of etcd (name "etcd") or of the proxy ("proxy")
// serving mTLS: its certificate, and a client certificate of the CA
// required of every caller (--client-cert-auth; with auth on, a caller
// without a token is then the user its certificate names, the proxy
// following etcd there).
func (m *mtlsPKI) serving(name string) []string {
	return []string{
		"--cert-file=" + m.file(name+".crt"), "--key-file=" + m.file(name+".key"),
		"--trusted-ca-file=" + m.file("ca.crt"), "--client-cert-auth",
	}
}

// upstream is the proxy's flags to reach its upstream (etcd, or the proxy
// it is in front of) over mTLS, with a certificate that names no user.
func (m *mtlsPKI) upstream() []string {
	return []string{"--cacert=" + m.file("ca.crt"), "--cert=" + m.file("anonymous.crt"), "--key=" + m.file("anonymous.key")}
}

// kubeEtcd is kube-apiserver's --etcd-* flags to reach its storage over
// mTLS with certificate cert: "anonymous" (naming no user) or
// "kube-apiserver" (the etcd user kube-apiserver).
func (m *mtlsPKI) kubeEtcd(cert string) []string {
	return []string{
		"--etcd-cafile=" + m.file("ca.crt"),
		"--etcd-certfile=" + m.file(cert+".crt"),
		"--etcd-keyfile=" + m.file(cert+".key"),
	}
}

// clientTLS is what the load presents to etcd and to the proxy: a new
// client certificate that names no user, and the CA alone trusted.
func (m *mtlsPKI) clientTLS(tb testing.TB) *tls.Config {
	tb.Helper()
	return m.pki.ClientTLS(tb, "")
}

// pprofFlags are `go tool pprof`'s flags to read profiles from an mTLS
// client port.
func (m *mtlsPKI) pprofFlags() string {
	return fmt.Sprintf("-tls_ca=%s -tls_cert=%s -tls_key=%s", m.file("ca.crt"), m.file("anonymous.crt"), m.file("anonymous.key"))
}

// transportName is what reports call the load's and the proxy's transport:
// "tls" (mTLS on every hop) or "plaintext".
func transportName(secure bool) string {
	if secure {
		return "tls"
	}
	return "plaintext"
}

// summaryName is b's name as its SUMMARY lines give it: with "/tls" when
// every hop is mTLS, so that plaintext and mTLS runs stand side by side
// (and apart in bench/chart).
func summaryName(b *testing.B, secure bool) string {
	if secure {
		return b.Name() + "/tls"
	}
	return b.Name()
}

// httpClient is a client of the HTTP endpoints on a client port (etcd's or
// the proxy's /debug/pprof/): presenting cfg's certificate when cfg is not
// nil, without keeping connections alive (goleak).
func httpClient(cfg *tls.Config) *http.Client {
	if cfg == nil {
		return http.DefaultClient
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg, DisableKeepAlives: true}}
}
