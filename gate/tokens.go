package gate

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// tokens are the auth tokens the proxy can attribute: those issued by
// Authenticate through it, to the user they were issued to.
//
// A token is trusted for cached reads for --auth-token-check-interval
// after etcd last accepted it, at the auth revision of that acceptance;
// then it is shown to etcd again (Gate.verifyToken). That proves it is
// still valid (etcd ends simple tokens on user deletion, a password change
// and --auth-token-ttl without use, and the first two move the auth
// revision) and, being a use, keeps it alive in etcd: a caller served from
// the cache never sees its token expire where etcd's would not.
type tokens struct {
	mu sync.Mutex
	// Guarded by mu.
	byToken map[string]*tokenEntry
	pruneAt int // len(byToken) at which issued prunes it
}

// tokenEntry is one token; guarded by tokens.mu.
type tokenEntry struct {
	user string
	// verifiedAt is when etcd last accepted the token, at auth revision
	// verifiedRev (as the proxy mirrored it then).
	verifiedAt  time.Time
	verifiedRev uint64
}

func newTokens() *tokens {
	return &tokens{byToken: map[string]*tokenEntry{}, pruneAt: minTokensPrune}
}

// issued records a token etcd issued to user: valid at auth revision rev
// if current, else not until etcd accepts it again (verifyToken).
func (t *tokens) issued(token, user string, rev uint64, current bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.byToken) >= t.pruneAt {
		t.pruneLocked()
	}
	e := &tokenEntry{user: user}
	if current {
		e.verifiedAt, e.verifiedRev = time.Now(), rev
	}
	t.byToken[token] = e
}

// tokenIdle is how long a token etcd has not accepted through the proxy
// stays known. Past it, the proxy sends the token's reads to etcd rather
// than verify it: etcd ends a simple token unused for --auth-token-ttl
// (5 minutes by default), and one in use is verified at every
// --auth-token-check-interval.
const tokenIdle = 15 * time.Minute

// pruneLocked forgets the tokens idle for tokenIdle, and sets the size at
// which it runs again: twice what is left, so that it costs O(1) per
// token issued. mu is held.
func (t *tokens) pruneLocked() {
	for token, e := range t.byToken {
		if time.Since(e.verifiedAt) > tokenIdle {
			delete(t.byToken, token)
		}
	}
	t.pruneAt = max(minTokensPrune, 2*len(t.byToken))
}

// minTokensPrune is the fewest known tokens at which pruneLocked runs.
const minTokensPrune = 1024

// trusted returns the user of token if etcd accepted it within interval
// and at auth revision rev.
func (t *tokens) trusted(token string, rev uint64, interval time.Duration) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byToken[token]
	if e == nil || e.verifiedRev != rev || time.Since(e.verifiedAt) > interval {
		return "", false
	}
	return e.user, true
}

// known reports whether token was issued through the proxy and not found
// invalid since.
func (t *tokens) known(token string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.byToken[token] != nil
}

// answered records etcd's answer to a KV request forwarded with token:
// any answer but an invalid-token error proves the token valid now, at
// auth revision rev if current; that error ends it.
func (t *tokens) answered(token string, rev uint64, current bool, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byToken[token]
	if e == nil {
		return
	}
	switch {
	case errors.Is(rpctypes.Error(err), rpctypes.ErrInvalidAuthToken):
		delete(t.byToken, token)
	case current && (err == nil || errors.Is(rpctypes.Error(err), rpctypes.ErrPermissionDenied)):
		e.verifiedAt, e.verifiedRev = time.Now(), rev
	}
}

// TokenKeys are the request metadata keys etcd reads a caller's token
// from: a forwarded request carries them for etcd to judge.
var TokenKeys = []string{rpctypes.TokenFieldNameGRPC, rpctypes.TokenFieldNameSwagger}

// tokenOf returns the caller's token, "" for none, where etcd's
// AuthInfoFromCtx reads it: the token key, else the authorization key,
// whose "Bearer " prefix etcd strips (since 3.6.13: see CallerOf).
func tokenOf(ctx context.Context) string {
	token, _, _ := bearerTokenOf(ctx)
	return token
}

