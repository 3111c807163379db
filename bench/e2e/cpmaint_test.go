package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// cpPhaseDef is a phase BenchmarkControlPlane can run in a side's pass. A
// phase is either a run of its own (the storms, steady state, the
// restarts of kube-apiservers and of the proxy) or a maintenance fault on
// etcd (fault), which maintenance runs under the steady load and
// measures the same way for both sides, so that a fault through the proxy
// stands beside the same fault direct.
type cpPhaseDef struct {
	name       string
	proxyOnly  bool // the proxy side's alone
	minMembers int  // the etcd members it needs
	run        func(cp *controlPlane, b *testing.B, side string, load *kubeload, round int) cpPhase
	// fault does the maintenance on etcd and returns once it is undone
	// (every member healthy again), with what it did, for the report.
	fault func(cp *controlPlane, b *testing.B, side string) string
}

// cpPhaseTable is every phase, in the order -snapcache.e2e.cp-phases
// lists them by default. start-storm is run by pass itself.
var cpPhaseTable = []cpPhaseDef{
	{name: "start-storm"},
	{name: "steady", run: func(cp *controlPlane, b *testing.B, side string, load *kubeload, round int) cpPhase {
		return cp.steady(b, side, load, round)
	}},
	{name: "restart-all", run: func(cp *controlPlane, b *testing.B, side string, load *kubeload, round int) cpPhase {
		cp.pauseLoad(b, load, true)
		defer cp.pauseLoad(b, load, false)
		return cp.restart(b, side, "restart-all", cp.kubes, load, round)
	}},
	{name: "restart-one", run: func(cp *controlPlane, b *testing.B, side string, load *kubeload, round int) cpPhase {
		return cp.restart(b, side, "restart-one", cp.kubes[:1], load, round)
	}},
	{name: "restart-proxy", proxyOnly: true, run: (*controlPlane).restartProxy},
	{name: "handover-proxy", proxyOnly: true, run: (*controlPlane).handoverProxy},

	{name: "rolling-restart", minMembers: 1, fault: faultRollingRestart},
	{name: "defrag", minMembers: 1, fault: faultDefrag},
	{name: "move-leader", minMembers: 2, fault: faultMoveLeader},
	{name: "hung-leader", minMembers: 3, fault: faultHungLeader},
	{name: "hung-watch-member", minMembers: 3, fault: faultHungWatchMember},
	{name: "lost-member", minMembers: 3, fault: faultLostMember},
	{name: "cut-connection", minMembers: 1, fault: faultCutConnection},
	{name: "downgrade-upgrade", minMembers: 1, fault: faultDowngradeUpgrade},
}

// cpPhaseNames lists the phases, for the flag's usage.
func cpPhaseNames() string {
	var names []string
	for _, p := range cpPhaseTable {
		names = append(names, p.name)
	}
	return strings.Join(names, ", ")
}

// cpSelectPhases is the phases of list (comma-separated), in its order.
func cpSelectPhases(list string) ([]cpPhaseDef, error) {
	var out []cpPhaseDef
	for name := range strings.SplitSeq(list, ",") {
		name = strings.TrimSpace(name)
		i := slices.IndexFunc(cpPhaseTable, func(p cpPhaseDef) bool { return p.name == name })
		if i < 0 {
			return nil, fmt.Errorf("-snapcache.e2e.cp-phases: no phase %q (phases: %s)", name, cpPhaseNames())
		}
		out = append(out, cpPhaseTable[i])
	}
	return out, nil
}

// cpMemberCount is -snapcache.e2e.cp-etcd-members, or by default 3 when a
// maintenance phase is selected (a cluster that keeps a quorum while one
// member is away, as production runs), else 1, as the benchmark always
// ran. It fails if a selected phase needs more members.
func cpMemberCount(b *testing.B, phases []cpPhaseDef) int {
	n := *cpMembers
	if n <= 0 {
		n = 1
		if slices.ContainsFunc(phases, func(p cpPhaseDef) bool { return p.fault != nil }) {
			n = 3
		}
	}
	for _, p := range phases {
		if n < p.minMembers {
			b.Fatalf("phase %s needs %d etcd members; -snapcache.e2e.cp-etcd-members=%d", p.name, p.minMembers, n)
		}
	}
	return n
}

