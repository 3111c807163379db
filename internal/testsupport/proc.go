package testsupport

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// HandedOverTo returns the pid of the process that a proxy's log (its JSON
// lines) says it handed over to (SIGHUP), 0 if it says none. The log
// outlives the process, which may have exited by the time it is read.
func HandedOverTo(log string) int {
	for l := range strings.SplitSeq(log, "\n") {
		if !strings.Contains(l, `"msg":"handing over to a new process`) {
			continue
		}
		if _, rest, ok := strings.Cut(l, `"pid":`); ok {
			n, _ := strconv.Atoi(strings.TrimRight(rest, "}\r "))
			return n
		}
	}
	return 0
}

// ProcessRuns reports whether pid is a process that has not exited (a
// zombie has), for processes a test did not start and cannot wait for.
func ProcessRuns(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// "pid (comm) state ...", and comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && b[i+2] != 'Z' && b[i+2] != 'X'
}

// StopPid stops a process the test did not start, and so cannot wait for
// (SIGTERM, then SIGKILL after 15 s), and returns once it has exited. A
// pid of 0 is no process.
func StopPid(tb testing.TB, pid int) {
	tb.Helper()
	if pid == 0 {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	kill := time.NewTimer(15 * time.Second)
	defer kill.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for ProcessRuns(pid) {
		select {
		case <-kill.C:
			tb.Logf("process %d did not stop within 15s of SIGTERM; killing it", pid)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		case <-tick.C:
		}
	}
}
