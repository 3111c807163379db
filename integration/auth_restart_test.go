package integration

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestAuthTokensAfterEtcdRestart: an etcd restart ends every simple token,
// the proxy's own and its callers'. The proxy authenticates again, a
// password client authenticates again through it, and that client's reads
// are then served from the cache again, as before the restart (the new
// token is attributed; reads are not forwarded for good). Under the race
// detector etcd's bcrypt makes each Authenticate take seconds, hence the
// long wait.
func TestAuthTokensAfterEtcdRestart(t *testing.T) {
	env := &timelineEnv{t: t, clientURL: "http://" + testsupport.FreeAddr(t), peerURL: "http://" + testsupport.FreeAddr(t)}
	dir := t.TempDir()
	env.start(dir)
	setUpAuth(t, callerClient(t, env.clientURL, "", "", nil))
	p := servertest.StartProxy(t, servertest.Config(env.clientURL, func(cfg *server.Config) {
		cfg.User = "root"
		cfg.Password = "rootpw"
		cfg.Logger = zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))
	}))
	alice := callerClient(t, "http://"+p.Addr(), "alice", "alicepw", nil)
	read := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := alice.Get(ctx, "/alice/x")
		return err
	}
	cachedAfter := func(what string) {
		t.Helper()
		testsupport.WaitFor(t, 30*time.Second, what, func() bool {
			before := rangeCounts(t, p)["cache/linearizable"]
			if err := read(); err != nil {
				t.Logf("read: %v", err)
				return false
			}
			return rangeCounts(t, p)["cache/linearizable"] > before
		})
	}
	cachedAfter("alice's reads served from the cache")

	env.stopEtcd()
	env.start(dir)
	cachedAfter("alice's reads served from the cache after etcd restarted")
}
