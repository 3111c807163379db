package authcache

import (
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"
	"go.etcd.io/etcd/server/v3/etcdserver/apply"
	"go.etcd.io/etcd/server/v3/lease"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Rules are the permission rules of one etcd release, where releases
// differ. Read from etcd's sources (etcdserver/v3_server.go,
// etcdserver/apply/auth.go, etcdserver/api/v3rpc/*.go) of every 3.6 patch
// release, 3.5.35 and 3.7.3: the base rules are 3.7.3's, which 3.6.12 and
// later and 3.5.33 and later follow too, but for AuthStatus.
type Rules struct {
	// Release is the upstream's version, major.minor.patch.
	Release string
	// AuthStatusAdminOnly: AuthStatus needs the root role (before 3.7).
	AuthStatusAdminOnly bool
	// StatusAdminOnly: Maintenance.Status needs the root role (3.6.0 to
	// 3.6.11); otherwise any authenticated user.
	StatusAdminOnly bool
	// MemberListAdminOnly, AlarmGetAdminOnly: MemberList and Alarm GET
	// need the root role (3.6.9); otherwise any authenticated user.
	MemberListAdminOnly, AlarmGetAdminOnly bool
	// BearerStripped: a token in the authorization header loses its
	// "Bearer " prefix (3.6.13, 3.5.32 and later).
	BearerStripped bool
	// Stricter reports that etcd checks less than these rules: releases
	// with known auth bugs (before 3.6.11, before 3.5.33), for which the
	// proxy applies the strictest rules it knows and refuses what etcd
	// might allow, never the reverse.
	Stricter bool
}

// RulesFor returns the rules of the etcd release version (as Status
// reports it, "3.6.8").
func RulesFor(version string) (Rules, error) {
	var major, minor, patch int
	if _, err := fmt.Sscanf(version, "%d.%d.%d", &major, &minor, &patch); err != nil || major != 3 {
		return Rules{}, fmt.Errorf("authcache: etcd version %q: want 3.x.y", version)
	}
	r := Rules{Release: fmt.Sprintf("%d.%d.%d", major, minor, patch), BearerStripped: true}
	at := func(m, p int) bool { return minor > m || minor == m && patch >= p }
	switch {
	case minor >= 7:
		return r, nil
	case minor == 6:
		r.BearerStripped = at(6, 13)
		r.StatusAdminOnly = !at(6, 12)
		r.MemberListAdminOnly = !at(6, 10)
		r.AlarmGetAdminOnly = !at(6, 10)
		r.Stricter = !at(6, 11)
	case minor == 5:
		r.BearerStripped = patch >= 32
		r.StatusAdminOnly = patch < 32
		r.MemberListAdminOnly, r.AlarmGetAdminOnly = patch < 33, patch < 33
		r.Stricter = patch < 33
	default:
		r.BearerStripped = false
		r.StatusAdminOnly, r.MemberListAdminOnly, r.AlarmGetAdminOnly, r.Stricter = true, true, true, true
	}
	r.AuthStatusAdminOnly = true
	return r, nil
}

// Leases are the keys attached to leases, as etcd's lessor holds them at
// the time of a check. A lease missing from it does not exist, and etcd
// checks nothing about it (its request then fails with "lease not found").
type Leases map[int64][]string

// lessor is etcd's lessor as its permission checks use it: Lookup only.
type lessor struct {
	lease.FakeLessor
	leases Leases
}

func (l *lessor) Lookup(id lease.LeaseID) *lease.Lease {
	keys, ok := l.leases[int64(id)]
	if !ok {
		return nil
	}
	le := lease.NewLease(id, 0)
	for _, k := range keys {
		le.SetLeaseItem(lease.LeaseItem{Key: k})
	}
	return le
}

// LeasesNeeded returns the leases whose attached keys the check of req by
// a caller who is not an admin reads, and whether it reads every lease
// (LeaseLeases).
func (r Rules) LeasesNeeded(req any) (ids []int64, all bool) {
	switch q := req.(type) {
	case *pb.PutRequest:
		return leaseOf(nil, q), false
	case *pb.TxnRequest:
		return txnLeases(nil, q), false
	case *pb.LeaseRevokeRequest:
		return []int64{q.ID}, false
	case *pb.LeaseKeepAliveRequest:
		return []int64{q.ID}, false
	case *pb.LeaseTimeToLiveRequest:
		if q.Keys {
			return []int64{q.ID}, false
		}
	case *pb.LeaseLeasesRequest:
		return nil, true
	}
	return nil, false
}

func leaseOf(ids []int64, p *pb.PutRequest) []int64 {
	if p != nil && p.Lease != 0 {
		ids = append(ids, p.Lease)
	}
	return ids
}

func txnLeases(ids []int64, t *pb.TxnRequest) []int64 {
	for _, ops := range [][]*pb.RequestOp{t.Success, t.Failure} {
		for _, op := range ops {
			switch o := op.Request.(type) {
			case *pb.RequestOp_RequestPut:
				ids = leaseOf(ids, o.RequestPut)
			case *pb.RequestOp_RequestTxn:
				if o.RequestTxn != nil {
					ids = txnLeases(ids, o.RequestTxn)
				}
			}
		}
	}
	return ids
}

// errNotChecked refuses a request whose check the proxy does not know: it
// never forwards what it cannot check.
func errNotChecked(method string) error {
	return status.Errorf(codes.PermissionDenied, "etcd-snapcache: %s cannot be checked for a certificate identity; send it with a token, or straight to etcd", method)
}

// CheckRequest is etcd's permission check of req, a request of the gRPC
// method (its full name), by id, under rules, with leases holding the
// keys of every lease LeasesNeeded names. It returns nil or the gRPC
// error etcd answers. A method it does not know is refused.
func (c *Checker) CheckRequest(id Identity, method string, req any, rules Rules, leases Leases) error {
	ls := &lessor{leases: leases}
	switch q := req.(type) {
	case *pb.RangeRequest:
		return c.CheckRange(id, q.Key, q.RangeEnd)
	case *pb.PutRequest:
		// etcd's checkPutAuth, which a Txn of one Put runs unchanged.
		return c.checkTxn(id, ls, &pb.TxnRequest{Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestPut{RequestPut: q}}}})
	case *pb.DeleteRangeRequest:
		if err := c.CheckDeleteRange(id, q.Key, q.RangeEnd); err != nil {
			return err
		}
		if q.PrevKv {
			return c.CheckRange(id, q.Key, q.RangeEnd)
		}
		return nil
	case *pb.TxnRequest:
		return c.checkTxn(id, ls, q)
	case *pb.CompactionRequest:
		return c.CheckAdmin(id) // in etcd's handler (api/v3rpc/key.go), not at apply
	case *pb.LeaseGrantRequest:
		return c.RequireUser(id)
	case *pb.LeaseRevokeRequest:
		if err := c.RequireUser(id); err != nil {
			return err
		}
		return c.checkLeaseKeys(id, ls, q.ID, c.CheckPut)
	case *pb.LeaseKeepAliveRequest:
		if err := c.RequireUser(id); err != nil {
			return err
		}
		return c.checkLeaseKeys(id, ls, q.ID, c.CheckPut)
	case *pb.LeaseTimeToLiveRequest:
		if err := c.RequireUser(id); err != nil {
			return err
		}
		if !q.Keys {
			return nil
		}
		return c.checkLeaseKeys(id, ls, q.ID, func(id Identity, key []byte) error { return c.CheckRange(id, key, nil) })
	case *pb.LeaseLeasesRequest:
		if err := c.RequireUser(id); err != nil {
			return err
		}
		if c.CheckAdmin(id) == nil {
			return nil
		}
		for lid := range leases {
			if err := c.checkLeaseKeys(id, ls, lid, func(id Identity, key []byte) error { return c.CheckRange(id, key, nil) }); err != nil {
				return err
			}
		}
		return nil
	case *pb.MemberListRequest:
		if rules.MemberListAdminOnly {
			return c.CheckAdmin(id)
		}
		return c.RequireUser(id)
	case *pb.MemberAddRequest, *pb.MemberRemoveRequest, *pb.MemberUpdateRequest, *pb.MemberPromoteRequest:
		return c.CheckAdmin(id)
	case *pb.StatusRequest:
		if rules.StatusAdminOnly {
			return c.CheckAdmin(id)
		}
		return c.RequireUser(id)
	case *pb.AlarmRequest:
		if q.Action == pb.AlarmRequest_GET && !rules.AlarmGetAdminOnly {
			return c.RequireUser(id)
		}
		return c.CheckAdmin(id)
	case *pb.DefragmentRequest, *pb.SnapshotRequest, *pb.HashRequest, *pb.HashKVRequest, *pb.MoveLeaderRequest, *pb.DowngradeRequest:
		return c.CheckAdmin(id)
	case *pb.AuthenticateRequest:
		return nil
	case *pb.AuthStatusRequest:
		if rules.AuthStatusAdminOnly {
			return c.CheckAdmin(id)
		}
		return nil
	case *pb.AuthUserGetRequest:
		// An anonymous caller's name is "": it may "read" user "", which
		// etcd then does not find.
		if err := c.CheckAdmin(id); err != nil && q.Name != id.User {
			return err
		}
		return nil
	case *pb.AuthRoleGetRequest:
		if err := c.CheckAdmin(id); err != nil && !c.HasRole(id, q.Role) {
			return err
		}
		return nil
	case *pb.AuthEnableRequest, *pb.AuthDisableRequest, *pb.AuthUserAddRequest, *pb.AuthUserDeleteRequest,
		*pb.AuthUserChangePasswordRequest, *pb.AuthUserGrantRoleRequest, *pb.AuthUserRevokeRoleRequest,
		*pb.AuthRoleAddRequest, *pb.AuthRoleGrantPermissionRequest, *pb.AuthRoleRevokePermissionRequest,
		*pb.AuthRoleDeleteRequest, *pb.AuthUserListRequest, *pb.AuthRoleListRequest:
		return c.CheckAdmin(id)
	case *v3lockpb.LockRequest, *v3lockpb.UnlockRequest, *v3electionpb.CampaignRequest, *v3electionpb.ProclaimRequest,
		*v3electionpb.ResignRequest, *v3electionpb.LeaderRequest:
		return c.checkConcurrency(id, req)
	}
	return errNotChecked(method)
}

