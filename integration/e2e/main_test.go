//go:build cluster_proxy || e2e_direct

package e2e

import (
	"fmt"
	"os"
	"testing"

	"go.etcd.io/etcd/client/pkg/v3/testutil"
	"go.etcd.io/etcd/tests/v3/framework/e2e"
)

// TestMain is etcd's (go.etcd.io/etcd/tests/v3/e2e/main_test.go): -bin-dir is
// the wrapper directory run.sh builds. The working directory must be that
// package's directory in the module cache, where run.sh runs this binary:
// the framework finds its certificates in ../fixtures.
func TestMain(m *testing.M) {
	e2e.InitFlags()
	if _, err := os.Stat(e2e.FixturesDir); err != nil {
		fmt.Fprintf(os.Stderr, "no etcd test fixtures at %s: run this through integration/e2e/run.sh, "+
			"which runs it in go.etcd.io/etcd/tests/v3/e2e's directory\n", e2e.FixturesDir)
		os.Exit(2)
	}
	v := m.Run()
	if v == 0 && testutil.CheckLeakedGoroutine() {
		os.Exit(1)
	}
	os.Exit(v)
}
