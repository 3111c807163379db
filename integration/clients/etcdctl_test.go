package clients

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestEtcdctl runs one deterministic script of real etcdctl commands twice,
// at the same time: against a fresh etcd directly ("direct"), and against
// another fresh etcd through the proxy ("proxy"). Every command's stdout,
// stderr and exit status are recorded, and the two transcripts must be
// identical after normalization.
//
// Normalization replaces only what differs between two etcd clusters, or
// with the clock, never a revision, a key, a value, a count or an error:
//
//   - each side's own etcd member id and cluster id (hex and decimal), in
//     response headers and endpoint status, become <MEMBER> and <CLUSTER>.
//     Through the proxy they must be those of the etcd behind it, so a
//     header that carried anything else would show;
//   - lease ids (random per etcd) become <LEASE1>, <LEASE2>, ... in the
//     order the script grants them;
//   - the endpoint address becomes <ENDPOINT>;
//   - member list: the member's id, name and peer URLs. The proxy lists
//     itself (its own id, its own name, no peer URLs), by design, so that
//     clients syncing endpoints stay on it; the client URL, status and
//     learner flag are compared;
//   - durations ("took"), the remaining TTL of a lease, and the database
//     sizes of endpoint status, which depend on when bbolt committed (they
//     do differ between two etcds given the same writes);
//   - the order of a lease's keys in `lease timetolive --keys`, which etcd
//     takes from a Go map.
//
// Raft term and raft index are not blanked: two fresh single-member etcds
// that received the same writes agree on them, and through the proxy they
// show that it forwarded exactly the script's writes.
func TestEtcdctl(t *testing.T) {
	ctl := etcdctlBin(t)
	etcdBin(t)
	snapcacheBin(t)

	var direct, proxied *ctlSide
	t.Run("run", func(t *testing.T) {
		t.Run("direct", func(t *testing.T) {
			t.Parallel()
			e := startEtcd(t, "direct")
			direct = newCtlSide(t, ctl, e.addr, e.addr, nil)
			etcdctlScript(direct)
		})
		t.Run("proxy", func(t *testing.T) {
			t.Parallel()
			e := startEtcd(t, "behind-proxy")
			px := startProxy(t, "proxy", e.addr)
			proxied = newCtlSide(t, ctl, px.addr, e.addr, px)
			etcdctlScript(proxied)
		})
	})
	if t.Failed() {
		return
	}
	if len(direct.steps) != len(proxied.steps) {
		t.Fatalf("direct ran %d steps, proxy %d", len(direct.steps), len(proxied.steps))
	}
	diffs := 0
	for i := range direct.steps {
		d, p := direct.steps[i], proxied.steps[i]
		if d.String() == p.String() {
			continue
		}
		diffs++
		t.Errorf("step %d differs\n--- direct:\n%s\n--- proxy:\n%s", i+1, d, p)
	}
	if diffs == 0 {
		t.Logf("%d etcdctl steps, identical transcripts", len(direct.steps))
	}
	if testing.Verbose() || t.Failed() {
		var b strings.Builder
		for i, s := range direct.steps {
			fmt.Fprintf(&b, "[%d] %s\n", i+1, s)
		}
		t.Logf("direct transcript:\n%s", b.String())
	}
}

