package authcache

import (
	"context"
	"errors"
	"fmt"
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

	"github.com/etcd-snapcache/etcd-snapcache/internal/coalesce"
	"github.com/etcd-snapcache/etcd-snapcache/internal/etcderr"
)

// DefaultPollInterval is how often the mirror asks etcd for its auth
// revision while auth is enabled: an auth change reaches cached
// serializable reads and new watches within about this long.
const DefaultPollInterval = time.Second

// disabledPollInterval is how often the cheap probe asks whether auth was
// enabled: enabling it must stop anonymous cached reads within a second,
// with the reading of users and roles that follows included. Each probe
// wakes etcd (a linearizable read, a read index on every member), and on
// an idle cluster that wakeup is most of what the proxy costs it: at
// 250 ms the proxy's probes took about 4 ms of an idle etcd's CPU per
// second.
const disabledPollInterval = 500 * time.Millisecond

// MaxMirrorAge is how old the mirror's auth state may be, counted from
// when the last poll etcd answered was sent (Polled), for a read or watch
// to be authorized from it without asking etcd. Past it the state is
// treated as unknown: a poll starved of CPU, or stuck on a congested
// connection, must not leave the proxy trusting an auth state from long
// ago, where etcd's member judges a serializable read at its own apply
// lag, milliseconds. (What the gate does instead is its staleAuth.)
//
// A healthy mirror is never that old: it sends its next poll one interval
// (DefaultPollInterval while auth is enabled, disabledPollInterval while
// it is not) after the previous one answered, so its age stays below an
// interval plus two AuthStatus round trips (and, after an auth change,
// the read of the users and roles). Two seconds absorb an AuthStatus (a
// raft proposal) of up to half a second, five times etcd's own
// slow-request warning, without the gate giving up on a healthy mirror;
// and it keeps the proxy, starved, within the three seconds in
// which it promises that an auth change binds serializable reads, with a
// second left for the forwarded answer. It is a constant, not a flag, as
// the poll intervals are: etcd's grpc-proxy has no equivalent to mirror.
const MaxMirrorAge = 2 * DefaultPollInterval

// MirrorConfig configures a Mirror.
type MirrorConfig struct {
	// Auth is etcd's Auth service, reached with the proxy's own
	// credentials, which must hold the root role to read users and roles.
	Auth pb.AuthClient
	// EnabledProbe, if set, tells cheaply whether auth is enabled (a
	// serializable read by an anonymous caller fails with "user name is
	// empty" exactly then), so that AuthStatus, a raft proposal, is paid
	// for only while it is.
	EnabledProbe func(ctx context.Context) (bool, error)
	// JWT, if set, is etcd's JWT token provider, with which checkers
	// verify JWTs.
	JWT      auth.TokenProvider
	Interval time.Duration // DefaultPollInterval if 0
	// CallTimeout bounds each call of a poll (DefaultCallTimeout if 0).
	CallTimeout time.Duration
	Logger      *zap.Logger
	// Tracer, if set, traces each shared AuthStatus as a span of its own
	// (AuthStatusSpanName), which the requests checked with it link to.
	Tracer trace.Tracer
}

// AuthStatusSpanName names the span of an AuthStatus shared by the
// requests that prove the auth state with it.
const AuthStatusSpanName = "snapcache.auth_status"

// DefaultCallTimeout bounds each call the mirror makes. A call sent to a
// member that hangs is answered only when gRPC keepalive gives up on it
// (50 s by default): it would hold the poll, and so the mirror, that long,
// while the gate trusts no state older than MaxMirrorAge. Bounded, the
// next poll goes to a member that answers (a hung one is avoided within
// 4 s). 3 s is far above an AuthStatus's raft round trip.
const DefaultCallTimeout = 3 * time.Second

// Mirror follows etcd's auth state: whether auth is enabled, from
// AuthStatus (which needs no permission), and a Checker of the users, roles
// and permissions at etcd's auth revision, which needs the root role.
type Mirror struct {
	cfg MirrorConfig
	// status is the AuthStatus that proofs share (Status).
	status *coalesce.Call[*pb.AuthStatusResponse]
	kick   chan struct{} // a poll is wanted now
	// knownc is closed when the auth state is first known (Known).
	knownc chan struct{}
	// polled is when the latest poll etcd answered was sent, in Unix
	// nanoseconds (0: none yet). Written under mu; read without it by
	// Polled, which the gate asks on every read it judges.
	polled atomic.Int64

	mu sync.Mutex
	// Guarded by mu.
	known    bool          // AuthStatus has answered at least once
	enabled  bool          // auth was enabled at the last AuthStatus
	revision uint64        // the auth revision of the last AuthStatus
	checker  *Checker      // at revision; nil when it could not be read
	readErr  error         // why checker could not be read
	changed  chan struct{} // closed, and replaced, when checker changes
}

