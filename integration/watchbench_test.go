package integration

// BenchmarkWatchFanout: many watchers of one prefix, served by etcd directly
// (sub-benchmark "etcd") and by the proxy ("proxy"), on the same cluster. Run:
//
//	go test -run '^$' -bench WatchFanout -benchtime 1x -timeout 30m ./integration/
//
// The -snapcache.bench.watch* flags go after the package, e.g. a smaller
// run with paced writes and -v for the per-stream spread:
//
//	go test -run '^$' -bench WatchFanout -benchtime 1x -v ./integration/ \
//		-snapcache.bench.watchwrites 200 -snapcache.bench.watchwriteinterval 250ms
//
// The scenario, once per b.N iteration (its wall time is ns/op):
//
//   - 10,000 watchers (-snapcache.bench.watchers) over 100 watch streams
//     (-snapcache.bench.watchstreams) on 10 gRPC connections
//     (-snapcache.bench.watchconns), 100 per stream, each created on the
//     prefix with prev_kv as kube-apiserver watches, and each created
//     response awaited;
//   - 1,000 Puts (-snapcache.bench.watchwrites) of 1 KiB values, written
//     straight to etcd, sequentially and as fast as etcd commits them (or
//     paced with -snapcache.bench.watchwriteinterval), cycling over 100 keys
//     that exist before the watchers, so that every event carries a 1 KiB
//     prev_kv;
//   - every watcher must receive every write, once, in order, with its
//     prev_kv: 10M event deliveries at the default size.
//
// Reported per side:
//
//   - p50-ms, p99-ms, max-ms: latency of the deliveries, from just before
//     the Put is sent (the time is in the value) to the receipt of the
//     response carrying the event, over every (watcher, event) pair;
//   - events/s: deliveries divided by the time from the first Put to the
//     last delivery; writes/s: the Puts' own rate;
//   - upstream-watchers: etcd's etcd_debugging_mvcc_watcher_total with
//     every watcher open: the client watchers plus the proxy's follower on
//     the etcd side, the follower alone on the proxy side;
//     added-watchers is the increase over before the watchers were
//     opened, which must be 0 on the proxy side;
//   - heap-watchers-MiB: the increase of the process's live heap (after a
//     GC) with every watcher open, before the writes; heap-MiB: the same
//     after every event has been delivered, watchers still open;
//     peak-heap-MiB: the highest heap (live objects and garbage not yet
//     collected, what the process's memory follows), sampled every 100ms
//     during the writes and deliveries, over the baseline: it grows with
//     the rate of allocation as much as with what is held;
//   - create-ms: the time to create every watcher;
//   - cpu-us/event: the CPU the whole process (clients, proxy and etcd)
//     spent per delivery during the writes and deliveries; it moves less
//     than the rates when other processes compete for the CPUs.
//
// etcd, the proxy and the clients share the process and its CPUs: the
// receive side's cost (decoding 10M events, about half the CPU on the proxy
// side) is in both sides' numbers, the heap figures are the whole
// process's (client, proxy and etcd), and the fan-out's CPU use slows
// etcd's commits, hence the unpaced write rate, on both sides. Profiles
// (-cpuprofile, -memprofile, -snapcache.bench.watchheapprofile) separate
// them. When the deliveries cannot keep up with the writes, the latency
// is the backlog's; with grpc-go's default flow control (BDP-estimated
// windows, -snapcache.bench.watchwindow 0), whole connections then lag
// tens of seconds behind the others, against etcd as against the proxy:
// -v logs the spread per stream and per connection.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/metadata"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

