// Package memlimit chooses the Go runtime's soft memory limit
// (runtime/debug.SetMemoryLimit) for the proxy, whose heap is almost all
// its cache: with the runtime's default pacing (GOGC=100) the heap grows to
// twice the live data before a collection, and a proxy holding 1 GiB of
// keys then needs 2 GiB and more of resident memory.
//
// A limit is fixed (--memory-limit=3GiB), or automatic: it follows the
// cache's own estimate of its live memory, with headroom (Headroom, Slack)
// so that resident memory stays near the live data, and it never goes
// above CgroupRatio of the memory limit of the process's cgroup (v2
// memory.max, v1 memory.limit_in_bytes), as
// github.com/KimMachineGun/automemlimit sets it, nor below Floor, so that
// a small proxy does not collect all the time. A Tracker re-sets it as the
// cache grows and shrinks.
//
// The limit is soft: past it, the collector runs more often (at most about
// half of the CPU, the runtime's own cap), and nothing fails.
package memlimit

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"unicode"
)

// Ratios and bounds of an automatic limit.
const (
	// CgroupRatio is the share of the cgroup's memory limit the Go
	// runtime may use: the rest is for what it does not count (the
	// binary's pages, the copy on disk's mmap, the kernel's).
	CgroupRatio = 0.9
	// Headroom and Slack: the limit is Headroom times the live estimate
	// plus Slack, what the collector may let the heap grow to between
	// collections (the requests in flight and the pages of a load in
	// it), so that resident memory stays within about 1.5 times the live
	// heap.
	Headroom = 1.25
	Slack    = 32 << 20
	// Floor is the least automatic limit, unless the cgroup's is lower.
	Floor = 64 << 20
)

// Policy computes the limit for an estimate of the live heap.
type Policy struct {
	// Fixed, if more than 0, is the limit, whatever the estimate.
	Fixed int64
	// Cgroup is the process's cgroup memory limit; 0: none. An automatic
	// limit is at most CgroupRatio of it.
	Cgroup int64
	// FollowLive makes an automatic limit follow the estimate; without
	// it, the limit is the cgroup's share alone (0 without a cgroup
	// limit: none), for a process whose heap holds more than the estimate
	// knows (an embedded etcd).
	FollowLive bool
}

// Limit is the soft memory limit for a live heap of about live bytes; 0:
// none.
func (p Policy) Limit(live int64) int64 {
	if p.Fixed > 0 {
		return p.Fixed
	}
	limit := int64(0)
	if p.FollowLive {
		limit = max(Floor, int64(float64(max(live, 0))*Headroom)+Slack)
	}
	if p.Cgroup > 0 {
		share := int64(float64(p.Cgroup) * CgroupRatio)
		if limit == 0 || share < limit {
			limit = share
		}
	}
	return limit
}

// Ceiling is the most Limit returns for any estimate; 0: no bound.
func (p Policy) Ceiling() int64 {
	if p.Fixed > 0 {
		return p.Fixed
	}
	if p.Cgroup > 0 {
		return int64(float64(p.Cgroup) * CgroupRatio)
	}
	return 0
}

// Static reports whether the limit does not depend on the estimate.
func (p Policy) Static() bool { return p.Fixed > 0 || !p.FollowLive }

// ParseSize parses a byte size as Kubernetes quantities and etcd's flags
// write them: an integer, or a decimal number with a suffix, binary (Ki,
// Mi, Gi, Ti; also KiB, MiB, GiB, TiB) or decimal (K or k, M, G, T; also
// KB, MB, GB, TB). "0" is 0.
func ParseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	i := strings.IndexFunc(s, func(r rune) bool { return !unicode.IsDigit(r) && r != '.' })
	num, unit := s, ""
	if i >= 0 {
		num, unit = s[:i], strings.TrimSpace(s[i:])
	}
	if num == "" {
		return 0, fmt.Errorf("%q: not a size: want bytes, or a number with a unit such as 512Mi or 3GiB", s)
	}
	mult, ok := units[unit]
	if !ok {
		return 0, fmt.Errorf("%q: unknown unit %q: want Ki, Mi, Gi, Ti (KiB...), or K, M, G, T (KB...)", s, unit)
	}
	if !strings.Contains(num, ".") {
		n, err := strconv.ParseInt(num, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%q: %w", s, err)
		}
		if n > math.MaxInt64/mult {
			return 0, fmt.Errorf("%q: too large", s)
		}
		return n * mult, nil
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, fmt.Errorf("%q: %w", s, err)
	}
	v := f * float64(mult)
	if v >= math.MaxInt64 {
		return 0, fmt.Errorf("%q: too large", s)
	}
	return int64(v), nil
}

var units = map[string]int64{
	"": 1, "B": 1,
	"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
	"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
	"K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
	"KB": 1e3, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
}

// FormatSize writes n bytes in binary units, for logs.
func FormatSize(n int64) string {
	for _, u := range []struct {
		name string
		size int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n >= u.size {
			return strconv.FormatFloat(float64(n)/float64(u.size), 'f', 1, 64) + u.name
		}
	}
	return strconv.FormatInt(n, 10) + "B"
}

// errNoCgroup: the process is in no cgroup with a memory controller that
// this package can read.
var errNoCgroup = errors.New("no memory cgroup found")
