package e2e

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// Flags of BenchmarkPersistOverhead.
var (
	persistRounds    = flag.Int("snapcache.e2e.persist-rounds", 3, "BenchmarkPersistOverhead: measured rounds of each workload (apply: both proxies at once; reads and watch: on,off, off,on, ...)")
	persistKeys      = flag.Int("snapcache.e2e.persist-keys", 10_000, "BenchmarkPersistOverhead: keys (1 KiB) written first; every later put updates one of them at random")
	persistRevs      = flag.Int("snapcache.e2e.persist-revisions", 20_000, "BenchmarkPersistOverhead: revisions an apply round writes (both proxies follow them)")
	persistReads     = flag.Int("snapcache.e2e.persist-reads", 200_000, "BenchmarkPersistOverhead: serializable single-key Gets of a read round")
	persistReaders   = flag.Int("snapcache.e2e.persist-read-clients", 32, "BenchmarkPersistOverhead: concurrent goroutines of a read round")
	persistWriteRate = flag.Int("snapcache.e2e.persist-write-rate", 500, "BenchmarkPersistOverhead: revisions/s written into etcd during the read rounds")
	persistWatchers  = flag.Int("snapcache.e2e.persist-watchers", 100, "BenchmarkPersistOverhead: watchers of the whole prefix in a watch round")
	persistWatchPuts = flag.Int("snapcache.e2e.persist-watch-puts", 5000, "BenchmarkPersistOverhead: revisions a watch round writes, each delivered to every watcher")
)

const (
	persistValue   = 1024 // bytes of every value written
	persistWriters = 16   // concurrent writers of the apply and watch rounds
	// persistRoundTimeout bounds a read round, the waits for the proxies to
	// catch up and the watch rounds' waits (with -snapcache.e2e.watch-timeout).
	persistRoundTimeout = 5 * time.Minute
	// persistPoll is how often an apply round polls on's copy on disk
	// (both proxies' /proxy/metrics each time: a scrape costs a proxy a
	// few ms of CPU, counted in what the round measures).
	persistPoll = 100 * time.Millisecond
)

// persistSide is one of the two proxies, its load connections and what
// its rounds measured.
type persistSide struct {
	name string // "on" (--persist-cache, the default) or "off"
	p    *proxyProcess
	s    *side

	applyCPU, catchUp, rss       []float64 // CPU-s per 1000 revisions; s from the writer's end; bytes
	copyLag                      []float64 // on: s from the writer's end to the copy on disk at etcd's head
	readOps, readCPU, readCached []float64 // ops/s; CPU-s per 10k ops; share of Ranges served from the cache
	writeRate                    []float64 // revisions/s written into etcd during the read rounds
	watchEvs, watchSecs          []float64 // events/s; s from the first put to the last event
	watchTail, watchCPU          []float64 // s from the writer's end to the last event; proxy CPU µs/event
	watchWrite                   []float64 // s the writer took
}

