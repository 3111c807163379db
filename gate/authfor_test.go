package gate

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
	"github.com/etcd-snapcache/etcd-snapcache/internal/coalesce"
)

// fakeMirror is etcd's auth state as the test sets it.
type fakeMirror struct {
	enabled, known bool
	// age is how long before the gate's clock (now) the last answered
	// poll was sent.
	age     time.Duration
	now     time.Time
	checker *authcache.Checker // Checker's answer
	// Status's answer.
	statusOn  bool
	statusRev uint64
	statusErr error
	// readsTo is the checker CheckerAt finds (it becomes the current
	// one) if its revision is enough; readErr, why it finds none.
	readsTo *authcache.Checker
	readErr error

	statuses int // Status calls
}

func (m *fakeMirror) Enabled() (bool, bool)       { return m.enabled, m.known }
func (m *fakeMirror) Checker() *authcache.Checker { return m.checker }
func (m *fakeMirror) Polled() time.Time           { return m.now.Add(-m.age) }

func (m *fakeMirror) Status(ctx context.Context) (bool, uint64, error) {
	m.statuses++
	if err := ctx.Err(); err != nil {
		return false, 0, err
	}
	return m.statusOn, m.statusRev, m.statusErr
}

// CheckerAt answers at once: with the checker it finds, with readErr, or
// with the error the gate's bound on the wait would end it with.
func (m *fakeMirror) CheckerAt(ctx context.Context, rev uint64) (*authcache.Checker, error) {
	switch {
	case m.checker != nil && m.checker.Revision() >= rev:
		return m.checker, nil
	case m.readsTo != nil && m.readsTo.Revision() >= rev:
		m.checker = m.readsTo
		return m.checker, nil
	case m.readErr != nil:
		return nil, m.readErr
	case ctx.Err() != nil:
		return nil, ctx.Err()
	}
	return nil, context.DeadlineExceeded
}

// fakeFollower is the follower as the test sets it.
type fakeFollower struct{ serving, refused bool }

func (f fakeFollower) Serving() bool           { return f.serving }
func (f fakeFollower) IdentityRefused() bool   { return f.refused }
func (f fakeFollower) UpstreamVersion() string { return "3.6.5" }

// etcdKV is etcd answering the gate's probes: the anonymous count that
// proves auth disabled, and the count that shows etcd a caller's token,
// which etcd judges through the forwarding connection's interceptor
// (WatchTokens), as in the proxy.
type etcdKV struct {
	pb.KVClient
	g *Gate
	// anonymous is the answer to an anonymous count; answers, by token,
	// to a token's (none: accepted); down, if set, to every count.
	anonymous error
	answers   map[string]error
	down      error

	mu     sync.Mutex
	proofs int // anonymous counts
}

func (k *etcdKV) Range(ctx context.Context, r *pb.RangeRequest, _ ...grpc.CallOption) (*pb.RangeResponse, error) {
	err := k.g.WatchTokens(ctx, pb.KV_Range_FullMethodName, r, &pb.RangeResponse{}, nil,
		func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
			token := tokenOf(ctx)
			switch {
			case k.down != nil:
				return k.down
			case token == "":
				k.mu.Lock()
				k.proofs++
				k.mu.Unlock()
				return k.anonymous
			}
			return k.answers[token]
		})
	if err != nil {
		return nil, err
	}
	return &pb.RangeResponse{}, nil
}

func (k *etcdKV) proofsDone() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.proofs
}

// authOutcome is what authFor returns: a checker and the caller's
// identity in it, or an error.
type authOutcome struct {
	chk *authcache.Checker
	id  authcache.Identity
	err error
}

// authOutcomes are authFor's answers for each kind of caller: anonymous;
// a verified certificate naming alice; a token issued to bob that etcd
// accepted at auth revision 5, within the check interval; tokens issued
// to carol and dave that etcd has not accepted since (it accepts carol's
// and calls dave's invalid); and a token not issued through the proxy.
type authOutcomes struct {
	anonymous, cert, trusted, verified, revoked, unknown authOutcome
}

