package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// Flags of BenchmarkControlPlane.
var (
	cpObjects    = flag.Int("snapcache.e2e.cp-objects", 100000, "objects of BenchmarkControlPlane: Nodes, as many Leases, the rest half Pods, half ConfigMaps, of 1–4 KiB")
	cpAPIServers = flag.Int("snapcache.e2e.cp-apiservers", 3, "kube-apiservers of BenchmarkControlPlane")
	cpNodes      = flag.Int("snapcache.e2e.cp-nodes", 500, "nodes of BenchmarkControlPlane: each renews its Lease every 10 s")
	cpInformers  = flag.Int("snapcache.e2e.cp-informers", 2, "informer clients per kube-apiserver (each informs on pods, nodes, configmaps and leases)")
	cpSteady     = flag.Duration("snapcache.e2e.cp-steady", time.Minute, "length of the steady phase")
	cpSettle     = flag.Duration("snapcache.e2e.cp-settle", 20*time.Second, "how long a restart phase goes on once every kube-apiserver is ready and every informer has caught up")
	cpRounds     = flag.Int("snapcache.e2e.cp-rounds", 1, "passes of the phases per side (direct,proxy, proxy,direct, ...)")
	cpRate       = flag.Float64("snapcache.e2e.cp-rate", 1, "multiplies every rate of the load but the heartbeats")
	cpWatchList  = flag.Bool("snapcache.e2e.cp-watchlist", false, "informers use watch-list (client-go's WatchListClient) instead of LIST then WATCH")
	cpStormLoad  = flag.Bool("snapcache.e2e.cp-storm-load", true, "the load's writes and reads (kubelet heartbeats included) go on during start-storm and restart-all; false: they pause there (informers still start and catch up), so those phases measure the storm's own cost: the kube-apiservers' LISTs and watches")
	cpTopology   = flag.String("snapcache.e2e.cp-topology", "shared", "the proxy side's proxies: shared (one proxy in front of etcd for every kube-apiserver), sidecar (one per kube-apiserver, each in front of etcd) or tiered (one in front of etcd, and one per kube-apiserver in front of it)")
	cpSides      = flag.String("snapcache.e2e.cp-sides", "direct,proxy", "the sides BenchmarkControlPlane runs, in its first round's order: direct, proxy, or both")
	cpProxyFlags = flag.String("snapcache.e2e.cp-proxy-flags", "", "extra flags of every proxy of the proxy side (space-separated), e.g. --memory-limit=0 to compare a setting")
	cpTimeout    = flag.Duration("snapcache.e2e.cp-timeout", 10*time.Minute, "bound of each wait: kube-apiservers ready, informers synced or caught up (populating: three times it)")
	cpPhaseList  = flag.String("snapcache.e2e.cp-phases", strings.Join(cpDefaultPhases, ","), "the phases of each side's pass, in order (comma-separated): "+cpPhaseNames()+"; start-storm always runs first, as it brings the side up")
	cpMembers    = flag.Int("snapcache.e2e.cp-etcd-members", 0, "etcd members, each a process of its own; 0: 3 if a maintenance phase is selected, else 1")
)

// kubeloadBinary is $KUBELOAD_BIN, else the load generator `make kubeload`
// builds (bench/kubeload, a module of its own: client-go stays out of the
// main module).
func kubeloadBinary(tb testing.TB) string {
	return requireBinary(tb, "KUBELOAD_BIN", "../../bin/kubeload", "build it with `make kubeload`")
}

// cpDefaultPhases are the phases of a side's pass unless
// -snapcache.e2e.cp-phases says otherwise. restart-proxy and
// handover-proxy are the proxy side's alone.
var cpDefaultPhases = []string{"start-storm", "steady", "restart-all", "restart-one", "restart-proxy", "handover-proxy"}

