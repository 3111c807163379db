package kvproxy

import "github.com/prometheus/client_golang/prometheus"

// Sources of a Range answer, the "source" label of the ranges metric.
const (
	sourceCache     = "cache"
	sourceForwarded = "forwarded"
	sourceRejected  = "rejected"
)

// Metrics are the KV service's Prometheus metrics.
type Metrics struct {
	ranges *prometheus.CounterVec
}

// NewMetrics creates the KV service's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		ranges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcd_snapcache_range_requests_total",
			Help: "Range requests by source (cache, forwarded, rejected) and reason.",
		}, []string{"source", "reason"}),
	}
	reg.MustRegister(m.ranges)
	return m
}

func (m *Metrics) observe(source, reason string) {
	if m != nil {
		m.ranges.WithLabelValues(source, reason).Inc()
	}
}
