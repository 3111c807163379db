package integration

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// authFollowWithin bounds how long the proxy may take to answer as etcd
// does after a change of etcd's auth state that etcd applies at once (a
// password changed, a user deleted, auth disabled or enabled, a permission
// revoked, for serializable reads).
const authFollowWithin = 3 * time.Second

// authReenableWithin bounds how long the proxy may take to see auth
// enabled again. Enabling auth fails the mirror's reads of the users and
// roles under way, which clientv3 retries after authenticating the
// proxy's identity again: a bcrypt check in etcd, which in these tests
// runs in process under the race detector (about 0.7 s alone, several
// seconds on a loaded 2-core machine).
const authReenableWithin = 10 * time.Second

// TestAuthMatrix is the differential auth matrix (issue 10): every caller
// (root, alice with a role on /alice/ and /shared, bob without a role, and
// callers etcd knows no user for) sends the same requests to etcd and to
// the proxy, and must get the same answer: the same data, or the same
// refusal with the same code and message, and for writes the same effect
// in etcd. It runs with password identities, with password identities
// through two tiers of proxies, and with client-certificate identities
// (etcd with --client-cert-auth, the proxy with ClientCertAuth and a
// CN-less upstream certificate). Then it checks that alice's allowed reads
// are served from the cache, and that revoking permissions, changing a
// password, deleting a user and disabling auth bind the proxy as they bind
// etcd.
//
// Subtests are named mode/caller/op. A "TEST EXPECTATION" failure means
// etcd itself did not answer as the matrix expects (the test is wrong, or
// etcd changed); every other failure prints etcd's answer and the proxy's.
func TestAuthMatrix(t *testing.T) {
	for _, mode := range []struct {
		name  string
		start func(*testing.T) *matrixEnv
	}{
		{"password", func(t *testing.T) *matrixEnv { return startPasswordMatrix(t, false) }},
		{"tiered", func(t *testing.T) *matrixEnv { return startPasswordMatrix(t, true) }},
		{"cert", startCertMatrix},
	} {
		t.Run(mode.name, func(t *testing.T) {
			env := mode.start(t)
			for _, c := range env.callers {
				t.Run(c.name, func(t *testing.T) {
					env.waitSynced(t)
					for _, op := range env.readOps() {
						t.Run(op.name, func(t *testing.T) { env.runRead(t, c, op) })
					}
					for _, op := range env.writeOps() {
						t.Run(op.name, func(t *testing.T) { env.runWrite(t, c, op) })
					}
					// Leave the write keys as they were, so that the next
					// caller's watches end with a put of each range.
					env.reset(t)
				})
			}
			t.Run("cache", env.testCacheUse)
			t.Run("revocation", env.testRevocation)
		})
	}
}

// matrixCaller is one identity, with a client of etcd and one of the proxy.
type matrixCaller struct {
	name string // the subtest's name
	// user is the name etcd takes the caller for: "" for a caller without
	// a token or a certificate, or with a certificate without CN.
	user string
	// authn: etcd finds an identity for the caller (requireAuthInfo
	// passes), even one that is no user.
	authn bool
	// anonymous: etcd knows no user by the caller's identity.
	anonymous   bool
	etcd, proxy *clientv3.Client
	// ownRole is a role the caller has ("nosuchrole" if none), otherRole
	// one it has not, otherUser a user it is not.
	ownRole, otherRole, otherUser string
}

// allowedBy reports whether allow (caller names, "authn" for every caller
// etcd finds an identity for, "all") names c.
func (c *matrixCaller) allowedBy(allow string) bool {
	for _, w := range strings.Fields(allow) {
		switch {
		case w == "all", w == c.name, w == "authn" && c.authn:
			return true
		}
	}
	return false
}

// matrixEnv is one identity mode: etcd with auth, the proxy the callers
// talk to, and the callers.
type matrixEnv struct {
	mode            string
	etcdEP, proxyEP string
	proxy           *server.Server
	root            *clientv3.Client // etcd, as root
	callers         []*matrixCaller
	// tokenCaller is the caller whose connections carry the tokens of the
	// revocation subtests (tokenTLS is its TLS configuration).
	tokenCaller string
	tokenTLS    func(*testing.T) *tls.Config
	// certTLS is the TLS configuration of the caller whose certificate
	// names cn (cert mode only).
	certTLS func(t *testing.T, cn string) *tls.Config
	// leaseA is attached to /alice/leased, leaseS to /secret/leased.
	leaseA, leaseS int64
	// r0 is a revision before the proxy's load: older than its history.
	// r1, after the load, is a revision before the second version of the
	// read keys.
	r0, r1 int64
}

func (env *matrixEnv) caller(name string) *matrixCaller {
	for _, c := range env.callers {
		if c.name == name {
			return c
		}
	}
	panic("no caller " + name)
}

func matrixCallerDefaults(c *matrixCaller) *matrixCaller {
	c.ownRole, c.otherRole, c.otherUser = "nosuchrole", "root", "alice"
	switch c.name {
	case "root":
		c.ownRole, c.otherRole = "root", "alice"
	case "alice":
		c.ownRole, c.otherUser = "alice", "root"
	}
	return c
}

// matrixLogger logs the proxy's errors only: every refused request is a
// warning, and the matrix sends hundreds.
func matrixLogger(t *testing.T) *zap.Logger {
	return zaptest.NewLogger(t, zaptest.Level(zapcore.ErrorLevel))
}

// startPasswordMatrix: a plain etcd, the proxy (behind a second proxy if
// tiered) with root's password, callers with passwords.
func startPasswordMatrix(t *testing.T, tiered bool) *matrixEnv {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	env := &matrixEnv{mode: "password", etcdEP: "http://" + e.Clients[0].Addr().String(), tokenCaller: "anonymous", tokenTLS: func(*testing.T) *tls.Config { return nil }}
	setUpAuth(t, callerClient(t, env.etcdEP, "", "", nil))
	env.root = callerClient(t, env.etcdEP, "root", "rootpw", nil)
	env.r0 = env.etcdRev(t) - 1
	upstream := env.etcdEP
	if tiered {
		env.mode = "tiered"
		inner := servertest.StartProxy(t, servertest.Config(upstream, func(cfg *server.Config) {
			cfg.User = "root"
			cfg.Password = "rootpw"
			cfg.Logger = matrixLogger(t).Named("inner")
		}))
		upstream = "http://" + inner.Addr()
	}
	env.proxy = servertest.StartProxy(t, servertest.Config(upstream, func(cfg *server.Config) {
		cfg.User = "root"
		cfg.Password = "rootpw"
		cfg.Logger = matrixLogger(t)
	}))
	env.proxyEP = "http://" + env.proxy.Addr()
	env.seed(t)
	// A caller authenticates once with each target and sends its token:
	// clientv3 with a password authenticates again (bcrypt, slow under
	// -race) for every stream it opens.
	anonEtcd, anonProxy := callerClient(t, env.etcdEP, "", "", nil), callerClient(t, env.proxyEP, "", "", nil)
	env.callers = append(env.callers, matrixCallerDefaults(&matrixCaller{name: "anonymous", anonymous: true, etcd: anonEtcd, proxy: anonProxy}))
	for _, c := range []struct{ user, password string }{{"root", "rootpw"}, {"alice", "alicepw"}, {"bob", "bobpw"}} {
		env.callers = append(env.callers, matrixCallerDefaults(&matrixCaller{
			name: c.user, user: c.user, authn: true,
			etcd:  tokenClient(t, env.etcdEP, authenticate(t, anonEtcd, c.user, c.password), nil),
			proxy: tokenClient(t, env.proxyEP, authenticate(t, anonProxy, c.user, c.password), nil),
		}))
	}
	// root, alice, bob, anonymous
	env.callers = append(env.callers[1:], env.callers[0])
	return env
}