// BenchmarkControlPlane: a production control plane, -snapcache.e2e.cp-apiservers
// unmodified kube-apiservers with their watch caches on (the default), in
// front of one etcd directly ("direct") and in front of one etcd-snapcache
// process in front of the same etcd ("proxy"), alternating on the same etcd
// and data, under a kube-shaped load (bench/kubeload, a client-go process):
// kubelet heartbeats, pod and node status updates, creates and deletes,
// informers (LIST then WATCH, bookmarks, resumes), GETs, consistent LISTs
// and LISTs at a resourceVersion. A side's pass is four phases: every
// kube-apiserver starting at once (start-storm, until all are ready and every
// informer has synced), steady state (-snapcache.e2e.cp-steady), every
// kube-apiserver restarting at once (restart-all) and one restarting while
// the others serve (restart-one), each of these until every kube-apiserver
// is ready and every informer has caught up, then -snapcache.e2e.cp-settle.
// The proxy side then restarts the proxy in front of the first
// kube-apiserver (restart-proxy: SIGTERM, then a new process on the same
// port, which starts warm from its copy on disk), and its kube-apiservers
// reconnect and resume their watches; then hands it over to a new process
// (handover-proxy: SIGHUP, as the systemd unit's reload does), which
// refuses no connection.
// -snapcache.e2e.cp-phases selects the phases, and adds maintenance
// phases (cpPhaseTable): what operators do to etcd and what fails in it
// (rolling restarts, defrag, leadership moves, hung and lost members, a
// cut link), on a 3-member etcd, under the steady load, on both sides:
// what a control plane on the proxy goes through when etcd is maintained.
// Per phase and side: etcd's CPU per second, resident memory and peak,
// watchers and requests per second by method; the proxy's CPU and memory;
// kube-apiserver's request latency per verb, its 5xx and 429 answers and
// what its logs say (errors, relists, too large or too old resource
// versions, timeouts); the informers' event delay, lists, watches and
// errors; the load's ops and errors. With -snapcache.e2e.tls, every hop
// to etcd and the proxies is mTLS: the kube-apiservers reach their storage
// with --etcd-cafile, --etcd-certfile and --etcd-keyfile (a certificate
// that names no user), and the proxies reach their upstream likewise.
func BenchmarkControlPlane(b *testing.B) {
	bin := kubeAPIServerBinary()
	if bin == "" {
		b.Skip("no kube-apiserver binary: build it with `make tools-kube` (tools/build.sh kube), or set $KUBE_APISERVER_BIN")
	}
	phases, err := cpSelectPhases(*cpPhaseList)
	if err != nil {
		b.Fatal(err)
	}
	cp := newControlPlane(b, bin, kubeloadBinary(b), phases)
	cp.populate(b)

	var results []cpPhase
	for r := range *cpRounds {
		sides := strings.Split(*cpSides, ",")
		if r%2 == 1 {
			slices.Reverse(sides)
		}
		for _, s := range sides {
			results = append(results, cp.pass(b, s, r, phases)...)
		}
	}
	b.StopTimer()
	cp.report(b, results)
}

// controlPlane is etcd, the proxy in front of it, the kube-apiservers and
// the load.
type controlPlane struct {
	etcd    *etcdCluster
	pki     *mtlsPKI        // with -snapcache.e2e.tls: every hop is mTLS; else nil
	tls     *tls.Config     // what the benchmark's own clients present (with pki)
	proxies []*proxyProcess // started once the data is in, and kept running; the inner one first
	front   []*proxyProcess // the proxy each kube-apiserver is in front of, by index
	loader  *clientv3.Client
	kubes   []*cpKube
	kubeBin string
	loadBin string
	token   string
	caFile  string // every kube-apiserver's CA
	dir     string
	sampler *sampler
	setup   string    // what was populated, for the SUMMARY
	uts     bool      // each kube-apiserver runs in a UTS namespace of its own
	load    *kubeload // the running load generator, if any

	profDir  string      // where the CPU profiles go (-snapcache.e2e.pprof)
	profiles []cpProfile // the CPU profiles taken, in order
}

