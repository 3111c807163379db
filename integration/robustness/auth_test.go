package robustness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/storage/datadir"
	"go.etcd.io/etcd/server/v3/storage/wal"
	"go.etcd.io/etcd/tests/v3/robustness/model"
	"go.etcd.io/etcd/tests/v3/robustness/report"
	"go.etcd.io/raft/v3/raftpb"
)

// TestRobustnessAuth is TestRobustness against an etcd with auth enabled:
// the proxy runs as root (server.Config User and Password), the key-value
// and watch traffic as a user whose role may read and write only the keys
// that traffic uses, the watch that collects every event as a user that may
// read every key, and the compaction traffic as root (etcd allows Compact
// to admins only).
//
// The framework's RecordingClient builds its clientv3.Config itself, with
// endpoints and no credentials, so each user's clients reach the proxy
// through a tokenFront, which adds the user's token to every call as
// clientv3 does for a client configured with a user name and password.
//
// The scenarios and validations are TestRobustness's, under the upstream
// cut. The restart fault is TestRobustness's alone: a restart leaves tens of
// writes of unknown outcome, and with the token renewals it adds, etcd's
// linearization checker ran past its 5 minutes in one CI run in three
// (the checker's cost, not a finding; the restart invalidates every simple
// token, and both the proxy and the fronts renew theirs).
func TestRobustnessAuth(t *testing.T) {
	withRequestTimeout(t)
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			testRobustness(t, sc.traffic, cutUpstream, options{auth: true})
		})
	}
}

// The users of an auth run. The traffic's role covers exactly the keys the
// framework's key-value and watch traffic read and write: the etcd-shaped
// keys ("key0".."keyN", and "key" that the watch traffic and the empty
// database check read, all under the prefix "key"), the Kubernetes-shaped
// objects (/registry/pods/), and the final write of "tombstone". The event
// collector watches the whole keyspace (clientv3 sends a watch of the empty
// prefix as ["\x00", "\x00")), so its role may read every key. The
// compaction traffic runs as root: etcd 3.7 refuses Compact to any user
// without the root role (kvServer.Compact checks admin permission), and the
// Kubernetes compactor's compact_rev_key Txn goes with it.
const (
	rootUser, rootPassword       = "root", "rootpw"
	trafficUser, trafficPassword = "traffic", "trafficpw"
	watchUser, watchPassword     = "watcher", "watcherpw"
)

var trafficPermissions = []struct{ key, end string }{
	{"key", clientv3.GetPrefixRangeEnd("key")},
	{"/registry/pods/", clientv3.GetPrefixRangeEnd("/registry/pods/")},
	{"tombstone", ""},
}

// setUpAuth creates the users and roles of an auth run and enables auth.
// None of it writes a key: the traffic still finds etcd at revision 1.
func setUpAuth(t *testing.T, e *embed.Etcd) {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{"http://" + e.Clients[0].Addr().String()},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	// etcd hashes every password with bcrypt's default cost, which takes
	// most of a second under the race detector.
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	steps := []func() error{
		func() error { _, err := cli.RoleAdd(ctx, rootUser); return err },
		func() error { _, err := cli.UserAdd(ctx, rootUser, rootPassword); return err },
		func() error { _, err := cli.UserGrantRole(ctx, rootUser, rootUser); return err },
		func() error { _, err := cli.RoleAdd(ctx, trafficUser); return err },
		func() error { _, err := cli.UserAdd(ctx, trafficUser, trafficPassword); return err },
		func() error { _, err := cli.UserGrantRole(ctx, trafficUser, trafficUser); return err },
		func() error { _, err := cli.RoleAdd(ctx, watchUser); return err },
		func() error {
			_, err := cli.RoleGrantPermission(ctx, watchUser, "\x00", "\x00", clientv3.PermissionType(clientv3.PermRead))
			return err
		},
		func() error { _, err := cli.UserAdd(ctx, watchUser, watchPassword); return err },
		func() error { _, err := cli.UserGrantRole(ctx, watchUser, watchUser); return err },
	}
	for _, p := range trafficPermissions {
		steps = append(steps, func() error {
			_, err := cli.RoleGrantPermission(ctx, trafficUser, p.key, p.end, clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		})
	}
	steps = append(steps, func() error { _, err := cli.AuthEnable(ctx); return err })
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatalf("setting up auth: %v", err)
		}
	}
}

