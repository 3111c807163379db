package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

var (
	keyspaceKeys     = flag.String("snapcache.e2e.keyspace-keys", "100000", "BenchmarkKeyspaceMemory: keyspace sizes, comma-separated")
	keyspaceValue    = flag.Int("snapcache.e2e.keyspace-value", 1024, "BenchmarkKeyspaceMemory: value size in bytes")
	keyspaceSteady   = flag.Int("snapcache.e2e.keyspace-steady", 50_000, "BenchmarkKeyspaceMemory: puts of random keys in the steady phase")
	keyspaceProfiles = flag.String("snapcache.e2e.keyspace-profiles", "", "BenchmarkKeyspaceMemory: a directory to save the proxy's heap profiles in, at each measurement")
	keyspaceModes    = flag.String("snapcache.e2e.keyspace-modes", "limit=off:--memory-limit=0,limit=default:",
		"BenchmarkKeyspaceMemory: the proxy's cases, comma-separated name:flags (flags space-separated; none: default flags)")
)

// BenchmarkKeyspaceMemory measures what the live keyspace costs the proxy
// run as users run it, a separate process with default flags (the
// sibling of BenchmarkHistoryMemory, which measures retained history):
// for each size of -snapcache.e2e.keyspace-keys, kube-apiserver-shaped
// keys with values of -snapcache.e2e.keyspace-value bytes are written to
// etcd, and for each case of -snapcache.e2e.keyspace-modes (by default
// --memory-limit=0, the Go runtime's default pacing, and the default
// flags, the soft memory limit's) a new proxy process loads them cold.
// Reported, per case:
//
//	data-MiB        the keys' and values' bytes;
//	live-MiB        the proxy's live heap once loaded and its first copy
//	                to disk written: heap_alloc right after a forced
//	                collection (/debug/pprof/heap?gc=1, twice, then
//	                go_memstats_heap_alloc_bytes);
//	live-B/key      live heap per key, live/data its ratio to the data;
//	peak-load-MiB   the process's peak resident memory (VmHWM) once
//	                ready: its peak during the cold load; rss-ready-MiB
//	                its resident memory (VmRSS) then;
//	rss-loaded-MiB  VmRSS once the first copy to disk is written (read
//	                before the forced collection), and rss/live-loaded;
//	rss-steady-MiB  VmRSS after -snapcache.e2e.keyspace-steady puts of
//	                random keys have been applied (the history they leave
//	                is within --max-history-bytes), and rss/live-steady,
//	                over the live heap read after it; anon-steady-MiB its
//	                anonymous part (RssAnon), without the file pages of
//	                the copy on disk (bbolt's mmap, clean page cache the
//	                kernel reclaims); peak-MiB the VmHWM then;
//	limit-MiB       etcd_snapcache_memory_limit_bytes (0: none);
//	etcd-RSS-MiB    etcd's resident memory, beside it.
func BenchmarkKeyspaceMemory(b *testing.B) {
	for _, f := range strings.Split(*keyspaceKeys, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			b.Fatalf("-snapcache.e2e.keyspace-keys: %q is not a size", f)
		}
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) { benchKeyspaceMemory(b, n) })
	}
}