// callers are the callers of authOutcomes, in the same order.
var callers = []struct {
	name   string
	caller Caller
}{
	{"anonymous", Caller{Kind: Anonymous}},
	{"certificate", Caller{Kind: CertCaller, CN: "alice"}},
	{"trusted token", Caller{Kind: TokenCaller, Token: "t-bob"}},
	{"token etcd accepts again", Caller{Kind: TokenCaller, Token: "t-carol"}},
	{"token etcd calls invalid", Caller{Kind: TokenCaller, Token: "t-dave"}},
	{"token not issued through the proxy", Caller{Kind: TokenCaller, Token: "t-eve"}},
}

func (o authOutcomes) of(i int) authOutcome {
	return [...]authOutcome{o.anonymous, o.cert, o.trusted, o.verified, o.revoked, o.unknown}[i]
}

var (
	allowed = authOutcome{} // auth disabled: no checker, everything allowed
	askEtcd = authOutcome{err: ErrAskEtcd}
)

func refusedWith(err error) authOutcome { return authOutcome{err: err} }

// everyone is o for every caller.
func everyone(o authOutcome) authOutcomes { return authOutcomes{o, o, o, o, o, o} }

// checkedBy is every caller identified and checked with c.
func checkedBy(c *authcache.Checker) authOutcomes {
	return authOutcomes{
		anonymous: authOutcome{chk: c},
		cert:      authOutcome{chk: c, id: authcache.User("alice")},
		trusted:   authOutcome{chk: c, id: authcache.User("bob")},
		verified:  authOutcome{chk: c, id: authcache.User("carol")},
		revoked:   refusedWith(rpctypes.ErrGRPCInvalidAuthToken),
		unknown:   askEtcd,
	}
}

// noChecker is auth enabled without a checker: an anonymous caller needs
// none, a certificate caller gets certErr, a token's read goes to etcd.
func noChecker(certErr error) authOutcomes {
	return authOutcomes{
		anonymous: authOutcome{chk: anonymousChecker},
		cert:      refusedWith(certErr),
		trusted:   askEtcd, verified: askEtcd, revoked: askEtcd, unknown: askEtcd,
	}
}

// stateUnknown is the auth state not known: err for the callers only the
// proxy can judge, etcd for tokens.
func stateUnknown(err error) authOutcomes {
	return authOutcomes{
		anonymous: refusedWith(err), cert: refusedWith(err),
		trusted: askEtcd, verified: askEtcd, revoked: askEtcd, unknown: askEtcd,
	}
}

// mirrorStale is the mirror's state older than authcache.MaxMirrorAge:
// never its answer. A caller whose read goes to etcd as it came goes
// there (ErrMirrorStale): tokens, and an anonymous caller unless the
// proxy's connection carries a certificate's name (named). The others get
// proven, the answer of a fresh request; nil: errAuthUnknown (the proxy
// without an identity of its own cannot prove it).
func mirrorStale(named bool, proven *authOutcomes) authOutcomes {
	stale := refusedWith(ErrMirrorStale)
	o := authOutcomes{
		anonymous: stale, cert: refusedWith(errAuthUnknown),
		trusted: stale, verified: stale, revoked: stale, unknown: stale,
	}
	if proven != nil {
		o.cert = proven.cert
	}
	if named {
		o.anonymous = proven.anonymous
	}
	return o
}

// provesWhenStale reports whether caller i's request that authFor would
// judge from a stale mirror is judged as a fresh one instead, asking etcd
// as a fresh one does (staleAuth): a certificate caller, and an anonymous
// one behind a connection with a name, when the proxy has an identity.
func (tc authForCase) provesWhenStale(i int) bool {
	kind := callers[i].caller.Kind
	return tc.mirror.age > authcache.MaxMirrorAge && (tc.user != "" || tc.cn != "") &&
		(kind == CertCaller || kind == Anonymous && tc.cn != "")
}

func ptr[T any](v T) *T { return &v }