// persistedRequests returns the requests persisted in etcd's WAL, as the
// validations take them (report.PersistedRequests), through
// persistedFromEntries.
func persistedRequests(t *testing.T, lg *zap.Logger, dataDir string) ([]model.EtcdRequest, error) {
	state, ents, err := report.ReadWAL(lg, dataDir)
	if err != nil {
		return nil, err
	}
	if state == nil {
		state = &raftpb.HardState{}
	}
	return persistedFromEntries(t, lg, state, ents)
}

// blankAuthRequests empties the data of ents' auth requests, which change
// no key and which report.PersistedRequests, knowing only the KV, lease,
// compaction and cluster requests, panics on (it skips an entry without
// data): with auth enabled Authenticate, AuthStatus, and the user and role
// calls of the set-up and of the proxy's auth mirror; with auth disabled,
// an AuthStatus of the proxy's when a linearizable read arrives before its
// mirror has learned etcd's auth state. It returns how many it emptied.
func blankAuthRequests(ents []*raftpb.Entry) int {
	blanked := 0
	for _, e := range ents {
		if e.GetType() != raftpb.EntryNormal || len(e.GetData()) == 0 {
			continue
		}
		var r pb.InternalRaftRequest
		if err := proto.Unmarshal(e.GetData(), &r); err != nil {
			continue // the reader decides what to do with it
		}
		if isAuthRequest(&r) {
			e.Data = nil
			blanked++
		}
	}
	return blanked
}

// persistedFromEntries returns the requests report.PersistedRequests reads,
// with the auth requests left out (blankAuthRequests),
// from a WAL of ents under state, written into a new data directory.
func persistedFromEntries(t *testing.T, lg *zap.Logger, state *raftpb.HardState, ents []*raftpb.Entry) ([]model.EtcdRequest, error) {
	if n := blankAuthRequests(ents); n > 0 {
		t.Logf("WAL: %d entries, %d auth requests left out", len(ents), n)
	}
	dir := t.TempDir()
	w, err := wal.Create(lg, datadir.ToWALDir(dir), nil)
	if err != nil {
		return nil, err
	}
	err = w.Save(state, ents)
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("writing a copy of the WAL: %w", err)
	}
	return report.PersistedRequests(lg, []string{dir})
}

// isAuthRequest tells whether a raft request is one of etcd's auth
// requests, whose fields are all named auth* (authenticate, auth_enable,
// auth_user_add, ...), and nothing else.
func isAuthRequest(r *pb.InternalRaftRequest) bool {
	auth, other := false, false
	r.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		switch name := string(fd.Name()); {
		case name == "header" || name == "ID":
		case strings.HasPrefix(name, "auth"):
			auth = true
		default:
			other = true
		}
		return true
	})
	return auth && !other
}

// tokenFront is a gRPC endpoint on loopback that forwards every call, as
// raw frames, to the proxy with a user's token in the call's metadata, for
// clients that cannot carry credentials. As clientv3's interceptors do for
// a client configured with the user's name and password, it authenticates
// (through the proxy, so that the proxy sees the token issued) when it
// starts, and again when a call fails because the token is no longer valid
// (etcd's "invalid auth token", "revision of auth store is old" or "user
// name is empty"), which it then retries with the new token. Such a call
// was refused before it was applied, so the retry is safe. A call whose
// client sends one message (unary calls, RangeStream) is retried if it
// fails so before its first response; a watch stream is relayed as it is,
// and a watch canceled for its token renews the token for the next streams
// (the client opens a new stream once its last watch is canceled).
//
// Unlike clientv3, which also authenticates for every stream it opens, it
// keeps its token until etcd refuses it: each Authenticate costs etcd a
// bcrypt check of the password, most of a second under the race detector,
// and the traffic opens streams by the hundred.
//
// Close stops it and waits for every goroutine it started.
type tokenFront struct {
	user, password string
	lis            net.Listener
	srv            *grpc.Server
	conn           *grpc.ClientConn // to the proxy
	// clientStreams are the methods whose clients send a stream of
	// messages (Watch, LeaseKeepAlive).
	clientStreams map[string]bool
	ctx           context.Context // ends with Close
	cancel        context.CancelFunc
	wg            sync.WaitGroup
	closeOnce     sync.Once

	mu     sync.Mutex
	token  string
	flight *authFlight // the authentication under way, if any

	calls, authentications, retries atomic.Int64
}

// authFlight is one authentication, which every call that found the same
// token invalid waits for.
type authFlight struct {
	done  chan struct{}
	token string
	err   error
}

// authTimeout bounds one authentication: etcd checks the password with
// bcrypt, which takes most of a second under the race detector.
const authTimeout = 30 * time.Second

// maxAttempts bounds the attempts of a call whose token is renewed.
const maxAttempts = 3

