// Package clients runs real client programs against etcd-snapcache, as
// separate processes: a real etcd (.tools/bin/etcd), the proxy as built by
// `make build` (bin/etcd-snapcache), and then
//
//   - etcdctl (TestEtcdctl): one deterministic script of etcdctl commands
//     runs against a fresh etcd directly and against another fresh etcd
//     behind the proxy, and the two transcripts must be identical once the
//     values that differ between two etcd clusters are replaced by
//     placeholders (see normalizer);
//   - kube-apiserver (TestKubeAPIServer): an unmodified kube-apiserver with
//     the proxy as its only etcd server, with the watch cache off and on,
//     driven through its HTTPS API; in plaintext, and with etcd's auth on
//     over mTLS, kube-apiserver identified by its certificate's common
//     name (the test CA is internal/testsupport's PKI);
//   - the deploy kit (TestDeploy*): the Dockerfile's static build, the
//     kube-apiserver sidecar manifest run for real over mTLS and accepted by
//     a server-side dry run, the systemd unit (systemd-analyze verify), and
//     every metric the Grafana dashboard and the alerting rules query,
//     present on a running proxy.
//
// It is its own module: it only runs binaries, and needs none of the main
// module's dependencies. Its imports from the repository are
// internal/testsupport (standard library only), through a replace of the
// main module by ../.. that brings no other module into its build, and a
// YAML parser for the deploy kit's manifests. Build
// the binaries first (tools/build.sh builds etcd, etcdctl and kube-apiserver from the
// Go module proxy into .tools/bin), then
//
//	cd integration/clients && go test -count=1 ./...
//
// The binaries are found through $ETCD_BIN, $ETCDCTL_BIN, $KUBE_APISERVER_BIN
// and $SNAPCACHE_BIN, or else in ../../.tools/bin and ../../bin. A missing
// binary fails the test with the command that builds it. Set
// $CLIENTS_LOG_DIR to keep every process's log (etcd, proxy,
// kube-apiserver) under that directory, one subdirectory per test.
package clients
