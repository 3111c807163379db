package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
)

// cpPhase is one phase of one side's pass, and what was measured in it.
type cpPhase struct {
	side, name string
	start      time.Time
	secs       float64
	ready      time.Duration // until every kube-apiserver was ready
	caughtUp   time.Duration // until every informer had synced or caught up
	notes      []string

	etcdCPU0, proxyCPU0 time.Duration
	loadCPU0            time.Duration
	memberCPU0          []time.Duration
	etcdReqs0           map[string]float64
	cached0, forwarded0 float64

	etcdCPU, proxyCPU     time.Duration
	kubeCPU, loadCPU      time.Duration // every kube-apiserver's; the load generator's
	etcdRSS, etcdPeak     int64
	proxyRSS, proxyPeak   int64
	watchers, watchersMax float64
	etcdReqs              map[string]float64 // gRPC method → requests etcd handled
	cached, forwarded     float64            // the proxy's Ranges from its cache, and forwarded
	kube                  counters           // every kube-apiserver's request counters
	load                  loadReport
	logs                  logCounts
	memberCPU             []time.Duration // etcdCPU by member

	// A maintenance phase's (maint): what the fault did and how long it
	// took; on the proxy side, how long a proxy was not ready, and its
	// upstream's counters (proxyCounters).
	maint         bool
	faultDesc     string
	fault         time.Duration
	proxyNotReady time.Duration
	proxyEvents   counters
}

func (p *cpPhase) note(s string) { p.notes = append(p.notes, s) }

// begin starts measuring a phase.
func (cp *controlPlane) begin(b *testing.B, side, name string) *cpPhase {
	b.Helper()
	ph := &cpPhase{side: side, name: name}
	for _, k := range cp.kubes {
		k.acc, k.base, k.logs, k.cpuAcc, k.cpuBase = nil, nil, nil, 0, 0
		if k.proc != nil && k.proc.alive() == nil {
			k.logs = []*logCursor{k.cursor}
			k.cpuBase = k.cpu()
			m, err := k.scrape()
			if err != nil {
				b.Fatalf("kube-apiserver %d: %v", k.idx, err)
			}
			k.base = m
		}
	}
	for _, pid := range cp.etcd.pids() {
		clearPeak(pid)
	}
	for _, p := range cp.proxies {
		clearPeak(p.cmd.Process.Pid)
	}
	cp.sampler.reset()
	ph.memberCPU0 = cp.etcd.memberCPU()
	ph.etcdCPU0, ph.proxyCPU0 = sumDurations(ph.memberCPU0), cp.proxiesCPU(b)
	if cp.load != nil {
		ph.loadCPU0, _ = cpuOf(cp.load.cmd.Process.Pid)
	}
	ph.etcdReqs0 = cp.etcd.reqs(b)
	ph.cached0, ph.forwarded0 = cp.proxiesRanges(b)
	ph.start = time.Now()
	progress("%s %s: begins", side, name)
	return ph
}

// end ends a phase: what the load, etcd, the proxy and the kube-apiservers
// did in it.
func (cp *controlPlane) end(b *testing.B, ph *cpPhase, load *kubeload) cpPhase {
	b.Helper()
	if r := load.do(b, "report"); r.Report != nil {
		ph.load = *r.Report
	}
	ph.secs = time.Since(ph.start).Seconds()
	for i, d := range cp.etcd.memberCPU() {
		ph.memberCPU = append(ph.memberCPU, d-ph.memberCPU0[i])
	}
	ph.etcdCPU = sumDurations(ph.memberCPU)
	ph.proxyCPU = cp.proxiesCPU(b) - ph.proxyCPU0
	if d, err := cpuOf(load.cmd.Process.Pid); err == nil {
		ph.loadCPU = d - ph.loadCPU0
	}
	ph.etcdReqs = cp.etcd.reqs(b)
	for m, v := range ph.etcdReqs0 {
		ph.etcdReqs[m] -= v
	}
	ph.watchers = cp.etcd.metrics(b).sum("etcd_debugging_mvcc_watcher_total")
	cached, forwarded := cp.proxiesRanges(b)
	ph.cached, ph.forwarded = cached-ph.cached0, forwarded-ph.forwarded0
	etcdMax, proxyMax, watchersMax := cp.sampler.take()
	ph.watchersMax = max(watchersMax, ph.watchers)
	ph.etcdRSS, ph.etcdPeak = cp.etcd.mem()
	for _, p := range cp.proxies {
		rss, peak := memOf(p.cmd.Process.Pid)
		ph.proxyRSS += rss
		ph.proxyPeak += peak
	}
	ph.etcdPeak, ph.proxyPeak = max(ph.etcdPeak, etcdMax), max(ph.proxyPeak, proxyMax)
	for _, k := range cp.kubes {
		m, err := k.scrape()
		if err != nil {
			b.Fatalf("kube-apiserver %d: %v", k.idx, err)
		}
		k.acc.add(m, 1)
		k.acc.add(k.base, -1)
		k.base = m
		ph.kube.add(k.acc, 1)
		ph.kubeCPU += k.cpuAcc + k.cpu() - k.cpuBase
		for _, c := range k.logs {
			c.scan(&ph.logs)
		}
	}
	progress("%s %s: %.1fs, etcd cpu %.2f s/s, peak rss %.0f MiB, watchers %.0f; informer delay p99 %.0f ms; kube-apiserver log errors %d relists %d",
		ph.side, ph.name, ph.secs, ph.etcdCPU.Seconds()/ph.secs, inMiB(ph.etcdPeak), ph.watchers, ph.load.Delay.P99, ph.logs.errors, ph.logs.relists)
	return *ph
}

