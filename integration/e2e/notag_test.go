//go:build !cluster_proxy && !e2e_direct

package e2e

import "testing"

// Without the cluster_proxy tag the framework starts bare etcd members and
// no proxy: nothing here would test etcd-snapcache, so a run without it
// fails rather than passing vacuously. e2e_direct (run.sh's E2E_PROXY=none)
// builds the watch tests without a proxy on purpose, to measure etcd alone.
func TestNeedsClusterProxyTag(t *testing.T) {
	t.Fatal("build with -tags cluster_proxy (run.sh does), or e2e_direct to run the watch tests against etcd alone: without either no proxy is started")
}
