package server

import (
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
)

// status is the proxy's status document, /proxy/status: read at each
// request from the values the metrics read (the store, the follower, the
// mode, the readiness checks, the KV and Watch services' counters), so
// that the two never tell different stories.
func (s *Server) status() proxystatus.Status {
	up := s.upstreamStatus()
	st := proxystatus.Status{
		UpstreamEndpoints:      up.endpoints,
		UpstreamVersion:        up.version,
		UpstreamClusterID:      up.clusterID,
		UpstreamWatchConnected: s.follower.Following(),
		UpstreamWatchMember:    s.follower.WatchMember(),
		UnresponsiveMembers:    append([]string{}, drain.Unresponsive()...),
		Mode:                   s.mode(),
		FailingChecks:          []proxystatus.Check{},
		Revision:               s.store.Rev(),
		RevisionLag:            s.follower.RevisionLag(),
		CompactRevision:        s.store.CompactRev(),
		OldestRevision:         s.store.OldestRev(),
		RetainedRevisions:      int64(s.store.Snapshots()),
		HistoryBytes:           s.store.HistoryBytes(),
		MaxHistoryBytes:        s.store.MaxHistoryBytes(),
		RangeRequests:          s.svc.kvMetrics.RangeRequests(),
		StartTime:              processStart(),
	}
	for _, c := range s.readyChecks() {
		if err := c.check(); err != nil {
			st.FailingChecks = append(st.FailingChecks, proxystatus.Check{Name: c.name, Reason: err.Error()})
		}
	}
	st.Ready = len(st.FailingChecks) == 0
	st.WatchStreams, st.Watchers = s.svc.watchMetrics.Watching()
	return st
}

// statusHandler serves the status document as JSON.
func statusHandler(status func() proxystatus.Status) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		b, err := json.Marshal(status())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Write(append(b, '\n'))
	})
}

// processStart is when the process started, as the process collector
// reports it (process_start_time_seconds), to the millisecond; nil where
// it reports none. It never changes: read once.
var processStart = sync.OnceValue(func() *time.Time {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// A failing collector reports what it could, with an error.
	families, _ := reg.Gather()
	for _, f := range families {
		if f.GetName() != "process_start_time_seconds" || len(f.GetMetric()) == 0 {
			continue
		}
		if v := f.GetMetric()[0].GetGauge().GetValue(); v > 0 {
			t := time.UnixMilli(int64(math.Round(v * 1000))).UTC()
			return &t
		}
	}
	return nil
})

// upstreamFields is what the proxy is in front of.
type upstreamFields struct {
	endpoints          []string
	version, clusterID string
}

func (s *Server) upstreamStatus() upstreamFields {
	up := upstreamFields{endpoints: s.cfg.Endpoints, version: s.follower.UpstreamVersion()}
	if up.endpoints == nil {
		up.endpoints = []string{}
	}
	if id := s.follower.ClusterID(); id != 0 {
		up.clusterID = strconv.FormatUint(id, 16)
	}
	return up
}

// upstreamInfo is etcd_snapcache_upstream_info: what the proxy sits in
// front of, as labels of a gauge that is always 1 (a Prometheus "info"
// metric), read at each scrape.
type upstreamInfo struct {
	s    *Server
	desc *prometheus.Desc
}

func (u upstreamInfo) Describe(ch chan<- *prometheus.Desc) { ch <- u.desc }

func (u upstreamInfo) Collect(ch chan<- prometheus.Metric) {
	up := u.s.upstreamStatus()
	ch <- prometheus.MustNewConstMetric(u.desc, prometheus.GaugeValue, 1,
		up.version, strings.Join(up.endpoints, ","), up.clusterID)
}

// registerStatusMetrics registers the metrics of what /proxy/status says
// beside the cache's, the watch's and the mode's own: the upstream's
// endpoints, release and cluster.
func (s *Server) registerStatusMetrics() {
	s.registry.MustRegister(upstreamInfo{s: s, desc: prometheus.NewDesc(
		"etcd_snapcache_upstream_info",
		"Always 1; its labels say what the proxy is in front of: version, the upstream etcd's release as its Maintenance.Status reports it (\"\" while unknown: not read yet, or refused, as etcd 3.6 refuses non-admins with auth on); endpoints, the upstream endpoints (--endpoints), comma-separated; cluster_id, the etcd cluster whose history the cache holds, in hex (\"\" before the first load).",
		[]string{"version", "endpoints", "cluster_id"}, nil,
	)})
}
