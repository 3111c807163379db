package e2e

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

var (
	quietKeys       = flag.Int("snapcache.e2e.quiet-keys", 100_000, "BenchmarkQuietCluster: keys loaded before the phases")
	quietValue      = flag.Int("snapcache.e2e.quiet-value", 1024, "BenchmarkQuietCluster: value size of the loaded keys")
	quietStreams    = flag.String("snapcache.e2e.quiet-streams", "200,2000", "BenchmarkQuietCluster: watch streams of the idle phases, comma-separated; the first is also the streams+writes phase's")
	quietPrefixes   = flag.Int("snapcache.e2e.quiet-prefixes", 1, "BenchmarkQuietCluster: distinct prefixes the streams watch (1: every stream the whole keyspace; up to 100: a namespace each)")
	quietPrevKV     = flag.Bool("snapcache.e2e.quiet-prevkv", true, "BenchmarkQuietCluster: the streams' watches ask for prev_kv, as kube-apiserver's do")
	quietWriteRate  = flag.Int("snapcache.e2e.quiet-write-rate", 20, "BenchmarkQuietCluster: single-key puts per second of the write phases")
	quietWriteValue = flag.Int("snapcache.e2e.quiet-write-value", 256, "BenchmarkQuietCluster: value size of those puts")
	quietWindow     = flag.Duration("snapcache.e2e.quiet-window", 20*time.Second, "BenchmarkQuietCluster: length of each measured window")
	quietRounds     = flag.Int("snapcache.e2e.quiet-rounds", 1, "BenchmarkQuietCluster: measured windows per phase and side, alternating sides")
)

