package e2e

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// Every goroutine a benchmark starts, the in-process proxy's included,
// must be gone when it ends. A benchmark run first says its transport in
// a configuration line of Go's benchmark format ("transport: tls" or
// "transport: plaintext", -snapcache.e2e.tls), which benchstat keeps
// apart (-col transport): plaintext and mTLS runs side by side.
func TestMain(m *testing.M) {
	flag.Parse()
	if f := flag.Lookup("test.bench"); f != nil && f.Value.String() != "" {
		fmt.Printf("transport: %s\n", transportName(*cmpTLS))
	}
	goleak.VerifyTestMain(m)
}

// startTimeout bounds the wait for etcd to serve, and stopTimeout for it to
// exit after SIGTERM.
const (
	startTimeout = time.Minute
	stopTimeout  = 15 * time.Second
)

// lookupBinary is $env, else rel (relative to this package), as an
// absolute path; "" if it is not an executable file.
func lookupBinary(env, rel string) string {
	p := os.Getenv(env)
	if p == "" {
		p = rel
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		return ""
	}
	if st, err := os.Stat(abs); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
		return ""
	}
	return abs
}

// requireBinary is lookupBinary's binary, or the test's end with how to
// build it.
func requireBinary(tb testing.TB, env, built, how string) string {
	tb.Helper()
	p := lookupBinary(env, built)
	if p == "" {
		tb.Fatalf("no %s binary: %s, or set $%s", filepath.Base(built), how, env)
	}
	return p
}

// etcdBinary is $ETCD_BIN, else the etcd that tools/build.sh builds.
func etcdBinary(tb testing.TB) string {
	return requireBinary(tb, "ETCD_BIN", "../../.tools/bin/etcd", "build it with `make tools-etcd` (tools/build.sh etcd)")
}

// etcdProcess is a single-member etcd run as a separate process.
type etcdProcess struct {
	*child
	endpoint   string // http://127.0.0.1:port, or https:// with TLS
	metricsURL string // where its /metrics is read in plaintext
}

// startEtcd starts etcd with its data in a temporary directory and waits
// until it answers; it is stopped when the benchmark ends. Without fsync:
// the benchmarks measure the proxy, not the disk.
func startEtcd(tb testing.TB, extra ...string) *etcdProcess {
	tb.Helper()
	return startEtcdTLS(tb, nil, extra...)
}

// startEtcdTLS is startEtcd serving its clients over TLS when clientTLS
// (what a client presents to it) is not nil; extra then holds the serving
// flags. Its metrics are then served in plaintext on a port of their own.
func startEtcdTLS(tb testing.TB, clientTLS *tls.Config, extra ...string) *etcdProcess {
	tb.Helper()
	return startEtcdCluster(tb, 1, clientTLS, extra...).members[0].etcdProcess
}

// rssBytes is the etcd process's resident memory (VmRSS), or 0 if unknown.
func (e *etcdProcess) rssBytes() int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", e.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// startProxy starts the proxy in this process in front of endpoint, and
// waits until it has loaded the keyspace.
func startProxy(tb testing.TB, endpoint string, configure func(*server.Config)) *server.Server {
	tb.Helper()
	return servertest.StartProxy(tb, servertest.Config(endpoint, configure))
}

// waitApplied waits until the proxy's cache has applied rev.
func waitApplied(tb testing.TB, p *server.Server, rev int64) {
	tb.Helper()
	testsupport.WaitFor(tb, 5*time.Minute, fmt.Sprintf("the cache to reach revision %d", rev), func() bool {
		return p.Store().Rev() >= rev
	})
}

// writer writes values of a fixed size through one client.
type writer struct {
	cli     *clientv3.Client
	kv      pb.KVClient
	value   []byte
	workers int
}

func newWriter(cli *clientv3.Client, valueSize, workers int) *writer {
	v := make([]byte, valueSize)
	for i := range v {
		v[i] = 'a' + byte(i%26)
	}
	return &writer{cli: cli, kv: pb.NewKVClient(cli.ActiveConnection()), value: v, workers: workers}
}

// put writes n puts, of keyOf(i) for i in 0..n-1, with the writer's
// concurrent workers, one revision each, and returns the highest revision
// written.
func (w *writer) put(tb testing.TB, n int, keyOf func(i int) []byte) int64 {
	tb.Helper()
	head, err := servertest.PutConcurrently(w.kv, n, w.workers, func(i int) *pb.PutRequest {
		return &pb.PutRequest{Key: keyOf(i), Value: w.value}
	})
	if err != nil {
		tb.Fatalf("put: %v", err)
	}
	return head
}

// keyspace is the benchmarks' keys: n keys shaped like kube-apiserver's.
type keyspace struct{ n int }

func (k keyspace) key(i int) []byte {
	return fmt.Appendf(nil, "/registry/pods/ns-%03d/pod-%08d", i%100, i)
}

// random returns a key function that picks keys at random, seeded.
func (k keyspace) random(seed uint64) func(int) []byte {
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, seed+1))
	return func(int) []byte {
		mu.Lock()
		i := rng.IntN(k.n)
		mu.Unlock()
		return k.key(i)
	}
}

// liveHeap is this process's live heap: HeapAlloc right after a full
// collection.
func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// firstError keeps the first error that concurrent workers report, and
// cancels their context when one does.
type firstError struct {
	cancel context.CancelFunc
	mu     sync.Mutex
	err    error // guarded by mu
}

func (f *firstError) fail(err error) {
	f.mu.Lock()
	if f.err == nil {
		f.err = err
	}
	f.mu.Unlock()
	f.cancel()
}

func (f *firstError) get() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}
