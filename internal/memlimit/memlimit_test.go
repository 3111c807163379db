package memlimit

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"0", 0},
		{"1073741824", 1 << 30},
		{"3GiB", 3 << 30},
		{"3Gi", 3 << 30},
		{"512Mi", 512 << 20},
		{"512MiB", 512 << 20},
		{"1.5Gi", 3 << 29},
		{"64Ki", 64 << 10},
		{"2Ti", 2 << 40},
		{"1G", 1e9},
		{"1GB", 1e9},
		{"500M", 500e6},
		{"100k", 100e3},
		{" 2 GiB ", 2 << 30},
		{"10B", 10},
	} {
		got, err := ParseSize(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
	for _, in := range []string{"", "auto", "Gi", "3XB", "-1", "1.2.3Gi", "99999999999Ti", "1e3"} {
		if got, err := ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) = %d, want an error", in, got)
		}
	}
}

func share(cgroup int64) int64 { return int64(float64(cgroup) * CgroupRatio) }

func TestPolicyLimit(t *testing.T) {
	const gib = 1 << 30
	live := int64(gib)
	follow := int64(float64(live)*Headroom) + Slack
	for _, tc := range []struct {
		name string
		p    Policy
		live int64
		want int64
	}{
		{"fixed", Policy{Fixed: 3 * gib, Cgroup: gib, FollowLive: true}, live, 3 * gib},
		{"follow", Policy{FollowLive: true}, live, follow},
		{"follow, floor", Policy{FollowLive: true}, 1 << 20, Floor},
		{"follow, empty store", Policy{FollowLive: true}, 0, Floor},
		{"follow, within the cgroup", Policy{FollowLive: true, Cgroup: 4 * gib}, live, follow},
		{"follow, capped by the cgroup", Policy{FollowLive: true, Cgroup: gib}, live, share(gib)},
		{"follow, cgroup under the floor", Policy{FollowLive: true, Cgroup: 32 << 20}, 0, share(32 << 20)},
		{"cgroup only", Policy{Cgroup: 4 * gib}, live, share(4 * gib)},
		{"nothing to follow", Policy{}, live, 0},
	} {
		if got := tc.p.Limit(tc.live); got != tc.want {
			t.Errorf("%s: Limit(%d) = %d, want %d", tc.name, tc.live, got, tc.want)
		}
		// The ceiling bounds the limit for every estimate, and is
		// reached by a large enough one.
		if c := tc.p.Ceiling(); c != 0 && (tc.p.Limit(tc.live) > c || tc.p.Limit(1<<50) != c) {
			t.Errorf("%s: Ceiling %d, Limit(%d) %d, Limit(1 PiB) %d", tc.name, c, tc.live, tc.p.Limit(tc.live), tc.p.Limit(1<<50))
		} else if c == 0 && tc.p.Limit(1<<50) != 0 && !tc.p.FollowLive {
			t.Errorf("%s: no ceiling, but a static limit %d", tc.name, tc.p.Limit(1<<50))
		}
	}
	// Resident memory within about 1.5x the live heap for a proxy of a
	// GiB and more (the slack weighs on small ones, the floor on the
	// smallest).
	if r := float64(Policy{FollowLive: true}.Limit(live)) / float64(live); r > 1.3 {
		t.Errorf("a 1 GiB store's limit is %.2fx its estimate, want at most 1.3x", r)
	}
}

