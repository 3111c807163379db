package authcache

import (
	"context"
	"errors"

	"go.uber.org/zap"
	"golang.org/x/crypto/bcrypt"

	"go.etcd.io/etcd/api/v3/authpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/server/v3/auth"
)

// Snapshot is etcd's auth state at one auth revision.
type Snapshot struct {
	Enabled  bool
	Revision uint64
	// Users with their roles (no passwords); Roles with their permissions.
	Users []*authpb.User
	Roles []*authpb.Role
}

// Checker answers permission questions about one Snapshot with etcd's auth
// store. It is safe for concurrent use.
type Checker struct {
	snap  Snapshot
	store auth.AuthStore
	jwt   bool // the store verifies JWTs with etcd's key
}

// NewChecker returns a checker of s. jwt, if not nil, is etcd's JWT token
// provider (NewJWTProvider), with which the checker verifies JWTs.
func NewChecker(s Snapshot, jwt auth.TokenProvider) (*Checker, error) {
	tp := jwt
	if tp == nil {
		var err error
		if tp, err = auth.NewTokenProvider(zap.NewNop(), "", nil, 0); err != nil {
			return nil, err
		}
	}
	// A nop logger: etcd's store logs every refused check at error level,
	// and refusals are answers here, not faults.
	store := auth.NewAuthStore(zap.NewNop(), newMemBackend(s), tp, bcrypt.MinCost)
	return &Checker{snap: s, store: store, jwt: jwt != nil}, nil
}

// NewJWTProvider returns etcd's JWT token provider for opts, etcd's
// --auth-token value ("jwt,pub-key=<file>,sign-method=<alg>"); nil for
// "simple" or "". With only a public key it verifies, and cannot sign.
func NewJWTProvider(lg *zap.Logger, opts string) (auth.TokenProvider, error) {
	if opts == "" || opts == "simple" {
		return nil, nil
	}
	tp, err := auth.NewTokenProvider(lg, opts, nil, 0)
	if err != nil {
		return nil, err
	}
	return tp, nil
}

// Enabled reports whether auth is enabled in the snapshot.
func (c *Checker) Enabled() bool { return c.snap.Enabled }

// Revision is the snapshot's auth revision.
func (c *Checker) Revision() uint64 { return c.snap.Revision }

// Identity is who a request is from, as etcd's AuthInfoFromCtx decides it.
// A zero Identity is anonymous. An authenticated one names a User (which
// may be empty or unknown: a certificate names whatever it names) and the
// auth Revision it was established at: a simple token's or a
// certificate's is the current one (0 here), a JWT's is its claim.
type Identity struct {
	Authenticated bool
	User          string
	Revision      uint64
}

// User returns the identity of an authenticated user at the current
// revision: a simple token's owner or a certificate's common name.
func User(name string) Identity { return Identity{Authenticated: true, User: name} }

// info is id as etcd's checks receive it: an anonymous caller is nil for
// the admin checks and the zero AuthInfo for the others, as etcd passes it.
func (c *Checker) info(id Identity) *auth.AuthInfo {
	if !id.Authenticated {
		return &auth.AuthInfo{}
	}
	rev := id.Revision
	if rev == 0 {
		rev = c.snap.Revision
	}
	return &auth.AuthInfo{Username: id.User, Revision: rev}
}

func (c *Checker) adminInfo(id Identity) *auth.AuthInfo {
	if !id.Authenticated {
		return nil
	}
	return c.info(id)
}

// CheckRange is etcd's check of a Range (and of a watch create) over
// [key, rangeEnd) by id: nil, or the gRPC error etcd answers.
func (c *Checker) CheckRange(id Identity, key, rangeEnd []byte) error {
	return grpcError(c.store.IsRangePermitted(c.info(id), key, rangeEnd))
}

// CheckPut is etcd's check of a Put of key by id, without its lease.
func (c *Checker) CheckPut(id Identity, key []byte) error {
	return grpcError(c.store.IsPutPermitted(c.info(id), key))
}

