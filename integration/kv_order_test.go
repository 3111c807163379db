package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestForwardedReadsNeverGoBack: the proxy's upstream connection spreads
// reads over several endpoints, and one of them lags: here a second proxy
// whose own upstream was cut, which still answers serializable reads from
// its frozen cache, as a partitioned etcd member answers them. Once the
// proxy has answered at etcd's head, no later answer of its is below it:
// a forwarded serializable read (at a revision older than the proxy's
// history) that the lagging endpoint answers from the past is asked again
// as a linearizable read, as one etcd member never goes back in time.
func TestForwardedReadsNeverGoBack(t *testing.T) {
	lg := zaptest.NewLogger(t)
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	etcdAddr := e.Clients[0].Addr().String()
	etcdKV := pb.NewKVClient(rawConn(t, etcdAddr))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	put := func(n int) int64 {
		t.Helper()
		var rev int64
		for i := range n {
			resp, err := etcdKV.Put(ctx, &pb.PutRequest{Key: []byte("k"), Value: fmt.Appendf(nil, "v%d", i)})
			if err != nil {
				t.Fatal(err)
			}
			rev = resp.Header.Revision
		}
		return rev
	}

	// The lagging endpoint: a proxy that holds every revision from 1, and
	// refuses linearizable reads at once once its upstream is cut.
	relay := testsupport.NewRelay(t, etcdAddr)
	lagging := servertest.StartProxy(t, servertest.Config(relay.Addr(), func(cfg *server.Config) {
		cfg.FreshnessTimeout = 100 * time.Millisecond
		cfg.ConsistentReadFallback = kvproxy.FallbackFail
		cfg.Logger = lg.Named("lagging")
	}))
	put(9)
	p := servertest.StartProxy(t, servertest.Config("http://"+etcdAddr, func(cfg *server.Config) {
		cfg.Endpoints = append(cfg.Endpoints, "http://"+lagging.Addr())
		cfg.RevisionWait = 50 * time.Millisecond
		cfg.CompactionProbeInterval = 20 * time.Millisecond
		cfg.Logger = lg.Named("proxy")
	}))
	oldest := p.Store().OldestRev()
	frozen := put(5)
	testsupport.WaitFor(t, waitTimeout, "both proxies to apply the writes", func() bool {
		return lagging.Store().Rev() >= frozen && p.Store().Rev() >= frozen
	})
	relay.Cut()
	testsupport.WaitFor(t, waitTimeout, "the lagging proxy to lose its upstream", func() bool { return !lagging.Follower().Following() })
	head := put(10)

	// A client retries the Unavailable a refusing endpoint may answer.
	cli := newClient(t, p.Addr())
	first, err := cli.Get(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if first.Header.Revision < head {
		t.Fatalf("linearizable read at %d, below etcd's head %d", first.Header.Revision, head)
	}
	served := first.Header.Revision
	// Older than the proxy's snapshots: forwarded, to either endpoint.
	old := oldest - 1
	for i := range 20 {
		for _, rev := range []int64{0, old} {
			resp, err := cli.Get(ctx, "k", clientv3.WithSerializable(), clientv3.WithRev(rev))
			if err != nil {
				t.Fatalf("read %d at revision %d: %v", i, rev, err)
			}
			if resp.Header.Revision < served {
				t.Fatalf("read %d at revision %d answered at %d, after an answer at %d (the lagging endpoint is at %d)",
					i, rev, resp.Header.Revision, served, frozen)
			}
			served = resp.Header.Revision
		}
	}
	if n := proxyMetricValue(t, p, "etcd_snapcache_range_went_back_total"); n == 0 {
		t.Fatal("no forwarded read reached the lagging endpoint")
	}
}
