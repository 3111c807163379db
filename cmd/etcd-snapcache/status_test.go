package main

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap/zaptest"

	etcdversion "go.etcd.io/etcd/api/v3/version"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// statusWait bounds the waits of the status tests.
const statusWait = 30 * time.Second

// statusJSON runs `status -w json` with args and decodes what it printed;
// it returns the command's error too, which a failed endpoint makes.
func statusJSON(t *testing.T, args ...string) ([]proxyStatus, error) {
	t.Helper()
	out, err := run(append([]string{"status", "-w", "json"}, args...)...)
	var sts []proxyStatus
	if jerr := json.Unmarshal([]byte(out), &sts); jerr != nil {
		t.Fatalf("status -w json printed no JSON array (%v): %q; command error %v", jerr, out, err)
	}
	return sts, err
}

// statusTable runs `status -w table` with args and returns its output,
// failing t if the command failed.
func statusTable(t *testing.T, args ...string) string {
	t.Helper()
	out, err := run(append([]string{"status", "-w", "table"}, args...)...)
	if err != nil {
		t.Fatalf("status -w table: %v\n%s", err, out)
	}
	t.Logf("status -w table:\n%s", out)
	return out
}

// waitStatus runs `status -w json` with args until every endpoint's status
// satisfies cond, and returns those statuses.
func waitStatus(t *testing.T, what string, cond func(proxyStatus) bool, args ...string) []proxyStatus {
	t.Helper()
	var sts []proxyStatus
	testsupport.Poll(t, statusWait, 10*time.Millisecond, what, func() (bool, error) {
		var err error
		if sts, err = statusJSON(t, args...); err != nil {
			return false, err
		}
		return !slices.ContainsFunc(sts, func(st proxyStatus) bool { return !cond(st) }), nil
	})
	return sts
}

// tableRow returns the table's lines that hold the row of endpoint (its
// first line names it; the lines up to the next rule continue it).
func tableRow(t *testing.T, table, endpoint string) string {
	t.Helper()
	lines := strings.Split(table, "\n")
	for i, l := range lines {
		if !strings.HasPrefix(l, "| ") || !strings.Contains(strings.SplitN(l, "|", 3)[1], endpoint) {
			continue
		}
		row := []string{l}
		for _, next := range lines[i+1:] {
			if !strings.HasPrefix(next, "| ") || strings.TrimSpace(strings.SplitN(next, "|", 3)[1]) != "" {
				break
			}
			row = append(row, next)
		}
		return strings.Join(row, "\n")
	}
	t.Fatalf("no row for %s in the table:\n%s", endpoint, table)
	return ""
}

