package server

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"strings"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
)

// Where each caller's requests are checked:
//
//   - Reads (Range, RangeStream) and watch creates are answered from the
//     cache, so the proxy checks them itself, with etcd's auth store on the
//     mirror (authorizeRead, authorizeWatch), for every caller whose
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
// new watches use the mirror, at most about a second behind.

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
func (s *Server) hasIdentity() bool { return s.cfg.User != "" || s.upstreamCN != "" }

// forwarding reports whether every request goes to etcd as it came, as
// etcd's grpc-proxy sends it: etcd has auth enabled and the proxy has no
// identity of its own, so it can neither read the keyspace nor tell what
// any caller may do, and etcd judges each request by the caller's own
// token, or as anonymous. Nothing is served from the cache then, even a
// cache loaded while auth was disabled. Without an identity the proxy's
// connection carries no one's permissions, so a certificate caller's
// request, which cannot go as that caller, goes as anonymous. (A proxy
// whose own identity etcd refuses is misconfigured instead: it is not
// ready, and says why.)
func (s *Server) forwarding() bool {
	if s.hasIdentity() {
		return false
	}
	if on, known := s.authMirror.Enabled(); known {
		return on
	}
	return !s.follower.Serving() && s.follower.IdentityRefused()
}

// authFor returns the checker that binds a request of c, and c's identity
// in it: a nil checker when auth is disabled (everything is allowed). With
// fresh, the auth state is proven as of after the request arrived.
// kvproxy.ErrAskEtcd says only etcd can judge c (a token the proxy cannot
// attribute, or no mirror to check it with).
func (s *Server) authFor(ctx context.Context, c caller, fresh bool) (*authcache.Checker, authcache.Identity, error) {
	var none authcache.Identity
	if s.forwarding() {
		return nil, none, kvproxy.ErrAskEtcd
	}
	enabled, rev := false, uint64(0)
	if fresh {
		var err error
		if enabled, rev, err = s.freshAuth(ctx); err != nil {
			if c.kind == tokenCaller {
				return nil, none, kvproxy.ErrAskEtcd
			}
			if ctx.Err() != nil {
				return nil, none, status.FromContextError(ctx.Err()).Err()
			}
			return nil, none, status.Errorf(codes.Unavailable, "etcd-snapcache: reading etcd's auth state: %v", err)
		}
	} else {
		var known bool
		if enabled, known = s.authMirror.Enabled(); !known {
			if c.kind == tokenCaller {
				return nil, none, kvproxy.ErrAskEtcd
			}
			return nil, none, errAuthUnknown
		}
	}
	if !enabled {
		return nil, none, nil
	}
	chk := s.authMirror.Checker()
	var chkErr error // why no checker came, when one was waited for
	if rev != 0 && (chk == nil || chk.Revision() < rev) || chk == nil && c.kind == certCaller {
		// A fresh auth revision, or a certificate caller while the mirror
		// reads the users and roles again after a change: wait for them,
		// rather than refuse a caller only the proxy can check.
		cctx, cancel := context.WithTimeout(ctx, s.cfg.FreshnessTimeout)
		chk, chkErr = s.authMirror.CheckerAt(cctx, rev)
		cancel()
	}
	switch {
	case c.kind == anonymous:
		if chk == nil {
			chk = anonymousChecker
		}
		return chk, none, nil
	case chk == nil && c.kind == tokenCaller:
		return nil, none, kvproxy.ErrAskEtcd
	case chk == nil && !errors.Is(chkErr, authcache.ErrNoMirror):
		if ctx.Err() != nil {
			return nil, none, status.FromContextError(ctx.Err()).Err()
		}
		return nil, none, errAuthReading
	case chk == nil:
		s.noMirrorLog.Do(func() {
			s.lg.Error("refusing certificate-identified requests while auth is enabled: the proxy cannot read etcd's users and roles to check them; give it root credentials (--user)")
		})
		return nil, none, authcache.ErrNoMirror
	case c.kind == certCaller:
		return chk, authcache.User(c.cn), nil
	}
	id, err := s.tokenIdentity(ctx, c.token, chk)
	return chk, id, err
}