// authenticate returns the token cli's endpoint issues user.
func authenticate(t *testing.T, cli *clientv3.Client, user, password string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	resp, err := authOf(cli).Authenticate(ctx, &pb.AuthenticateRequest{Name: user, Password: password})
	if err != nil {
		t.Fatalf("authenticate %s with %s: %v", user, cli.Endpoints()[0], err)
	}
	return resp.Token
}

// startCertMatrix: etcd serving TLS with --client-cert-auth, the proxy
// serving TLS with ClientCertAuth, reaching etcd with a client certificate
// without CN and root's password; callers known by their certificates'
// common names: root, alice, bob, nobody (no such user) and one without CN.
func startCertMatrix(t *testing.T) *matrixEnv {
	dir := t.TempDir()
	pki := newTestPKI(t, dir)
	certs := map[string][2]string{}
	for _, cn := range []string{"root", "alice", "bob", "nobody", ""} {
		cert, key := pki.client(cn)
		certs[cn] = [2]string{cert, key}
	}
	tlsFor := func(t *testing.T, cn string) *tls.Config { return pki.tlsConfig(t, certs[cn][0], certs[cn][1]) }
	curl := startTLSEtcd(t, pki, dir)
	env := &matrixEnv{mode: "cert", etcdEP: curl.String(), tokenCaller: "nocn", tokenTLS: func(t *testing.T) *tls.Config { return tlsFor(t, "") }, certTLS: tlsFor}
	setUpAuth(t, callerClient(t, env.etcdEP, "", "", tlsFor(t, "root")))
	env.root = callerClient(t, env.etcdEP, "", "", tlsFor(t, "root"))
	env.r0 = env.etcdRev(t) - 1
	env.proxy = servertest.StartProxy(t, servertest.Config(env.etcdEP, func(cfg *server.Config) {
		cfg.UpstreamTLS = transport.TLSInfo{TrustedCAFile: pki.ca, CertFile: certs[""][0], KeyFile: certs[""][1]}
		cfg.ServerTLS = transport.TLSInfo{CertFile: pki.serverCert, KeyFile: pki.serverKey, TrustedCAFile: pki.ca}
		cfg.ClientCertAuth = true
		cfg.User = "root"
		cfg.Password = "rootpw"
		cfg.Logger = matrixLogger(t)
	}))
	env.proxyEP = "https://" + env.proxy.Addr()
	env.seed(t)
	for _, c := range []struct{ name, cn string }{
		{"root", "root"}, {"alice", "alice"}, {"bob", "bob"}, {"nobody", "nobody"}, {"nocn", ""},
	} {
		env.callers = append(env.callers, matrixCallerDefaults(&matrixCaller{
			name: c.name, user: c.cn, authn: true, anonymous: c.name == "nobody" || c.name == "nocn",
			etcd:  callerClient(t, env.etcdEP, "", "", tlsFor(t, c.cn)),
			proxy: callerClient(t, env.proxyEP, "", "", tlsFor(t, c.cn)),
		}))
	}
	return env
}

// seed completes setUpAuth's users, roles and keys (auth is enabled):
//
//	bob: no role; alice: also READ on the single key /shared and WRITE
//	(only) on the single key /dropbox
//	/alice/x /alice/y /alice/leased(leaseA) /secret /secret/leased(leaseS)
//	/shared /sharedx /zzz, then r1, then new versions of /alice/x /secret
//	/shared /sharedx; and the write keys (reset).
func (env *matrixEnv) seed(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	root := env.root
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err := root.UserAdd(ctx, "bob", "bobpw")
	must(err)
	_, err = root.RoleGrantPermission(ctx, "alice", "/shared", "", clientv3.PermissionType(clientv3.PermRead))
	must(err)
	_, err = root.RoleGrantPermission(ctx, "alice", "/dropbox", "", clientv3.PermissionType(clientv3.PermWrite))
	must(err)
	la, err := root.Grant(ctx, 600)
	must(err)
	ls, err := root.Grant(ctx, 600)
	must(err)
	env.leaseA, env.leaseS = int64(la.ID), int64(ls.ID)
	for _, kv := range []struct {
		k, v  string
		lease clientv3.LeaseID
	}{
		{"/alice/y", "ay", 0}, {"/alice/leased", "al", la.ID}, {"/secret/leased", "sl", ls.ID},
		{"/shared", "sh", 0}, {"/sharedx", "shx", 0}, {"/zzz", "z", 0},
	} {
		resp, err := root.Put(ctx, kv.k, kv.v, clientv3.WithLease(kv.lease))
		must(err)
		env.r1 = resp.Header.Revision
	}
	for _, kv := range [][2]string{{"/alice/x", "a2"}, {"/secret", "s2"}, {"/shared", "sh2"}, {"/sharedx", "shx2"}} {
		_, err := root.Put(ctx, kv[0], kv[1])
		must(err)
	}
	env.reset(t)
}

// reset puts the write keys back as they were (as root, on etcd), revokes
// every lease but leaseA and leaseS, and grants two fresh leases, fa
// attached to /alice/rv and fs to /secret/rv.
func (env *matrixEnv) reset(t *testing.T) (fa, fs int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	leases, err := env.root.Leases(ctx)
	if err != nil {
		t.Fatalf("reset: %v", err)
	}
	for _, l := range leases.Leases {
		if id := int64(l.ID); id != env.leaseA && id != env.leaseS {
			if _, err := env.root.Revoke(ctx, l.ID); err != nil && status.Code(err) != codes.NotFound {
				t.Fatalf("reset: revoke %x: %v", id, err)
			}
		}
	}
	la, err := env.root.Grant(ctx, 600)
	if err != nil {
		t.Fatalf("reset: %v", err)
	}
	ls, err := env.root.Grant(ctx, 600)
	if err != nil {
		t.Fatalf("reset: %v", err)
	}
	ops := []clientv3.Op{
		clientv3.OpPut("/alice/w1", "w1"), clientv3.OpPut("/alice/w2", "w2"),
		clientv3.OpPut("/secret/w", "sw"), clientv3.OpPut("/dropbox", "db"),
		clientv3.OpPut("/alice/rv", "rv", clientv3.WithLease(la.ID)),
		clientv3.OpPut("/secret/rv", "srv", clientv3.WithLease(ls.ID)),
		clientv3.OpDelete("/alice/new"), clientv3.OpDelete("/secret/new"),
	}
	// root may write the read-only /shared: put it back only then, so
	// that the read keys keep their revisions.
	if _, err := env.root.Txn(ctx).If(clientv3.Compare(clientv3.Value("/shared"), "=", "sh2")).
		Then(ops...).Else(append(ops, clientv3.OpPut("/shared", "sh2"))...).Commit(); err != nil {
		t.Fatalf("reset: %v", err)
	}
	return int64(la.ID), int64(ls.ID)
}

// snapshot describes etcd's keyspace and leases, without revisions, with
// the leases named (A, S, FA, FS for fa and fs, "other").
func (env *matrixEnv) snapshot(t *testing.T, fa, fs int64) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	names := map[int64]string{0: "-", env.leaseA: "A", env.leaseS: "S", fa: "FA", fs: "FS"}
	name := func(id int64) string {
		if n, ok := names[id]; ok {
			return n
		}
		return "other"
	}
	resp, err := pb.NewKVClient(env.root.ActiveConnection()).Range(ctx, &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}})
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	var b strings.Builder
	for _, kv := range resp.Kvs {
		fmt.Fprintf(&b, "%s=%s(%s) ", kv.Key, kv.Value, name(kv.Lease))
	}
	leases, err := env.root.Leases(ctx)
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	var ls []string
	for _, l := range leases.Leases {
		ls = append(ls, name(int64(l.ID)))
	}
	sort.Strings(ls)
	fmt.Fprintf(&b, "leases %v", ls)
	return b.String()
}

