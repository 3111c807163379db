// Package robustness records traffic through etcd-snapcache with etcd's own
// robustness framework (go.etcd.io/etcd/tests/v3/robustness) and validates
// it: linearizability of the KV history, the watch guarantees, and
// historical reads replayed against etcd's WAL.
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
