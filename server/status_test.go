package server_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap/zaptest"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestStatusAsTheMetrics: /proxy/status, on the client port and on
// --metrics-addr, says what the proxy's metrics say in the same run: the
// upstream, the mode, readiness, the cache's revisions and history, the
// Range requests by source and reason, the watchers and the process's
// start; after writes, reads from the cache and an open watch.
func TestStatusAsTheMetrics(t *testing.T) {
	etcd := server.EmbeddedEndpoint(servertest.StartEtcd(t, server.EmbeddedConfig{}))
	p := servertest.StartProxy(t, servertest.Config(etcd, func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	last := servertest.PutAndWait(ctx, t, newClient(t, etcd), p)
	servertest.ReadAndWatch(ctx, t, newClient(t, "http://"+p.Addr()), last)

	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	var doc proxystatus.Status
	testsupport.Poll(t, 30*time.Second, 10*time.Millisecond, "/proxy/status as the metrics say", func() (bool, error) {
		doc = fetchStatus(t, hc, "http://"+p.MetricsAddr())
		families, err := p.Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		if want := statusFromMetrics(t, families, doc.FailingChecks); !sameStatus(doc, want) {
			return false, fmt.Errorf("/proxy/status:\n%+v\nthe metrics:\n%+v", doc, want)
		}
		if other := fetchStatus(t, hc, "http://"+p.Addr()); !sameStatus(doc, other) {
			return false, fmt.Errorf("--metrics-addr's /proxy/status:\n%+v\nthe client port's:\n%+v", doc, other)
		}
		return true, nil
	})
	// What was done above is in it: the comparison is of values that
	// moved, not of zeros.
	hasReads := func(reason string) bool {
		return slices.ContainsFunc(doc.RangeRequests, func(r proxystatus.RangeRequests) bool {
			return r.Source == proxystatus.SourceCache && r.Reason == reason && r.Count > 0
		})
	}
	switch {
	case doc.Mode != proxystatus.ModeCache || !doc.Ready || len(doc.FailingChecks) != 0:
		t.Errorf("mode %q, ready %v, failing %+v; want the cache's, ready", doc.Mode, doc.Ready, doc.FailingChecks)
	case doc.Revision != last || !slices.Equal(doc.UpstreamEndpoints, []string{etcd}) || doc.UpstreamClusterID == "":
		t.Errorf("revision %d, upstream %v cluster %q; want %d, [%s]", doc.Revision, doc.UpstreamEndpoints, doc.UpstreamClusterID, last, etcd)
	case !hasReads("serializable") || !hasReads("historical") || doc.Requests(proxystatus.SourceCache) < 2:
		t.Errorf("range requests %+v; want the reads from the cache", doc.RangeRequests)
	case doc.UpstreamWatchMember != strings.TrimPrefix(etcd, "http://") || len(doc.UnresponsiveMembers) != 0:
		t.Errorf("upstream watch on %q, unresponsive %v; want %s, none", doc.UpstreamWatchMember, doc.UnresponsiveMembers, etcd)
	case doc.Watchers < 1 || doc.WatchStreams < 1 || doc.StartTime == nil:
		t.Errorf("%d watchers, %d streams, start %v; want the open watch and a start", doc.Watchers, doc.WatchStreams, doc.StartTime)
	}
}

func newClient(t *testing.T, endpoint string) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func fetchStatus(t *testing.T, hc *http.Client, base string) proxystatus.Status {
	t.Helper()
	resp, err := hc.Get(base + proxystatus.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		t.Fatalf("GET %s%s: %s, %s", base, proxystatus.Path, resp.Status, resp.Header.Get("Content-Type"))
	}
	var st proxystatus.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("GET %s%s: %v", base, proxystatus.Path, err)
	}
	return st
}

// statusFromMetrics is the status the metrics report; the failing checks,
// which no metric names, are failing's.
func statusFromMetrics(t *testing.T, families []*dto.MetricFamily, failing []proxystatus.Check) proxystatus.Status {
	t.Helper()
	byName := map[string][]*dto.Metric{}
	for _, f := range families {
		byName[f.GetName()] = f.GetMetric()
	}
	value := func(m *dto.Metric) float64 {
		return cmp.Or(m.GetGauge().GetValue(), m.GetCounter().GetValue(), m.GetUntyped().GetValue())
	}
	one := func(name string) int64 {
		ms := byName[name]
		if len(ms) != 1 {
			t.Fatalf("%d series of %s, want one", len(ms), name)
		}
		return int64(value(ms[0]))
	}
	label := func(m *dto.Metric, name string) string {
		for _, l := range m.GetLabel() {
			if l.GetName() == name {
				return l.GetValue()
			}
		}
		return ""
	}
	st := proxystatus.Status{
		UpstreamWatchConnected: one("etcd_snapcache_upstream_watch_connected") == 1,
		Ready:                  one("etcd_snapcache_ready") == 1,
		FailingChecks:          failing,
		Revision:               one("etcd_snapcache_cache_revision"),
		RevisionLag:            one("etcd_snapcache_upstream_revision_lag"),
		CompactRevision:        one("etcd_snapcache_compact_revision"),
		OldestRevision:         one("etcd_snapcache_oldest_snapshot_revision"),
		RetainedRevisions:      one("etcd_snapcache_snapshots_retained"),
		HistoryBytes:           one("etcd_snapcache_history_bytes"),
		MaxHistoryBytes:        one("etcd_snapcache_max_history_bytes"),
		Watchers:               one("etcd_snapcache_watchers"),
		WatchStreams:           one("etcd_snapcache_watch_streams"),
		RangeRequests:          []proxystatus.RangeRequests{},
	}
	if ms := byName["etcd_snapcache_upstream_watch_member"]; len(ms) == 1 {
		st.UpstreamWatchMember = label(ms[0], "member")
	}
	st.UnresponsiveMembers = []string{}
	for _, m := range byName["etcd_snapcache_upstream_member_unresponsive"] {
		if value(m) == 1 {
			st.UnresponsiveMembers = append(st.UnresponsiveMembers, label(m, "member"))
		}
	}
	slices.Sort(st.UnresponsiveMembers)
	for _, m := range byName["etcd_snapcache_mode"] {
		if value(m) == 1 {
			st.Mode = proxystatus.Mode(label(m, "mode"))
		}
	}
	if info := byName["etcd_snapcache_upstream_info"]; len(info) == 1 {
		st.UpstreamEndpoints = strings.Split(label(info[0], "endpoints"), ",")
		st.UpstreamVersion = label(info[0], "version")
		st.UpstreamClusterID = label(info[0], "cluster_id")
	}
	for _, m := range byName["etcd_snapcache_range_requests_total"] {
		st.RangeRequests = append(st.RangeRequests, proxystatus.RangeRequests{
			Source: proxystatus.Source(label(m, "source")), Reason: label(m, "reason"), Count: int64(value(m)),
		})
	}
	if ms := byName["process_start_time_seconds"]; len(ms) == 1 {
		start := time.UnixMilli(int64(math.Round(value(ms[0]) * 1000))).UTC()
		st.StartTime = &start
	}
	return st
}

// sameStatus compares two statuses, their range requests in any order.
func sameStatus(a, b proxystatus.Status) bool {
	if (a.StartTime == nil) != (b.StartTime == nil) || (a.StartTime != nil && !a.StartTime.Equal(*b.StartTime)) {
		return false
	}
	a.StartTime, b.StartTime = nil, nil
	order := func(x, y proxystatus.RangeRequests) int {
		return cmp.Or(strings.Compare(string(x.Source), string(y.Source)), strings.Compare(x.Reason, y.Reason))
	}
	a.RangeRequests = slices.SortedFunc(slices.Values(a.RangeRequests), order)
	b.RangeRequests = slices.SortedFunc(slices.Values(b.RangeRequests), order)
	return reflect.DeepEqual(a, b)
}