// etcdctlScript is the script both sides run. Revisions are not written in
// it: they are read from each side's own answers, so a proxy that reported
// a wrong revision would also run different commands, and differ.
func etcdctlScript(s *ctlSide) {
	// Writes, with put's options and output formats.
	s.run("put", "/k/a", "1")
	s.run("put", "/k/b", "2")
	s.run("put", "/k/c", "3")
	revD := s.revision("put", "/k/d", "4")
	s.run("put", "/other", "x")
	s.run("put", "/k/a", "10", "--prev-kv")
	s.run("put", "/k/b", "20", "-w", "json")
	s.run("put", "/k/c", "30", "--prev-kv", "-w", "json")
	s.run("put", "/k/e", "5")
	s.run("put", "/k/a", "100", "-w", "fields")
	s.run("put", "/k/a", "--ignore-value", "--prev-kv") // keeps the value, new revision
	head := s.revision("get", "/k/a")

	// Reads at the head, through the proxy's cache.
	s.run("get", "/k/a")
	s.run("get", "/k/a", "-w", "json")
	s.run("get", "/k/", "--prefix")
	s.run("get", "/k/", "--prefix", "-w", "json")
	s.run("get", "/k/", "--prefix", "-w", "fields")
	s.run("get", "/k/", "--prefix", "--limit=2", "-w", "json")
	s.run("get", "/k/", "--prefix", "--limit=2")
	s.run("get", "/k/", "--prefix", "--sort-by=MODIFY", "--order=DESCEND")
	s.run("get", "/k/", "--prefix", "--sort-by=VALUE", "--order=ASCEND")
	s.run("get", "/k/", "--prefix", "--sort-by=CREATE", "--order=DESCEND", "--limit=3", "-w", "json")
	s.run("get", "/k/", "--prefix", "--sort-by=VERSION", "--order=DESCEND") // ties keep etcd's order
	s.run("get", "/k/", "--prefix", "--sort-by=KEY", "--order=DESCEND", "--limit=2")
	s.run("get", "/k/", "--prefix", "--keys-only")
	s.run("get", "/k/", "--prefix", "--keys-only", "-w", "json")
	s.run("get", "/k/", "--prefix", "--count-only", "-w", "fields")
	s.run("get", "/k/", "--prefix", "--count-only", "--limit=1", "-w", "fields")
	s.run("get", "/k/", "--prefix", "--print-value-only")
	s.run("get", "/k/", "--prefix", "--hex")
	s.run("get", "/k/b", "--from-key")
	s.run("get", "/k/b", "--from-key", "--limit=2", "-w", "json")
	s.run("get", "", "--from-key", "--keys-only")
	s.run("get", "/k/a", "/k/c") // [a, c)
	s.run("get", "/k/", "--prefix", "--min-mod-rev="+itoa(revD+2), "-w", "json")
	s.run("get", "/k/", "--prefix", "--max-create-rev="+itoa(revD-1))
	s.run("get", "/k/", "--prefix", "--consistency=s", "-w", "json")
	s.run("get", "/k/", "--prefix", "--stream", "-w", "json") // RangeStream (etcd 3.7)
	s.run("get", "", "--from-key", "--stream", "--keys-only", "--limit=3")
	s.run("get", "/missing")
	s.run("get", "/missing", "-w", "json")

	// Reads at older revisions (the proxy's snapshots) and out of range.
	for rev := int64(1); rev <= head; rev++ {
		s.run("get", "/k/", "--prefix", "--rev="+itoa(rev), "-w", "json")
	}
	s.run("get", "/k/a", "--rev=3")
	s.run("get", "/k/", "--prefix", "--rev="+itoa(revD), "--limit=2", "--sort-by=VALUE", "--order=DESCEND")
	s.run("get", "/k/", "--prefix", "--rev="+itoa(revD), "--keys-only", "--consistency=s")
	s.run("get", "/k/", "--prefix", "--rev="+itoa(revD), "--count-only", "-w", "fields")
	s.run("get", "/k/a", "--rev="+itoa(head+100)) // a future revision: etcd's error

	// Deletes.
	s.run("put", "/d/1", "a")
	s.run("put", "/d/2", "b")
	s.run("put", "/d/3", "c")
	s.run("put", "/d/4", "d")
	s.run("del", "/d/1")
	s.run("del", "/d/1") // nothing to delete: 0, no revision
	s.run("del", "/d/2", "--prev-kv", "-w", "json")
	s.run("del", "/d/", "--prefix", "--prev-kv")
	s.run("put", "/z/5", "e") // the last keys: --from-key deletes only these
	s.run("put", "/z/6", "f")
	s.run("del", "/z/5", "--from-key", "--prev-kv", "-w", "json")
	s.run("get", "/d/", "--prefix", "--count-only", "-w", "fields")

	// Transactions: interactive (prompts and answers read from a file) and
	// not, both branches, nested reads, JSON.
	s.runIn("mod(\"/k/a\") > \"0\"\n\nput /k/t1 from-txn\nget /k/ --prefix --limit=2\n\nput /k/t1 failed\n\n",
		"txn", "--interactive")
	s.runIn("value(\"/k/a\") = \"nope\"\n\nput /k/t2 success\n\nput /k/t2 failure\nget /k/t1\n\n",
		"txn", "--interactive", "-w", "json")
	s.runIn("version(\"/k/t1\") = \"1\"\ncreate(\"/k/zzz\") = \"0\"\n\ndel /k/t2 --prev-kv\nput /k/t3 x\nget /k/ --prefix --keys-only --sort-by=MODIFY --order=DESCEND --limit=2\n\nput /never y\n\n",
		"txn", "-w", "json")
	s.runIn("create(\"/k/t3\") > \"0\"\n\nget /k/t3\n\n\n", "txn")
	s.runIn("mod(\"/k/a\") < \"1\"\n\n\nget /k/a /k/c\n\n", "txn")
	s.run("get", "/k/t", "--prefix", "-w", "json")

	// HashKV of both etcds agrees while no key carries a lease (a key-value
	// holds its lease id, which differs between two etcds).
	s.run("endpoint", "hashkv")
	s.run("endpoint", "hashkv", "--rev="+itoa(revD), "-w", "json")

	// Cluster and maintenance calls.
	s.run("member", "list")
	s.run("member", "list", "-w", "json")
	s.run("endpoint", "status")
	s.run("endpoint", "status", "-w", "json")
	s.run("endpoint", "health")
	s.run("endpoint", "health", "-w", "json")
	s.run("alarm", "list")
	s.run("auth", "status")
	s.run("defrag")

	// Leases: grant, attach, keep alive, time to live, list, revoke.
	l1 := s.lease("lease", "grant", "600")
	s.run("put", "/l/x", "leased", "--lease="+l1)
	s.run("put", "/l/y", "leased", "--lease="+l1, "-w", "json")
	s.run("get", "/l/", "--prefix", "-w", "json")
	s.run("put", "/l/y", "still-leased", "--ignore-lease")
	s.run("get", "/l/y", "-w", "json")
	s.run("lease", "timetolive", l1)
	s.run("lease", "timetolive", l1, "--keys")
	s.runBlankJSON([]string{"TTL"}, "lease", "timetolive", l1, "--keys", "-w", "json")
	s.run("lease", "keep-alive", "--once", l1)
	s.run("lease", "keep-alive", "--once", l1, "-w", "json")
	s.run("lease", "list")
	s.run("lease", "revoke", l1)
	s.run("get", "/l/", "--prefix")
	s.run("lease", "timetolive", l1)
	s.run("lease", "revoke", l1)                  // already gone: etcd's error
	s.run("put", "/l/z", "v", "--lease=1234abcd") // unknown lease: etcd's error
	l2 := s.lease("lease", "grant", "300", "-w", "json")
	s.run("lease", "revoke", l2, "-w", "json")

	// A live watch, started before the writes it sees (at a fixed start
	// revision, so that when etcdctl's watch is created does not matter):
	// puts, an overwrite, a delete, and a key whose lease expires.
	next := s.revision("get", "/w/", "--prefix", "--keys-only") + 1
	live := s.startWatch("watch", "--rev="+itoa(next), "--prev-kv", "--prefix", "/w/")
	s.run("put", "/w/a", "1")
	s.run("put", "/w/a", "2")
	ttl := s.lease("lease", "grant", "2") // etcd's minimum TTL
	s.run("put", "/w/expiring", "soon", "--lease="+ttl)
	s.run("put", "/w/b", "3")
	s.run("del", "/w/a")
	s.waitGone("/w/expiring") // the lease expires: a DELETE with prev_kv
	s.run("lease", "timetolive", ttl)
	s.run("put", "/w/zz-end", "end")
	live.until("/w/zz-end", false)

	// A watch from an old revision, replayed from history, in JSON (one
	// response per batch, with headers and prev_kv), and with filters.
	s.run("put", "/k/zz-end", "end")
	s.watch("/k/zz-end", true, "watch", "--rev=2", "--prev-kv", "--prefix", "/k/", "-w", "json")
	s.watch("/k/zz-end", false, "watch", "--rev="+itoa(revD), "--prefix", "/k/")
	s.watch("/w/b", false, "watch", "--rev="+itoa(next), "--prev-kv", "/w/b") // one key
	s.watch("/k/zz-end", false, "watch", "--rev=1", "/k/a", "/k/zz-endz")     // a range

	// A lock: a session lease, a txn, a watch on the waiters' prefix.
	s.run("lock", "/locks/one", "--", "sh", "-c", "echo locked at revision $ETCD_LOCK_REV")
	s.run("get", "/locks/", "--prefix", "--count-only", "-w", "fields")

	// Compaction through the endpoint (the proxy mirrors it as it forwards
	// it), then reads and watches below and at it.
	c1 := s.revision("put", "/k/a", "before-compaction") - 2
	s.run("compact", itoa(c1))
	s.run("get", "/k/a", "--rev="+itoa(c1-1))
	s.run("get", "/k/a", "--rev="+itoa(c1), "-w", "json")
	s.run("get", "/k/", "--prefix", "--rev="+itoa(c1), "--keys-only")
	s.run("get", "/k/", "--prefix", "--rev="+itoa(c1+1), "--count-only", "-w", "fields")
	s.run("watch", "--rev="+itoa(c1-1), "/k/a")               // canceled: compacted
	s.run("watch", "--rev="+itoa(c1-1), "/k/a", "-w", "json") // with compact_revision
	s.run("put", "/k/zz-end2", "end")
	s.watch("/k/zz-end2", false, "watch", "--rev="+itoa(c1), "--prev-kv", "--prefix", "/k/")
	s.run("compact", itoa(c1-1)) // already compacted: etcd's error

	// prev_kv at the compaction revision: etcd reads it at the revision
	// before, which is compacted, and sends the event without it (a PUT at
	// c3, a DELETE at c4); the events after keep theirs.
	s.run("put", "/p/k", "v1")
	s.run("put", "/p/k", "v2")
	c3 := s.revision("put", "/p/k", "v3")
	s.run("compact", itoa(c3))
	s.run("put", "/p/k", "v4")
	s.run("put", "/p/zz-end", "end")
	s.watch("/p/zz-end", true, "watch", "--rev="+itoa(c3), "--prev-kv", "/p/k", "/p/zz-endz", "-w", "json")
	c4 := s.revision("del", "/p/k")
	s.run("compact", itoa(c4))
	s.run("put", "/p/k", "reborn")
	s.run("del", "/p/k")
	s.run("put", "/p/zz-end2", "end")
	s.watch("/p/zz-end2", true, "watch", "--rev="+itoa(c4), "--prev-kv", "--prefix", "/p/", "-w", "json")

	// Compaction made on etcd directly, not through the proxy: the proxy
	// learns it from its probe (waited for on the proxy side), then answers
	// as etcd does.
	s.run("put", "/k/b", "after")
	c2 := s.revision("put", "/k/c", "after") - 1
	s.compactDirect(c2)
	s.run("get", "/k/", "--prefix", "--rev="+itoa(c2-1))
	s.run("get", "/k/", "--prefix", "--rev="+itoa(c2), "-w", "json")
	s.run("watch", "--rev="+itoa(c2-1), "--prefix", "/k/", "-w", "json")
	s.run("put", "/k/zz-end3", "end")
	// etcd fills prev_kv by reading the key at mod_revision-1: for an event
	// at the compaction revision itself (/k/b here) whose previous version
	// is older, that read is compacted, and etcd sends the event without
	// prev_kv. So must the proxy, which still holds that version.
	s.watch("/k/zz-end3", true, "watch", "--rev="+itoa(c2), "--prev-kv", "--prefix", "/k/", "-w", "json")
	s.watch("/k/zz-end3", true, "watch", "--rev="+itoa(c2+1), "--prev-kv", "--prefix", "/k/", "-w", "json")

	// Everything deleted, compacted at the head: etcd's hash covers the
	// whole history, which both etcds must share.
	s.run("del", "", "--from-key", "--prev-kv", "-w", "json")
	s.run("get", "", "--from-key", "--count-only", "-w", "fields")
	end := s.revision("get", "/")
	s.run("compact", itoa(end), "--physical")
	s.run("endpoint", "hashkv", "-w", "json")
	s.run("endpoint", "status", "-w", "json")
}

