package e2e

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// Flags of the throughput benchmarks (BenchmarkLinearizableGet,
// BenchmarkWatchFanout, BenchmarkPaginatedList, BenchmarkHistoricalRange).
var (
	cmpRounds  = flag.Int("snapcache.e2e.rounds", 5, "measured rounds per side; etcd and proxy rounds alternate (etcd,proxy, proxy,etcd, ...)")
	cmpRound   = flag.Duration("snapcache.e2e.round", 2*time.Second, "length of a closed-loop round (the round also ends after -snapcache.e2e.maxops ops)")
	cmpMaxOps  = flag.Int64("snapcache.e2e.maxops", 1_000_000, "most ops of a closed-loop round")
	cmpConns   = flag.Int("snapcache.e2e.conns", 4, "gRPC connections (clientv3 clients) per side that the closed-loop goroutines share round-robin")
	cmpAuth    = flag.Bool("snapcache.e2e.auth", false, "etcd with auth enabled: the proxy runs as root, the load authenticates as a user with read-write access to /registry/")
	cmpTLS     = flag.Bool("snapcache.e2e.tls", false, "mTLS on every hop, as production runs: etcd and the proxy serve TLS and require client certificates of one CA (--client-cert-auth); the proxy reaches etcd, and the load and the kube-apiservers reach either, with a client certificate that names no user")
	cmpTimeout = flag.Duration("snapcache.e2e.op-timeout", time.Minute, "timeout of one op (a round fails past it)")
	cmpPprof   = flag.Bool("snapcache.e2e.pprof", false, "serve etcd's and the proxy's /debug/pprof/ and log where, to profile them while a benchmark runs")
)

// Users of the auth runs (-snapcache.e2e.auth).
const (
	rootPassword  = "rootpw"
	benchUser     = "bench"
	benchPassword = "benchpw"
	benchPerm     = "/registry/" // benchUser's read-write range: every benchmark key
)

// pairEnv is one etcd process and one proxy process in front of it, with
// the load's clients of each.
type pairEnv struct {
	etcd   *etcdProcess
	proxy  *proxyProcess
	loader *clientv3.Client // direct to etcd (root with auth): loads data
	etcdS  *side
	proxyS *side
	auth   bool
	tls    *tls.Config // what the load presents to etcd and the proxy; nil: plaintext
	pki    *mtlsPKI    // the certificates, with tls; else nil
	// proxyArgs are the flags the proxy runs with beyond startProxyProcess's
	// own: serving mTLS and reaching etcd over it, as root with auth, pprof.
	proxyArgs []string
}

// side is one path the load takes: direct to etcd, or through the proxy.
type side struct {
	name     string // "etcd" or "proxy"
	endpoint string
	clis     []*clientv3.Client // -snapcache.e2e.conns connections
	kvs      []pb.KVClient      // their KV clients
	env      *pairEnv
}

// dial is a clientv3 client of endpoint (over TLS with tlsCfg if not nil,
// authenticated if user is set), closed when tb ends. Its raw pb clients
// receive messages of any size, as clientv3's own calls do.
func dial(tb testing.TB, endpoint string, tlsCfg *tls.Config, user, password string) *clientv3.Client {
	tb.Helper()
	return dialAll(tb, []string{endpoint}, tlsCfg, user, password)
}

// dialAll is dial to several endpoints: the members of a cluster, which
// clientv3 balances over and fails over between.
func dialAll(tb testing.TB, endpoints []string, tlsCfg *tls.Config, user, password string) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		TLS:         tlsCfg,
		Username:    user,
		Password:    password,
		DialTimeout: 5 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32))},
		Logger:      zap.NewNop(),
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}

// newPairEnv starts etcd, then (with -snapcache.e2e.auth, after enabling
// auth) the proxy in front of it, and the load's connections to each; with
// -snapcache.e2e.tls, every hop is mTLS. The proxy starts before any data
// is written, so that it holds every revision the benchmarks read from
// memory.
func newPairEnv(b *testing.B) *pairEnv {
	b.Helper()
	return startPair(b, *cmpAuth, *cmpTLS)
}