func newControlPlane(b *testing.B, kubeBin, loadBin string, phases []cpPhaseDef) *controlPlane {
	cp := &controlPlane{kubeBin: kubeBin, loadBin: loadBin, dir: b.TempDir()}
	var etcdArgs []string
	if *cmpPprof {
		etcdArgs = []string{"--enable-pprof"}
		d, err := os.MkdirTemp("", "cp-pprof-")
		if err != nil {
			b.Fatal(err)
		}
		cp.profDir = d
	}
	var kubeTLS []string
	if *cmpTLS {
		// etcd and the proxies serve mTLS; the proxies reach their
		// upstream, and the kube-apiservers their storage, with a client
		// certificate that names no user.
		cp.pki = newMTLSPKI(b)
		cp.tls = cp.pki.clientTLS(b)
		etcdArgs = append(etcdArgs, cp.pki.serving("etcd")...)
		kubeTLS = cp.pki.kubeEtcd("anonymous")
	}
	cp.etcd = startEtcdCluster(b, cpMemberCount(b, phases), cp.tls, etcdArgs...)
	if slices.ContainsFunc(phases, func(p cpPhaseDef) bool { return p.name == "cut-connection" }) {
		// The clients of both sides reach the first member through a
		// relay for the whole run, so that cut-connection can cut them
		// off it, and the benchmark's own clients reach it directly.
		// The first: in the smoke runs the proxy's upstream watch was
		// there every time, as were a third or more of the
		// kube-apiservers' watches.
		first := cp.etcd.members[0]
		first.relay = testsupport.NewRelay(b, strings.TrimPrefix(strings.TrimPrefix(first.endpoint, "http://"), "https://"))
	}
	cp.loader = dialAll(b, cp.etcd.directEndpoints(), cp.tls, "", "")
	cp.uts = exec.Command("unshare", "--uts", "--", "/bin/sh", "-c", "hostname kube-apiserver").Run() == nil
	if !cp.uts {
		b.Logf("no UTS namespaces (unshare --uts): the kube-apiservers share a hostname, so an identity Lease, and log errors about it")
	}
	for i := range max(*cpAPIServers, 1) {
		dir := filepath.Join(cp.dir, fmt.Sprintf("kube-%d", i))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			b.Fatal(err)
		}
		args, port, token := testsupport.KubeAPIServerSetup(b, dir)
		if i == 0 {
			cp.token = token
		} else {
			// One cluster: every kube-apiserver takes the same token and
			// signs service accounts with the same key, as in HA.
			for _, f := range []string{"tokens.csv", "sa.key", "sa.pub"} {
				copyFile(b, filepath.Join(cp.dir, "kube-0", f), filepath.Join(dir, f))
			}
		}
		cp.kubes = append(cp.kubes, &cpKube{idx: i, dir: dir, port: port, bin: kubeBin, token: cp.token,
			// --v=1: the cacher's forced watcher closes too.
			args: append(append(args, "--v=1"), kubeTLS...)})
	}
	cp.sampler = startSampler(b, cp)
	return cp
}

func copyFile(tb testing.TB, from, to string) {
	tb.Helper()
	data, err := os.ReadFile(from)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(to, data, 0o600); err != nil {
		tb.Fatal(err)
	}
}

// populate writes the objects through kube-apiservers in front of etcd
// (then stopped), compacts etcd, and starts the proxy, which loads them.
func (cp *controlPlane) populate(b *testing.B) {
	start := time.Now()
	cp.startKubes(b, "direct", cp.kubes)
	if _, err := cp.waitReady(cp.kubes); err != nil {
		b.Fatal(err)
	}
	// Every kube-apiserver's self-signed serving certificate, for the load.
	var bundle []byte
	for _, k := range cp.kubes {
		pem, err := os.ReadFile(k.certFile())
		if err != nil {
			b.Fatal(err)
		}
		bundle = append(bundle, pem...)
	}
	cp.caFile = filepath.Join(cp.dir, "kube-ca.crt")
	if err := os.WriteFile(cp.caFile, bundle, 0o600); err != nil {
		b.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3**cpTimeout)
	defer cancel()
	logf, err := os.Create(filepath.Join(cp.dir, "kubeload-populate.log"))
	if err != nil {
		b.Fatal(err)
	}
	defer logf.Close()
	cmd := cp.loadCmd(ctx, "populate", "-concurrency=48")
	cmd.Stderr = logf
	out, err := cmd.Output()
	if err != nil {
		b.Fatalf("kubeload populate: %v: %s\n%s", err, out, tailOf(logf.Name()))
	}
	var res struct {
		Objects int      `json:"objects"`
		Secs    float64  `json:"secs"`
		Errors  int      `json:"errors"`
		Samples []string `json:"error_samples"`
	}
	if err := jsonLine(out, &res); err != nil {
		b.Fatalf("kubeload populate: %v: %s", err, out)
	}
	cp.stopKubes(b, cp.kubes, false)
	for _, k := range cp.kubes {
		k.logs = nil
	}
	head := cp.head(b)
	cp.compact(b, head)

	// What kube-apiserver stored, read back from etcd.
	var parts []string
	for _, r := range []struct{ name, prefix string }{
		{"pods", "/registry/pods/"}, {"configmaps", "/registry/configmaps/"},
		{"nodes", "/registry/minions/"}, {"leases", "/registry/leases/"},
	} {
		gctx, gcancel := context.WithTimeout(context.Background(), time.Minute)
		all, err := cp.loader.Get(gctx, r.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			gcancel()
			b.Fatal(err)
		}
		some, err := cp.loader.Get(gctx, r.prefix, clientv3.WithPrefix(), clientv3.WithLimit(2000))
		gcancel()
		if err != nil {
			b.Fatal(err)
		}
		size := 0
		for _, kv := range some.Kvs {
			size += len(kv.Value)
		}
		parts = append(parts, fmt.Sprintf("%d %s (%.1f KiB)", all.Count, r.name, float64(size)/float64(max(len(some.Kvs), 1))/1024))
	}
	db := cp.etcd.members[0].metrics(b).sum("etcd_mvcc_db_total_size_in_bytes")
	cp.setup = fmt.Sprintf("%s; etcd (%d member(s)) db %.0f MiB at revision %d; %d objects written through %d kube-apiservers in %.0fs",
		strings.Join(parts, ", "), len(cp.etcd.members), db/(1<<20), head, res.Objects, len(cp.kubes), res.Secs)
	progress("setup: %s (%d errors %v); took %v", cp.setup, res.Errors, res.Samples, time.Since(start).Round(time.Second))
	if res.Errors > 0 {
		b.Fatalf("kubeload populate: %d errors: %v", res.Errors, res.Samples)
	}

	cp.startProxies(b, head)
}

