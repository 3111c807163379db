package e2e

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// etcdctlBinary is $ETCDCTL_BIN, else the etcdctl that tools/build.sh
// builds beside etcd: the maintenance phases run the commands operators run.
func etcdctlBinary(tb testing.TB) string {
	return requireBinary(tb, "ETCDCTL_BIN", "../../.tools/bin/etcdctl", "build it with `make tools-etcd` (tools/build.sh etcd)")
}

// etcd36Binary is $ETCD36_BIN, else the etcd 3.6 that tools/build.sh
// builds beside 3.7's: the downgrade-upgrade phase runs it.
func etcd36Binary(tb testing.TB) string {
	return requireBinary(tb, "ETCD36_BIN", "../../.tools/bin/etcd-3.6", "build it with `make tools-etcd` (tools/build.sh etcd)")
}

// etcdCluster is BenchmarkControlPlane's etcd: one member or several, each
// a process of its own on loopback, with a static --initial-cluster. The
// maintenance phases stop, restart, hang, replace and cut off its members,
// so a member keeps what it needs to start again (its flags and data
// directory) and what its exited processes did (CPU, requests), which the
// phases' accounting adds to the running process's.
type etcdCluster struct {
	members   []*etcdMember
	clientTLS *tls.Config // what a client presents, with -snapcache.e2e.tls; else nil
	extra     []string    // every member's extra flags (serving TLS, pprof)
	token     string      // --initial-cluster-token
}

// etcdMember is one member. Its client, peer and metrics ports stay the
// same across its processes, so the endpoints the clients were given stay
// valid; relay, if set, is what the clients were given instead of its
// client URL (the cut-connection phase).
type etcdMember struct {
	*etcdProcess
	name     string
	dir      string // the member's directory: its logs, and data/
	peer     string
	gen      int              // processes started so far
	bin      string           // the etcd binary its next process runs; "": etcdBinary's
	cli      *clientv3.Client // to this member alone, never through relay
	relay    *testsupport.Relay
	cpuDone  time.Duration      // the CPU of its exited processes
	reqsDone map[string]float64 // their requests by gRPC method (grpc_server_handled_total)
}

// startEtcdCluster starts n members at once (a member waits for a quorum
// before it serves) and waits until each serves. One member is the
// single-member etcd of startEtcdTLS.
func startEtcdCluster(tb testing.TB, n int, clientTLS *tls.Config, extra ...string) *etcdCluster {
	tb.Helper()
	c := &etcdCluster{clientTLS: clientTLS, extra: extra, token: fmt.Sprintf("bench-%d", time.Now().UnixNano())}
	var initial []string
	for i := range n {
		ports := testsupport.FreePorts(tb, 3)
		m := &etcdMember{name: "bench", dir: tb.TempDir(), reqsDone: map[string]float64{},
			peer: fmt.Sprintf("http://127.0.0.1:%d", ports[1])}
		if n > 1 {
			m.name = fmt.Sprintf("m%d", i)
		}
		m.etcdProcess = &etcdProcess{endpoint: fmt.Sprintf("http://127.0.0.1:%d", ports[0])}
		m.metricsURL = m.endpoint
		if clientTLS != nil {
			m.endpoint = fmt.Sprintf("https://127.0.0.1:%d", ports[0])
			m.metricsURL = fmt.Sprintf("http://127.0.0.1:%d", ports[2])
		}
		c.members = append(c.members, m)
		initial = append(initial, m.name+"="+m.peer)
	}
	for _, m := range c.members {
		m.launch(tb, c, strings.Join(initial, ","), "new")
		m.cli = dial(tb, m.endpoint, clientTLS, "", "")
	}
	for _, m := range c.members {
		c.waitServes(tb, m)
	}
	return c
}

// launch starts a process of member m with the cluster's flags, joining
// initialCluster in state "new" or "existing". Without fsync: the
// benchmarks measure the proxy, not the disk.
func (m *etcdMember) launch(tb testing.TB, c *etcdCluster, initialCluster, state string) {
	tb.Helper()
	args := []string{
		"--name=" + m.name,
		"--data-dir=" + filepath.Join(m.dir, "data"),
		"--listen-client-urls=" + m.endpoint, "--advertise-client-urls=" + m.endpoint,
		"--listen-peer-urls=" + m.peer, "--initial-advertise-peer-urls=" + m.peer,
		"--initial-cluster=" + initialCluster,
		"--initial-cluster-state=" + state,
		"--initial-cluster-token=" + c.token,
		"--unsafe-no-fsync",
		"--quota-backend-bytes=8589934592",
		"--log-level=warn",
	}
	if m.metricsURL != m.endpoint {
		args = append(args, "--listen-metrics-urls="+m.metricsURL)
	}
	name := "etcd"
	if len(c.members) > 1 {
		name = "etcd-" + m.name
	}
	if m.gen > 0 {
		name = fmt.Sprintf("%s.%d", name, m.gen)
	}
	m.gen++
	bin := m.bin
	if bin == "" {
		bin = etcdBinary(tb)
	}
	m.child = startChild(tb, name, m.dir, bin, append(args, c.extra...))
}

