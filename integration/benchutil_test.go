package integration

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/prometheus/client_golang/prometheus"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// Shape of the benchmark data set: a kube-apiserver-like resource prefix.
const (
	benchPrefix    = "/registry/pods/bench/"
	benchKeys      = 10000
	benchValueSize = 1024
	benchUpdates   = 2000 // separate revisions after the benchmarked revision R
	benchTxnOps    = 100  // puts per load Txn; etcd's --max-txn-ops is 128
	benchPageSize  = 500  // kube-apiserver's default LIST page size
)

var benchClients = flag.Int("snapcache.bench.clients", 8,
	"concurrent client goroutines of the throughput benchmarks (all share one gRPC connection per backend)")

// benchEnv is a cluster loaded with the benchmark data set.
type benchEnv struct {
	c          *cluster
	etcdKV     pb.KVClient // the load's: c.directKV, or the reader's with auth
	proxyKV    pb.KVClient // the load's: c.proxyKV, or the reader's with auth
	prefix     []byte
	rangeEnd   []byte // prefix + 1: [prefix, rangeEnd) is the whole set
	rev        int64  // R: the revision after the load, before the updates
	keys       [][]byte
	rangeBytes int64 // encoded size of the full Range response at R
	auth       bool  // benchOptions.auth
}

// benchOptions vary the benchmark cluster.
type benchOptions struct {
	// auth enables auth in etcd before the proxy starts, which then runs
	// as root; the load clients of both sides authenticate as a user whose
	// role may only read the benchmark prefix (benchauth_test.go).
	auth bool
}

// newBenchEnv starts a cluster, loads benchKeys keys of benchValueSize bytes
// in Txns of benchTxnOps puts, remembers the revision R, then makes
// benchUpdates single-put revisions over random existing keys, and waits
// until the proxy has applied them. Everything is written directly to etcd.
func newBenchEnv(b *testing.B, opts benchOptions) *benchEnv {
	b.Helper()
	start := time.Now()
	copts := clusterOptions{quiet: true}
	if opts.auth {
		copts.configure = benchAuthSetUp(b)
	}
	c := newCluster(b, copts)
	env := &benchEnv{
		c:        c,
		etcdKV:   c.directKV,
		proxyKV:  c.proxyKV,
		prefix:   []byte(benchPrefix),
		rangeEnd: []byte(clientv3.GetPrefixRangeEnd(benchPrefix)),
		keys:     make([][]byte, benchKeys),
		auth:     opts.auth,
	}
	for i := range env.keys {
		env.keys[i] = fmt.Appendf(nil, "%spod-%05d", benchPrefix, i)
	}
	if opts.auth {
		env.authenticate(b)
	}
	ctx := context.Background()

	// Load: Txns of benchTxnOps puts, a few in flight at once.
	var batches []int
	for i := 0; i < benchKeys; i += benchTxnOps {
		batches = append(batches, i)
	}
	benchParallel(b, 4, len(batches), func(w, j int, rng *rand.ChaCha8) error {
		lo := batches[j]
		hi := min(lo+benchTxnOps, benchKeys)
		ops := make([]*pb.RequestOp, 0, hi-lo)
		for _, k := range env.keys[lo:hi] {
			ops = append(ops, &pb.RequestOp{Request: &pb.RequestOp_RequestPut{
				RequestPut: &pb.PutRequest{Key: k, Value: benchRandomValue(rng)},
			}})
		}
		_, err := c.directKV.Txn(ctx, &pb.TxnRequest{Success: ops})
		return err
	})
	env.rev = c.etcdRev(b)

	// Updates: benchUpdates separate Puts, hence benchUpdates revisions.
	benchParallel(b, 16, benchUpdates, func(w, j int, rng *rand.ChaCha8) error {
		k := env.keys[rng.Uint64()%benchKeys]
		_, err := c.directKV.Put(ctx, &pb.PutRequest{Key: k, Value: benchRandomValue(rng)})
		return err
	})
	if got, want := c.etcdRev(b), env.rev+benchUpdates; got != want {
		b.Fatalf("etcd is at revision %d after the updates, want %d", got, want)
	}
	c.waitSynced(b)
	if _, err := c.proxy.Store().View(env.rev); err != nil {
		b.Fatalf("the proxy cannot serve revision %d from memory: %v", env.rev, err)
	}

	// Both backends must give the same answer at R.
	req := env.fullRange()
	fromEtcd, err := env.etcdKV.Range(ctx, req)
	if err != nil {
		b.Fatal(err)
	}
	fromProxy, err := env.proxyKV.Range(ctx, req)
	if err != nil {
		b.Fatal(err)
	}
	if len(fromEtcd.Kvs) != benchKeys || fromEtcd.Count != benchKeys {
		b.Fatalf("etcd returned %d keys (count %d) at R, want %d", len(fromEtcd.Kvs), fromEtcd.Count, benchKeys)
	}
	if fromProxy.Count != fromEtcd.Count || fromProxy.More != fromEtcd.More || len(fromProxy.Kvs) != len(fromEtcd.Kvs) {
		b.Fatalf("proxy: %d keys, count %d, more %v; etcd: %d keys, count %d, more %v",
			len(fromProxy.Kvs), fromProxy.Count, fromProxy.More, len(fromEtcd.Kvs), fromEtcd.Count, fromEtcd.More)
	}
	for i := range fromEtcd.Kvs {
		if !proto.Equal(fromEtcd.Kvs[i], fromProxy.Kvs[i]) {
			b.Fatalf("key %d differs at R: proxy %v, etcd %v", i, fromProxy.Kvs[i], fromEtcd.Kvs[i])
		}
	}
	env.rangeBytes = int64(proto.Size(fromEtcd))
	b.Logf("setup: %d keys x %d B at R=%d, %d update revisions, full range %.1f MiB, %d clients, GOMAXPROCS %d, auth %v; took %v",
		benchKeys, benchValueSize, env.rev, benchUpdates, float64(env.rangeBytes)/(1<<20), *benchClients, runtime.GOMAXPROCS(0), opts.auth, time.Since(start).Round(time.Millisecond))
	return env
}