func sumDurations(ds []time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return sum
}

// proxiesCPU is the CPU time every proxy has used.
func (cp *controlPlane) proxiesCPU(b *testing.B) time.Duration {
	var d time.Duration
	for _, p := range cp.proxies {
		d += processCPU(b, p.pid())
	}
	return d
}

// proxiesRanges is the Ranges the kube-apiservers' proxies answered from
// their caches and forwarded, so far.
func (cp *controlPlane) proxiesRanges(b *testing.B) (cached, forwarded float64) {
	for _, p := range cp.fronts() {
		c, f := p.ranges(b)
		cached += c
		forwarded += f
	}
	return cached, forwarded
}

// ranges is the Ranges the proxy process answered from its cache and
// forwarded since it started.
func (p *proxyProcess) ranges(b *testing.B) (cached, forwarded float64) {
	st := p.status(b)
	return float64(st.Requests(proxystatus.SourceCache)), float64(st.Requests(proxystatus.SourceForwarded))
}

// counters is a set of counters by key, that phases add and subtract.
type counters map[string]float64

func (c *counters) add(o counters, f float64) {
	if *c == nil {
		*c = counters{}
	}
	for k, v := range o {
		(*c)[k] += f * v
	}
}

// Keys of a kube-apiserver's counters.
const (
	keyBucket = "bucket\x00" // + verb + "\x00" + le: apiserver_request_duration_seconds_bucket
	keyCode   = "code\x00"   // + code: apiserver_request_total
	keyVerb   = "verb\x00"   // + verb: apiserver_request_total
	keyErr    = "err\x00"    // + verb + "\x00" + code: apiserver_request_total answered 5xx or 429
)

// scrape reads a kube-apiserver's request counters from its /metrics: its
// API requests' (those of a resource).
func (k *cpKube) scrape() (counters, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	body, err := k.get(ctx, "/metrics")
	if err != nil {
		return nil, err
	}
	c := counters{}
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		c.addRequestSample(sc.Text())
	}
	return c, sc.Err()
}

// addRequestSample adds a line of kube-apiserver's /metrics to c if it is
// a sample of an API request's counters (those of a resource): its
// latency buckets by verb, its answers by code and by verb, and the 5xx
// and 429 answers by verb and code.
func (c counters) addRequestSample(line string) {
	var name string
	switch {
	case strings.HasPrefix(line, "apiserver_request_duration_seconds_bucket{"):
		name = "bucket"
	case strings.HasPrefix(line, "apiserver_request_total{"):
		name = "total"
	default:
		return
	}
	lbls, v, ok := parseSample(line)
	if !ok || lbls["resource"] == "" {
		return // not an API request: /readyz, /metrics, ...
	}
	if name == "bucket" {
		c[keyBucket+lbls["verb"]+"\x00"+lbls["le"]] += v
		return
	}
	c[keyCode+lbls["code"]] += v
	c[keyVerb+lbls["verb"]] += v
	if code := lbls["code"]; strings.HasPrefix(code, "5") || code == "429" {
		c[keyErr+lbls["verb"]+"\x00"+code] += v
	}
}

