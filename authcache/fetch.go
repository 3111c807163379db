package authcache

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/authpb"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/etcderr"
)

// fetchAttempts bounds the reads of a snapshot while auth keeps changing.
const fetchAttempts = 5

// Fetch reads etcd's auth state through ac, with credentials that may read
// every user and role (the root role, once auth is enabled). It reads
// between two AuthStatus calls (both linearizable: they go through raft)
// and keeps the result only if they agree, so that the snapshot is one
// auth revision's state.
func Fetch(ctx context.Context, ac pb.AuthClient) (Snapshot, error) {
	for range fetchAttempts {
		before, err := ac.AuthStatus(ctx, &pb.AuthStatusRequest{})
		if err != nil {
			return Snapshot{}, fmt.Errorf("reading etcd's auth status: %w", err)
		}
		s, err := fetchState(ctx, ac)
		switch e := etcderr.Of(err); {
		case errors.Is(e, rpctypes.ErrUserNotFound), errors.Is(e, rpctypes.ErrRoleNotFound):
			continue // deleted while listed: the state changed, read it again
		case err != nil:
			return Snapshot{}, err
		}
		after, err := ac.AuthStatus(ctx, &pb.AuthStatusRequest{})
		if err != nil {
			return Snapshot{}, fmt.Errorf("reading etcd's auth status: %w", err)
		}
		if before.AuthRevision == after.AuthRevision && before.Enabled == after.Enabled {
			s.Enabled, s.Revision = after.Enabled, after.AuthRevision
			return s, nil
		}
	}
	return Snapshot{}, fmt.Errorf("etcd's auth state changed during %d reads in a row", fetchAttempts)
}

func fetchState(ctx context.Context, ac pb.AuthClient) (Snapshot, error) {
	var s Snapshot
	users, err := ac.UserList(ctx, &pb.AuthUserListRequest{})
	if err != nil {
		return s, fmt.Errorf("listing etcd's users: %w", err)
	}
	for _, name := range users.Users {
		u, err := ac.UserGet(ctx, &pb.AuthUserGetRequest{Name: name})
		if err != nil {
			return s, fmt.Errorf("reading etcd's user %q: %w", name, err)
		}
		s.Users = append(s.Users, &authpb.User{Name: []byte(name), Roles: u.Roles})
	}
	roles, err := ac.RoleList(ctx, &pb.AuthRoleListRequest{})
	if err != nil {
		return s, fmt.Errorf("listing etcd's roles: %w", err)
	}
	for _, name := range roles.Roles {
		r, err := ac.RoleGet(ctx, &pb.AuthRoleGetRequest{Role: name})
		if err != nil {
			return s, fmt.Errorf("reading etcd's role %q: %w", name, err)
		}
		s.Roles = append(s.Roles, &authpb.Role{Name: []byte(name), KeyPermission: r.Perm})
	}
	return s, nil
}
