package integration

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// setUpAuth creates root (role root) and alice, whose role may read and
// write /alice/ only, writes /secret and /alice/x, and enables auth.
func setUpAuth(t testing.TB, admin *clientv3.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	steps := []func() error{
		func() error { _, err := admin.Put(ctx, "/secret", "s"); return err },
		func() error { _, err := admin.Put(ctx, "/alice/x", "a"); return err },
		func() error { _, err := admin.UserAdd(ctx, "root", "rootpw"); return err },
		func() error { _, err := admin.RoleAdd(ctx, "root"); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := admin.UserAdd(ctx, "alice", "alicepw"); return err },
		func() error { _, err := admin.RoleAdd(ctx, "alice"); return err },
		func() error {
			_, err := admin.RoleGrantPermission(ctx, "alice", "/alice/", clientv3.GetPrefixRangeEnd("/alice/"), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := admin.UserGrantRole(ctx, "alice", "alice"); return err },
		func() error { _, err := admin.AuthEnable(ctx); return err },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
}

// startAuthProxy starts an etcd set up by setUpAuth and a proxy in front of
// it with root's credentials; it returns etcd's endpoint, the proxy and a
// client of etcd as root.
func startAuthProxy(t *testing.T) (string, *server.Server, *clientv3.Client) {
	t.Helper()
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	etcdEP := "http://" + e.Clients[0].Addr().String()
	setUpAuth(t, callerClient(t, etcdEP, "", "", nil))
	p := servertest.StartProxy(t, servertest.Config(etcdEP, func(cfg *server.Config) {
		cfg.User = "root"
		cfg.Password = "rootpw"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	return etcdEP, p, callerClient(t, etcdEP, "root", "rootpw", nil)
}

// callerClient is a client of ep as one caller: a user with a password,
// a TLS client certificate, both or neither. A password client
// authenticates while it dials, and etcd's bcrypt check of the password
// can take seconds on a loaded 2-core machine: hence the long dial timeout.
func callerClient(t testing.TB, ep, user, password string, tlsCfg *tls.Config) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, Username: user, Password: password, TLS: tlsCfg, DialTimeout: 15 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// outcome is what a caller sees of one request: the answer's key-values, or
// the error's code and message.
func outcome(kvs int, err error) string {
	if err != nil {
		s := status.Convert(err)
		return s.Code().String() + ": " + s.Message()
	}
	return "ok, " + string(rune('0'+kvs)) + " kvs"
}

// firstWatchResponse creates a watch and returns its first response.
func firstWatchResponse(t *testing.T, cli *clientv3.Client, cr *pb.WatchCreateRequest) *pb.WatchResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ws, err := pb.NewWatchClient(cli.ActiveConnection()).Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ws.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: cr}}); err != nil {
		t.Fatal(err)
	}
	resp, err := ws.Recv()
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// TestAuthPasswordIdentity: against an etcd with auth enabled, the proxy
// loads and follows with its own --user, never lends it, and every caller
// gets etcd's answers: anonymous reads, watches and writes are refused with
// etcd's "user name is empty" (the cache must not answer them), and a
// token caller's requests are answered as etcd answers that user.
func TestAuthPasswordIdentity(t *testing.T) {
	etcdEP, p, root := startAuthProxy(t)
	proxyEP := "http://" + p.Addr()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	head, err := root.Get(ctx, "/secret")
	if err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the cache to reach etcd's revision", func() bool { return p.Store().Rev() >= head.Header.Revision })

	for _, caller := range []struct{ user, password string }{{"", ""}, {"alice", "alicepw"}} {
		direct, proxied := callerClient(t, etcdEP, caller.user, caller.password, nil), callerClient(t, proxyEP, caller.user, caller.password, nil)
		for _, req := range []*pb.RangeRequest{
			{Key: []byte("/secret")},
			{Key: []byte("/secret"), Serializable: true},
			{Key: []byte("/secret"), Revision: head.Header.Revision, Serializable: true},
			{Key: []byte("/"), RangeEnd: []byte("0")},
			{Key: []byte{0}, RangeEnd: []byte{0}, Serializable: true},
			{Key: []byte("/alice/x")},
			{Key: []byte("/alice/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("/alice/")), Serializable: true},
		} {
			d, derr := pb.NewKVClient(direct.ActiveConnection()).Range(ctx, req)
			pr, perr := pb.NewKVClient(proxied.ActiveConnection()).Range(ctx, req)
			var dn, pn int
			if derr == nil {
				dn = len(d.Kvs)
			}
			if perr == nil {
				pn = len(pr.Kvs)
			}
			if outcome(dn, derr) != outcome(pn, perr) {
				t.Errorf("%q Range %v: etcd %s, proxy %s", caller.user, req, outcome(dn, derr), outcome(pn, perr))
			}
		}
		for _, key := range []string{"/secret", "/alice/x"} {
			cr := &pb.WatchCreateRequest{Key: []byte(key), StartRevision: 1}
			d, pr := firstWatchResponse(t, direct, cr), firstWatchResponse(t, proxied, cr)
			if d.Created != pr.Created || d.Canceled != pr.Canceled || d.CancelReason != pr.CancelReason || d.WatchId != pr.WatchId {
				t.Errorf("%q watch %s: etcd %v, proxy %v", caller.user, key, d, pr)
			}
		}
		for _, key := range []string{"/secret", "/alice/y"} {
			_, derr := direct.Put(ctx, key, "from "+caller.user)
			_, perr := proxied.Put(ctx, key, "from "+caller.user)
			if outcome(0, derr) != outcome(0, perr) {
				t.Errorf("%q Put %s: etcd %s, proxy %s", caller.user, key, outcome(0, derr), outcome(0, perr))
			}
		}
	}
	if got, err := root.Get(ctx, "/secret"); err != nil || string(got.Kvs[0].Value) != "s" {
		t.Fatalf("/secret after the refused writes: %v, %v", got, err)
	}
}

// TestAuthCertificateIdentityNotLent: the proxy reaches an etcd with
// --client-cert-auth through a certificate whose common name is root. A
// caller with its own certificate (alice's) must get nothing the proxy's
// identity could read or write for it: reads, watches and writes are
// refused, and nothing is applied.
func TestAuthCertificateIdentityNotLent(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir)
	rootCert, rootKey := pki.client("root")
	aliceCert, aliceKey := pki.client("alice")

	curl := startTLSEtcd(t, pki, dir)

	setUpAuth(t, callerClient(t, curl.String(), "", "", pki.tlsConfig(t, rootCert, rootKey)))
	p := servertest.StartProxy(t, servertest.Config(curl.String(), func(cfg *server.Config) {
		cfg.UpstreamTLS = transport.TLSInfo{TrustedCAFile: pki.ca, CertFile: rootCert, KeyFile: rootKey}
		cfg.ServerTLS = transport.TLSInfo{CertFile: pki.serverCert, KeyFile: pki.serverKey, TrustedCAFile: pki.ca}
		cfg.Logger = zaptest.NewLogger(t)
	}))
	alice := callerClient(t, "https://"+p.Addr(), "", "", pki.tlsConfig(t, aliceCert, aliceKey))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv := pb.NewKVClient(alice.ActiveConnection())
	for _, req := range []*pb.RangeRequest{
		{Key: []byte("/secret")},
		{Key: []byte("/secret"), Serializable: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, Serializable: true},
	} {
		if resp, err := kv.Range(ctx, req); err == nil {
			t.Errorf("alice read %v through the proxy's identity: %v", req, resp.Kvs)
		}
	}
	if w := firstWatchResponse(t, alice, &pb.WatchCreateRequest{Key: []byte("/secret"), StartRevision: 1}); !w.Canceled {
		t.Errorf("alice watched /secret through the proxy's identity: %v", w)
	}
	if _, err := alice.Put(ctx, "/secret", "stolen"); err == nil {
		t.Error("alice's Put of /secret ran as the proxy's identity")
	}
	if _, err := alice.Delete(ctx, "/secret"); err == nil {
		t.Error("alice's Delete of /secret ran as the proxy's identity")
	}
	root := callerClient(t, curl.String(), "", "", pki.tlsConfig(t, rootCert, rootKey))
	if got, err := root.Get(ctx, "/secret"); err != nil || len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "s" {
		t.Fatalf("/secret after alice's writes: %v, %v", got, err)
	}
}

// TestAuthTokenCallerServedFromCache: a caller whose token was issued
// through the proxy gets its allowed serializable and historical reads from
// the cache, checked with etcd's rules, and etcd's refusal for the rest;
// once its user is deleted in etcd, its reads fail as etcd's do within the
// mirror's second.
func TestAuthTokenCallerServedFromCache(t *testing.T) {
	etcdEP, p, root := startAuthProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	head, err := root.Get(ctx, "/alice/x")
	if err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the cache to reach etcd's revision", func() bool { return p.Store().Rev() >= head.Header.Revision })
	direct := pb.NewKVClient(callerClient(t, etcdEP, "alice", "alicepw", nil).ActiveConnection())
	proxied := pb.NewKVClient(callerClient(t, "http://"+p.Addr(), "alice", "alicepw", nil).ActiveConnection())

	cached := func() float64 {
		return metricSum(t, p.Registry(), "etcd_snapcache_range_requests_total", map[string]string{"source": "cache"})
	}
	reqs := []*pb.RangeRequest{
		{Key: []byte("/alice/x"), Serializable: true},
		{Key: []byte("/alice/"), RangeEnd: []byte(clientv3.GetPrefixRangeEnd("/alice/")), Serializable: true},
		{Key: []byte("/alice/x"), Revision: head.Header.Revision, Serializable: true},
		{Key: []byte("/secret"), Serializable: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, Serializable: true},
	}
	same := func(what string) (identical bool, detail string) {
		for _, req := range reqs {
			d, derr := direct.Range(ctx, req)
			pr, perr := proxied.Range(ctx, req)
			if derr == nil && perr == nil {
				if d.Header.Revision != pr.Header.Revision || len(d.Kvs) != len(pr.Kvs) {
					return false, fmt.Sprintf("%s %v: etcd %v, proxy %v", what, req, d, pr)
				}
				continue
			}
			if outcome(0, derr) != outcome(0, perr) {
				return false, fmt.Sprintf("%s %v: etcd %s, proxy %s", what, req, outcome(0, derr), outcome(0, perr))
			}
		}
		return true, ""
	}
	before := cached()
	if ok, detail := same("alice"); !ok {
		t.Fatal(detail)
	}
	if served := cached() - before; served < 3 {
		t.Fatalf("%v of alice's allowed reads served from the cache, want 3", served)
	}

	if _, err := root.UserDelete(ctx, "alice"); err != nil {
		t.Fatal(err)
	}
	testsupport.Poll(t, 5*time.Second, 50*time.Millisecond, "alice's reads to fail as etcd's do", func() (bool, error) {
		if ok, detail := same("deleted alice"); !ok {
			return false, errors.New(detail)
		}
		return true, nil
	})
}