// bearerTokenOf is tokenOf, whether it lost a "Bearer " prefix, and
// whether the caller sent a token key at all: etcd takes a key that is
// present, even empty, for a token, and refuses an empty one as invalid.
func bearerTokenOf(ctx context.Context) (token string, stripped, present bool) {
	// Every request asks this, at least twice: ValueFromIncomingContext
	// copies only the key's values, which most requests do not carry,
	// where FromIncomingContext would copy all the metadata.
	if v := metadata.ValueFromIncomingContext(ctx, rpctypes.TokenFieldNameGRPC); len(v) > 0 {
		return v[0], false, true
	}
	if v := metadata.ValueFromIncomingContext(ctx, rpctypes.TokenFieldNameSwagger); len(v) > 0 {
		token, stripped := strings.CutPrefix(v[0], "Bearer ")
		return token, stripped, true
	}
	return "", false, false
}

// WatchTokens is the client interceptor of the forwarding connection:
// etcd's answer to a KV call made with a caller's token tells whether the
// token is valid. Only KV calls tell: etcd checks every one's token, where
// it skips the check for some other calls (Authenticate; LeaseLeases and
// MemberList in some releases), whose success then proves nothing. The
// answer counts at the mirrored auth revision only if that did not move
// while the call was out: etcd may have checked the token before a change
// the mirror has seen since.
func (g *Gate) WatchTokens(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	token := tokenOf(ctx)
	if token == "" || !strings.HasPrefix(method, kvMethodPrefix) {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	rev := g.mirroredAuthRevision()
	err := invoker(ctx, method, req, reply, cc, opts...)
	g.tokens.answered(token, rev, g.mirroredAuthRevision() == rev, err)
	return err
}

// kvMethodPrefix starts the full method name of every KV call.
const kvMethodPrefix = "/etcdserverpb.KV/"

// mirroredAuthRevision is the auth revision of the mirror's checker, 0 if
// none (or before Connect).
func (g *Gate) mirroredAuthRevision() uint64 {
	if g.auth == nil {
		return 0
	}
	if c := g.auth.Checker(); c != nil {
		return c.Revision()
	}
	return 0
}

// AuthServer is the Auth service forwarded to upstream, learning the
// tokens that Authenticate issues through the proxy, and telling the
// mirror what a successful call showed of the auth state.
func (g *Gate) AuthServer(upstream pb.AuthServer) pb.AuthServer {
	return &authServer{AuthServer: upstream, g: g}
}

// authServer forwards the Auth service for a Gate.
type authServer struct {
	pb.AuthServer
	g *Gate
}

// Authenticate records the token issued, at the mirrored auth revision,
// current if the mirror did not move while Authenticate was out. etcd
// issues tokens only while auth is enabled.
func (a *authServer) Authenticate(ctx context.Context, r *pb.AuthenticateRequest) (*pb.AuthenticateResponse, error) {
	rev := a.g.mirroredAuthRevision()
	resp, err := a.AuthServer.Authenticate(ctx, r)
	if err == nil && resp.Token != "" {
		current := a.g.mirroredAuthRevision() == rev
		a.g.mirror.Observed(true)
		a.g.tokens.issued(resp.Token, r.Name, rev, current)
	}
	return resp, err
}

func (a *authServer) AuthEnable(ctx context.Context, r *pb.AuthEnableRequest) (*pb.AuthEnableResponse, error) {
	resp, err := a.AuthServer.AuthEnable(ctx, r)
	if err == nil {
		a.g.mirror.Observed(true)
	}
	return resp, err
}

func (a *authServer) AuthDisable(ctx context.Context, r *pb.AuthDisableRequest) (*pb.AuthDisableResponse, error) {
	resp, err := a.AuthServer.AuthDisable(ctx, r)
	if err == nil {
		a.g.mirror.Observed(false)
	}
	return resp, err
}