// ctlSide runs the script against one endpoint and records a transcript.
type ctlSide struct {
	t      *testing.T
	ctl    string
	ep     string     // what the script talks to: etcd, or the proxy
	etcdEP string     // the etcd itself
	proxy  *proxyProc // nil on the direct side
	norm   *normalizer
	steps  []ctlStep
	leases int
}

type ctlStep struct {
	cmd    string
	stdout string
	stderr string
	exit   int
}

func (s ctlStep) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "$ %s\n", s.cmd)
	b.WriteString(s.stdout)
	if s.stderr != "" {
		for l := range strings.SplitSeq(strings.TrimRight(s.stderr, "\n"), "\n") {
			fmt.Fprintf(&b, "stderr: %s\n", l)
		}
	}
	if s.exit != 0 {
		fmt.Fprintf(&b, "exit status %d\n", s.exit)
	}
	return b.String()
}

func newCtlSide(t *testing.T, ctl, ep, etcdEP string, px *proxyProc) *ctlSide {
	s := &ctlSide{t: t, ctl: ctl, ep: ep, etcdEP: etcdEP, proxy: px}
	s.norm = newNormalizer()
	s.norm.add(ep, "<ENDPOINT>")
	// The etcd's own identity, asked of the etcd itself.
	out, _, _ := s.exec(etcdEP, "", "endpoint", "status", "-w", "json")
	var st []struct {
		Status struct {
			Header struct {
				ClusterID uint64 `json:"cluster_id"`
				MemberID  uint64 `json:"member_id"`
			} `json:"header"`
		}
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || len(st) != 1 || st[0].Status.Header.MemberID == 0 {
		t.Fatalf("endpoint status of %s: %q: %v", etcdEP, out, err)
	}
	h := st[0].Status.Header
	s.norm.addID(h.MemberID, "<MEMBER>")
	s.norm.addID(h.ClusterID, "<CLUSTER>")
	return s
}

// exec runs etcdctl against ep and returns its stdout, its stderr without
// the client's own log lines (timestamps, retries), and its exit status.
func (s *ctlSide) exec(ep, stdin string, args ...string) (stdout, stderr string, exit int) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	full := append([]string{"--endpoints=" + ep, "--dial-timeout=5s", "--command-timeout=20s"}, args...)
	cmd := exec.CommandContext(ctx, s.ctl, full...)
	cmd.Env = ctlEnv()
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var o, e strings.Builder
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	if ctx.Err() != nil {
		s.t.Fatalf("etcdctl %s: timed out after 60s\nstdout: %s\nstderr: %s", strings.Join(args, " "), o.String(), e.String())
	}
	if ee, ok := err.(*exec.ExitError); ok {
		exit = ee.ExitCode()
	} else if err != nil {
		s.t.Fatalf("etcdctl %s: %v", strings.Join(args, " "), err)
	}
	return o.String(), dropClientLogs(e.String()), exit
}