// parseSample parses a Prometheus text sample line: its labels and value.
func parseSample(line string) (map[string]string, float64, bool) {
	open := strings.IndexByte(line, '{')
	end := strings.LastIndexByte(line, '}')
	if open < 0 || end < open {
		return nil, 0, false
	}
	lbls := map[string]string{}
	s := line[open+1 : end]
	for s != "" {
		eq := strings.IndexByte(s, '=')
		if eq < 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			return nil, 0, false
		}
		key := strings.TrimLeft(s[:eq], ", ")
		var val strings.Builder
		i := eq + 2
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
			}
			val.WriteByte(s[i])
		}
		lbls[key] = val.String()
		s = strings.TrimLeft(s[min(i+1, len(s)):], ",")
	}
	f := strings.Fields(line[end+1:])
	if len(f) == 0 {
		return nil, 0, false
	}
	v, err := strconv.ParseFloat(f[0], 64)
	return lbls, v, err == nil
}

// byLabel sums metric name's samples by the value of label.
func byLabel(ms metricSet, name, label string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range ms {
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		if lbls, v, ok := parseSample(line); ok {
			out[lbls[label]] += v
		}
	}
	return out
}

// verbQuantile is quantile q of verb's request durations in c, in
// milliseconds, interpolated within its bucket as Prometheus'
// histogram_quantile does; NaN without requests.
func (c counters) verbQuantile(verb string, q float64) float64 {
	type bucket struct{ le, n float64 }
	var bs []bucket
	prefix := keyBucket + verb + "\x00"
	for k, v := range c {
		if le, ok := strings.CutPrefix(k, prefix); ok {
			f, err := strconv.ParseFloat(le, 64)
			if err == nil {
				bs = append(bs, bucket{f, v})
			}
		}
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].le < bs[j].le })
	if len(bs) == 0 || bs[len(bs)-1].n <= 0 {
		return math.NaN()
	}
	rank := q * bs[len(bs)-1].n
	lo, below := 0.0, 0.0
	for _, b := range bs {
		if b.n >= rank {
			if math.IsInf(b.le, 1) {
				return lo * 1000
			}
			if b.n == below {
				return b.le * 1000
			}
			return (lo + (b.le-lo)*(rank-below)/(b.n-below)) * 1000
		}
		lo, below = b.le, b.n
	}
	return lo * 1000
}

// verbs are the verbs of c's requests but the long-running ones, in a
// fixed order.
func (c counters) verbs() []string {
	order := []string{"GET", "LIST", "POST", "PUT", "PATCH", "DELETE"}
	var out []string
	for _, v := range order {
		if c[keyVerb+v] > 0 {
			out = append(out, v)
		}
	}
	var rest []string
	for k, n := range c {
		if v, ok := strings.CutPrefix(k, keyVerb); ok && n > 0 && !slices.Contains(order, v) && v != "WATCH" && v != "WATCHLIST" && v != "CONNECT" {
			rest = append(rest, v)
		}
	}
	slices.Sort(rest)
	return append(out, rest...)
}

// codes counts c's requests answered 5xx and 429.
func (c counters) codes() (fivexx, tooMany float64) {
	for k, n := range c {
		if code, ok := strings.CutPrefix(k, keyCode); ok {
			if strings.HasPrefix(code, "5") {
				fivexx += n
			} else if code == "429" {
				tooMany += n
			}
		}
	}
	return
}

