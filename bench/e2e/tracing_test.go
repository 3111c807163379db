package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport/otlpsink"
)

// Flags of BenchmarkTracingCost.
var (
	tracingRounds       = flag.Int("snapcache.e2e.tracing-rounds", 4, "BenchmarkTracingCost: measured rounds; each runs every variant once (etcd direct, the proxies off, rate0, rate100), the order rotated by one each round")
	tracingGets         = flag.Int("snapcache.e2e.tracing-gets", 10_000, "BenchmarkTracingCost: linearizable single-key Gets per variant and round")
	tracingGetClients   = flag.Int("snapcache.e2e.tracing-get-clients", 8, "BenchmarkTracingCost: concurrent goroutines of the Gets")
	tracingRanges       = flag.Int("snapcache.e2e.tracing-ranges", 40, "BenchmarkTracingCost: linearizable Ranges of the whole prefix per variant and round")
	tracingRangeClients = flag.Int("snapcache.e2e.tracing-range-clients", 2, "BenchmarkTracingCost: concurrent goroutines of the Ranges")
	tracingKeys         = flag.Int("snapcache.e2e.tracing-keys", 10_000, "BenchmarkTracingCost: keys under the prefix: each Range's answer")
	tracingValue        = flag.Int("snapcache.e2e.tracing-value", 1024, "BenchmarkTracingCost: value size of every key")
)

const (
	// tracingGetKey is the single key the Gets read, outside the Ranges'
	// prefix (rangePrefix).
	tracingGetKey = "/registry/configmaps/default/tracing-get"
	// tracingBSPDelayMs is the proxies' OTEL_BSP_SCHEDULE_DELAY (the
	// SDK's default is 5 s): the spans a window ends with are exported
	// within it (tracingSettle), not in the same proxy's next window.
	tracingBSPDelayMs = 100
	// tracingSettle is the pause between a window's last op and its
	// closing sample, in every variant alike: the proxy exports the spans
	// still batched.
	tracingSettle = 300 * time.Millisecond
	// tracingTimeout bounds a window's ops, and the waits of the setup.
	tracingTimeout = 5 * time.Minute
)

