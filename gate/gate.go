// Package gate decides, for every request the proxy receives, what etcd
// would decide of its caller: who the caller is (a token, a verified
// certificate's common name, or nobody, as etcd's AuthInfoFromCtx), and
// so whether the proxy may answer it from the cache after checking it with
// etcd's auth store on the mirror (authcache), must send it to etcd as it
// came for etcd to judge, or must check it first and send it as the proxy.
// It keeps the tokens issued through the proxy, which it can attribute.
//
// kvproxy and watchproxy ask it about each read and watch
// (AuthorizeRead, AuthorizeWatch, RelayWatch, Forwarding); the gRPC
// server runs every other request through its interceptors; the
// forwarding connection to etcd runs its token watcher.
package gate

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/server/v3/auth"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
	"github.com/etcd-snapcache/etcd-snapcache/internal/coalesce"
	"github.com/etcd-snapcache/etcd-snapcache/internal/kvcheck"
)

// Where each caller's requests are checked:
//
//   - Reads (Range, RangeStream) and watch creates are answered from the
//     cache, so the proxy checks them itself, with etcd's auth store on the
//     mirror (AuthorizeRead, AuthorizeWatch), for every caller whose
//     identity it knows: a certificate's common name, a token issued
//     through it, a JWT it verified. A token it cannot attribute goes to
//     etcd with its read, or its watch stream is relayed whole.
//   - Every other request goes to etcd. A token caller's goes with its
//     token, and an anonymous caller's without identity: etcd checks them.
//     A certificate caller's cannot go as that user (the proxy's
//     connection carries the proxy's identity), so the proxy checks it
//     first with the upstream release's rules and then sends it as itself
//     (admit); so too an anonymous caller's, when the proxy's connection
//     carries a certificate identity that etcd would take for the caller.
//
// A linearizable read and a checked forwarded request are checked at an
// auth revision from a shared AuthStatus that started after the request
// arrived (freshAuth): a grant or revoke made before the request binds it,
// as in etcd; one racing with it lands either way. Serializable reads and
// new watches use the mirror, about a second behind, and never more than
// authcache.MaxMirrorAge (counted from when its last answered poll was
// sent): past that, a caller whose request can go to etcd as it came
// goes there, and the others are checked as a fresh request is
// (staleAuth).

// ErrAskEtcd, from AuthorizeRead, says that only etcd can judge the
// caller: the read goes to etcd with the caller's credentials.
var ErrAskEtcd = errors.New("gate: only etcd can judge this caller")

// ErrMirrorStale, from AuthorizeRead, is ErrAskEtcd because the mirror's
// auth state is older than authcache.MaxMirrorAge: the read goes to etcd
// as it came, and etcd judges it (kvproxy counts it apart, auth_stale).
var ErrMirrorStale = fmt.Errorf("%w: etcd's auth state, as the proxy last read it, is too old", ErrAskEtcd)

// DefaultTokenCheckInterval is how long a token etcd accepted is trusted
// before it is shown to etcd again (--auth-token-check-interval): well
// under etcd's --auth-token-ttl of 300 s.
const DefaultTokenCheckInterval = 5 * time.Second

// Follower is what the gate reads of the upstream follower.
type Follower interface {
	// Serving reports whether the cache answers for etcd.
	Serving() bool
	// IdentityRefused reports whether etcd refused the proxy's own
	// identity the keyspace.
	IdentityRefused() bool
	// UpstreamVersion is the upstream member's release, "" if unknown.
	UpstreamVersion() string
}

// authMirror is what the gate's decisions read of etcd's auth state
// (authcache.Mirror).
type authMirror interface {
	// Enabled reports whether etcd has auth enabled, as of the last poll,
	// and whether any poll has answered yet.
	Enabled() (enabled, known bool)
	// Polled is when the latest poll etcd answered was sent: Enabled and
	// Checker are no older.
	Polled() time.Time
	// Checker is the checker of the current auth revision, nil while it
	// is not read.
	Checker() *authcache.Checker
	// CheckerAt waits for a checker of auth revision rev or later; it
	// fails with authcache.ErrNoMirror while the users and roles cannot
	// be read.
	CheckerAt(ctx context.Context, rev uint64) (*authcache.Checker, error)
	// Status is etcd's auth state from an AuthStatus that started after
	// the call.
	Status(ctx context.Context) (enabled bool, rev uint64, err error)
}

