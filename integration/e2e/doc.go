// Package e2e runs etcd's own end-to-end tests (go.etcd.io/etcd/tests/v3,
// packages e2e and common) in the framework's "cluster_proxy" mode, with
// etcd-snapcache in the role of `etcd grpc-proxy start`: every e2e member is
// an etcd process plus a proxy started with the framework's unmodified
// grpc-proxy command line (framework/e2e/cluster_proxy.go), and the clients
// the tests create (etcdctl, clientv3) talk to the proxies.
//
// run.sh builds a bin directory whose `etcd` is a wrapper: `etcd grpc-proxy
// start ARGS` runs `etcd-snapcache serve ARGS`, anything else the real etcd
// (.tools/bin, tools/build.sh). It compiles etcd's test packages from the
// module cache with -tags cluster_proxy and runs a selection of their tests,
// each in its own process, with -bin-dir=<wrapper dir>.
//
// This package holds etcd's e2e/watch_test.go (and the utils.go helpers it
// uses), copied unchanged but for the build tag: etcd builds it only without
// cluster_proxy. Its test binary runs in etcd's e2e package directory, as
// etcd's own does, so that the framework finds its fixtures in ../fixtures.
// Two tests are this package's own, on the same framework: --metrics-addr
// URLs on three proxies (metrics_addr_test.go), and a serializable read right
// after a write through a proxy that just started (read_your_writes_test.go).
// deps.go keeps in go.mod and go.sum what etcd's test packages import.
//
//	make integration-e2e          # from the repository root
//	integration/e2e/run.sh        # the same, once make build tools-etcd ran
//	E2E_PROXY=etcd integration/e2e/run.sh   # the same tests with etcd's own grpc-proxy
//	E2E_PROXY=none integration/e2e/run.sh   # the watch-delay tests against etcd alone
//
// It is a separate module so that go.etcd.io/etcd/tests/v3 stays out of the
// main module; it does not import the main module.
package e2e