// errorsByVerb is c's requests answered 5xx or 429 by verb and code
// ("GET 504x2 LIST 429x1"; 504 is kube-apiserver's timeout), or "-".
func (c counters) errorsByVerb() string {
	var keys []string
	for k, n := range c {
		if _, ok := strings.CutPrefix(k, keyErr); ok && n > 0 {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var parts []string
	last := ""
	for _, k := range keys {
		verb, code, _ := strings.Cut(strings.TrimPrefix(k, keyErr), "\x00")
		if verb != last {
			parts = append(parts, verb)
			last = verb
		}
		parts = append(parts, fmt.Sprintf("%sx%.0f", code, c[k]))
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " ")
}

// sampler samples etcd's and the proxy's resident memory (every 250 ms) and
// etcd's watchers (every 2 s) for the phases' maxima.
type sampler struct {
	mu                sync.Mutex
	etcdPids          []int // every member's
	proxyPids         []int
	etcdMax, proxyMax int64
	watchersMax       float64
	metricsURLs       []string // every member's /metrics
	readyURLs         []string // the /readyz polled, if any (pollReady)
	notReady          time.Duration
}

func startSampler(b *testing.B, cp *controlPlane) *sampler {
	s := &sampler{etcdPids: cp.etcd.pids()}
	for _, m := range cp.etcd.members {
		s.metricsURLs = append(s.metricsURLs, m.metricsURL+"/metrics")
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		last := time.Now()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			now := time.Now()
			since := now.Sub(last)
			last = now
			s.mu.Lock()
			eps, pps, readys := s.etcdPids, s.proxyPids, s.readyURLs
			s.mu.Unlock()
			e := int64(0) // every member's
			for _, ep := range eps {
				r, _ := memOf(ep)
				e += r
			}
			ready := true
			for _, u := range readys {
				if _, err := getURL(samplerHTTP, u); err != nil {
					ready = false
				}
			}
			p := int64(0) // every proxy's
			for _, pp := range pps {
				r, _ := memOf(pp)
				p += r
			}
			w := -1.0
			if i%8 == 0 {
				w = 0
				for _, u := range s.metricsURLs {
					body, err := getURL(samplerHTTP, u)
					if err != nil {
						w = -1 // a member stopped, say: no sum this time
						break
					}
					for line := range strings.SplitSeq(string(body), "\n") {
						if rest, ok := strings.CutPrefix(line, "etcd_debugging_mvcc_watcher_total "); ok {
							n, _ := strconv.ParseFloat(strings.TrimSpace(rest), 64)
							w += n
						}
					}
				}
			}
			s.mu.Lock()
			if !ready && len(s.readyURLs) > 0 {
				s.notReady += since // the wall time since the last poll: a slow scrape delays the next
			}
			s.etcdMax, s.proxyMax, s.watchersMax = max(s.etcdMax, e), max(s.proxyMax, p), max(s.watchersMax, w)
			s.mu.Unlock()
		}
	}()
	b.Cleanup(func() { close(stop); <-done })
	return s
}

// samplerHTTP is the sampler's client: a member stopped by a hung-* phase
// must not hold its polls up for long.
var samplerHTTP = &http.Client{
	Timeout:   2 * time.Second,
	Transport: &http.Transport{DisableKeepAlives: true},
}

// setEtcd points the sampler at the members' processes, after a
// maintenance phase started new ones.
func (s *sampler) setEtcd(pids []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.etcdPids = pids
}

// pollReady polls the /readyz of proxies from now on, every tick, counting
// the ticks when one was not ready, and returns how long that was since
// the last call; nil stops polling. A maintenance phase polls, the others
// do not: their load stays what it was.
func (s *sampler) pollReady(proxies []*proxyProcess) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.readyURLs = nil
	for _, p := range proxies {
		s.readyURLs = append(s.readyURLs, p.metricsURL+"/readyz")
	}
	d := s.notReady
	s.notReady = 0
	return d
}

func (s *sampler) setProxies(pids []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.proxyPids = pids
}

func (s *sampler) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.etcdMax, s.proxyMax, s.watchersMax = 0, 0, 0
}

func (s *sampler) take() (etcdMax, proxyMax int64, watchersMax float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.etcdMax, s.proxyMax, s.watchersMax
}

// cpuOf is the user+system CPU time process pid has used so far.
func cpuOf(pid int) (time.Duration, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	return time.Duration(utime+stime) * clockTick, nil
}

// memOf is process pid's resident memory (VmRSS) and its peak (VmHWM,
// since clearPeak), in bytes.
func memOf(pid int) (rss, peak int64) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			continue
		}
		kb, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "VmRSS:":
			rss = kb << 10
		case "VmHWM:":
			peak = kb << 10
		}
	}
	return rss, peak
}

// clearPeak resets process pid's VmHWM to its current resident memory
// (Linux's clear_refs; the sampler's maxima stand in where it fails).
func clearPeak(pid int) {
	_ = os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0)
}

func inMiB(n int64) float64 { return float64(n) / mib }

// logCursor reads a log from where it last stopped.
type logCursor struct {
	path string
	off  int64
}

// logCounts is what kube-apiservers' logs said in a phase: klog's error
// (E) and warning (W) lines, and the lines that say a cacher relisted
// ("reinitializing", "relist"), "too large resource version", "too old
// resource version", a timeout ("timeout", "timed out", "deadline
// exceeded") or a watcher closed for being slow ("unresponsiveness").
type logCounts struct {
	errors, warnings, relists, tooLarge, tooOld, timeouts, forced int
	samples                                                       []string
}

// newLogCursorAtEnd is a cursor at the end of the log at path now: its
// lines from now on.
func newLogCursorAtEnd(path string) *logCursor {
	lc := &logCursor{path: path}
	if st, err := os.Stat(path); err == nil {
		lc.off = st.Size()
	}
	return lc
}