// Config configures a Gate.
type Config struct {
	// User is the proxy's own user in etcd (--user), "" for none.
	User string
	// UpstreamCertFile is the proxy's client certificate for etcd: etcd
	// with --client-cert-auth takes its common name for a user.
	UpstreamCertFile string
	// ClientCertAuth is etcd's --client-cert-auth: a caller without a
	// token is the user its verified client certificate names.
	ClientCertAuth bool
	// AuthToken is the upstream's --auth-token, whose JWT public key lets
	// the proxy verify the JWTs etcd issued.
	AuthToken string
	// TokenCheckInterval is how long a token etcd accepted is trusted
	// before it is shown to etcd again.
	TokenCheckInterval time.Duration
	// FreshnessTimeout bounds how long a request waits for etcd's users
	// and roles.
	FreshnessTimeout time.Duration
	Logger           *zap.Logger
}

// Upstream is what the gate asks etcd through, and the follower whose
// state it reads.
type Upstream struct {
	// Forwarding is the connection that forwards callers' requests, with
	// no identity of its own (or the proxy's client certificate's).
	Forwarding grpc.ClientConnInterface
	// Own is the connection of the proxy's own identity (User); the
	// forwarding one if none.
	Own      grpc.ClientConnInterface
	Follower Follower
	// Tracer, if set, traces the shared proofs of etcd's auth state as
	// spans of their own, which the requests checked with them link to.
	Tracer trace.Tracer
}

// DisabledProofSpanName names the span of a shared anonymous quorum read
// that proves auth disabled.
const DisabledProofSpanName = "snapcache.auth_disabled_proof"

// Gate is the proxy's auth gate. New makes it; Connect gives it etcd
// before the first request; Start and Stop run its mirror of etcd's auth
// state.
type Gate struct {
	cfg Config
	lg  *zap.Logger
	// upstreamCN is the common name of the proxy's upstream client
	// certificate: etcd with --client-cert-auth takes it for a user.
	upstreamCN string
	jwt        auth.TokenProvider // nil: simple tokens
	tokens     *tokens            // the callers' tokens the proxy can attribute

	// Set by Connect (server's Start, once the connections exist), before
	// any request.
	follower Follower
	// mirror follows etcd's auth state: the gate runs it (Start) and
	// tells it what requests through the proxy showed (AuthServer).
	mirror *authcache.Mirror
	// auth is what the gate reads of that state: mirror, or a fake in
	// the decisions' tests.
	auth authMirror
	// probeKV reads etcd through the forwarding connection: with a
	// caller's context it shows etcd the caller's token.
	probeKV pb.KVClient
	// leases reads lease keys as the proxy.
	leases pb.LeaseClient
	// disabledProof shares the anonymous quorum reads that prove auth
	// disabled (freshAuth).
	disabledProof *coalesce.Call[bool]
	// now is the clock the mirror's age is read with (time.Now; a fake
	// in the decisions' tests). Set before any request.
	now func() time.Time

	noMirrorLog  sync.Once // the error of refusing certificate callers
	releaseRules atomic.Pointer[releaseRules]
	wg           sync.WaitGroup // the mirror's goroutine
}

// New returns a gate; its token watcher may be given to the forwarding
// connection's dial before Connect.
func New(cfg Config) (*Gate, error) {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	g := &Gate{cfg: cfg, lg: cfg.Logger, tokens: newTokens(), now: time.Now}
	var err error
	if g.upstreamCN, err = certCommonName(cfg.UpstreamCertFile); err != nil {
		return nil, fmt.Errorf("--cert: %w", err)
	}
	if g.jwt, err = authcache.NewJWTProvider(g.lg, cfg.AuthToken); err != nil {
		return nil, fmt.Errorf("--auth-token: %w", err)
	}
	return g, nil
}

// Connect gives the gate the connections it asks etcd through and the
// follower; call it once, before the first request.
func (g *Gate) Connect(u Upstream) {
	g.follower = u.Follower
	g.probeKV = pb.NewKVClient(u.Forwarding)
	g.leases = pb.NewLeaseClient(u.Own)
	g.mirror = authcache.NewMirror(authcache.MirrorConfig{
		Auth:         pb.NewAuthClient(u.Own),
		EnabledProbe: g.authEnabledProbe(),
		JWT:          g.jwt,
		Logger:       g.lg,
		Tracer:       u.Tracer,
	})
	g.auth = g.mirror
	g.disabledProof = coalesce.New(g.authEnabledNow)
	g.disabledProof.Trace(u.Tracer, DisabledProofSpanName)
}