// compactRev is etcd's compaction revision (0 before the first).
func (env *matrixEnv) compactRev(ctx context.Context) (int64, error) {
	resp, err := pb.NewMaintenanceClient(env.root.ActiveConnection()).HashKV(ctx, &pb.HashKVRequest{})
	if err != nil {
		return 0, err
	}
	return max(resp.CompactRevision, 0), nil
}

// etcdRev is etcd's head revision.
func (env *matrixEnv) etcdRev(t *testing.T) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	resp, err := pb.NewKVClient(env.root.ActiveConnection()).Range(ctx, &pb.RangeRequest{Key: []byte{0}, CountOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

// waitSynced waits until the proxy's cache has etcd's head.
func (env *matrixEnv) waitSynced(t *testing.T) {
	t.Helper()
	rev := env.etcdRev(t)
	testsupport.WaitFor(t, waitTimeout, "the cache to reach etcd's revision", func() bool { return env.proxy.Store().Rev() >= rev })
}

// matrixOp is one request of the matrix.
type matrixOp struct {
	name string
	// allow names the callers etcd serves (see allowedBy); the others it
	// refuses.
	allow string
	// write: the request changes etcd; it is sent through the proxy first,
	// then to etcd, each time from the same state (reset), and etcd's
	// state after each is compared too. Revisions are not compared.
	write bool
	// outcomeOnly: only success or the error is compared (the proxy
	// answers with its own data: MemberList, Status).
	outcomeOnly bool
	// compact: the effect includes whether etcd's compaction revision
	// moved.
	compact bool
	// norm adjusts both answers before they are compared.
	norm func(proto.Message)
	call func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error)
}

// opRun is what a request may depend on.
type opRun struct {
	env    *matrixEnv
	caller *matrixCaller
	fa, fs int64 // write runs: the fresh leases on /alice/rv and /secret/rv
}

func kvOf(cli *clientv3.Client) pb.KVClient { return pb.NewKVClient(cli.ActiveConnection()) }
func authOf(cli *clientv3.Client) pb.AuthClient {
	return pb.NewAuthClient(cli.ActiveConnection())
}
func leaseOf(cli *clientv3.Client) pb.LeaseClient { return pb.NewLeaseClient(cli.ActiveConnection()) }
func maintOf(cli *clientv3.Client) pb.MaintenanceClient {
	return pb.NewMaintenanceClient(cli.ActiveConnection())
}

func prefixEnd(p string) []byte { return []byte(clientv3.GetPrefixRangeEnd(p)) }

func rangeOp(name, allow string, req *pb.RangeRequest) matrixOp {
	return matrixOp{name: name, allow: allow, call: func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
		return kvOf(cli).Range(ctx, req)
	}}
}

// rangeStreamOp reads a whole RangeStream; the chunks are compared in
// order, as the ranges of a TxnResponse.
func rangeStreamOp(name, allow string, req *pb.RangeRequest) matrixOp {
	return matrixOp{name: name, allow: allow, call: func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
		chunks, err := collectStream(ctx, kvOf(cli), req)
		if err != nil {
			return nil, err
		}
		agg := &pb.TxnResponse{}
		for _, c := range chunks {
			agg.Responses = append(agg.Responses, &pb.ResponseOp{Response: &pb.ResponseOp_ResponseRange{ResponseRange: c.RangeResponse}})
		}
		return agg, nil
	}}
}

func txnOp(name, allow string, write bool, req *pb.TxnRequest) matrixOp {
	return matrixOp{name: name, allow: allow, write: write, call: func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
		return kvOf(cli).Txn(ctx, req)
	}}
}

func writeOp(name, allow string, call func(ctx context.Context, kv pb.KVClient, r *opRun) (proto.Message, error)) matrixOp {
	return matrixOp{name: name, allow: allow, write: true, call: func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
		return call(ctx, kvOf(cli), r)
	}}
}

func putOp(name, allow string, req *pb.PutRequest) matrixOp {
	return writeOp(name, allow, func(ctx context.Context, kv pb.KVClient, _ *opRun) (proto.Message, error) { return kv.Put(ctx, req) })
}

func deleteOp(name, allow string, req *pb.DeleteRangeRequest) matrixOp {
	return writeOp(name, allow, func(ctx context.Context, kv pb.KVClient, _ *opRun) (proto.Message, error) {
		return kv.DeleteRange(ctx, req)
	})
}

func cmpValue(key, value string) *pb.Compare {
	return &pb.Compare{Key: []byte(key), Target: pb.Compare_VALUE, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_Value{Value: []byte(value)}}
}

func reqPut(key, value string) *pb.RequestOp {
	return &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: []byte(key), Value: []byte(value)}}}
}

func reqRange(key string) *pb.RequestOp {
	return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte(key)}}}
}

func reqDelete(key string) *pb.RequestOp {
	return &pb.RequestOp{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: &pb.DeleteRangeRequest{Key: []byte(key)}}}
}

func reqTxn(txn *pb.TxnRequest) *pb.RequestOp {
	return &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: txn}}
}

// watchOp creates a watch and returns its first response with the events
// of every later one up to the last revision that changed the range (a
// put, in this test), as one WatchResponse; a later cancel is kept.
func watchOp(name, allow string, cr *pb.WatchCreateRequest) matrixOp {
	return matrixOp{name: name, allow: allow, call: func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
		head, err := kvOf(r.env.root).Range(ctx, &pb.RangeRequest{Key: cr.Key, RangeEnd: cr.RangeEnd})
		if err != nil {
			return nil, fmt.Errorf("the range's last revision: %w", err)
		}
		var last int64
		for _, kv := range head.Kvs {
			last = max(last, kv.ModRevision)
		}
		ctx, cancel := context.WithTimeout(ctx, rpcTimeout)
		defer cancel()
		ws, err := pb.NewWatchClient(cli.ActiveConnection()).Watch(ctx)
		if err != nil {
			return nil, err
		}
		if err := ws.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: cr}}); err != nil {
			return nil, err
		}
		first, err := ws.Recv()
		if err != nil {
			return nil, err
		}
		agg := proto.Clone(first).(*pb.WatchResponse)
		if !first.Created || first.Canceled {
			return agg, nil
		}
		for len(agg.Events) == 0 && last >= cr.StartRevision || len(agg.Events) > 0 && agg.Events[len(agg.Events)-1].Kv.ModRevision < last {
			resp, err := ws.Recv()
			if err != nil {
				return nil, fmt.Errorf("after %d events of revisions up to %d: %w", len(agg.Events), last, err)
			}
			agg.Events = append(agg.Events, resp.Events...)
			if resp.Canceled {
				agg.Canceled, agg.CancelReason, agg.CompactRevision = true, "later: "+resp.CancelReason, resp.CompactRevision
				break
			}
		}
		return agg, nil
	}}
}

