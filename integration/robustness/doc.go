// Package robustness records traffic through etcd-snapcache with etcd's own
// robustness framework (go.etcd.io/etcd/tests/v3/robustness) and validates
// it: linearizability of the KV history, the watch guarantees, and
// historical reads replayed against etcd's WAL.
//
// TestRobustnessAuth runs the same scenarios against an etcd with auth
// enabled, the proxy running as root and the traffic as users with their
// own permissions. The framework's clients cannot carry credentials (its
// RecordingClient builds its clientv3.Config from endpoints alone), so each
// user's clients reach the proxy through a token front that adds the
// user's token to every call (auth_test.go).
//
// TestRobustnessHistoryBudget runs them with the proxy's history budget
// (--max-history-bytes) a small fraction of what the run writes, so that
// history is trimmed throughout (budget_test.go).
//
// TestRobustnessRestore replaces etcd, under the running traffic, by one
// restored from a snapshot taken a second earlier (etcdutl snapshot
// restore --bump-revision --mark-compacted), which loses acknowledged
// writes. No single etcd history explains such a run, so it is validated as
// the two it is made of: the old etcd's answers with its WAL, and the
// restored etcd's with the snapshot's requests and its own WAL, the bump
// taken out of its revisions; no answer may mix them, every watch open
// across the restore must end as compacted, and afterwards the proxy must
// answer every revision as the restored etcd does (restore_test.go).
//
// It is a separate module because the framework pulls heavy dependencies
// that the proxy itself does not need. Run it with
//
//	cd integration/robustness && go test -race -count=1 ./...
//
// Set RESULTS_DIR to choose where a failed run's report (client histories,
// etcd's data directory, and the linearization visualization when there is
// one) is saved; PERSIST_RESULTS keeps it for passing runs too.
package robustness