// Start runs the mirror of etcd's auth state, and the shared proofs, until
// ctx is done; Stop waits for them.
func (g *Gate) Start(ctx context.Context) {
	g.disabledProof.Start(ctx)
	g.wg.Go(func() { g.mirror.Run(ctx) })
}

// Stop waits for what Start started; the Start context must be done.
func (g *Gate) Stop() {
	g.disabledProof.Stop()
	g.wg.Wait()
}

// AuthKnown is closed once the proxy knows whether etcd has auth enabled.
func (g *Gate) AuthKnown() <-chan struct{} { return g.mirror.Known() }

// AuthEnabled reports whether etcd has auth enabled, as far as the proxy
// knows, and whether it knows.
func (g *Gate) AuthEnabled() (enabled, known bool) { return g.auth.Enabled() }

// AuthStateKnown reports whether the proxy knows whether etcd has auth
// enabled. Until then a cached read must ask etcd for its auth state (an
// AuthStatus, which etcd commits through raft) before it is served.
func (g *Gate) AuthStateKnown() bool {
	_, known := g.auth.Enabled()
	return known
}

// errAuthUnknown answers a caller the proxy cannot yet tell etcd's auth
// state for; clients retry.
var errAuthUnknown = status.Error(codes.Unavailable, "etcd-snapcache: etcd's auth state is not known yet; retry")

// errAuthReading answers a certificate caller whose permissions the proxy
// could not check within the freshness timeout because it was still
// reading etcd's users and roles; clients retry.
var errAuthReading = status.Error(codes.Unavailable, "etcd-snapcache: etcd's users and roles are being read; retry")

// errReleaseUnknown answers a checked request while the upstream's release,
// whose rules the check follows, is not known.
var errReleaseUnknown = status.Error(codes.Unavailable, "etcd-snapcache: etcd's release is not known yet, so its permission rules are not; retry")

// anonymousChecker answers every question about an anonymous caller with
// auth enabled, which never depends on the users and roles.
var anonymousChecker = func() *authcache.Checker {
	c, err := authcache.NewChecker(authcache.Snapshot{Enabled: true, Revision: 1}, nil)
	if err != nil {
		panic(err)
	}
	return c
}()

// hasIdentity reports whether the proxy reaches etcd with an identity of
// its own: a user (--user), or a client certificate whose common name etcd
// takes for one.
func (g *Gate) hasIdentity() bool { return g.cfg.User != "" || g.upstreamCN != "" }

// Forwarding reports whether every request goes to etcd as it came, as
// etcd's grpc-proxy sends it: etcd has auth enabled and the proxy has no
// identity of its own, so it can neither read the keyspace nor tell what
// any caller may do, and etcd judges each request by the caller's own
// token, or as anonymous. Nothing is served from the cache then, even a
// cache loaded while auth was disabled. Without an identity the proxy's
// connection carries no one's permissions, so a certificate caller's
// request, which cannot go as that caller, goes as anonymous. (A proxy
// whose own identity etcd refuses is misconfigured instead: it is not
// ready, and says why.)
func (g *Gate) Forwarding() bool {
	if g.hasIdentity() {
		return false
	}
	if on, known := g.auth.Enabled(); known {
		return on
	}
	return !g.follower.Serving() && g.follower.IdentityRefused()
}

// authFor returns the checker that binds a request of c, and c's identity
// in it: a nil checker when auth is disabled (everything is allowed). With
// fresh, the auth state is proven as of after the request arrived.
// ErrAskEtcd says only etcd can judge c (a token the proxy cannot
// attribute, or no mirror to check it with). The request's span says
// where the answer came from (traceAuth).
func (g *Gate) authFor(ctx context.Context, c Caller, fresh bool) (*authcache.Checker, authcache.Identity, error) {
	chk, id, proven, err := g.authState(ctx, c, fresh)
	traceAuth(ctx, chk, proven, err)
	return chk, id, err
}