// BenchmarkPersistOverhead: what keeping the cache's copy on disk costs
// the proxy's event apply, reads and watch sends. One etcd, two proxy
// processes following it: "on" with the default flags (--persist-cache,
// --persist-interval=1s) and "off" with --persist-cache=false. The
// workloads, -snapcache.e2e.persist-rounds rounds each:
//
//   - apply: a writer puts -snapcache.e2e.persist-revisions revisions
//     (updates of random keys, 1 KiB, 16 writers) into etcd; both proxies
//     follow the same writes at once. Per proxy: its CPU per 1000
//     revisions (from the writes' start until the caches hold etcd's head
//     and on's copy on disk does: the persister's work on them is
//     counted), the catch-up lag from the writer's end until the proxy
//     has applied etcd's head (a put right after the writer's last reaches
//     the proxy's watcher of it), on's lag until its copy on disk holds
//     it (etcd_snapcache_disk_revision), and each proxy's resident memory.
//   - reads: -snapcache.e2e.persist-reads serializable single-key Gets
//     (served from the cache) by -snapcache.e2e.persist-read-clients
//     goroutines through one proxy at a time, while etcd is written at
//     -snapcache.e2e.persist-write-rate revisions/s (so that on's
//     persister has work every interval): ops/s and the proxy's CPU per
//     10k ops.
//   - watch: -snapcache.e2e.persist-watchers clientv3 watchers of the
//     whole prefix on one proxy at a time, then
//     -snapcache.e2e.persist-watch-puts puts: the time from the first put
//     until every watcher has every event, and events/s.
//
// The read and watch rounds alternate on,off, off,on, ...; each reports
// the medians per proxy and the ratio on/off. Then on's writes of its copy
// during the run (etcd_snapcache_disk_writes_total,
// etcd_snapcache_disk_write_seconds), and etcd_snapcache_disk_write_failing
// must be 0.
func BenchmarkPersistOverhead(b *testing.B) {
	if *persistRounds < 1 || *persistKeys < 1 || *persistRevs < 1 || *persistReads < 1 ||
		*persistReaders < 1 || *persistWriteRate < 1 || *persistWatchers < 1 || *persistWatchPuts < 1 {
		b.Fatal("the -snapcache.e2e.persist-* flags must be positive")
	}
	start := time.Now()
	env := newPairEnv(b) // etcd, and "on" in front of it
	user, password := "", ""
	if env.auth {
		user, password = benchUser, benchPassword
	}
	// Both proxies start before any data is written, so that both hold
	// the same history; "off" with "on"'s flags (auth, mTLS, pprof) but
	// its copy on disk.
	offP := env.startProxy(b, "--persist-cache=false")
	on := &persistSide{name: "on", p: env.proxy, s: env.proxyS}
	off := &persistSide{name: "off", p: offP, s: env.newSide(b, "off", offP.endpoint, user, password)}
	sides := []*persistSide{on, off}

	ks := keyspace{n: *persistKeys}
	keys := make([][]byte, ks.n)
	for i := range keys {
		keys[i] = ks.key(i)
	}
	w := newWriter(env.loader, persistValue, persistWriters)
	head := w.put(b, ks.n, ks.key)
	waitFollowed(b, sides, head)
	if n := off.p.metrics(b).sum("etcd_snapcache_disk_revision"); n != 0 {
		b.Fatalf("the proxy with --persist-cache=false has a copy on disk (etcd_snapcache_disk_revision %v)", n)
	}
	disk0 := on.p.metrics(b)
	b.Logf("setup: %d keys x %d B, both proxies at revision %d, on's copy on disk too; took %v",
		ks.n, persistValue, head, time.Since(start).Round(time.Millisecond))

	b.ResetTimer()
	runStart := time.Now()
	seed := uint64(1)
	for range *persistRounds {
		seed++
		applyRound(b, env, w, ks.random(seed), on, off)
	}
	// Reads: a warm-up round on each, not reported.
	for _, s := range sides {
		seed++
		readRound(b, w, ks, keys, s, seed, max(*persistReads/10, 1), false)
	}
	for i := range *persistRounds {
		for _, s := range alternate(i, on, off) {
			seed++
			readRound(b, w, ks, keys, s, seed, *persistReads, true)
		}
	}
	for i := range *persistRounds {
		for _, s := range alternate(i, on, off) {
			seed++
			persistWatchRound(b, env, w, ks.random(seed), s)
		}
	}
	final := env.head(b)
	waitFollowed(b, sides, final)
	runSecs := time.Since(runStart).Seconds()
	disk1 := on.p.metrics(b)
	b.StopTimer()

	if f := disk1.sum("etcd_snapcache_disk_write_failing"); f != 0 {
		b.Fatalf("etcd_snapcache_disk_write_failing is %v on the proxy with --persist-cache", f)
	}
	if n := off.p.metrics(b).sum("etcd_snapcache_disk_writes_total"); n != 0 {
		b.Fatalf("the proxy with --persist-cache=false wrote a copy on disk %v times", n)
	}
	reportPersist(b, env, on, off, disk0, disk1, runSecs, final)
}