func (env *matrixEnv) readOps() []matrixOp {
	r1 := env.r1
	alice, secret, all := []byte("/alice/"), []byte("/secret"), []byte{0}
	ops := []matrixOp{
		rangeOp("get-linearizable", "root alice", &pb.RangeRequest{Key: []byte("/alice/x")}),
		rangeOp("get-serializable", "root alice", &pb.RangeRequest{Key: []byte("/alice/x"), Serializable: true}),
		rangeOp("get-old-rev", "root alice", &pb.RangeRequest{Key: []byte("/alice/x"), Revision: r1}),
		rangeOp("get-old-rev-serializable", "root alice", &pb.RangeRequest{Key: []byte("/alice/x"), Revision: r1, Serializable: true}),
		rangeOp("get-before-load-serializable", "root alice", &pb.RangeRequest{Key: []byte("/alice/x"), Revision: env.r0, Serializable: true}),
		rangeOp("get-secret-before-load", "root", &pb.RangeRequest{Key: secret, Revision: env.r0}),
		rangeOp("get-missing-serializable", "root alice", &pb.RangeRequest{Key: []byte("/alice/nokey"), Serializable: true}),
		rangeOp("get-secret", "root", &pb.RangeRequest{Key: secret}),
		rangeOp("get-secret-serializable", "root", &pb.RangeRequest{Key: secret, Serializable: true}),
		rangeOp("get-secret-old-rev-serializable", "root", &pb.RangeRequest{Key: secret, Revision: r1, Serializable: true}),
		rangeOp("get-shared-serializable", "root alice", &pb.RangeRequest{Key: []byte("/shared"), Serializable: true}),
		rangeOp("get-shared-old-rev", "root alice", &pb.RangeRequest{Key: []byte("/shared"), Revision: r1}),
		rangeOp("get-sharedx-serializable", "root", &pb.RangeRequest{Key: []byte("/sharedx"), Serializable: true}),
		rangeOp("get-dropbox-serializable", "root", &pb.RangeRequest{Key: []byte("/dropbox"), Serializable: true}),
		rangeOp("prefix-alice", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/")}),
		rangeOp("prefix-alice-serializable", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), Serializable: true}),
		rangeOp("prefix-alice-old-rev-serializable", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), Revision: r1, Serializable: true}),
		rangeOp("prefix-alice-limit-serializable", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), Limit: 1, Serializable: true}),
		rangeOp("prefix-alice-sorted-serializable", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), SortOrder: pb.RangeRequest_DESCEND, SortTarget: pb.RangeRequest_VALUE, Serializable: true}),
		rangeOp("prefix-alice-keys-only-serializable", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), KeysOnly: true, Serializable: true}),
		rangeOp("prefix-alice-keys-only", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), KeysOnly: true}),
		rangeOp("prefix-alice-count-only-serializable", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), CountOnly: true, Serializable: true}),
		rangeOp("prefix-alice-count-only", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), CountOnly: true}),
		rangeOp("prefix-secret-serializable", "root", &pb.RangeRequest{Key: secret, RangeEnd: prefixEnd("/secret"), Serializable: true}),
		rangeOp("prefix-secret-count-only-serializable", "root", &pb.RangeRequest{Key: secret, RangeEnd: prefixEnd("/secret"), CountOnly: true, Serializable: true}),
		rangeOp("prefix-shared-serializable", "root", &pb.RangeRequest{Key: []byte("/shared"), RangeEnd: prefixEnd("/shared"), Serializable: true}),
		rangeOp("fromkey-alice-serializable", "root", &pb.RangeRequest{Key: alice, RangeEnd: all, Serializable: true}),
		rangeOp("fromkey-alice", "root", &pb.RangeRequest{Key: alice, RangeEnd: all}),
		rangeOp("fromkey-zzz-serializable", "root", &pb.RangeRequest{Key: []byte("/zzz"), RangeEnd: all, Serializable: true}),
		rangeOp("all-keys-serializable", "root", &pb.RangeRequest{Key: all, RangeEnd: all, Serializable: true}),
		rangeOp("all-keys-old-rev-count-only", "root", &pb.RangeRequest{Key: all, RangeEnd: all, Revision: r1, CountOnly: true}),

		rangeStreamOp("rangestream-alice", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/")}),
		rangeStreamOp("rangestream-alice-serializable", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), Serializable: true}),
		rangeStreamOp("rangestream-alice-old-rev", "root alice", &pb.RangeRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), Revision: r1, Serializable: true}),
		rangeStreamOp("rangestream-secret-serializable", "root", &pb.RangeRequest{Key: secret, RangeEnd: prefixEnd("/secret"), Serializable: true}),
		rangeStreamOp("rangestream-all-keys", "root", &pb.RangeRequest{Key: all, RangeEnd: all, Serializable: true}),

		watchOp("watch-alice-prefix-prevkv", "root alice", &pb.WatchCreateRequest{Key: alice, RangeEnd: prefixEnd("/alice/"), StartRevision: r1 + 1, PrevKv: true}),
		watchOp("watch-alice-x", "root alice", &pb.WatchCreateRequest{Key: []byte("/alice/x"), StartRevision: r1 + 1}),
		watchOp("watch-shared", "root alice", &pb.WatchCreateRequest{Key: []byte("/shared"), StartRevision: r1 + 1, PrevKv: true}),
		watchOp("watch-shared-prefix", "root", &pb.WatchCreateRequest{Key: []byte("/shared"), RangeEnd: prefixEnd("/shared"), StartRevision: r1 + 1}),
		watchOp("watch-secret", "root", &pb.WatchCreateRequest{Key: secret, StartRevision: r1 + 1}),
		watchOp("watch-secret-prefix-prevkv", "root", &pb.WatchCreateRequest{Key: secret, RangeEnd: prefixEnd("/secret"), StartRevision: r1 + 1, PrevKv: true}),
		watchOp("watch-alice-fromkey", "root", &pb.WatchCreateRequest{Key: alice, RangeEnd: all, StartRevision: r1 + 1}),
		watchOp("watch-all-keys", "root", &pb.WatchCreateRequest{Key: all, RangeEnd: all, StartRevision: r1 + 1}),

		txnOp("txn-read-allowed", "root alice", false, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/x", "a2")},
			Success: []*pb.RequestOp{reqRange("/alice/x"), reqRange("/shared")},
			Failure: []*pb.RequestOp{reqRange("/alice/y")},
		}),
		txnOp("txn-read-denied-compare", "root", false, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/secret", "s2")},
			Success: []*pb.RequestOp{reqRange("/alice/x")},
		}),
		txnOp("txn-read-denied-branch", "root", false, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/x", "a2")},
			Success: []*pb.RequestOp{reqRange("/alice/x")},
			Failure: []*pb.RequestOp{reqRange("/secret")},
		}),
	}
	leaseTTL := func(name, allow string, id int64, keys bool) matrixOp {
		return matrixOp{name: name, allow: allow, call: func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return leaseOf(cli).LeaseTimeToLive(ctx, &pb.LeaseTimeToLiveRequest{ID: id, Keys: keys})
		}}
	}
	keepAlive := func(name, allow string, id int64) matrixOp {
		return matrixOp{name: name, allow: allow, call: func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			s, err := leaseOf(cli).LeaseKeepAlive(ctx)
			if err != nil {
				return nil, err
			}
			if err := s.Send(&pb.LeaseKeepAliveRequest{ID: id}); err != nil {
				return nil, err
			}
			resp, err := s.Recv()
			_ = s.CloseSend()
			return resp, err
		}}
	}
	unary := func(name, allow string, outcomeOnly bool, call func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error)) matrixOp {
		return matrixOp{name: name, allow: allow, outcomeOnly: outcomeOnly, call: call}
	}
	ops = append(ops,
		leaseTTL("lease-ttl-keys-alice", "root alice", env.leaseA, true),
		leaseTTL("lease-ttl-keys-secret", "root", env.leaseS, true),
		leaseTTL("lease-ttl-secret", "authn", env.leaseS, false),
		matrixOp{name: "lease-leases", allow: "root", norm: sortLeases, call: func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return leaseOf(cli).LeaseLeases(ctx, &pb.LeaseLeasesRequest{})
		}},
		keepAlive("lease-keepalive-alice", "root alice", env.leaseA),
		keepAlive("lease-keepalive-secret", "root", env.leaseS),
		unary("member-list", "authn", true, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return pb.NewClusterClient(cli.ActiveConnection()).MemberList(ctx, &pb.MemberListRequest{Linearizable: true})
		}),
		unary("status", "authn", true, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return maintOf(cli).Status(ctx, &pb.StatusRequest{})
		}),
		unary("alarm-get", "authn", false, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return maintOf(cli).Alarm(ctx, &pb.AlarmRequest{Action: pb.AlarmRequest_GET})
		}),
		unary("hash-kv", "root", false, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return maintOf(cli).HashKV(ctx, &pb.HashKVRequest{})
		}),
		unary("defragment", "root", false, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return maintOf(cli).Defragment(ctx, &pb.DefragmentRequest{})
		}),
		unary("auth-status", "all", false, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return authOf(cli).AuthStatus(ctx, &pb.AuthStatusRequest{})
		}),
		unary("user-list", "root", false, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return authOf(cli).UserList(ctx, &pb.AuthUserListRequest{})
		}),
		unary("user-get-self", "root alice bob", false, func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
			return authOf(cli).UserGet(ctx, &pb.AuthUserGetRequest{Name: r.caller.user})
		}),
		unary("user-get-other", "root", false, func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
			return authOf(cli).UserGet(ctx, &pb.AuthUserGetRequest{Name: r.caller.otherUser})
		}),
		unary("role-get-own", "root alice", false, func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
			return authOf(cli).RoleGet(ctx, &pb.AuthRoleGetRequest{Role: r.caller.ownRole})
		}),
		unary("role-get-other", "root", false, func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
			return authOf(cli).RoleGet(ctx, &pb.AuthRoleGetRequest{Role: r.caller.otherRole})
		}),
		unary("role-list", "root", false, func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return authOf(cli).RoleList(ctx, &pb.AuthRoleListRequest{})
		}),
	)
	return ops
}