// authState is authFor's answer, and whether the auth state it rests on
// was proven as of after the request arrived: with fresh, or when the
// mirror was too old to use.
func (g *Gate) authState(ctx context.Context, c Caller, fresh bool) (*authcache.Checker, authcache.Identity, bool, error) {
	var none authcache.Identity
	if g.Forwarding() {
		return nil, none, fresh, ErrAskEtcd
	}
	enabled, rev := false, uint64(0)
	if fresh {
		var err error
		if enabled, rev, err = g.freshAuth(ctx); err != nil {
			if c.Kind == TokenCaller {
				return nil, none, fresh, ErrAskEtcd
			}
			if ctx.Err() != nil {
				return nil, none, fresh, status.FromContextError(ctx.Err()).Err()
			}
			return nil, none, fresh, status.Errorf(codes.Unavailable, "etcd-snapcache: reading etcd's auth state: %v", err)
		}
	} else {
		var known bool
		if enabled, known = g.auth.Enabled(); !known {
			if c.Kind == TokenCaller {
				return nil, none, fresh, ErrAskEtcd
			}
			return nil, none, fresh, errAuthUnknown
		}
		if g.now().Sub(g.auth.Polled()) > authcache.MaxMirrorAge {
			if err := g.staleAuth(c); err != nil {
				return nil, none, fresh, err
			}
			return g.authState(ctx, c, true)
		}
	}
	if !enabled {
		return nil, none, fresh, nil
	}
	chk := g.auth.Checker()
	var chkErr error // why no checker came, when one was waited for
	if rev != 0 && (chk == nil || chk.Revision() < rev) || chk == nil && c.Kind == CertCaller {
		// A fresh auth revision, or a certificate caller while the mirror
		// reads the users and roles again after a change: wait for them,
		// rather than refuse a caller only the proxy can check.
		cctx, cancel := context.WithTimeout(ctx, g.cfg.FreshnessTimeout)
		chk, chkErr = g.auth.CheckerAt(cctx, rev)
		cancel()
	}
	switch {
	case c.Kind == Anonymous:
		if chk == nil {
			chk = anonymousChecker
		}
		return chk, none, fresh, nil
	case chk == nil && c.Kind == TokenCaller:
		return nil, none, fresh, ErrAskEtcd
	case chk == nil && !errors.Is(chkErr, authcache.ErrNoMirror):
		if ctx.Err() != nil {
			return nil, none, fresh, status.FromContextError(ctx.Err()).Err()
		}
		return nil, none, fresh, errAuthReading
	case chk == nil:
		g.noMirrorLog.Do(func() {
			g.lg.Error("refusing certificate-identified requests while auth is enabled: the proxy cannot read etcd's users and roles to check them; give it root credentials (--user)")
		})
		return nil, none, fresh, authcache.ErrNoMirror
	case c.Kind == CertCaller:
		return chk, authcache.User(c.CN), fresh, nil
	}
	id, err := g.tokenIdentity(ctx, c.Token, chk)
	return chk, id, fresh, err
}

// staleAuth decides for a request authFor would judge from the mirror
// when the mirror's state is older than authcache.MaxMirrorAge; never from
// that state. A caller whose request can go to etcd as it came goes there
// (ErrMirrorStale, an ErrAskEtcd: etcd judges it), as when the state is
// not known: a token caller, with its token, and an anonymous caller when
// the proxy's connection carries no certificate name that etcd would take
// for the caller (as admit sends its other requests). The others cannot
// go as they came: with an identity of its own, the proxy proves the auth
// state as for a linearizable read (nil: authFor with fresh), a shared
// AuthStatus whose answer also renews the mirror; without one it cannot
// (that proof would rest on a read fence a serializable read does not
// take), and they get errAuthUnknown, which clients retry, as when the
// state is not known.
func (g *Gate) staleAuth(c Caller) error {
	switch {
	case c.Kind == TokenCaller, c.Kind == Anonymous && g.upstreamCN == "":
		return ErrMirrorStale
	case g.hasIdentity():
		return nil
	}
	return errAuthUnknown
}

