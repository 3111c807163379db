package integration

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/etcd-snapcache/etcd-snapcache/server"
)

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
}

// cluster is an embedded etcd with the proxy in front of it.
type cluster struct {
	etcd  *embed.Etcd
	proxy *server.Server
	relay *relay // nil unless clusterOptions.relay

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
	e, err := server.StartEmbedded(server.EmbeddedConfig{
		Dir:                     tb.TempDir(),
		AutoCompactionMode:      opts.autoCompactionMode,
		AutoCompactionRetention: opts.autoCompactionRetention,
		MaxRequestBytes:         uint(opts.maxRequestBytes),
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(e.Close)
	c := &cluster{etcd: e, etcdAddr: e.Clients[0].Addr().String()}

	upstream := c.etcdAddr
	if opts.relay {
		c.relay = newRelay(tb, c.etcdAddr)
		upstream = c.relay.addr()
	}
	c.proxyCfg = server.Config{
		Endpoints:                   []string{"http://" + upstream},
		ListenAddr:                  "127.0.0.1:0",
		MetricsAddr:                 "127.0.0.1:0",
		CompactionProbeInterval:     20 * time.Millisecond,
		LoadRetainedHistory:         opts.loadRetainedHistory,
		MaxRequestBytes:             opts.maxRequestBytes,
		WatchProgressNotifyInterval: opts.progressNotifyInterval,
		Logger:                      lg,
	}
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
	p, err := server.Start(c.proxyCfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Stop)
	c.proxy = p
	c.proxyAddr = p.Addr()
	select {
	case <-p.Ready():
	case err := <-p.Err():
		tb.Fatal(err)
	case <-time.After(30 * time.Second):
		tb.Fatal("proxy not ready after 30s")
	}
	c.viaProxy = newClient(tb, c.proxyAddr)
	c.proxyKV = pb.NewKVClient(c.viaProxy.ActiveConnection())
}

func newClient(tb testing.TB, addr string) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{addr},
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

// waitFor checks cond every millisecond until it holds, failing after 30 s:
// the proxy's state is observed, not assumed after a pause.
func waitFor(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	deadline := time.NewTimer(30 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-deadline.C:
			tb.Fatalf("timed out waiting for %s", what)
		}
	}
}

// waitSynced waits until the proxy's cache has applied etcd's current
// revision and mirrors etcd's compaction revision.
func (c *cluster) waitSynced(tb testing.TB) {
	tb.Helper()
	rev, compact := c.etcdRev(tb), c.etcdCompactRev(tb)
	waitFor(tb, "the cache to reach etcd's revision and compaction", func() bool {
		st := c.proxy.Store()
		return st.Rev() >= rev && st.CompactRev() >= compact
	})
}

// relay is a TCP relay on loopback whose connections can be cut, to break
// the proxy's upstream connection the way a network failure does.
type relay struct {
	tb     testing.TB
	lis    net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

func newRelay(tb testing.TB, target string) *relay {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	r := &relay{tb: tb, lis: lis, target: target, conns: map[net.Conn]struct{}{}}
	r.wg.Add(1)
	go r.accept()
	tb.Cleanup(func() {
		lis.Close()
		r.Cut()
		r.wg.Wait()
	})
	return r
}

func (r *relay) addr() string { return r.lis.Addr().String() }

func (r *relay) accept() {
	defer r.wg.Done()
	for {
		down, err := r.lis.Accept()
		if err != nil {
			return
		}
		r.mu.Lock()
		if r.cut {
			r.mu.Unlock()
			down.Close()
			continue
		}
		up, err := net.Dial("tcp", r.target)
		if err != nil {
			r.mu.Unlock()
			down.Close()
			continue
		}
		r.conns[down], r.conns[up] = struct{}{}, struct{}{}
		r.mu.Unlock()
		r.wg.Add(2)
		go r.pipe(down, up)
		go r.pipe(up, down)
	}
}

func (r *relay) pipe(dst, src net.Conn) {
	defer r.wg.Done()
	_, err := io.Copy(dst, src)
	if err != nil && !errors.Is(err, net.ErrClosed) {
		r.tb.Logf("relay: %v", err)
	}
	dst.Close()
	src.Close()
}

// Cut closes every relayed connection and refuses new ones until Restore.
func (r *relay) Cut() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut = true
	for c := range r.conns {
		c.Close()
		delete(r.conns, c)
	}
}

// Restore accepts connections again.
func (r *relay) Restore() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut = false
}
