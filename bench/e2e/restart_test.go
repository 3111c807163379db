package e2e

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

var (
	restartKeys  = flag.String("snapcache.e2e.restart-keys", "100000,1000000", "BenchmarkRestart: keyspace sizes, comma-separated")
	restartValue = flag.Int("snapcache.e2e.restart-value", 1024, "BenchmarkRestart: value size in bytes")
)

// BenchmarkRestart: what a restart of the proxy costs, per keyspace size
// (-snapcache.e2e.restart-keys, values of -snapcache.e2e.restart-value),
// cold and warm: etcd and the proxy as processes, the keyspace written to
// etcd, the proxy started and ready, then stopped (SIGTERM) and started
// again with the same flags and data directory. Cold runs with
// --persist-cache=false, and loads the whole keyspace from etcd again;
// warm restarts from the copy on disk, once the copy holds etcd's head,
// and reads from etcd only the verification's keys (no values). Reported,
// for each: the time from the new process's start to its /readyz (polled
// every 50ms), the bytes etcd sent and the CPU it spent meanwhile
// (etcd_network_client_grpc_sent_bytes_total, /proc), and the proxy's
// resident memory once ready.
func BenchmarkRestart(b *testing.B) {
	for _, f := range strings.Split(*restartKeys, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			b.Fatalf("-snapcache.e2e.restart-keys: %q is not a size", f)
		}
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) { benchRestart(b, n) })
	}
}

// restartCost is what restarts of one proxy cost, medians.
type restartCost struct {
	ready, sentMiB, etcdCPU, rssMiB float64
}

func benchRestart(b *testing.B, keys int) {
	e := startEtcd(b)
	cli := dial(b, e.endpoint, nil, "", "")
	ks := keyspace{n: keys}
	start := time.Now()
	head := newWriter(cli, *restartValue, 64).put(b, keys, ks.key)
	progress("restart keys=%d: written in %v, etcd at revision %d", keys, time.Since(start).Round(time.Second), head)

	b.ResetTimer()
	costs := map[string]restartCost{}
	for _, mode := range []string{"cold", "warm"} {
		flags := []string{"--persist-cache=false"}
		if mode == "warm" {
			flags = nil
		}
		p := startProxyProcess(b, e.endpoint, flags...)
		var readies, sent, cpu, rss []float64
		for range b.N {
			if mode == "warm" {
				p.waitCopied(b, head)
			}
			sent0 := e.metrics(b).sum("etcd_network_client_grpc_sent_bytes_total")
			cpu0 := processCPU(b, e.pid())
			readies = append(readies, p.restart(b).Seconds())
			sent = append(sent, e.metrics(b).sum("etcd_network_client_grpc_sent_bytes_total")-sent0)
			cpu = append(cpu, (processCPU(b, e.pid()) - cpu0).Seconds())
			r, _ := memOf(p.cmd.Process.Pid)
			rss = append(rss, float64(r))
			if mode == "warm" {
				if n := p.metrics(b).sum("etcd_snapcache_disk_restores_total", `result="warm"`); n != 1 {
					b.Fatalf("the warm restart did not start from its copy on disk (warm restores: %v)", n)
				}
			}
		}
		c := restartCost{ready: median(readies), sentMiB: median(sent) / (1 << 20), etcdCPU: median(cpu), rssMiB: median(rss) / (1 << 20)}
		costs[mode] = c
		fmt.Printf("SUMMARY %s: %s restart of the proxy over %d keys of %d B (%d restarts): ready after %.2f s, etcd sent %.1f MiB and spent %.2f CPU-s, proxy RSS %.0f MiB\n",
			b.Name(), mode, keys, *restartValue, b.N, c.ready, c.sentMiB, c.etcdCPU, c.rssMiB)
		p.stop(b)
	}
	b.StopTimer()
	cold, warm := costs["cold"], costs["warm"]
	fmt.Printf("SUMMARY %s: warm/cold over %d keys: ready %.2fx (%.2f s vs %.2f s), etcd sent %.3fx, etcd CPU %.2fx\n",
		b.Name(), keys, warm.ready/cold.ready, warm.ready, cold.ready, warm.sentMiB/cold.sentMiB, warm.etcdCPU/cold.etcdCPU)
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(cold.ready, "cold-ready-s")
	b.ReportMetric(warm.ready, "warm-ready-s")
	b.ReportMetric(cold.sentMiB, "cold-etcd-sent-MiB")
	b.ReportMetric(warm.sentMiB, "warm-etcd-sent-MiB")
	b.ReportMetric(cold.etcdCPU, "cold-etcd-cpu-s")
	b.ReportMetric(warm.etcdCPU, "warm-etcd-cpu-s")
	b.ReportMetric(warm.rssMiB, "warm-proxy-rss-MiB")
}

// waitCopied waits until the proxy's copy on disk holds revision rev.
func (p *proxyProcess) waitCopied(tb testing.TB, rev int64) {
	tb.Helper()
	testsupport.Poll(tb, startTimeout, 50*time.Millisecond, "the proxy's copy on disk to reach the head", func() (bool, error) {
		if err := p.alive(); err != nil {
			tb.Fatal(err)
		}
		got := p.metrics(tb).sum("etcd_snapcache_disk_revision")
		return int64(got) >= rev, fmt.Errorf("the copy holds revision %v, want %d", got, rev)
	})
}
