package robustness

import (
	"testing"
)

// historyBudget is the proxy's history budget in
// TestRobustnessHistoryBudget: a small fraction of what a run writes, so
// that the oldest revisions are dropped over and over while the traffic
// runs.
const historyBudget = 4 << 10

// TestRobustnessHistoryBudget is TestRobustness with the proxy's history
// bounded (server.Config.MaxHistoryBytes, --max-history-bytes) far below
// what the run writes: the budget is reached within the first second and
// the oldest retained revision moves with every write after that (a few
// dozen revisions stay). Reads below it go to etcd, watches from below it
// catch up from etcd's history, and reads above it are served from memory,
// all in the same run; the validations are TestRobustness's, unchanged,
// and the run must have trimmed history
// (etcd_snapcache_history_trimmed_revisions_total).
//
// The fault is the cut of the proxy's upstream connection: a restart of
// etcd is TestRobustness's concern, not the budget's.
func TestRobustnessHistoryBudget(t *testing.T) {
	withRequestTimeout(t)
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			testRobustness(t, sc.traffic, cutUpstream, options{maxHistoryBytes: historyBudget})
		})
	}
}

// checkTrimmed fails a budget run in which the budget did nothing: the
// proxy must have dropped revisions to stay within it. How many reads and
// watches it then sent to etcd depends on the revisions the traffic picked,
// and is only logged.
func checkTrimmed(t *testing.T, m counters) {
	t.Helper()
	const (
		trimmed     = "etcd_snapcache_history_trimmed_revisions_total"
		notRetained = "etcd_snapcache_range_requests_total{reason=not_retained}"
		catchups    = "etcd_snapcache_watch_catchups_total"
	)
	t.Logf("history budget %d bytes: %v revisions trimmed; %v reads forwarded as no longer retained; %v watch catch-ups from etcd",
		historyBudget, m[trimmed], m[notRetained], m[catchups])
	if m[trimmed] == 0 {
		t.Errorf("%s = 0: the history budget of %d bytes was never reached", trimmed, historyBudget)
	}
}