// waitServes waits until member m answers a serializable read: it is up,
// and so is the cluster's quorum when it first starts.
func (c *etcdCluster) waitServes(tb testing.TB, m *etcdMember) {
	tb.Helper()
	testsupport.Poll(tb, startTimeout, 50*time.Millisecond, "etcd member "+m.name+" to serve", func() (bool, error) {
		if err := m.alive(); err != nil {
			tb.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := m.cli.Get(ctx, "health")
		return err == nil, err
	})
}

// waitHealthy waits until every member answers Status with no error and
// the same leader, and a quorum read succeeds: the end of a maintenance
// step, before the next one.
func (c *etcdCluster) waitHealthy(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	testsupport.Poll(tb, timeout, 100*time.Millisecond, "the etcd cluster to be healthy", func() (bool, error) {
		var leader uint64
		for _, m := range c.members {
			if err := m.alive(); err != nil {
				tb.Fatal(err)
			}
			st, err := m.status()
			if err != nil {
				return false, fmt.Errorf("%s: %v", m.name, err)
			}
			if len(st.Errors) > 0 {
				return false, fmt.Errorf("%s: %v", m.name, st.Errors)
			}
			if st.Leader == 0 || (leader != 0 && st.Leader != leader) {
				return false, fmt.Errorf("%s: leader %x", m.name, st.Leader)
			}
			leader = st.Leader
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := c.members[0].cli.Get(ctx, "health")
		return err == nil, err
	})
}

// status is member m's Maintenance.Status.
func (m *etcdMember) status() (*clientv3.StatusResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return m.cli.Status(ctx, m.endpoint)
}

// id is member m's id, from its Status.
func (m *etcdMember) id(tb testing.TB) uint64 {
	tb.Helper()
	st, err := m.status()
	if err != nil {
		tb.Fatalf("etcd member %s: %v", m.name, err)
	}
	return st.Header.MemberId
}

// leader is the member the others follow.
func (c *etcdCluster) leader(tb testing.TB) *etcdMember {
	tb.Helper()
	c.waitHealthy(tb, *cpTimeout)
	st, err := c.members[0].status()
	if err != nil {
		tb.Fatal(err)
	}
	for _, m := range c.members {
		if m.id(tb) == st.Leader {
			return m
		}
	}
	tb.Fatalf("etcd leader %x is no member", st.Leader)
	return nil
}

// clientEndpoint is what clients are given for member m: its relay's
// address if it has one, else its client URL.
func (m *etcdMember) clientEndpoint() string {
	if m.relay == nil {
		return m.endpoint
	}
	scheme, _, _ := strings.Cut(m.endpoint, "://")
	return scheme + "://" + m.relay.Addr()
}

// clientEndpoints is every member's clientEndpoint, comma-separated: a
// kube-apiserver's --etcd-servers, a proxy's --endpoints.
func (c *etcdCluster) clientEndpoints() string {
	var eps []string
	for _, m := range c.members {
		eps = append(eps, m.clientEndpoint())
	}
	return strings.Join(eps, ",")
}

// directEndpoints is every member's client URL, never through a relay:
// the benchmark's own clients, which no fault is meant to touch.
func (c *etcdCluster) directEndpoints() []string {
	var eps []string
	for _, m := range c.members {
		eps = append(eps, m.endpoint)
	}
	return eps
}

// retire accounts for the process of m that is about to end: its
// requests (read now, while it still answers) and, once it has exited, its
// CPU (retired).
func (m *etcdMember) retire(tb testing.TB) {
	tb.Helper()
	for k, v := range byLabel(m.metrics(tb), "grpc_server_handled_total", "grpc_method") {
		m.reqsDone[k] += v
	}
}

// retired adds the CPU of m's exited process to cpuDone.
func (m *etcdMember) retired() {
	if st := m.cmd.ProcessState; st != nil {
		m.cpuDone += st.UserTime() + st.SystemTime()
	}
}

// cpu is the CPU every process of m has used.
func (m *etcdMember) cpu() time.Duration {
	if m.alive() != nil {
		return m.cpuDone
	}
	d, _ := cpuOf(m.cmd.Process.Pid)
	return m.cpuDone + d
}

// reqs is the requests every process of m has handled, by gRPC method.
func (m *etcdMember) reqs(ms metricSet) map[string]float64 {
	out := byLabel(ms, "grpc_server_handled_total", "grpc_method")
	for k, v := range m.reqsDone {
		out[k] += v
	}
	return out
}

// restart stops member m (SIGTERM, as a rolling restart does) and starts
// it again on its data, and waits until it serves. It returns how long
// the old process took to exit.
func (c *etcdCluster) restart(tb testing.TB, m *etcdMember) time.Duration {
	tb.Helper()
	m.retire(tb)
	start := time.Now()
	m.stop(tb)
	stopped := time.Since(start)
	m.retired()
	m.launch(tb, c, c.initialCluster(), "existing")
	c.waitServes(tb, m)
	return stopped
}

// initialCluster is the cluster's members as --initial-cluster gives them.
func (c *etcdCluster) initialCluster() string {
	var s []string
	for _, m := range c.members {
		s = append(s, m.name+"="+m.peer)
	}
	return strings.Join(s, ",")
}

// signal sends sig to member m's process (SIGSTOP, SIGCONT, SIGKILL).
func (m *etcdMember) signal(tb testing.TB, sig syscall.Signal) {
	tb.Helper()
	if err := m.cmd.Process.Signal(sig); err != nil {
		tb.Fatalf("etcd member %s: %v: %v", m.name, sig, err)
	}
}

// etcdctl runs etcdctl against endpoint with args, over mTLS with a
// certificate that names no user when the cluster serves mTLS, and
// returns its output.
func (c *etcdCluster) etcdctl(tb testing.TB, pki *mtlsPKI, endpoint string, args ...string) string {
	tb.Helper()
	out, err := c.tryEtcdctl(tb, pki, endpoint, args...)
	if err != nil {
		tb.Fatalf("etcdctl %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return out
}

// tryEtcdctl is etcdctl, returning its failure.
func (c *etcdCluster) tryEtcdctl(tb testing.TB, pki *mtlsPKI, endpoint string, args ...string) (string, error) {
	tb.Helper()
	full := []string{"--endpoints=" + endpoint, "--command-timeout=2m"}
	if pki != nil {
		full = append(full, pki.upstream()...)
	}
	full = append(full, args...)
	out, err := exec.Command(etcdctlBinary(tb), full...).CombinedOutput()
	return string(out), err
}

// replace replaces member m, lost with its data, as an operator does: it
// is killed (SIGKILL), removed from the cluster, its data wiped, added
// again under its name and URLs, and started to join the cluster as it is.
func (c *etcdCluster) replace(tb testing.TB, pki *mtlsPKI, m *etcdMember) {
	tb.Helper()
	id := m.id(tb)
	m.retire(tb)
	m.signal(tb, syscall.SIGKILL)
	<-m.done
	m.retired()
	var other *etcdMember
	for _, o := range c.members {
		if o != m {
			other = o
			break
		}
	}
	c.etcdctl(tb, pki, other.endpoint, "member", "remove", strconv.FormatUint(id, 16))
	if err := os.RemoveAll(filepath.Join(m.dir, "data")); err != nil {
		tb.Fatal(err)
	}
	c.etcdctl(tb, pki, other.endpoint, "member", "add", m.name, "--peer-urls="+m.peer)
	m.launch(tb, c, c.initialCluster(), "existing")
	c.waitServes(tb, m)
}

// memberCPU is the CPU every member has used, by member.
func (c *etcdCluster) memberCPU() []time.Duration {
	out := make([]time.Duration, len(c.members))
	for i, m := range c.members {
		out[i] = m.cpu()
	}
	return out
}

// metrics is every member's metrics, one after the other: sum and byLabel
// over them are the cluster's.
func (c *etcdCluster) metrics(tb testing.TB) metricSet {
	tb.Helper()
	var ms metricSet
	for _, m := range c.members {
		ms = append(ms, m.metrics(tb)...)
	}
	return ms
}

// reqs is the requests every member has handled, by gRPC method, across
// their processes.
func (c *etcdCluster) reqs(tb testing.TB) map[string]float64 {
	tb.Helper()
	out := map[string]float64{}
	for _, m := range c.members {
		for k, v := range m.reqs(m.metrics(tb)) {
			out[k] += v
		}
	}
	return out
}

// pids is every member's running process.
func (c *etcdCluster) pids() []int {
	var out []int
	for _, m := range c.members {
		out = append(out, m.cmd.Process.Pid)
	}
	return out
}

// children is every member's running process, for the liveness checks.
func (c *etcdCluster) children() []*child {
	var out []*child
	for _, m := range c.members {
		out = append(out, m.child)
	}
	return out
}

// mem is the members' resident memory and peak, summed.
func (c *etcdCluster) mem() (rss, peak int64) {
	for _, m := range c.members {
		r, p := memOf(m.cmd.Process.Pid)
		rss += r
		peak += p
	}
	return rss, peak
}
