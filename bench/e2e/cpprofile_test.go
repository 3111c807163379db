package e2e

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"
)

// With -snapcache.e2e.pprof, BenchmarkControlPlane runs etcd and the
// proxies with --enable-pprof and takes CPU profiles: of etcd in the first
// cpStormProfileSecs of each storm, and of etcd and the first proxy in the
// middle of each side's steady phase. They are saved under $TMPDIR (their
// paths printed) and summed up in PROFILE lines: etcd's by what it does,
// both by their top frames.

const (
	// cpProfileSecs is how long a steady phase's CPU profiles run.
	cpProfileSecs = 20
	// cpStormProfileSecs is how long a storm's CPU profile of etcd runs,
	// from the storm's start: the storm's busiest part at 100k objects.
	cpStormProfileSecs = 30
)

// cpProfile is a CPU profile of etcd or a proxy taken in a phase.
type cpProfile struct {
	proc        string // "etcd" or "proxy"
	side, phase string
	round       int
	secs        int
	path        string // "" if it failed
	err         error
}

// profileRun is a CPU profile being taken on a goroutine of its own; the
// phase that starts it waits for it.
type profileRun struct {
	p    cpProfile
	done chan struct{}
}

// startProfile starts a CPU profile of secs seconds of the process whose
// HTTP endpoints (with /debug/pprof/) are at url. Should the benchmark
// fail before the phase waits for it, its cleanup does.
func (cp *controlPlane) startProfile(b *testing.B, proc, url, side, phase string, round, secs int) *profileRun {
	r := &profileRun{p: cpProfile{proc: proc, side: side, phase: phase, round: round, secs: secs}, done: make(chan struct{})}
	name := fmt.Sprintf("%s-%s-%d-%s.pprof", proc, side, round, phase)
	go func() {
		defer close(r.done)
		r.p.path, r.p.err = fetchProfile(httpClient(cp.tls), url, filepath.Join(cp.profDir, name), secs)
	}()
	b.Cleanup(func() { <-r.done })
	return r
}

// wait waits for the profile, records it and says where it went.
func (cp *controlPlane) waitProfile(r *profileRun) {
	<-r.done
	p := r.p
	if p.err == nil {
		progress("%s %s: %s's CPU profile (%ds): %s", p.side, p.phase, p.proc, p.secs, p.path)
	} else {
		progress("%s %s: %s's CPU profile: %v", p.side, p.phase, p.proc, p.err)
	}
	cp.profiles = append(cp.profiles, p)
}

// profileSteady profiles etcd's CPU, and on the proxy side the first
// proxy's, in the middle of a phase of length phaseLen that began at
// start, while the phase's load runs: it holds the phase (cp.hold) until
// the profiles' window, then takes them, which lasts their seconds.
func (cp *controlPlane) profileSteady(b *testing.B, load *kubeload, side, phase string, round int, start time.Time, phaseLen time.Duration) {
	secs := min(cpProfileSecs, max(int(phaseLen.Seconds()), 1))
	cp.hold(b, load, start.Add(max(phaseLen/2-time.Duration(secs)*time.Second/2, 0)))
	runs := []*profileRun{cp.startProfile(b, "etcd", cp.etcd.members[0].endpoint, side, phase, round, secs)}
	if side == "proxy" {
		runs = append(runs, cp.startProfile(b, "proxy", cp.proxies[0].endpoint, side, phase, round, secs))
	}
	for _, r := range runs {
		cp.waitProfile(r)
	}
}

// profileStorm starts a profile of etcd's CPU from a storm's start, with
// -snapcache.e2e.pprof; nil without.
func (cp *controlPlane) profileStorm(b *testing.B, side, phase string, round int) *profileRun {
	if !*cmpPprof {
		return nil
	}
	return cp.startProfile(b, "etcd", cp.etcd.members[0].endpoint, side, phase, round, cpStormProfileSecs)
}

// waitStormProfile waits for a storm's profile, if one was started.
func (cp *controlPlane) waitStormProfile(r *profileRun) {
	if r != nil {
		cp.waitProfile(r)
	}
}

// fetchProfile saves the /debug/pprof/profile of secs seconds served at
// url as path, fetched with hc.
func fetchProfile(hc *http.Client, url, path string, secs int) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(secs+30)*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", fmt.Sprintf("%s/debug/pprof/profile?seconds=%d", url, secs), nil)
	if err != nil {
		return "", err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s/debug/pprof/profile: %s (is it run with --enable-pprof?)", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return "", err
	}
	return path, f.Close()
}

// goTool is the go command that runs pprof.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(runtime.GOROOT(), "bin", "go")
}