func (env *matrixEnv) writeOps() []matrixOp {
	put := func(key, value string) *pb.PutRequest { return &pb.PutRequest{Key: []byte(key), Value: []byte(value)} }
	withPrev := func(r *pb.PutRequest) *pb.PutRequest { r.PrevKv = true; return r }
	withLease := func(r *pb.PutRequest, id int64) *pb.PutRequest { r.Lease = id; return r }
	return []matrixOp{
		putOp("put-allowed", "root alice", put("/alice/w1", "new")),
		putOp("put-allowed-prevkv", "root alice", withPrev(put("/alice/w1", "new"))),
		putOp("put-allowed-new-key", "root alice", withPrev(put("/alice/new", "new"))),
		putOp("put-denied", "root", put("/secret/w", "stolen")),
		putOp("put-denied-prevkv", "root", withPrev(put("/secret/w", "stolen"))),
		putOp("put-denied-new-key", "root", put("/secret/new", "stolen")),
		putOp("put-read-only-key", "root", put("/shared", "stolen")),
		putOp("put-write-only-key", "root alice", put("/dropbox", "new")),
		putOp("put-write-only-key-prevkv", "root", withPrev(put("/dropbox", "new"))),
		putOp("put-lease-alice", "root alice", withPrev(withLease(put("/alice/w1", "new"), env.leaseA))),
		putOp("put-lease-secret", "root", withLease(put("/alice/w1", "new"), env.leaseS)),
		writeOp("put-lease-fresh-alice", "root alice", func(ctx context.Context, kv pb.KVClient, r *opRun) (proto.Message, error) {
			return kv.Put(ctx, withLease(put("/alice/w2", "new"), r.fa))
		}),

		deleteOp("delete-allowed", "root alice", &pb.DeleteRangeRequest{Key: []byte("/alice/w1")}),
		deleteOp("delete-allowed-prevkv", "root alice", &pb.DeleteRangeRequest{Key: []byte("/alice/w1"), PrevKv: true}),
		deleteOp("delete-range-prevkv", "root alice", &pb.DeleteRangeRequest{Key: []byte("/alice/w1"), RangeEnd: []byte("/alice/w3"), PrevKv: true}),
		deleteOp("delete-missing", "root alice", &pb.DeleteRangeRequest{Key: []byte("/alice/nokey")}),
		deleteOp("delete-denied", "root", &pb.DeleteRangeRequest{Key: []byte("/secret/w")}),
		deleteOp("delete-denied-prefix", "root", &pb.DeleteRangeRequest{Key: []byte("/secret/w"), RangeEnd: prefixEnd("/secret/w"), PrevKv: true}),
		deleteOp("delete-write-only-key", "root alice", &pb.DeleteRangeRequest{Key: []byte("/dropbox")}),
		deleteOp("delete-write-only-key-prevkv", "root", &pb.DeleteRangeRequest{Key: []byte("/dropbox"), PrevKv: true}),

		txnOp("txn-allowed", "root alice", true, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/w1", "w1")},
			Success: []*pb.RequestOp{reqPut("/alice/w2", "t"), reqRange("/alice/w1")},
			Failure: []*pb.RequestOp{reqDelete("/alice/w2")},
		}),
		txnOp("txn-allowed-failure-branch", "root alice", true, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/w1", "not")},
			Success: []*pb.RequestOp{reqRange("/alice/w1")},
			Failure: []*pb.RequestOp{reqDelete("/alice/w2"), reqPut("/dropbox", "t")},
		}),
		txnOp("txn-denied-branch-op", "root", true, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/w1", "w1")},
			Success: []*pb.RequestOp{reqPut("/alice/w2", "t")},
			Failure: []*pb.RequestOp{reqPut("/secret/w", "stolen")},
		}),
		txnOp("txn-denied-read-in-branch", "root", true, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/w1", "w1")},
			Success: []*pb.RequestOp{reqPut("/alice/w2", "t"), reqRange("/dropbox")},
		}),
		txnOp("txn-denied-compare", "root", true, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/secret/w", "sw")},
			Success: []*pb.RequestOp{reqPut("/alice/w2", "t")},
		}),
		txnOp("txn-nested-allowed", "root alice", true, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/w1", "w1")},
			Success: []*pb.RequestOp{reqTxn(&pb.TxnRequest{
				Compare: []*pb.Compare{cmpValue("/alice/w2", "w2")},
				Success: []*pb.RequestOp{reqPut("/alice/new", "nested"), reqRange("/shared")},
				Failure: []*pb.RequestOp{reqRange("/alice/w2")},
			})},
		}),
		txnOp("txn-nested-denied", "root", true, &pb.TxnRequest{
			Compare: []*pb.Compare{cmpValue("/alice/w1", "w1")},
			Success: []*pb.RequestOp{reqTxn(&pb.TxnRequest{
				Compare: []*pb.Compare{cmpValue("/alice/w2", "w2")},
				Success: []*pb.RequestOp{reqPut("/alice/new", "nested")},
				Failure: []*pb.RequestOp{reqRange("/secret/w")},
			})},
		}),

		{name: "lease-grant", allow: "authn", write: true, norm: clearLeaseID, call: func(ctx context.Context, cli *clientv3.Client, _ *opRun) (proto.Message, error) {
			return leaseOf(cli).LeaseGrant(ctx, &pb.LeaseGrantRequest{TTL: 60})
		}},
		{name: "lease-revoke-alice", allow: "root alice", write: true, call: func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
			return leaseOf(cli).LeaseRevoke(ctx, &pb.LeaseRevokeRequest{ID: r.fa})
		}},
		{name: "lease-revoke-secret", allow: "root", write: true, call: func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
			return leaseOf(cli).LeaseRevoke(ctx, &pb.LeaseRevokeRequest{ID: r.fs})
		}},
		{name: "compact", allow: "root", write: true, compact: true, call: func(ctx context.Context, cli *clientv3.Client, r *opRun) (proto.Message, error) {
			cr, err := r.env.compactRev(ctx)
			if err != nil {
				return nil, fmt.Errorf("etcd's compaction revision: %w", err)
			}
			return kvOf(cli).Compact(ctx, &pb.CompactionRequest{Revision: cr + 1})
		}},
	}
}