// BenchmarkQuietCluster measures what the proxy costs where most clusters
// spend most of their time: quiet. etcd (a process) holds
// -snapcache.e2e.quiet-keys keys of -snapcache.e2e.quiet-value bytes; one
// proxy process with default flags follows it throughout; the load is this
// process. Phases, each a -snapcache.e2e.quiet-window window of CPU read
// from /proc (utime+stime) per process:
//
//	idle           no client at all;
//	writes         -snapcache.e2e.quiet-write-rate single-key puts/s of
//	               -snapcache.e2e.quiet-write-value bytes to etcd, no
//	               other client: what following etcd costs the proxy;
//	streams=N      N watch streams, one a connection, each with one
//	               watch of a prefix (prev_kv unless
//	               -snapcache.e2e.quiet-prevkv=false, progress_notify,
//	               from the head, as kube-apiserver's cacher watches),
//	               nothing written: direct on etcd, then through the proxy;
//	streams=N+writes  the first N with the puts, sent through the side
//	               measured (as kube-apiserver writes).
//
// The streams watch -snapcache.e2e.quiet-prefixes prefixes (1, the
// default: every stream the whole keyspace, so that every put is an event
// on every stream; 100: one namespace each, kube's shape, where a write
// concerns a few streams). Sides alternate etcd,proxy, proxy,etcd, ... for
// -snapcache.e2e.quiet-rounds windows each.
//
// Per phase and side (SUMMARY lines): etcd's and the proxy's CPU in ms per
// second (on the etcd side the proxy only follows etcd), their resident
// memory, etcd's watchers and watch streams, etcd's requests per second
// (grpc_server_handled_total), the events the load received per second;
// derived, the proxy's CPU per write (writes minus idle, over the puts)
// and per stream (streams minus idle, over the streams), and etcd+proxy
// through the proxy over etcd direct.
func BenchmarkQuietCluster(b *testing.B) {
	var points []int
	for _, f := range strings.Split(*quietStreams, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			b.Fatalf("-snapcache.e2e.quiet-streams: %q is not a count", f)
		}
		points = append(points, n)
	}
	if *quietPrefixes < 1 || *quietPrefixes > 100 {
		b.Fatalf("-snapcache.e2e.quiet-prefixes: %d is not within 1-100", *quietPrefixes)
	}
	e := startEtcd(b)
	cli := dial(b, e.endpoint, nil, "", "")
	ks := keyspace{n: *quietKeys}
	start := time.Now()
	loaded := newWriter(cli, *quietValue, 64).put(b, ks.n, ks.key)
	progress("quiet: %d keys of %d B written in %v", ks.n, *quietValue, time.Since(start).Round(time.Second))
	var proxyFlags []string
	if *cmpPprof {
		proxyFlags = append(proxyFlags, "--enable-pprof")
	}
	p := startProxyProcess(b, e.endpoint, proxyFlags...)
	p.waitCopied(b, loaded)
	q := &quietEnv{b: b, etcd: e, proxy: p, keys: ks}

	idle := q.measure("idle", "none", 0, false)
	writes := q.measure("writes", "none", 0, true)
	perWrite := (writes.proxyCPU - idle.proxyCPU) / float64(*quietWriteRate) * 1000 // µs per put
	fmt.Printf("SUMMARY BenchmarkQuietCluster/following: proxy CPU %.2f ms/s idle, %.2f ms/s with %d puts/s: %.0f µs per write; etcd %.2f and %.2f ms/s; proxy RSS %.0f MiB, etcd RSS %.0f MiB\n",
		idle.proxyCPU, writes.proxyCPU, *quietWriteRate, perWrite, idle.etcdCPU, writes.etcdCPU, idle.proxyRSS, idle.etcdRSS)
	b.ReportMetric(idle.proxyCPU, "idle-proxy-ms/s")
	b.ReportMetric(idle.etcdCPU, "idle-etcd-ms/s")
	b.ReportMetric(perWrite, "proxy-µs/write")

	for i, n := range points {
		phases := []bool{false}
		if i == 0 {
			phases = append(phases, true)
		}
		for _, withWrites := range phases {
			name := fmt.Sprintf("streams=%d", n)
			if withWrites {
				name += "+writes"
			}
			var direct, proxied []quietWindowResult
			for r := range *quietRounds {
				order := []string{"etcd", "proxy"}
				if r%2 == 1 {
					order = []string{"proxy", "etcd"}
				}
				for _, sideName := range order {
					res := q.measure(name, sideName, n, withWrites)
					if sideName == "etcd" {
						direct = append(direct, res)
					} else {
						proxied = append(proxied, res)
					}
				}
			}
			d, pr := meanWindow(direct), meanWindow(proxied)
			perStream := (pr.proxyCPU - idle.proxyCPU) / float64(n) * 1000 // µs/s per stream
			if withWrites {
				perStream = 0
			}
			fmt.Printf("SUMMARY BenchmarkQuietCluster/%s: direct: etcd %.1f ms/s; through the proxy: etcd %.1f + proxy %.1f = %.1f ms/s (%.2fx direct)%s; "+
				"etcd watchers %.0f/%.0f, watch streams %.0f/%.0f, requests %.1f/%.1f per s, events received %.0f/%.0f per s; RSS etcd %.0f/%.0f MiB, proxy %.0f MiB (direct/proxy)\n",
				name, d.etcdCPU, pr.etcdCPU, pr.proxyCPU, pr.etcdCPU+pr.proxyCPU, (pr.etcdCPU+pr.proxyCPU)/d.etcdCPU,
				func() string {
					if withWrites {
						return ""
					}
					return fmt.Sprintf(", proxy %.1f µs/s per stream", perStream)
				}(),
				d.watchers, pr.watchers, d.streams, pr.streams, d.requests, pr.requests, d.events, pr.events,
				d.etcdRSS, pr.etcdRSS, pr.proxyRSS)
			unit := func(s string) string { return strings.NewReplacer("=", "", "+", "-").Replace(name) + "-" + s }
			b.ReportMetric(d.etcdCPU, unit("direct-etcd-ms/s"))
			b.ReportMetric(pr.etcdCPU, unit("etcd-ms/s"))
			b.ReportMetric(pr.proxyCPU, unit("proxy-ms/s"))
		}
	}
	b.ReportMetric(0, "ns/op")
}

// quietEnv is BenchmarkQuietCluster's etcd, proxy and keys.
type quietEnv struct {
	b     *testing.B
	etcd  *etcdProcess
	proxy *proxyProcess
	keys  keyspace
}

// quietWindowResult is one measured window: CPU in ms per second, memory
// in MiB, the rest per second or as gauges.
type quietWindowResult struct {
	etcdCPU, proxyCPU         float64
	etcdRSS, proxyRSS         float64
	watchers, streams         float64
	requests, events, written float64
}