// BenchmarkTracingCost: what the proxy's distributed tracing costs per
// linearizable Get of one key and per linearizable Range of
// -snapcache.e2e.tracing-keys keys, in one run. One etcd process holds
// the keys (under rangePrefix) and one more key, -snapcache.e2e.tracing-value
// bytes each; three proxy processes follow it:
//
//	off      default flags: no tracing;
//	rate0    --enable-distributed-tracing --distributed-tracing-address=<sink>:
//	         tracing on at the default sampling rate, 0 per million; the
//	         load sends no trace context, so nothing is sampled (otelgrpc's
//	         stats handlers run, every span a non-recording one);
//	rate100  the same with --distributed-tracing-sampling-rate=1000000:
//	         every request a sampled trace, its spans exported.
//
// Both tracing proxies export to one OTLP/gRPC receiver (otlpsink) in
// this process, with OTEL_BSP_SCHEDULE_DELAY=100 (ms). Before the rounds,
// a Get with a sampled W3C traceparent goes to each proxy: rate0's and
// rate100's spans of it must reach the receiver (a sampled caller is
// followed at any rate), off's none.
//
// The load is this process's clientv3 connections
// (-snapcache.e2e.conns per variant). A window is a fixed count of ops:
// -snapcache.e2e.tracing-gets Gets from -snapcache.e2e.tracing-get-clients
// goroutines, or -snapcache.e2e.tracing-ranges Ranges from
// -snapcache.e2e.tracing-range-clients goroutines. A round runs, for each
// variant in turn (etcd direct as a reference, then the three proxies, the
// order rotated by one each round), its Get window then its Range window;
// one warm-up round (a fifth of the ops) first, not reported;
// -snapcache.e2e.tracing-rounds measured rounds.
//
// Per workload and variant (SUMMARY lines): ops/s, the latency of the ops
// (mean, p50, p99 over every round's), the CPU time per op of the serving
// process (the proxy's; etcd's for etcd direct; utime+stime from
// /proc/<pid>/stat in 10 ms ticks, read after the opening scrape of
// /metrics and before the closing one, so that the scrapes are outside
// it) and its allocations per op (go_memstats_mallocs_total of the
// proxy's /proxy/metrics, etcd's /metrics); beside it etcd's CPU and
// allocations per op through the proxy, and the load generator's CPU per
// op (this process, the span receiver included); and each tracing
// variant's ratios over off, with each round's CPU ratio.
func BenchmarkTracingCost(b *testing.B) {
	if *tracingRounds < 1 || *tracingGets < 1 || *tracingGetClients < 1 || *tracingRanges < 1 ||
		*tracingRangeClients < 1 || *tracingKeys < 1 || *tracingValue < 1 {
		b.Fatal("the -snapcache.e2e.tracing-* flags must be positive")
	}
	start := time.Now()
	b.Setenv("OTEL_BSP_SCHEDULE_DELAY", fmt.Sprint(tracingBSPDelayMs)) // the proxies inherit it
	sink := otlpsink.Start(b)

	var etcdArgs, pprofArgs []string
	if *cmpPprof {
		etcdArgs, pprofArgs = []string{"--enable-pprof"}, []string{"--enable-pprof"}
	}
	e := startEtcd(b, etcdArgs...)
	cli := dial(b, e.endpoint, nil, "", "")
	ks := keyspace{n: *tracingKeys}
	w := newWriter(cli, *tracingValue, 16)
	loaded := w.put(b, ks.n, ks.key)
	ctx, cancel := context.WithTimeout(context.Background(), tracingTimeout)
	defer cancel()
	put, err := cli.Put(ctx, tracingGetKey, string(w.value))
	if err != nil {
		b.Fatal(err)
	}
	head := put.Header.Revision
	if loaded < int64(ks.n) || head != loaded+1 {
		// The writer's puts are one revision each.
		b.Fatalf("etcd at revision %d after %d puts (the keys up to %d): something else wrote", head, ks.n+1, loaded)
	}
	progress("tracing: %d keys of %d B and %s written in %v", ks.n, *tracingValue, tracingGetKey, time.Since(start).Round(time.Millisecond))

	traced := []string{"--enable-distributed-tracing", "--distributed-tracing-address=" + sink.Addr()}
	env := &pairEnv{etcd: e, loader: cli}
	vs := []*tracingVariant{{name: "etcd", s: env.newSide(b, "etcd", e.endpoint, "", "")}}
	for _, pv := range []struct {
		name string
		args []string
	}{
		{"off", nil},
		{"rate0", traced},
		{"rate100", append(slices.Clone(traced), "--distributed-tracing-sampling-rate=1000000")},
	} {
		p := startProxyProcess(b, e.endpoint, append(slices.Clone(pprofArgs), pv.args...)...)
		vs = append(vs, &tracingVariant{name: pv.name, proxy: p, s: env.newSide(b, pv.name, p.endpoint, "", "")})
	}
	if *cmpPprof {
		fmt.Printf("PPROF %s: etcd %s/debug/pprof/, proxies off %s, rate0 %s, rate100 %s (/debug/pprof/)\n",
			b.Name(), e.endpoint, vs[1].proxy.endpoint, vs[2].proxy.endpoint, vs[3].proxy.endpoint)
	}
	for _, v := range vs[1:] {
		testsupport.Poll(b, tracingTimeout, 20*time.Millisecond, fmt.Sprintf("the %s proxy's cache to reach revision %d", v.name, head), func() (bool, error) {
			if err := v.proxy.alive(); err != nil {
				b.Fatal(err)
			}
			at := v.proxy.status(b).Revision
			return at >= head, fmt.Errorf("at revision %d", at)
		})
		// The copy on disk of the keyspace is written once, before any
		// window.
		v.proxy.waitCopied(b, head)
	}

	getReq := &pb.RangeRequest{Key: []byte(tracingGetKey)}
	rangeReq := &pb.RangeRequest{Key: []byte(rangePrefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(rangePrefix))}
	var rangeBytes int
	for _, v := range vs {
		resp, err := v.s.kvs[0].Range(ctx, rangeReq)
		if err != nil {
			b.Fatalf("%s: %v", v.name, err)
		}
		if len(resp.Kvs) != ks.n || resp.Header.Revision < head {
			b.Fatalf("%s: the Range returned %d keys at revision %d, want %d at %d or later", v.name, len(resp.Kvs), resp.Header.Revision, ks.n, head)
		}
		rangeBytes = proto.Size(resp)
	}
	probe := tracingProbe(b, sink, vs[1:], getReq)

	workloads := []*tracingWorkload{
		{name: "get", n: *tracingGets, clients: *tracingGetClients,
			what: fmt.Sprintf("linearizable Gets of one key of %d B", *tracingValue),
			op: func(ctx context.Context, kv pb.KVClient) error {
				resp, err := kv.Range(ctx, getReq)
				if err == nil && len(resp.Kvs) != 1 {
					err = fmt.Errorf("the Get returned %d keys, want 1", len(resp.Kvs))
				}
				return err
			}},
		{name: "range", n: *tracingRanges, clients: *tracingRangeClients,
			what: fmt.Sprintf("linearizable Ranges of %d keys x %d B (%.1f MiB)", ks.n, *tracingValue, float64(rangeBytes)/mib),
			op: func(ctx context.Context, kv pb.KVClient) error {
				resp, err := kv.Range(ctx, rangeReq)
				if err == nil && len(resp.Kvs) != ks.n {
					err = fmt.Errorf("the Range returned %d keys, want %d", len(resp.Kvs), ks.n)
				}
				return err
			}},
	}
	for _, v := range vs {
		v.stats = map[string]*tracingStats{}
		for _, wl := range workloads {
			v.stats[wl.name] = &tracingStats{}
		}
	}
	fmt.Printf("SUMMARY %s setup: %d keys x %d B under %s and %s at revision %d, a Range's answer %.1f MiB; proxies off, rate0 (tracing on, rate 0), rate100 (rate 1000000 per million), spans to an OTLP receiver in the load generator (OTEL_BSP_SCHEDULE_DELAY=%dms); a sampled caller's Get: %s; took %v\n",
		b.Name(), ks.n, *tracingValue, rangePrefix, tracingGetKey, head, float64(rangeBytes)/mib, tracingBSPDelayMs, probe, time.Since(start).Round(time.Millisecond))

	b.ResetTimer()
	for _, v := range vs {
		for _, wl := range workloads {
			tracingWindow(b, e, v, wl, max(wl.n/5, 1), nil)
		}
	}
	for i := range *tracingRounds {
		for j := range vs {
			v := vs[(i+j)%len(vs)]
			for _, wl := range workloads {
				tracingWindow(b, e, v, wl, wl.n, v.stats[wl.name])
			}
		}
		progress("tracing: round %d of %d done", i+1, *tracingRounds)
	}
	b.StopTimer()

	for _, v := range vs[1:] {
		if err := v.proxy.alive(); err != nil {
			b.Fatal(err)
		}
		if log := strings.TrimSpace(tailOf(v.proxy.logPath)); log != "" {
			b.Logf("the %s proxy logged (at warn and above):\n%s", v.name, log)
		}
	}
	reportTracing(b, vs, workloads)
}