// tokenIdentity is the identity of a token at chk's auth revision: a JWT
// verified with etcd's key, or a simple token issued through the proxy
// that etcd accepted recently at that revision (shown to etcd again when
// it was not). ErrAskEtcd: the proxy cannot attribute it.
func (g *Gate) tokenIdentity(ctx context.Context, token string, chk *authcache.Checker) (authcache.Identity, error) {
	if id, err := chk.TokenIdentity(ctx); err == nil {
		return id, nil
	}
	if user, ok := g.tokens.trusted(token, chk.Revision(), g.cfg.TokenCheckInterval); ok {
		return authcache.User(user), nil
	}
	if !g.tokens.known(token) {
		return authcache.Identity{}, ErrAskEtcd
	}
	if err := g.verifyToken(ctx); err != nil {
		return authcache.Identity{}, err
	}
	if user, ok := g.tokens.trusted(token, chk.Revision(), g.cfg.TokenCheckInterval); ok {
		return authcache.User(user), nil
	}
	return authcache.Identity{}, ErrAskEtcd
}

// verifyToken shows the caller's token to etcd with a cheap request etcd
// checks it for, a count of one key: etcd's answer
// tells whether the token is valid (WatchTokens records it), and, being a
// use, keeps a simple token alive in etcd. An invalid token gets etcd's
// error; any other failure leaves the judgement to etcd. The count is
// linearizable: when the upstream is another proxy, a serializable one
// could be answered from that proxy's cache, at its older auth state.
func (g *Gate) verifyToken(ctx context.Context) error {
	_, err := g.probeKV.Range(ctx, &pb.RangeRequest{Key: authProbeKey, CountOnly: true})
	switch e := rpctypes.Error(err); {
	case err == nil, errors.Is(e, rpctypes.ErrPermissionDenied):
		return nil
	case errors.Is(e, rpctypes.ErrInvalidAuthToken):
		return rpctypes.ErrGRPCInvalidAuthToken
	}
	return ErrAskEtcd
}

// freshAuth is etcd's auth state as of after the call: whether auth is
// enabled and, if it is, the auth revision. While auth is disabled it
// costs nothing when the proxy's own identity is anonymous (then every
// read fence and forwarded request is anonymous, and etcd refuses it if
// auth was enabled meanwhile), or one shared anonymous quorum read;
// otherwise, and while auth is enabled, a shared AuthStatus.
func (g *Gate) freshAuth(ctx context.Context) (bool, uint64, error) {
	if on, known := g.auth.Enabled(); known && !on {
		switch {
		case g.cfg.User == "" && g.upstreamCN == "":
			return false, 0, nil
		case g.upstreamCN == "":
			on, err := g.disabledProof.Do(ctx)
			if err != nil {
				return false, 0, err
			}
			if !on {
				return false, 0, nil
			}
		}
	}
	return g.auth.Status(ctx)
}

// authEnabledNow is the disabled proof's call: a linearizable count of one
// key by an anonymous caller, which etcd refuses exactly while auth is
// enabled (refusedByAuth).
func (g *Gate) authEnabledNow(ctx context.Context) (bool, error) {
	_, err := g.probeKV.Range(ctx, &pb.RangeRequest{Key: authProbeKey, CountOnly: true})
	return refusedByAuth(err)
}

// refusedByAuth reads the answer to an anonymous read: allowed while auth
// is disabled; refused while it is enabled, with "user name is empty", or
// "permission denied" when the proxy's connection presents a certificate
// without a common name to an etcd with --client-cert-auth (etcd takes it
// for the user "").
func refusedByAuth(err error) (enabled bool, _ error) {
	switch e := rpctypes.Error(err); {
	case err == nil:
		return false, nil
	case errors.Is(e, rpctypes.ErrUserEmpty), errors.Is(e, rpctypes.ErrPermissionDenied):
		return true, nil
	}
	return false, err
}

// AuthorizeRead is etcd's permission check of a read, for the caller of
// ctx; with linearizable, at an auth revision proven after it arrived.
// ErrAskEtcd: only etcd can judge the caller.
func (g *Gate) AuthorizeRead(ctx context.Context, key, rangeEnd []byte, linearizable bool) error {
	c := g.CallerOf(ctx)
	chk, id, err := g.authFor(ctx, c, linearizable)
	if err != nil || chk == nil {
		return err
	}
	return chk.CheckRange(id, key, rangeEnd)
}