// alternate is round i's order: on,off, off,on, ... so that neither
// always goes first.
func alternate(i int, on, off *persistSide) []*persistSide {
	if i%2 == 0 {
		return []*persistSide{on, off}
	}
	return []*persistSide{off, on}
}

// waitFollowed waits until every side's cache holds rev and on's copy on
// disk does too.
func waitFollowed(b *testing.B, sides []*persistSide, rev int64) {
	b.Helper()
	for _, s := range sides {
		testsupport.Poll(b, persistRoundTimeout, 20*time.Millisecond, fmt.Sprintf("the %s proxy's cache to reach revision %d", s.name, rev), func() (bool, error) {
			if err := s.p.alive(); err != nil {
				b.Fatal(err)
			}
			at := s.p.status(b).Revision
			return at >= rev, fmt.Errorf("at revision %d", at)
		})
		if s.name == "on" {
			s.p.waitCopied(b, rev)
		}
	}
}

// persistSentinel is put right after an apply round's writer ends; each
// proxy's watch of it tells when that proxy has applied every revision
// before it. Under benchPerm, outside the prefix the watch rounds watch.
const persistSentinel = "/registry/bench/persist-sentinel"

// applyRound writes -snapcache.e2e.persist-revisions revisions into etcd
// and measures both proxies following them: each one's CPU from the
// writes' start until both have applied them and on's copy on disk holds
// them, and each one's catch-up lag: from the writer's end until the
// sentinel put right after it reaches the proxy's watcher of it (event
// driven: a scrape of /proxy/metrics costs the proxy milliseconds of CPU,
// which polling its revision would add to what is measured). The copy's
// revision is polled every persistPoll, both proxies scraped alike.
func applyRound(b *testing.B, env *pairEnv, w *writer, keyOf func(int) []byte, on, off *persistSide) {
	b.Helper()
	sides := [2]*persistSide{on, off}
	before := env.head(b)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	type arrival struct {
		at  time.Time
		err error
	}
	var arrived [2]chan arrival
	for i, s := range sides {
		wch := s.s.clis[0].Watch(ctx, persistSentinel, clientv3.WithRev(before+1), clientv3.WithCreatedNotify())
		select {
		case resp, ok := <-wch:
			if !ok || !resp.Created {
				b.Fatalf("apply: watching the sentinel on %s: %v", s.name, resp.Err())
			}
		case <-time.After(startTimeout):
			b.Fatalf("apply: the sentinel's watcher on %s not created after %v", s.name, startTimeout)
		}
		arrived[i] = make(chan arrival, 1)
		wg.Go(func() {
			sent := false
			for resp := range wch { // until cancel
				if sent || ctx.Err() != nil {
					continue
				}
				if err := resp.Err(); err != nil {
					arrived[i] <- arrival{err: err}
					sent = true
				} else if len(resp.Events) > 0 {
					arrived[i] <- arrival{at: time.Now()}
					sent = true
				}
			}
		})
	}

	var cpu0 [2]time.Duration
	for i, s := range sides {
		cpu0[i] = processCPU(b, s.p.pid())
	}
	head := w.put(b, *persistRevs, keyOf)
	wrote := time.Now()
	resp, err := env.loader.Put(ctx, persistSentinel, "x")
	if err != nil {
		b.Fatalf("apply: putting the sentinel: %v", err)
	}
	last := resp.Header.Revision
	if head != before+int64(*persistRevs) || last != head+1 {
		b.Fatalf("apply: %d puts from revision %d to %d, the sentinel at %d: something else wrote", *persistRevs, before, head, last)
	}
	var caught [2]time.Duration
	for i, s := range sides {
		select {
		case a := <-arrived[i]:
			if a.err != nil {
				b.Fatalf("apply: the sentinel's watcher on %s: %v", s.name, a.err)
			}
			caught[i] = a.at.Sub(wrote)
		case <-time.After(persistRoundTimeout):
			b.Fatalf("apply: %s has not applied revision %d after %v", s.name, last, persistRoundTimeout)
		}
	}
	var copied time.Duration
	tick := 0
	testsupport.Poll(b, persistRoundTimeout, persistPoll, fmt.Sprintf("on's copy on disk to reach revision %d", last), func() (bool, error) {
		tick++
		at := int64(0)
		for j := range sides {
			s := sides[(j+tick)%2] // neither always first
			if err := s.p.alive(); err != nil {
				b.Fatal(err)
			}
			if ms := s.p.metrics(b); s == on {
				at = int64(ms.sum("etcd_snapcache_disk_revision"))
			}
		}
		copied = time.Since(wrote)
		return at >= last, fmt.Errorf("at revision %d", at)
	})
	for i, s := range sides {
		cpu := processCPU(b, s.p.pid()) - cpu0[i]
		s.applyCPU = append(s.applyCPU, cpu.Seconds()/(float64(*persistRevs)/1000))
		s.catchUp = append(s.catchUp, caught[i].Seconds())
		rss, _ := memOf(s.p.cmd.Process.Pid)
		s.rss = append(s.rss, float64(rss))
	}
	on.copyLag = append(on.copyLag, copied.Seconds())
}

