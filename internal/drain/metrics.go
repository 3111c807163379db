package drain

import (
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/connectivity"
)

// The metrics are the process's, as the balancer is: every connection
// dialed with DialOptions counts in them.
var (
	unresponsiveTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "etcd_snapcache_upstream_member_unresponsive_total",
		Help: "Times an etcd member did not answer the proxy's Status probe within 3 s on a connection where it was ready, by member (each upstream connection counts: two with --user).",
	}, []string{"member"})
	unresponsiveDesc = prometheus.NewDesc("etcd_snapcache_upstream_member_unresponsive",
		"1 while an etcd member the proxy is connected to has not answered its last Status probe within 3 s: the proxy sends it nothing new while another member answers.",
		[]string{"member"}, nil)

	// live holds the balancers not yet closed, for the gauge.
	live = struct {
		mu    sync.Mutex
		conns map[*clientConn]struct{} // guarded by mu
	}{conns: map[*clientConn]struct{}{}}
)

// Collector returns the process's drain metrics: per member the proxy is
// connected to, whether it is unresponsive now, and how many times it was
// found so.
func Collector() prometheus.Collector { return collector{} }

type collector struct{}

func (collector) Describe(ch chan<- *prometheus.Desc) {
	unresponsiveTotal.Describe(ch)
	ch <- unresponsiveDesc
}

func (collector) Collect(ch chan<- prometheus.Metric) {
	unresponsiveTotal.Collect(ch)
	for m, hung := range members() {
		v := 0.0
		if hung {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(unresponsiveDesc, prometheus.GaugeValue, v, m)
	}
}

// Unresponsive returns the members, sorted, that a connection of the
// process is READY to and that did not answer its last probe in time.
func Unresponsive() []string {
	var out []string
	for m, hung := range members() {
		if hung {
			out = append(out, m)
		}
	}
	slices.Sort(out)
	return out
}

// members maps each member some connection is READY to to whether one
// such connection finds it unresponsive.
func members() map[string]bool {
	out := map[string]bool{}
	live.mu.Lock()
	defer live.mu.Unlock()
	for c := range live.conns {
		for _, sc := range c.all() {
			sc.mu.Lock()
			ready, hung := sc.state == connectivity.Ready, sc.unresponding
			sc.mu.Unlock()
			if ready {
				out[sc.addr] = out[sc.addr] || hung
			}
		}
	}
	return out
}

func track(c *clientConn) {
	live.mu.Lock()
	live.conns[c] = struct{}{}
	live.mu.Unlock()
}

func untrack(c *clientConn) {
	live.mu.Lock()
	delete(live.conns, c)
	live.mu.Unlock()
	updateReleases()
}

// releases says whether the members some connection of the process is
// READY to run different etcd releases (major.minor), as their latest
// answers to the probes say: true during a rolling upgrade or downgrade.
var releases = struct {
	update  sync.Mutex // held by updateReleases throughout; before mu
	mu      sync.Mutex
	mixed   bool          // guarded by mu
	changed chan struct{} // guarded by mu; closed, and replaced, when mixed changes
}{changed: make(chan struct{})}

// MixedReleases reports whether the READY members run different releases,
// and returns a channel closed when that changes.
func MixedReleases() (mixed bool, changed <-chan struct{}) {
	releases.mu.Lock()
	defer releases.mu.Unlock()
	return releases.mixed, releases.changed
}

// updateReleases forgets the statuses of members no connection is READY
// to, and recomputes releases.mixed from the READY members' statuses; it
// runs when a member's release or the READY set changes. A READY member
// whose probe has not answered yet does not count.
func updateReleases() {
	// Held from the snapshot to the publication, so that two updates
	// cannot publish in the wrong order.
	releases.update.Lock()
	defer releases.update.Unlock()
	ready := members()
	statuses.Range(func(addr, _ any) bool {
		if _, ok := ready[addr.(string)]; !ok {
			statuses.Delete(addr)
		}
		return true
	})
	seen := map[string]bool{}
	for addr := range ready {
		if st, ok := statusOf(addr); ok && st.release != "" {
			seen[st.release] = true
		}
	}
	mixed := len(seen) > 1
	releases.mu.Lock()
	defer releases.mu.Unlock()
	if mixed != releases.mixed {
		releases.mixed = mixed
		close(releases.changed)
		releases.changed = make(chan struct{})
	}
}