func BenchmarkWatchFanout(b *testing.B) {
	if *fanoutWatchers < *fanoutStreams || *fanoutStreams < 1 || *fanoutConns < 1 || *fanoutWrites < 1 {
		b.Fatalf("need watchers >= streams >= 1, connections >= 1, writes >= 1")
	}
	start := time.Now()
	c := newCluster(b, clusterOptions{quiet: true})
	// The keys the writes update exist before any watcher: every event has
	// a prev_kv.
	rng := rand.NewChaCha8([32]byte{})
	for i := range fanoutKeys {
		pad := make([]byte, fanoutValueSize)
		rng.Read(pad)
		if _, err := c.directKV.Put(context.Background(), &pb.PutRequest{Key: fanoutKey(i), Value: fanoutValue(-1, 0, pad)}); err != nil {
			b.Fatal(err)
		}
	}
	c.waitSynced(b)
	b.Logf("setup: %d watchers over %d streams on %d connections, %d writes of %d B over %d keys (interval %v), GOMAXPROCS %d; took %v",
		*fanoutWatchers, *fanoutStreams, *fanoutConns, *fanoutWrites, fanoutValueSize, fanoutKeys, *fanoutWriteInterval, runtime.GOMAXPROCS(0), time.Since(start).Round(time.Millisecond))

	var etcd, proxy *fanoutResult
	b.Run("etcd", func(b *testing.B) { etcd = runWatchFanout(b, c, false) })
	b.Run("proxy", func(b *testing.B) { proxy = runWatchFanout(b, c, true) })
	if etcd != nil && proxy != nil {
		// Straight to stdout, as compareBackends does.
		fmt.Printf("SUMMARY %-22s %d watchers/%d streams, %d writes\n", b.Name(), *fanoutWatchers, *fanoutStreams, *fanoutWrites)
		for _, r := range []struct {
			name string
			r    *fanoutResult
		}{{"etcd", etcd}, {"proxy", proxy}} {
			fmt.Printf("SUMMARY   %-5s  p50 %8.1f ms  p99 %8.1f ms  max %8.1f ms  %9.0f events/s  %6.1f writes/s  upstream watchers %6.0f (+%.0f)  heap %7.1f MiB (watchers %6.1f, peak %7.1f)  create %6.0f ms  cpu/event %5.2f us\n",
				r.name, toMs(r.r.p50), toMs(r.r.p99), toMs(r.r.max), r.r.eventsPerSec, r.r.writesPerSec,
				r.r.upstream, r.r.added, r.r.heapMiB, r.r.heapWatchersMiB, r.r.peakHeapMiB, toMs(r.r.create), float64(r.r.cpuPerEvent)/float64(time.Microsecond))
		}
	}
}

func fanoutKey(i int) []byte { return fmt.Appendf(nil, "%spod-%05d", fanoutPrefix, i%fanoutKeys) }