func newChecker(t *testing.T, rev uint64) *authcache.Checker {
	t.Helper()
	c, err := authcache.NewChecker(authcache.Snapshot{Enabled: true, Revision: rev}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// authForCase is one auth state: the proxy's own identity, etcd's auth
// state and answers, and authFor's answers to every caller for each kind
// of request.
type authForCase struct {
	state string
	// The proxy's identity: --user, and its certificate's common name.
	user, cn string
	follower fakeFollower
	mirror   fakeMirror
	// etcd's answer to an anonymous read (nil: auth disabled), and to
	// every read if down is set.
	anonymous, down error
	canceled        bool // the caller's context is done

	// serializable is authFor's answer for a serializable read or a watch
	// create (from the mirror); fresh, for a linearizable read or a
	// checked forwarded request (at an auth state proven after it came).
	serializable, fresh authOutcomes
	// What a fresh request asks etcd for: AuthStatus calls, and anonymous
	// reads that prove auth disabled. A serializable one asks neither,
	// but from a stale mirror for a caller it proves (provesWhenStale).
	statuses, proofs int
}

func authForCases(t *testing.T) []authForCase {
	c5, c7 := newChecker(t, 5), newChecker(t, 7)
	errUnreachable := status.Error(codes.Unavailable, "etcd unreachable")
	errNoRoot := fmt.Errorf("%w: %w", authcache.ErrNoMirror, rpctypes.ErrGRPCPermissionDenied)
	readingFailed := status.Errorf(codes.Unavailable, "etcd-snapcache: reading etcd's auth state: %v", errUnreachable)
	canceled := status.FromContextError(context.Canceled).Err()
	stale := authcache.MaxMirrorAge + time.Nanosecond
	serving := fakeFollower{serving: true}
	enabled := func(c *authcache.Checker, rev uint64) fakeMirror {
		return fakeMirror{enabled: true, known: true, checker: c, statusOn: true, statusRev: rev}
	}
	withErrs := func(o authOutcomes, verified, revoked authOutcome) authOutcomes {
		o.verified, o.revoked = verified, revoked
		return o
	}
	return []authForCase{
		// The cache is off: etcd judges everyone.
		{state: "no identity of the proxy's own, auth enabled", follower: serving,
			mirror:       fakeMirror{enabled: true, known: true},
			serializable: everyone(askEtcd), fresh: everyone(askEtcd)},
		{state: "no identity, auth not known yet, the load refused", follower: fakeFollower{refused: true},
			serializable: everyone(askEtcd), fresh: everyone(askEtcd)},

		// Not known yet.
		{state: "auth state not known yet", user: "root", follower: serving,
			mirror:       fakeMirror{statusOn: true, statusRev: 5, readsTo: c5},
			serializable: stateUnknown(errAuthUnknown), fresh: checkedBy(c5), statuses: 1},
		{state: "auth state not known yet, etcd unreachable", user: "root", follower: serving,
			mirror:       fakeMirror{statusErr: errUnreachable},
			serializable: stateUnknown(errAuthUnknown), fresh: stateUnknown(readingFailed), statuses: 1},

		// Disabled.
		{state: "auth disabled, the proxy anonymous", follower: serving,
			mirror:       fakeMirror{known: true},
			serializable: everyone(allowed), fresh: everyone(allowed)},
		{state: "auth disabled, the proxy a user: etcd confirms", user: "root", follower: serving,
			mirror:       fakeMirror{known: true},
			serializable: everyone(allowed), fresh: everyone(allowed), proofs: 1},
		{state: "auth disabled in the mirror, enabled since", user: "root", follower: serving,
			mirror:       fakeMirror{known: true, statusOn: true, statusRev: 5, readsTo: c5},
			anonymous:    rpctypes.ErrGRPCUserEmpty,
			serializable: everyone(allowed), fresh: checkedBy(c5), statuses: 1, proofs: 1},
		{state: "auth disabled, the proxy a certificate identity", cn: "proxy", follower: serving,
			mirror:       fakeMirror{known: true},
			serializable: everyone(allowed), fresh: everyone(allowed), statuses: 1},
		{state: "auth enabled in the mirror, disabled since", user: "root", follower: serving,
			mirror:       fakeMirror{enabled: true, known: true, checker: c5},
			serializable: checkedBy(c5), fresh: everyone(allowed), statuses: 1},

		// Enabled.
		{state: "auth enabled, users and roles read", user: "root", follower: serving,
			mirror:       enabled(c5, 5),
			serializable: checkedBy(c5), fresh: checkedBy(c5), statuses: 1},
		{state: "auth enabled, a change the mirror reads in time", user: "root", follower: serving,
			mirror: func() fakeMirror { m := enabled(c5, 7); m.readsTo = c7; return m }(),
			// bob's token was accepted at 5: shown to etcd again at 7.
			serializable: checkedBy(c5), fresh: checkedBy(c7), statuses: 1},
		{state: "auth enabled, a change the mirror does not read in time", user: "root", follower: serving,
			mirror:       enabled(c5, 7),
			serializable: checkedBy(c5), fresh: noChecker(errAuthReading), statuses: 1},
		{state: "auth enabled, users and roles being read", user: "root", follower: serving,
			mirror:       enabled(nil, 5),
			serializable: noChecker(errAuthReading), fresh: noChecker(errAuthReading), statuses: 1},
		{state: "auth enabled, users and roles unreadable without root", user: "reader", follower: serving,
			mirror:       func() fakeMirror { m := enabled(nil, 5); m.readErr = errNoRoot; return m }(),
			serializable: noChecker(authcache.ErrNoMirror), fresh: noChecker(authcache.ErrNoMirror), statuses: 1},
		{state: "auth enabled, etcd unreachable", user: "root", follower: serving,
			mirror:       func() fakeMirror { m := enabled(c5, 5); m.statusErr = errUnreachable; return m }(),
			down:         errUnreachable,
			serializable: withErrs(checkedBy(c5), askEtcd, askEtcd), fresh: stateUnknown(readingFailed), statuses: 1},
		{state: "auth enabled, users and roles being read, the caller gone", user: "root", follower: serving,
			mirror: enabled(nil, 5), canceled: true,
			serializable: noChecker(canceled), fresh: stateUnknown(canceled), statuses: 1},

		// The mirror's state as old as the bound allows: still used.
		{state: "auth disabled, the mirror's last poll at the bound", user: "root", follower: serving,
			mirror:       fakeMirror{known: true, age: authcache.MaxMirrorAge},
			serializable: everyone(allowed), fresh: everyone(allowed), proofs: 1},
		{state: "auth enabled, the mirror's last poll at the bound", user: "root", follower: serving,
			mirror:       func() fakeMirror { m := enabled(c5, 5); m.age = authcache.MaxMirrorAge; return m }(),
			serializable: checkedBy(c5), fresh: checkedBy(c5), statuses: 1},
		// Older (its poll starved, or stuck): never used for a
		// serializable read or a watch; a fresh request proves the state
		// as always.
		{state: "auth disabled in a stale mirror, enabled since", user: "root", follower: serving,
			mirror:       fakeMirror{known: true, age: stale, statusOn: true, statusRev: 5, readsTo: c5},
			anonymous:    rpctypes.ErrGRPCUserEmpty,
			serializable: mirrorStale(false, ptr(checkedBy(c5))), fresh: checkedBy(c5), statuses: 1, proofs: 1},
		{state: "auth disabled in a stale mirror, no identity of the proxy's own", follower: serving,
			mirror:       fakeMirror{known: true, age: stale},
			serializable: mirrorStale(false, nil), fresh: everyone(allowed)},
		{state: "auth disabled in a stale mirror, the proxy a certificate identity", cn: "proxy", follower: serving,
			mirror:       fakeMirror{known: true, age: stale},
			serializable: mirrorStale(true, ptr(everyone(allowed))), fresh: everyone(allowed), statuses: 1},
		{state: "auth disabled in a stale mirror, enabled since, the proxy a certificate identity", cn: "proxy", follower: serving,
			mirror:       fakeMirror{known: true, age: stale, statusOn: true, statusRev: 5, readsTo: c5},
			serializable: mirrorStale(true, ptr(checkedBy(c5))), fresh: checkedBy(c5), statuses: 1},
		{state: "auth enabled in a stale mirror", user: "root", follower: serving,
			mirror:       func() fakeMirror { m := enabled(c5, 5); m.age = stale; return m }(),
			serializable: mirrorStale(false, ptr(checkedBy(c5))), fresh: checkedBy(c5), statuses: 1},
		{state: "auth enabled in a stale mirror, a change since", user: "root", follower: serving,
			mirror:       func() fakeMirror { m := enabled(c5, 7); m.age = stale; m.readsTo = c7; return m }(),
			serializable: mirrorStale(false, ptr(checkedBy(c7))), fresh: checkedBy(c7), statuses: 1},
		{state: "auth enabled in a stale mirror, etcd unreachable", user: "root", follower: serving,
			mirror:       func() fakeMirror { m := enabled(c5, 5); m.age = stale; m.statusErr = errUnreachable; return m }(),
			down:         errUnreachable,
			serializable: mirrorStale(false, ptr(stateUnknown(readingFailed))), fresh: stateUnknown(readingFailed), statuses: 1},
	}
}

// tracer records every span, for the attributes authFor puts on a
// request's.
var tracer = sdktrace.NewTracerProvider().Tracer("test")

// attrOf is a recorded span's string attribute k.
func attrOf(span trace.Span, k attribute.Key) string {
	for _, kv := range span.(sdktrace.ReadOnlySpan).Attributes() {
		if kv.Key == k {
			return kv.Value.Emit()
		}
	}
	return ""
}

// TestTraceAuth: where a permission answer came from, as the request's
// span says it.
func TestTraceAuth(t *testing.T) {
	c5 := newChecker(t, 5)
	for _, tc := range []struct {
		name   string
		chk    *authcache.Checker
		proven bool
		err    error
		want   string
	}{
		{"only etcd can judge the caller", nil, false, ErrAskEtcd, authFromEtcd},
		{"the mirror too old, the caller sent to etcd", nil, false, ErrMirrorStale, authFromEtcd},
		{"the auth state unknown", nil, true, errAuthUnknown, authUnknown},
		{"auth disabled", nil, true, nil, authFromDisabled},
		{"the mirror", c5, false, nil, authFromMirror},
		{"the mirror at a proven revision", c5, true, nil, authFromProof},
		{"the mirror, the caller's token refused", c5, false, rpctypes.ErrGRPCInvalidAuthToken, authFromMirror},
	} {
		ctx, span := tracer.Start(context.Background(), tc.name)
		traceAuth(ctx, tc.chk, tc.proven, tc.err)
		span.End()
		if got := attrOf(span, attrAuth); got != tc.want {
			t.Errorf("%s: snapcache.auth %q, want %q", tc.name, got, tc.want)
		}
		if rev := attrOf(span, attrAuthRevision); (tc.chk != nil) != (rev != "") {
			t.Errorf("%s: snapcache.auth_revision %q with checker %v", tc.name, rev, tc.chk != nil)
		}
	}
}

// TestAuthFor: authFor's answer, for each auth state, to each kind of
// caller, for each kind of request: the checker (none with auth
// disabled), the caller's identity in it, or the error (ErrAskEtcd: etcd
// judges the caller); and what it asked etcd for.
func TestAuthFor(t *testing.T) {
	for _, tc := range authForCases(t) {
		for _, kind := range []struct {
			name  string
			fresh bool
		}{{"serializable read or watch", false}, {"linearizable read or checked request", true}} {
			want := tc.serializable
			if kind.fresh {
				want = tc.fresh
			}
			for i, c := range callers {
				t.Run(tc.state+"/"+kind.name+"/"+c.name, func(t *testing.T) {
					g, kv, mirror := tc.gate(t)
					ctx := t.Context()
					if c.caller.Kind == TokenCaller {
						ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(rpctypes.TokenFieldNameGRPC, c.caller.Token))
					}
					if tc.canceled {
						var cancel context.CancelFunc
						ctx, cancel = context.WithCancel(ctx)
						cancel()
					}
					ctx, span := tracer.Start(ctx, "request")
					chk, id, err := g.authFor(ctx, c.caller, kind.fresh)
					span.End()
					// The span says where the answer came from.
					if got := attrOf(span, attrAuth); got == "" || kind.fresh && chk != nil && err == nil && got != authFromProof {
						t.Errorf("snapcache.auth %q for a %s answered by %s, %v", got, kind.name, checkerName(chk), err)
					}
					w := want.of(i)
					// With an error, no caller uses the checker or identity.
					if !sameError(err, w.err) || err == nil && (chk != w.chk || id != w.id) {
						t.Fatalf("authFor = %s, %+v, %v; want %s, %+v, %v", checkerName(chk), id, err, checkerName(w.chk), w.id, w.err)
					}
					statuses, proofs := 0, 0
					if kind.fresh || tc.provesWhenStale(i) {
						statuses, proofs = tc.statuses, tc.proofs
					}
					if mirror.statuses != statuses || kv.proofsDone() != proofs {
						t.Fatalf("asked etcd for %d AuthStatus and %d proofs of auth disabled, want %d and %d", mirror.statuses, kv.proofsDone(), statuses, proofs)
					}
				})
			}
		}
	}
}

// gate is a gate in tc's state, with bob's, carol's and dave's tokens
// issued through it at auth revision 5 (only bob's accepted since).
func (tc authForCase) gate(t *testing.T) (*Gate, *etcdKV, *fakeMirror) {
	mirror := tc.mirror
	now := time.Unix(1_000_000, 0)
	mirror.now = now
	kv := &etcdKV{anonymous: tc.anonymous, down: tc.down, answers: map[string]error{"t-dave": rpctypes.ErrGRPCInvalidAuthToken}}
	g := &Gate{
		cfg:        Config{User: tc.user, TokenCheckInterval: DefaultTokenCheckInterval, FreshnessTimeout: time.Second},
		lg:         zap.NewNop(),
		upstreamCN: tc.cn,
		tokens:     newTokens(),
		follower:   tc.follower,
		auth:       &mirror,
		probeKV:    kv,
		now:        func() time.Time { return now },
	}
	kv.g = g
	g.tokens.issued("t-bob", "bob", 5, true)
	g.tokens.issued("t-carol", "carol", 5, false)
	g.tokens.issued("t-dave", "dave", 5, false)
	g.disabledProof = coalesce.New(g.authEnabledNow)
	ctx, cancel := context.WithCancel(context.Background())
	g.disabledProof.Start(ctx)
	t.Cleanup(func() {
		cancel()
		g.disabledProof.Stop()
	})
	return g, kv, &mirror
}

// sameError reports whether err is want, to the message.
func sameError(err, want error) bool {
	if err == nil || want == nil {
		return err == want
	}
	return errors.Is(err, want) && err.Error() == want.Error()
}

func checkerName(c *authcache.Checker) string {
	switch {
	case c == nil:
		return "no checker"
	case c == anonymousChecker:
		return "the anonymous checker"
	}
	return fmt.Sprintf("checker at %d", c.Revision())
}

// TestStaleMirrorWatch: an anonymous caller's watch is never authorized
// from a mirror whose state is older than authcache.MaxMirrorAge. A new
// stream is relayed to etcd whole, which judges its creates (as when the
// cache is off); a create on a stream the proxy serves is checked at an
// auth state proven now (one AuthStatus) when the proxy has an identity of
// its own, else refused with errAuthUnknown, which clients retry. At the
// bound the mirror still judges both, asking etcd nothing.
func TestStaleMirrorWatch(t *testing.T) {
	c5 := newChecker(t, 5)
	for _, tc := range []struct {
		name     string
		user     string
		age      time.Duration
		disabled bool // in the mirror
		statusOn bool // etcd's auth state, which the mirror may not know
		relay    bool
		create   error
		statuses int
	}{
		{name: "at the bound", user: "root", age: authcache.MaxMirrorAge, create: rpctypes.ErrGRPCUserEmpty},
		{name: "past the bound, auth still enabled", user: "root", age: authcache.MaxMirrorAge + time.Nanosecond, statusOn: true,
			relay: true, create: rpctypes.ErrGRPCUserEmpty, statuses: 1},
		{name: "past the bound, auth disabled since", user: "root", age: authcache.MaxMirrorAge + time.Nanosecond,
			relay: true, create: nil, statuses: 1},
		{name: "past the bound, no identity of the proxy's own, auth disabled in the mirror", age: authcache.MaxMirrorAge + time.Nanosecond,
			disabled: true, statusOn: true, relay: true, create: errAuthUnknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := fakeMirror{enabled: !tc.disabled, known: true, checker: c5, age: tc.age, statusOn: tc.statusOn, statusRev: 5}
			g, _, mirror := authForCase{user: tc.user, follower: fakeFollower{serving: true}, mirror: m}.gate(t)
			ctx := t.Context()
			if got := g.RelayWatch(ctx); got != tc.relay {
				t.Errorf("RelayWatch = %v, want %v", got, tc.relay)
			}
			if err := g.AuthorizeWatch(ctx, []byte("a"), nil); !sameError(err, tc.create) {
				t.Errorf("AuthorizeWatch = %v, want %v", err, tc.create)
			}
			if mirror.statuses != tc.statuses {
				t.Errorf("asked etcd for %d AuthStatus, want %d", mirror.statuses, tc.statuses)
			}
		})
	}
}
