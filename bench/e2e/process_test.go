package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// proxyBinary is $SNAPCACHE_BIN, else the binary `make build` builds.
func proxyBinary(tb testing.TB) string {
	return requireBinary(tb, "SNAPCACHE_BIN", "../../bin/etcd-snapcache", "build it with `make build`")
}

// child is a process the benchmark started, its output in a log file.
type child struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed once the process has exited
}

// startChild starts bin with args, its output in dir/name.log; it is
// stopped (SIGTERM, then SIGKILL after stopTimeout) when the benchmark
// ends.
func startChild(tb testing.TB, name, dir, bin string, args []string) *child {
	tb.Helper()
	c := &child{name: name, logPath: filepath.Join(dir, name+".log"), done: make(chan struct{})}
	logf, err := os.Create(c.logPath)
	if err != nil {
		tb.Fatal(err)
	}
	c.cmd = exec.Command(bin, args...)
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	if err := c.cmd.Start(); err != nil {
		logf.Close()
		tb.Fatalf("starting %s: %v", name, err)
	}
	go func() {
		c.cmd.Wait()
		logf.Close()
		close(c.done)
	}()
	tb.Cleanup(func() { c.stop(tb) })
	return c
}

// alive is nil while the process runs, else an error with its log's tail.
func (c *child) alive() error {
	select {
	case <-c.done:
		return fmt.Errorf("%s exited: %s", c.name, tailOf(c.logPath))
	default:
		return nil
	}
}

func (c *child) pid() string { return strconv.Itoa(c.cmd.Process.Pid) }

func (c *child) stop(tb testing.TB) {
	select {
	case <-c.done:
		return
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(stopTimeout):
		tb.Logf("%s did not stop within %v of SIGTERM; killing it", c.name, stopTimeout)
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// proxyProcess is etcd-snapcache run as a separate process, as users run
// it: `etcd-snapcache serve --endpoints=...` with grpc-proxy's flags.
type proxyProcess struct {
	*child
	endpoint   string // http(s)://127.0.0.1:port, the etcd API
	metricsURL string // http://127.0.0.1:port of --metrics-addr
	gen        int    // restarts so far
}

// startProxyProcess starts the proxy binary in front of the etcd at
// upstream, serving on a free loopback port with its HTTP endpoints also on
// --metrics-addr, and waits until its /readyz answers 200 (it has loaded
// the keyspace and follows etcd). It is stopped (SIGTERM) when the
// benchmark ends.
func startProxyProcess(tb testing.TB, upstream string, extra ...string) *proxyProcess {
	tb.Helper()
	return startProxyProcessTLS(tb, upstream, false, extra...)
}

// startProxyProcessTLS is startProxyProcess serving its clients over TLS
// if secure (extra then holds the serving flags); --metrics-addr stays
// plaintext.
func startProxyProcessTLS(tb testing.TB, upstream string, secure bool, extra ...string) *proxyProcess {
	tb.Helper()
	ports := testsupport.FreePorts(tb, 2)
	dir := tb.TempDir()
	scheme := "http"
	if secure {
		scheme = "https"
	}
	p := &proxyProcess{
		endpoint:   fmt.Sprintf("%s://127.0.0.1:%d", scheme, ports[0]),
		metricsURL: fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
	}
	args := append([]string{
		"serve",
		"--endpoints=" + upstream,
		fmt.Sprintf("--listen-addr=127.0.0.1:%d", ports[0]),
		"--metrics-addr=" + p.metricsURL,
		"--data-dir=" + filepath.Join(dir, "data"),
		"--log-level=warn",
	}, extra...)
	p.child = startChild(tb, "etcd-snapcache", dir, proxyBinary(tb), args)
	p.waitReady(tb)
	return p
}

// waitReady waits until the proxy's /readyz answers 200.
func (p *proxyProcess) waitReady(tb testing.TB) {
	tb.Helper()
	testsupport.Poll(tb, startTimeout, 50*time.Millisecond, "etcd-snapcache to be ready", func() (bool, error) {
		if err := p.alive(); err != nil {
			tb.Fatal(err)
		}
		_, err := httpGet(p.metricsURL + "/readyz")
		return err == nil, err
	})
}

// restart stops the proxy (SIGTERM, as a rolling update does) and starts
// it again with the same flags, ports and data directory, and waits until
// it is ready: it loads the keyspace from etcd again. It returns the time
// from the new process's start to its readiness.
func (p *proxyProcess) restart(tb testing.TB) time.Duration {
	tb.Helper()
	p.stop(tb)
	p.gen++
	dir := filepath.Dir(p.logPath)
	start := time.Now()
	p.child = startChild(tb, fmt.Sprintf("etcd-snapcache.%d", p.gen), dir, p.cmd.Path, p.cmd.Args[1:])
	p.waitReady(tb)
	return time.Since(start)
}

// handover hands the proxy over to a new process of it (SIGHUP, as the
// systemd unit's reload does): the new one takes the listening sockets and
// the copy on disk, and the old one drains once the new one is ready. It
// waits until the old one has exited and the new one is ready, and
// returns how long that took. The proxy must log at level info, where it
// names the new process.
func (p *proxyProcess) handover(tb testing.TB) time.Duration {
	tb.Helper()
	start := time.Now()
	old := p.child
	if err := old.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		tb.Fatal(err)
	}
	// The old process names the new one in its log; it may have exited
	// by the time it is read. Whatever happens, it is stopped at the end.
	tb.Cleanup(func() {
		b, _ := os.ReadFile(old.logPath)
		testsupport.StopPid(tb, testsupport.HandedOverTo(string(b)))
	})
	var pid int
	testsupport.Poll(tb, startTimeout, 10*time.Millisecond, "the process taking over", func() (bool, error) {
		b, _ := os.ReadFile(old.logPath)
		pid = testsupport.HandedOverTo(string(b))
		return pid != 0, nil
	})
	select {
	case <-old.done:
	case <-time.After(startTimeout):
		tb.Fatalf("the old process did not exit after handing over: %s", tailOf(old.logPath))
	}
	p.child = adopt(tb, old, pid)
	p.gen++
	p.waitReady(tb)
	return time.Since(start)
}

// adopt is the process pid, which from started (a handover), as a child of
// the benchmark: from's name, log and command line; stopped when the
// benchmark ends. It is not the benchmark's child: its end is polled.
func adopt(tb testing.TB, from *child, pid int) *child {
	tb.Helper()
	proc, err := os.FindProcess(pid)
	if err != nil {
		tb.Fatal(err)
	}
	c := &child{name: from.name, logPath: from.logPath, done: make(chan struct{}),
		cmd: &exec.Cmd{Path: from.cmd.Path, Args: from.cmd.Args, Process: proc}}
	go func() {
		defer close(c.done)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for testsupport.ProcessRuns(pid) {
			<-t.C
		}
	}()
	tb.Cleanup(func() { c.stop(tb) })
	return c
}

// metrics scrapes the proxy's own metrics (/proxy/metrics: its /metrics
// relays etcd's, as grpc-proxy's does), for what its status does not say:
// the runtime's, the copy on disk's, the memory limit.
func (p *proxyProcess) metrics(tb testing.TB) metricSet {
	tb.Helper()
	return scrape(tb, p.metricsURL+"/proxy/metrics")
}

// status reads the proxy's status document (/proxy/status): its cache's
// revisions and the Range requests it counted, which a scrape of its
// metrics would cost it more CPU to say.
func (p *proxyProcess) status(tb testing.TB) proxystatus.Status {
	tb.Helper()
	body, err := httpGet(p.metricsURL + proxystatus.Path)
	if err != nil {
		tb.Fatalf("reading the proxy's status: %v", err)
	}
	var st proxystatus.Status
	if err := json.Unmarshal(body, &st); err != nil {
		tb.Fatalf("reading the proxy's status: %s: %v", proxystatus.Path, err)
	}
	return st
}

// metrics scrapes etcd's /metrics, which it serves on its client URL.
func (e *etcdProcess) metrics(tb testing.TB) metricSet {
	tb.Helper()
	return scrape(tb, e.metricsURL+"/metrics")
}

func tailOf(path string) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(lines[max(len(lines)-20, 0):], "\n")
}