func client(t *testing.T, endpoint string, cfg clientv3.Config) *clientv3.Client {
	t.Helper()
	cfg.Endpoints = []string{endpoint}
	cfg.DialTimeout = 5 * time.Second
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func hasReason(st proxyStatus, source, reason string) bool {
	return slices.ContainsFunc(st.ReadsByReason, func(r readReason) bool {
		return r.Source == source && r.Reason == reason && r.Count > 0
	})
}

// TestStatusServing: against a proxy that serves from its cache, over
// https with a client certificate on its client port and over http on its
// --metrics-addr, status reports the same proxy twice: the upstream, its
// release and cluster; the cache at etcd's revision, no lag, the retained
// window and the history budget; the reads served from the cache by
// reason; the open watch; ready, with no failing check; and the mode
// serving; as JSON and as a table, exiting 0.
func TestStatusServing(t *testing.T) {
	etcd := server.EmbeddedEndpoint(servertest.StartEtcd(t, server.EmbeddedConfig{}))
	dir := t.TempDir()
	pki := testsupport.NewPKI(t)
	ca, srvCert, srvKey := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "proxy.crt"), filepath.Join(dir, "proxy.key")
	cliCert, cliKey := filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
	pki.WriteCA(t, ca)
	pki.WritePair(t, "proxy", testsupport.Server, srvCert, srvKey)
	pki.WritePair(t, "", testsupport.Client, cliCert, cliKey)
	p := servertest.StartProxy(t, servertest.Config(etcd, func(cfg *server.Config) {
		cfg.ServerTLS = transport.TLSInfo{CertFile: srvCert, KeyFile: srvKey, TrustedCAFile: ca}
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
	}))

	// Writes to etcd, then reads and a watch through the proxy.
	ctx, cancel := context.WithTimeout(context.Background(), statusWait)
	defer cancel()
	last := servertest.PutAndWait(ctx, t, client(t, etcd, clientv3.Config{}), p)
	servertest.ReadAndWatch(ctx, t, client(t, "https://"+p.Addr(), clientv3.Config{TLS: pki.ClientTLS(t, "")}), last)

	clientURL, metricsURL := "https://"+p.Addr(), "http://"+p.MetricsAddr()
	args := []string{"--endpoints", clientURL + "," + metricsURL, "--cacert", ca, "--cert", cliCert, "--key", cliKey}
	sts := waitStatus(t, "the watch and the reads counted", func(st proxyStatus) bool {
		return st.Watchers >= 1 && st.Reads >= 2
	}, args...)
	if len(sts) != 2 || sts[0].Endpoint != clientURL || sts[1].Endpoint != metricsURL {
		t.Fatalf("status of %s and %s: %+v", clientURL, metricsURL, sts)
	}
	for _, st := range sts {
		switch {
		case st.Error != "":
			t.Errorf("%s: error %q", st.Endpoint, st.Error)
		case st.Mode != "serving" || st.ModeReason != "" || !st.Ready || len(st.FailingChecks) != 0:
			t.Errorf("%s: mode %q (%q), ready %v, failing %v; want serving, ready", st.Endpoint, st.Mode, st.ModeReason, st.Ready, st.FailingChecks)
		case !slices.Equal(st.UpstreamEndpoints, []string{etcd}) || st.UpstreamVersion != etcdversion.Version || st.UpstreamClusterID == "" || !st.UpstreamWatchConnected:
			t.Errorf("%s: upstream %v %q cluster %q connected %v; want [%s] %s", st.Endpoint, st.UpstreamEndpoints, st.UpstreamVersion, st.UpstreamClusterID, st.UpstreamWatchConnected, etcd, etcdversion.Version)
		case st.Revision != last || st.RevisionLag != 0 || st.CompactRevision != 0 || st.OldestRevision < 1 || st.OldestRevision > last || st.RetainedRevisions < 1:
			t.Errorf("%s: revision %d lag %d compacted %d oldest %d retained %d; want %d, 0, 0, 1..%d, >0", st.Endpoint, st.Revision, st.RevisionLag, st.CompactRevision, st.OldestRevision, st.RetainedRevisions, last, last)
		case st.MaxHistoryBytes != revtree.DefaultMaxHistoryBytes || st.HistoryBytes < 0:
			t.Errorf("%s: history %d of %d; want a budget of %d", st.Endpoint, st.HistoryBytes, st.MaxHistoryBytes, revtree.DefaultMaxHistoryBytes)
		case st.CacheHitRatio != 1 || !hasReason(st, "cache", "serializable") || !hasReason(st, "cache", "historical"):
			t.Errorf("%s: hit ratio %v of %d, by reason %+v; want every read from the cache, serializable and historical", st.Endpoint, st.CacheHitRatio, st.Reads, st.ReadsByReason)
		case st.Watchers < 1 || st.WatchStreams < 1:
			t.Errorf("%s: %d watchers, %d streams; want the open watch", st.Endpoint, st.Watchers, st.WatchStreams)
		case st.StartTime == nil || time.Since(*st.StartTime) < 0:
			t.Errorf("%s: start time %v", st.Endpoint, st.StartTime)
		}
	}

	table := statusTable(t, args...)
	for _, h := range statusHeader {
		if !strings.Contains(table, h) {
			t.Errorf("the table has no %s column", h)
		}
	}
	for _, ep := range []string{clientURL, metricsURL} {
		row := tableRow(t, table, ep)
		for _, want := range []string{etcd, etcdversion.Version, " serving ", " true ", "100.0% of", "cache/serializable", "cache/historical"} {
			if !strings.Contains(row, want) {
				t.Errorf("%s's row has no %q:\n%s", ep, want, row)
			}
		}
	}

	// An endpoint that refuses and one that is etcd's, not a proxy's:
	// each reported with its error, after the proxy, and exit 1.
	refused := "http://" + testsupport.FreeAddr(t)
	sts, err := statusJSON(t, "--endpoints", metricsURL+","+refused+","+etcd)
	var exit cli.ExitCoder
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(err.Error(), refused) || !strings.Contains(err.Error(), etcd) {
		t.Errorf("status with failed endpoints: %v; want exit 1 naming them", err)
	}
	if len(sts) != 3 || sts[0].Error != "" || sts[0].Mode != "serving" ||
		sts[1].Endpoint != refused || sts[1].Error == "" ||
		sts[2].Endpoint != etcd || !strings.Contains(sts[2].Error, "not an etcd-snapcache endpoint") {
		t.Errorf("status with failed endpoints: %+v", sts)
	}
	out, err := run("status", "--endpoints", metricsURL+","+refused)
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(tableRow(t, out, metricsURL), "serving") || !strings.Contains(tableRow(t, out, refused), "refused") {
		t.Errorf("table with a failed endpoint: %v\n%s", err, out)
	}
}