// startProxy starts a proxy in front of upstream (etcd, or the inner
// proxy) with the flags every proxy of the control plane runs with: at log
// level info, whose lines say which process a handover went to; with
// -snapcache.e2e.tls, serving mTLS and reaching upstream over mTLS.
func (cp *controlPlane) startProxy(b *testing.B, upstream string) *proxyProcess {
	b.Helper()
	args := []string{"--log-level=info"}
	if *cmpPprof {
		args = append(args, "--enable-pprof")
	}
	if cp.pki != nil {
		args = append(append(args, cp.pki.serving("proxy")...), cp.pki.upstream()...)
	}
	args = append(args, strings.Fields(*cpProxyFlags)...)
	return startProxyProcessTLS(b, upstream, cp.pki != nil, args...)
}

// startProxies starts the proxies of -snapcache.e2e.cp-topology, each once
// the one it is in front of has reached revision head.
func (cp *controlPlane) startProxies(b *testing.B, head int64) {
	b.Helper()
	switch *cpTopology {
	case "shared":
		p := cp.startProxy(b, cp.etcd.clientEndpoints())
		cp.proxies = []*proxyProcess{p}
		for range cp.kubes {
			cp.front = append(cp.front, p)
		}
	case "sidecar":
		for range cp.kubes {
			p := cp.startProxy(b, cp.etcd.clientEndpoints())
			cp.proxies = append(cp.proxies, p)
			cp.front = append(cp.front, p)
		}
	case "tiered":
		inner := cp.startProxy(b, cp.etcd.clientEndpoints())
		cp.proxies = []*proxyProcess{inner}
		cp.waitProxies(b, head)
		for range cp.kubes {
			p := cp.startProxy(b, inner.endpoint)
			cp.proxies = append(cp.proxies, p)
			cp.front = append(cp.front, p)
		}
	default:
		b.Fatalf("-snapcache.e2e.cp-topology=%s: shared, sidecar or tiered", *cpTopology)
	}
	cp.sampleProxies()
	cp.waitProxies(b, head)
}

