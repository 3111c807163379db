package testsupport

import (
	"testing"
	"time"
)

// WaitInterval is how often WaitFor checks its condition: often, because
// the conditions are cheap reads of in-process state.
const WaitInterval = time.Millisecond

// WaitFor checks cond every WaitInterval, starting at once, until it
// holds, and fails tb if it does not within timeout: state is observed, not
// assumed after a pause.
func WaitFor(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	Poll(tb, timeout, WaitInterval, what, func() (bool, error) { return cond(), nil })
}

// Poll calls cond every interval, starting at once, until it returns true,
// and fails tb if it does not within timeout, with the last error cond
// returned. cond runs on the caller's goroutine, so it may fail tb itself
// to give up early.
func Poll(tb testing.TB, timeout, interval time.Duration, what string, cond func() (bool, error)) {
	tb.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	var last error
	for {
		ok, err := cond()
		if ok {
			return
		}
		if err != nil {
			last = err
		}
		select {
		case <-tick.C:
		case <-deadline.C:
			if last != nil {
				tb.Fatalf("waiting for %s: not done after %v (last error: %v)", what, timeout, last)
			}
			tb.Fatalf("waiting for %s: not done after %v", what, timeout)
		}
	}
}