// TestStatusLoading: while the proxy loads its cache (held on its first
// page), status reports the mode loading, not ready with the cache check
// failing and why, and no read served from the cache.
func TestStatusLoading(t *testing.T) {
	etcd := server.EmbeddedEndpoint(servertest.StartEtcd(t, server.EmbeddedConfig{}))
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	p := servertest.StartProxyUnready(t, servertest.Config(etcd, func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
		cfg.BeforeLoadPage = func() {
			once.Do(func() { close(held); <-release })
		}
	}))
	var releaseOnce sync.Once
	// Cleanups run last first: the load goes on before the proxy stops.
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	select {
	case <-held:
	case <-time.After(statusWait):
		t.Fatal("the proxy's load did not begin")
	}
	ctx, cancel := context.WithTimeout(context.Background(), statusWait)
	defer cancel()
	// Answered by etcd, or refused, while the cache loads: either way
	// not from the cache.
	viaProxy := client(t, "http://"+p.Addr(), clientv3.Config{})
	viaProxy.Get(ctx, "k", clientv3.WithSerializable())

	args := []string{"--endpoints", "http://" + p.Addr() + ",http://" + p.MetricsAddr()}
	sts := waitStatus(t, "the read counted", func(st proxyStatus) bool { return st.Reads >= 1 }, args...)
	for _, st := range sts {
		cacheCheck := slices.IndexFunc(st.FailingChecks, func(c readyCheck) bool { return c.Name == "cache" })
		switch {
		case st.Error != "":
			t.Errorf("%s: error %q", st.Endpoint, st.Error)
		case st.Mode != "loading" || st.ModeReason != "" || st.Ready:
			t.Errorf("%s: mode %q (%q), ready %v; want loading, not ready", st.Endpoint, st.Mode, st.ModeReason, st.Ready)
		case cacheCheck < 0 || !strings.Contains(st.FailingChecks[cacheCheck].Reason, "loading"):
			t.Errorf("%s: failing checks %+v; want the cache check, loading", st.Endpoint, st.FailingChecks)
		case st.CacheHitRatio != 0 || hasReason(st, "cache", "serializable") || len(st.ReadsByReason) == 0:
			t.Errorf("%s: hit ratio %v, reads by reason %+v; want the read not from the cache", st.Endpoint, st.CacheHitRatio, st.ReadsByReason)
		case !slices.Equal(st.UpstreamEndpoints, []string{etcd}):
			t.Errorf("%s: upstream %v", st.Endpoint, st.UpstreamEndpoints)
		}
	}

	table := statusTable(t, args...)
	row := tableRow(t, table, "http://"+p.Addr())
	for _, want := range []string{" loading ", " false ", "cache: the cache is loading", "0.0% of"} {
		if !strings.Contains(row, want) {
			t.Errorf("the row has no %q:\n%s", want, row)
		}
	}
}

