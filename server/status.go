package server

import (
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// upstreamInfo is etcd_snapcache_upstream_info: what the proxy sits in
// front of, as labels of a gauge that is always 1 (a Prometheus "info"
// metric), read at each scrape. `etcd-snapcache status` shows it.
type upstreamInfo struct {
	s    *Server
	desc *prometheus.Desc
}

func (u upstreamInfo) Describe(ch chan<- *prometheus.Desc) { ch <- u.desc }

func (u upstreamInfo) Collect(ch chan<- prometheus.Metric) {
	cluster := ""
	if id := u.s.follower.ClusterID(); id != 0 {
		cluster = strconv.FormatUint(id, 16)
	}
	ch <- prometheus.MustNewConstMetric(u.desc, prometheus.GaugeValue, 1,
		u.s.follower.UpstreamVersion(), strings.Join(u.s.cfg.Endpoints, ","), cluster)
}

// registerStatusMetrics registers the metrics that `etcd-snapcache status`
// reads beside the cache's, the watch's and the mode's own: the upstream's
// endpoints, release and cluster.
func (s *Server) registerStatusMetrics() {
	s.registry.MustRegister(upstreamInfo{s: s, desc: prometheus.NewDesc(
		"etcd_snapcache_upstream_info",
		"Always 1; its labels say what the proxy is in front of: version, the upstream etcd's release as its Maintenance.Status reports it (\"\" while unknown: not read yet, or refused, as etcd 3.6 refuses non-admins with auth on); endpoints, the upstream endpoints (--endpoints), comma-separated; cluster_id, the etcd cluster whose history the cache holds, in hex (\"\" before the first load).",
		[]string{"version", "endpoints", "cluster_id"}, nil,
	)})
}