// AuthorizeWatch is etcd's permission check of a watch create on a stream
// the proxy serves. Streams whose token the proxy cannot attribute are
// relayed (RelayWatch); one that it could at the
// start but cannot now is refused with Unavailable, which clients retry.
// With the mirror older than authcache.MaxMirrorAge, the create is checked
// at an auth state proven now when the proxy has an identity of its own,
// and refused with Unavailable otherwise.
func (g *Gate) AuthorizeWatch(ctx context.Context, key, rangeEnd []byte) error {
	c := g.CallerOf(ctx)
	chk, id, err := g.authFor(ctx, c, false)
	if errors.Is(err, ErrMirrorStale) && g.hasIdentity() {
		// A create on a stream the proxy serves cannot go to etcd alone:
		// the auth state is proven now, as for a linearizable read.
		chk, id, err = g.authFor(ctx, c, true)
	}
	switch {
	case errors.Is(err, ErrAskEtcd):
		return errAuthUnknown
	case err != nil || chk == nil:
		return err
	}
	return chk.CheckRange(id, key, rangeEnd)
}

// RelayWatch reports whether a watch stream must be relayed to etcd whole:
// its token is one the proxy cannot attribute, the cache is off
// (Forwarding), or the mirror's state is too old to judge the stream's
// caller and the stream can go to etcd as it came (staleAuth).
func (g *Gate) RelayWatch(ctx context.Context) bool {
	c := g.CallerOf(ctx)
	switch {
	case g.Forwarding():
		return true
	case c.Kind == CertCaller:
		return false
	}
	_, _, err := g.authFor(ctx, c, false)
	return errors.Is(err, ErrAskEtcd)
}

// Methods the read and watch servers check themselves, and the one etcd
// answers without any identity.
const (
	methodRange        = "/etcdserverpb.KV/Range"
	methodRangeStream  = "/etcdserverpb.KV/RangeStream"
	methodWatch        = "/etcdserverpb.Watch/Watch"
	methodAuthenticate = "/etcdserverpb.Auth/Authenticate"
)

// admit decides how a request reaches its handler: the context it runs
// under (marked to go upstream as the proxy when the proxy checked it for
// a certificate caller), or etcd's refusal. The refusal of a streaming
// request's messages comes from check, for each message received.
func (g *Gate) admit(ctx context.Context, method string) (_ context.Context, check func(req any) error) {
	switch {
	case method == methodRange || method == methodRangeStream || method == methodWatch:
		// Checked per read and per watch create by their servers.
		if g.CallerOf(ctx).Kind == CertCaller {
			return AsProxy(ctx), nil
		}
		return ctx, nil
	case method == methodAuthenticate || strings.HasPrefix(method, "/grpc.health.v1."):
		return ctx, nil
	}
	c := g.CallerOf(ctx)
	switch {
	case g.Forwarding():
		// As it came: a certificate caller's goes as anonymous (asProxy,
		// the proxy having no identity), which etcd judges.
		if c.Kind == CertCaller {
			return AsProxy(ctx), nil
		}
		return ctx, nil
	case c.Kind == TokenCaller:
		return ctx, nil // with its token: etcd checks it
	case c.Kind == Anonymous && g.upstreamCN == "":
		return ctx, nil // without identity: etcd checks it
	}
	if c.Kind == CertCaller {
		ctx = AsProxy(ctx)
	}
	// The check sees the request's final context. It captures a copy:
	// capturing ctx itself, which is reassigned, would move ctx to the
	// heap on every call, Ranges included.
	checkCtx := ctx
	check = func(req any) error { return g.checkForwarded(checkCtx, c, method, req) }
	return ctx, check
}

// checkForwarded is etcd's check of a request the proxy sends to etcd as
// itself, with the upstream release's rules, at a fresh auth revision.
func (g *Gate) checkForwarded(ctx context.Context, c Caller, method string, req any) error {
	// etcd validates a write before it checks permissions.
	if err := kvcheck.Write(req); err != nil {
		return err
	}
	chk, id, err := g.authFor(ctx, c, true)
	if err != nil || chk == nil {
		return err
	}
	rules, err := g.rules()
	if err != nil {
		return errReleaseUnknown
	}
	var leases authcache.Leases
	if ids, all := rules.LeasesNeeded(req); (len(ids) > 0 || all) && chk.CheckAdmin(id) != nil {
		if leases, err = g.leaseKeys(ctx, ids, all); err != nil {
			return err
		}
	}
	return chk.CheckRequest(id, method, req, rules, leases)
}

