package clients

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// TestWarmStartAfterKill: the proxy, with its copy on disk written every
// 20ms, is killed with SIGKILL again and again while etcd takes writes
// (transactions of 20 puts of 1 KiB, and prefix deletes), and started
// again on the same --data-dir. Every start finds a whole copy (never a
// damaged one) and starts warm from it; afterwards the proxy answers as
// etcd does: keys and mod revisions at its revision (etcd-snapcache
// check), and values at revisions from before the last kill, which its
// restored history serves.
func TestWarmStartAfterKill(t *testing.T) {
	ctl, bin := etcdctlBin(t), snapcacheBin(t)
	e := startEtcd(t, "etcd")
	flags := []string{"--data-dir=" + t.TempDir(), "--persist-interval=20ms"}
	px := startProxy(t, "proxy-0", e.addr, flags...)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	written := make(chan error, 1)
	go func() { written <- writeTxns(ctx, ctl, e.url, 300) }()

	const kills = 6
	var firstRev int64 // a revision every later proxy holds
	for i := 1; i <= kills; i++ {
		var copied float64
		waitUntil(t, 60*time.Second, "the copy on disk to take new revisions", func() (bool, error) {
			v, err := px.metric("disk_revision")
			copied = v
			return err == nil && v > 0 && int64(v) > firstRev, err
		}, px.process)
		if firstRev == 0 {
			firstRev = int64(copied)
		}
		if err := px.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		<-px.done
		px = startProxy(t, fmt.Sprintf("proxy-%d", i), e.addr, flags...)
		results := restoreResults(t, px)
		if results["damaged"] != 0 || results["unreadable"] != 0 || results["warm"] != 1 {
			t.Fatalf("start %d after SIGKILL at copy revision %v: restores %v, want one warm", i, copied, results)
		}
	}
	if err := <-written; err != nil {
		t.Fatal(err)
	}

	head := etcdHead(t, ctl, e.url)
	waitUntil(t, 30*time.Second, "the proxy to reach etcd's head", func() (bool, error) {
		return etcdHead(t, ctl, px.url, "--consistency=s") >= head, nil
	}, px.process)
	ctx2, cancel2 := context.WithTimeout(context.Background(), time.Minute)
	defer cancel2()
	if out, err := exec.CommandContext(ctx2, bin, "check", "--endpoints="+e.url, "--proxy="+px.url).CombinedOutput(); err != nil {
		t.Fatalf("etcd-snapcache check after %d kills: %v\n%s", kills, err, out)
	}
	sources := labelled(t, px, "range_requests_total", "source")
	for _, rev := range []int64{firstRev, (firstRev + head) / 2, head} {
		want := runEtcdctl(t, ctl, []string{"--endpoints=" + e.url}, "get", "", "--prefix", "--rev="+strconv.FormatInt(rev, 10), "-w", "json")
		got := runEtcdctl(t, ctl, []string{"--endpoints=" + px.url}, "get", "", "--prefix", "--rev="+strconv.FormatInt(rev, 10), "-w", "json")
		if kvsOf(want) != kvsOf(got) {
			t.Fatalf("get --rev=%d after %d kills: the proxy's key-values differ from etcd's", rev, kills)
		}
	}
	after := labelled(t, px, "range_requests_total", "source")
	if after["forwarded"] != sources["forwarded"] || after["cache"] != sources["cache"]+3 {
		t.Fatalf("reads at revisions from before the last kill: %v from the cache, %v forwarded; want all 3 from the restored history",
			after["cache"]-sources["cache"], after["forwarded"]-sources["forwarded"])
	}
}

// writeTxns writes n transactions through etcdctl: 20 puts of 1 KiB
// values each, and every fifth a delete of a prefix of them.
func writeTxns(ctx context.Context, ctl, endpoint string, n int) error {
	value := strings.Repeat("v", 1024)
	for i := range n {
		var ops bytes.Buffer
		ops.WriteString("\n") // no compares
		for j := range 20 {
			fmt.Fprintf(&ops, "put kill/%d/%d %s-%d\n", j%4, (i*20+j)%97, value, i)
		}
		ops.WriteString("\n\n")
		cmd := exec.CommandContext(ctx, ctl, "--endpoints="+endpoint, "txn")
		if i%5 == 4 {
			cmd = exec.CommandContext(ctx, ctl, "--endpoints="+endpoint, "del", "--prefix", fmt.Sprintf("kill/%d/", i%4))
		} else {
			cmd.Stdin = &ops
		}
		cmd.Env = ctlEnv()
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("write %d: %v: %s", i, err, out)
		}
	}
	return nil
}

// restoreResults returns etcd_snapcache_disk_restores_total by result.
func restoreResults(t testing.TB, px *proxyProc) map[string]float64 {
	t.Helper()
	return labelled(t, px, "disk_restores_total", "result")
}

// labelled returns the series of the proxy's metric etcd_snapcache_<name>
// summed by the value of one label.
func labelled(t testing.TB, px *proxyProc, name, label string) map[string]float64 {
	t.Helper()
	lines, err := px.metricLines(name + "{")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, l := range lines {
		// etcd_snapcache_<name>{<label>="value"} 1
		_, rest, ok := strings.Cut(l, label+`="`)
		if !ok {
			continue
		}
		key, value, _ := strings.Cut(rest, `"} `)
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		out[key] += v
	}
	return out
}