// tokenIdentity is the identity of a token at chk's auth revision: a JWT
// verified with etcd's key, or a simple token issued through the proxy
// that etcd accepted recently at that revision (shown to etcd again when
// it was not). kvproxy.ErrAskEtcd: the proxy cannot attribute it.
func (s *Server) tokenIdentity(ctx context.Context, token string, chk *authcache.Checker) (authcache.Identity, error) {
	if id, err := chk.TokenIdentity(ctx); err == nil {
		return id, nil
	}
	if user, ok := s.tokens.trusted(token, chk.Revision(), s.cfg.AuthTokenCheckInterval); ok {
		return authcache.User(user), nil
	}
	if !s.tokens.known(token) {
		return authcache.Identity{}, kvproxy.ErrAskEtcd
	}
	if err := s.verifyToken(ctx); err != nil {
		return authcache.Identity{}, err
	}
	if user, ok := s.tokens.trusted(token, chk.Revision(), s.cfg.AuthTokenCheckInterval); ok {
		return authcache.User(user), nil
	}
	return authcache.Identity{}, kvproxy.ErrAskEtcd
}

// verifyToken shows the caller's token to etcd with a cheap request etcd
// checks it for, a count of one key: etcd's answer
// tells whether the token is valid (watchTokens records it), and, being a
// use, keeps a simple token alive in etcd. An invalid token gets etcd's
// error; any other failure leaves the judgement to etcd. The count is
// linearizable: when the upstream is another proxy, a serializable one
// could be answered from that proxy's cache, at its older auth state.
func (s *Server) verifyToken(ctx context.Context) error {
	_, err := s.probeKV.Range(ctx, &pb.RangeRequest{Key: authProbeKey, CountOnly: true})
	switch e := rpctypes.Error(err); {
	case err == nil, errors.Is(e, rpctypes.ErrPermissionDenied):
		return nil
	case errors.Is(e, rpctypes.ErrInvalidAuthToken):
		return rpctypes.ErrGRPCInvalidAuthToken
	}
	return kvproxy.ErrAskEtcd
}

// freshAuth is etcd's auth state as of after the call: whether auth is
// enabled and, if it is, the auth revision. While auth is disabled it
// costs nothing when the proxy's own identity is anonymous (then every
// read fence and forwarded request is anonymous, and etcd refuses it if
// auth was enabled meanwhile), or one shared anonymous quorum read;
// otherwise, and while auth is enabled, a shared AuthStatus.
func (s *Server) freshAuth(ctx context.Context) (bool, uint64, error) {
	if on, known := s.authMirror.Enabled(); known && !on {
		switch {
		case s.cfg.User == "" && s.upstreamCN == "":
			return false, 0, nil
		case s.upstreamCN == "":
			on, err := s.disabledProof.Do(ctx)
			if err != nil {
				return false, 0, err
			}
			if !on {
				return false, 0, nil
			}
		}
	}
	return s.authMirror.Status(ctx)
}

