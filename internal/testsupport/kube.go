package testsupport

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// KubeAPIServerSetup prepares dir for an unmodified kube-apiserver serving
// alone on 127.0.0.1: a token file whose one token is an admin in
// system:masters, and a service-account key pair. It returns
// kube-apiserver's flags (all but --etcd-servers, the other --etcd-*
// flags and --watch-cache), the free port it will serve HTTPS on, and the
// token. kube-apiserver writes its self-signed serving certificate into
// dir/certs (KubeClient).
func KubeAPIServerSetup(tb testing.TB, dir string) (args []string, port int, token string) {
	tb.Helper()
	token = "e2e-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	writeFile(tb, filepath.Join(dir, "tokens.csv"), []byte(token+`,admin,admin-uid,"system:masters"`+"\n"))
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		tb.Fatal(err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		tb.Fatal(err)
	}
	writeFile(tb, filepath.Join(dir, "sa.key"), pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	writeFile(tb, filepath.Join(dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}))
	port = FreePorts(tb, 1)[0]
	return []string{
		fmt.Sprintf("--secure-port=%d", port),
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--endpoint-reconciler-type=none",
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + filepath.Join(dir, "sa.pub"),
		"--service-account-signing-key-file=" + filepath.Join(dir, "sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		"--authorization-mode=RBAC",
		"--token-auth-file=" + filepath.Join(dir, "tokens.csv"),
	}, port, token
}

// KubeClient waits until the kube-apiserver set up in dir
// (KubeAPIServerSetup) serves at https://127.0.0.1:port: its serving
// certificate, self-signed under its own CA, is complete in dir/certs (it
// writes it there before it serves), and /readyz answers 200 to token. It
// returns an HTTP client that trusts that certificate; its idle
// connections are closed when tb ends. alive, if not nil, is checked while
// waiting: its error (the process exited) fails the wait at once.
func KubeClient(tb testing.TB, dir string, port int, token string, timeout time.Duration, alive func() error) *http.Client {
	tb.Helper()
	certFile := filepath.Join(dir, "certs", "apiserver.crt")
	pool := x509.NewCertPool()
	check := func(what string) {
		if alive != nil {
			if err := alive(); err != nil {
				tb.Fatalf("waiting for %s: %v", what, err)
			}
		}
	}
	Poll(tb, timeout, 50*time.Millisecond, "kube-apiserver's serving certificate", func() (bool, error) {
		check("kube-apiserver's serving certificate")
		b, err := os.ReadFile(certFile)
		return err == nil && pool.AppendCertsFromPEM(b), err
	})
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"}, ForceAttemptHTTP2: true}
	hc := &http.Client{Transport: tr, Timeout: time.Minute}
	tb.Cleanup(tr.CloseIdleConnections)
	url := fmt.Sprintf("https://127.0.0.1:%d/readyz", port)
	Poll(tb, timeout, 100*time.Millisecond, "kube-apiserver /readyz", func() (bool, error) {
		check("kube-apiserver /readyz")
		req, err := http.NewRequest("GET", url, nil)
		if err != nil {
			return false, err
		}
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := hc.Do(req)
		if err != nil {
			return false, err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return false, fmt.Errorf("%s: %s", resp.Status, body)
		}
		return true, nil
	})
	return hc
}