// maintenance is a maintenance phase: the fault under the load, then, as
// after a restart, until every kube-apiserver is ready and every informer
// has caught up (a barrier), then -snapcache.e2e.cp-settle. Beside what
// every phase measures, it takes the fault's own length and, on the proxy
// side, how long a proxy's /readyz was not 200 and how many times a proxy
// reloaded the keyspace or resumed its upstream watch.
func (cp *controlPlane) maintenance(b *testing.B, side string, def cpPhaseDef, load *kubeload) cpPhase {
	ph := cp.begin(b, side, def.name)
	ph.maint = true
	var proxy0 counters
	var logs []*logCursor
	if side == "proxy" {
		proxy0 = cp.proxyCounters(b)
		cp.sampler.pollReady(cp.proxies)
		for _, p := range cp.proxies {
			logs = append(logs, newLogCursorAtEnd(p.logPath))
		}
	}
	start := time.Now()
	ph.faultDesc = def.fault(cp, b, side)
	ph.fault = time.Since(start)
	cp.sampler.setEtcd(cp.etcd.pids())
	progress("%s %s: %s (%.1fs)", side, def.name, ph.faultDesc, ph.fault.Seconds())
	cp.recover(b, ph, load)
	if side == "proxy" {
		ph.proxyNotReady = cp.sampler.pollReady(nil)
		ph.proxyEvents = cp.proxyCounters(b)
		ph.proxyEvents.add(proxy0, -1)
		// Why a proxy reloaded, and its errors; not its warnings, which
		// every resumed watch and lease stream logs.
		n := 0
		for _, lc := range logs {
			for _, line := range lc.lines() {
				if n < 6 && (strings.Contains(line, "reloading the keyspace") || strings.Contains(line, `"level":"error"`)) {
					ph.note("proxy log: " + line[:min(len(line), 400)])
					n++
				}
			}
		}
	}
	return cp.end(b, ph, load)
}

// proxyCounters is what every proxy (in a tiered topology, the inner
// one's too) counted of its upstream so far: loads and reloads of the
// keyspace, resumes of the watch.
func (cp *controlPlane) proxyCounters(b *testing.B) counters {
	c := counters{}
	for _, p := range cp.proxies {
		m := p.metrics(b)
		c["reloads"] += m.sum("etcd_snapcache_reloads_total")
		for reason, n := range byLabel(m, "etcd_snapcache_reloads_total", "reason") {
			c["reload:"+reason] += n
		}
		c["loads"] += m.sum("etcd_snapcache_loads_total")
		c["watch-restarts"] += m.sum("etcd_snapcache_upstream_watch_restarts_total")
	}
	return c
}

// sleep holds the phase for d under the load, checking that every process
// is still alive.
func (cp *controlPlane) sleep(b *testing.B, d time.Duration) {
	cp.hold(b, cp.load, time.Now().Add(d))
}

// faultRollingRestart restarts every member in turn (SIGTERM, then a new
// process on the same data), the next once the cluster is healthy, as an
// operator rolls a configuration change or a patch release.
func faultRollingRestart(cp *controlPlane, b *testing.B, _ string) string {
	var took []string
	for _, m := range cp.etcd.members {
		start := time.Now()
		stop := cp.etcd.restart(b, m)
		cp.sampler.setEtcd(cp.etcd.pids())
		cp.etcd.waitHealthy(b, *cpTimeout)
		took = append(took, fmt.Sprintf("%s %.1fs (exit %.1fs)", m.name, time.Since(start).Seconds(), stop.Seconds()))
	}
	return "restarted in turn, each until healthy (of which its exit after SIGTERM): " + strings.Join(took, ", ")
}