func toMs(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func toMiB(n int64) float64 { return float64(n) / (1 << 20) }

// fanoutResult is one side's measurement, averaged over the b.N runs
// (latencies over every delivery of every run).
type fanoutResult struct {
	p50, p99, max, create, cpuPerEvent          time.Duration
	eventsPerSec, writesPerSec, upstream, added float64
	heapWatchersMiB, heapMiB, peakHeapMiB       float64
}

// fanoutRun is one run of the scenario.
type fanoutRun struct {
	create, writing, delivering, cpu  time.Duration
	upstream, added                   float64
	heapWatchers, heapAfter, peakHeap int64
}

func runWatchFanout(b *testing.B, c *cluster, viaProxy bool) *fanoutResult {
	b.StopTimer()
	addr := c.etcdAddr
	if viaProxy {
		addr = c.proxyAddr
	}
	streams := *fanoutStreams
	hists := make([]*latHist, streams)
	for i := range hists {
		hists[i] = newLatHist()
	}
	all := newLatHist()
	var sum fanoutRun
	for range b.N {
		r := watchFanoutOnce(b, c, addr, viaProxy, hists)
		logStreamSpread(b, hists)
		for _, h := range hists {
			all.merge(h)
			h.reset()
		}
		sum.create += r.create
		sum.writing += r.writing
		sum.delivering += r.delivering
		sum.cpu += r.cpu
		sum.upstream += r.upstream
		sum.added += r.added
		sum.heapWatchers += r.heapWatchers
		sum.heapAfter += r.heapAfter
		sum.peakHeap += r.peakHeap
	}
	n := float64(b.N)
	deliveries := float64(*fanoutWatchers) * float64(*fanoutWrites)
	res := &fanoutResult{
		p50:             all.quantile(0.50),
		p99:             all.quantile(0.99),
		max:             time.Duration(all.max),
		create:          sum.create / time.Duration(b.N),
		eventsPerSec:    deliveries * n / sum.delivering.Seconds(),
		writesPerSec:    float64(*fanoutWrites) * n / sum.writing.Seconds(),
		cpuPerEvent:     time.Duration(float64(sum.cpu) / (deliveries * n)),
		upstream:        sum.upstream / n,
		added:           sum.added / n,
		heapWatchersMiB: toMiB(sum.heapWatchers) / n,
		heapMiB:         toMiB(sum.heapAfter) / n,
		peakHeapMiB:     toMiB(sum.peakHeap) / n,
	}
	if want := uint64(deliveries) * uint64(b.N); all.n != want {
		b.Fatalf("recorded %d deliveries, want %d", all.n, want)
	}
	b.ReportMetric(toMs(res.p50), "p50-ms")
	b.ReportMetric(toMs(res.p99), "p99-ms")
	b.ReportMetric(toMs(res.max), "max-ms")
	b.ReportMetric(res.eventsPerSec, "events/s")
	b.ReportMetric(res.writesPerSec, "writes/s")
	b.ReportMetric(res.upstream, "upstream-watchers")
	b.ReportMetric(res.added, "added-watchers")
	b.ReportMetric(res.heapWatchersMiB, "heap-watchers-MiB")
	b.ReportMetric(res.heapMiB, "heap-MiB")
	b.ReportMetric(res.peakHeapMiB, "peak-heap-MiB")
	b.ReportMetric(toMs(res.create), "create-ms")
	b.ReportMetric(float64(res.cpuPerEvent)/float64(time.Microsecond), "cpu-us/event")
	return res
}

// watchFanoutOnce runs the scenario once against addr; only the writes and
// the deliveries are timed.
func watchFanoutOnce(b *testing.B, c *cluster, addr string, viaProxy bool, hists []*latHist) fanoutRun {
	var r fanoutRun
	nStreams, nWatchers, writes := *fanoutStreams, *fanoutWatchers, *fanoutWrites
	// Every watcher must start after the previous run's writes: the proxy
	// creates watchers at its own revision.
	c.waitSynced(b)

	conns, err := dialConns(addr, *fanoutConns)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		for _, conn := range conns {
			conn.Close()
		}
	}()
	pad := make([]byte, fanoutValueSize)
	rand.NewChaCha8([32]byte{1}).Read(pad)

	runtime.GC()
	heap0 := heapAlloc()
	watchers0 := metricSum(b, prometheus.DefaultGatherer, etcdWatcherGauge, nil)
	var proxySent0, proxyCatchups0 float64
	if viaProxy {
		proxySent0 = c.proxyMetric(b, "etcd_snapcache_watch_events_sent_total", nil)
		proxyCatchups0 = c.proxyMetric(b, "etcd_snapcache_watch_catchups_total", nil)
	}

	// Open the streams and create the watchers, kube-apiserver style: the
	// streams require a leader.
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(),
		rpctypes.MetadataRequireLeaderKey, rpctypes.MetadataHasLeader))
	defer cancel()
	errc := make(chan error, 1)
	base := time.Now()
	createStart := time.Now()
	ss := make([]*fanoutStream, nStreams)
	for i := range ss {
		n := nWatchers / nStreams
		if i < nWatchers%nStreams {
			n++
		}
		ss[i], err = startFanoutStream(ctx, conns[i%len(conns)], n, writes, base, hists[i], errc)
		if err != nil {
			b.Fatal(err)
		}
	}
	deadline := time.After(*fanoutTimeout)
	for _, s := range ss {
		select {
		case <-s.created:
		case err := <-errc:
			b.Fatal(err)
		case <-deadline:
			b.Fatalf("watchers not created after %v", *fanoutTimeout)
		}
	}
	r.create = time.Since(createStart)

	watchersOpen := metricSum(b, prometheus.DefaultGatherer, etcdWatcherGauge, nil)
	r.upstream, r.added = watchersOpen, watchersOpen-watchers0
	if viaProxy {
		if got := c.proxyMetric(b, "etcd_snapcache_watchers", nil); got != float64(nWatchers) {
			b.Fatalf("the proxy serves %v watchers, want %d", got, nWatchers)
		}
	}
	runtime.GC()
	r.heapWatchers = heapAlloc() - heap0

	// Sample the heap and etcd's watcher count while the events flow.
	var peakHeap int64
	var maxWatchers float64
	sampleStop := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Go(func() {
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			peakHeap = max(peakHeap, int64(heapObjects()))
			maxWatchers = max(maxWatchers, readEtcdWatchers())
			select {
			case <-sampleStop:
				return
			case <-t.C:
			}
		}
	})

	// The writes: sequential Puts straight to etcd.
	b.StartTimer()
	cpu0, cpuOK0 := processCPU()
	writeStart := time.Now()
	var pace *time.Ticker // writes paced at a fixed rate, if asked
	if iv := *fanoutWriteInterval; iv > 0 {
		pace = time.NewTicker(iv)
		defer pace.Stop()
	}
	for i := range writes {
		if pace != nil && i > 0 {
			<-pace.C
		}
		v := fanoutValue(i, time.Since(base), pad)
		if _, err := c.directKV.Put(context.Background(), &pb.PutRequest{Key: fanoutKey(i), Value: v}); err != nil {
			b.Fatal(err)
		}
		select {
		case err := <-errc:
			b.Fatal(err)
		default:
		}
	}
	r.writing = time.Since(writeStart)
	if *fanoutHeapProfile != "" {
		side := ".etcd"
		if viaProxy {
			side = ".proxy"
		}
		writeHeapProfile(b, *fanoutHeapProfile+side)
	}

	// Wait for every delivery.
	for _, s := range ss {
		select {
		case <-s.done:
		case err := <-errc:
			b.Fatal(err)
		case <-deadline:
			var got int64
			for _, s := range ss {
				got += s.received.Load()
			}
			b.Fatalf("%d of %d events delivered after %v", got, int64(nWatchers)*int64(writes), *fanoutTimeout)
		}
	}
	doneAt := make([]time.Duration, len(ss)) // since the first write
	for i, s := range ss {
		doneAt[i] = time.Duration(s.lastAt.Load()) - writeStart.Sub(base)
	}
	slices.Sort(doneAt)
	r.delivering = doneAt[len(doneAt)-1]
	b.Logf("writes took %v; streams had every event after: first %v, median %v, p90 %v, last %v",
		r.writing.Round(time.Millisecond), doneAt[0].Round(time.Millisecond), doneAt[len(doneAt)/2].Round(time.Millisecond),
		doneAt[len(doneAt)*9/10].Round(time.Millisecond), r.delivering.Round(time.Millisecond))
	b.StopTimer()
	if cpu1, cpuOK1 := processCPU(); cpuOK0 && cpuOK1 {
		r.cpu = cpu1 - cpu0
	}
	close(sampleStop)
	sampler.Wait()

	runtime.GC()
	r.heapAfter = heapAlloc() - heap0
	r.peakHeap = peakHeap - heap0
	// Every event went out, and no watcher cost an upstream watch.
	if maxWatchers != watchersOpen {
		b.Errorf("etcd held %v watchers during the writes, %v before", maxWatchers, watchersOpen)
	}
	if viaProxy {
		if r.added != 0 {
			b.Errorf("the proxy's watchers added %v etcd watchers, want 0", r.added)
		}
		sent := c.proxyMetric(b, "etcd_snapcache_watch_events_sent_total", nil) - proxySent0
		if want := float64(nWatchers) * float64(writes); sent != want {
			b.Errorf("the proxy counted %v events sent, want %v", sent, want)
		}
		if n := c.proxyMetric(b, "etcd_snapcache_watch_catchups_total", nil) - proxyCatchups0; n != 0 {
			b.Errorf("%v watchers were caught up from etcd", n)
		}
	}

	// Close every stream; the next run starts from the same etcd watchers.
	cancel()
	for _, conn := range conns {
		conn.Close()
	}
	testsupport.WaitFor(b, waitTimeout, "etcd's watchers to go back to the baseline", func() bool {
		return metricSum(b, prometheus.DefaultGatherer, etcdWatcherGauge, nil) == watchers0
	})
	if viaProxy {
		testsupport.WaitFor(b, waitTimeout, "the proxy's watchers to close", func() bool {
			return c.proxyMetric(b, "etcd_snapcache_watchers", nil) == 0
		})
	}
	return r
}

