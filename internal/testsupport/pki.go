package testsupport

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// Usage is what a certificate PKI issues may authenticate: a server, a
// client, or both (Server|Client).
type Usage uint8

const (
	Server Usage = 1 << iota // serverAuth, for 127.0.0.1 and localhost
	Client                   // clientAuth
)

// PKI is a test certificate authority: a fresh P-256 CA, valid from an
// hour ago for a day, that issues leaf certificates.
type PKI struct {
	CA    *x509.Certificate
	CAPEM []byte
	Pool  *x509.CertPool // holds CA alone

	key    *ecdsa.PrivateKey
	mu     sync.Mutex
	serial int64
}

// NewPKI creates a CA whose common name is "test-ca".
func NewPKI(tb testing.TB) *PKI {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "test-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		tb.Fatal(err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		tb.Fatal(err)
	}
	p := &PKI{CA: ca, CAPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), Pool: x509.NewCertPool(), key: key, serial: 1}
	p.Pool.AddCert(ca)
	return p
}

// Issue returns a new certificate signed by the CA and its private key,
// both PEM-encoded (the key as PKCS #8). cn is the subject's common name;
// "" issues a certificate without one, which etcd's --client-cert-auth
// maps to no user. A Server certificate is for IP 127.0.0.1 and DNS name
// localhost.
func (p *PKI) Issue(tb testing.TB, cn string, usage Usage) (certPEM, keyPEM []byte) {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	p.mu.Lock()
	p.serial++
	serial := p.serial
	p.mu.Unlock()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
	if usage&Server != 0 {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		tmpl.DNSNames = []string{"localhost"}
	}
	if usage&Client != 0 {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.CA, &key.PublicKey, p.key)
	if err != nil {
		tb.Fatal(err)
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		tb.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb})
}

// WriteCA writes the CA's certificate to path, creating its directory.
func (p *PKI) WriteCA(tb testing.TB, path string) {
	tb.Helper()
	writeFile(tb, path, p.CAPEM)
}

// WritePair issues a certificate (as Issue) and writes it and its key to
// certPath and keyPath, creating their directories.
func (p *PKI) WritePair(tb testing.TB, cn string, usage Usage, certPath, keyPath string) {
	tb.Helper()
	c, k := p.Issue(tb, cn, usage)
	writeFile(tb, certPath, c)
	writeFile(tb, keyPath, k)
}

// ClientTLS returns a TLS client configuration that trusts the CA alone
// and presents a new client certificate for cn ("" for none).
func (p *PKI) ClientTLS(tb testing.TB, cn string) *tls.Config {
	tb.Helper()
	c, k := p.Issue(tb, cn, Client)
	cert, err := tls.X509KeyPair(c, k)
	if err != nil {
		tb.Fatal(err)
	}
	return &tls.Config{RootCAs: p.Pool, Certificates: []tls.Certificate{cert}}
}

func writeFile(tb testing.TB, path string, b []byte) {
	tb.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		tb.Fatal(err)
	}
}

// WriteKubeEtcdPKI issues into dir the certificates of kube-apiserver's
// storage over mTLS, as clusters that enable etcd's RBAC run it:
//
//   - ca.crt, the CA;
//   - etcd.crt/.key and proxy.crt/.key, serving certificates for etcd and
//     etcd-snapcache;
//   - kube-apiserver.crt/.key, a client certificate for the etcd user
//     kube-apiserver, which it authenticates with (it sends no password);
//   - anonymous.crt/.key, a client certificate that names no user: the
//     proxy's to etcd (it lends no identity to what it forwards), and that
//     of tools that log in by password.
//
// It returns the PKI and the path of a file of dir by name.
func WriteKubeEtcdPKI(tb testing.TB, dir string) (*PKI, func(name string) string) {
	tb.Helper()
	file := func(name string) string { return filepath.Join(dir, name) }
	p := NewPKI(tb)
	p.WriteCA(tb, file("ca.crt"))
	p.WritePair(tb, "etcd", Server, file("etcd.crt"), file("etcd.key"))
	p.WritePair(tb, "etcd-snapcache", Server, file("proxy.crt"), file("proxy.key"))
	p.WritePair(tb, "kube-apiserver", Client, file("kube-apiserver.crt"), file("kube-apiserver.key"))
	p.WritePair(tb, "", Client, file("anonymous.crt"), file("anonymous.key"))
	return p, file
}
