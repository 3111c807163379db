package testsupport

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"
)

// TestPKI checks the certificates PKI issues: verified by its CA for their
// usages only, with the common name asked for (or none), and usable for an
// mTLS handshake on 127.0.0.1.
func TestPKI(t *testing.T) {
	p := NewPKI(t)
	parse := func(b []byte) *x509.Certificate {
		t.Helper()
		block, _ := pem.Decode(b)
		if block == nil {
			t.Fatal("no PEM block")
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	verify := func(c *x509.Certificate, usage x509.ExtKeyUsage, host string) error {
		_, err := c.Verify(x509.VerifyOptions{Roots: p.Pool, KeyUsages: []x509.ExtKeyUsage{usage}, DNSName: host})
		return err
	}

	srvPEM, srvKey := p.Issue(t, "server", Server)
	srv := parse(srvPEM)
	if err := verify(srv, x509.ExtKeyUsageServerAuth, "127.0.0.1"); err != nil {
		t.Errorf("server certificate for 127.0.0.1: %v", err)
	}
	if err := verify(srv, x509.ExtKeyUsageServerAuth, "localhost"); err != nil {
		t.Errorf("server certificate for localhost: %v", err)
	}
	if verify(srv, x509.ExtKeyUsageClientAuth, "") == nil {
		t.Error("a Server certificate verifies as a client certificate")
	}

	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "a", "c.crt"), filepath.Join(dir, "b", "c.key")
	p.WritePair(t, "", Client, certPath, keyPath)
	b, err := os.ReadFile(certPath)
	if err != nil {
		t.Fatal(err)
	}
	cli := parse(b)
	if cli.Subject.CommonName != "" {
		t.Errorf("common name %q, want none", cli.Subject.CommonName)
	}
	if err := verify(cli, x509.ExtKeyUsageClientAuth, ""); err != nil {
		t.Errorf("client certificate: %v", err)
	}
	if _, err := tls.LoadX509KeyPair(certPath, keyPath); err != nil {
		t.Errorf("written pair: %v", err)
	}
	p.WriteCA(t, filepath.Join(dir, "ca", "ca.crt"))
	if b, err := os.ReadFile(filepath.Join(dir, "ca", "ca.crt")); err != nil || !x509.NewCertPool().AppendCertsFromPEM(b) {
		t.Errorf("written CA: %v", err)
	}

	// An mTLS handshake: the server sees the client's common name.
	pair, err := tls.X509KeyPair(srvPEM, srvKey)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{pair}, ClientCAs: p.Pool, ClientAuth: tls.RequireAndVerifyClientCert})
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	cn := make(chan string, 1)
	go func() {
		c, err := lis.Accept()
		if err != nil {
			cn <- err.Error()
			return
		}
		defer c.Close()
		tc := c.(*tls.Conn)
		if err := tc.Handshake(); err != nil {
			cn <- err.Error()
			return
		}
		cn <- "CN=" + tc.ConnectionState().PeerCertificates[0].Subject.CommonName
	}()
	cfg := p.ClientTLS(t, "alice")
	c, err := tls.Dial("tcp", lis.Addr().String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := <-cn; got != "CN=alice" {
		t.Errorf("server saw %s, want CN=alice", got)
	}
	c.Close()
}