// tracingVariant is one path the load takes: etcd direct, or one of the
// proxies.
type tracingVariant struct {
	name  string        // etcd, off, rate0, rate100
	proxy *proxyProcess // nil for etcd direct
	s     *side
	stats map[string]*tracingStats // by workload
}

// tracingWorkload is a window's ops: n of op from clients goroutines.
type tracingWorkload struct {
	name       string // get, range
	what       string
	n, clients int
	op         func(ctx context.Context, kv pb.KVClient) error
}

// tracingStats sums a variant's windows of one workload.
type tracingStats struct {
	ops, secs                   float64
	lats                        []time.Duration // every op's
	serveCPU, etcdCPU, loadCPU  time.Duration   // the serving process: the proxy, or etcd direct
	serveMallocs, etcdMallocs   float64
	roundCPU, roundOps, roundMs []float64 // each round's serving CPU µs/op, ops/s, mean latency
}

// tracingCounters is what the processes have spent so far.
type tracingCounters struct {
	serveCPU, etcdCPU, loadCPU time.Duration
	serveMallocs, etcdMallocs  float64
}

// tracingSample reads v's counters: the scrapes first, then the CPU times
// (opening), or the CPU times first, then the scrapes (closing), so that
// the scrapes' CPU stays outside the window.
func tracingSample(b *testing.B, e *etcdProcess, v *tracingVariant, opening bool) tracingCounters {
	b.Helper()
	var c tracingCounters
	scrapes := func() {
		c.etcdMallocs = e.metrics(b).sum("go_memstats_mallocs_total")
		c.serveMallocs = c.etcdMallocs
		if v.proxy != nil {
			c.serveMallocs = v.proxy.metrics(b).sum("go_memstats_mallocs_total")
		}
	}
	cpus := func() {
		c.etcdCPU, c.loadCPU = processCPU(b, e.pid()), processCPU(b, "self")
		c.serveCPU = c.etcdCPU
		if v.proxy != nil {
			c.serveCPU = processCPU(b, v.proxy.pid())
		}
	}
	if opening {
		scrapes()
		cpus()
	} else {
		cpus()
		scrapes()
	}
	return c
}

