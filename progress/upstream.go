package progress

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/backoff"
	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
)

// upstreamState is what the proxy knows of the etcd member it talks to,
// from that member's answers: the header fields that describe the member
// rather than the keyspace, the highest head revision it reported, and its
// release.
type upstreamState struct {
	head atomic.Int64 // the highest revision etcd has reported as its head

	mu sync.Mutex
	// Guarded by mu.
	cluster clusterFields // of the latest upstream response
	version string        // etcd's release from Maintenance.Status; "" if unknown
}

// clusterFields are the parts of a response header that come from the
// member that answered rather than from the keyspace.
type clusterFields struct{ clusterID, memberID, raftTerm uint64 }

// observe records the cluster fields and the head of an upstream response
// header.
func (u *upstreamState) observe(h *pb.ResponseHeader) {
	if h == nil || h.ClusterId == 0 {
		return
	}
	u.observeHead(h.Revision)
	u.mu.Lock()
	defer u.mu.Unlock()
	u.cluster = clusterFields{h.ClusterId, h.MemberId, h.RaftTerm}
}

// observeHead records a revision etcd reported as its head.
func (u *upstreamState) observeHead(rev int64) {
	for {
		cur := u.head.Load()
		if rev <= cur || u.head.CompareAndSwap(cur, rev) {
			return
		}
	}
}

// resetHead forgets the heads reported so far: after a change of timeline
// they belong to a history that is gone.
func (u *upstreamState) resetHead() { u.head.Store(0) }

// fill sets h's cluster fields to those of the latest upstream response.
func (u *upstreamState) fill(h *pb.ResponseHeader) {
	u.mu.Lock()
	defer u.mu.Unlock()
	h.ClusterId, h.MemberId, h.RaftTerm = u.cluster.clusterID, u.cluster.memberID, u.cluster.raftTerm
}

func (u *upstreamState) getVersion() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.version
}

func (u *upstreamState) setVersion(v string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.version = v
}

// Bounds of the retries of Maintenance.Status while the version is unknown.
// With auth on, etcd 3.6 answers Status only to admins, so the version may
// stay unknown for good: the retries slow down to once a minute.
const (
	versionRetryMin = time.Second
	versionRetryMax = time.Minute
	versionTimeout  = 5 * time.Second
)

// versionTracker keeps the upstream's release current: etcd can be upgraded
// or downgraded under the proxy, one member at a time, so the release is
// read again after every reconnect and whenever the members' releases
// start or stop differing, and retried while unknown. While the members
// run different releases it is unknown: each member answers by its own
// release, and the proxy cannot answer as all of them. Readers treat an
// unknown release conservatively (see kvproxy).
type versionTracker struct {
	// unsupported, if set, is told of a release the follower cannot
	// follow, read after a reconnect (a downgrade under the proxy).
	unsupported func(error)
	state       *upstreamState
	status      func(ctx context.Context) (*pb.StatusResponse, error)
	// mixed reports whether the members run different releases, and a
	// channel closed when that changes (drain.MixedReleases).
	mixed   func() (bool, <-chan struct{})
	lg      *zap.Logger
	recheck chan struct{} // buffered 1: the connection was re-established

	mu sync.Mutex // held by refresh throughout
	// changed is guarded by mu: mixed's channel, taken by the latest
	// refresh (or at construction). run waits on it; as every change
	// closes the channels handed out before it, a channel taken at or
	// before the latest read of mixed misses no change.
	changed <-chan struct{}
}

func newVersionTracker(state *upstreamState, mt pb.MaintenanceClient, lg *zap.Logger) *versionTracker {
	v := &versionTracker{
		state: state,
		status: func(ctx context.Context) (*pb.StatusResponse, error) {
			return mt.Status(ctx, &pb.StatusRequest{})
		},
		mixed:   drain.MixedReleases,
		lg:      lg,
		recheck: make(chan struct{}, 1),
	}
	// run may wait before the first refresh has run: an older channel is
	// closed at the next change too.
	_, v.changed = v.mixed()
	return v
}

// reconnected has the release read again: the member that answers now may
// run another release. Until the answer comes, the last release read
// stands: the store it describes was fed by the same cluster.
func (v *versionTracker) reconnected() {
	select {
	case v.recheck <- struct{}{}:
	default:
	}
}

// refresh reads the release once, and returns the release of the member
// that answered ("" if none did): what a load checks, even while the
// members differ and the release the readers see is unknown.
func (v *versionTracker) refresh(ctx context.Context) string {
	// Serialized, so that the last answer read is the one kept, and the
	// channel run waits on is the one taken before it.
	v.mu.Lock()
	defer v.mu.Unlock()
	// Taken before the Status call, so that a change during it wakes run.
	mixed, changed := v.mixed()
	v.changed = changed
	sctx, cancel := context.WithTimeout(ctx, versionTimeout)
	st, err := v.status(sctx)
	cancel()
	if err != nil {
		v.state.setVersion("")
		if ctx.Err() == nil {
			v.lg.Warn("reading etcd's version failed; treating it as unknown", zap.Error(err))
		}
		return ""
	}
	v.state.observe(st.Header)
	version := st.Version
	if mixed {
		version = ""
	}
	if old := v.state.getVersion(); old != version {
		if version == "" {
			v.lg.Info("etcd's members run different releases: the release is unknown until they agree", zap.String("member-version", st.Version))
		} else {
			v.lg.Info("upstream etcd version", zap.String("version", version))
		}
	}
	v.state.setVersion(version)
	if err := checkRelease(st.Version); err != nil && v.unsupported != nil {
		v.unsupported(err)
	}
	return st.Version
}

// changedChan is the channel of the latest refresh's mixed.
func (v *versionTracker) changedChan() <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.changed
}

// run re-reads the release after each reconnect, and retries with a
// growing pause while it is unknown, until ctx is done.
func (v *versionTracker) run(ctx context.Context) {
	bo := backoff.New(versionRetryMin, versionRetryMax)
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.recheck:
			bo.Reset()
		case <-v.changedChan():
			bo.Reset()
		case <-retry:
		}
		retry = nil
		if v.refresh(ctx) == "" && ctx.Err() == nil {
			retry = time.After(bo.Next())
		}
	}
}
