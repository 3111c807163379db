package memlimit

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// unlimited: a cgroup v1 limit at least this large is no limit (v1 writes
// "no limit" as the largest page-aligned int64).
const unlimited = 1 << 62

// CgroupLimit is the memory limit of the process's cgroup: the lowest
// memory.max (cgroup v2) or memory.limit_in_bytes (v1) of its cgroup and
// of the cgroups above it that the process sees; 0 if there is none. An
// error says that no memory cgroup could be read at all.
func CgroupLimit() (int64, error) { return cgroupLimit("/") }

// cgroupLimit is CgroupLimit with /proc and the cgroup mounts under root.
func cgroupLimit(root string) (int64, error) {
	cgroups, err := os.ReadFile(filepath.Join(root, "proc/self/cgroup"))
	if err != nil {
		return 0, fmt.Errorf("reading the process's cgroups: %w", err)
	}
	mountinfo, err := os.ReadFile(filepath.Join(root, "proc/self/mountinfo"))
	if err != nil {
		return 0, fmt.Errorf("reading the mounts: %w", err)
	}
	mounts := parseMountinfo(mountinfo)
	limit, found := int64(0), false
	for _, cg := range parseCgroups(cgroups) {
		for _, m := range mounts {
			var file string
			switch {
			case cg.v2 && m.fstype == "cgroup2":
				file = "memory.max"
			case !cg.v2 && m.fstype == "cgroup" && m.hasOption("memory"):
				file = "memory.limit_in_bytes"
			default:
				continue
			}
			l, ok, err := lowestLimit(filepath.Join(root, m.point), m.root, cg.path, file)
			if err != nil {
				return 0, err
			}
			if ok {
				found = true
				if l > 0 && (limit == 0 || l < limit) {
					limit = l
				}
			}
		}
	}
	if !found {
		return 0, errNoCgroup
	}
	return limit, nil
}

// cgroupLine is a line of /proc/self/cgroup that concerns memory: the v2
// hierarchy ("0::/path"), or the v1 hierarchy with the memory controller.
type cgroupLine struct {
	v2   bool
	path string
}

func parseCgroups(b []byte) []cgroupLine {
	var out []cgroupLine
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.SplitN(sc.Text(), ":", 3)
		if len(f) != 3 {
			continue
		}
		switch {
		case f[0] == "0" && f[1] == "":
			out = append(out, cgroupLine{v2: true, path: f[2]})
		case hasItem(f[1], "memory"):
			out = append(out, cgroupLine{path: f[2]})
		}
	}
	return out
}

// mount is a line of /proc/self/mountinfo: the mount's root within its
// filesystem, where it is mounted, its type and its super options.
type mount struct {
	root, point, fstype, options string
}

func (m mount) hasOption(o string) bool { return hasItem(m.options, o) }

func parseMountinfo(b []byte) []mount {
	var out []mount
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		// id parent major:minor root point options [optional...] - fstype source super-options
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 5 || len(f) < sep+4 {
			continue
		}
		out = append(out, mount{root: unescape(f[3]), point: unescape(f[4]), fstype: f[sep+1], options: f[sep+3]})
	}
	return out
}

// unescape undoes mountinfo's octal escapes of spaces, tabs, newlines and
// backslashes.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func hasItem(list, item string) bool {
	for x := range strings.SplitSeq(list, ",") {
		if x == item {
			return true
		}
	}
	return false
}

// lowestLimit reads file in the directory of cgroup cg (a path of the
// hierarchy mounted at point, whose root within the hierarchy is
// mountRoot) and in each directory above it up to the mount point, and
// returns the lowest limit; ok is false if no file could be read. A cgroup
// outside the mount's root (another namespace's view) is looked up from
// the mount point down.
func lowestLimit(point, mountRoot, cg, file string) (limit int64, ok bool, err error) {
	rel := cg
	if r, cut := strings.CutPrefix(path.Clean(cg), path.Clean(mountRoot)); cut && (r == "" || r[0] == '/' || mountRoot == "/") {
		rel = r
	}
	dir := filepath.Join(point, filepath.FromSlash(path.Clean("/"+rel)))
	for {
		l, present, err := readLimit(filepath.Join(dir, file))
		if err != nil {
			return 0, false, err
		}
		if present {
			ok = true
			if l > 0 && (limit == 0 || l < limit) {
				limit = l
			}
		}
		if dir == point || len(dir) <= len(point) {
			return limit, ok, nil
		}
		dir = filepath.Dir(dir)
	}
}

// readLimit reads a memory limit file: 0 for "max" or a v1 "no limit";
// present is false if the file does not exist.
func readLimit(file string) (limit int64, present bool, err error) {
	b, err := os.ReadFile(file)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("reading the cgroup's memory limit: %w", err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, true, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, false, fmt.Errorf("%s: %q: %w", file, s, err)
	}
	if n <= 0 || n >= unlimited {
		return 0, true, nil
	}
	return n, true, nil
}
