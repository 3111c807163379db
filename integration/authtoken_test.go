package integration

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/metadata"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// writeRSAKeys writes a new RSA key pair as PEM files into dir.
func writeRSAKeys(t *testing.T, dir, name string) (priv, pub string, key *rsa.PrivateKey) {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	priv, pub = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub")
	if err := os.WriteFile(priv, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(pub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return priv, pub, key
}

// withToken is ctx carrying token as etcd's clients send it.
func withToken(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "token", token)
}

// TestAuthJWT: etcd issues JWTs; the proxy, given etcd's public key,
// verifies tokens issued straight by etcd and serves their allowed reads
// from the cache. A forged JWT (signed with another key), a garbage token
// and a JWT from before an auth change get exactly etcd's answers.
func TestAuthJWT(t *testing.T) {
	dir := t.TempDir()
	priv, pub, _ := writeRSAKeys(t, dir, "etcd")
	_, _, forger := writeRSAKeys(t, dir, "forger")
	e := servertest.StartEtcd(t, server.EmbeddedConfig{AuthToken: "jwt,pub-key=" + pub + ",priv-key=" + priv + ",sign-method=RS256,ttl=10m"})
	etcdEP := server.EmbeddedEndpoint(e)
	setUpAuth(t, callerClient(t, etcdEP, "", "", nil))
	p := servertest.StartProxy(t, servertest.Config(etcdEP, func(cfg *server.Config) {
		cfg.User = "root"
		cfg.Password = "rootpw"
		cfg.AuthToken = "jwt,pub-key=" + pub + ",sign-method=RS256"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	etcdConn, proxyConn := rawConn(t, strings.TrimPrefix(etcdEP, "http://")), rawConn(t, p.Addr()) // clientv3 would retry an invalid token 100 times

	// A token issued by etcd directly, never seen by the proxy.
	auth, err := pb.NewAuthClient(etcdConn).Authenticate(ctx, &pb.AuthenticateRequest{Name: "alice", Password: "alicepw"})
	if err != nil {
		t.Fatal(err)
	}
	forged, err := jwt.NewWithClaims(jwt.SigningMethodRS256, jwt.MapClaims{
		"username": "root", "revision": float64(1e9), "exp": time.Now().Add(time.Hour).Unix(),
	}).SignedString(forger)
	if err != nil {
		t.Fatal(err)
	}
	reqs := []*pb.RangeRequest{
		{Key: []byte("/alice/x"), Serializable: true},
		{Key: []byte("/alice/x")},
		{Key: []byte("/alice/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("/alice/"))},
		{Key: []byte("/secret")},
		{Key: []byte("/secret"), Serializable: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, Serializable: true},
	}
	compare := func(label, token string) string {
		for _, req := range reqs {
			d, derr := pb.NewKVClient(etcdConn).Range(withToken(ctx, token), req)
			pr, perr := pb.NewKVClient(proxyConn).Range(withToken(ctx, token), req)
			dn, pn := 0, 0
			if derr == nil {
				dn = len(d.Kvs)
			}
			if perr == nil {
				pn = len(pr.Kvs)
			}
			if outcome(dn, derr) != outcome(pn, perr) {
				return label + ": " + req.String() + ": etcd " + outcome(dn, derr) + ", proxy " + outcome(pn, perr)
			}
		}
		return ""
	}
	servertest.WaitReady(t, p)
	testsupport.WaitFor(t, waitTimeout, "the proxy to mirror etcd's auth", func() bool { return compare("alice's JWT", auth.Token) == "" })
	cached := func() float64 {
		return metricSum(t, p.Registry(), "etcd_snapcache_range_requests_total", map[string]string{"source": "cache"})
	}
	// Under load a linearizable read may legitimately go to etcd when its
	// freshness is not proven in time: three tries.
	var served float64
	for range 3 {
		before := cached()
		if diff := compare("alice's JWT", auth.Token); diff != "" {
			t.Fatal(diff)
		}
		if served = cached() - before; served >= 3 {
			break
		}
	}
	if served < 3 {
		t.Fatalf("%v of alice's allowed reads served from the cache, want 3 (JWT not verified?); by source and reason: %v", served, rangeCounts(t, p))
	}
	for label, token := range map[string]string{"a forged JWT": forged, "a garbage token": "garbage.token.x", "not a JWT": "simple"} {
		if diff := compare(label, token); diff != "" {
			t.Error(diff)
		}
	}

	// An auth change makes alice's JWT old: etcd answers "revision of auth
	// store is old", and so must the proxy once its mirror moved.
	root := callerClient(t, etcdEP, "root", "rootpw", nil)
	if _, err := root.RoleAdd(ctx, "unrelated"); err != nil {
		t.Fatal(err)
	}
	testsupport.Poll(t, 5*time.Second, 50*time.Millisecond, "answers to an old JWT to match etcd's", func() (bool, error) {
		if diff := compare("alice's old JWT", auth.Token); diff != "" {
			return false, errorString(diff)
		}
		return true, nil
	})
}

// rangeCounts is the proxy's etcd_snapcache_range_requests_total by
// "source/reason".
func rangeCounts(t *testing.T, p *server.Server) map[string]float64 {
	t.Helper()
	mfs, err := p.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "etcd_snapcache_range_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			out[labels["source"]+"/"+labels["reason"]] += m.GetCounter().GetValue()
		}
	}
	return out
}

type errorString string

func (e errorString) Error() string { return string(e) }

// TestAuthBadInput: a wrong password, an unknown user, a garbage token and
// a token replayed after its user was deleted each get etcd's answer
// through the proxy, and nothing is served.
func TestAuthBadInput(t *testing.T) {
	etcdEP, p, root := startAuthProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	etcdConn, proxyConn := rawConn(t, strings.TrimPrefix(etcdEP, "http://")), rawConn(t, p.Addr()) // clientv3 would retry an invalid token 100 times
	for _, r := range []*pb.AuthenticateRequest{{Name: "alice", Password: "wrong"}, {Name: "nobody", Password: "x"}, {}} {
		_, derr := pb.NewAuthClient(etcdConn).Authenticate(ctx, r)
		_, perr := pb.NewAuthClient(proxyConn).Authenticate(ctx, r)
		if outcome(0, derr) != outcome(0, perr) {
			t.Errorf("Authenticate %v: etcd %s, proxy %s", r, outcome(0, derr), outcome(0, perr))
		}
	}
	if _, err := root.UserAdd(ctx, "carol", "carolpw"); err != nil {
		t.Fatal(err)
	}
	if _, err := root.UserGrantRole(ctx, "carol", "alice"); err != nil {
		t.Fatal(err)
	}
	// carol's token, issued through the proxy, then carol deleted.
	auth, err := pb.NewAuthClient(proxyConn).Authenticate(ctx, &pb.AuthenticateRequest{Name: "carol", Password: "carolpw"})
	if err != nil {
		t.Fatal(err)
	}
	read := &pb.RangeRequest{Key: []byte("/alice/x"), Serializable: true}
	testsupport.WaitFor(t, waitTimeout, "carol's read through the proxy", func() bool {
		_, err := pb.NewKVClient(proxyConn).Range(withToken(ctx, auth.Token), read)
		return err == nil
	})
	if _, err := root.UserDelete(ctx, "carol"); err != nil {
		t.Fatal(err)
	}
	// A linearizable read is bound by the deletion at once; a serializable
	// one within the mirror's second, as the proxy promises.
	same := func(token string, req *pb.RangeRequest) error {
		_, derr := pb.NewKVClient(etcdConn).Range(withToken(ctx, token), req)
		_, perr := pb.NewKVClient(proxyConn).Range(withToken(ctx, token), req)
		if outcome(0, derr) != outcome(0, perr) {
			return fmt.Errorf("token %.8s… %v: etcd %s, proxy %s", token, req, outcome(0, derr), outcome(0, perr))
		}
		return nil
	}
	for _, token := range []string{auth.Token, "garbage"} {
		if err := same(token, &pb.RangeRequest{Key: []byte("/alice/x")}); err != nil {
			t.Error(err)
		}
		testsupport.Poll(t, 2*time.Second, 20*time.Millisecond, "a serializable read to follow the deletion", func() (bool, error) {
			if err := same(token, read); err != nil {
				return false, err
			}
			return true, nil
		})
		_, derr := pb.NewKVClient(etcdConn).Put(withToken(ctx, token), &pb.PutRequest{Key: []byte("/alice/z"), Value: []byte("v")})
		_, perr := pb.NewKVClient(proxyConn).Put(withToken(ctx, token), &pb.PutRequest{Key: []byte("/alice/z"), Value: []byte("v")})
		if outcome(0, derr) != outcome(0, perr) {
			t.Errorf("token %.8s… Put: etcd %s, proxy %s", token, outcome(0, derr), outcome(0, perr))
		}
	}
	if got, err := root.Get(ctx, "/alice/z"); err != nil || len(got.Kvs) != 0 {
		t.Fatalf("a refused Put was applied: %v, %v", got, err)
	}
}

// TestAuthProxyIdentityMustReadEverything: a proxy whose own user cannot
// read the whole keyspace never becomes ready, and says why on /readyz.
func TestAuthProxyIdentityMustReadEverything(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	etcdEP := server.EmbeddedEndpoint(e)
	setUpAuth(t, callerClient(t, etcdEP, "", "", nil))
	p := servertest.StartProxyUnready(t, servertest.Config(etcdEP, func(cfg *server.Config) {
		cfg.User = "alice"
		cfg.Password = "alicepw"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	var body string
	testsupport.WaitFor(t, waitTimeout, "/readyz to say why the proxy is not ready", func() bool {
		resp, err := http.Get("http://" + p.Addr() + "/readyz?verbose")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		return resp.StatusCode == http.StatusServiceUnavailable && strings.Contains(body, "cannot read the whole keyspace")
	})
	select {
	case <-p.Ready():
		t.Fatalf("ready with an identity that cannot read the keyspace; /readyz: %s", body)
	default:
	}
}