// authEnabledNow is the disabled proof's call: a linearizable count of one
// key by an anonymous caller, which etcd refuses exactly while auth is
// enabled (refusedByAuth).
func (s *Server) authEnabledNow(ctx context.Context) (bool, error) {
	_, err := pb.NewKVClient(s.client.ActiveConnection()).Range(ctx, &pb.RangeRequest{Key: authProbeKey, CountOnly: true})
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

// authorizeRead is etcd's permission check of a read (kvproxy's
// Authorize), for the caller of ctx.
func (s *Server) authorizeRead(ctx context.Context, key, rangeEnd []byte, linearizable bool) error {
	c := s.callerOf(ctx)
	chk, id, err := s.authFor(ctx, c, linearizable)
	if err != nil || chk == nil {
		return err
	}
	return chk.CheckRange(id, key, rangeEnd)
}

// authorizeWatch is etcd's permission check of a watch create on a stream
// the proxy serves (watchproxy's Authorize). Streams whose token the proxy
// cannot attribute are relayed (relayWatch); one that it could at the
// start but cannot now is refused with Unavailable, which clients retry.
func (s *Server) authorizeWatch(ctx context.Context, key, rangeEnd []byte) error {
	c := s.callerOf(ctx)
	chk, id, err := s.authFor(ctx, c, false)
	switch {
	case errors.Is(err, kvproxy.ErrAskEtcd):
		return errAuthUnknown
	case err != nil || chk == nil:
		return err
	}
	return chk.CheckRange(id, key, rangeEnd)
}

// relayWatch reports whether a watch stream must be relayed to etcd whole:
// its token is one the proxy cannot attribute.
func (s *Server) relayWatch(ctx context.Context) bool {
	c := s.callerOf(ctx)
	switch {
	case s.forwarding():
		return true
	case c.kind != tokenCaller:
		return false
	}
	_, _, err := s.authFor(ctx, c, false)
	return errors.Is(err, kvproxy.ErrAskEtcd)
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
func (s *Server) admit(ctx context.Context, method string) (_ context.Context, check func(req any) error) {
	switch {
	case method == methodRange || method == methodRangeStream || method == methodWatch:
		// Checked per read and per watch create by their servers.
		if s.callerOf(ctx).kind == certCaller {
			return asProxy(ctx), nil
		}
		return ctx, nil
	case method == methodAuthenticate || strings.HasPrefix(method, "/grpc.health.v1."):
		return ctx, nil
	}
	c := s.callerOf(ctx)
	switch {
	case s.forwarding():
		// As it came: a certificate caller's goes as anonymous (asProxy,
		// the proxy having no identity), which etcd judges.
		if c.kind == certCaller {
			return asProxy(ctx), nil
		}
		return ctx, nil
	case c.kind == tokenCaller:
		return ctx, nil // with its token: etcd checks it
	case c.kind == anonymous && s.upstreamCN == "":
		return ctx, nil // without identity: etcd checks it
	}
	if c.kind == certCaller {
		ctx = asProxy(ctx)
	}
	// The check sees the request's final context. It captures a copy:
	// capturing ctx itself, which is reassigned, would move ctx to the
	// heap on every call, Ranges included.
	checkCtx := ctx
	check = func(req any) error { return s.checkForwarded(checkCtx, c, method, req) }
	return ctx, check
}

// checkForwarded is etcd's check of a request the proxy sends to etcd as
// itself, with the upstream release's rules, at a fresh auth revision.
func (s *Server) checkForwarded(ctx context.Context, c caller, method string, req any) error {
	if err := kvproxy.ValidateWrite(req); err != nil {
		return err
	}
	chk, id, err := s.authFor(ctx, c, true)
	if err != nil || chk == nil {
		return err
	}
	rules, err := s.rules()
	if err != nil {
		return errReleaseUnknown
	}
	var leases authcache.Leases
	if ids, all := rules.LeasesNeeded(req); (len(ids) > 0 || all) && chk.CheckAdmin(id) != nil {
		if leases, err = s.leaseKeys(ctx, ids, all); err != nil {
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
func (s *Server) rules() (authcache.Rules, error) {
	v := s.follower.UpstreamVersion()
	if c := s.releaseRules.Load(); c != nil && c.version == v {
		return c.rules, c.err
	}
	r, err := authcache.RulesFor(v)
	s.releaseRules.Store(&releaseRules{version: v, rules: r, err: err})
	if err == nil && r.Stricter {
		s.lg.Warn("etcd's release checks less than the proxy's rules for it (known auth fixes came later); certificate callers may be refused requests that this etcd would allow, never the reverse", zap.String("version", v))
	}
	return r, err
}

// leaseKeys reads the keys attached to leases from etcd, as the proxy: the
// leases ids, or every lease.
func (s *Server) leaseKeys(ctx context.Context, ids []int64, all bool) (authcache.Leases, error) {
	lc := pb.NewLeaseClient(s.own.ActiveConnection())
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

func (s *Server) gateUnary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	ctx, check := s.admit(ctx, info.FullMethod)
	if check != nil {
		if err := check(req); err != nil {
			return nil, err
		}
	}
	return handler(ctx, req)
}

func (s *Server) gateStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, check := s.admit(ss.Context(), info.FullMethod)
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

// authEnabledProbe is a cheap test of whether etcd has auth enabled: a
// count-only read of one key by an anonymous caller, which etcd refuses
// exactly while auth is enabled (refusedByAuth). It is linearizable, so
// that an upstream proxy cannot answer it from its cache at an older auth
// state (a read index for etcd). It
// is anonymous only without a certificate identity, so there is none with
// one.
func (s *Server) authEnabledProbe() func(ctx context.Context) (bool, error) {
	if s.upstreamCN != "" {
		return nil
	}
	kv := pb.NewKVClient(s.client.ActiveConnection())
	return func(ctx context.Context) (bool, error) {
		_, err := kv.Range(ctx, &pb.RangeRequest{Key: authProbeKey, CountOnly: true})
		return refusedByAuth(err)
	}
}

// authProbeKey is read, never written, by the proxy's probes.
var authProbeKey = []byte("\x00etcd-snapcache-auth-probe")
