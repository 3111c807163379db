//go:build !cluster_proxy

package e2e

import "testing"

// Without the cluster_proxy tag the framework starts bare etcd members and
// no proxy: nothing here would test etcd-snapcache, so a run without it
// fails rather than passing vacuously.
func TestNeedsClusterProxyTag(t *testing.T) {
	t.Fatal("build with -tags cluster_proxy (run.sh does): without it no proxy is started")
}