func newTokenFront(t *testing.T, proxyAddr, user, password string) *tokenFront {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+proxyAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		conn.Close()
		t.Fatal(err)
	}
	f := &tokenFront{user: user, password: password, lis: lis, conn: conn, clientStreams: map[string]bool{}}
	for _, d := range []*grpc.ServiceDesc{&pb.KV_ServiceDesc, &pb.Watch_ServiceDesc, &pb.Lease_ServiceDesc,
		&pb.Cluster_ServiceDesc, &pb.Maintenance_ServiceDesc, &pb.Auth_ServiceDesc} {
		for _, s := range d.Streams {
			if s.ClientStreams {
				f.clientStreams["/"+d.ServiceName+"/"+s.StreamName] = true
			}
		}
	}
	f.ctx, f.cancel = context.WithCancel(context.Background())
	// Stop waits for the handlers, which start goroutines of f.wg: none
	// can start once Close waits for them.
	f.srv = grpc.NewServer(grpc.ForceServerCodec(rawCodec{}), grpc.UnknownServiceHandler(f.handle), grpc.WaitForHandlers(true))
	t.Cleanup(f.Close)
	token, err := f.renew()
	if err != nil {
		t.Fatalf("authenticating %s through the proxy: %v", user, err)
	}
	f.token = token
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		_ = f.srv.Serve(lis) // returns once Close stops the server
	}()
	return f
}

// Addr is the front's host:port.
func (f *tokenFront) Addr() string { return f.lis.Addr().String() }

// Close stops the front and waits for its goroutines.
func (f *tokenFront) Close() {
	f.closeOnce.Do(func() {
		f.cancel()
		// Ends every call and waits for the handlers; the relaying
		// goroutines' receives then fail.
		f.srv.Stop()
		f.lis.Close()
		f.conn.Close()
		f.wg.Wait()
	})
}

func (f *tokenFront) String() string {
	return fmt.Sprintf("%s: %d calls, %d authentications, %d calls retried with a new token",
		f.user, f.calls.Load(), f.authentications.Load(), f.retries.Load())
}

func (f *tokenFront) currentToken() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.token
}

// renew authenticates the user through the proxy, with the front's own
// context: a call's deadline (a second for the traffic) must not cut short
// an authentication that other calls wait for.
func (f *tokenFront) renew() (string, error) {
	f.authentications.Add(1)
	ctx, cancel := context.WithTimeout(f.ctx, authTimeout)
	defer cancel()
	resp, err := pb.NewAuthClient(f.conn).Authenticate(ctx, &pb.AuthenticateRequest{Name: f.user, Password: f.password})
	if err != nil {
		return "", err
	}
	return resp.GetToken(), nil
}

// startRenewal starts renewing the token if it is still the one that
// failed and no renewal is under way, and returns the renewal to wait for,
// or nil if the token was renewed already.
func (f *tokenFront) startRenewal(failed string) *authFlight {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.token != failed {
		return nil
	}
	if f.flight != nil {
		return f.flight
	}
	fl := &authFlight{done: make(chan struct{})}
	f.flight = fl
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		token, err := f.renew()
		f.mu.Lock()
		if err == nil {
			f.token = token
		}
		fl.token, fl.err = token, err
		f.flight = nil
		f.mu.Unlock()
		close(fl.done)
	}()
	return fl
}

// refresh returns a token to replace failed, renewing it if no other call
// has yet.
func (f *tokenFront) refresh(ctx context.Context, failed string) (string, error) {
	fl := f.startRenewal(failed)
	if fl == nil {
		return f.currentToken(), nil
	}
	select {
	case <-fl.done:
		return fl.token, fl.err
	case <-ctx.Done():
		return "", status.FromContextError(ctx.Err()).Err()
	}
}

// tokenRefused tells whether etcd refused a call for its token, as
// clientv3's shouldRefreshToken does for a client with a password.
func tokenRefused(err error) bool {
	err = rpctypes.Error(err)
	return errors.Is(err, rpctypes.ErrInvalidAuthToken) || errors.Is(err, rpctypes.ErrAuthOldRevision) ||
		errors.Is(err, rpctypes.ErrUserEmpty)
}

// watchTokenRefused tells whether a watch was canceled for its stream's
// token (etcd's cancel reasons of isWatchPermitted).
func watchTokenRefused(reason string) bool {
	return reason == rpctypes.ErrGRPCInvalidAuthToken.Error() || reason == rpctypes.ErrGRPCAuthOldRevision.Error() ||
		reason == rpctypes.ErrGRPCUserEmpty.Error()
}

var allStreams = &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