// NewMirror returns a mirror; it does nothing until Run.
func NewMirror(cfg MirrorConfig) *Mirror {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultPollInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = DefaultCallTimeout
	}
	cfg.Auth = boundedAuth{AuthClient: cfg.Auth, timeout: cfg.CallTimeout}
	m := &Mirror{cfg: cfg, kick: make(chan struct{}, 1), knownc: make(chan struct{}), changed: make(chan struct{})}
	// The shared AuthStatus is bounded as every call of the mirror is:
	// while etcd is unreachable a call waits for the connection, and the
	// readers queued behind it would wait too; they give up earlier with
	// their own contexts.
	m.status = coalesce.New(func(ctx context.Context) (*pb.AuthStatusResponse, error) {
		return m.cfg.Auth.AuthStatus(ctx, &pb.AuthStatusRequest{})
	})
	m.status.Trace(cfg.Tracer, AuthStatusSpanName)
	return m
}

// Run polls etcd's auth status until ctx is done, and reads the users and
// roles again whenever the auth revision moves. It owns the shared
// AuthStatus of Status, and waits for it before returning.
func (m *Mirror) Run(ctx context.Context) {
	m.status.Start(ctx)
	defer m.status.Stop()
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		m.poll(ctx)
		next := m.cfg.Interval
		if on, known := m.Enabled(); m.cfg.EnabledProbe != nil && (!known || !on) {
			next = min(next, disabledPollInterval)
		}
		t.Reset(next)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-m.kick:
		}
	}
}

func (m *Mirror) poll(ctx context.Context) {
	m.mu.Lock()
	known, enabled := m.known, m.enabled
	m.mu.Unlock()
	if m.cfg.EnabledProbe != nil && (!known || !enabled) {
		sent := time.Now()
		pctx, cancel := context.WithTimeout(ctx, m.cfg.CallTimeout)
		on, err := m.cfg.EnabledProbe(pctx)
		cancel()
		if err != nil {
			return // unknown: try again at the next poll
		}
		if !on {
			m.observe(false, 0, sent)
			return
		}
	}
	sent := time.Now()
	st, err := m.cfg.Auth.AuthStatus(ctx, &pb.AuthStatusRequest{})
	if err != nil {
		if ctx.Err() == nil {
			m.cfg.Logger.Debug("reading etcd's auth status failed", zap.Error(err))
		}
		return
	}
	if !m.observe(st.Enabled, st.AuthRevision, sent) {
		return
	}
	snap, err := Fetch(ctx, m.cfg.Auth)
	var c *Checker
	if err == nil {
		c, err = NewChecker(snap, m.cfg.JWT)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		switch {
		case ctx.Err() != nil:
		case isRefusal(err) && !isRefusal(m.readErr):
			m.cfg.Logger.Error("cannot mirror etcd's users and roles: the proxy's own identity needs the root role; until it has it, token callers' reads go to etcd and certificate callers are refused", zap.Error(err))
		case !isRefusal(err):
			m.cfg.Logger.Warn("reading etcd's users and roles failed; retrying", zap.Error(err))
		}
		m.readErr = err
		return
	}
	// Enabling auth keeps the auth revision: at the same revision, a
	// state read by a call sent after this poll's (Status) may be newer
	// than the snapshot, and is kept.
	if snap.Revision > m.revision || snap.Revision == m.revision && (snap.Enabled == m.enabled || !m.polledAt().After(sent)) {
		m.checker, m.readErr = c, nil
		m.enabled, m.revision = snap.Enabled, snap.Revision
		close(m.changed)
		m.changed = make(chan struct{})
	}
}

// observe records an auth state etcd reported to a call sent at sent,
// and reports whether the checker must be read again. A state from auth
// disabled (the cheap probe) carries no revision. The state is as fresh as
// the call's sending, not its answer: etcd may have changed it any time
// after that, and a slow answer must not look recent.
func (m *Mirror) observe(enabled bool, rev uint64, sent time.Time) (stale bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.known && (rev != 0 && rev < m.revision || sent.Before(m.polledAt())) {
		// An older answer than one already seen, or an answer to a call
		// sent before the one whose answer is kept: the state kept is as
		// of its sending or later, which Polled promises.
		return false
	}
	m.polled.Store(sent.UnixNano())
	if enabled != m.enabled || !m.known {
		m.cfg.Logger.Info("etcd auth", zap.Bool("enabled", enabled), zap.Uint64("auth-revision", rev))
	}
	m.setKnownLocked()
	m.enabled = enabled
	if !enabled && rev == 0 {
		return false
	}
	// Enabling or disabling auth need not move the auth revision.
	stale = m.checker == nil || rev != m.revision || m.checker.Enabled() != enabled
	m.revision = rev
	if stale {
		m.checker = nil
	}
	return stale
}

// Observed records what a request through the proxy showed of etcd's auth
// state (auth enabled or disabled through it, a token issued), ahead of
// the next poll, which it asks for at once. A checker of the other state is
// dropped: until the users and roles are read again, callers it would
// have judged go to etcd.
func (m *Mirror) Observed(enabled bool) {
	m.mu.Lock()
	m.setKnownLocked()
	m.enabled = enabled
	if m.checker != nil && m.checker.Enabled() != enabled {
		m.checker = nil
	}
	m.mu.Unlock()
	m.poke()
}