func writeHeapProfile(b *testing.B, path string) {
	runtime.GC()
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		b.Fatal(err)
	}
}

// heapAlloc is the process's heap (live right after a GC).
func heapAlloc() int64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// readEtcdWatchers is etcd's mvcc watcher gauge, for goroutines that cannot
// fail the benchmark (-1 if it cannot be read).
func readEtcdWatchers() float64 {
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		return -1
	}
	for _, mf := range mfs {
		if mf.GetName() == etcdWatcherGauge {
			var sum float64
			for _, m := range mf.GetMetric() {
				sum += m.GetGauge().GetValue()
			}
			return sum
		}
	}
	return -1
}

// logStreamSpread logs how the streams' median and maximum latencies are
// spread: a wide spread means some streams were served much later than
// others.
func logStreamSpread(b *testing.B, hists []*latHist) {
	p50s := make([]time.Duration, len(hists))
	maxs := make([]time.Duration, len(hists))
	var conns strings.Builder
	for i, h := range hists {
		p50s[i], maxs[i] = h.quantile(0.5), time.Duration(h.max)
	}
	// Streams are spread round-robin over the connections.
	for conn := range min(*fanoutConns, len(hists)) {
		fmt.Fprintf(&conns, " %d:", conn)
		for i := conn; i < len(hists); i += *fanoutConns {
			fmt.Fprintf(&conns, " %.0f", toMs(p50s[i])/1000)
		}
	}
	slices.Sort(p50s)
	slices.Sort(maxs)
	q := func(ds []time.Duration, f float64) time.Duration {
		return ds[min(int(f*float64(len(ds))), len(ds)-1)].Round(time.Millisecond)
	}
	b.Logf("per-stream p50 latency: min %v, median %v, p90 %v, max %v; per-stream max latency: min %v, median %v, max %v",
		q(p50s, 0), q(p50s, 0.5), q(p50s, 0.9), q(p50s, 1), q(maxs, 0), q(maxs, 0.5), q(maxs, 1))
	b.Logf("per-stream p50 latency in s, by connection:%s", conns.String())
}