// tracingWindow runs n of wl's ops through v, and adds what they cost to
// st (nil: a warm-up, not counted).
func tracingWindow(b *testing.B, e *etcdProcess, v *tracingVariant, wl *tracingWorkload, n int, st *tracingStats) {
	b.Helper()
	c0 := tracingSample(b, e, v, true)
	lats, secs, err := fixedLoop(v.s.kvs, n, wl.clients, wl.op)
	if err != nil {
		b.Fatalf("%s %s: %v", v.name, wl.name, err)
	}
	settle(tracingSettle)
	c1 := tracingSample(b, e, v, false)
	if v.proxy != nil {
		if err := v.proxy.alive(); err != nil {
			b.Fatal(err)
		}
	}
	if st == nil {
		return
	}
	ops := float64(n)
	var sum time.Duration
	for _, l := range lats {
		sum += l
	}
	st.ops += ops
	st.secs += secs
	st.lats = append(st.lats, lats...)
	st.serveCPU += c1.serveCPU - c0.serveCPU
	st.etcdCPU += c1.etcdCPU - c0.etcdCPU
	st.loadCPU += c1.loadCPU - c0.loadCPU
	st.serveMallocs += c1.serveMallocs - c0.serveMallocs
	st.etcdMallocs += c1.etcdMallocs - c0.etcdMallocs
	st.roundCPU = append(st.roundCPU, float64(c1.serveCPU-c0.serveCPU)/float64(time.Microsecond)/ops)
	st.roundOps = append(st.roundOps, ops/secs)
	st.roundMs = append(st.roundMs, float64(sum)/float64(time.Millisecond)/ops)
}