// fronts are the proxies kube-apiservers are in front of, each once.
func (cp *controlPlane) fronts() []*proxyProcess {
	var out []*proxyProcess
	for _, p := range cp.front {
		if !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

// endpoint is what kube-apiserver k is in front of on side.
func (cp *controlPlane) endpoint(side string, k *cpKube) string {
	if side == "proxy" {
		return cp.front[k.idx].endpoint
	}
	return cp.etcd.clientEndpoints()
}

// progress prints a line at once: a benchmark's log comes out when it ends.
func progress(format string, args ...any) {
	fmt.Printf("PROGRESS "+format+"\n", args...)
}

// head is etcd's current revision.
func (cp *controlPlane) head(b *testing.B) int64 {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := cp.loader.Get(ctx, "health")
	if err != nil {
		b.Fatal(err)
	}
	return resp.Header.Revision
}

// compact compacts etcd at rev, as kube-apiserver's compactor does every
// five minutes: each side starts from a compacted etcd.
func (cp *controlPlane) compact(b *testing.B, rev int64) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := cp.loader.Compact(ctx, rev, clientv3.WithCompactPhysical()); err != nil && !strings.Contains(err.Error(), "compacted") {
		b.Fatal(err)
	}
}

// waitProxies waits until every proxy's cache has applied rev.
func (cp *controlPlane) waitProxies(b *testing.B, rev int64) {
	b.Helper()
	for i, p := range cp.proxies {
		testsupport.Poll(b, *cpTimeout, 50*time.Millisecond, fmt.Sprintf("proxy %d's cache to reach revision %d", i, rev), func() (bool, error) {
			if err := p.alive(); err != nil {
				b.Fatal(err)
			}
			at := p.status(b).Revision
			return at >= rev, fmt.Errorf("at revision %d", at)
		})
	}
}

// pass runs the phases on one side: the kube-apiservers in front of etcd
// ("direct") or of the proxy. start-storm comes first whether it was
// selected or not: it starts the kube-apiservers and the load that the
// other phases run under; it is reported if selected.
func (cp *controlPlane) pass(b *testing.B, side string, round int, phases []cpPhaseDef) []cpPhase {
	head := cp.head(b)
	cp.compact(b, head)
	if side == "proxy" {
		cp.waitProxies(b, head)
	}
	var out []cpPhase
	storm, load := cp.startStorm(b, side, round)
	if slices.ContainsFunc(phases, func(p cpPhaseDef) bool { return p.name == "start-storm" }) {
		out = append(out, storm)
	}
	for _, p := range phases {
		if p.name == "start-storm" || p.proxyOnly && side != "proxy" {
			continue
		}
		if p.fault != nil {
			out = append(out, cp.maintenance(b, side, p, load))
		} else {
			out = append(out, p.run(cp, b, side, load, round))
		}
	}

	load.stop(b)
	cp.load = nil
	cp.stopKubes(b, cp.kubes, false)
	return out
}

// startStorm is the start-storm phase: every kube-apiserver starting at
// once, then the clients, until every informer has synced and caught up.
// It returns the phase and the load, which runs on (resumed, if the storm
// paused it).
func (cp *controlPlane) startStorm(b *testing.B, side string, round int) (cpPhase, *kubeload) {
	ph := cp.begin(b, side, "start-storm")
	storm := cp.profileStorm(b, side, "start-storm", round)
	cp.startKubes(b, side, cp.kubes)
	if _, err := cp.waitReady(cp.kubes); err != nil {
		b.Fatal(err)
	}
	ph.ready = time.Since(ph.start)
	load := cp.startLoad(b, side, round)
	if r := load.do(b, "synced"); !r.OK {
		ph.note("informers not synced: " + r.Error)
	} else if r := load.do(b, "barrier"); !r.OK {
		// Synced and caught up: steady state begins without a backlog.
		ph.note("barrier: " + r.Error)
	}
	ph.caughtUp = time.Since(ph.start)
	done := cp.end(b, ph, load)
	// After the phase's end, so that the profile's length does not
	// stretch the phase, and before the load resumes.
	cp.waitStormProfile(storm)
	cp.pauseLoad(b, load, false)
	return done, load
}

// steady is the steady phase: the load alone, for -snapcache.e2e.cp-steady.
func (cp *controlPlane) steady(b *testing.B, side string, load *kubeload, round int) cpPhase {
	ph := cp.begin(b, side, "steady")
	if *cmpPprof {
		cp.profileSteady(b, load, side, "steady", round, ph.start, *cpSteady)
	}
	cp.hold(b, load, ph.start.Add(*cpSteady))
	return cp.end(b, ph, load)
}

// pauseLoad pauses (or resumes) the load's writes and reads, with
// -snapcache.e2e.cp-storm-load=false: around start-storm and restart-all.
func (cp *controlPlane) pauseLoad(b *testing.B, load *kubeload, pause bool) {
	b.Helper()
	if *cpStormLoad {
		return
	}
	cmd := map[bool]string{true: "pause", false: "resume"}[pause]
	if r := load.do(b, cmd); !r.OK {
		b.Fatalf("kubeload %s: %s", cmd, r.Error)
	}
}

// restart is a restart phase: kubes stop and start again, all at once;
// the phase goes on until they are ready, every informer has caught up (a
// barrier) and -snapcache.e2e.cp-settle has passed.
func (cp *controlPlane) restart(b *testing.B, side, name string, kubes []*cpKube, load *kubeload, round int) cpPhase {
	ph := cp.begin(b, side, name)
	var storm *profileRun
	if name == "restart-all" {
		storm = cp.profileStorm(b, side, name, round)
	}
	cp.stopKubes(b, kubes, true)
	cp.startKubes(b, side, kubes)
	cp.recover(b, ph, load)
	done := cp.end(b, ph, load)
	cp.waitStormProfile(storm)
	return done
}

// restartProxy is the restart-proxy phase: the proxy in front of the first
// kube-apiserver stops and starts again under load, warm from its copy on
// disk. The phase goes
// on until it is ready, every kube-apiserver is ready, every informer has
// caught up (a barrier) and -snapcache.e2e.cp-settle has passed.
func (cp *controlPlane) restartProxy(b *testing.B, _ string, load *kubeload, _ int) cpPhase {
	ph := cp.begin(b, "proxy", "restart-proxy")
	p := cp.front[0]
	// The stopped process's CPU and Ranges so far leave the phase's
	// baseline: the new one's count from zero.
	ph.proxyCPU0 -= processCPU(b, p.pid())
	cached, forwarded := p.ranges(b)
	ph.cached0 -= cached
	ph.forwarded0 -= forwarded
	p.restart(b)
	cp.sampleProxies()
	cp.recover(b, ph, load)
	return cp.end(b, ph, load)
}

// handoverProxy is the handover-proxy phase: the proxy in front of the
// first kube-apiserver hands over to a new process of it (SIGHUP) under
// load. The old process's CPU after the phase began is not counted: it
// has exited when the phase ends. The phase goes on as restartProxy's.
func (cp *controlPlane) handoverProxy(b *testing.B, _ string, load *kubeload, _ int) cpPhase {
	ph := cp.begin(b, "proxy", "handover-proxy")
	p := cp.front[0]
	ph.proxyCPU0 -= processCPU(b, p.pid())
	cached, forwarded := p.ranges(b)
	ph.cached0 -= cached
	ph.forwarded0 -= forwarded
	p.handover(b)
	cp.sampleProxies()
	cp.recover(b, ph, load)
	return cp.end(b, ph, load)
}

// recover ends a restart: it waits until every kube-apiserver is ready
// and every informer has caught up (a barrier), then holds the phase for
// -snapcache.e2e.cp-settle.
func (cp *controlPlane) recover(b *testing.B, ph *cpPhase, load *kubeload) {
	if _, err := cp.waitReady(cp.kubes); err != nil {
		b.Fatal(err)
	}
	ph.ready = time.Since(ph.start)
	r := load.do(b, "barrier")
	ph.caughtUp = time.Since(ph.start)
	if !r.OK {
		ph.note("barrier: " + r.Error)
	}
	cp.hold(b, load, time.Now().Add(*cpSettle))
}

// sampleProxies points the memory sampler at the proxies' processes.
func (cp *controlPlane) sampleProxies() {
	var pids []int
	for _, p := range cp.proxies {
		pids = append(pids, p.cmd.Process.Pid)
	}
	cp.sampler.setProxies(pids)
}

// hold lets a phase's load run until end, checking every second that
// every process of the control plane is still alive.
func (cp *controlPlane) hold(b *testing.B, load *kubeload, end time.Time) {
	b.Helper()
	deadline := time.NewTimer(time.Until(end))
	defer deadline.Stop()
	check := time.NewTicker(time.Second)
	defer check.Stop()
	for {
		select {
		case <-deadline.C:
			return
		case <-check.C:
			cp.checkAlive(b, load)
		}
	}
}

func (cp *controlPlane) checkAlive(b *testing.B, load *kubeload) {
	b.Helper()
	cs := cp.etcd.children()
	for _, p := range cp.proxies {
		cs = append(cs, p.child)
	}
	for _, c := range cs {
		if err := c.alive(); err != nil {
			b.Fatal(err)
		}
	}
	for _, k := range cp.kubes {
		if err := k.proc.alive(); err != nil {
			b.Fatal(err)
		}
	}
	if err := load.alive(); err != nil {
		b.Fatal(err)
	}
}

// cpKube is one kube-apiserver: its flags and directory stay, its process
// is started again at each (re)start (a generation), each with a log of its
// own.
type cpKube struct {
	idx    int
	dir    string
	port   int
	bin    string
	token  string
	args   []string // all but --etcd-servers
	gen    int
	proc   *child
	hc     *http.Client
	cursor *logCursor   // the running generation's log
	logs   []*logCursor // this phase's generations' logs

	// The phase's accounting of its /metrics and its CPU time: acc holds
	// what earlier generations did in the phase, base the running one's
	// counters when the phase began (nil, 0: it started in the phase).
	base, acc       counters
	cpuBase, cpuAcc time.Duration
}

// cpu is the CPU time the running (or last) generation has used.
func (k *cpKube) cpu() time.Duration {
	if k.proc.alive() != nil {
		return k.proc.cmd.ProcessState.UserTime() + k.proc.cmd.ProcessState.SystemTime()
	}
	d, _ := cpuOf(k.proc.cmd.Process.Pid)
	return d
}

func (k *cpKube) certFile() string { return filepath.Join(k.dir, "certs", "apiserver.crt") }
func (k *cpKube) url() string      { return fmt.Sprintf("https://127.0.0.1:%d", k.port) }

// startKubes starts kubes at once, in front of etcd ("direct") or their
// proxies (side "proxy").
func (cp *controlPlane) startKubes(b *testing.B, side string, kubes []*cpKube) {
	b.Helper()
	for _, k := range kubes {
		k.gen++
		name := fmt.Sprintf("kube-apiserver-%d.%d", k.idx, k.gen)
		bin, args := k.bin, append(slices.Clone(k.args), "--etcd-servers="+cp.endpoint(side, k))
		if cp.uts {
			// A host of its own, by name: kube-apiserver names its
			// identity Lease after its hostname, and kube-apiservers
			// sharing one fight over it.
			bin, args = "unshare", append([]string{"--uts", "--", "/bin/sh", "-c", `hostname "$0" && exec "$@"`,
				fmt.Sprintf("kube-apiserver-%d", k.idx), k.bin}, args...)
		}
		k.proc = startChild(b, name, k.dir, bin, args)
		k.cursor = &logCursor{path: k.proc.logPath}
		k.logs = append(k.logs, k.cursor)
	}
}

// stopKubes stops kubes at once (SIGTERM, as a rolling restart does);
// account: in a phase, whose metrics are read first.
func (cp *controlPlane) stopKubes(b *testing.B, kubes []*cpKube, account bool) {
	b.Helper()
	if account {
		for _, k := range kubes {
			if m, err := k.scrape(); err == nil {
				k.acc.add(m, 1)
				k.acc.add(k.base, -1)
			} else {
				b.Logf("kube-apiserver %d: its metrics before it stopped: %v", k.idx, err)
			}
			k.base = nil
		}
	}
	var wg sync.WaitGroup
	for _, k := range kubes {
		wg.Go(func() { k.proc.stop(b) })
	}
	wg.Wait()
	if account {
		for _, k := range kubes {
			k.cpuAcc += k.cpu() - k.cpuBase
			k.cpuBase = 0
		}
	}
}

// waitReady waits until every one of kubes answers /readyz, and returns
// how long that took.
func (cp *controlPlane) waitReady(kubes []*cpKube) (time.Duration, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), *cpTimeout)
	defer cancel()
	errs := make(chan error, len(kubes))
	for _, k := range kubes {
		go func() { errs <- k.waitReady(ctx) }()
	}
	var first error
	for range kubes {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return time.Since(start), first
}

func (k *cpKube) waitReady(ctx context.Context) error {
	for {
		if err := k.proc.alive(); err != nil {
			return err
		}
		if k.hc == nil {
			if pem, err := os.ReadFile(k.certFile()); err == nil {
				pool := x509.NewCertPool()
				if pool.AppendCertsFromPEM(pem) {
					k.hc = &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
						TLSClientConfig:   &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"},
						DisableKeepAlives: true,
					}}
				}
			}
		}
		if k.hc != nil {
			if _, err := k.get(ctx, "/readyz"); err == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kube-apiserver %d not ready: %v", k.idx, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (k *cpKube) get(ctx context.Context, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", k.url()+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+k.token)
	resp, err := k.hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := readAll(resp)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", path, resp.Status)
	}
	return body, nil
}
