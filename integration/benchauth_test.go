package integration

// The throughput benchmarks of bench_test.go with auth enabled on both
// sides: etcd has users root and benchUser, whose role may only read the
// benchmark prefix; the proxy runs as root; the load clients of both sides
// authenticate as benchUser (against the proxy, with a token issued through
// it, which the proxy can attribute and check on its mirror of etcd's users
// and roles, so that the reads are still served from its cache:
// compareBackendsN fails the run otherwise). Compare each with its auth-off
// twin:
//
//	go test -run '^$' -bench '(HistoricalRange|PaginatedList|LinearizableGet)(Auth)?$' -benchmem -benchtime 2s ./integration/
//
// The historical Range and the LIST pages are linearizable reads at a
// revision (as kube-apiserver sends them), so, like the linearizable Get,
// each pays the shared AuthStatus that proves the auth revision it is
// checked at ("etcd-auth-req/1k-ops").

import (
	"context"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// The load's user and its password.
const (
	benchUser     = "bench-reader"
	benchPassword = "bench-readerpw"
)

func BenchmarkHistoricalRangeAuth(b *testing.B) {
	benchHistoricalRange(b, benchOptions{auth: true})
}

func BenchmarkPaginatedListAuth(b *testing.B) {
	benchPaginatedList(b, benchOptions{auth: true})
}

func BenchmarkLinearizableGetAuth(b *testing.B) {
	benchLinearizableGet(b, benchOptions{auth: true})
}

// benchAuthSetUp returns the clusterOptions.configure of an auth benchmark
// cluster: it runs once etcd has started and before the proxy does, sets up
// etcd's auth (setUpAuth, then benchUser with read access to benchPrefix),
// and gives the proxy root's credentials.
func benchAuthSetUp(b *testing.B) func(*server.Config) {
	return func(cfg *server.Config) {
		ep := cfg.Endpoints[0]
		setUpAuth(b, callerClient(b, ep, "", "", nil))
		root := callerClient(b, ep, "root", "rootpw", nil)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		steps := []func() error{
			func() error { _, err := root.UserAdd(ctx, benchUser, benchPassword); return err },
			func() error { _, err := root.RoleAdd(ctx, benchUser); return err },
			func() error {
				_, err := root.RoleGrantPermission(ctx, benchUser, benchPrefix, clientv3.GetPrefixRangeEnd(benchPrefix), clientv3.PermissionType(clientv3.PermRead))
				return err
			},
			func() error { _, err := root.UserGrantRole(ctx, benchUser, benchUser); return err },
		}
		for _, step := range steps {
			if err := step(); err != nil {
				b.Fatal(err)
			}
		}
		cfg.User, cfg.Password = "root", "rootpw"
	}
}

// authenticate switches env's clients to auth: the cluster's direct
// client (which loads the data and reads etcd's revision) to root, and the
// load clients of both sides to benchUser.
func (env *benchEnv) authenticate(b *testing.B) {
	b.Helper()
	c := env.c
	c.direct = newUserClient(b, c.etcdAddr, "root", "rootpw")
	c.directKV = pb.NewKVClient(c.direct.ActiveConnection())
	env.etcdKV = pb.NewKVClient(newUserClient(b, c.etcdAddr, benchUser, benchPassword).ActiveConnection())
	env.proxyKV = pb.NewKVClient(newUserClient(b, c.proxyAddr, benchUser, benchPassword).ActiveConnection())
}