// CheckDeleteRange is etcd's check of a DeleteRange over [key, rangeEnd).
func (c *Checker) CheckDeleteRange(id Identity, key, rangeEnd []byte) error {
	return grpcError(c.store.IsDeleteRangePermitted(c.info(id), key, rangeEnd))
}

// CheckAdmin is etcd's check of an admin-only request.
func (c *Checker) CheckAdmin(id Identity) error {
	return grpcError(c.store.IsAdminPermitted(c.adminInfo(id)))
}

// RequireUser is etcd's requireAuthInfo: with auth enabled, an anonymous
// caller gets "user name is empty".
func (c *Checker) RequireUser(id Identity) error {
	if c.snap.Enabled && !id.Authenticated {
		return rpctypes.ErrGRPCUserEmpty
	}
	return nil
}

// HasRole reports whether id's user has role, as etcd's RoleGet asks.
func (c *Checker) HasRole(id Identity, role string) bool {
	return id.Authenticated && c.store.HasRole(id.User, role)
}

// ErrNotJWT says a token is not a JWT the checker can verify.
var ErrNotJWT = errors.New("authcache: not a verifiable JWT")

// TokenIdentity verifies the JWT in ctx's request metadata with etcd's
// code and returns the identity it carries: its username and revision
// claims. A token that is not a valid, unexpired JWT signed with etcd's
// key gets ErrNotJWT, as does every token when the checker has no JWT
// provider or auth is disabled.
func (c *Checker) TokenIdentity(ctx context.Context) (Identity, error) {
	if !c.jwt {
		return Identity{}, ErrNotJWT
	}
	ai, err := c.store.AuthInfoFromCtx(ctx)
	if err != nil || ai == nil {
		return Identity{}, ErrNotJWT
	}
	return Identity{Authenticated: true, User: ai.Username, Revision: ai.Revision}, nil
}

// authErrors are etcd's gRPC errors for its auth store's errors
// (etcdserver/api/v3rpc/util.go).
var authErrors = map[error]error{
	auth.ErrRootUserNotExist:     rpctypes.ErrGRPCRootUserNotExist,
	auth.ErrRootRoleNotExist:     rpctypes.ErrGRPCRootRoleNotExist,
	auth.ErrUserAlreadyExist:     rpctypes.ErrGRPCUserAlreadyExist,
	auth.ErrUserEmpty:            rpctypes.ErrGRPCUserEmpty,
	auth.ErrUserNotFound:         rpctypes.ErrGRPCUserNotFound,
	auth.ErrRoleAlreadyExist:     rpctypes.ErrGRPCRoleAlreadyExist,
	auth.ErrRoleNotFound:         rpctypes.ErrGRPCRoleNotFound,
	auth.ErrRoleEmpty:            rpctypes.ErrGRPCRoleEmpty,
	auth.ErrAuthFailed:           rpctypes.ErrGRPCAuthFailed,
	auth.ErrPermissionDenied:     rpctypes.ErrGRPCPermissionDenied,
	auth.ErrRoleNotGranted:       rpctypes.ErrGRPCRoleNotGranted,
	auth.ErrPermissionNotGranted: rpctypes.ErrGRPCPermissionNotGranted,
	auth.ErrAuthNotEnabled:       rpctypes.ErrGRPCAuthNotEnabled,
	auth.ErrInvalidAuthToken:     rpctypes.ErrGRPCInvalidAuthToken,
	auth.ErrInvalidAuthMgmt:      rpctypes.ErrGRPCInvalidAuthMgmt,
	auth.ErrAuthOldRevision:      rpctypes.ErrGRPCAuthOldRevision,
}

func grpcError(err error) error {
	if err == nil {
		return nil
	}
	for e, g := range authErrors {
		if errors.Is(err, e) {
			return g
		}
	}
	return err
}