// checkConcurrency checks a lock or election request. etcd runs them on an
// in-process client with the caller's identity, which reads and writes the
// keys under name/, and answers a refusal of those inner calls with code
// Unknown and etcd's message. The check asks for READ, and WRITE where the
// call writes, on the whole prefix: a user allowed only some keys under it
// may be refused here where etcd, writing only its own key, would not.
func (c *Checker) checkConcurrency(id Identity, req any) error {
	var err error
	switch q := req.(type) {
	case *v3lockpb.LockRequest:
		err = c.checkPrefix(id, string(q.Name)+"/", true)
	case *v3lockpb.UnlockRequest:
		err = c.CheckDeleteRange(id, q.Key, nil)
	case *v3electionpb.CampaignRequest:
		err = c.checkPrefix(id, string(q.Name)+"/", true)
	case *v3electionpb.ProclaimRequest:
		if q.Leader != nil {
			err = c.checkPrefix(id, string(q.Leader.Name)+"/", true)
		}
	case *v3electionpb.ResignRequest:
		if q.Leader != nil {
			err = c.checkPrefix(id, string(q.Leader.Name)+"/", true)
		}
	case *v3electionpb.LeaderRequest:
		err = c.checkPrefix(id, string(q.Name)+"/", false)
	}
	if err != nil {
		return status.Error(codes.Unknown, status.Convert(err).Message())
	}
	return nil
}

// checkPrefix checks READ, and with write WRITE, on every key under
// prefix: what a lock or an election on it does through etcd's client.
func (c *Checker) checkPrefix(id Identity, prefix string, write bool) error {
	key, end := []byte(prefix), []byte(clientv3.GetPrefixRangeEnd(prefix))
	if err := c.CheckRange(id, key, end); err != nil {
		return err
	}
	if write {
		return c.CheckDeleteRange(id, key, end)
	}
	return nil
}

func (c *Checker) checkTxn(id Identity, ls *lessor, t *pb.TxnRequest) error {
	return grpcError(apply.CheckTxnAuth(c.store, c.info(id), ls, t))
}

// checkLeaseKeys is etcd's check of the keys attached to a lease: none
// for an admin; check on each key for anyone else.
func (c *Checker) checkLeaseKeys(id Identity, ls *lessor, leaseID int64, check func(Identity, []byte) error) error {
	if !c.snap.Enabled || c.CheckAdmin(id) == nil {
		return nil
	}
	le := ls.Lookup(lease.LeaseID(leaseID))
	if le == nil {
		return nil
	}
	for _, key := range le.Keys() {
		if err := check(id, []byte(key)); err != nil {
			return err
		}
	}
	return nil
}