// startPair is newPairEnv with auth on or off, and over mTLS (secure) or
// plaintext. With mTLS, etcd and the proxy serve TLS with
// --client-cert-auth and a CA they trust (mtlsPKI), the proxy reaches etcd
// with a client certificate that names no user, and the load presents one
// too. With auth, etcd has root and benchUser (setUpAuth, then authSteps
// before auth is enabled), the proxy runs as root (--user) and the load
// authenticates as benchUser.
func startPair(b *testing.B, auth, secure bool, authSteps ...func(context.Context, *clientv3.Client) error) *pairEnv {
	b.Helper()
	var etcdArgs []string
	env := &pairEnv{auth: auth}
	if *cmpPprof {
		etcdArgs, env.proxyArgs = []string{"--enable-pprof"}, []string{"--enable-pprof"}
	}
	if secure {
		env.pki = newMTLSPKI(b)
		env.tls = env.pki.clientTLS(b)
		etcdArgs = append(etcdArgs, env.pki.serving("etcd")...)
		env.proxyArgs = append(append(env.proxyArgs, env.pki.serving("proxy")...), env.pki.upstream()...)
	}
	env.etcd = startEtcdTLS(b, env.tls, etcdArgs...)
	user, password := "", ""
	if env.auth {
		setUpAuth(b, env.etcd.endpoint, env.tls, authSteps...)
		env.proxyArgs = append(env.proxyArgs, "--user=root", "--password="+rootPassword)
		user, password = benchUser, benchPassword
		env.loader = dial(b, env.etcd.endpoint, env.tls, "root", rootPassword)
	} else {
		env.loader = dial(b, env.etcd.endpoint, env.tls, "", "")
	}
	env.proxy = env.startProxy(b)
	if *cmpPprof {
		// Printed at once: a benchmark's log comes out when it ends.
		how := ""
		if env.pki != nil {
			how = " (mTLS: go tool pprof " + env.pki.pprofFlags() + ")"
		}
		fmt.Printf("PPROF %s: etcd %s/debug/pprof/, proxy %s/debug/pprof/%s\n", b.Name(), env.etcd.endpoint, env.proxy.endpoint, how)
	}
	env.etcdS = env.newSide(b, "etcd", env.etcd.endpoint, user, password)
	env.proxyS = env.newSide(b, "proxy", env.proxy.endpoint, user, password)
	return env
}

// startProxy starts a proxy process in front of env's etcd with the
// pair's flags (env.proxyArgs), then extra.
func (env *pairEnv) startProxy(b *testing.B, extra ...string) *proxyProcess {
	b.Helper()
	return startProxyProcessTLS(b, env.etcd.endpoint, env.tls != nil, append(slices.Clone(env.proxyArgs), extra...)...)
}

// summaryName is b's name as its SUMMARY lines give it ("/tls" if mTLS).
func (env *pairEnv) summaryName(b *testing.B) string { return summaryName(b, env.tls != nil) }

func (env *pairEnv) newSide(b *testing.B, name, endpoint, user, password string) *side {
	s := &side{name: name, endpoint: endpoint, env: env}
	for range max(*cmpConns, 1) {
		cli := dial(b, endpoint, env.tls, user, password)
		s.clis = append(s.clis, cli)
		s.kvs = append(s.kvs, pb.NewKVClient(cli.ActiveConnection()))
	}
	return s
}