// cpProfileFrames are the frames of etcd's work worth listing in the top
// by cumulative share, but for the wrappers cpProfileWrappers matches
// (gRPC's handlers and interceptors, the apply's scheduler), which every
// request or apply goes through.
var (
	cpProfileFrames   = regexp.MustCompile(`etcdserver|v3rpc|mvcc|backend|raft|wal|lease|bbolt|grpc|http2|runtime\.(gcBgMarkWorker|mallocgc|memmove)$`)
	cpProfileWrappers = regexp.MustCompile(`grpc\.\(\*Server\)|Interceptor|getChainUnaryHandler|chainUnaryInterceptors|chainStreamInterceptors|schedule\.|\(\*EtcdServer\)\.run\.func|NewServerTransport\.func|\.func[0-9.]+$|Handler\.func1$|quotaKVServer`)
)

// profileTop is `go tool pprof -top -cum` of path, only the lines of the
// frames that frames matches and cpProfileWrappers does not, at most n.
func profileTop(path string, frames *regexp.Regexp, n int) ([]string, error) {
	out, err := exec.Command(goTool(), "tool", "pprof", "-top", "-cum", "-nodecount=400", path).Output()
	if err != nil {
		return nil, fmt.Errorf("go tool pprof -top: %v", err)
	}
	var top []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() && len(top) < n {
		f := strings.Fields(sc.Text())
		if len(f) < 6 || !strings.HasSuffix(f[4], "%") {
			continue
		}
		if fn := strings.Join(f[5:], " "); frames.MatchString(fn) && !cpProfileWrappers.MatchString(fn) {
			top = append(top, fmt.Sprintf("%s %s", f[4], fn))
		}
	}
	return top, nil
}

// cpProfileKinds classify a sample by its stack: the first kind one of
// whose frames matches its pattern (in this order) takes it.
var cpProfileKinds = []struct {
	name string
	re   *regexp.Regexp
}{
	// Reads: Range (serializable or linearizable, its ReadIndex wait
	// included), read-only Txns.
	{"range", regexp.MustCompile(`_KV_Range_Handler|v3rpc\.\(\*kvServer\)\.Range|\(\*EtcdServer\)\.Range|\(\*EtcdServer\)\.linearizableReadLoop|\(\*EtcdServer\)\.requestCurrentIndex`)},
	// Watchers: notifying them of writes, syncing unsynced ones, sending events.
	{"watch", regexp.MustCompile(`_Watch_Watch_Handler|\(\*watchableStore\)\.(notify|sync|moveVictims)|serverWatchStream|v3rpc\.\(\*watchServer\)|mvcc\.\(\*watchStream\)|watcherGroup|newWatcherBatch|\(\*watcher\)\.send`)},
	// Writes: Txns, Puts and Deletes through raft, the apply, the backend's commits, the WAL.
	{"apply", regexp.MustCompile(`_KV_(Txn|Put|DeleteRange)_Handler|v3rpc\.\(\*kvServer\)\.(Txn|Put|DeleteRange)|\(\*EtcdServer\)\.(Txn|Put|DeleteRange|apply|processInternalRaftRequest|raftRequest)|\(\*raftNode\)|go\.etcd\.io/raft|etcdserver/api/rafthttp|/wal\.|backend\.\(\*(backend|batchTx)|bbolt\.\(\*(Tx|DB)\)\.(Commit|commit|spill)|applier|uberApplier|\(\*applierV3`)},
	{"lease", regexp.MustCompile(`/lease\.|LeaseGrant|LeaseRevoke|LeaseKeepAlive|leaseServer`)},
	{"compact", regexp.MustCompile(`(?i)compact|defrag`)},
	// gRPC's writes to its connections (loopyWriter: every response and
	// watch event goes out there, whoever the stream's).
	{"grpc-send", regexp.MustCompile(`transport\.\(\*loopyWriter\)`)},
	// The rest of gRPC: reading and decoding frames, HTTP/2, TLS.
	{"grpc", regexp.MustCompile(`google\.golang\.org/grpc|golang\.org/x/net/http2|crypto/tls`)},
	{"gc", regexp.MustCompile(`runtime\.(gcBgMarkWorker|bgsweep|bgscavenge|gcStart|markroot|GC)`)},
}

// profileShares is each kind's share of path's samples, from `go tool
// pprof -traces`, in cpProfileKinds' order then "other".
func profileShares(path string) (map[string]float64, time.Duration, error) {
	out, err := exec.Command(goTool(), "tool", "pprof", "-traces", path).Output()
	if err != nil {
		return nil, 0, fmt.Errorf("go tool pprof -traces: %v", err)
	}
	by, total := classifyTraces(string(out))
	shares := map[string]float64{}
	for k, d := range by {
		shares[k] = float64(d) / float64(max(total, 1))
	}
	return shares, total, nil
}

