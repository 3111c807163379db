package authcache_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// etcd's Lock and Election in-process client outlives etcd (see
// integration's TestMain); nothing here uses them.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// keyspace of the random permissions and requests: few keys, so that
// ranges overlap, touch and nest.
var keys = []string{"a", "a/1", "a/2", "b", "b/1", "c", "d", "e", "z"}

// randRange returns a range in one of etcd's forms: one key, [key, end),
// a prefix, or from key on ("\x00").
func randRange(r *rand.Rand) (key, end []byte) {
	key = []byte(keys[r.IntN(len(keys))])
	switch r.IntN(4) {
	case 0:
		return key, nil
	case 1:
		return key, []byte(keys[r.IntN(len(keys))] + "x") // may be empty or inverted
	case 2:
		return key, []byte(clientv3.GetPrefixRangeEnd(string(key)))
	default:
		return key, []byte{0}
	}
}

func dial(t *testing.T, ep, user, password string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, Username: user, Password: password, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// TestCheckerMatchesEtcd is a differential test: random roles with random
// permissions in every range form, granted to random users, then random
// Range, Put and DeleteRange requests by each user, by root and by an
// anonymous caller, sent to a real etcd with auth enabled and asked of a
// Checker built from Fetch. Every answer must be etcd's, code and message.
func TestCheckerMatchesEtcd(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("SNAPCACHE_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("SNAPCACHE_SEED: %v", err)
		}
	}
	t.Logf("seed %d (rerun with SNAPCACHE_SEED=%d)", seed, seed)
	r := rand.New(rand.NewPCG(seed, seed>>1))
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	ep := "http://" + e.Clients[0].Addr().String()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	admin := dial(t, ep, "", "")
	must := func(_ any, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(admin.UserAdd(ctx, "root", "rootpw"))
	must(admin.RoleAdd(ctx, "root"))
	must(admin.UserGrantRole(ctx, "root", "root"))
	users := []string{"u0", "u1", "u2", "u3", "norole"}
	for _, u := range users {
		must(admin.UserAdd(ctx, u, u+"pw"))
	}
	types := []clientv3.PermissionType{clientv3.PermissionType(clientv3.PermRead), clientv3.PermissionType(clientv3.PermWrite), clientv3.PermissionType(clientv3.PermReadWrite)}
	for i := range 6 {
		role := fmt.Sprintf("r%d", i)
		must(admin.RoleAdd(ctx, role))
		for range 1 + r.IntN(3) {
			key, end := randRange(r)
			if len(end) != 0 && string(end) != "\x00" && string(end) <= string(key) {
				end = nil // etcd refuses to grant an empty range
			}
			must(admin.RoleGrantPermission(ctx, role, string(key), string(end), types[r.IntN(len(types))]))
		}
		for _, u := range users[:4] {
			if r.IntN(2) == 0 {
				must(admin.UserGrantRole(ctx, u, role))
			}
		}
	}
	must(admin.AuthEnable(ctx))

	root := dial(t, ep, "root", "rootpw")
	snap, err := authcache.Fetch(ctx, pb.NewAuthClient(root.ActiveConnection()))
	if err != nil {
		t.Fatal(err)
	}
	if !snap.Enabled || snap.Revision == 0 || len(snap.Users) != len(users)+1 {
		t.Fatalf("snapshot: enabled %v, revision %d, %d users", snap.Enabled, snap.Revision, len(snap.Users))
	}
	c, err := authcache.NewChecker(snap, nil)
	if err != nil {
		t.Fatal(err)
	}

	callers := map[string]*clientv3.Client{"root": root, "": dial(t, ep, "", "")}
	for _, u := range users {
		callers[u] = dial(t, ep, u, u+"pw")
	}
	same := func(what string, etcdErr, checkErr error) {
		t.Helper()
		if status.Code(etcdErr) != status.Code(checkErr) || status.Convert(etcdErr).Message() != status.Convert(checkErr).Message() {
			t.Fatalf("%s: etcd %v, checker %v", what, etcdErr, checkErr)
		}
	}
	compared := 0
	for user, cli := range callers {
		kv := pb.NewKVClient(cli.ActiveConnection())
		id := authcache.User(user)
		if user == "" {
			id = authcache.Identity{}
		}
		for range 60 {
			key, end := randRange(r)
			_, etcdErr := kv.Range(ctx, &pb.RangeRequest{Key: key, RangeEnd: end, Serializable: true})
			same(fmt.Sprintf("%q Range [%q, %q)", user, key, end), etcdErr, c.CheckRange(id, key, end))
			_, etcdErr = kv.DeleteRange(ctx, &pb.DeleteRangeRequest{Key: key, RangeEnd: end})
			same(fmt.Sprintf("%q DeleteRange [%q, %q)", user, key, end), etcdErr, c.CheckDeleteRange(id, key, end))
			_, etcdErr = kv.Put(ctx, &pb.PutRequest{Key: key, Value: []byte("v")})
			same(fmt.Sprintf("%q Put %q", user, key), etcdErr, c.CheckPut(id, key))
			compared += 3
		}
		_, etcdErr := pb.NewAuthClient(cli.ActiveConnection()).UserList(ctx, &pb.AuthUserListRequest{})
		same(fmt.Sprintf("%q UserList (admin)", user), etcdErr, c.CheckAdmin(id))
	}
	t.Logf("%d requests by %d callers compared", compared, len(callers))

	// An identity from before an auth change gets etcd's old-revision error.
	if err := c.CheckRange(authcache.Identity{Authenticated: true, User: "u0", Revision: snap.Revision - 1}, []byte("a"), nil); status.Convert(err).Message() != "etcdserver: revision of auth store is old" {
		t.Fatalf("an old auth revision: %v", err)
	}
}

// TestCheckerAuthDisabled: with auth disabled every request is allowed, an
// anonymous one included, as in etcd.
func TestCheckerAuthDisabled(t *testing.T) {
	c, err := authcache.NewChecker(authcache.Snapshot{Enabled: false, Revision: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []authcache.Identity{{}, authcache.User("nobody")} {
		if err := c.CheckRange(id, []byte("a"), []byte{0}); err != nil {
			t.Errorf("%v: %v", id, err)
		}
		if err := c.CheckAdmin(id); err != nil {
			t.Errorf("%v admin: %v", id, err)
		}
	}
}
