package progress

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/broadcast"
	"github.com/etcd-snapcache/etcd-snapcache/internal/etcderr"
)

// One timeline: the store must only ever hold etcd's history. A restore
// from an older snapshot (etcdutl snapshot restore), or endpoints that now
// reach another cluster, give etcd a different history, which may even pass
// the store's revision again with new writes. Only linearizable evidence
// counts as a sign of that, because a lagging member legitimately reports
// lower revisions in serializable reads, Status and watch progress:
//
//   - a response from another cluster (cluster id);
//   - a raft term that went backwards on one member;
//   - a quorum read (the read fence, the compaction probe) whose head is
//     below what the store held before the read began;
//   - a resume that etcd refuses as compacted (a restore with
//     --bump-revision --mark-compacted looks exactly like that);
//   - on every resume of the upstream watch, before following, a
//     comparison of etcd's keys and mod revisions at the store's revision
//     with the store's own (Config.History).
//
// On a sign the store stops serving at once, the epoch moves (the Watch
// service ends every client watch as compacted, so clients relist, as they
// must after a restore), and the keyspace is reloaded from scratch.

// HistoryVerifier compares etcd's keys and their mod revisions at a
// revision with the store's (a *hashcheck.Verifier).
type HistoryVerifier interface {
	// SameHistory reports whether etcd's keys and their mod revisions at
	// rev are the store's.
	SameHistory(ctx context.Context, rev int64) (bool, error)
	// SameHistoryAhead is SameHistory for a store being restored: it
	// reads etcd's keys, in chunks cut at bounds, while restored (which
	// returns the restore's error) has not returned, then compares.
	SameHistoryAhead(ctx context.Context, rev int64, bounds [][]byte, restored func() error) (bool, error)
}

// errTimeline ends the upstream watch when the history differs, and
// errCompactedResume when etcd compacted past the store's revision.
var (
	errTimeline        = errors.New("etcd's history is not the cache's")
	errCompactedResume = errors.New("etcd compacted past the cache's revision")
	// errCompactedAtNext: etcd compacted exactly at the revision after the
	// store's, which a watch from there continues.
	errCompactedAtNext = errors.New("etcd compacted at the revision after the cache's")
)

// timeline holds what the proxy knows of the history it follows.
type timeline struct {
	epoch   atomic.Uint64    // moves on every change; watchers of an older epoch end
	changed broadcast.Signal // woken when epoch moves
	// pending is set from a change until the reload that follows it is
	// done; while it is, signs are not looked for (the old timeline's
	// answers and the new one's mix).
	pending atomic.Bool
	// compactAtChange is the store's compaction revision as the epoch last
	// moved: the reload that follows drops the store, and a watch stream
	// may end after that, its watchers still owed etcd's compaction
	// revision.
	compactAtChange atomic.Int64

	mu sync.Mutex
	// Guarded by mu.
	clusterID uint64            // of the cluster the store was loaded from; 0 before
	terms     map[uint64]uint64 // the highest raft term seen per member since the load
}

// loaded starts a timeline at a load from cluster.
func (t *timeline) loaded(cluster uint64) {
	t.mu.Lock()
	t.clusterID, t.terms = cluster, map[uint64]uint64{}
	t.mu.Unlock()
	t.pending.Store(false)
}

// check returns the sign an upstream header shows, "" for none.
func (t *timeline) check(h *pb.ResponseHeader) string {
	if h == nil || h.ClusterId == 0 || t.pending.Load() {
		return ""
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.clusterID == 0:
		return "" // not loaded yet
	case h.ClusterId != t.clusterID:
		return "cluster-id"
	}
	prev, seen := t.terms[h.MemberId]
	switch {
	case seen && h.RaftTerm < prev:
		return "raft-term"
	case h.RaftTerm > prev:
		t.terms[h.MemberId] = h.RaftTerm
	}
	return ""
}

// Epoch returns the timeline's epoch, which moves whenever etcd's history
// is found to differ from the store's, and a channel closed when it next
// moves. A watch created at an older epoch must end.
func (f *Follower) Epoch() (uint64, <-chan struct{}) {
	ch := f.timeline.changed.Wait()
	return f.timeline.epoch.Load(), ch
}

// CompactRevAtEpochChange is the store's compaction revision when the
// epoch last moved (0 if it never has): what a watcher ended for the
// change is owed if the store has since been dropped for the reload.
func (f *Follower) CompactRevAtEpochChange() int64 { return f.timeline.compactAtChange.Load() }

