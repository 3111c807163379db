package progress

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Metrics are the follower's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	reg              prometheus.Registerer
	loads            prometheus.Counter
	reloads          *prometheus.CounterVec
	timelineChanges  *prometheus.CounterVec
	watchRestarts    prometheus.Counter
	events           prometheus.Counter
	compactions      *prometheus.CounterVec
	progressRequests prometheus.Counter
	fenceWait        prometheus.Histogram
}

// NewMetrics creates the follower's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	m := &Metrics{
		reg:   reg,
		loads: counter("etcd_snapcache_loads_total", "Loads of the whole keyspace from etcd, the first included."),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcd_snapcache_reloads_total",
			Help: "Reloads of the keyspace because the upstream watch could not resume, by reason (compacted, gap, inconsistent).",
		}, []string{"reason"}),
		watchRestarts: counter("etcd_snapcache_upstream_watch_restarts_total", "Times the upstream watch broke and was resumed."),
		events:        counter("etcd_snapcache_events_applied_total", "Upstream watch events applied to the cache."),
		compactions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcd_snapcache_compactions_observed_total",
			Help: "Compactions mirrored into the cache, by how they were learned (proxy, compact_rev_key, probe, watch).",
		}, []string{"source"}),
		progressRequests: counter("etcd_snapcache_upstream_progress_requests_total", "RequestProgress calls sent on the upstream watch."),
		fenceWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "etcd_snapcache_freshness_wait_seconds",
			Help:    "Time a linearizable read waited to prove the cache fresh (quorum read of etcd's revision, then the cache reaching it).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16), // 100µs to 3.3s
		}),
	}
	m.timelineChanges = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "etcd_snapcache_timeline_changes_total",
		Help: "Times etcd's history was found to differ from the cache's (a restore, another cluster), by the sign that showed it.",
	}, []string{"sign"})
	reg.MustRegister(m.timelineChanges)
	reg.MustRegister(m.loads, m.reloads, m.watchRestarts, m.events, m.compactions, m.progressRequests, m.fenceWait)
	return m
}

func (m *Metrics) bindFollower(f *Follower) {
	if m == nil {
		return
	}
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_upstream_revision_lag",
		Help: "Revisions between the highest head etcd has reported and the cache's revision.",
	}, func() float64 { return float64(f.RevisionLag()) }))
}

func (m *Metrics) bindStore(s *revtree.Store) {
	if m == nil {
		return
	}
	gauge := func(name, help string, fn func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, fn)
	}
	m.reg.MustRegister(
		gauge("etcd_snapcache_cache_revision", "Revision the cache is complete up to.",
			func() float64 { return float64(s.Rev()) }),
		gauge("etcd_snapcache_compact_revision", "etcd's compaction revision as mirrored by the cache.",
			func() float64 { return float64(s.CompactRev()) }),
		gauge("etcd_snapcache_oldest_snapshot_revision", "Revision of the oldest retained snapshot.",
			func() float64 { return float64(s.OldestRev()) }),
		gauge("etcd_snapcache_snapshots_retained", "Snapshots (revisions) retained in memory.",
			func() float64 { return float64(s.Snapshots()) }),
		gauge("etcd_snapcache_cache_bytes", "Estimated memory of the cache: the keyspace, retained history, and what dropped revisions leave in the key index until its sweep frees it.",
			func() float64 { return float64(s.ApproxBytes()) }),
		gauge("etcd_snapcache_history_bytes", "Estimated memory of retained history on top of the live keyspace: past revisions' values, versions and events, and the flattened-range cache; bounded by --max-history-bytes.",
			func() float64 { return float64(s.HistoryBytes()) }),
		gauge("etcd_snapcache_max_history_bytes", "The history budget, --max-history-bytes (0: unbounded).",
			func() float64 { return float64(s.MaxHistoryBytes()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "etcd_snapcache_history_trimmed_revisions_total",
			Help: "Retained revisions dropped, oldest first, to keep history within --max-history-bytes; reads below them go to etcd.",
		}, func() float64 { return float64(s.HistoryTrimmed()) }),
	)
}

func (m *Metrics) observeLoad() {
	if m != nil {
		m.loads.Inc()
	}
}

func (m *Metrics) observeReload(reason string) {
	if m != nil {
		m.reloads.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) observeTimelineChange(sign string) {
	if m != nil {
		m.timelineChanges.WithLabelValues(sign).Inc()
	}
}

func (m *Metrics) observeWatchRestart() {
	if m != nil {
		m.watchRestarts.Inc()
	}
}

func (m *Metrics) observeEvents(n int) {
	if m != nil {
		m.events.Add(float64(n))
	}
}

func (m *Metrics) observeCompaction(source string) {
	if m != nil {
		m.compactions.WithLabelValues(source).Inc()
	}
}

func (m *Metrics) observeProgressRequest() {
	if m != nil {
		m.progressRequests.Inc()
	}
}

func (m *Metrics) observeFenceWait(d time.Duration) {
	if m != nil {
		m.fenceWait.Observe(d.Seconds())
	}
}