// fullRange is a Range of the whole prefix at R, as a kube-apiserver LIST
// with an exact resourceVersion and no limit sends it (linearizable).
func (env *benchEnv) fullRange() *pb.RangeRequest {
	return &pb.RangeRequest{Key: env.prefix, RangeEnd: env.rangeEnd, Revision: env.rev}
}

// paginatedList reads the prefix at R the way kube-apiserver paginates, in
// pages of benchPageSize, and returns the number of keys read.
func (env *benchEnv) paginatedList(ctx context.Context, kv pb.KVClient) (int, error) {
	return servertest.ListPages(ctx, kv, env.prefix, env.rangeEnd, benchPageSize, env.rev)
}

func benchRandomValue(rng *rand.ChaCha8) []byte {
	v := make([]byte, benchValueSize)
	rng.Read(v)
	return v
}

// benchParallel runs fn for jobs 0..n-1 on workers goroutines, each with its own
// deterministic random source, and fails b on the first error.
func benchParallel(b *testing.B, workers, n int, fn func(worker, job int, rng *rand.ChaCha8) error) {
	b.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			var seed [32]byte
			seed[0] = byte(w)
			rng := rand.NewChaCha8(seed)
			for {
				j := int(next.Add(1) - 1)
				if j >= n {
					return
				}
				if err := fn(w, j, rng); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatal(err)
	}
}

// benchResult is one backend's measurement.
type benchResult struct {
	opsPerSec float64
	cpuPerOp  time.Duration // process CPU per op; 0 if unknown
}

