package e2e

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
)

var (
	restartKeys  = flag.String("snapcache.e2e.restart-keys", "100000,1000000", "BenchmarkRestart: keyspace sizes, comma-separated")
	restartValue = flag.Int("snapcache.e2e.restart-value", 1024, "BenchmarkRestart: value size in bytes")
)

// BenchmarkRestart: what a restart of the proxy costs, per keyspace size
// (-snapcache.e2e.restart-keys, values of -snapcache.e2e.restart-value):
// etcd and the proxy as processes, the keyspace written to etcd, the proxy
// started and ready, then stopped (SIGTERM) and started again with the
// same flags and data directory. Reported: the time from the new process's
// start to its /readyz (polled every 50ms), the bytes etcd sent and the CPU it spent meanwhile
// (etcd_network_client_grpc_sent_bytes_total, /proc), and the proxy's
// resident memory once ready. The proxy loads cold today: this is the
// baseline of a warm start from its data directory.
func BenchmarkRestart(b *testing.B) {
	for _, f := range strings.Split(*restartKeys, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			b.Fatalf("-snapcache.e2e.restart-keys: %q is not a size", f)
		}
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) { benchRestart(b, n) })
	}
}

func benchRestart(b *testing.B, keys int) {
	e := startEtcd(b)
	cli := dial(b, e.endpoint, nil, "", "")
	ks := keyspace{n: keys}
	start := time.Now()
	head := newWriter(cli, *restartValue, 64).put(b, keys, ks.key)
	progress("restart keys=%d: written in %v, etcd at revision %d", keys, time.Since(start).Round(time.Second), head)

	p := startProxyProcess(b, e.endpoint)
	b.ResetTimer()
	var readies []time.Duration
	var sent, cpu, rss []float64
	for range b.N {
		sent0 := e.metrics(b).sum("etcd_network_client_grpc_sent_bytes_total")
		cpu0 := processCPU(b, e.pid())
		readies = append(readies, p.restart(b))
		sent = append(sent, e.metrics(b).sum("etcd_network_client_grpc_sent_bytes_total")-sent0)
		cpu = append(cpu, (processCPU(b, e.pid()) - cpu0).Seconds())
		r, _ := memOf(p.cmd.Process.Pid)
		rss = append(rss, float64(r))
	}
	b.StopTimer()
	var readySecs []float64
	for _, d := range readies {
		readySecs = append(readySecs, d.Seconds())
	}
	ready, sentMiB, etcdCPU, rssMiB := median(readySecs), median(sent)/(1<<20), median(cpu), median(rss)/(1<<20)
	fmt.Printf("SUMMARY %s: cold restart of the proxy over %d keys of %d B (%d restarts): ready after %.1f s, etcd sent %.0f MiB and spent %.1f CPU-s, proxy RSS %.0f MiB\n",
		b.Name(), keys, *restartValue, b.N, ready, sentMiB, etcdCPU, rssMiB)
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(ready, "ready-s")
	b.ReportMetric(sentMiB, "etcd-sent-MiB")
	b.ReportMetric(etcdCPU, "etcd-cpu-s")
	b.ReportMetric(rssMiB, "proxy-rss-MiB")
}