// The defrag phase's churn: keys of a prefix no kube-apiserver reads,
// written then deleted, so that the compaction after them leaves free
// pages for defrag to give back, as deleted objects and compacted
// history leave in a long-running cluster.
const (
	churnPrefix = "/snapcache-bench-churn/"
	churnKeys   = 200
	churnValue  = 64 << 10
)

// faultDefrag churns (churnKeys keys of churnValue bytes written, deleted,
// compacted), then defragments each member in turn with `etcdctl defrag`
// against that member alone, as operators do: a member blocks its reads
// and writes while it defragments.
func faultDefrag(cp *controlPlane, b *testing.B, _ string) string {
	w := newWriter(cp.loader, churnValue, 8)
	w.put(b, churnKeys, func(i int) []byte { return fmt.Appendf(nil, "%s%06d", churnPrefix, i) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	del, err := cp.loader.Delete(ctx, churnPrefix, clientv3.WithPrefix())
	cancel()
	if err != nil {
		b.Fatal(err)
	}
	cp.compact(b, del.Header.Revision)
	dbSize := func() (total, inUse float64) {
		ms := cp.etcd.metrics(b)
		return ms.sum("etcd_mvcc_db_total_size_in_bytes"), ms.sum("etcd_mvcc_db_total_size_in_use_in_bytes")
	}
	total0, inUse0 := dbSize()
	var took []string
	for _, m := range cp.etcd.members {
		start := time.Now()
		cp.etcd.etcdctl(b, cp.pki, m.endpoint, "defrag")
		took = append(took, fmt.Sprintf("%s %.1fs", m.name, time.Since(start).Seconds()))
	}
	total1, _ := dbSize()
	return fmt.Sprintf("churn %d MiB; db (all members) %.0f MiB, %.0f in use, to %.0f MiB; defrag %s",
		churnKeys*churnValue>>20, total0/mib, inUse0/mib, total1/mib, strings.Join(took, ", "))
}

// moveLeaderTimes is how many times move-leader moves the leadership.
const moveLeaderTimes = 3

// faultMoveLeader moves the leadership to the next member, moveLeaderTimes
// times, 5 s apart (`etcdctl move-leader`, sent to the leader), as an
// operator does before taking the leader's machine down.
func faultMoveLeader(cp *controlPlane, b *testing.B, _ string) string {
	var moves []string
	for i := range moveLeaderTimes {
		if i > 0 {
			cp.sleep(b, 5*time.Second)
		}
		from := cp.etcd.leader(b)
		to := cp.etcd.members[(slices.Index(cp.etcd.members, from)+1)%len(cp.etcd.members)]
		id := to.id(b)
		start := time.Now()
		cp.etcd.etcdctl(b, cp.pki, from.endpoint, "move-leader", fmt.Sprintf("%x", id))
		testsupport.Poll(b, *cpTimeout, 50*time.Millisecond, "the leadership to move to "+to.name, func() (bool, error) {
			st, err := to.status()
			if err != nil {
				return false, err
			}
			return st.Leader == id, fmt.Errorf("leader %x", st.Leader)
		})
		moves = append(moves, fmt.Sprintf("%s→%s %.1fs", from.name, to.name, time.Since(start).Seconds()))
	}
	return "leadership moved " + strings.Join(moves, ", ")
}

// hangFor is how long the hung-* phases keep a member stopped.
const hangFor = 15 * time.Second

// hang stops member m (SIGSTOP) for hangFor and lets it go on (SIGCONT):
// a process that neither answers nor closes its connections, as a member
// stuck on a disk, in a long pause or in a frozen VM is. Its peers elect
// a new leader if it led; its clients see requests hang until their
// keepalive or their deadline gives up on it.
func (cp *controlPlane) hang(b *testing.B, side string, m *etcdMember) (found string) {
	watchOn := cp.watchMember(b, side)
	m.signal(b, syscall.SIGSTOP)
	defer m.signal(b, syscall.SIGCONT)
	return cp.holdFinding(b, side, m, watchOn, hangFor)
}

// watchMember is the member of the proxy's upstream watch, as its status
// names it, on the proxy side; "" direct.
func (cp *controlPlane) watchMember(b *testing.B, side string) string {
	if side != "proxy" || len(cp.proxies) == 0 {
		return ""
	}
	return cp.proxies[0].status(b).UpstreamWatchMember
}

// holdFinding is sleep for d while member m is faulty. On the proxy side
// it polls the proxy's status every 100 ms, and says how long the proxy
// took to find the fault: to list m as unresponsive, and, if its upstream
// watch was on m as the fault began (watchOn), to move it off.
func (cp *controlPlane) holdFinding(b *testing.B, side string, m *etcdMember, watchOn string, d time.Duration) string {
	if side != "proxy" || len(cp.proxies) == 0 {
		cp.sleep(b, d)
		return ""
	}
	// The proxy names a member by the address it was given, without
	// the scheme.
	name := m.clientEndpoint()
	name = name[strings.Index(name, "://")+3:]
	start := time.Now()
	avoided, moved := time.Duration(-1), time.Duration(-1)
	poll := time.NewTicker(100 * time.Millisecond)
	defer poll.Stop()
	checked := start
	for time.Since(start) < d {
		<-poll.C
		st := cp.proxies[0].status(b)
		if avoided < 0 && slices.Contains(st.UnresponsiveMembers, name) {
			avoided = time.Since(start)
		}
		if moved < 0 && watchOn == name && st.UpstreamWatchMember != "" && st.UpstreamWatchMember != name {
			moved = time.Since(start)
		}
		if time.Since(checked) >= time.Second {
			cp.checkAlive(b, cp.load)
			checked = time.Now()
		}
	}
	after := func(d time.Duration) string {
		if d < 0 {
			return "not within the fault"
		}
		return fmt.Sprintf("after %.1fs", d.Seconds())
	}
	found := "; the proxy avoided it " + after(avoided)
	if watchOn == name {
		found += ", moved its upstream watch off it " + after(moved)
	}
	return found
}

// faultHungLeader hangs the leader.
func faultHungLeader(cp *controlPlane, b *testing.B, side string) string {
	l := cp.etcd.leader(b)
	streams := cp.etcd.watchStreams(b)
	found := cp.hang(b, side, l)
	cp.etcd.waitHealthy(b, *cpTimeout)
	return fmt.Sprintf("leader %s stopped %v (watch streams %s%s); leader now %s", l.name, hangFor, streams, found, cp.etcd.leader(b).name)
}

// memberCounts is a count by member, as the fault lines give it.
type memberCounts struct {
	c *etcdCluster
	n []float64
}

func (mc memberCounts) String() string {
	var parts []string
	for i, n := range mc.n {
		parts = append(parts, fmt.Sprintf("%s %.0f", mc.c.members[i].name, n))
	}
	return strings.Join(parts, ", ")
}

// watchStreams is each member's watch streams
// (etcd_debugging_mvcc_watch_stream_total, its own): where the side's
// watches are, since neither the proxy nor kube-apiserver says which
// member a watch is on.
func (c *etcdCluster) watchStreams(tb testing.TB) memberCounts {
	mc := memberCounts{c: c}
	for _, m := range c.members {
		mc.n = append(mc.n, m.metrics(tb).sum("etcd_debugging_mvcc_watch_stream_total"))
	}
	return mc
}

// faultHungWatchMember hangs the member that serves the side's watches.
// Direct, that is the member most of the kube-apiservers' watches are on:
// the one with the most watch streams (etcd_debugging_mvcc_watch_stream_total,
// each member's own). Through the proxy, it is the member of the proxy's
// upstream watch, as /proxy/status's upstream_watch_member names it: the
// proxy has two watch streams (the other carries its progress ticks), so
// etcd's counts may tie.
func faultHungWatchMember(cp *controlPlane, b *testing.B, side string) string {
	streams := cp.etcd.watchStreams(b)
	most := 0
	for i, n := range streams.n {
		if n > streams.n[most] {
			most = i
		}
	}
	pick := cp.etcd.members[most]
	leader := cp.etcd.leader(b)
	named := ""
	if on := cp.watchMember(b, side); on != "" {
		// The proxy's other watch (its progress ticks) may be on
		// another member as often: its status says which is the one.
		named = fmt.Sprintf("; the proxy's upstream watch on %s", on)
		for _, m := range cp.etcd.members {
			if strings.HasSuffix(m.clientEndpoint(), "://"+on) {
				pick = m
			}
		}
	}
	found := cp.hang(b, side, pick)
	cp.etcd.waitHealthy(b, *cpTimeout)
	return fmt.Sprintf("%s (%s) stopped %v (watch streams %s%s%s; it led: %v)", pick.name, strings.TrimPrefix(pick.endpoint, "https://"), hangFor, streams, named, found, pick == leader)
}

// faultLostMember loses a follower with its disk and replaces it
// (SIGKILL, member remove, data wiped, member add, a new process joining
// the existing cluster), the way an operator replaces a failed machine.
func faultLostMember(cp *controlPlane, b *testing.B, _ string) string {
	// Not the member behind the relay, if there is one: its
	// replacement would move the watches off it before cut-connection.
	leader := cp.etcd.leader(b)
	var m *etcdMember
	for _, o := range slices.Backward(cp.etcd.members) {
		if o != leader && (m == nil || m.relay != nil) {
			m = o
		}
	}
	cp.etcd.replace(b, cp.pki, m)
	cp.sampler.setEtcd(cp.etcd.pids())
	cp.etcd.waitHealthy(b, *cpTimeout)
	return fmt.Sprintf("follower %s killed, removed, wiped, added and started again", m.name)
}

// cutFor is how long cut-connection holds a member's connections up.
const cutFor = 20 * time.Second

// faultCutConnection holds up, both ways, every connection between the
// side's clients (the kube-apiservers direct, the proxy's upstream through
// it) and the relayed member, for cutFor: the relay's Stall, which relays
// no byte and closes nothing, as a link that drops every packet does
// (Cut would close the connections, which a dead link never does, and
// clients would fail over at once). New connections hang the same way.
// The member and its peers see nothing.
func faultCutConnection(cp *controlPlane, b *testing.B, side string) string {
	m := cp.etcd.members[0]
	conns := m.relay.Conns()
	// Whether the side's watches are on it: through the proxy, the cut
	// delays every event only if the proxy's upstream watch is.
	streams := cp.etcd.watchStreams(b)
	watchOn := cp.watchMember(b, side)
	m.relay.Stall()
	defer m.relay.Flow() // Flow again is a no-op
	found := cp.holdFinding(b, side, m, watchOn, cutFor)
	m.relay.Flow()
	return fmt.Sprintf("clients' connections to %s (%d open) held up %v both ways (watch streams %s%s)", m.name, conns, cutFor, streams, found)
}

func TestCPSelectPhases(t *testing.T) {
	got, err := cpSelectPhases(strings.Join(cpDefaultPhases, ","))
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range got {
		if p.name != cpDefaultPhases[i] || p.fault != nil {
			t.Errorf("default phase %d: %s (fault %v), want %s without a fault", i, p.name, p.fault != nil, cpDefaultPhases[i])
		}
	}
	got, err = cpSelectPhases("steady, lost-member,defrag")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[1].name != "lost-member" || got[1].fault == nil || got[2].name != "defrag" {
		t.Errorf("selected %v", got)
	}
	if _, err := cpSelectPhases("steady,defrg"); err == nil {
		t.Error("an unknown phase was accepted")
	}
}

func TestErrorsByVerb(t *testing.T) {
	c := counters{}
	for _, line := range []string{
		`apiserver_request_total{code="200",component="apiserver",resource="pods",verb="GET"} 100`,
		`apiserver_request_total{code="504",component="apiserver",resource="pods",verb="GET"} 2`,
		`apiserver_request_total{code="500",component="apiserver",resource="pods",verb="PUT"} 1`,
		`apiserver_request_total{code="429",component="apiserver",resource="pods",verb="GET"} 3`,
		`apiserver_request_total{code="503",component="apiserver",resource="",verb="GET"} 7`,
	} {
		c.addRequestSample(line)
	}
	if got, want := c.errorsByVerb(), "GET 429x3 504x2 PUT 500x1"; got != want {
		t.Errorf("errorsByVerb = %q, want %q", got, want)
	}
	if got := (counters{}).errorsByVerb(); got != "-" {
		t.Errorf("errorsByVerb of none = %q, want -", got)
	}
}

// faultDowngradeUpgrade downgrades the cluster from 3.7 to 3.6 by etcd's
// procedure (`etcdctl downgrade validate` and `enable`, every member's
// storage version down to 3.6, then each member restarted on the 3.6
// binary in turn, until the leader ends the downgrade), then upgrades it
// back (each member restarted on 3.7's in turn), and waits until the
// cluster version is 3.7 again, so that the other side's pass can do the
// same.
func faultDowngradeUpgrade(cp *controlPlane, b *testing.B, _ string) string {
	etcd36, etcd37 := etcd36Binary(b), etcdBinary(b)
	leader := cp.etcd.leader(b)
	cp.etcd.etcdctl(b, cp.pki, leader.endpoint, "downgrade", "validate", "3.6")
	cp.etcd.etcdctl(b, cp.pki, leader.endpoint, "downgrade", "enable", "3.6")
	start := time.Now()
	testsupport.Poll(b, *cpTimeout, 100*time.Millisecond, "every member's storage version at 3.6", func() (bool, error) {
		for _, m := range cp.etcd.members {
			st, err := m.status()
			if err != nil {
				return false, err
			}
			if st.StorageVersion != "3.6.0" {
				return false, fmt.Errorf("%s: storage version %q", m.name, st.StorageVersion)
			}
		}
		return true, nil
	})
	storage := time.Since(start)
	roll := func(bin string) string {
		var took []string
		for _, m := range cp.etcd.members {
			start := time.Now()
			m.bin = bin
			cp.etcd.restart(b, m)
			cp.sampler.setEtcd(cp.etcd.pids())
			cp.etcd.waitHealthy(b, *cpTimeout)
			took = append(took, fmt.Sprintf("%s %.1fs", m.name, time.Since(start).Seconds()))
		}
		return strings.Join(took, ", ")
	}
	down := roll(etcd36)
	// The leader ends the downgrade once it sees every member on 3.6
	// (every 5 s by default); a member back on 3.7 before that would
	// keep it enabled for good.
	testsupport.Poll(b, *cpTimeout, 100*time.Millisecond, "the downgrade done", func() (bool, error) {
		for _, m := range cp.etcd.members {
			st, err := m.status()
			if err != nil {
				return false, err
			}
			if st.DowngradeInfo != nil && st.DowngradeInfo.Enabled {
				return false, fmt.Errorf("%s: downgrade to %s still enabled", m.name, st.DowngradeInfo.TargetVersion)
			}
		}
		return true, nil
	})
	up := roll(etcd37)
	for _, m := range cp.etcd.members {
		m.bin = ""
	}
	// The leader raises the cluster version once every member runs 3.7;
	// until it has, a downgrade to 3.6 is refused.
	start = time.Now()
	testsupport.Poll(b, *cpTimeout, 500*time.Millisecond, "the cluster version back at 3.7", func() (bool, error) {
		out, err := cp.etcd.tryEtcdctl(b, cp.pki, cp.etcd.leader(b).endpoint, "downgrade", "validate", "3.6")
		return err == nil, fmt.Errorf("%v: %s", err, out)
	})
	return fmt.Sprintf("storage versions at 3.6 in %.1fs; members on 3.6: %s; back on 3.7: %s; cluster version 3.7 after %.1fs",
		storage.Seconds(), down, up, time.Since(start).Seconds())
}