func sortLeases(m proto.Message) {
	if r, ok := m.(*pb.LeaseLeasesResponse); ok {
		sort.Slice(r.Leases, func(i, j int) bool { return r.Leases[i].ID < r.Leases[j].ID })
	}
}

func clearLeaseID(m proto.Message) {
	if r, ok := m.(*pb.LeaseGrantResponse); ok {
		r.ID = 0
	}
}

// normalize returns a copy of m without what etcd and the proxy may differ
// in legitimately: every header's member_id and raft_term, and with
// noRevisions every revision (headers', and key-values' create and mod
// revisions and versions: write runs start from a reset state).
func normalize(m proto.Message, noRevisions bool, norm func(proto.Message)) proto.Message {
	if m == nil || !m.ProtoReflect().IsValid() {
		return m
	}
	m = proto.Clone(m)
	var walk func(protoreflect.Message)
	walk = func(rm protoreflect.Message) {
		switch v := rm.Interface().(type) {
		case *pb.ResponseHeader:
			v.MemberId, v.RaftTerm = 0, 0
			if noRevisions {
				v.Revision = 0
			}
		case *mvccpb.KeyValue:
			if noRevisions {
				v.CreateRevision, v.ModRevision, v.Version = 0, 0, 0
			}
		}
		rm.Range(func(fd protoreflect.FieldDescriptor, val protoreflect.Value) bool {
			switch {
			case fd.IsMap():
			case fd.IsList() && fd.Message() != nil:
				for i := 0; i < val.List().Len(); i++ {
					walk(val.List().Get(i).Message())
				}
			case !fd.IsList() && fd.Message() != nil:
				walk(val.Message())
			}
			return true
		})
	}
	walk(m.ProtoReflect())
	if norm != nil {
		norm(m)
	}
	return m
}

// diffOutcomes compares two answers: the same message, or errors with the
// same code and message. It returns "" when they agree.
func diffOutcomes(d proto.Message, dErr error, p proto.Message, pErr error) string {
	switch {
	case dErr == nil && pErr == nil:
		if proto.Equal(d, p) {
			return ""
		}
	case dErr != nil && pErr != nil:
		ds, ps := status.Convert(dErr), status.Convert(pErr)
		if ds.Code() == ps.Code() && ds.Message() == ps.Message() {
			return ""
		}
	}
	return fmt.Sprintf("etcd:  %s\nproxy: %s", fmtOutcome(d, dErr), fmtOutcome(p, pErr))
}

// etcdAllowed reports whether etcd's answer serves the request (a watch
// refused is created and canceled).
func etcdAllowed(resp proto.Message, err error) bool {
	if w, ok := resp.(*pb.WatchResponse); ok && err == nil {
		return !w.Canceled
	}
	return err == nil
}

// judge checks etcd's answer against the matrix's expectation and compares
// the proxy's with it.
func (env *matrixEnv) judge(t *testing.T, c *matrixCaller, op matrixOp, d proto.Message, dErr error, p proto.Message, pErr error) {
	t.Helper()
	if want, got := c.allowedBy(op.allow), etcdAllowed(d, dErr); want != got {
		t.Errorf("TEST EXPECTATION: etcd served=%v, the matrix expected served=%v: %s", got, want, fmtOutcome(d, dErr))
	}
	if op.outcomeOnly {
		if dErr == nil {
			d = &pb.ResponseHeader{}
		}
		if pErr == nil {
			p = &pb.ResponseHeader{}
		}
	}
	d, p = normalize(d, op.write, op.norm), normalize(p, op.write, op.norm)
	// A lease's remaining TTL may tick between the two reads.
	if dl, ok := d.(*pb.LeaseTimeToLiveResponse); ok && dErr == nil {
		if pl, ok := p.(*pb.LeaseTimeToLiveResponse); ok && pErr == nil && pl.TTL >= dl.TTL-1 && pl.TTL <= dl.TTL+1 {
			pl.TTL = dl.TTL
		}
	}
	if diff := diffOutcomes(d, dErr, p, pErr); diff != "" {
		t.Errorf("%s/%s/%s: proxy and etcd disagree\n%s", env.mode, c.name, op.name, diff)
	}
}

// runRead sends a request that changes nothing to etcd and to the proxy.
func (env *matrixEnv) runRead(t *testing.T, c *matrixCaller, op matrixOp) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*rpcTimeout)
	defer cancel()
	d, dErr := op.call(ctx, c.etcd, &opRun{env: env, caller: c})
	p, pErr := op.call(ctx, c.proxy, &opRun{env: env, caller: c})
	env.judge(t, c, op, d, dErr, p, pErr)
}

// runWrite sends a request that may change etcd through the proxy, then
// to etcd, each time from the same state, and compares the answers
// (without revisions) and etcd's state after each.
func (env *matrixEnv) runWrite(t *testing.T, c *matrixCaller, op matrixOp) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*rpcTimeout)
	defer cancel()
	var (
		resps   [2]proto.Message
		errs    [2]error
		effects [2]string
	)
	for i, cli := range []*clientv3.Client{c.proxy, c.etcd} {
		fa, fs := env.reset(t)
		var before int64
		if op.compact {
			var err error
			if before, err = env.compactRev(ctx); err != nil {
				t.Fatal(err)
			}
		}
		resps[i], errs[i] = op.call(ctx, cli, &opRun{env: env, caller: c, fa: fa, fs: fs})
		effects[i] = env.snapshot(t, fa, fs)
		if op.compact {
			after, err := env.compactRev(ctx)
			if err != nil {
				t.Fatal(err)
			}
			effects[i] += fmt.Sprintf(" compacted=%v", after > before)
		}
	}
	env.judge(t, c, op, resps[1], errs[1], resps[0], errs[0])
	if effects[0] != effects[1] {
		t.Errorf("%s/%s/%s: etcd's state differs\nafter the request to etcd:          %s\nafter the request through the proxy: %s", env.mode, c.name, op.name, effects[1], effects[0])
	}
}