// releaseRules are the permission rules of one upstream release.
type releaseRules struct {
	version string
	rules   authcache.Rules
	err     error
}

// rules returns the upstream release's permission rules, read once per
// release.
func (g *Gate) rules() (authcache.Rules, error) {
	v := g.follower.UpstreamVersion()
	if c := g.releaseRules.Load(); c != nil && c.version == v {
		return c.rules, c.err
	}
	r, err := authcache.RulesFor(v)
	g.releaseRules.Store(&releaseRules{version: v, rules: r, err: err})
	if err == nil && r.Stricter {
		g.lg.Warn("etcd's release checks less than the proxy's rules for it (known auth fixes came later); certificate callers may be refused requests that this etcd would allow, never the reverse", zap.String("version", v))
	}
	return r, err
}

// leaseKeys reads the keys attached to leases from etcd, as the proxy: the
// leases ids, or every lease.
func (g *Gate) leaseKeys(ctx context.Context, ids []int64, all bool) (authcache.Leases, error) {
	lc := g.leases
	if all {
		resp, err := lc.LeaseLeases(ctx, &pb.LeaseLeasesRequest{})
		if err != nil {
			return nil, err
		}
		ids = ids[:0]
		for _, l := range resp.Leases {
			ids = append(ids, l.ID)
		}
	}
	leases := authcache.Leases{}
	for _, id := range ids {
		resp, err := lc.LeaseTimeToLive(ctx, &pb.LeaseTimeToLiveRequest{ID: id, Keys: true})
		switch {
		case errors.Is(rpctypes.Error(err), rpctypes.ErrLeaseNotFound):
			continue
		case err != nil:
			return nil, err
		case resp.TTL == -1:
			continue // etcd's answer for a lease that does not exist
		}
		keys := make([]string, len(resp.Keys))
		for i, k := range resp.Keys {
			keys[i] = string(k)
		}
		leases[id] = keys
	}
	return leases, nil
}

// UnaryServerInterceptor runs each unary request through the gate: etcd's
// refusal, or the handler under the context admit decides.
func (g *Gate) UnaryServerInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	ctx, check := g.admit(ctx, info.FullMethod)
	if check != nil {
		if err := check(req); err != nil {
			return nil, err
		}
	}
	return handler(ctx, req)
}

// StreamServerInterceptor runs each stream through the gate, checking
// every message a client sends on it when admit says so.
func (g *Gate) StreamServerInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, check := g.admit(ss.Context(), info.FullMethod)
	if ctx == ss.Context() && check == nil {
		return handler(srv, ss)
	}
	return handler(srv, &checkedStream{ServerStream: ss, ctx: ctx, check: check})
}

// checkedStream is a client stream whose every received message is
// checked before its handler sees it, and whose context may mark its
// upstream calls as the proxy's.
type checkedStream struct {
	grpc.ServerStream
	ctx   context.Context
	check func(req any) error // nil: none
}

func (c *checkedStream) Context() context.Context { return c.ctx }

func (c *checkedStream) RecvMsg(m any) error {
	if err := c.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if c.check != nil {
		return c.check(m)
	}
	return nil
}

// certCommonName returns the common name of the first certificate in a
// PEM file, "" for none.
func certCommonName(file string) (string, error) {
	if file == "" {
		return "", nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	block, _ := pem.Decode(b)
	if block == nil {
		return "", fmt.Errorf("%s: no PEM certificate", file)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return "", fmt.Errorf("%s: %w", file, err)
	}
	return cert.Subject.CommonName, nil
}

// authEnabledProbe is the mirror's cheap test of whether etcd has auth
// enabled, authEnabledNow: linearizable, so that an upstream proxy cannot
// answer it from its cache at an older auth state (a read index for
// etcd). It is anonymous only without a certificate identity, so there is
// none with one.
func (g *Gate) authEnabledProbe() func(ctx context.Context) (bool, error) {
	if g.upstreamCN != "" {
		return nil
	}
	return g.authEnabledNow
}

// authProbeKey is read, never written, by the proxy's probes.
var authProbeKey = []byte("\x00etcd-snapcache-auth-probe")