func benchKeyspaceMemory(b *testing.B, n int) {
	e := startEtcd(b)
	cli := dial(b, e.endpoint, nil, "", "")
	ks := keyspace{n: n}
	w := newWriter(cli, *keyspaceValue, 64)
	start := time.Now()
	loadedRev := w.put(b, n, ks.key)
	var data int64
	for i := range n {
		data += int64(len(ks.key(i)) + *keyspaceValue)
	}
	progress("keyspace memory keys=%d: %.0f MiB written in %v", n, float64(data)/mib, time.Since(start).Round(time.Second))
	for _, m := range strings.Split(*keyspaceModes, ",") {
		name, flags, _ := strings.Cut(m, ":")
		b.Run(name, func(b *testing.B) {
			p := startProxyProcess(b, e.endpoint, append(strings.Fields(flags), "--enable-pprof")...)
			pid := p.cmd.Process.Pid
			ready := procStatus(b, pid)
			if !strings.Contains(flags, "--persist-cache=false") {
				// The first copy to disk follows the load: settled is
				// once it is written.
				p.waitCopied(b, loadedRev)
			}
			settled := procStatus(b, pid)
			live := p.liveHeap(b)
			p.saveHeapProfile(b, b.Name()+"-loaded")

			head := w.put(b, *keyspaceSteady, ks.random(uint64(n)))
			p.waitRevision(b, head)
			steady := procStatus(b, pid)
			liveSteady := p.liveHeap(b)
			p.saveHeapProfile(b, b.Name()+"-steady")
			limit := p.metrics(b).sum("etcd_snapcache_memory_limit_bytes")
			etcdRSS := float64(e.rssBytes())
			r := func(m map[string]int64, k string) float64 { return float64(m[k]) / mib }

			fmt.Printf("SUMMARY %s: %d keys, %.0f MiB of keys and values: live heap %.0f MiB (%.0f B/key, %.2fx the data); "+
				"peak RSS during the load %.0f MiB, RSS when ready %.0f MiB; once copied to disk RSS %.0f MiB (anon %.0f MiB, %.2fx live), peak %.0f MiB; "+
				"after %d puts RSS %.0f MiB (anon %.0f MiB; %.2fx live %.0f MiB), peak %.0f MiB; memory limit %.0f MiB; etcd RSS %.0f MiB\n",
				b.Name(), n, float64(data)/mib, float64(live)/mib, float64(live)/float64(n), float64(live)/float64(data),
				r(ready, "VmHWM"), r(ready, "VmRSS"), r(settled, "VmRSS"), r(settled, "RssAnon"), float64(settled["VmRSS"])/float64(live), r(settled, "VmHWM"),
				*keyspaceSteady, r(steady, "VmRSS"), r(steady, "RssAnon"), float64(steady["VmRSS"])/float64(liveSteady), float64(liveSteady)/mib, r(steady, "VmHWM"),
				limit/mib, etcdRSS/mib)
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(float64(data)/mib, "data-MiB")
			b.ReportMetric(float64(live)/mib, "live-MiB")
			b.ReportMetric(float64(live)/float64(n), "live-B/key")
			b.ReportMetric(float64(live)/float64(data), "live/data")
			b.ReportMetric(r(ready, "VmHWM"), "peak-load-MiB")
			b.ReportMetric(r(ready, "VmRSS"), "rss-ready-MiB")
			b.ReportMetric(r(settled, "VmRSS"), "rss-loaded-MiB")
			b.ReportMetric(float64(settled["VmRSS"])/float64(live), "rss/live-loaded")
			b.ReportMetric(r(steady, "VmRSS"), "rss-steady-MiB")
			b.ReportMetric(r(steady, "RssAnon"), "anon-steady-MiB")
			b.ReportMetric(float64(steady["VmRSS"])/float64(liveSteady), "rss/live-steady")
			b.ReportMetric(r(steady, "VmHWM"), "peak-MiB")
			b.ReportMetric(limit/mib, "limit-MiB")
			b.ReportMetric(etcdRSS/mib, "etcd-RSS-MiB")
			p.stop(b)
		})
	}
}

// procStatus is the memory fields of /proc/<pid>/status (VmRSS, VmHWM,
// RssAnon, RssFile...), in bytes.
func procStatus(tb testing.TB, pid int) map[string]int64 {
	tb.Helper()
	s, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		tb.Fatalf("reading the proxy's memory: %v", err)
	}
	m := map[string]int64{}
	for line := range strings.SplitSeq(string(s), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[2] == "kB" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			m[strings.TrimSuffix(f[0], ":")] = kb << 10
		}
	}
	return m
}

// liveHeap is the proxy process's live heap: a collection forced through
// its /debug/pprof/heap?gc=1 (twice: the second finds the first's
// garbage swept), then go_memstats_heap_alloc_bytes. It needs
// --enable-pprof.
func (p *proxyProcess) liveHeap(tb testing.TB) int64 {
	tb.Helper()
	for range 2 {
		if _, err := httpGet(p.endpoint + "/debug/pprof/heap?gc=1"); err != nil {
			tb.Fatalf("forcing a collection in the proxy: %v", err)
		}
	}
	return int64(p.metrics(tb).sum("go_memstats_heap_alloc_bytes"))
}

// saveHeapProfile saves the proxy's heap profile (after a collection) in
// -snapcache.e2e.keyspace-profiles, if set, as <name>.pb.gz.
func (p *proxyProcess) saveHeapProfile(tb testing.TB, name string) {
	tb.Helper()
	if *keyspaceProfiles == "" {
		return
	}
	b, err := httpGet(p.endpoint + "/debug/pprof/heap?gc=1")
	if err != nil {
		tb.Fatalf("reading the proxy's heap profile: %v", err)
	}
	path := filepath.Join(*keyspaceProfiles, strings.NewReplacer("/", "_", "=", "-").Replace(name)+".pb.gz")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		tb.Fatal(err)
	}
	progress("heap profile of %s: %s", name, path)
}

// waitRevision waits until the proxy's cache has applied rev: a
// serializable read, served from the cache, answers at its revision.
func (p *proxyProcess) waitRevision(tb testing.TB, rev int64) {
	tb.Helper()
	kv := pb.NewKVClient(dial(tb, p.endpoint, nil, "", "").ActiveConnection())
	testsupport.Poll(tb, 5*time.Minute, 50*time.Millisecond, "the proxy's cache to reach the head", func() (bool, error) {
		if err := p.alive(); err != nil {
			tb.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := kv.Range(ctx, &pb.RangeRequest{Key: []byte("health"), Serializable: true, CountOnly: true})
		if err != nil {
			return false, err
		}
		return resp.Header.Revision >= rev, fmt.Errorf("the cache is at revision %d, want %d", resp.Header.Revision, rev)
	})
}
