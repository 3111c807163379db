package clients

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// etcdCluster is an etcd cluster of member processes, each on its own
// client and peer ports on loopback.
type etcdCluster struct {
	members []*etcdProc
	args    [][]string // each member's command line, for restarts
	starts  []int      // how many times each member was started
}

// startEtcdCluster starts an n-member cluster of .tools/bin/etcd and waits
// until every member is ready (it has a leader and serves reads).
func startEtcdCluster(t testing.TB, n int, extra ...string) *etcdCluster {
	t.Helper()
	return startEtcdClusterOf(t, etcdBin(t), n, extra...)
}

// startEtcdClusterOf starts an n-member cluster of the etcd binary bin.
func startEtcdClusterOf(t testing.TB, bin string, n int, extra ...string) *etcdCluster {
	t.Helper()
	ports := testsupport.FreePorts(t, 2*n)
	var initial []string
	for i := range n {
		initial = append(initial, fmt.Sprintf("m%d=http://127.0.0.1:%d", i, ports[2*i+1]))
	}
	c := &etcdCluster{}
	for i := range n {
		name := fmt.Sprintf("m%d", i)
		addr := fmt.Sprintf("127.0.0.1:%d", ports[2*i])
		peerURL := fmt.Sprintf("http://127.0.0.1:%d", ports[2*i+1])
		args := append([]string{
			"--name=" + name,
			"--data-dir=" + filepath.Join(t.TempDir(), name+".etcd"),
			"--listen-client-urls=http://" + addr,
			"--advertise-client-urls=http://" + addr,
			"--listen-peer-urls=" + peerURL,
			"--initial-advertise-peer-urls=" + peerURL,
			"--initial-cluster=" + strings.Join(initial, ","),
			"--initial-cluster-state=new",
			"--log-level=warn",
		}, extra...)
		p := startProcess(t, name, bin, args)
		c.members = append(c.members, &etcdProc{process: p, addr: addr, url: "http://" + addr})
		c.args = append(c.args, args)
		c.starts = append(c.starts, 1)
	}
	for _, m := range c.members {
		waitUntil(t, 30*time.Second, m.name+" /readyz", func() (bool, error) { return httpOK(m.url + "/readyz") }, m.process)
	}
	return c
}

// restart stops member i gracefully (SIGTERM), as a rolling restart or
// upgrade does, starts bin on its data directory with its flags, and waits
// until it is ready.
func (c *etcdCluster) restart(t testing.TB, i int, bin string) {
	t.Helper()
	m := c.members[i]
	m.stop(t)
	c.starts[i]++
	name := fmt.Sprintf("m%d", i)
	p := startProcess(t, fmt.Sprintf("%s-%d", name, c.starts[i]), bin, c.args[i])
	c.members[i] = &etcdProc{process: p, addr: m.addr, url: m.url}
	waitUntil(t, 30*time.Second, name+" /readyz after its restart", func() (bool, error) { return httpOK(m.url + "/readyz") }, p)
}

// endpoints are the members' client URLs, comma-separated, as --endpoints
// takes them.
func (c *etcdCluster) endpoints() string {
	var urls []string
	for _, m := range c.members {
		urls = append(urls, m.url)
	}
	return strings.Join(urls, ",")
}

// member returns the member whose client address is addr.
func (c *etcdCluster) member(t testing.TB, addr string) *etcdProc {
	t.Helper()
	for _, m := range c.members {
		if m.addr == addr {
			return m
		}
	}
	t.Fatalf("no member at %q", addr)
	return nil
}

// status asks member m alone for its Status.
func (m *etcdProc) status() (*clientv3.StatusResponse, error) {
	return alone(m, func(ctx context.Context, cli *clientv3.Client) (*clientv3.StatusResponse, error) {
		return cli.Status(ctx, m.addr)
	})
}

// get reads key from member m alone, serializably: the member's own
// answer, whichever its release.
func (m *etcdProc) get(key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	return alone(m, func(ctx context.Context, cli *clientv3.Client) (*clientv3.GetResponse, error) {
		return cli.Get(ctx, key, append(opts, clientv3.WithSerializable())...)
	})
}

// alone makes call with a client of member m alone, within 2 s.
func alone[T any](m *etcdProc, call func(context.Context, *clientv3.Client) (T, error)) (T, error) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{m.addr}, DialTimeout: 2 * time.Second})
	if err != nil {
		var zero T
		return zero, err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return call(ctx, cli)
}

// hang stops the member's process (SIGSTOP), as a stalled host would: its
// connections stay open and nothing on them is answered. The returned
// function resumes it (SIGCONT), as does the test's end.
func (m *etcdProc) hang(t testing.TB) (resume func()) {
	t.Helper()
	pid := m.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP %s: %v", m.name, err)
	}
	resume = func() { _ = syscall.Kill(pid, syscall.SIGCONT) }
	// Before the process's own cleanup, which SIGTERMs it: registered
	// later, so run earlier.
	t.Cleanup(resume)
	return resume
}
