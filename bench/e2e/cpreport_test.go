package e2e

import (
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"
)

// cpAgg is one side's phase over every round.
type cpAgg struct {
	rounds              int
	secs                float64
	etcdCPU, proxyCPU   float64 // seconds
	kubeCPU, loadCPU    float64
	etcdRSS, etcdPeak   int64 // the last round's, and the highest
	proxyRSS, proxyPeak int64
	watchers            float64 // the last round's, at the phase's end
	watchersMax         float64
	reqs                map[string]float64
	cached, forwarded   float64
	kube                counters
	ready, caughtUp     []float64
	delayP50, delayP99  []float64
	delayMax            []float64
	delayN              int64
	lists, watches      int64
	watchErrors         int64
	outOfOrder          int64
	repeated            int64
	skipped             int64
	ops                 map[string]*cpOpAgg
	logs                logCounts
	notes               []string
	loadErrs            []string
	memberCPU           []float64 // etcdCPU by member, seconds

	// Maintenance phases' (cpPhase.maint).
	maint         bool
	faults        []string
	fault         []float64 // seconds
	proxyNotReady float64   // seconds, in all
	proxyEvents   counters
}

type cpOpAgg struct {
	n, errors int64
	p99       []float64
}

func aggregate(phs []cpPhase) *cpAgg {
	a := &cpAgg{reqs: map[string]float64{}, ops: map[string]*cpOpAgg{}}
	for _, p := range phs {
		a.rounds++
		a.secs += p.secs
		a.etcdCPU += p.etcdCPU.Seconds()
		a.proxyCPU += p.proxyCPU.Seconds()
		a.kubeCPU += p.kubeCPU.Seconds()
		a.loadCPU += p.loadCPU.Seconds()
		a.etcdRSS, a.proxyRSS, a.watchers = p.etcdRSS, p.proxyRSS, p.watchers
		a.etcdPeak, a.proxyPeak = max(a.etcdPeak, p.etcdPeak), max(a.proxyPeak, p.proxyPeak)
		a.watchersMax = max(a.watchersMax, p.watchersMax)
		for m, v := range p.etcdReqs {
			a.reqs[m] += v
		}
		a.cached += p.cached
		a.forwarded += p.forwarded
		a.kube.add(p.kube, 1)
		if p.ready > 0 {
			a.ready = append(a.ready, p.ready.Seconds())
		}
		if p.caughtUp > 0 {
			a.caughtUp = append(a.caughtUp, p.caughtUp.Seconds())
		}
		l := p.load
		if l.Delay.N > 0 {
			a.delayP50 = append(a.delayP50, l.Delay.P50)
			a.delayP99 = append(a.delayP99, l.Delay.P99)
			a.delayMax = append(a.delayMax, l.Delay.Max)
		}
		a.delayN += l.Delay.N
		a.lists += l.Lists
		a.watches += l.Watches
		a.watchErrors += l.WatchErrors
		a.outOfOrder += l.OutOfOrder
		a.repeated += l.Repeated
		a.skipped += l.Skipped
		for k, d := range l.Ops {
			o := a.ops[k]
			if o == nil {
				o = &cpOpAgg{}
				a.ops[k] = o
			}
			o.n += d.N
			o.errors += d.Errors
			if d.N > 0 {
				o.p99 = append(o.p99, d.P99)
			}
		}
		a.logs.add(p.logs)
		a.notes = append(a.notes, p.notes...)
		for i, d := range p.memberCPU {
			if i == len(a.memberCPU) {
				a.memberCPU = append(a.memberCPU, 0)
			}
			a.memberCPU[i] += d.Seconds()
		}
		if p.maint {
			a.maint = true
			a.faults = append(a.faults, p.faultDesc)
			a.fault = append(a.fault, p.fault.Seconds())
			a.proxyNotReady += p.proxyNotReady.Seconds()
			a.proxyEvents.add(p.proxyEvents, 1)
		}
		a.loadErrs = append(a.loadErrs, l.Errors...)
	}
	return a
}

func (a *cpAgg) etcdCPUps() float64  { return a.etcdCPU / a.secs }
func (a *cpAgg) proxyCPUps() float64 { return a.proxyCPU / a.secs }

