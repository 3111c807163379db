package persist

import (
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the copy's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	reg      prometheus.Registerer
	restores *prometheus.CounterVec
	writes   *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

// NewMetrics creates the copy's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		reg: reg,
		restores: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcd_snapcache_disk_restores_total",
			Help: "Starts from the cache's copy on disk, by result: warm (restored and proven etcd's history), none (no copy), damaged (a checksum or the format failed), unreadable, or the check against etcd that refused it (cluster-id, head-below-disk, compacted, history).",
		}, []string{"result"}),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcd_snapcache_disk_writes_total",
			Help: "Writes of the cache's copy on disk, by kind (append: the revisions since the last; rewrite: a whole copy) and result (ok, error).",
		}, []string{"kind", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "etcd_snapcache_disk_write_seconds",
			Help:    "Time a write of the cache's copy on disk took, fsync included, by kind.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16), // 1ms to 33s
		}, []string{"kind"}),
	}
	reg.MustRegister(m.restores, m.writes, m.duration)
	return m
}

// bind exports the state of p.
func (m *Metrics) bind(p *Persister) {
	if m == nil {
		return
	}
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_disk_revision",
		Help: "The revision the cache's copy on disk is complete up to; 0 while there is none.",
	}, func() float64 { return float64(p.diskRev.Load()) }), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_disk_bytes",
		Help: "Size of the file of the cache's copy on disk.",
	}, func() float64 {
		fi, err := os.Stat(p.path)
		if err != nil {
			return 0
		}
		return float64(fi.Size())
	}), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_disk_write_failing",
		Help: "1 while the last write of the cache's copy on disk failed (a full disk, a read-only --data-dir): the proxy serves from memory, and a restart loads more from etcd.",
	}, func() float64 {
		if p.Failing() != nil {
			return 1
		}
		return 0
	}))
}

func (m *Metrics) observeRestore(result string) {
	if m != nil {
		m.restores.WithLabelValues(result).Inc()
	}
}

func (m *Metrics) observeWrite(kind string, err error, took time.Duration) {
	if m == nil {
		return
	}
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.writes.WithLabelValues(kind, result).Inc()
	m.duration.WithLabelValues(kind).Observe(took.Seconds())
}
