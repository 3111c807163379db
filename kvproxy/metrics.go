package kvproxy

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
)

// source is where a Range was answered from: the "source" label of the
// ranges metric, named in proxystatus, which /proxy/status shares.
type source string

const (
	sourceCache     = source(proxystatus.SourceCache)
	sourceForwarded = source(proxystatus.SourceForwarded)
	sourceRejected  = source(proxystatus.SourceRejected)
)

// reason is why a Range was answered where it was: the "reason" label of
// the ranges metric. Each request is counted once, with the reason that
// decided its source.
type reason string

const (
	// Served from the cache.
	reasonLinearizable reason = "linearizable" // proven fresh by the read fence
	reasonHistorical   reason = "historical"   // at a revision the cache holds
	reasonSerializable reason = "serializable" // at the cache's revision
	reasonWaited       reason = "waited"       // after the cache reached the revision

	// Forwarded to etcd.
	reasonAuth           reason = "auth"            // forwarded: carries a token, etcd checks it; rejected: etcd's permission refusal
	reasonAuthStale      reason = "auth_stale"      // the auth mirror's state is older than authcache.MaxMirrorAge: etcd checks the caller
	reasonInconsistent   reason = "inconsistent"    // the consistency check failed
	reasonNotRetained    reason = "not_retained"    // older than the cache's history
	reasonAhead          reason = "ahead"           // the cache did not reach the revision in time
	reasonNotReady       reason = "not_ready"       // the store is not loaded
	reasonVersionUnknown reason = "version_unknown" // keys-only, and the upstream's release is unknown
	reasonRangeStream    reason = "rangestream_unsupported"
	reasonForwarding     reason = "forwarding" // the cache is off: no identity of the proxy's own, and auth enabled

	// Forwarded or rejected.
	reasonLoading      reason = "loading"       // small reads forwarded, the rest refused
	reasonFreshTimeout reason = "fresh_timeout" // freshness not proven in time
	reasonFreshError   reason = "fresh_error"   // freshness could not be proven
	reasonFreshLagging reason = "fresh_lagging" // the cache lagged etcd's head past the fence's patience

	// Rejected.
	reasonCompacted reason = "compacted"
	reasonFuture    reason = "future"
	reasonOverload  reason = "overload" // no forwarding slot in time
	reasonMemory    reason = "memory"   // no room under --max-cached-read-bytes in time
)

// Metrics are the KV service's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	ranges *prometheus.CounterVec
	// rangeSeries are ranges' series by labels, each resolved on first
	// use (a series exists once a request was counted in it, as with
	// WithLabelValues): a request then neither hashes its labels nor
	// allocates them. Read-only after NewMetrics.
	rangeSeries     map[rangeLabels]*lazyCounter
	wentBack        prometheus.Counter
	cachedReadBytes prometheus.Gauge
}

// NewMetrics creates the KV service's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		ranges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "etcd_snapcache_range_requests_total",
			Help: "Range requests by source (cache, forwarded, rejected) and reason.",
		}, []string{"source", "reason"}),
		wentBack: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "etcd_snapcache_range_went_back_total",
			Help: "Serializable reads forwarded to etcd that a member answered below a revision the proxy had served, asked again as linearizable reads.",
		}),
		cachedReadBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "etcd_snapcache_cached_read_bytes",
			Help: "Bytes of responses served from the cache being built and sent, bounded by --max-cached-read-bytes.",
		}),
	}
	reg.MustRegister(m.ranges, m.wentBack, m.cachedReadBytes)
	m.rangeSeries = make(map[rangeLabels]*lazyCounter)
	for _, src := range []source{sourceCache, sourceForwarded, sourceRejected} {
		for _, why := range reasons {
			m.rangeSeries[rangeLabels{src, why}] = &lazyCounter{}
		}
	}
	return m
}

// reasons are every reason a Range is counted with: each has a row in
// TestRoute (TestRouteCoversEveryReason), and its series is resolved once.
var reasons = []reason{
	reasonLinearizable, reasonHistorical, reasonSerializable, reasonWaited,
	reasonAuth, reasonAuthStale, reasonInconsistent, reasonNotRetained, reasonAhead, reasonNotReady, reasonVersionUnknown, reasonRangeStream, reasonForwarding,
	reasonLoading, reasonFreshTimeout, reasonFreshError, reasonFreshLagging,
	reasonCompacted, reasonFuture, reasonOverload, reasonMemory,
}

type rangeLabels struct {
	src source
	why reason
}

// lazyCounter is a series of a CounterVec, resolved once.
type lazyCounter struct {
	once sync.Once
	c    prometheus.Counter
}

func (l *lazyCounter) get(vec *prometheus.CounterVec, src source, why reason) prometheus.Counter {
	l.once.Do(func() { l.c = vec.WithLabelValues(string(src), string(why)) })
	return l.c
}

// RangeRequests are the Range requests counted so far, by source and
// reason: the ranges metric's series, with the values a scrape reads (a
// series exists once a request was counted in it).
func (m *Metrics) RangeRequests() []proxystatus.RangeRequests {
	out := []proxystatus.RangeRequests{}
	if m == nil {
		return out
	}
	// Collect sends every series and returns: the goroutine ends once
	// the range below has drained the channel.
	ch := make(chan prometheus.Metric)
	go func() {
		m.ranges.Collect(ch)
		close(ch)
	}()
	for s := range ch {
		var d dto.Metric
		if s.Write(&d) != nil {
			continue
		}
		r := proxystatus.RangeRequests{Count: int64(d.GetCounter().GetValue())}
		for _, l := range d.GetLabel() {
			switch l.GetName() {
			case "source":
				r.Source = proxystatus.Source(l.GetValue())
			case "reason":
				r.Reason = l.GetValue()
			}
		}
		out = append(out, r)
	}
	return out
}

func (m *Metrics) observeWentBack() {
	if m != nil {
		m.wentBack.Inc()
	}
}

func (m *Metrics) setCachedReadBytes(n int64) {
	if m != nil {
		m.cachedReadBytes.Set(float64(n))
	}
}

func (m *Metrics) observe(src source, why reason) {
	if m != nil {
		if l := m.rangeSeries[rangeLabels{src, why}]; l != nil {
			l.get(m.ranges, src, why).Inc()
			return
		}
		m.ranges.WithLabelValues(string(src), string(why)).Inc()
	}
}