// trickle writes into etcd at a fixed rate on a goroutine of its own, until
// stopped or for at most its limit.
type trickle struct {
	stop, done chan struct{}
	begin      time.Time
	written    atomic.Int64
	err        error // set before done is closed
}

const trickleTick = 20 * time.Millisecond

// startTrickle writes rate revisions/s with w, of keys keyOf picks, for at
// most limit: every trickleTick, the puts due since the last (at most four
// ticks' worth, so that a stall is not followed by a burst), concurrently.
func startTrickle(w *writer, rate int, keyOf func(int) []byte, limit time.Duration) *trickle {
	t := &trickle{stop: make(chan struct{}), done: make(chan struct{}), begin: time.Now()}
	batch := max(rate*int(trickleTick)/int(time.Second), 1)
	go func() {
		defer close(t.done)
		ticker := time.NewTicker(trickleTick)
		defer ticker.Stop()
		deadline := time.NewTimer(limit)
		defer deadline.Stop()
		for {
			select {
			case <-t.stop:
				return
			case <-deadline.C:
				t.err = fmt.Errorf("still writing after %v", limit)
				return
			case <-ticker.C:
			}
			due := int64(time.Since(t.begin).Seconds()*float64(rate)) - t.written.Load()
			n := int(min(due, int64(4*batch)))
			if n <= 0 {
				continue
			}
			if _, err := servertest.PutConcurrently(w.kv, n, batch, func(i int) *pb.PutRequest {
				return &pb.PutRequest{Key: keyOf(i), Value: w.value}
			}); err != nil {
				t.err = err
				return
			}
			t.written.Add(int64(n))
		}
	}()
	return t
}

// end stops the trickle and returns the rate it wrote at.
func (t *trickle) end(tb testing.TB) float64 {
	tb.Helper()
	close(t.stop)
	<-t.done
	if t.err != nil {
		tb.Fatalf("writing in the background: %v", t.err)
	}
	return float64(t.written.Load()) / time.Since(t.begin).Seconds()
}