// metricsHTTP fetches the HTTP endpoints without keeping connections
// alive, so that no transport goroutine outlives a benchmark (goleak).
var metricsHTTP = &http.Client{
	Timeout:   10 * time.Second,
	Transport: &http.Transport{DisableKeepAlives: true},
}

// httpGet returns the body of GET url, or an error unless it answers 200.
func httpGet(url string) ([]byte, error) {
	return getURL(metricsHTTP, url)
}

// getURL is httpGet with client c.
func getURL(c *http.Client, url string) ([]byte, error) {
	resp, err := c.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s: %s", url, resp.Status, bytes.TrimSpace(body))
	}
	return body, nil
}

// metricSet is a Prometheus text exposition: its sample lines.
type metricSet []string

func scrape(tb testing.TB, url string) metricSet {
	tb.Helper()
	body, err := httpGet(url)
	if err != nil {
		tb.Fatalf("scraping metrics: %v", err)
	}
	var ms metricSet
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if line := sc.Text(); line != "" && line[0] != '#' {
			ms = append(ms, line)
		}
	}
	return ms
}

// sum is the sum of the samples of metric name whose labels include every
// one of labels (each `key="value"`).
func (ms metricSet) sum(name string, labels ...string) float64 {
	total := 0.0
outer:
	for _, line := range ms {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		var lbls string
		if rest[0] == '{' {
			end := strings.LastIndexByte(rest, '}')
			if end < 0 {
				continue
			}
			lbls, rest = rest[1:end], rest[end+1:]
		}
		for _, l := range labels {
			if !strings.Contains(lbls, l) {
				continue outer
			}
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err == nil {
			total += v
		}
	}
	return total
}

// clockTick is a tick of /proc/<pid>/stat's utime and stime: USER_HZ is
// 100 on every Linux ABI.
const clockTick = 10 * time.Millisecond

// processCPU is the user+system CPU time process pid has used so far, from
// /proc/<pid>/stat ("self" for this process).
func processCPU(tb testing.TB, pid string) time.Duration {
	tb.Helper()
	stat, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		tb.Fatalf("reading CPU time: %v", err)
	}
	// The command name (field 2) is parenthesised and may contain spaces;
	// utime and stime are fields 14 and 15, the 12th and 13th after it.
	i := bytes.LastIndexByte(stat, ')')
	f := strings.Fields(string(stat[i+1:]))
	if i < 0 || len(f) < 13 {
		tb.Fatalf("unexpected /proc/%s/stat: %q", pid, stat)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		tb.Fatalf("unexpected /proc/%s/stat: %q", pid, stat)
	}
	return time.Duration(utime+stime) * clockTick
}
