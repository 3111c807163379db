package authcache

import (
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
}

// NewChecker returns a checker of s.
func NewChecker(s Snapshot) (*Checker, error) {
	tp, err := auth.NewTokenProvider(zap.NewNop(), "", nil, 0)
	if err != nil {
		return nil, err
	}
	// A nop logger: etcd's store logs every refused check at error level,
	// and refusals are answers here, not faults.
	store := auth.NewAuthStore(zap.NewNop(), newMemBackend(s), tp, bcrypt.MinCost)
	return &Checker{snap: s, store: store}, nil
}

// Enabled reports whether auth is enabled in the snapshot.
func (c *Checker) Enabled() bool { return c.snap.Enabled }

// Revision is the snapshot's auth revision.
func (c *Checker) Revision() uint64 { return c.snap.Revision }

// Identity is who a request is from, as etcd's AuthInfoFromCtx decides it:
// an empty User is anonymous. Revision is the auth revision the identity
// was established at: a simple token's or a certificate's is the current
// one, a JWT's is its claim.
type Identity struct {
	User     string
	Revision uint64
}

// current returns id at the snapshot's revision unless it carries its own.
func (c *Checker) info(id Identity) *auth.AuthInfo {
	if id.User == "" {
		return &auth.AuthInfo{}
	}
	rev := id.Revision
	if rev == 0 {
		rev = c.snap.Revision
	}
	return &auth.AuthInfo{Username: id.User, Revision: rev}
}

// CheckRange is etcd's check of a Range (and of a watch create) over
// [key, rangeEnd) by id: nil, or the gRPC error etcd answers.
func (c *Checker) CheckRange(id Identity, key, rangeEnd []byte) error {
	return grpcError(c.store.IsRangePermitted(c.info(id), key, rangeEnd))
}

// CheckPut is etcd's check of a Put of key by id.
func (c *Checker) CheckPut(id Identity, key []byte) error {
	return grpcError(c.store.IsPutPermitted(c.info(id), key))
}

// CheckDeleteRange is etcd's check of a DeleteRange over [key, rangeEnd).
func (c *Checker) CheckDeleteRange(id Identity, key, rangeEnd []byte) error {
	return grpcError(c.store.IsDeleteRangePermitted(c.info(id), key, rangeEnd))
}

// CheckAdmin is etcd's check of an admin-only request.
func (c *Checker) CheckAdmin(id Identity) error {
	if id.User == "" {
		return grpcError(c.store.IsAdminPermitted(nil))
	}
	return grpcError(c.store.IsAdminPermitted(c.info(id)))
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