// readRound runs n serializable single-key Gets of random keys through s,
// from -snapcache.e2e.persist-read-clients goroutines over its
// connections, while etcd is written at -snapcache.e2e.persist-write-rate;
// measured unless it is a warm-up.
func readRound(b *testing.B, w *writer, ks keyspace, keys [][]byte, s *persistSide, seed uint64, n int, measured bool) {
	b.Helper()
	tr := startTrickle(w, *persistWriteRate, ks.random(seed<<32), persistRoundTimeout+time.Minute)
	stopped := false
	defer func() {
		if !stopped {
			close(tr.stop)
			<-tr.done
		}
	}()
	st0 := s.p.status(b)
	cpu0 := processCPU(b, s.p.pid())
	begin := time.Now()

	ctx, cancel := context.WithTimeout(context.Background(), persistRoundTimeout)
	defer cancel()
	var next atomic.Int64
	var failed atomic.Bool
	var errOnce sync.Once
	var firstErr error
	var wg sync.WaitGroup
	for g := range *persistReaders {
		kv := s.s.kvs[g%len(s.s.kvs)]
		rng := rand.New(rand.NewPCG(seed, uint64(g)))
		wg.Go(func() {
			for !failed.Load() && next.Add(1) <= int64(n) {
				resp, err := kv.Range(ctx, &pb.RangeRequest{Key: keys[rng.IntN(len(keys))], Serializable: true})
				if err == nil && len(resp.Kvs) != 1 {
					err = fmt.Errorf("got %d keys, want 1", len(resp.Kvs))
				}
				if err != nil {
					errOnce.Do(func() { firstErr = err })
					failed.Store(true)
					return
				}
			}
		})
	}
	wg.Wait()
	secs := time.Since(begin).Seconds()
	cpu := processCPU(b, s.p.pid()) - cpu0
	st1 := s.p.status(b)
	stopped = true
	rate := tr.end(b)
	if firstErr != nil {
		b.Fatalf("reads through %s: %v", s.name, firstErr)
	}
	if !measured {
		return
	}
	cached := float64(st1.Requests(proxystatus.SourceCache) - st0.Requests(proxystatus.SourceCache))
	forwarded := float64(st1.Requests(proxystatus.SourceForwarded) - st0.Requests(proxystatus.SourceForwarded))
	s.readOps = append(s.readOps, float64(n)/secs)
	s.readCPU = append(s.readCPU, cpu.Seconds()/(float64(n)/10_000))
	s.readCached = append(s.readCached, cached/max(cached+forwarded, 1))
	s.writeRate = append(s.writeRate, rate)
}

// persistWatchRound opens -snapcache.e2e.persist-watchers watchers of the
// whole prefix on s (spread over its connections), from etcd's next
// revision, then writes -snapcache.e2e.persist-watch-puts revisions into
// etcd and waits until every watcher has received every one of them.
func persistWatchRound(b *testing.B, env *pairEnv, w *writer, keyOf func(int) []byte, s *persistSide) {
	b.Helper()
	nw, np := *persistWatchers, *persistWatchPuts
	from := env.head(b)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	var (
		base     = time.Now()
		created  atomic.Int64
		allIn    = make(chan struct{}) // every watcher created
		complete atomic.Int64
		allDone  = make(chan struct{}) // every watcher has every event
		lastRecv atomic.Int64          // ns since base
	)
	first := &firstError{cancel: cancel}
	fail, errOf := first.fail, first.get
	for i := range nw {
		wch := s.s.clis[i%len(s.s.clis)].Watch(ctx, rangePrefix, clientv3.WithPrefix(), clientv3.WithRev(from+1), clientv3.WithCreatedNotify())
		wg.Go(func() {
			got, last := 0, from
			for resp := range wch {
				if ctx.Err() != nil {
					continue // drained until clientv3 closes the channel
				}
				if err := resp.Err(); err != nil {
					fail(fmt.Errorf("watcher %d: %w", i, err))
					continue
				}
				if resp.Created && created.Add(1) == int64(nw) {
					close(allIn)
				}
				for _, ev := range resp.Events {
					if rev := ev.Kv.ModRevision; rev <= last || rev > from+int64(np) {
						fail(fmt.Errorf("watcher %d: an event at revision %d after %d, want (%d, %d]", i, rev, last, from, from+int64(np)))
						break
					}
					last = ev.Kv.ModRevision
				}
				if k := len(resp.Events); k > 0 {
					got += k
					lastRecv.Store(int64(time.Since(base)))
					if got == np && complete.Add(1) == int64(nw) {
						close(allDone)
					}
				}
			}
		})
	}
	select {
	case <-allIn:
	case <-ctx.Done():
		b.Fatalf("watch on %s: %d of %d watchers created: %v", s.name, created.Load(), nw, errOf())
	case <-time.After(*watchTimeout):
		b.Fatalf("watch on %s: %d of %d watchers created after %v", s.name, created.Load(), nw, *watchTimeout)
	}

	cpu0 := processCPU(b, s.p.pid())
	begin := time.Since(base)
	head := w.put(b, np, keyOf)
	wrote := time.Since(base)
	if head != from+int64(np) {
		b.Fatalf("watch: etcd at revision %d after %d puts from %d: something else wrote", head, np, from)
	}
	select {
	case <-allDone:
	case <-ctx.Done():
		b.Fatalf("watch on %s: %d of %d watchers have every event: %v", s.name, complete.Load(), nw, errOf())
	case <-time.After(*watchTimeout):
		b.Fatalf("watch on %s: %d of %d watchers have every event after %v", s.name, complete.Load(), nw, *watchTimeout)
	}
	cpu := processCPU(b, s.p.pid()) - cpu0
	last := time.Duration(lastRecv.Load())
	cancel()
	wg.Wait()
	if err := errOf(); err != nil {
		b.Fatalf("watch on %s: %v", s.name, err)
	}
	events := float64(nw) * float64(np)
	secs := (last - begin).Seconds()
	s.watchEvs = append(s.watchEvs, events/secs)
	s.watchSecs = append(s.watchSecs, secs)
	// The last event may arrive before the last put's response does.
	s.watchTail = append(s.watchTail, max(last-wrote, 0).Seconds())
	s.watchWrite = append(s.watchWrite, (wrote - begin).Seconds())
	s.watchCPU = append(s.watchCPU, float64(cpu)/float64(time.Microsecond)/events)
}