// ctlEnv is the environment without ETCDCTL_* variables, which would change
// etcdctl's behaviour.
func ctlEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "ETCDCTL_") {
			env = append(env, kv)
		}
	}
	return env
}

// dropClientLogs removes clientv3's JSON log lines (with timestamps, and
// retries that depend on timing) from etcdctl's stderr.
func dropClientLogs(stderr string) string {
	var keep []string
	for l := range strings.SplitSeq(stderr, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["level"] != nil && m["ts"] != nil {
			continue
		}
		keep = append(keep, l)
	}
	return strings.Join(keep, "\n")
}

func (s *ctlSide) record(cmd, stdout, stderr string, exit int, blankJSON []string) ctlStep {
	st := ctlStep{
		cmd:    s.norm.text(cmd),
		stdout: s.norm.output(cmd, stdout, blankJSON),
		stderr: s.norm.output(cmd, stderr, nil),
		exit:   exit,
	}
	s.steps = append(s.steps, st)
	return st
}

func (s *ctlSide) run(args ...string) string {
	s.t.Helper()
	return s.runIn("", args...)
}

// runIn runs etcdctl with stdin (a file's content, as `etcdctl txn -i < f`).
func (s *ctlSide) runIn(stdin string, args ...string) string {
	s.t.Helper()
	out, errOut, exit := s.exec(s.ep, stdin, args...)
	cmd := "etcdctl " + shellJoin(args)
	if stdin != "" {
		cmd += " <<EOF\n" + stdin + "EOF"
	}
	s.record(cmd, out, errOut, exit, nil)
	return out
}

