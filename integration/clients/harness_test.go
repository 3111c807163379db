package clients

import (
	"bufio"
	"bytes"
	"errors"
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

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// binary returns the absolute path of a program the suites run: $env if set,
// else rel (relative to this package's directory). A missing binary fails
// the test, naming what builds it.
func binary(t testing.TB, env, rel, build string) string {
	t.Helper()
	p := os.Getenv(env)
	if p == "" {
		p = rel
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(abs)
	if err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
		t.Fatalf("%s: no executable at %s (set $%s, or build it from the repository root with `%s`)", filepath.Base(rel), abs, env, build)
	}
	return abs
}

func etcdBin(t testing.TB) string {
	return binary(t, "ETCD_BIN", "../../.tools/bin/etcd", "make tools-etcd` (that is, `tools/build.sh etcd`")
}

func etcdctlBin(t testing.TB) string {
	return binary(t, "ETCDCTL_BIN", "../../.tools/bin/etcdctl", "make tools-etcd` (that is, `tools/build.sh etcd`")
}

// etcd36Bin is the previous release's etcd, for the upgrade and downgrade
// test.
func etcd36Bin(t testing.TB) string {
	return binary(t, "ETCD36_BIN", "../../.tools/bin/etcd-3.6", "make tools-etcd` (that is, `tools/build.sh etcd`")
}

func snapcacheBin(t testing.TB) string {
	return binary(t, "SNAPCACHE_BIN", "../../bin/etcd-snapcache", "make build")
}

func kubeAPIServerBin(t testing.TB) string {
	return binary(t, "KUBE_APISERVER_BIN", "../../.tools/bin/kube-apiserver", "make tools-kube` (that is, `tools/build.sh kube`")
}

// process is a child process whose combined output goes to a log file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed when the process has exited
	err     error         // Wait's result, once done is closed
}

// startProcess starts bin with args; the process is stopped (SIGTERM, then
// SIGKILL after 15 s) when the test ends, and its log's tail is printed if
// the test failed.
func startProcess(t testing.TB, name, bin string, args []string, env ...string) *process {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stop(t)
		p.keepLog(t)
		if t.Failed() {
			t.Logf("--- last lines of %s's log (%s):\n%s", name, logPath, p.tail(60))
		}
	})
	return p
}

// keepLog copies the log to $CLIENTS_LOG_DIR/<test>/<name>.log, if that
// variable is set, so that CI can keep every process's log.
func (p *process) keepLog(t testing.TB) {
	dir := os.Getenv("CLIENTS_LOG_DIR")
	if dir == "" {
		return
	}
	dir = filepath.Join(dir, strings.NewReplacer("/", "_", "=", "-").Replace(t.Name()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Logf("keeping %s's log: %v", p.name, err)
		return
	}
	if err := os.WriteFile(filepath.Join(dir, p.name+".log"), []byte(p.log()), 0o644); err != nil {
		t.Logf("keeping %s's log: %v", p.name, err)
	}
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *process) stop(t testing.TB) {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		t.Logf("%s did not stop within 15s of SIGTERM; killing it", p.name)
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *process) log() string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("(reading %s: %v)", p.logPath, err)
	}
	return string(b)
}