// testCacheUse: alice's allowed reads are served from the proxy's cache
// (etcd_snapcache_range_requests_total{source="cache"}), none forwarded.
func (env *matrixEnv) testCacheUse(t *testing.T) {
	alice := env.caller("alice")
	env.waitSynced(t)
	reqs := []*pb.RangeRequest{
		{Key: []byte("/alice/x")},
		{Key: []byte("/alice/x"), Serializable: true},
		{Key: []byte("/alice/x"), Revision: env.r1},
		{Key: []byte("/alice/x"), Revision: env.r1, Serializable: true},
		{Key: []byte("/alice/"), RangeEnd: prefixEnd("/alice/"), Serializable: true},
		{Key: []byte("/alice/"), RangeEnd: prefixEnd("/alice/"), CountOnly: true, Serializable: true},
		{Key: []byte("/alice/"), RangeEnd: prefixEnd("/alice/"), KeysOnly: true, Serializable: true},
		{Key: []byte("/shared"), Serializable: true},
	}
	// counts are the proxy's Range counters by "source/reason".
	counts := func() map[string]float64 { return rangeCounts(t, env.proxy) }
	read := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
		defer cancel()
		for _, req := range reqs {
			if _, err := kvOf(alice.proxy).Range(ctx, req); err != nil {
				return fmt.Errorf("%v: %v", fmtMsg(req), err)
			}
		}
		return nil
	}
	if err := read(); err != nil { // warms the proxy's trust in alice's identity
		t.Fatalf("alice's allowed read through the proxy failed: %v", err)
	}
	// A token is re-checked with etcd every few seconds: a read may
	// legitimately go to etcd once in a while, so three tries.
	var last string
	for range 3 {
		before := counts()
		if err := read(); err != nil {
			t.Fatalf("alice's allowed read through the proxy failed: %v", err)
		}
		after := counts()
		var cached float64
		var elsewhere []string
		for k, v := range after {
			if d := v - before[k]; d > 0 && strings.HasPrefix(k, "cache/") {
				cached += d
			} else if d > 0 {
				elsewhere = append(elsewhere, fmt.Sprintf("%v %s", d, k))
			}
		}
		if cached == float64(len(reqs)) && len(elsewhere) == 0 {
			return
		}
		sort.Strings(elsewhere)
		last = fmt.Sprintf("of alice's %d allowed reads, %v were served from the cache; the others: %v", len(reqs), cached, elsewhere)
	}
	t.Error(last)
}

// tokenClient is a client of ep that sends token as is (clientv3 does not
// refresh a token it was given).
func tokenClient(t *testing.T, ep, token string, tlsCfg *tls.Config) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, Token: token, TLS: tlsCfg, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// tokenPair authenticates user through etcd and through the proxy and
// returns a client of each carrying the token it got.
func (env *matrixEnv) tokenPair(t *testing.T, user, password string) (etcd, proxy *clientv3.Client) {
	t.Helper()
	base := env.caller(env.tokenCaller)
	return tokenClient(t, env.etcdEP, authenticate(t, base.etcd, user, password), env.tokenTLS(t)),
		tokenClient(t, env.proxyEP, authenticate(t, base.proxy, user, password), env.tokenTLS(t))
}

// compareRead sends req to etcd and to the proxy; it returns the
// difference ("" if none) and etcd's answer.
func compareRead(etcd, proxy *clientv3.Client, req *pb.RangeRequest) (string, *pb.RangeResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	d, dErr := kvOf(etcd).Range(ctx, req)
	p, pErr := kvOf(proxy).Range(ctx, req)
	if diff := diffOutcomes(normalize(d, false, nil), dErr, normalize(p, false, nil), pErr); diff != "" {
		return fmt.Sprintf("%s\n%s", fmtMsg(req), diff), d, dErr
	}
	return "", d, dErr
}

// followEtcd waits up to within until the proxy answers req as etcd does,
// and checks etcd's answer against wantErr ("" for success).
func followEtcd(t *testing.T, within time.Duration, what string, etcd, proxy *clientv3.Client, req *pb.RangeRequest, wantErr string) {
	t.Helper()
	testsupport.Poll(t, within, 10*time.Millisecond, what, func() (bool, error) {
		diff, _, dErr := compareRead(etcd, proxy, req)
		if got := errText(dErr); got != wantErr {
			t.Fatalf("TEST EXPECTATION: %s: etcd answered %q, want %q", what, got, wantErr)
		}
		if diff != "" {
			return false, errors.New(diff)
		}
		return true, nil
	})
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return status.Convert(err).Message()
}

const (
	errPermissionDenied = "etcdserver: permission denied"
	errInvalidToken     = "etcdserver: invalid auth token"
	errUserEmpty        = "etcdserver: user name is empty"
)