// report prints the SUMMARY of every phase, both sides, and reports the
// key numbers as metrics.
func (cp *controlPlane) report(b *testing.B, results []cpPhase) {
	b.ReportMetric(0, "ns/op") // a run is fixed phases, not b.N ops
	bname := summaryName(b, cp.pki != nil)
	var sb strings.Builder
	shared := ""
	if !cp.uts {
		shared = ", sharing a hostname"
	}
	fmt.Fprintf(&sb, "SUMMARY %s setup: %d kube-apiservers (watch cache on%s), %d nodes, %d informer clients per kube-apiserver%s, load rate x%g (%s), proxy topology %s (%s), %s to etcd and the proxies, %d round(s); %s\n",
		bname, len(cp.kubes), shared, *cpNodes, *cpInformers, map[bool]string{true: " (watch-list)"}[*cpWatchList], *cpRate,
		map[bool]string{true: "on in every phase", false: "paused in start-storm and restart-all"}[*cpStormLoad], *cpTopology, cp.proxiesDesc(),
		map[bool]string{true: "mTLS", false: "plaintext"}[cp.pki != nil], *cpRounds, cp.setup)
	var names []string // in the order they ran
	for _, p := range results {
		if !slices.Contains(names, p.name) {
			names = append(names, p.name)
		}
	}
	for _, name := range names {
		sides := map[string]*cpAgg{}
		for _, side := range []string{"direct", "proxy"} {
			var phs []cpPhase
			for _, p := range results {
				if p.name == name && p.side == side {
					phs = append(phs, p)
				}
			}
			if len(phs) > 0 {
				sides[side] = aggregate(phs)
			}
		}
		d, p := sides["direct"], sides["proxy"]
		switch {
		case p == nil:
			continue
		case d == nil:
			// A phase of the proxy side alone: its cost in all, and
			// beside direct's steady state.
			fmt.Fprintf(&sb, "SUMMARY %s/%s: proxy side only: etcd cpu %.3f s/s, %.1f s in all  etcd peak rss %.0f MiB  etcd watchers %.0f  (took %.1fs)\n",
				bname, name, p.etcdCPUps(), p.etcdCPU/float64(p.rounds), inMiB(p.etcdPeak), p.watchers, p.secs/float64(p.rounds))
			b.ReportMetric(p.etcdCPUps(), name+"-proxy-etcd-cpu-s/s")
			b.ReportMetric(inMiB(p.etcdPeak), name+"-proxy-etcd-peak-MiB")
		default:
			cpuRatio := p.etcdCPUps() / d.etcdCPUps()
			peakRatio := float64(p.etcdPeak) / float64(d.etcdPeak)
			fmt.Fprintf(&sb, "SUMMARY %s/%s: etcd cpu proxy/direct %.2fx (%.3f vs %.3f s/s; %.1f vs %.1f s in all)  etcd peak rss proxy/direct %.2fx  etcd watchers %.0f vs %.0f  (took %.1fs vs %.1fs)\n",
				bname, name, cpuRatio, p.etcdCPUps(), d.etcdCPUps(), p.etcdCPU/float64(p.rounds), d.etcdCPU/float64(d.rounds), peakRatio, p.watchers, d.watchers, p.secs/float64(p.rounds), d.secs/float64(d.rounds))
			short := strings.TrimPrefix(name, "start-")
			b.ReportMetric(cpuRatio, short+"-etcd-cpu-proxy/direct")
			b.ReportMetric(d.etcdCPUps(), short+"-direct-etcd-cpu-s/s")
			b.ReportMetric(p.etcdCPUps(), short+"-proxy-etcd-cpu-s/s")
			b.ReportMetric(p.proxyCPUps(), short+"-proxy-cpu-s/s")
			b.ReportMetric(inMiB(d.etcdPeak), short+"-direct-etcd-peak-MiB")
			b.ReportMetric(inMiB(p.etcdPeak), short+"-proxy-etcd-peak-MiB")
			b.ReportMetric(median(d.delayP99), short+"-direct-delay-p99-ms")
			b.ReportMetric(median(p.delayP99), short+"-proxy-delay-p99-ms")
		}
		for _, side := range []string{"direct", "proxy"} {
			a := sides[side]
			if a == nil {
				continue
			}
			pad := map[string]string{"direct": "direct", "proxy": "proxy "}[side]
			byMember := ""
			if len(a.memberCPU) > 1 {
				var cpus []string
				for _, c := range a.memberCPU {
					cpus = append(cpus, fmt.Sprintf("%.3f", c/a.secs))
				}
				byMember = fmt.Sprintf(" (by member %s)", strings.Join(cpus, "/"))
			}
			fmt.Fprintf(&sb, "SUMMARY   %s etcd : cpu %.3f s/s%s  rss %.0f MiB (peak %.0f)  watchers %.0f (max %.0f)  req/s %s\n",
				pad, a.etcdCPUps(), byMember, inMiB(a.etcdRSS), inMiB(a.etcdPeak), a.watchers, a.watchersMax, fmtReqs(a.reqs, a.secs))
			if a.maint {
				proxy := ""
				if side == "proxy" {
					var reasons []string
					for k, n := range a.proxyEvents {
						if r, ok := strings.CutPrefix(k, "reload:"); ok && n > 0 {
							reasons = append(reasons, fmt.Sprintf(" %s %.0f", r, n))
						}
					}
					slices.Sort(reasons)
					proxy = fmt.Sprintf("  proxy not ready %.1fs, keyspace reloads %.0f%s (loads %.0f), upstream watch resumes %.0f",
						a.proxyNotReady, a.proxyEvents["reloads"], strings.Join(reasons, ""), a.proxyEvents["loads"], a.proxyEvents["watch-restarts"])
				}
				fmt.Fprintf(&sb, "SUMMARY   %s fault: took %.1fs%s  kube errors by verb %s  informer relists %d watches %d  (%s)\n",
					pad, median(a.fault), proxy, a.kube.errorsByVerb(), a.lists, a.watches, strings.Join(a.faults, "; "))
			}
			if side == "proxy" {
				cache := ""
				if a.cached+a.forwarded > 0 {
					cache = fmt.Sprintf("  Ranges from its cache %.1f%% of %.0f", 100*a.cached/(a.cached+a.forwarded), a.cached+a.forwarded)
				}
				fmt.Fprintf(&sb, "SUMMARY   %s proxy: cpu %.3f s/s  rss %.0f MiB (peak %.0f), summed over %d proxies (%s)%s\n",
					pad, a.proxyCPUps(), inMiB(a.proxyRSS), inMiB(a.proxyPeak), len(cp.proxies), *cpTopology, cache)
			}
			fivexx, tooMany := a.kube.codes()
			var lat []string
			for _, v := range a.kube.verbs() {
				lat = append(lat, fmt.Sprintf("%s %s/%s", v, fmtMS(a.kube.verbQuantile(v, 0.5)), fmtMS(a.kube.verbQuantile(v, 0.99))))
			}
			ready := ""
			if len(a.ready) > 0 {
				ready = fmt.Sprintf("  ready after %.1fs", median(a.ready))
			}
			if len(a.caughtUp) > 0 {
				ready += fmt.Sprintf(", informers caught up after %.1fs", median(a.caughtUp))
			}
			fmt.Fprintf(&sb, "SUMMARY   %s kube : cpu %.2f s/s  ms p50/p99 %s  5xx %.0f 429 %.0f%s  logs: errors %d relists %d too-large-rv %d too-old-rv %d timeouts %d slow-watcher-closes %d (warnings %d)\n",
				pad, a.kubeCPU/a.secs, strings.Join(lat, " "), fivexx, tooMany, ready,
				a.logs.errors, a.logs.relists, a.logs.tooLarge, a.logs.tooOld, a.logs.timeouts, a.logs.forced, a.logs.warnings)
			var total, errs int64
			var kinds []string
			for k, o := range a.ops {
				total += o.n
				errs += o.errors
				kinds = append(kinds, k)
			}
			slices.Sort(kinds)
			var p99s []string
			for _, k := range kinds {
				if o := a.ops[k]; len(o.p99) > 0 {
					e := ""
					if o.errors > 0 {
						e = fmt.Sprintf("(%d err)", o.errors)
					}
					p99s = append(p99s, fmt.Sprintf("%s %s%s", k, fmtMS(median(o.p99)), e))
				} else if o.errors > 0 {
					p99s = append(p99s, fmt.Sprintf("%s -(%d err)", k, o.errors))
				}
			}
			fmt.Fprintf(&sb, "SUMMARY   %s load : cpu %.2f s/s  informer delay p50/p99/max %s/%s/%s ms (%d events)  informer lists %d watches %d errors %d out-of-order %d repeated %d  ops %d errors %d skipped %d  p99 ms %s\n",
				pad, a.loadCPU/a.secs, fmtMS(median(a.delayP50)), fmtMS(median(a.delayP99)), fmtMS(median(a.delayMax)), a.delayN,
				a.lists, a.watches, a.watchErrors, a.outOfOrder, a.repeated, total, errs, a.skipped, strings.Join(p99s, " "))
			for _, n := range a.notes {
				fmt.Fprintf(&sb, "SUMMARY   %s note : %s\n", pad, n)
			}
			b.Logf("%s %s: kube-apiserver log lines: %q; load errors: %q", name, side, a.logs.samples, a.loadErrs)
		}
	}
	for _, p := range cp.profiles {
		sb.WriteString(profileSummary(b, p))
	}
	fmt.Fprint(os.Stdout, sb.String())
}

