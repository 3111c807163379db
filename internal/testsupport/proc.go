package testsupport

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
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
