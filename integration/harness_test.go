package integration

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// waitTimeout bounds every wait for a condition in the package's tests.
const waitTimeout = 30 * time.Second

// clusterOptions tune newCluster.
type clusterOptions struct {
	// relay puts a TCP relay between the proxy and etcd, so that tests can
	// cut the proxy's upstream connection.
	relay bool
	// autoCompactionMode/Retention configure etcd's auto-compaction.
	autoCompactionMode, autoCompactionRetention string
	// loadRetainedHistory starts the proxy with history replay.
	loadRetainedHistory bool
	// quiet drops the proxy's logs (benchmarks).
	quiet bool
	// configure adjusts the proxy's configuration before it starts.
	configure func(*server.Config)
	// maxRequestBytes sets etcd's --max-request-bytes and the proxy's.
	maxRequestBytes int
	// progressNotifyInterval sets the proxy's periodic watch progress
	// interval (etcd's is set with v3rpc.SetProgressReportInterval).
	progressNotifyInterval time.Duration
	// peerURL is etcd's peer URL (default: port 0, the same for every
	// test's etcd, so that all of them have one cluster id).
	peerURL string
	// clientURL is etcd's client URL (default: port 0). etcd's JSON
	// gateway dials etcd at the configured URL, so a test of it needs
	// the port given.
	clientURL string
	// tiered puts a second proxy between etcd and the proxy under test: the
	// proxy's --endpoints is the inner proxy, as in a tiered deployment.
	tiered bool
}

// cluster is an embedded etcd with the proxy in front of it.
type cluster struct {
	etcd  *embed.Etcd
	proxy *server.Server
	relay *testsupport.Relay // nil unless clusterOptions.relay

	// direct talks to etcd, viaProxy to the proxy; both are real clientv3
	// clients, and the pb clients below share their connections so that
	// responses can be compared field by field.
	direct, viaProxy    *clientv3.Client
	directKV, proxyKV   pb.KVClient
	etcdAddr, proxyAddr string
	proxyCfg            server.Config
}

func newCluster(tb testing.TB, opts clusterOptions) *cluster {
	tb.Helper()
	lg := zaptest.NewLogger(tb)
	e := servertest.StartEtcd(tb, server.EmbeddedConfig{
		AutoCompactionMode:      opts.autoCompactionMode,
		AutoCompactionRetention: opts.autoCompactionRetention,
		MaxRequestBytes:         uint(opts.maxRequestBytes),
		PeerURL:                 opts.peerURL,
		ClientURL:               opts.clientURL,
	})
	c := &cluster{etcd: e, etcdAddr: e.Clients[0].Addr().String()}

	upstream := c.etcdAddr
	if opts.relay {
		c.relay = testsupport.NewRelay(tb, c.etcdAddr)
		upstream = c.relay.Addr()
	}
	if opts.tiered {
		inner := servertest.StartProxy(tb, servertest.Config("http://"+upstream, func(cfg *server.Config) {
			cfg.CompactionProbeInterval = 20 * time.Millisecond
			if opts.maxRequestBytes != 0 {
				cfg.MaxRequestBytes = opts.maxRequestBytes
			}
			cfg.Logger = lg.Named("inner")
		}))
		upstream = inner.Addr()
	}
	c.proxyCfg = servertest.Config("http://"+upstream, func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.CompactionProbeInterval = 20 * time.Millisecond
		cfg.LoadRetainedHistory = opts.loadRetainedHistory
		if opts.maxRequestBytes != 0 {
			cfg.MaxRequestBytes = opts.maxRequestBytes
		}
		if opts.progressNotifyInterval > 0 {
			cfg.WatchProgressNotifyInterval, cfg.FollowEtcdProgressInterval = opts.progressNotifyInterval, false
		}
		cfg.Logger = lg
	})
	if opts.quiet {
		c.proxyCfg.Logger = nil
	}
	if opts.configure != nil {
		opts.configure(&c.proxyCfg)
	}
	c.startProxy(tb)
	c.direct = newClient(tb, c.etcdAddr)
	c.directKV = pb.NewKVClient(c.direct.ActiveConnection())
	return c
}

// startProxy starts (or restarts) the proxy and waits until it is ready.
func (c *cluster) startProxy(tb testing.TB) {
	tb.Helper()
	p := servertest.StartProxy(tb, c.proxyCfg)
	c.proxy = p
	c.proxyAddr = p.Addr()
	c.viaProxy = newClient(tb, c.proxyAddr)
	c.proxyKV = pb.NewKVClient(c.viaProxy.ActiveConnection())
}

// restartProxy stops the proxy once it has caught up with etcd, runs
// whileDown (writes the proxy misses), and starts it again, waiting until
// it has caught up; it returns the new proxy's history start: the first
// revision whose events it holds.
func (c *cluster) restartProxy(tb testing.TB, whileDown func()) int64 {
	tb.Helper()
	c.waitSynced(tb)
	c.proxy.Stop()
	whileDown()
	c.startProxy(tb)
	c.waitSynced(tb)
	return c.proxy.Store().HistoryStart()
}

func newClient(tb testing.TB, addr string) *clientv3.Client {
	tb.Helper()
	return newUserClient(tb, addr, "", "")
}

// newUserClient is newClient authenticated as user with password (none if
// user is empty).
func newUserClient(tb testing.TB, addr, user, password string) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{addr},
		Username:    user,
		Password:    password,
		DialTimeout: 5 * time.Second,
		// Large historical ranges are bigger than grpc-go's 4 MiB default,
		// and the raw pb clients on this connection do not get clientv3's
		// MaxCallRecvMsgSize: the limit goes on the connection.
		DialOptions: []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1 << 30))},
		// The client logs every failed attempt; the tests judge errors.
		Logger: zap.NewNop(),
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}

// etcdRev returns etcd's current revision.
func (c *cluster) etcdRev(tb testing.TB) int64 {
	tb.Helper()
	resp, err := c.directKV.Range(context.Background(), &pb.RangeRequest{Key: []byte{0}, CountOnly: true})
	if err != nil {
		tb.Fatal(err)
	}
	return resp.Header.Revision
}

// etcdCompactRev returns etcd's compaction revision (0 if never compacted).
func (c *cluster) etcdCompactRev(tb testing.TB) int64 {
	tb.Helper()
	resp, err := c.direct.HashKV(context.Background(), c.direct.Endpoints()[0], 0)
	if err != nil {
		tb.Fatal(err)
	}
	// etcd reports -1 before its first compaction.
	return max(resp.CompactRevision, 0)
}

// waitSynced waits until the proxy's cache has applied etcd's current
// revision and mirrors etcd's compaction revision.
func (c *cluster) waitSynced(tb testing.TB) {
	tb.Helper()
	rev, compact := c.etcdRev(tb), c.etcdCompactRev(tb)
	testsupport.WaitFor(tb, waitTimeout, "the cache to reach etcd's revision and compaction", func() bool {
		st := c.proxy.Store()
		return st.Rev() >= rev && st.CompactRev() >= compact
	})
}
