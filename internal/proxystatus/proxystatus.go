// Package proxystatus is the contract of the proxy's status: the document
// it serves at /proxy/status (Path), beside /readyz, on its client port and
// on --metrics-addr, which `etcd-snapcache status` and the process-level
// benchmarks read; and the one list of the names in it that the metrics
// share: the modes (the mode metric's label) and the sources of Range
// requests (the ranges metric's source label).
//
// The proxy builds the document from the same values its metrics read, at
// each request: the metrics stay for Prometheus, the document is for
// programs that want the status without parsing them. Fields are only
// ever added.
//
// It imports nothing of the proxy's, so that the server, the command and
// the benchmarks can all import it.
package proxystatus

import "time"

// Path is where the proxy serves Status, as JSON.
const Path = "/proxy/status"

// Status is the proxy's status, as /proxy/status serves it. Each field
// names, in its comment, the metric that reports the same value.
type Status struct {
	// UpstreamEndpoints are the proxy's --endpoints; UpstreamVersion is
	// etcd's release as its Maintenance.Status reports it, "" while the
	// proxy does not know it (not read yet, or refused: etcd 3.6 refuses
	// non-admins with auth on); UpstreamClusterID is the etcd cluster
	// whose history the cache holds, in hex, "" before the first load
	// (etcd_snapcache_upstream_info's labels).
	UpstreamEndpoints []string `json:"upstream_endpoints"`
	UpstreamVersion   string   `json:"upstream_version"`
	UpstreamClusterID string   `json:"upstream_cluster_id"`
	// UpstreamWatchConnected: the upstream watch that feeds the cache is
	// established (etcd_snapcache_upstream_watch_connected).
	UpstreamWatchConnected bool `json:"upstream_watch_connected"`
	// UpstreamWatchMember is the etcd member the upstream watch runs on,
	// as its address was given; "" while the watch is not established
	// (etcd_snapcache_upstream_watch_member's label).
	UpstreamWatchMember string `json:"upstream_watch_member"`
	// UnresponsiveMembers are the etcd members, sorted, that did not
	// answer the proxy's last Status probe in time: the proxy sends them
	// nothing new while another member answers
	// (etcd_snapcache_upstream_member_unresponsive).
	UnresponsiveMembers []string `json:"unresponsive_members"`

	// Mode is what the proxy serves from (etcd_snapcache_mode).
	Mode Mode `json:"mode"`
	// Ready is what /readyz answers (etcd_snapcache_ready), and
	// FailingChecks its failing checks, as /readyz?verbose lists them;
	// never nil.
	Ready         bool    `json:"ready"`
	FailingChecks []Check `json:"failing_checks"`

	// Revision is the revision the cache is complete up to
	// (etcd_snapcache_cache_revision), RevisionLag how far behind etcd's
	// highest reported head it is (etcd_snapcache_upstream_revision_lag).
	Revision    int64 `json:"revision"`
	RevisionLag int64 `json:"revision_lag"`
	// CompactRevision is etcd's compaction revision as mirrored
	// (etcd_snapcache_compact_revision); OldestRevision and
	// RetainedRevisions the retained window
	// (etcd_snapcache_oldest_snapshot_revision,
	// etcd_snapcache_snapshots_retained).
	CompactRevision   int64 `json:"compact_revision"`
	OldestRevision    int64 `json:"oldest_revision"`
	RetainedRevisions int64 `json:"retained_revisions"`
	// HistoryBytes is retained history's memory
	// (etcd_snapcache_history_bytes), MaxHistoryBytes its budget,
	// --max-history-bytes, 0: unbounded
	// (etcd_snapcache_max_history_bytes).
	HistoryBytes    int64 `json:"history_bytes"`
	MaxHistoryBytes int64 `json:"max_history_bytes"`

	// RangeRequests are the Range requests counted since the proxy
	// started, one entry a (source, reason) counted at least once
	// (etcd_snapcache_range_requests_total); never nil.
	RangeRequests []RangeRequests `json:"range_requests"`

	// Watchers and WatchStreams are the client watchers and watch
	// streams served from the cache (etcd_snapcache_watchers,
	// etcd_snapcache_watch_streams).
	Watchers     int64 `json:"watchers"`
	WatchStreams int64 `json:"watch_streams"`

	// StartTime is when the proxy's process started, which the counts are
	// since (process_start_time_seconds, to the millisecond); unset where
	// the process metrics are not exported.
	StartTime *time.Time `json:"start_time,omitempty"`
}

// Check is a failing readiness check: its name, and why it fails.
type Check struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

// RangeRequests are the Range requests counted with one source and reason.
type RangeRequests struct {
	Source Source `json:"source"`
	// Reason is why a Range was answered where it was: one of kvproxy's
	// reasons, the ranges metric's reason label.
	Reason string `json:"reason"`
	Count  int64  `json:"count"`
}

// Requests are the Range requests counted from src.
func (s Status) Requests(src Source) int64 {
	var n int64
	for _, r := range s.RangeRequests {
		if r.Source == src {
			n += r.Count
		}
	}
	return n
}