// setKnownLocked records that the auth state is known; m.mu is held.
func (m *Mirror) setKnownLocked() {
	if !m.known {
		m.known = true
		close(m.knownc)
	}
}

// Known returns a channel closed once the auth state is first known:
// readiness waits for it (a read before then costs etcd an AuthStatus).
func (m *Mirror) Known() <-chan struct{} { return m.knownc }

// Enabled reports whether etcd has auth enabled, as of the last poll, and
// whether any poll has answered yet.
func (m *Mirror) Enabled() (enabled, known bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.enabled, m.known
}

// Polled returns when the latest poll etcd answered was sent (the zero
// time before any): the auth state of Enabled and Checker was etcd's at
// that moment or later.
// The gate decides nothing from a state older than MaxMirrorAge.
func (m *Mirror) Polled() time.Time { return m.polledAt() }

func (m *Mirror) polledAt() time.Time {
	n := m.polled.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// Checker returns the checker of etcd's current auth revision, or nil
// while it is unknown.
func (m *Mirror) Checker() *Checker {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.checker
}

// Status is etcd's auth state from an AuthStatus that started after the
// call, shared with the calls that arrive while it waits: the auth state
// as of a moment after the caller's request arrived, which binds that
// request as it binds it in etcd.
func (m *Mirror) Status(ctx context.Context) (enabled bool, rev uint64, err error) {
	// The shared call that answers was sent after this moment: as a poll,
	// it is at least this fresh.
	asked := time.Now()
	st, err := m.status.Do(ctx)
	if err != nil {
		return false, 0, err
	}
	if m.observe(st.Enabled, st.AuthRevision, asked) {
		m.poke()
	}
	return st.Enabled, st.AuthRevision, nil
}

// ErrNoMirror says the proxy cannot read etcd's users and roles.
var ErrNoMirror = status.Error(codes.Unavailable, "etcd-snapcache: cannot check this caller's permissions: the proxy's own etcd identity cannot read etcd's users and roles (it needs the root role)")

// CheckerAt returns a checker of auth revision rev or later, waiting for
// the mirror to read it. It fails with ErrNoMirror while the users and
// roles cannot be read.
func (m *Mirror) CheckerAt(ctx context.Context, rev uint64) (*Checker, error) {
	for {
		m.mu.Lock()
		c, changed, readErr := m.checker, m.changed, m.readErr
		m.mu.Unlock()
		if c != nil && c.Revision() >= rev {
			return c, nil
		}
		if c == nil && isRefusal(readErr) {
			return nil, fmt.Errorf("%w: %w", ErrNoMirror, readErr)
		}
		m.poke()
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// isRefusal reports whether etcd refused the proxy's identity the users
// and roles: that lasts until an operator acts, unlike a failed read.
func isRefusal(err error) bool {
	switch e := etcderr.Of(err); {
	case err == nil:
		return false
	case errors.Is(e, rpctypes.ErrPermissionDenied), errors.Is(e, rpctypes.ErrUserEmpty),
		errors.Is(e, rpctypes.ErrUserNotFound), errors.Is(e, rpctypes.ErrAuthFailed), errors.Is(e, rpctypes.ErrInvalidAuthToken):
		return true
	}
	return false
}

func (m *Mirror) poke() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// boundedAuth gives each of the mirror's calls at most timeout.
type boundedAuth struct {
	pb.AuthClient
	timeout time.Duration
}

// within makes call with at most d of ctx.
func within[Req, Resp any](ctx context.Context, d time.Duration, call func(context.Context, Req, ...grpc.CallOption) (Resp, error), r Req, opts []grpc.CallOption) (Resp, error) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return call(ctx, r, opts...)
}

func (a boundedAuth) AuthStatus(ctx context.Context, r *pb.AuthStatusRequest, opts ...grpc.CallOption) (*pb.AuthStatusResponse, error) {
	return within(ctx, a.timeout, a.AuthClient.AuthStatus, r, opts)
}

func (a boundedAuth) UserList(ctx context.Context, r *pb.AuthUserListRequest, opts ...grpc.CallOption) (*pb.AuthUserListResponse, error) {
	return within(ctx, a.timeout, a.AuthClient.UserList, r, opts)
}

func (a boundedAuth) UserGet(ctx context.Context, r *pb.AuthUserGetRequest, opts ...grpc.CallOption) (*pb.AuthUserGetResponse, error) {
	return within(ctx, a.timeout, a.AuthClient.UserGet, r, opts)
}

func (a boundedAuth) RoleList(ctx context.Context, r *pb.AuthRoleListRequest, opts ...grpc.CallOption) (*pb.AuthRoleListResponse, error) {
	return within(ctx, a.timeout, a.AuthClient.RoleList, r, opts)
}

func (a boundedAuth) RoleGet(ctx context.Context, r *pb.AuthRoleGetRequest, opts ...grpc.CallOption) (*pb.AuthRoleGetResponse, error) {
	return within(ctx, a.timeout, a.AuthClient.RoleGet, r, opts)
}