// fixedLoop runs n ops from clients goroutines, spread round-robin over
// kvs, each starting its next op when its last one returns, and returns
// every op's latency and the seconds from the first op's start to the
// last one's end. An op failing ends the loop.
func fixedLoop(kvs []pb.KVClient, n, clients int, op func(context.Context, pb.KVClient) error) ([]time.Duration, float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), tracingTimeout)
	defer cancel()
	var next atomic.Int64
	var failed atomic.Bool
	var errOnce sync.Once
	var firstErr error
	per := make([][]time.Duration, clients)
	var wg sync.WaitGroup
	begin := time.Now()
	for g := range clients {
		kv := kvs[g%len(kvs)]
		wg.Go(func() {
			lats := make([]time.Duration, 0, n/clients+1)
			for !failed.Load() && next.Add(1) <= int64(n) {
				t0 := time.Now()
				if err := op(ctx, kv); err != nil {
					errOnce.Do(func() { firstErr = err })
					failed.Store(true)
					break
				}
				lats = append(lats, time.Since(t0))
			}
			per[g] = lats
		})
	}
	wg.Wait()
	secs := time.Since(begin).Seconds()
	if firstErr != nil {
		return nil, 0, firstErr
	}
	return slices.Concat(per...), secs, nil
}

// tracingProbe sends each proxy a Get in a sampled trace of its own (a
// W3C traceparent, as a traced client sends it) and checks that the
// receiver gets the spans of the tracing proxies' and none of off's. It
// returns what each proxy exported of it.
func tracingProbe(b *testing.B, sink *otlpsink.Sink, proxies []*tracingVariant, req *pb.RangeRequest) string {
	b.Helper()
	traceIDs := map[string]string{}
	for i, v := range proxies {
		traceID := fmt.Sprintf("%032x", 0x7ace0000+i+1)
		parent := fmt.Sprintf("00-%s-%016x-01", traceID, 0x5a0000+i+1)
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "traceparent", parent), 30*time.Second)
		resp, err := v.s.kvs[0].Range(ctx, req)
		cancel()
		if err != nil || len(resp.Kvs) != 1 {
			b.Fatalf("%s: the traced Get: %v (%d keys)", v.name, err, len(resp.GetKvs()))
		}
		traceIDs[v.name] = traceID
	}
	for _, v := range proxies {
		if v.name == "off" {
			continue
		}
		testsupport.Poll(b, time.Minute, 50*time.Millisecond, fmt.Sprintf("the %s proxy's spans of a sampled caller's Get", v.name), func() (bool, error) {
			return len(sink.Spans(traceIDs[v.name])) > 0, nil
		})
	}
	// What is still batched is exported within the schedule delay.
	settle(5 * tracingBSPDelayMs * time.Millisecond)
	var parts []string
	for _, v := range proxies {
		spans := sink.Spans(traceIDs[v.name])
		if v.name == "off" {
			if len(spans) != 0 {
				b.Fatalf("the proxy without tracing exported %d spans", len(spans))
			}
			parts = append(parts, "off 0 spans")
			continue
		}
		var names []string
		for _, sp := range spans {
			names = append(names, strings.ToLower(strings.TrimPrefix(sp.Kind.String(), "SPAN_KIND_"))+" "+sp.Name)
		}
		slices.Sort(names)
		parts = append(parts, fmt.Sprintf("%s %d spans (%s)", v.name, len(spans), strings.Join(names, ", ")))
	}
	return strings.Join(parts, ", ")
}

// tracingTotals is a variant's totals of one workload, per op.
type tracingTotals struct {
	opsSec                  float64
	meanMs, p50Ms, p99Ms    float64
	serveCPU, etcdCPU, load float64 // µs/op
	serveAllocs, etcdAllocs float64 // per op
}

func (st *tracingStats) totals() tracingTotals {
	lats := slices.Clone(st.lats)
	slices.Sort(lats)
	q := func(p float64) float64 {
		return float64(lats[min(int(p*float64(len(lats))), len(lats)-1)]) / float64(time.Millisecond)
	}
	var sum time.Duration
	for _, l := range lats {
		sum += l
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / st.ops }
	return tracingTotals{
		opsSec: st.ops / st.secs,
		meanMs: float64(sum) / float64(time.Millisecond) / float64(len(lats)),
		p50Ms:  q(0.50), p99Ms: q(0.99),
		serveCPU: us(st.serveCPU), etcdCPU: us(st.etcdCPU), load: us(st.loadCPU),
		serveAllocs: st.serveMallocs / st.ops, etcdAllocs: st.etcdMallocs / st.ops,
	}
}