// pairRatios is on[i]/off[i] for each round.
func pairRatios(on, off []float64) []float64 {
	r := make([]float64, len(on))
	for i := range on {
		r[i] = on[i] / off[i]
	}
	return r
}

// reportPersist reports both proxies' medians as metrics and prints a
// SUMMARY line per workload, and one of on's writes of its copy.
func reportPersist(b *testing.B, env *pairEnv, on, off *persistSide, disk0, disk1 metricSet, runSecs float64, final int64) {
	b.Helper()
	md := median
	ms := func(v []float64) []float64 {
		out := make([]float64, len(v))
		for i, x := range v {
			out[i] = x * 1000
		}
		return out
	}
	applyRatio := md(on.applyCPU) / md(off.applyCPU)
	readRatio := md(on.readOps) / md(off.readOps)
	readCPURatio := md(on.readCPU) / md(off.readCPU)
	watchRatio := md(on.watchEvs) / md(off.watchEvs)
	delta := func(name string, labels ...string) float64 {
		return disk1.sum(name, labels...) - disk0.sum(name, labels...)
	}
	writes := delta("etcd_snapcache_disk_writes_total")
	writeErrs := delta("etcd_snapcache_disk_writes_total", `result="error"`)
	rewrites := delta("etcd_snapcache_disk_writes_total", `kind="rewrite"`)
	writeCount := delta("etcd_snapcache_disk_write_seconds_count")
	meanWrite := 0.0
	if writeCount > 0 {
		meanWrite = delta("etcd_snapcache_disk_write_seconds_sum") / writeCount
	}
	if writes == 0 {
		b.Fatalf("the proxy with --persist-cache wrote no copy during the run")
	}

	b.ReportMetric(0, "ns/op") // fixed rounds, not b.N ops
	for _, s := range []*persistSide{on, off} {
		b.ReportMetric(md(s.applyCPU), s.name+"-apply-cpu-s/1k-rev")
		b.ReportMetric(md(s.catchUp)*1000, s.name+"-catchup-ms")
		b.ReportMetric(md(s.rss)/mib, s.name+"-rss-MiB")
		b.ReportMetric(md(s.readOps), s.name+"-reads/s")
		b.ReportMetric(md(s.readCPU), s.name+"-read-cpu-s/10k")
		b.ReportMetric(md(s.watchEvs), s.name+"-events/s")
		b.ReportMetric(md(s.watchSecs), s.name+"-watch-s")
	}
	b.ReportMetric(md(on.copyLag)*1000, "on-copy-lag-ms")
	b.ReportMetric(applyRatio, "apply-cpu-on/off")
	b.ReportMetric(readRatio, "reads-on/off")
	b.ReportMetric(watchRatio, "events-on/off")
	b.ReportMetric(meanWrite*1000, "disk-write-ms")
	b.ReportMetric(writes, "disk-writes")

	auth := ""
	if env.auth {
		auth = " (auth on)"
	}
	name := env.summaryName(b) + auth
	fmt.Printf("SUMMARY %s apply: on/off cpu %.2fx (per round %s), catch-up lag on %.1f ms off %.1f ms; on: %.3f cpu-s/1k rev (rounds %s), catch-up %.1f ms (rounds %s), copy on disk %.0f ms after the writer (rounds %s), rss %.0f MiB; off: %.3f cpu-s/1k rev (rounds %s), catch-up %.1f ms (rounds %s), rss %.0f MiB  [%d rounds of %d revisions x %d B, %d writers; medians]\n",
		name, applyRatio, fmtList(pairRatios(on.applyCPU, off.applyCPU), "%.2f"), md(on.catchUp)*1000, md(off.catchUp)*1000,
		md(on.applyCPU), fmtList(on.applyCPU, "%.3f"), md(on.catchUp)*1000, fmtList(ms(on.catchUp), "%.1f"),
		md(on.copyLag)*1000, fmtList(ms(on.copyLag), "%.0f"), md(on.rss)/mib,
		md(off.applyCPU), fmtList(off.applyCPU, "%.3f"), md(off.catchUp)*1000, fmtList(ms(off.catchUp), "%.1f"), md(off.rss)/mib,
		len(on.applyCPU), *persistRevs, persistValue, persistWriters)
	fmt.Printf("SUMMARY %s reads: on/off %.2fx ops/s (per round %s), cpu/op %.2fx; on: %.0f ops/s (rounds %s), %.3f cpu-s/10k ops, cache %.1f%%; off: %.0f ops/s (rounds %s), %.3f cpu-s/10k ops, cache %.1f%%  [%d serializable Gets by %d clients per round, etcd written at %.0f rev/s meanwhile; medians]\n",
		name, readRatio, fmtList(pairRatios(on.readOps, off.readOps), "%.2f"), readCPURatio,
		md(on.readOps), fmtList(on.readOps, "%.0f"), md(on.readCPU), 100*md(on.readCached),
		md(off.readOps), fmtList(off.readOps, "%.0f"), md(off.readCPU), 100*md(off.readCached),
		*persistReads, *persistReaders, md(append(append([]float64(nil), on.writeRate...), off.writeRate...)))
	fmt.Printf("SUMMARY %s watch: on/off %.2fx events/s (per round %s); on: %.0f events/s (rounds %s), all in %.2f s (writer %.2f s, last event %.0f ms after it), proxy cpu %.2f µs/event; off: %.0f events/s (rounds %s), all in %.2f s (writer %.2f s, last event %.0f ms after it), proxy cpu %.2f µs/event  [%d watchers x %d revisions x %d B; medians]\n",
		name, watchRatio, fmtList(pairRatios(on.watchEvs, off.watchEvs), "%.2f"),
		md(on.watchEvs), fmtList(on.watchEvs, "%.0f"), md(on.watchSecs), md(on.watchWrite), md(on.watchTail)*1000, md(on.watchCPU),
		md(off.watchEvs), fmtList(off.watchEvs, "%.0f"), md(off.watchSecs), md(off.watchWrite), md(off.watchTail)*1000, md(off.watchCPU),
		*persistWatchers, *persistWatchPuts, persistValue)
	fmt.Printf("SUMMARY %s disk: on's copy written %.0f times in %.0f s (%.0f rewrites, %.0f errors), mean %.1f ms per write (fsync included), write_failing %.0f, %.1f MiB at revision %.0f (etcd at %d)\n",
		name, writes, runSecs, rewrites, writeErrs, meanWrite*1000, disk1.sum("etcd_snapcache_disk_write_failing"),
		disk1.sum("etcd_snapcache_disk_bytes")/mib, disk1.sum("etcd_snapcache_disk_revision"), final)
}
