package clients

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// kubeAPIServerPerms are the permissions of the etcd role kube-apiserver's
// user has (etcdctl role grant-permission arguments): what kube-apiserver
// needs, and no more, as found against etcd directly.
//
//   - READWRITE on /registry/: its objects, and /registry/health for its
//     etcd health checks. Status (version detection, the db size metric)
//     and LeaseGrant (events) need only an authenticated user.
//   - READ on compact_rev_key: with ListFromCacheSnapshot (on by default)
//     its compactor reads and watches that key to learn compactions.
//     Without it, that read fails every second with "permission denied",
//     the watch cache never learns a compaction, and a LIST at a compacted
//     resourceVersion is answered 200 from the cache's snapshots instead of
//     410 Gone.
//   - Not WRITE on compact_rev_key, and not root: Compact is admin-only, so
//     its compactor cannot compact anyway. With WRITE, each run's Txn would
//     bump compact_rev_key to a revision that the refused Compact then
//     leaves uncompacted, and kube-apiserver would take it for compacted
//     (410 for reads etcd still serves). With READ, etcd refuses the whole
//     Txn: nothing is written, and the compactor logs the refusal and
//     retries at its next interval (checkCompactorRefused). Compaction is
//     then an administrator's job: here the test's, as root, announced in
//     compact_rev_key as kube-apiserver's compactor announces its own.
var kubeAPIServerPerms = [][]string{
	{"readwrite", "/registry/", "--prefix"},
	{"read", "compact_rev_key"},
}

// etcdAuthStorage is kube-apiserver's storage as in clusters that enable
// etcd's RBAC, every hop over mTLS with certificates of one test CA:
//
//   - etcd serves TLS with --client-cert-auth (a tokenless caller is the
//     user its certificate's common name names) and has auth enabled, with
//     the users root (role root, password rootpw) and kube-apiserver (no
//     password; role kube-apiserver with kubeAPIServerPerms);
//   - the proxy serves TLS with --client-cert-auth too, reaches etcd with
//     a client certificate without a common name, so that it lends no
//     identity to what it forwards (etcd 3.7.3 takes a verified
//     certificate without one for the user "", which does not exist:
//     "permission denied" rather than "user name is empty"), and is root
//     (--user) for its own load, watch and mirror;
//   - kube-apiserver reaches the proxy with a client certificate for CN
//     kube-apiserver and no password: every request it sends is that
//     user's;
//   - the test's etcdctl (its reads of etcd and its compactions) is root,
//     by password, over mTLS with a certificate without a common name.
func etcdAuthStorage(t *testing.T, bins kubeBins) kubeStorage {
	t.Helper()
	pki, file := testsupport.WriteKubeEtcdPKI(t, t.TempDir())
	// The HTTP endpoints' client (/readyz, /proxy/metrics): no identity.
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: pki.ClientTLS(t, "")}}
	ctlTLS := []string{"--cacert=" + file("ca.crt"), "--cert=" + file("anonymous.crt"), "--key=" + file("anonymous.key")}

	e := startEtcdTLS(t, "etcd", &serverTLS{cert: file("etcd.crt"), key: file("etcd.key"), ca: file("ca.crt"), client: hc}, "--client-cert-auth")
	etcdCtl := append([]string{"--endpoints=" + e.url}, ctlTLS...)
	setup := [][]string{
		{"role", "add", "root"},
		{"user", "add", "root", "--new-user-password=rootpw", "--interactive=false"},
		{"user", "grant-role", "root", "root"},
		{"role", "add", "kube-apiserver"},
	}
	for _, perm := range kubeAPIServerPerms {
		setup = append(setup, append([]string{"role", "grant-permission", "kube-apiserver"}, perm...))
	}
	setup = append(setup,
		[]string{"user", "add", "kube-apiserver", "--no-password"},
		[]string{"user", "grant-role", "kube-apiserver", "kube-apiserver"},
		[]string{"auth", "enable"},
	)
	for _, args := range setup {
		runEtcdctl(t, bins.ctl, etcdCtl, args...)
	}
	etcdCtl = append(etcdCtl, "--user=root:rootpw")

	px := startProxyTLS(t, "proxy", e.url, &serverTLS{cert: file("proxy.crt"), key: file("proxy.key"), ca: file("ca.crt"), client: hc},
		"--client-cert-auth",
		"--cacert="+file("ca.crt"), "--cert="+file("anonymous.crt"), "--key="+file("anonymous.key"),
		"--user=root:rootpw",
	)
	return kubeStorage{
		etcd: e, proxy: px,
		kubeArgs: []string{
			"--etcd-servers=" + px.url,
			"--etcd-cafile=" + file("ca.crt"),
			"--etcd-certfile=" + file("kube-apiserver.crt"),
			"--etcd-keyfile=" + file("kube-apiserver.key"),
			// Its compactor runs, and is refused, during the scenario.
			"--etcd-compaction-interval=2s",
		},
		etcdCtl:   etcdCtl,
		proxyCtl:  append([]string{"--endpoints=" + px.url, "--user=root:rootpw"}, ctlTLS...),
		tolerated: []string{compactorRefused, compactorTxnRefused},
		check:     checkCompactorRefused,
	}
}

// kube-apiserver's compactor runs every --etcd-compaction-interval (2s
// here) and, with the kube-apiserver role, is refused each time: its Txn
// that first bumps compact_rev_key writes a key the role may only read,
// so etcd refuses the whole Txn and Compact (admin-only) is never sent.
// These are the log lines of one refused run: the etcd client's warning,
// with etcd's code and message, and the compactor's error.
const (
	compactorTxnRefused = `"method":"/etcdserverpb.KV/Txn","attempt":0,"error":"rpc error: code = PermissionDenied desc = etcdserver: permission denied"`
	compactorRefused    = "compact failed: etcdserver: permission denied"
)

// checkCompactorRefused checks that kube-apiserver's compactor ran and was
// refused, with etcd's error, and that the refusal wrote nothing:
// compact_rev_key holds only the test's own writes (made as root, in
// compact), so neither the proxy nor etcd ran the compactor's Txn.
func checkCompactorRefused(k *kubeEnv) {
	k.t.Helper()
	waitUntil(k.t, 30*time.Second, "kube-apiserver's compactor to be refused", func() (bool, error) {
		log := k.kube.log()
		if !strings.Contains(log, compactorRefused) || !strings.Contains(log, compactorTxnRefused) {
			return false, fmt.Errorf("kube-apiserver's log has no %q with %q", compactorRefused, compactorTxnRefused)
		}
		return true, nil
	}, k.kube)
	out := k.etcdctl(k.etcdCtl, "get", "compact_rev_key", "-w", "json")
	var r struct {
		Kvs []struct {
			Version int64 `json:"version"`
		} `json:"kvs"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		k.t.Fatalf("etcdctl get compact_rev_key: %v: %s", err, out)
	}
	var version int64
	if len(r.Kvs) > 0 {
		version = r.Kvs[0].Version
	}
	if version != int64(k.revKeyWrites) {
		k.t.Errorf("compact_rev_key is at version %d, but the test wrote it %d times: kube-apiserver's refused compactor wrote it", version, k.revKeyWrites)
	}
	k.t.Logf("kube-apiserver's compactor refused %d times with etcd's PermissionDenied; compact_rev_key written only by the test (%d times)",
		strings.Count(k.kube.log(), compactorRefused), k.revKeyWrites)
}