// runBlankJSON is run, with the named JSON fields blanked (time-dependent).
func (s *ctlSide) runBlankJSON(fields []string, args ...string) {
	s.t.Helper()
	out, errOut, exit := s.exec(s.ep, "", args...)
	s.record("etcdctl "+shellJoin(args), out, errOut, exit, fields)
}

// revision runs a command with -w json and returns its header's revision.
func (s *ctlSide) revision(args ...string) int64 {
	s.t.Helper()
	out := s.run(append(args, "-w", "json")...)
	var r struct {
		Header struct {
			Revision int64 `json:"revision"`
		} `json:"header"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || r.Header.Revision == 0 {
		s.t.Fatalf("etcdctl %s: no revision in %q: %v", strings.Join(args, " "), out, err)
	}
	return r.Header.Revision
}

var grantedRE = regexp.MustCompile(`^lease ([0-9a-f]{16}) granted with TTL`)

// lease runs a `lease grant` and returns the lease id (hex), which is from
// now on normalized as <LEASEn>.
func (s *ctlSide) lease(args ...string) string {
	s.t.Helper()
	out, errOut, exit := s.exec(s.ep, "", args...)
	var id uint64
	if m := grantedRE.FindStringSubmatch(out); m != nil {
		id, _ = strconv.ParseUint(m[1], 16, 64)
	} else {
		var r struct {
			ID int64 `json:"ID"`
		}
		if json.Unmarshal([]byte(out), &r) == nil {
			id = uint64(r.ID)
		}
	}
	if id == 0 {
		s.t.Fatalf("etcdctl %s: no lease id in %q (stderr %q)", strings.Join(args, " "), out, errOut)
	}
	s.leases++
	s.norm.addID(id, fmt.Sprintf("<LEASE%d>", s.leases))
	s.record("etcdctl "+shellJoin(args), out, errOut, exit, nil)
	return strconv.FormatUint(id, 16)
}

// waitGone waits until key no longer exists (e.g. its lease expired). The
// polling is not recorded.
func (s *ctlSide) waitGone(key string) {
	s.t.Helper()
	waitUntil(s.t, 30*time.Second, key+" to be deleted", func() (bool, error) {
		out, errOut, exit := s.exec(s.ep, "", "get", key, "--count-only", "-w", "fields")
		if exit != 0 {
			return false, fmt.Errorf("%s %s", out, errOut)
		}
		return strings.Contains(out, `"Count" : 0`+"\n"), nil
	})
	s.record("(waited until "+key+" was deleted)", "", "", 0, nil)
}

// compactDirect compacts the etcd itself, bypassing the proxy; on the proxy
// side it then waits until the proxy has noticed.
func (s *ctlSide) compactDirect(rev int64) {
	s.t.Helper()
	out, errOut, exit := s.exec(s.etcdEP, "", "compact", itoa(rev))
	s.record("etcdctl --endpoints=<THE ETCD ITSELF> compact "+itoa(rev), out, errOut, exit, nil)
	if s.proxy != nil {
		s.proxy.waitCompactRevision(s.t, rev)
	}
}

// ctlWatch is a running `etcdctl watch`.
type ctlWatch struct {
	s     *ctlSide
	cmd   *exec.Cmd
	title string
	out   *lineReader
	errb  *strings.Builder
}

func (s *ctlSide) startWatch(args ...string) *ctlWatch {
	s.t.Helper()
	full := append([]string{"--endpoints=" + s.ep, "--dial-timeout=5s"}, args...)
	cmd := exec.Command(s.ctl, full...)
	cmd.Env = ctlEnv()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		s.t.Fatal(err)
	}
	errb := &strings.Builder{}
	cmd.Stderr = errb
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	w := &ctlWatch{s: s, cmd: cmd, title: "etcdctl " + shellJoin(args), out: newLineReader(stdout), errb: errb}
	s.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return w
}

// until reads the watch's output up to the event that puts sentinel (the
// last event it is expected to print: its key line then its value line in
// the simple format, or a JSON response holding the key), then stops it and
// records what it printed.
func (w *ctlWatch) until(sentinel string, isJSON bool) {
	s := w.s
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var lines []string
	b64 := base64.StdEncoding.EncodeToString([]byte(sentinel))
	for {
		l, err := w.out.next(deadline)
		if err != nil {
			s.t.Fatalf("%s: waiting for %s: %v; printed so far:\n%s\nstderr: %s", w.title, sentinel, err, strings.Join(lines, "\n"), w.errb.String())
		}
		lines = append(lines, l)
		if isJSON && strings.Contains(l, `"`+b64+`"`) {
			break
		}
		if !isJSON && l == sentinel {
			// The sentinel's value line follows.
			v, err := w.out.next(deadline)
			if err != nil {
				s.t.Fatalf("%s: the value of %s: %v", w.title, sentinel, err)
			}
			lines = append(lines, v)
			break
		}
	}
	_ = w.cmd.Process.Kill()
	_ = w.cmd.Wait()
	s.record(w.title+"   (read up to "+sentinel+")", strings.Join(lines, "\n")+"\n", "", 0, nil)
}

// watch runs a watch over history that ends with sentinel.
func (s *ctlSide) watch(sentinel string, isJSON bool, args ...string) {
	s.t.Helper()
	s.startWatch(args...).until(sentinel, isJSON)
}

func itoa(i int64) string { return strconv.FormatInt(i, 10) }

func shellJoin(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t\n\"'$<>|&;()*") {
			a = strconv.Quote(a)
		}
		q[i] = a
	}
	return strings.Join(q, " ")
}

// normalizer replaces a side's identities (see TestEtcdctl) with
// placeholders.
type normalizer struct {
	subs [][2]string // exact strings, longest first
}

func newNormalizer() *normalizer { return &normalizer{} }

func (n *normalizer) add(old, new string) {
	n.subs = append(n.subs, [2]string{old, new})
	sort.SliceStable(n.subs, func(i, j int) bool { return len(n.subs[i][0]) > len(n.subs[j][0]) })
}

// addID registers an id in the forms etcdctl prints: %x, %016x, decimal
// (unsigned and, for leases, signed).
func (n *normalizer) addID(id uint64, placeholder string) {
	n.add(fmt.Sprintf("%016x", id), placeholder)
	n.add(fmt.Sprintf("%x", id), placeholder)
	n.add(strconv.FormatUint(id, 10), placeholder)
	n.add(strconv.FormatInt(int64(id), 10), placeholder)
}

func (n *normalizer) text(s string) string {
	for _, sub := range n.subs {
		s = strings.ReplaceAll(s, sub[0], sub[1])
	}
	return s
}

var (
	tookRE      = regexp.MustCompile(`took (= )?[0-9.]+[µmn]?s`)
	remainingRE = regexp.MustCompile(`remaining\(-?\d+s\)`)
	// lease timetolive --keys: etcd lists a lease's keys from a Go map, in
	// no particular order.
	attachedRE = regexp.MustCompile(`attached keys\(\[(.*)\]\)`)
	// member list, simple format: ID, status, name, peer URLs, client URLs, learner.
	memberRowRE = regexp.MustCompile(`(?m)^[0-9a-f]+, (started|unstarted), [^,]*, [^,]*, (.*), (true|false)$`)
	// endpoint status, simple format: endpoint, ID, version, storage version,
	// db size, in use, % not in use, quota, then the rest.
	statusRowRE = regexp.MustCompile(`(?m)^([^,]+, [^,]+, [^,]+, [^,]*), [^,]+, [^,]+, [^,]+, ([^,]+, .*)$`)
)

// output normalizes a command's output: JSON lines are decoded, rewritten
// and re-encoded; other lines get the textual rules.
func (n *normalizer) output(cmd, out string, blankJSON []string) string {
	if out == "" {
		return ""
	}
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "{") || strings.HasPrefix(l, "[") {
			if j, ok := n.json(l, blankJSON); ok {
				lines[i] = j
				continue
			}
		}
		l = tookRE.ReplaceAllString(l, "took <DURATION>")
		l = remainingRE.ReplaceAllString(l, "remaining(<TTL>)")
		l = attachedRE.ReplaceAllStringFunc(l, func(m string) string {
			keys := strings.Fields(attachedRE.FindStringSubmatch(m)[1])
			sort.Strings(keys)
			return "attached keys([" + strings.Join(keys, " ") + "])"
		})
		if strings.HasPrefix(cmd, "etcdctl member list") {
			l = memberRowRE.ReplaceAllString(l, "<MEMBER-ID>, $1, <NAME>, <PEER-URLS>, $2, $3")
		}
		l = n.text(l)
		if strings.HasPrefix(cmd, "etcdctl endpoint status") {
			l = statusRowRE.ReplaceAllString(l, "$1, <DB-SIZE>, <IN-USE>, <NOT-IN-USE>, $2")
		}
		lines[i] = l
	}
	return strings.Join(lines, "\n") + "\n"
}

func (n *normalizer) json(line string, blank []string) (string, bool) {
	dec := json.NewDecoder(strings.NewReader(line))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil || dec.More() {
		return "", false
	}
	v = n.walk("", v, blank)
	b, err := json.Marshal(v)
	if err != nil {
		return "", false
	}
	return string(b), true
}

func (n *normalizer) walk(key string, v any, blank []string) any {
	switch key {
	case "took":
		return "<DURATION>"
	case "dbSize", "dbSizeInUse":
		return "<BYTES>"
	}
	for _, b := range blank {
		if strings.EqualFold(key, b) { // etcdctl 3.7 writes "ttl"
			return "<BLANKED>"
		}
	}
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			x[k] = n.walk(k, e, blank)
		}
		return x
	case []any:
		if key == "keys" { // lease timetolive: in no particular order
			sort.Slice(x, func(i, j int) bool { return fmt.Sprint(x[i]) < fmt.Sprint(x[j]) })
		}
		for i, e := range x {
			x[i] = n.walk("", e, blank)
			if key == "members" {
				if m, ok := x[i].(map[string]any); ok {
					m["ID"], m["name"], m["peerURLs"] = "<MEMBER-ID>", "<NAME>", "<PEER-URLS>"
				}
			}
		}
		return x
	case json.Number:
		if r := n.text(x.String()); r != x.String() {
			return r
		}
		return x
	case string:
		return n.text(x)
	}
	return v
}