// etcdHead returns the revision of a get through endpoint, with extra
// flags.
func etcdHead(t testing.TB, ctl, endpoint string, extra ...string) int64 {
	t.Helper()
	args := append([]string{"get", "k", "-w", "fields"}, extra...)
	rev, err := strconv.ParseInt(fieldValue(runEtcdctl(t, ctl, []string{"--endpoints=" + endpoint}, args...), "Revision"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return rev
}

// fieldValue returns the value of "name" in etcdctl's -w fields output.
func fieldValue(out, name string) string {
	for l := range strings.SplitSeq(out, "\n") {
		if rest, ok := strings.CutPrefix(l, `"`+name+`" : `); ok {
			return strings.TrimSpace(rest)
		}
	}
	return ""
}

// kvsOf returns the kvs and count of etcdctl's -w json output of a get,
// without its header.
func kvsOf(out string) string {
	if i := strings.Index(out, `"kvs"`); i >= 0 {
		return out[i:]
	}
	if i := strings.Index(out, `"count"`); i >= 0 {
		return out[i:]
	}
	return out
}

// TestHandoverKeepsClients: SIGHUP hands the running proxy over to a new
// process of it while etcdctl writes, reads and watches through it. No
// command fails (the listening socket is never closed, and the old
// process drains only once the new one serves), the watch (etcdctl's
// clientv3, resumed on the new process) prints every put exactly once
// and in order, and the new process started warm from the copy on disk.
func TestHandoverKeepsClients(t *testing.T) {
	ctl := etcdctlBin(t)
	e := startEtcd(t, "etcd")
	px := startProxy(t, "proxy", e.addr, "--data-dir="+t.TempDir())
	proxyCtl := []string{"--endpoints=" + px.url}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// From the revision after etcd's head now: the watch sees every put,
	// however long etcdctl takes to create it.
	from := etcdHead(t, ctl, e.url) + 1
	w := exec.CommandContext(ctx, ctl, append(proxyCtl, "watch", "--prefix", "hand/", "--rev="+strconv.FormatInt(from, 10))...)
	w.Env = ctlEnv()
	stdout, err := w.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var werr bytes.Buffer
	w.Stderr = &werr
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = w.Process.Kill()
		_ = w.Wait()
	}()
	lines := newLineReader(stdout)

	const writes = 120
	failed := make(chan string, 2*writes)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range writes {
			for _, args := range [][]string{
				{"put", fmt.Sprintf("hand/%03d", i), fmt.Sprintf("v%d", i)},
				{"get", "hand/", "--prefix", "--count-only", "-w", "fields"},
			} {
				cmd := exec.CommandContext(ctx, ctl, append(proxyCtl, args...)...)
				cmd.Env = ctlEnv()
				if out, err := cmd.CombinedOutput(); err != nil {
					failed <- fmt.Sprintf("etcdctl %s: %v: %s", strings.Join(args, " "), err, out)
				}
			}
		}
	}()

	// Hand over once the writes are under way.
	waitUntil(t, 30*time.Second, "the first writes", func() (bool, error) {
		out := runEtcdctl(t, ctl, proxyCtl, "get", "hand/", "--prefix", "--count-only", "-w", "fields")
		n, err := strconv.Atoi(fieldValue(out, "Count"))
		return err == nil && n >= 10, err
	}, px.process)
	if err := px.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	// The old process names the new one in its log; it may have exited
	// by the time it is read. Whatever happens, it is stopped at the end.
	t.Cleanup(func() { testsupport.StopPid(t, testsupport.HandedOverTo(px.log())) })
	waitUntil(t, 30*time.Second, "the process taking over", func() (bool, error) {
		return testsupport.HandedOverTo(px.log()) != 0, nil
	})
	select {
	case <-px.done:
	case <-time.After(time.Minute):
		t.Fatal("the old process did not exit after handing over")
	}
	if px.err != nil {
		t.Fatalf("the old process exited with %v", px.err)
	}
	<-done
	close(failed)
	for f := range failed {
		t.Error(f)
	}

	// Every put, once, in order: PUT, key, value.
	for i := range writes {
		for _, want := range []string{"PUT", fmt.Sprintf("hand/%03d", i), fmt.Sprintf("v%d", i)} {
			got, err := lines.next(time.Now().Add(30 * time.Second))
			if err != nil {
				t.Fatalf("etcdctl watch: %v, waiting for %q of put %d; stderr: %s", err, want, i, werr.String())
			}
			if got != want {
				t.Fatalf("etcdctl watch printed %q, want %q (put %d)", got, want, i)
			}
		}
	}
	if l, err := lines.next(time.Now().Add(200 * time.Millisecond)); err == nil {
		t.Fatalf("etcdctl watch printed %q after the last put", l)
	}
	if n := fieldValue(runEtcdctl(t, ctl, proxyCtl, "get", "hand/", "--prefix", "--count-only", "-w", "fields"), "Count"); n != fmt.Sprint(writes) {
		t.Fatalf("the new process counts %s keys, want %d", n, writes)
	}
	// The metrics address is the new process's now: it took it over too.
	if r := restoreResults(t, px); r["warm"] != 1 {
		t.Fatalf("the new process's restores: %v, want one warm", r)
	}
}