func meanWindow(rs []quietWindowResult) quietWindowResult {
	var m quietWindowResult
	for _, r := range rs {
		m.etcdCPU += r.etcdCPU / float64(len(rs))
		m.proxyCPU += r.proxyCPU / float64(len(rs))
		m.etcdRSS += r.etcdRSS / float64(len(rs))
		m.proxyRSS += r.proxyRSS / float64(len(rs))
		m.watchers += r.watchers / float64(len(rs))
		m.streams += r.streams / float64(len(rs))
		m.requests += r.requests / float64(len(rs))
		m.events += r.events / float64(len(rs))
		m.written += r.written / float64(len(rs))
	}
	return m
}

// measure opens streams watch streams on side ("etcd", "proxy", or "none"
// for no client), lets them settle, and measures one window, with the
// puts if withWrites (sent through side; to etcd for "none").
func (q *quietEnv) measure(phase, side string, streams int, withWrites bool) quietWindowResult {
	b := q.b
	b.Helper()
	endpoint := q.etcd.endpoint
	if side == "proxy" {
		endpoint = q.proxy.endpoint
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ws := openQuietStreams(b, ctx, endpoint, streams)
	defer ws.close()

	var writeConn *grpc.ClientConn
	if withWrites {
		writeConn = dialRaw(b, endpoint)
		defer writeConn.Close()
	}
	// Let the streams' creation and the connections' setup pass before the
	// window: a quiet cluster is measured, not its clients' arrival.
	settle(2 * time.Second)

	etcdPID, proxyPID := q.etcd.pid(), q.proxy.pid()
	em0 := q.etcd.metrics(b)
	e0, p0, ev0 := processCPU(b, etcdPID), processCPU(b, proxyPID), ws.events.Load()
	began := time.Now()
	var profiled chan string
	if *cmpPprof && side != "etcd" {
		profiled = make(chan string, 1)
		go func() { profiled <- q.profileProxy(phase, side) }()
	}
	var written int64
	if withWrites {
		written = q.writeFor(ctx, pb.NewKVClient(writeConn), *quietWindow)
	} else {
		settle(*quietWindow)
	}
	elapsed := time.Since(began).Seconds()
	e1, p1, ev1 := processCPU(b, etcdPID), processCPU(b, proxyPID), ws.events.Load()
	em1 := q.etcd.metrics(b)
	if profiled != nil {
		progress("quiet %s on %s: the proxy's CPU profile: %s", phase, side, <-profiled)
	}
	if err := ws.err(); err != nil {
		b.Fatalf("%s on %s: a watch stream failed: %v", phase, side, err)
	}
	res := quietWindowResult{
		etcdCPU:  float64(e1-e0) / float64(time.Millisecond) / elapsed,
		proxyCPU: float64(p1-p0) / float64(time.Millisecond) / elapsed,
		etcdRSS:  float64(q.etcd.rssBytes()) / mib,
		proxyRSS: float64(procStatus(b, q.proxy.cmd.Process.Pid)["VmRSS"]) / mib,
		watchers: em1.sum("etcd_debugging_mvcc_watcher_total"),
		streams:  em1.sum("etcd_debugging_mvcc_watch_stream_total"),
		requests: (em1.sum("grpc_server_handled_total") - em0.sum("grpc_server_handled_total")) / elapsed,
		events:   float64(ev1-ev0) / elapsed,
		written:  float64(written) / elapsed,
	}
	progress("quiet %s on %s: etcd %.1f ms/s, proxy %.1f ms/s, %.0f events/s, %.1f puts/s", phase, side, res.etcdCPU, res.proxyCPU, res.events, res.written)
	return res
}

// profileProxy saves a CPU profile of the proxy over one window, and
// returns its path (or why there is none).
func (q *quietEnv) profileProxy(phase, side string) string {
	secs := int(quietWindow.Seconds())
	client := &http.Client{Timeout: time.Duration(secs+30) * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get(fmt.Sprintf("%s/debug/pprof/profile?seconds=%d", q.proxy.endpoint, secs))
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	f, err := os.CreateTemp("", "quiet-pprof-"+strings.NewReplacer("=", "", "+", "-").Replace(phase)+"-"+side+"-*.pb.gz")
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	if _, err := io.Copy(f, resp.Body); err != nil {
		return err.Error()
	}
	return f.Name()
}

// writeFor puts one key a tick at -snapcache.e2e.quiet-write-rate for d,
// each to a key of the loaded keyspace in turn, and returns the puts made.
func (q *quietEnv) writeFor(ctx context.Context, kv pb.KVClient, d time.Duration) int64 {
	b := q.b
	value := make([]byte, *quietWriteValue)
	for i := range value {
		value[i] = 'w'
	}
	tick := time.NewTicker(time.Second / time.Duration(*quietWriteRate))
	defer tick.Stop()
	end := time.NewTimer(d)
	defer end.Stop()
	var n int64
	for {
		select {
		case <-end.C:
			return n
		case <-tick.C:
		}
		// Spread over the prefixes, so that with many each put concerns
		// the streams of one.
		key := q.keys.key(int(n*7919) % q.keys.n)
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := kv.Put(pctx, &pb.PutRequest{Key: key, Value: value})
		cancel()
		if err != nil {
			b.Fatalf("put: %v", err)
		}
		n++
	}
}

// settle waits d: the length of a measured window, or of the pause before
// one; nothing waits on it for a condition.
func settle(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	<-t.C
}

// dialRaw is a plain gRPC connection to endpoint, without clientv3's
// machinery: a quiet cluster's clients are measured, not the load's.
func dialRaw(tb testing.TB, endpoint string) *grpc.ClientConn {
	tb.Helper()
	conn, err := grpc.NewClient(strings.TrimPrefix(endpoint, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	return conn
}

// quietWatches is a phase's watch streams and their receivers.
type quietWatches struct {
	conns  []*grpc.ClientConn
	wg     sync.WaitGroup
	events atomic.Int64
	mu     sync.Mutex
	first  error // guarded by mu: the first stream error not caused by close
	closed atomic.Bool
}

// openQuietStreams opens n watch streams on endpoint, one a connection,
// each with one watch of its prefix, and waits until every watch is
// created.
func openQuietStreams(tb testing.TB, ctx context.Context, endpoint string, n int) *quietWatches {
	tb.Helper()
	ws := &quietWatches{}
	created := make(chan error, n)
	for i := range n {
		conn := dialRaw(tb, endpoint)
		ws.conns = append(ws.conns, conn)
		prefix := []byte("/registry/pods/")
		if *quietPrefixes > 1 {
			prefix = fmt.Appendf(nil, "/registry/pods/ns-%03d/", i%*quietPrefixes)
		}
		ws.wg.Add(1)
		go ws.receive(ctx, pb.NewWatchClient(conn), prefix, created)
	}
	deadline := time.NewTimer(2 * time.Minute)
	defer deadline.Stop()
	for range n {
		select {
		case err := <-created:
			if err != nil {
				ws.close()
				tb.Fatalf("opening a watch stream: %v", err)
			}
		case <-deadline.C:
			ws.close()
			tb.Fatalf("%d watch streams were not all created within 2 minutes", n)
		}
	}
	return ws
}

// receive runs one stream: creates its watch, then counts the events it
// receives until the stream ends.
func (ws *quietWatches) receive(ctx context.Context, wc pb.WatchClient, prefix []byte, created chan<- error) {
	defer ws.wg.Done()
	stream, err := wc.Watch(clientv3.WithRequireLeader(ctx))
	if err == nil {
		err = stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{
			Key: prefix, RangeEnd: []byte(clientv3.GetPrefixRangeEnd(string(prefix))), PrevKv: *quietPrevKV, ProgressNotify: true,
		}}})
	}
	var resp *pb.WatchResponse
	if err == nil {
		resp, err = stream.Recv()
		if err == nil && (!resp.Created || resp.Canceled) {
			err = fmt.Errorf("watch not created: %v", resp)
		}
	}
	created <- err
	if err != nil {
		return
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			if !ws.closed.Load() && !errors.Is(err, io.EOF) {
				ws.mu.Lock()
				if ws.first == nil {
					ws.first = err
				}
				ws.mu.Unlock()
			}
			return
		}
		ws.events.Add(int64(len(resp.Events)))
	}
}

func (ws *quietWatches) err() error {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return ws.first
}

// close ends every stream and waits for its receiver.
func (ws *quietWatches) close() {
	ws.closed.Store(true)
	for _, c := range ws.conns {
		c.Close()
	}
	ws.wg.Wait()
}