// reportTracing reports every variant's totals and the tracing variants'
// ratios over off, as metrics and SUMMARY lines, per workload.
func reportTracing(b *testing.B, vs []*tracingVariant, workloads []*tracingWorkload) {
	b.Helper()
	b.ReportMetric(0, "ns/op") // fixed rounds, not b.N ops
	var sb strings.Builder
	for _, wl := range workloads {
		t := map[string]tracingTotals{}
		rounds := map[string][]float64{} // each round's serving CPU per op
		for _, v := range vs {
			t[v.name] = v.stats[wl.name].totals()
			rounds[v.name] = v.stats[wl.name].roundCPU
		}
		off := t["off"]
		fmt.Fprintf(&sb, "SUMMARY %s/%s: over tracing off:", b.Name(), wl.name)
		for i, name := range []string{"rate0", "rate100"} {
			x := t[name]
			sep := ";"
			if i == 0 {
				sep = ""
			}
			fmt.Fprintf(&sb, "%s %s proxy cpu %.2fx (%+.1f µs/op; per round %s), allocs %.2fx (%+.1f/op), latency mean %.2fx p50 %.2fx p99 %.2fx, ops/s %.2fx",
				sep, name, x.serveCPU/off.serveCPU, x.serveCPU-off.serveCPU,
				fmtList(pairRatios(rounds[name], rounds["off"]), "%.2f"),
				x.serveAllocs/off.serveAllocs, x.serveAllocs-off.serveAllocs,
				x.meanMs/off.meanMs, x.p50Ms/off.p50Ms, x.p99Ms/off.p99Ms, x.opsSec/off.opsSec)
			b.ReportMetric(x.serveCPU/off.serveCPU, wl.name+"-"+name+"/off-cpu")
			b.ReportMetric(x.serveAllocs/off.serveAllocs, wl.name+"-"+name+"/off-allocs")
			b.ReportMetric(x.meanMs/off.meanMs, wl.name+"-"+name+"/off-latency")
		}
		fmt.Fprintf(&sb, "  [%d rounds x %d %s by %d clients over %d connections; rounds rotate the variants' order]\n",
			*tracingRounds, wl.n, wl.what, wl.clients, len(vs[0].s.kvs))
		for _, v := range vs {
			x, st := t[v.name], v.stats[wl.name]
			serving := "proxy"
			if v.proxy == nil {
				serving = "etcd"
			}
			fmt.Fprintf(&sb, "SUMMARY   %-7s: %9.1f ops/s (rounds %s)  latency mean %.3f ms (rounds %s) p50 %.3f p99 %.3f ms  %s cpu %.1f µs/op (rounds %s)  %s allocs %.1f/op",
				v.name, x.opsSec, fmtList(st.roundOps, "%.1f"), x.meanMs, fmtList(st.roundMs, "%.3f"), x.p50Ms, x.p99Ms,
				serving, x.serveCPU, fmtList(st.roundCPU, "%.1f"), serving, x.serveAllocs)
			if v.proxy != nil {
				fmt.Fprintf(&sb, "  etcd cpu %.1f µs/op allocs %.1f/op", x.etcdCPU, x.etcdAllocs)
			}
			fmt.Fprintf(&sb, "  [load generator cpu %.1f µs/op]\n", x.load)
			p := wl.name + "-" + v.name + "-"
			b.ReportMetric(x.opsSec, p+"ops/s")
			b.ReportMetric(x.serveCPU, p+"cpu-us/op")
			b.ReportMetric(x.serveAllocs, p+"allocs/op")
			b.ReportMetric(x.meanMs, p+"mean-ms")
			b.ReportMetric(x.p99Ms, p+"p99-ms")
		}
	}
	// Straight to stdout: a benchmark's b.Log shows only with -v.
	fmt.Fprint(os.Stdout, sb.String())
}