func (p *process) tail(n int) string {
	lines := strings.Split(strings.TrimRight(p.log(), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// waitUntil polls cond every 50ms until it returns true, failing the test
// after timeout with the last error cond returned (testsupport.Poll).
// Processes in watch make it fail early if they exit.
func waitUntil(t testing.TB, timeout time.Duration, what string, cond func() (bool, error), watch ...*process) {
	t.Helper()
	testsupport.Poll(t, timeout, 50*time.Millisecond, what, func() (bool, error) {
		t.Helper()
		ok, err := cond()
		if !ok {
			for _, p := range watch {
				if p.exited() {
					t.Fatalf("waiting for %s: %s exited: %v", what, p.name, p.err)
				}
			}
		}
		return ok, err
	})
}

var plainHTTP = &http.Client{Timeout: 5 * time.Second}

// httpOK reports whether GET url answers 200.
func httpOK(url string) (bool, error) { return httpGetOK(plainHTTP, url) }

// httpGetOK reports whether GET url, sent by hc, answers 200.
func httpGetOK(hc *http.Client, url string) (bool, error) {
	resp, err := hc.Get(url)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Errorf("%s: %s: %s", url, resp.Status, bytes.TrimSpace(body))
	}
	return true, nil
}

// serverTLS is a server's TLS, as etcd's and the proxy's --cert-file,
// --key-file and --trusted-ca-file, and an HTTP client of its HTTP
// endpoints (over mTLS when it verifies client certificates).
type serverTLS struct {
	cert, key, ca string
	client        *http.Client
}

func (st *serverTLS) args() []string {
	return []string{"--cert-file=" + st.cert, "--key-file=" + st.key, "--trusted-ca-file=" + st.ca}
}

// etcdProc is a single-member etcd started from .tools/bin/etcd.
type etcdProc struct {
	*process
	addr string // host:port of the client URL
	url  string // client URL
}

func startEtcd(t testing.TB, name string, extra ...string) *etcdProc {
	t.Helper()
	return startEtcdTLS(t, name, nil, extra...)
}

// startEtcdTLS starts etcd serving its clients with st (nil: plaintext).
func startEtcdTLS(t testing.TB, name string, st *serverTLS, extra ...string) *etcdProc {
	t.Helper()
	bin := etcdBin(t)
	ports := testsupport.FreePorts(t, 2)
	addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	clientURL, hc := "http://"+addr, plainHTTP
	var tlsArgs []string
	if st != nil {
		clientURL, hc, tlsArgs = "https://"+addr, st.client, st.args()
	}
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	args := append(append([]string{
		"--name=" + name,
		"--data-dir=" + filepath.Join(t.TempDir(), name+".etcd"),
		"--listen-client-urls=" + clientURL,
		"--advertise-client-urls=" + clientURL,
		"--listen-peer-urls=" + peerURL,
		"--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=" + name + "=" + peerURL,
		"--initial-cluster-state=new",
		"--log-level=warn",
	}, tlsArgs...), extra...)
	p := startProcess(t, name, bin, args)
	e := &etcdProc{process: p, addr: addr, url: clientURL}
	waitUntil(t, 30*time.Second, name+" /readyz", func() (bool, error) { return httpGetOK(hc, clientURL+"/readyz") }, p)
	return e
}

// proxyProc is etcd-snapcache serve, started from bin/etcd-snapcache.
type proxyProc struct {
	*process
	addr        string // host:port of the gRPC endpoint
	url         string
	metricsAddr string
	// own is where the proxy's own HTTP endpoints (/proxy/metrics,
	// /readyz) are read, with hc: --metrics-addr in plaintext, or the
	// client port when it serves TLS.
	own string
	hc  *http.Client
}

func startProxy(t testing.TB, name, upstream string, extra ...string) *proxyProc {
	t.Helper()
	return startProxyTLS(t, name, upstream, nil, extra...)
}

// startProxyTLS starts the proxy serving its clients with st (nil:
// plaintext). Its own HTTP endpoints are then read on its client port,
// through st's client.
func startProxyTLS(t testing.TB, name, upstream string, st *serverTLS, extra ...string) *proxyProc {
	t.Helper()
	bin := snapcacheBin(t)
	ports := testsupport.FreePorts(t, 2)
	addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	metrics := fmt.Sprintf("127.0.0.1:%d", ports[1])
	px := &proxyProc{addr: addr, url: "http://" + addr, metricsAddr: metrics, own: "http://" + metrics, hc: plainHTTP}
	var tlsArgs []string
	if st != nil {
		px.url, px.own, px.hc, tlsArgs = "https://"+addr, "https://"+addr, st.client, st.args()
	}
	args := append(append([]string{
		"serve",
		"--endpoints=" + upstream,
		"--listen-addr=" + addr,
		"--metrics-addr=" + metrics,
		"--advertise-client-url=" + px.url,
		// The copy on disk in the test's own directory (a later
		// --data-dir in extra wins).
		"--data-dir=" + filepath.Join(t.TempDir(), name+".data"),
		// Compactions made directly on etcd are noticed within 100ms.
		"--compaction-probe-interval=100ms",
	}, tlsArgs...), extra...)
	px.process = startProcess(t, name, bin, args)
	waitUntil(t, 30*time.Second, name+" /readyz", func() (bool, error) { return httpGetOK(px.hc, px.own+"/readyz") }, px.process)
	return px
}

// metric returns the value of an unlabelled etcd_snapcache_ metric.
func (px *proxyProc) metric(name string) (float64, error) {
	resp, err := px.hc.Get(px.own + "/proxy/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	full := "etcd_snapcache_" + name
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, full+" "); ok {
			return strconv.ParseFloat(strings.TrimSpace(rest), 64)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("metric %s not found", full)
}

// metricLines returns the proxy's metric lines whose name starts with
// etcd_snapcache_<prefix>, without comments.
func (px *proxyProc) metricLines(prefix string) ([]string, error) {
	resp, err := px.hc.Get(px.own + "/proxy/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	var out []string
	for l := range strings.SplitSeq(string(b), "\n") {
		if strings.HasPrefix(l, "etcd_snapcache_"+prefix) {
			out = append(out, l)
		}
	}
	return out, nil
}

// waitCompactRevision waits until the proxy has mirrored etcd's compaction
// at rev, which it learns within --compaction-probe-interval when the
// compaction was not sent through it.
func (px *proxyProc) waitCompactRevision(t testing.TB, rev int64) {
	t.Helper()
	waitUntil(t, 10*time.Second, fmt.Sprintf("the proxy to mirror compaction at %d", rev), func() (bool, error) {
		v, err := px.metric("compact_revision")
		if err != nil {
			return false, err
		}
		if int64(v) < rev {
			return false, fmt.Errorf("compact_revision %v", v)
		}
		return true, nil
	}, px.process)
}

// lineReader reads a child's output line by line, with a deadline per read.
type lineReader struct {
	lines chan string
	err   error // why lines was closed; read after it is
}

func newLineReader(r io.Reader) *lineReader {
	lr := &lineReader{lines: make(chan string, 1024)}
	go func() {
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			lr.lines <- sc.Text()
		}
		lr.err = sc.Err()
		if lr.err == nil {
			lr.err = io.EOF
		}
		close(lr.lines)
	}()
	return lr
}

var errTimeout = errors.New("timed out")

// next returns the next line, or an error at EOF or when deadline passes.
func (lr *lineReader) next(deadline time.Time) (string, error) {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case l, ok := <-lr.lines:
		if !ok {
			return "", lr.err
		}
		return l, nil
	case <-timer.C:
		return "", errTimeout
	}
}