// proxiesDesc says what the proxies are in front of.
func (cp *controlPlane) proxiesDesc() string {
	switch *cpTopology {
	case "sidecar":
		return fmt.Sprintf("%d proxies, one per kube-apiserver, each in front of etcd", len(cp.proxies))
	case "tiered":
		return fmt.Sprintf("%d proxies: one in front of etcd, and one per kube-apiserver in front of it", len(cp.proxies))
	}
	return "one proxy in front of etcd for every kube-apiserver"
}

// fmtReqs is etcd's requests per second by gRPC method, the most first
// (those under 0.05/s left out).
func fmtReqs(reqs map[string]float64, secs float64) string {
	type mr struct {
		m string
		r float64
	}
	var rs []mr
	for m, n := range reqs {
		if r := n / secs; r >= 0.05 {
			rs = append(rs, mr{m, r})
		}
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].r > rs[j].r || rs[i].r == rs[j].r && rs[i].m < rs[j].m })
	parts := make([]string, len(rs))
	for i, x := range rs {
		parts[i] = fmt.Sprintf("%s %.1f", x.m, x.r)
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " ")
}

// fmtMS is a duration in milliseconds, to 2 significant digits or so.
func fmtMS(ms float64) string {
	switch {
	case math.IsNaN(ms):
		return "-"
	case ms < 10:
		return fmt.Sprintf("%.1f", ms)
	default:
		return fmt.Sprintf("%.0f", ms)
	}
}