// writeFiles writes files (path relative to root: content) under root.
func writeFiles(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for name, content := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

const (
	mountsV2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
	mountsV1 = "31 23 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n" +
		"35 31 0:32 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,memory\n" +
		"36 31 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,cpu,cpuacct\n"
	// A container's view without a cgroup namespace: the memory hierarchy
	// mounted at the container's own cgroup.
	mountsV1Docker = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:14 - cgroup cgroup rw,memory\n"
	v1NoLimit      = "9223372036854771712\n"
)

func TestCgroupLimit(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files map[string]string
		want  int64
		err   bool
	}{
		{"v2, container's namespace", map[string]string{
			"proc/self/cgroup":          "0::/\n",
			"proc/self/mountinfo":       mountsV2,
			"sys/fs/cgroup/memory.max":  "4294967296\n",
			"sys/fs/cgroup/memory.high": "max\n",
		}, 4 << 30, false},
		{"v2, unlimited", map[string]string{
			"proc/self/cgroup":         "0::/\n",
			"proc/self/mountinfo":      mountsV2,
			"sys/fs/cgroup/memory.max": "max\n",
		}, 0, false},
		{"v2, a systemd service under a limited slice", map[string]string{
			"proc/self/cgroup":    "0::/system.slice/snapcache.service\n",
			"proc/self/mountinfo": mountsV2,
			"sys/fs/cgroup/system.slice/snapcache.service/memory.max": "max\n",
			"sys/fs/cgroup/system.slice/memory.max":                   "2147483648\n",
		}, 2 << 30, false},
		{"v2, the lowest of the service and its slice", map[string]string{
			"proc/self/cgroup":    "0::/system.slice/snapcache.service\n",
			"proc/self/mountinfo": mountsV2,
			"sys/fs/cgroup/system.slice/snapcache.service/memory.max": "1073741824\n",
			"sys/fs/cgroup/system.slice/memory.max":                   "2147483648\n",
		}, 1 << 30, false},
		{"v1", map[string]string{
			"proc/self/cgroup":    "12:cpu,cpuacct:/kubepods/pod1/c1\n4:memory:/kubepods/pod1/c1\n0::/\n",
			"proc/self/mountinfo": mountsV1,
			"sys/fs/cgroup/memory/kubepods/pod1/c1/memory.limit_in_bytes": "536870912\n",
			"sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes":    "1073741824\n",
			"sys/fs/cgroup/memory/kubepods/memory.limit_in_bytes":         v1NoLimit,
			"sys/fs/cgroup/memory/memory.limit_in_bytes":                  v1NoLimit,
		}, 512 << 20, false},
		{"v1, unlimited", map[string]string{
			"proc/self/cgroup":    "4:memory:/user.slice\n",
			"proc/self/mountinfo": mountsV1,
			"sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes": v1NoLimit,
			"sys/fs/cgroup/memory/memory.limit_in_bytes":            v1NoLimit,
		}, 0, false},
		{"v1, mounted at the container's cgroup", map[string]string{
			"proc/self/cgroup":                           "4:memory:/docker/abc\n",
			"proc/self/mountinfo":                        mountsV1Docker,
			"sys/fs/cgroup/memory/memory.limit_in_bytes": "268435456\n",
		}, 256 << 20, false},
		{"v1, the cgroup's directory not visible", map[string]string{
			"proc/self/cgroup":                           "4:memory:/process_api/d3d8\n",
			"proc/self/mountinfo":                        mountsV1,
			"sys/fs/cgroup/memory/memory.limit_in_bytes": v1NoLimit,
		}, 0, false},
		{"hybrid: memory in v1, an empty unified hierarchy", map[string]string{
			"proc/self/cgroup": "4:memory:/\n0::/\n",
			"proc/self/mountinfo": mountsV1 +
				"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
			"sys/fs/cgroup/memory/memory.limit_in_bytes": "805306368\n",
		}, 768 << 20, false},
		{"no memory cgroup mounted", map[string]string{
			"proc/self/cgroup":    "0::/\n",
			"proc/self/mountinfo": "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n",
		}, 0, true},
		{"garbage in the limit", map[string]string{
			"proc/self/cgroup":         "0::/\n",
			"proc/self/mountinfo":      mountsV2,
			"sys/fs/cgroup/memory.max": "lots\n",
		}, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			writeFiles(t, root, tc.files)
			got, err := cgroupLimit(root)
			if (err != nil) != tc.err || got != tc.want {
				t.Fatalf("cgroupLimit = %d, %v; want %d (error: %v)", got, err, tc.want, tc.err)
			}
		})
	}
	if _, err := cgroupLimit(t.TempDir()); err == nil {
		t.Error("no /proc: want an error")
	}
}

func TestUnescape(t *testing.T) {
	if got := unescape(`/sys/fs/cgroup/my\040dir`); got != "/sys/fs/cgroup/my dir" {
		t.Errorf("unescape = %q", got)
	}
	if got := unescape(`/a\\`); got != `/a\\` {
		t.Errorf("unescape of a short escape = %q", got)
	}
}

// liveFeed is an estimate that a test moves, and the limits a Tracker set.
type liveFeed struct {
	mu   sync.Mutex
	live int64 // guarded by mu
	set  chan int64
}