func (f *tokenFront) handle(_ any, ss grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(ss)
	if !ok {
		return status.Error(codes.Internal, "token front: no method")
	}
	f.calls.Add(1)
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	md := forwardedMetadata(ss.Context())
	if f.clientStreams[method] {
		return f.relayStream(ctx, method, md, ss)
	}
	return f.relayCall(ctx, method, md, ss)
}

// relayCall relays a call whose client sends one message, renewing the
// token and retrying while the call fails for it before its first answer.
func (f *tokenFront) relayCall(ctx context.Context, method string, md metadata.MD, ss grpc.ServerStream) error {
	var req frame
	if err := ss.RecvMsg(&req); err != nil {
		return err
	}
	token := f.currentToken()
	for attempt := 1; ; attempt++ {
		cs, err := f.conn.NewStream(withToken(ctx, md, token), allStreams, method, grpc.ForceCodec(rawCodec{}))
		if err != nil {
			return err
		}
		// A failed send shows as the call's status in RecvMsg.
		if cs.SendMsg(&req) == nil {
			_ = cs.CloseSend()
		}
		var first frame
		err = cs.RecvMsg(&first)
		if err != nil && attempt < maxAttempts && tokenRefused(err) {
			f.retries.Add(1)
			if token, err = f.refresh(ctx, token); err != nil {
				return err
			}
			continue
		}
		return relayAnswers(cs, ss, first, err, nil)
	}
}

// relayStream relays a stream in both directions.
func (f *tokenFront) relayStream(ctx context.Context, method string, md metadata.MD, ss grpc.ServerStream) error {
	token := f.currentToken()
	cs, err := f.conn.NewStream(withToken(ctx, md, token), allStreams, method, grpc.ForceCodec(rawCodec{}))
	if err != nil {
		return err
	}
	f.wg.Add(1)
	go func() { // ends when the client's stream does, which gRPC ends when the handler returns
		defer f.wg.Done()
		for {
			var m frame
			if err := ss.RecvMsg(&m); err != nil {
				if errors.Is(err, io.EOF) {
					_ = cs.CloseSend()
				}
				return
			}
			if err := cs.SendMsg(&m); err != nil {
				return
			}
		}
	}()
	var inspect func(frame)
	if method == "/etcdserverpb.Watch/Watch" {
		inspect = func(m frame) {
			var wr pb.WatchResponse
			if proto.Unmarshal(m, &wr) == nil && wr.GetCanceled() && watchTokenRefused(wr.GetCancelReason()) {
				f.startRenewal(token)
			}
		}
	}
	var first frame
	err = cs.RecvMsg(&first)
	return relayAnswers(cs, ss, first, err, inspect)
}

// relayAnswers relays the upstream's header, answers and trailer to the
// client, from the first answer (or the error that came instead).
func relayAnswers(cs grpc.ClientStream, ss grpc.ServerStream, m frame, err error, inspect func(frame)) error {
	if h, herr := cs.Header(); herr == nil && len(h) > 0 {
		if err := ss.SendHeader(h); err != nil {
			return err
		}
	}
	for err == nil {
		if inspect != nil {
			inspect(m)
		}
		if err := ss.SendMsg(&m); err != nil {
			return err
		}
		m = nil
		err = cs.RecvMsg(&m)
	}
	ss.SetTrailer(cs.Trailer())
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// forwardedMetadata is the client's metadata (hasleader, the client's
// version) without gRPC's own headers and any token.
func forwardedMetadata(ctx context.Context) metadata.MD {
	in, _ := metadata.FromIncomingContext(ctx)
	md := metadata.MD{}
	for k, v := range in {
		switch {
		case strings.HasPrefix(k, ":"), strings.HasPrefix(k, "grpc-"),
			k == "content-type", k == "user-agent", k == "te", k == rpctypes.TokenFieldNameGRPC:
			continue
		}
		md[k] = slices.Clone(v)
	}
	return md
}

func withToken(ctx context.Context, md metadata.MD, token string) context.Context {
	md = md.Copy()
	md.Set(rpctypes.TokenFieldNameGRPC, token)
	return metadata.NewOutgoingContext(ctx, md)
}

// frame is one message, relayed without decoding.
type frame []byte

// rawCodec passes frames through. Its name is the proto codec's, the
// content subtype every etcd server expects.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	m, ok := v.(*frame)
	if !ok {
		return nil, fmt.Errorf("token front: cannot marshal %T", v)
	}
	return *m, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	m, ok := v.(*frame)
	if !ok {
		return fmt.Errorf("token front: cannot unmarshal into %T", v)
	}
	*m = slices.Clone(data)
	return nil
}

func (rawCodec) Name() string { return "proto" }