// setUpAuth gives etcd a root user and benchUser, whose role may read and
// write benchPerm, and enables auth.
func setUpAuth(b *testing.B, endpoint string, tlsCfg *tls.Config, more ...func(context.Context, *clientv3.Client) error) {
	b.Helper()
	admin := dial(b, endpoint, tlsCfg, "", "")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	steps := []func() error{
		func() error { _, err := admin.UserAdd(ctx, "root", rootPassword); return err },
		func() error { _, err := admin.RoleAdd(ctx, "root"); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := admin.UserAdd(ctx, benchUser, benchPassword); return err },
		func() error { _, err := admin.RoleAdd(ctx, benchUser); return err },
		func() error {
			_, err := admin.RoleGrantPermission(ctx, benchUser, benchPerm, clientv3.GetPrefixRangeEnd(benchPerm), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := admin.UserGrantRole(ctx, benchUser, benchUser); return err },
	}
	for _, step := range more {
		steps = append(steps, func() error { return step(ctx, admin) })
	}
	steps = append(steps, func() error { _, err := admin.AuthEnable(ctx); return err })
	for _, step := range steps {
		if err := step(); err != nil {
			b.Fatalf("setting up etcd's auth: %v", err)
		}
	}
}

// head is etcd's current revision.
func (env *pairEnv) head(b *testing.B) int64 {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := env.loader.Get(ctx, "health")
	if err != nil {
		b.Fatal(err)
	}
	return resp.Header.Revision
}

// waitProxy waits until the proxy's cache is complete up to rev, and checks
// that it still holds revision oldest in memory (so that reads at it are
// measured served from the cache).
func (env *pairEnv) waitProxy(b *testing.B, rev, oldest int64) {
	b.Helper()
	var last proxystatus.Status
	testsupport.Poll(b, 5*time.Minute, 20*time.Millisecond, fmt.Sprintf("the proxy's cache to reach revision %d", rev), func() (bool, error) {
		if err := env.proxy.alive(); err != nil {
			b.Fatal(err)
		}
		last = env.proxy.status(b)
		return last.Revision >= rev, fmt.Errorf("at revision %d", last.Revision)
	})
	if o := last.OldestRevision; oldest > 0 && o > oldest {
		b.Fatalf("the proxy's oldest snapshot is at revision %d; revision %d would be read from etcd", o, oldest)
	}
}

// sample is what the serving processes (and this one) have spent so far.
type sample struct {
	etcdCPU, proxyCPU, clientCPU time.Duration
	etcdMallocs, proxyMallocs    float64
	etcdKV                       float64 // KV requests etcd has received
	cached, forwarded            float64 // the proxy's Ranges served from its cache, and forwarded
}

func (env *pairEnv) sample(b *testing.B) sample {
	b.Helper()
	em, pm, ps := env.etcd.metrics(b), env.proxy.metrics(b), env.proxy.status(b)
	return sample{
		etcdCPU:      processCPU(b, env.etcd.pid()),
		proxyCPU:     processCPU(b, env.proxy.pid()),
		clientCPU:    processCPU(b, "self"),
		etcdMallocs:  em.sum("go_memstats_mallocs_total"),
		proxyMallocs: pm.sum("go_memstats_mallocs_total"),
		etcdKV:       em.sum("grpc_server_started_total", `grpc_service="etcdserverpb.KV"`),
		cached:       float64(ps.Requests(proxystatus.SourceCache)),
		forwarded:    float64(ps.Requests(proxystatus.SourceForwarded)),
	}
}

// meter brackets the measured part of a round with samples.
type meter struct {
	b             *testing.B
	env           *pairEnv
	before, after sample
	started       bool
	stopped       bool
}

func (m *meter) start() { m.before, m.started = m.env.sample(m.b), true }
func (m *meter) stop()  { m.after, m.stopped = m.env.sample(m.b), true }

// roundOut is what a round reports: ops done in secs of wall time, and
// any workload-specific values (e.g. latency percentiles), by name.
type roundOut struct {
	ops   float64
	secs  float64
	extra map[string]float64
}

// roundFunc runs one round of a workload against s, calling m.start and
// m.stop around its measured part. A warm-up round (warm) is shorter and
// not reported; a workload may do nothing for it.
type roundFunc func(b *testing.B, s *side, m *meter, warm bool) roundOut

// round is one measured round.
type round struct {
	out    roundOut
	d      sample // after - before
	opsSec float64
}

// compareSides runs a warm-up round on each side, then -snapcache.e2e.rounds
// rounds on each, alternating (etcd,proxy, proxy,etcd, ...: neither side
// always goes first), and reports both sides, the ratio proxy/etcd and each
// round's values (b.ReportMetric and SUMMARY lines). unit names what an
// op is ("op", "event").
func compareSides(b *testing.B, env *pairEnv, unit string, fn roundFunc) {
	b.Helper()
	run := func(s *side, warm bool) round {
		m := &meter{b: b, env: env}
		out := fn(b, s, m, warm)
		if warm {
			return round{}
		}
		if !m.started || !m.stopped {
			b.Fatalf("%s round: the workload did not start and stop its meter", s.name)
		}
		if out.ops <= 0 || out.secs <= 0 {
			b.Fatalf("%s round: %v %s in %vs", s.name, out.ops, unit, out.secs)
		}
		a, z := m.before, m.after
		return round{out: out, opsSec: out.ops / out.secs, d: sample{
			etcdCPU: z.etcdCPU - a.etcdCPU, proxyCPU: z.proxyCPU - a.proxyCPU, clientCPU: z.clientCPU - a.clientCPU,
			etcdMallocs: z.etcdMallocs - a.etcdMallocs, proxyMallocs: z.proxyMallocs - a.proxyMallocs,
			etcdKV: z.etcdKV - a.etcdKV, cached: z.cached - a.cached, forwarded: z.forwarded - a.forwarded,
		}}
	}
	run(env.etcdS, true)
	run(env.proxyS, true)
	var er, pr []round
	b.ResetTimer()
	for i := range *cmpRounds {
		if i%2 == 0 {
			er = append(er, run(env.etcdS, false))
			pr = append(pr, run(env.proxyS, false))
		} else {
			pr = append(pr, run(env.proxyS, false))
			er = append(er, run(env.etcdS, false))
		}
	}
	b.StopTimer()
	report(b, env, unit, er, pr)
}

// sideTotals sums a side's rounds.
type sideTotals struct {
	ops, secs                    float64
	etcdCPU, proxyCPU, cliCPU    time.Duration
	etcdMallocs, proxyMallocs    float64
	etcdKV, cached, forwarded    float64
	perRound                     []float64
	extra                        map[string][]float64
	opsSec, cpuPerOp, allocsOp   float64 // cpuPerOp in µs; of the path (etcd, or proxy + etcd)
	etcdCPUOp, proxyCPUOp, cliOp float64 // µs per op
	etcdAllocsOp, proxyAllocsOp  float64
}

func totals(name string, rs []round) sideTotals {
	t := sideTotals{extra: map[string][]float64{}}
	for _, r := range rs {
		t.ops += r.out.ops
		t.secs += r.out.secs
		t.etcdCPU += r.d.etcdCPU
		t.proxyCPU += r.d.proxyCPU
		t.cliCPU += r.d.clientCPU
		t.etcdMallocs += r.d.etcdMallocs
		t.proxyMallocs += r.d.proxyMallocs
		t.etcdKV += r.d.etcdKV
		t.cached += r.d.cached
		t.forwarded += r.d.forwarded
		t.perRound = append(t.perRound, r.opsSec)
		for k, v := range r.out.extra {
			t.extra[k] = append(t.extra[k], v)
		}
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / t.ops }
	t.opsSec = t.ops / t.secs
	t.etcdCPUOp, t.proxyCPUOp, t.cliOp = us(t.etcdCPU), us(t.proxyCPU), us(t.cliCPU)
	t.etcdAllocsOp, t.proxyAllocsOp = t.etcdMallocs/t.ops, t.proxyMallocs/t.ops
	// The path's cost: etcd alone for the direct path; proxy + etcd
	// through the proxy (the proxy process idles during etcd's rounds and
	// is not counted there).
	t.cpuPerOp, t.allocsOp = t.etcdCPUOp, t.etcdAllocsOp
	if name == "proxy" {
		t.cpuPerOp += t.proxyCPUOp
		t.allocsOp += t.proxyAllocsOp
	}
	return t
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func fmtList(v []float64, format string) string {
	parts := make([]string, len(v))
	for i, x := range v {
		parts[i] = fmt.Sprintf(format, x)
	}
	return strings.Join(parts, " ")
}

// report reports both sides' totals as metrics and prints the SUMMARY.
func report(b *testing.B, env *pairEnv, unit string, er, pr []round) {
	b.Helper()
	e, p := totals("etcd", er), totals("proxy", pr)
	ratio := p.opsSec / e.opsSec
	var ratios []float64
	for i := range er {
		ratios = append(ratios, pr[i].opsSec/er[i].opsSec)
	}
	b.ReportMetric(0, "ns/op") // a run is many ops of fixed rounds: see ops/s
	b.ReportMetric(e.opsSec, "etcd-"+unit+"s/s")
	b.ReportMetric(p.opsSec, "proxy-"+unit+"s/s")
	b.ReportMetric(ratio, "proxy/etcd")
	b.ReportMetric(e.cpuPerOp, "etcd-cpu-us/"+unit)
	b.ReportMetric(p.cpuPerOp, "proxy-path-cpu-us/"+unit)
	b.ReportMetric(e.allocsOp, "etcd-allocs/"+unit)
	b.ReportMetric(p.allocsOp, "proxy-path-allocs/"+unit)
	// etcd's own share of the proxy path: what the proxy saves etcd.
	b.ReportMetric(p.etcdCPUOp, "proxy-path-etcd-cpu-us/"+unit)
	b.ReportMetric(p.etcdAllocsOp, "proxy-path-etcd-allocs/"+unit)
	if p.cached+p.forwarded > 0 {
		b.ReportMetric(100*p.cached/(p.cached+p.forwarded), "proxy-cache-%")
	}
	var extras []string
	for k := range e.extra {
		extras = append(extras, k)
	}
	slices.Sort(extras)
	for _, k := range extras {
		b.ReportMetric(median(e.extra[k]), "etcd-"+k)
		b.ReportMetric(median(p.extra[k]), "proxy-"+k)
	}

	// Straight to stdout: a benchmark's b.Log shows only with -v, and
	// benchstat ignores these lines.
	var sb strings.Builder
	auth := ""
	if env.auth {
		auth = " (auth on)"
	}
	fmt.Fprintf(&sb, "SUMMARY %s%s: proxy/etcd %.2fx %ss/s (per round %s)\n", env.summaryName(b), auth, ratio, unit, fmtList(ratios, "%.2f"))
	fmt.Fprintf(&sb, "SUMMARY   etcd : %10.1f %ss/s (rounds %s)  cpu %.1f µs/%s  allocs %.1f/%s  etcd KV requests %.3f/%s  [load generator cpu %.1f µs/%s]\n",
		e.opsSec, unit, fmtList(e.perRound, "%.1f"), e.cpuPerOp, unit, e.allocsOp, unit, e.etcdKV/e.ops, unit, e.cliOp, unit)
	cache := ""
	if p.cached+p.forwarded > 0 {
		cache = fmt.Sprintf("  cache %.1f%% of %.0f Ranges", 100*p.cached/(p.cached+p.forwarded), p.cached+p.forwarded)
	}
	fmt.Fprintf(&sb, "SUMMARY   proxy: %10.1f %ss/s (rounds %s)  cpu %.1f µs/%s (proxy %.1f + etcd %.1f)  allocs %.1f/%s (proxy %.1f + etcd %.1f)  etcd KV requests %.3f/%s%s  [load generator cpu %.1f µs/%s]\n",
		p.opsSec, unit, fmtList(p.perRound, "%.1f"), p.cpuPerOp, unit, p.proxyCPUOp, p.etcdCPUOp,
		p.allocsOp, unit, p.proxyAllocsOp, p.etcdAllocsOp, p.etcdKV/p.ops, unit, cache, p.cliOp, unit)
	for _, k := range extras {
		fmt.Fprintf(&sb, "SUMMARY   %s: etcd %.3g (rounds %s)  proxy %.3g (rounds %s)  (medians of rounds)\n",
			k, median(e.extra[k]), fmtList(e.extra[k], "%.3g"), median(p.extra[k]), fmtList(p.extra[k], "%.3g"))
	}
	fmt.Fprint(os.Stdout, sb.String())
}

// closedLoop runs op on clients goroutines, spread round-robin over s's
// connections, each starting its next op when its last one returns, for
// -snapcache.e2e.round (a quarter of it, at most 500ms, when warm) or until
// -snapcache.e2e.maxops ops have started, whichever comes first. An op
// failing fails the round.
func closedLoop(b *testing.B, s *side, m *meter, warm bool, clients int, op func(ctx context.Context, kv pb.KVClient) error) roundOut {
	b.Helper()
	d := *cmpRound
	if warm {
		d = min(d/4, 500*time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), d+*cmpTimeout)
	defer cancel()
	var stop atomic.Bool
	var started, done atomic.Int64
	var errOnce sync.Once
	var firstErr error
	var wg sync.WaitGroup
	m.start()
	begin := time.Now()
	timer := time.AfterFunc(d, func() { stop.Store(true) })
	for g := range clients {
		kv := s.kvs[g%len(s.kvs)]
		wg.Go(func() {
			for !stop.Load() && started.Add(1) <= *cmpMaxOps {
				if err := op(ctx, kv); err != nil {
					errOnce.Do(func() { firstErr = err })
					stop.Store(true)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	secs := time.Since(begin).Seconds()
	timer.Stop()
	m.stop()
	if firstErr != nil {
		b.Fatalf("%s: %v", s.name, firstErr)
	}
	return roundOut{ops: float64(done.Load()), secs: secs}
}