func (f *liveFeed) Live() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.live
}

func (f *liveFeed) move(live int64) {
	f.mu.Lock()
	f.live = live
	f.mu.Unlock()
}

func (f *liveFeed) Set(l int64) { f.set <- l }

func TestTrackerFollowsTheEstimate(t *testing.T) {
	f := &liveFeed{live: 100 << 20, set: make(chan int64)}
	tr := &Tracker{Policy: Policy{FollowLive: true}, Live: f.Live, Set: f.Set, Interval: time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int64)
	go func() {
		tr.Start()
		done <- tr.Run(ctx)
	}()
	want := func(live int64) int64 { return tr.Policy.Limit(live) }
	if got := <-f.set; got != want(100<<20) {
		t.Fatalf("first limit %d, want %d", got, want(100<<20))
	}
	// A move within 1/32 of the limit sets nothing; the next one does.
	f.move(101 << 20)
	f.move(1 << 30)
	if got := <-f.set; got != want(1<<30) {
		t.Fatalf("limit %d after the store grew, want %d", got, want(1<<30))
	}
	f.move(0) // emptied (a reload): down to the floor
	if got := <-f.set; got != Floor {
		t.Fatalf("limit %d after the store emptied, want the floor %d", got, Floor)
	}
	cancel()
	if last := <-done; last != Floor {
		t.Fatalf("Run returned %d, want the last limit %d", last, Floor)
	}
}

// TestTrackerQuietFollows: once the estimate stood still long enough for
// the Tracker to read it less often, a change is still followed.
func TestTrackerQuietFollows(t *testing.T) {
	f := &liveFeed{live: 100 << 20, set: make(chan int64, 1)}
	reads := make(chan struct{}, 1)
	live := func() int64 {
		select {
		case reads <- struct{}{}:
		default:
		}
		return f.Live()
	}
	tr := &Tracker{Policy: Policy{FollowLive: true}, Live: live, Set: f.Set, Interval: time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int64)
	go func() {
		tr.Start()
		done <- tr.Run(ctx)
	}()
	<-f.set
	for range 2 * quietFactor {
		<-reads // the same estimate each time: quiet
	}
	f.move(1 << 30)
	if got, want := <-f.set, tr.Policy.Limit(1<<30); got != want {
		t.Fatalf("limit %d after a quiet spell and growth, want %d", got, want)
	}
	cancel()
	<-done
}

func TestTrackerStatic(t *testing.T) {
	f := &liveFeed{live: 100 << 20, set: make(chan int64, 1)}
	tr := &Tracker{Policy: Policy{Fixed: 3 << 30}, Live: f.Live, Set: f.Set, Interval: time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int64)
	go func() {
		tr.Start()
		done <- tr.Run(ctx)
	}()
	if got := <-f.set; got != 3<<30 {
		t.Fatalf("limit %d, want 3 GiB", got)
	}
	cancel()
	<-done
	if len(f.set) != 0 {
		t.Fatalf("a fixed limit was set again: %d", <-f.set)
	}
}

func TestFormatSize(t *testing.T) {
	for in, want := range map[int64]string{0: "0B", 1023: "1023B", 64 << 20: "64.0MiB", 3 << 29: "1.5GiB"} {
		if got := FormatSize(in); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", in, got, want)
		}
	}
}

// TestAcquireRuntime: one owner of the process at a time sets the runtime's
// limit, and releasing restores the limit it found.
func TestAcquireRuntime(t *testing.T) {
	found := RuntimeLimit()
	rt, ok := AcquireRuntime()
	if !ok {
		t.Fatal("the runtime's limit is held before the test")
	}
	if _, ok := AcquireRuntime(); ok {
		t.Fatal("a second owner acquired the runtime's limit")
	}
	rt.Set(3 << 30)
	if got := RuntimeLimit(); got != 3<<30 {
		t.Fatalf("limit %d, want 3 GiB", got)
	}
	rt.Set(0)
	if got := RuntimeLimit(); got != 0 {
		t.Fatalf("limit %d after Set(0), want none", got)
	}
	rt.Release()
	if got := RuntimeLimit(); got != found {
		t.Fatalf("limit %d after Release, want the %d found", got, found)
	}
	again, ok := AcquireRuntime()
	if !ok {
		t.Fatal("the runtime's limit cannot be acquired after Release")
	}
	again.Release()
}