// testRevocation: changes of etcd's auth state bind the proxy as they bind
// etcd: a revoked permission at once for a linearizable read and within
// authFollowWithin for a serializable one; a changed password or a deleted
// user ends the tokens within authFollowWithin; disabling and enabling auth
// changes anonymous callers' answers within authFollowWithin.
func (env *matrixEnv) testRevocation(t *testing.T) {
	root := env.root
	aliceX := &pb.RangeRequest{Key: []byte("/alice/x")}
	aliceXSer := &pb.RangeRequest{Key: []byte("/alice/x"), Serializable: true}

	t.Run("revoke-permission", func(t *testing.T) {
		alice := env.caller("alice")
		env.waitSynced(t)
		for _, req := range []*pb.RangeRequest{aliceX, aliceXSer} { // the cache may hold alice's rights now
			if diff, _, err := compareRead(alice.etcd, alice.proxy, req); diff != "" || err != nil {
				t.Errorf("before the revocation: %v %s", err, diff)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		if _, err := root.RoleRevokePermission(ctx, "alice", "/alice/", clientv3.GetPrefixRangeEnd("/alice/")); err != nil {
			t.Fatal(err)
		}
		granted := false
		grant := func() {
			if granted {
				return
			}
			granted = true
			if _, err := root.RoleGrantPermission(ctx, "alice", "/alice/", clientv3.GetPrefixRangeEnd("/alice/"), clientv3.PermissionType(clientv3.PermReadWrite)); err != nil {
				t.Fatal(err)
			}
		}
		defer grant()
		// At once: the proxy first, so that it cannot lag behind etcd.
		p, pErr := kvOf(alice.proxy).Range(ctx, aliceX)
		d, dErr := kvOf(alice.etcd).Range(ctx, aliceX)
		if errText(dErr) != errPermissionDenied {
			t.Errorf("TEST EXPECTATION: etcd answered alice's revoked read %s", fmtOutcome(d, dErr))
		}
		if diff := diffOutcomes(d, dErr, p, pErr); diff != "" {
			t.Errorf("alice's linearizable read right after the revocation:\n%s", diff)
		}
		followEtcd(t, authFollowWithin, "alice's revoked serializable read to be refused", alice.etcd, alice.proxy, aliceXSer, errPermissionDenied)
		grant()
		followEtcd(t, waitTimeout, "alice's serializable read to be served again", alice.etcd, alice.proxy, aliceXSer, "")
		followEtcd(t, waitTimeout, "alice's linearizable read to be served again", alice.etcd, alice.proxy, aliceX, "")
	})

	t.Run("change-password", func(t *testing.T) {
		etcd, proxy := env.tokenPair(t, "alice", "alicepw")
		env.waitSynced(t)
		followEtcd(t, waitTimeout, "alice's token read before the change", etcd, proxy, aliceXSer, "")
		changeAlicePassword(t, root)
		followEtcd(t, authFollowWithin, "alice's old token to be refused", etcd, proxy, aliceXSer, errInvalidToken)
		followEtcd(t, authFollowWithin, "alice's old token to be refused (linearizable)", etcd, proxy, aliceX, errInvalidToken)
	})

	// etcd does not check the token an Authenticate carries, so another
	// user's Authenticate through the proxy with a dead token proves
	// nothing of it: the token stays refused.
	t.Run("dead-token-stays-dead", func(t *testing.T) {
		base := env.caller(env.tokenCaller)
		token := authenticate(t, base.proxy, "alice", "alicepw")
		etcd := tokenClient(t, env.etcdEP, authenticate(t, base.etcd, "alice", "alicepw"), env.tokenTLS(t))
		proxy := tokenClient(t, env.proxyEP, token, env.tokenTLS(t))
		// A second token of alice's shows when the proxy has followed the
		// change, without using (and so ending) the first one there.
		probe := tokenClient(t, env.proxyEP, authenticate(t, base.proxy, "alice", "alicepw"), env.tokenTLS(t))
		env.waitSynced(t)
		followEtcd(t, waitTimeout, "alice's token read before the change", etcd, proxy, aliceXSer, "")
		followEtcd(t, waitTimeout, "alice's second token read before the change", etcd, probe, aliceXSer, "")
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		changeAlicePassword(t, root)
		followEtcd(t, authFollowWithin, "alice's second old token to be refused", etcd, probe, aliceXSer, errInvalidToken)
		withDeadToken := metadata.AppendToOutgoingContext(ctx, rpctypes.TokenFieldNameGRPC, token)
		if _, err := authOf(base.proxy).Authenticate(withDeadToken, &pb.AuthenticateRequest{Name: "bob", Password: "bobpw"}); err != nil {
			t.Fatalf("bob's Authenticate carrying alice's old token: %v", err)
		}
		if diff, _, dErr := compareRead(etcd, proxy, aliceXSer); diff != "" || errText(dErr) != errInvalidToken {
			t.Fatalf("alice's old token after an Authenticate that carried it: etcd %q; %s", errText(dErr), diff)
		}
	})

	// Certificate callers are the ones the proxy alone checks.
	if env.mode == "cert" {
		t.Run("unrelated-changes", env.testUnrelatedChanges)
	}

	// etcd takes a token key sent empty for a token, and refuses it; the
	// proxy must not take it for no token (an anonymous caller, or the
	// caller's certificate).
	t.Run("empty-token", func(t *testing.T) {
		env.waitSynced(t)
		// Raw connections: clientv3 retries an invalid token for seconds.
		type rawCaller struct {
			name        string
			etcd, proxy pb.KVClient
		}
		callers := []rawCaller{{env.tokenCaller, rawKV(t, env.etcdEP, env.tokenTLS(t)), rawKV(t, env.proxyEP, env.tokenTLS(t))}}
		if env.mode == "cert" {
			callers = append(callers, rawCaller{"alice", rawKV(t, env.etcdEP, env.certTLS(t, "alice")), rawKV(t, env.proxyEP, env.certTLS(t, "alice"))})
		}
		for _, c := range callers {
			for _, md := range [][2]string{
				{rpctypes.TokenFieldNameGRPC, ""},
				{rpctypes.TokenFieldNameSwagger, ""},
				{rpctypes.TokenFieldNameSwagger, "Bearer "},
			} {
				for _, req := range []*pb.RangeRequest{aliceXSer, aliceX} {
					ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
					ctx = metadata.AppendToOutgoingContext(ctx, md[0], md[1])
					d, dErr := c.etcd.Range(ctx, req)
					p, pErr := c.proxy.Range(ctx, req)
					cancel()
					if diff := diffOutcomes(normalize(d, false, nil), dErr, normalize(p, false, nil), pErr); diff != "" {
						t.Errorf("%s with %s=%q: %s\n%s", c.name, md[0], md[1], fmtMsg(req), diff)
					}
				}
			}
		}
	})

	t.Run("delete-user", func(t *testing.T) {
		etcd, proxy := env.tokenPair(t, "bob", "bobpw")
		bob := env.caller("bob")
		followEtcd(t, waitTimeout, "bob's token read before the deletion", etcd, proxy, aliceXSer, errPermissionDenied)
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		if _, err := root.UserDelete(ctx, "bob"); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if _, err := root.UserAdd(ctx, "bob", "bobpw"); err != nil {
				t.Fatal(err)
			}
		}()
		followEtcd(t, authFollowWithin, "deleted bob's token to be refused", etcd, proxy, aliceXSer, errInvalidToken)
		followEtcd(t, authFollowWithin, "deleted bob's token to be refused (all keys)", etcd, proxy, &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, Serializable: true}, errInvalidToken)
		// The matrix's bob: his token ended, or his certificate names a
		// user that is gone.
		want := errInvalidToken
		if env.mode == "cert" {
			want = errPermissionDenied
		}
		followEtcd(t, authFollowWithin, "deleted bob to be refused", bob.etcd, bob.proxy, aliceXSer, want)
	})

	t.Run("disable-auth", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		env.waitSynced(t)
		if _, err := root.AuthDisable(ctx); err != nil {
			t.Fatal(err)
		}
		enabled := false
		enable := func() {
			if enabled {
				return
			}
			enabled = true
			if _, err := root.AuthEnable(ctx); err != nil {
				t.Fatal(err)
			}
		}
		defer enable()
		reqs := []*pb.RangeRequest{
			{Key: []byte("/secret"), Serializable: true},
			{Key: []byte("/secret")},
			{Key: []byte{0}, RangeEnd: []byte{0}, Serializable: true},
		}
		for _, c := range env.callers {
			if c.anonymous {
				for _, req := range reqs {
					followEtcd(t, authFollowWithin, c.name+"'s read with auth disabled", c.etcd, c.proxy, req, "")
				}
			}
		}
		enable()
		for _, c := range env.callers {
			if c.anonymous {
				want := errPermissionDenied
				if !c.authn {
					want = errUserEmpty
				}
				for _, req := range reqs {
					followEtcd(t, authReenableWithin, c.name+"'s read with auth enabled again", c.etcd, c.proxy, req, want)
				}
			}
		}
	})
}

// rawKV is a KV client of ep on a plain gRPC connection, without clientv3's
// retries and token handling.
func rawKV(t *testing.T, ep string, tlsCfg *tls.Config) pb.KVClient {
	t.Helper()
	creds := insecure.NewCredentials()
	if tlsCfg != nil {
		creds = credentials.NewTLS(tlsCfg)
	}
	addr := ep[strings.Index(ep, "://")+3:]
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return pb.NewKVClient(conn)
}

// testUnrelatedChanges: an auth change that does not concern a certificate
// caller leaves its reads served: the proxy waits while it reads the users
// and roles again, rather than refuse the caller it alone can check.
func (env *matrixEnv) testUnrelatedChanges(t *testing.T) {
	root := env.root
	aliceX := &pb.RangeRequest{Key: []byte("/alice/x")}
	aliceXSer := &pb.RangeRequest{Key: []byte("/alice/x"), Serializable: true}
	alice, bob := env.caller("alice"), env.caller("bob")
	env.waitSynced(t)
	followEtcd(t, waitTimeout, "alice's read before the changes", alice.etcd, alice.proxy, aliceXSer, "")
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	// readsThrough reads as alice while bob's linearizable read makes
	// the proxy learn of the change and read the users and roles again.
	readsThrough := func(change string) {
		learned := make(chan struct{})
		go func() {
			defer close(learned)
			kvOf(bob.proxy).Range(ctx, aliceX) // its answer does not matter
		}()
		for i := 0; i < 5000; i++ {
			if _, err := kvOf(alice.proxy).Range(ctx, aliceXSer); err != nil {
				t.Errorf("alice's read after %s: %v", change, err)
				break
			}
			select {
			case <-learned:
				i = 5000
			default:
			}
		}
		<-learned
	}
	for i := range 10 {
		role := fmt.Sprintf("unrelated-%d", i)
		if _, err := root.RoleAdd(ctx, role); err != nil {
			t.Fatal(err)
		}
		readsThrough("adding role " + role)
		if _, err := root.RoleDelete(ctx, role); err != nil {
			t.Fatal(err)
		}
		readsThrough("deleting role " + role)
	}
}

// changeAlicePassword changes alice's password, which ends her tokens, and
// restores it when the test ends.
func changeAlicePassword(t *testing.T, root *clientv3.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if _, err := root.UserChangePassword(ctx, "alice", "alicepw2"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		if _, err := root.UserChangePassword(ctx, "alice", "alicepw"); err != nil {
			t.Error(err)
		}
	})
}