// observeHeader records an upstream header, and looks for a sign of
// another history in it.
func (f *Follower) observeHeader(h *pb.ResponseHeader) {
	f.upstream.observe(h)
	if sign := f.timeline.check(h); sign != "" {
		f.timelineChanged(sign, fmt.Errorf("cluster %x member %x term %d", h.ClusterId, h.MemberId, h.RaftTerm))
	}
}

// headWitness is what the store held when a linearizable read began: on
// one timeline, etcd's answer can never report a lower head.
type headWitness struct{ rev, loads int64 }

func (f *Follower) witness() headWitness {
	return headWitness{rev: f.store.Rev(), loads: f.loads.Load()}
}

// checkHead compares the head a linearizable answer reported with the
// witness taken before it was asked.
func (f *Follower) checkHead(w headWitness, head int64) {
	if head < w.rev && f.loads.Load() == w.loads {
		f.timelineChanged("head-below-cache", fmt.Errorf("a quorum read reported revision %d, the cache held %d before it", head, w.rev))
	}
}

// timelineChanged stops serving from the store, ends the watchers and
// has the keyspace reloaded.
func (f *Follower) timelineChanged(sign string, detail error) {
	if !f.timeline.pending.CompareAndSwap(false, true) {
		return
	}
	f.life.reloading()
	f.verified.Store(0)
	f.timeline.compactAtChange.Store(f.store.CompactRev())
	f.timeline.epoch.Add(1)
	f.timeline.changed.Notify()
	f.changes.Notify()
	f.m.observeTimelineChange(sign)
	f.lg.Error("etcd's history differs from the cache's (restored from a snapshot, or another cluster): serving from etcd, ending every watch as compacted and reloading",
		zap.String("sign", sign), zap.Int64("store-revision", f.store.Rev()), zap.Error(detail))
	f.Reload(reloadReasonFor(sign))
}

// reloadReasonFor is the reload reason of a sign: a compacted resume is
// counted as the compaction it usually is.
func reloadReasonFor(sign string) string {
	if sign == "compacted-resume" {
		return "compacted"
	}
	return "timeline"
}

// verifyResume compares etcd's history with the store's at rev before a
// resumed watch is followed: a quorum read's head, then, if configured,
// every key's mod revision at rev. With next (etcd compacted at rev+1),
// rev cannot be read in etcd any more, and only the head is compared.
func (f *Follower) verifyResume(ctx context.Context, rev int64, next bool) error {
	if f.warm.opened {
		return f.verifyWarm(ctx, rev, next)
	}
	w := f.witness()
	resp, err := f.kv.Range(ctx, &pb.RangeRequest{Key: probeKey, CountOnly: true})
	if err != nil {
		return fmt.Errorf("verifying etcd's history: %w", err)
	}
	f.observeHeader(resp.Header)
	f.checkHead(w, resp.Header.Revision)
	if f.timeline.pending.Load() {
		return errTimeline
	}
	if next {
		return nil
	}
	if c := f.store.CompactRev(); c == rev+1 {
		return errCompactedAtNext
	} else if c > rev {
		// etcd compacted past the store's revision while the watch was
		// away (the probe mirrored it): the resume is refused too.
		f.timelineChanged("compacted-resume", fmt.Errorf("etcd compacted at %d, past the cache's revision %d", c, rev))
		return errCompactedResume
	}
	if f.cfg.History == nil {
		return nil
	}
	same, err := f.cfg.History.SameHistory(ctx, rev)
	switch {
	case etcderr.Is(err, rpctypes.ErrCompacted):
		if ok, rerr := f.compaction.readable(ctx, rev+1); rerr == nil && ok {
			return errCompactedAtNext
		}
		// Compacted past the store's revision while away: the resume is
		// refused too, and every watcher etcd would cancel is behind it.
		// The watchers end with etcd's compaction revision, found first;
		// if etcd cannot be asked, with their own next revision.
		if perr := f.compaction.probeOnce(ctx, f.store.CompactRev(), 0, "watch"); perr != nil {
			f.lg.Warn("finding etcd's compaction revision for the canceled watchers failed", zap.Error(perr))
		}
		f.timelineChanged("compacted-resume", err)
		return errCompactedResume
	case etcderr.Is(err, rpctypes.ErrFutureRev):
		f.timelineChanged("head-below-cache", err)
		return errTimeline
	case err != nil:
		return fmt.Errorf("verifying etcd's history at revision %d: %w", rev, err)
	case !same:
		f.timelineChanged("history", fmt.Errorf("etcd's keys at revision %d differ from the cache's", rev))
		return errTimeline
	}
	return nil
}