// classifyTraces sums the samples of `go tool pprof -traces` output by
// cpProfileKinds' kind.
func classifyTraces(out string) (map[string]time.Duration, time.Duration) {
	by := map[string]time.Duration{}
	var total, val time.Duration
	var stack []string
	flush := func() {
		if val > 0 {
			kind := "other"
		kinds:
			for _, k := range cpProfileKinds {
				for _, fn := range stack {
					if k.re.MatchString(fn) {
						kind = k.name
						break kinds
					}
				}
			}
			by[kind] += val
			total += val
		}
		val, stack = 0, nil
	}
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "-----") {
			flush()
			continue
		}
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		// A trace's first line: its value, then its leaf frame.
		if line[0] == ' ' && len(f) >= 2 && val == 0 && len(stack) == 0 {
			if d, err := time.ParseDuration(f[0]); err == nil {
				val = d
				stack = append(stack, strings.Join(f[1:], " "))
				continue
			}
		}
		if val > 0 {
			stack = append(stack, strings.Join(f, " "))
		}
	}
	flush()
	return by, total
}

// cpProfiles are saved etcd profiles for BenchmarkProfileSummary.
var (
	cpProfiles   = flag.String("snapcache.e2e.cp-profiles", "", "BenchmarkProfileSummary: saved CPU profiles (space-separated; etcd's named etcd-*) to print PROFILE lines of again")
	cpProfileLen = flag.Int("snapcache.e2e.cp-profile-secs", cpProfileSecs, "BenchmarkProfileSummary: how many seconds the saved profiles ran")
)

// BenchmarkProfileSummary prints the PROFILE lines of the profiles that a
// run of BenchmarkControlPlane saved (-snapcache.e2e.cp-profiles), to look
// at them again: `make bench-e2e BENCH=ProfileSummary
// BENCH_E2E_FLAGS='-snapcache.e2e.cp-profiles=...'`.
func BenchmarkProfileSummary(b *testing.B) {
	files := strings.Fields(*cpProfiles)
	if len(files) == 0 {
		b.Fatal("-snapcache.e2e.cp-profiles: no profile given")
	}
	for _, f := range files {
		proc := "proxy"
		if strings.HasPrefix(filepath.Base(f), "etcd") {
			proc = "etcd"
		}
		fmt.Print(profileSummary(b, cpProfile{proc: proc, side: strings.TrimSuffix(filepath.Base(f), ".pprof"), phase: "-", secs: *cpProfileLen, path: f}))
	}
}

// cpProxyFrames are the proxy's frames worth listing in its top by
// cumulative share.
var cpProxyFrames = regexp.MustCompile(`etcd-snapcache|btree|grpc|http2|proto|runtime\.(gcBgMarkWorker|mallocgc|memmove)$`)

// profileSummary is the PROFILE lines of a profile: for etcd, its share by
// what etcd does, then the top frames by cumulative share.
func profileSummary(b testing.TB, p cpProfile) string {
	var sb strings.Builder
	if p.err != nil || p.path == "" {
		fmt.Fprintf(&sb, "PROFILE %s %s %s: none: %v\n", p.side, p.phase, p.proc, p.err)
		return sb.String()
	}
	secs := float64(max(p.secs, 1))
	frames := cpProxyFrames
	if p.proc == "etcd" {
		frames = cpProfileFrames
		shares, total, err := profileShares(p.path)
		if err != nil {
			fmt.Fprintf(&sb, "PROFILE %s %s etcd: %s: %v\n", p.side, p.phase, p.path, err)
			return sb.String()
		}
		// Each kind's share, and its CPU seconds per second of the profile.
		var parts []string
		for _, k := range append(cpProfileKinds, struct {
			name string
			re   *regexp.Regexp
		}{name: "other"}) {
			parts = append(parts, fmt.Sprintf("%s %.0f%% (%.3f s/s)", k.name, 100*shares[k.name], shares[k.name]*total.Seconds()/secs))
		}
		fmt.Fprintf(&sb, "PROFILE %s %s etcd: %.3f s/s of samples in %ds: %s  [%s]\n", p.side, p.phase, total.Seconds()/secs, p.secs, strings.Join(parts, "  "), p.path)
	} else {
		fmt.Fprintf(&sb, "PROFILE %s %s %s: %ds [%s]\n", p.side, p.phase, p.proc, p.secs, p.path)
	}
	top, err := profileTop(p.path, frames, 20)
	if err != nil {
		b.Logf("%s: %v", p.path, err)
	}
	for _, t := range top {
		fmt.Fprintf(&sb, "PROFILE   %s %s top-cum %s\n", p.side, p.proc, t)
	}
	return sb.String()
}