// lines returns the log's complete lines since the last read.
func (lc *logCursor) lines() []string {
	f, err := os.Open(lc.path)
	if err != nil {
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(lc.off, io.SeekStart); err != nil {
		return nil
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return nil
	}
	end := bytes.LastIndexByte(data, '\n')
	if end < 0 {
		return nil
	}
	lc.off += int64(end + 1)
	return strings.Split(string(data[:end]), "\n")
}

// scan counts the log's complete lines since the last scan into c.
func (lc *logCursor) scan(c *logCounts) {
	for _, line := range lc.lines() {
		c.count(line)
	}
}

func (c *logCounts) count(line string) {
	if strings.Contains(line, "] FLAG: ") {
		return // --v=1 prints every flag at start: --request-timeout, ...
	}
	lower := strings.ToLower(line)
	klog := func(sev byte) bool {
		return len(line) > 5 && line[0] == sev && line[1] >= '0' && line[1] <= '9' && line[4] >= '0' && line[4] <= '9'
	}
	interesting := false
	for _, m := range []struct {
		n   *int
		hit bool
	}{
		{&c.errors, klog('E') || klog('F')},
		{&c.warnings, klog('W')},
		{&c.relists, strings.Contains(lower, "reinitializing") || strings.Contains(lower, "relist")},
		{&c.tooLarge, strings.Contains(lower, "too large resource version")},
		{&c.tooOld, strings.Contains(lower, "too old resource version") || strings.Contains(lower, "is too old")},
		{&c.timeouts, strings.Contains(lower, "timeout") || strings.Contains(lower, "timed out") || strings.Contains(lower, "deadline exceeded")},
		{&c.forced, strings.Contains(lower, "unresponsiveness")},
	} {
		if m.hit {
			*m.n++
			interesting = interesting || m.n != &c.warnings
		}
	}
	if interesting && len(c.samples) < 8 {
		if len(line) > 300 {
			line = line[:300]
		}
		c.samples = append(c.samples, line)
	}
}

func (c *logCounts) add(o logCounts) {
	c.errors += o.errors
	c.warnings += o.warnings
	c.relists += o.relists
	c.tooLarge += o.tooLarge
	c.tooOld += o.tooOld
	c.timeouts += o.timeouts
	c.forced += o.forced
	for _, s := range o.samples {
		if len(c.samples) < 8 {
			c.samples = append(c.samples, s)
		}
	}
}

func TestKubeMetricsParsingAndQuantiles(t *testing.T) {
	c := counters{}
	for _, line := range []string{
		`apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="GET",version="v1",le="0.005"} 50`,
		`apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="GET",version="v1",le="0.025"} 90`,
		`apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="GET",version="v1",le="0.1"} 100`,
		`apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="GET",version="v1",le="+Inf"} 100`,
	} {
		lbls, v, ok := parseSample(line)
		if !ok {
			t.Fatalf("parseSample(%q) failed", line)
		}
		c[keyBucket+lbls["verb"]+"\x00"+lbls["le"]] += v
	}
	for _, tc := range []struct{ q, want float64 }{{0.5, 5}, {0.7, 15}, {0.99, 92.5}} {
		if got := c.verbQuantile("GET", tc.q); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("quantile %v = %v ms, want %v", tc.q, got, tc.want)
		}
	}
	if got := c.verbQuantile("LIST", 0.5); !math.IsNaN(got) {
		t.Errorf("quantile of no requests = %v, want NaN", got)
	}
	if lbls, _, ok := parseSample(`x{a="q\"uote",b="2"} 3`); !ok || lbls["a"] != `q"uote` || lbls["b"] != "2" {
		t.Errorf("escaped label: %q", lbls)
	}
}

func TestKubeLogCounts(t *testing.T) {
	var c logCounts
	for _, line := range []string{
		`I0101 00:00:00.000000       1 flags.go:64] FLAG: --request-timeout="1m0s"`,
		`E0101 00:00:00.000000       1 cacher.go:506] cacher (pods): unexpected ListAndWatch error: too old resource version: 5 (7); reinitializing...`,
		`W0101 00:00:00.000000       1 reflector.go:664] Warning: watch ended with error: context deadline exceeded`,
		`I0101 00:00:00.000000       1 cache_watcher.go:214] Forcing pods watcher close due to unresponsiveness`,
	} {
		c.count(line)
	}
	got := [...]int{c.errors, c.warnings, c.relists, c.tooLarge, c.tooOld, c.timeouts, c.forced}
	if want := [...]int{1, 1, 1, 0, 1, 1, 1}; got != want {
		t.Errorf("counts (errors, warnings, relists, too large, too old, timeouts, forced) = %v, want %v", got, want)
	}
}