// runThroughput runs b.N calls of op spread over *benchClients goroutines
// and reports the achieved rate as ops/s. ns/op is then wall time per
// completed op at that concurrency (1e9 / throughput), not latency. It also
// reports cpu-ms/op, the CPU the whole process (client, proxy and etcd)
// spent per op: it moves much less than throughput when other processes
// compete for the machine's CPUs (by ~15% rather than by 2x).
func runThroughput(b *testing.B, clients int, bytesPerOp int64, op func(ctx context.Context) error) benchResult {
	b.Helper()
	b.ReportAllocs()
	if bytesPerOp > 0 {
		b.SetBytes(bytesPerOp)
	}
	ctx := context.Background()
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	cpu0, cpuOK := processCPU()
	for range clients {
		wg.Go(func() {
			for next.Add(1) <= int64(b.N) {
				if err := op(ctx); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	cpu1, cpuOK1 := processCPU()
	b.StopTimer()
	res := benchResult{opsPerSec: float64(b.N) / b.Elapsed().Seconds()}
	b.ReportMetric(res.opsPerSec, "ops/s")
	// Below half a second the 10ms clock tick would make it a guess.
	if cpuOK && cpuOK1 && cpu1-cpu0 >= 500*time.Millisecond {
		res.cpuPerOp = (cpu1 - cpu0) / time.Duration(b.N)
		b.ReportMetric(float64(res.cpuPerOp)/float64(time.Millisecond), "cpu-ms/op")
	}
	return res
}

// processCPU is the user+system CPU time of this process so far, from
// /proc/self/stat (Linux; ok is false elsewhere). Its resolution is a clock
// tick (10ms), fine for runs of seconds.
func processCPU() (d time.Duration, ok bool) {
	stat, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0, false
	}
	// The command name (field 2) is parenthesised and may contain spaces;
	// utime and stime are fields 14 and 15, the 12th and 13th after it.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	const clockTick = 10 * time.Millisecond // USER_HZ is 100 on every Linux ABI
	return time.Duration(utime+stime) * clockTick, true
}

// compareBackends runs op against etcd directly (sub-benchmark "etcd"), then
// through the proxy ("proxy"), on the same cluster and data. The proxy
// sub-benchmark reports its throughput relative to etcd's as "x-etcd", and
// the parent prints a one-line SUMMARY. Either side can be selected alone with
// -bench (e.g. 'Historical/proxy'); the ratio then is not reported. With
// -count n, the testing package runs "etcd" n times and then "proxy" n times,
// and every proxy ratio is against the last etcd run.
func compareBackends(b *testing.B, env *benchEnv, bytesPerOp int64, op func(ctx context.Context, kv pb.KVClient) error) {
	b.Helper()
	compareBackendsN(b, env, *benchClients, bytesPerOp, op)
}

// compareBackendsN is compareBackends with clients concurrent clients. Both
// sub-benchmarks also report the requests etcd's KV service received per
// 1,000 ops ("etcd-kv-req/1k-ops"): the proxy's cost to etcd; with auth
// enabled, also those of its Auth service ("etcd-auth-req/1k-ops": the
// proxy's AuthStatus proofs). The proxy's reports the share of its Ranges
// it served from its cache ("cache-%"), which must be all of them.
func compareBackendsN(b *testing.B, env *benchEnv, clients int, bytesPerOp int64, op func(ctx context.Context, kv pb.KVClient) error) {
	b.Helper()
	etcdRequests := func(service string) float64 {
		return metricSum(b, prometheus.DefaultGatherer, "grpc_server_started_total", map[string]string{"grpc_service": service})
	}
	reportEtcdRequests := func(b *testing.B, kv0, auth0 float64) {
		b.ReportMetric((etcdRequests("etcdserverpb.KV")-kv0)*1000/float64(b.N), "etcd-kv-req/1k-ops")
		if env.auth {
			b.ReportMetric((etcdRequests("etcdserverpb.Auth")-auth0)*1000/float64(b.N), "etcd-auth-req/1k-ops")
		}
	}
	var etcd, proxy benchResult
	b.Run("etcd", func(b *testing.B) {
		kv0, auth0 := etcdRequests("etcdserverpb.KV"), etcdRequests("etcdserverpb.Auth")
		etcd = runThroughput(b, clients, bytesPerOp, func(ctx context.Context) error { return op(ctx, env.etcdKV) })
		reportEtcdRequests(b, kv0, auth0)
	})
	b.Run("proxy", func(b *testing.B) {
		cacheBefore, fwdBefore := proxyRangeSources(b, env.c)
		kv0, auth0 := etcdRequests("etcdserverpb.KV"), etcdRequests("etcdserverpb.Auth")
		prog0 := env.c.proxyMetric(b, "etcd_snapcache_upstream_progress_requests_total", nil)
		proxy = runThroughput(b, clients, bytesPerOp, func(ctx context.Context) error { return op(ctx, env.proxyKV) })
		reportEtcdRequests(b, kv0, auth0)
		b.ReportMetric((env.c.proxyMetric(b, "etcd_snapcache_upstream_progress_requests_total", nil)-prog0)*1000/float64(b.N), "progress-req/1k-ops")
		cacheAfter, fwdAfter := proxyRangeSources(b, env.c)
		if served := cacheAfter - cacheBefore + fwdAfter - fwdBefore; served > 0 {
			b.ReportMetric(100*(cacheAfter-cacheBefore)/served, "cache-%")
		}
		if fwdAfter != fwdBefore || cacheAfter-cacheBefore < float64(b.N) {
			b.Fatalf("the proxy served %v Ranges from its cache and forwarded %v to etcd for %d ops; the measurement is not of the cache",
				cacheAfter-cacheBefore, fwdAfter-fwdBefore, b.N)
		}
		if etcd.opsPerSec > 0 {
			b.ReportMetric(proxy.opsPerSec/etcd.opsPerSec, "x-etcd")
		}
		if etcd.cpuPerOp > 0 && proxy.cpuPerOp > 0 {
			b.ReportMetric(float64(etcd.cpuPerOp)/float64(proxy.cpuPerOp), "x-etcd-cpu")
		}
	})
	if etcd.opsPerSec > 0 && proxy.opsPerSec > 0 {
		// Straight to stdout: a parent benchmark's b.Log shows only with -v.
		// Both sub-benchmarks have printed their complete result lines by now,
		// and benchstat ignores lines like this one.
		cpu := ""
		if etcd.cpuPerOp > 0 && proxy.cpuPerOp > 0 {
			cpu = fmt.Sprintf("   cpu/op etcd %v proxy %v (%.2fx less)", etcd.cpuPerOp.Round(time.Microsecond),
				proxy.cpuPerOp.Round(time.Microsecond), float64(etcd.cpuPerOp)/float64(proxy.cpuPerOp))
		}
		fmt.Printf("SUMMARY %-24s etcd %9.1f ops/s   proxy %9.1f ops/s   proxy/etcd %5.2fx%s\n",
			b.Name(), etcd.opsPerSec, proxy.opsPerSec, proxy.opsPerSec/etcd.opsPerSec, cpu)
	}
}

// proxyRangeSources reads the proxy's Range counters: served from the cache
// and forwarded to etcd.
func proxyRangeSources(b *testing.B, c *cluster) (cache, forwarded float64) {
	b.Helper()
	mfs, err := c.proxy.Registry().Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "etcd_snapcache_range_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() != "source" {
					continue
				}
				switch l.GetValue() {
				case "cache":
					cache += m.GetCounter().GetValue()
				case "forwarded":
					forwarded += m.GetCounter().GetValue()
				}
			}
		}
	}
	return cache, forwarded
}