// TestStatusForwarding: a proxy without an identity of its own in front
// of an etcd with auth enabled forwards every request; status says so,
// and why, and that it is ready: etcd answers for it.
func TestStatusForwarding(t *testing.T) {
	etcd := server.EmbeddedEndpoint(servertest.StartEtcd(t, server.EmbeddedConfig{}))
	ctx, cancel := context.WithTimeout(context.Background(), statusWait)
	defer cancel()
	admin := client(t, etcd, clientv3.Config{})
	for _, step := range []func() error{
		func() error { _, err := admin.UserAdd(ctx, "root", "rootpw"); return err },
		func() error { _, err := admin.RoleAdd(ctx, "root"); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := admin.AuthEnable(ctx); return err },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	p := servertest.StartProxyUnready(t, servertest.Config(etcd, func(cfg *server.Config) {
		cfg.Logger = zaptest.NewLogger(t)
	}))

	args := []string{"--endpoints", p.Addr()} // host:port: http
	waitStatus(t, "the forwarding mode, ready", func(st proxyStatus) bool { return st.Mode == "forwarding" && st.Ready }, args...)
	root := client(t, "http://"+p.Addr(), clientv3.Config{Username: "root", Password: "rootpw"})
	if _, err := root.Get(ctx, "k", clientv3.WithSerializable()); err != nil {
		t.Fatal(err)
	}
	sts := waitStatus(t, "the read counted", func(st proxyStatus) bool { return st.Reads >= 1 }, args...)
	st := sts[0]
	switch {
	case st.Endpoint != "http://"+p.Addr() || st.Error != "":
		t.Errorf("%s: error %q", st.Endpoint, st.Error)
	case st.Mode != "forwarding" || st.ModeReason != "etcd auth on, the proxy has no identity of its own" || !st.Ready || len(st.FailingChecks) != 0:
		t.Errorf("mode %q (%q), ready %v, failing %v; want forwarding for want of an identity, ready", st.Mode, st.ModeReason, st.Ready, st.FailingChecks)
	case st.CacheHitRatio != 0 || slices.ContainsFunc(st.ReadsByReason, func(r readReason) bool { return r.Source != "forwarded" }):
		t.Errorf("hit ratio %v, reads by reason %+v; want every read forwarded", st.CacheHitRatio, st.ReadsByReason)
	}

	row := tableRow(t, statusTable(t, args...), "http://"+p.Addr())
	for _, want := range []string{"forwarding (etcd auth on, the proxy has no identity of its own)", " true ", "0.0% of", "forwarded/"} {
		if !strings.Contains(row, want) {
			t.Errorf("the row has no %q:\n%s", want, row)
		}
	}
}

// TestStatusBadFlags: a bad flag value stops status before any request,
// with one line naming the flag.
func TestStatusBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"status", "-w", "yaml"}, "--write-out"},
		{[]string{"status", "--endpoints", "ftp://127.0.0.1:1"}, "--endpoints"},
		{[]string{"status", "--endpoints", "http://"}, "--endpoints"},
		{[]string{"status", "--cert", "client.crt"}, "--cert"},
	} {
		_, err := run(tc.args...)
		if err == nil {
			t.Errorf("%v: no error", tc.args)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, tc.flag) || strings.Contains(msg, "\n") {
			t.Errorf("%v: %q, want one line naming %s", tc.args, msg, tc.flag)
		}
	}
}

// TestStatusHelp: status --help shows its examples.
func TestStatusHelp(t *testing.T) {
	out, err := run("status", "--help")
	if err != nil || !strings.Contains(out, "Examples:") || !strings.Contains(out, "etcd-snapcache status -w json --endpoints=") || !strings.Contains(out, "--write-out value, -w value") {
		t.Fatalf("status --help: %v\n%s", err, out)
	}
}
