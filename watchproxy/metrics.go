package watchproxy

import (
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Metrics are the Watch service's Prometheus metrics. A nil *Metrics
// records nothing.
type Metrics struct {
	streams          prometheus.Gauge
	watchers         prometheus.Gauge
	eventsSent       prometheus.Counter
	catchups         prometheus.Counter
	catchupsRunning  prometheus.Gauge
	catchupRestarts  *prometheus.CounterVec
	compactedCancels prometheus.Counter
	relayedStreams   prometheus.Counter
	encoded          prometheus.Gauge
}

// NewMetrics creates the Watch service's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "etcd_snapcache_watch_streams",
			Help: "Client watch streams served from the cache.",
		}),
		watchers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "etcd_snapcache_watchers",
			Help: "Client watchers served from the cache.",
		}),
		eventsSent: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "etcd_snapcache_watch_events_sent_total",
			Help: "Events sent to client watchers.",
		}),
		catchups: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "etcd_snapcache_watch_catchups_total",
			Help: "Watchers caught up from etcd's history because they started before the cache's.",
		}),
		catchupsRunning: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "etcd_snapcache_watch_catchups_running",
			Help: "Upstream watches open to catch watchers up from etcd's history (at most 8 at once; the rest wait).",
		}),
		catchupRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcd_snapcache_watch_catchup_restarts_total",
			Help: "Catch-up watches closed before the end and opened again from where they got to, by reason: stalled (the client did not read, and the catch-up gave its slot up) or broken (the upstream watch failed).",
		}, []string{"reason"}),
		compactedCancels: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "etcd_snapcache_watch_compacted_total",
			Help: "Watchers canceled because etcd compacted their next revision, or because the cache was found inconsistent.",
		}),
		relayedStreams: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "etcd_snapcache_watch_relayed_streams_total",
			Help: "Watch streams relayed to etcd whole: a token the proxy cannot attribute, the cache off or inconsistent, or the proxy's auth state too old to judge the caller.",
		}),
		encoded: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "etcd_snapcache_watch_encoded_bytes",
			Help: "Bytes of the newest revisions' events held encoded, shared by every watch stream that sends them, with the events they keep alive.",
		}),
	}
	reg.MustRegister(m.streams, m.watchers, m.eventsSent, m.catchups, m.catchupsRunning, m.catchupRestarts, m.compactedCancels, m.relayedStreams, m.encoded)
	return m
}

// Watching is the client watch streams and watchers served from the
// cache, as the watch_streams and watchers gauges read.
func (m *Metrics) Watching() (streams, watchers int64) {
	if m == nil {
		return 0, 0
	}
	return gaugeValue(m.streams), gaugeValue(m.watchers)
}

func gaugeValue(g prometheus.Gauge) int64 {
	var d dto.Metric
	if g.Write(&d) != nil {
		return 0
	}
	return int64(d.GetGauge().GetValue())
}

func (m *Metrics) streamOpened() {
	if m != nil {
		m.streams.Inc()
	}
}

func (m *Metrics) streamClosed() {
	if m != nil {
		m.streams.Dec()
	}
}

func (m *Metrics) watchersAdded(n int) {
	if m != nil {
		m.watchers.Add(float64(n))
	}
}

func (m *Metrics) watchersRemoved(n int) {
	if m != nil {
		m.watchers.Sub(float64(n))
	}
}

func (m *Metrics) relayed() {
	if m != nil {
		m.relayedStreams.Inc()
	}
}

func (m *Metrics) sent(events int) {
	if m != nil {
		m.eventsSent.Add(float64(events))
	}
}

func (m *Metrics) compacted() {
	if m != nil {
		m.compactedCancels.Inc()
	}
}

func (m *Metrics) caughtUp() {
	if m != nil {
		m.catchups.Inc()
	}
}

func (m *Metrics) catchupRunning(delta int) {
	if m != nil {
		m.catchupsRunning.Add(float64(delta))
	}
}

func (m *Metrics) catchupRestarted(reason string) {
	if m != nil {
		m.catchupRestarts.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) encodedBytes(delta int64) {
	if m != nil {
		m.encoded.Add(float64(delta))
	}
}
