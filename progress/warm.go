package progress

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/internal/backoff"
	"github.com/etcd-snapcache/etcd-snapcache/internal/etcderr"
)

// A warm start: the store restored from the copy a previous process left
// on disk (Config.Disk), then followed from its revision R, as a resumed
// watch is. Nothing is served from it until it is proven to be etcd's
// history, with the checks a resume makes and stricter ones:
//
//   - the copy's cluster is the one etcd answers for;
//   - etcd's head (a quorum read) is not below R;
//   - etcd has not compacted past R, so R can still be compared;
//   - once the watch from R is created, etcd's keys and mod revisions at
//     R are the store's (Config.VerifyHistory): a restore that kept the
//     cluster id and moved on from an older snapshot fails here.
//
// A copy that fails a check is thrown away and the keyspace is loaded from
// etcd, as on a first start. The compaction revision is found again
// before serving: the copy's may be older than etcd's.

// DiskCopy is the copy of the cache a previous process left on local disk
// (a *persist.Persister).
type DiskCopy interface {
	// Restore fills the store from the copy and returns the cluster it
	// was taken from; false if there is no usable copy (it says why).
	Restore(ctx context.Context) (clusterID uint64, ok bool)
	// Accepted is told the restored store is proven etcd's history.
	Accepted()
	// Refused is told the restored store failed check against etcd.
	Refused(check string, err error)
}

var (
	// errNoDiskCopy: there is no copy to start from; the feed loads.
	errNoDiskCopy = errors.New("no usable copy of the cache on disk")
	// errDiskRefused: the restored copy failed a check against etcd;
	// the feed loads.
	errDiskRefused = errors.New("the cache's copy on disk is not etcd's history")
)

// warmState is the feed's warm start; only the feed's goroutine uses it.
type warmState struct {
	restored bool   // the store holds the copy, not yet refused
	cluster  uint64 // the copy's cluster
	// target is etcd's head when the copy was checked: the store serves
	// once verified and caught up with it. 0 once verified or refused.
	target int64
}

// warmStart restores the store from the copy on disk, checks it against
// etcd and follows etcd from its revision. It returns errNoDiskCopy or
// errDiskRefused when the feed must load instead, a *loadError when etcd
// could not be asked (the feed tries again), and otherwise what the
// resumed watch ends with.
func (f *Follower) warmStart(ctx context.Context, bo *backoff.Backoff) error {
	if !f.warm.restored {
		// The release decides how some reads are answered: as a load,
		// read it before the store can serve.
		f.version.refresh(ctx)
		if err := checkRelease(f.upstream.getVersion()); err != nil {
			return &loadError{err}
		}
		cluster, ok := f.cfg.Disk.Restore(ctx)
		if !ok {
			return errNoDiskCopy
		}
		f.warm.restored, f.warm.cluster = true, cluster
	}
	head, err := f.readHeadForLoad(ctx)
	if err != nil {
		return &loadError{err}
	}
	rev := f.store.Rev()
	switch {
	case head.ClusterId != f.warm.cluster:
		return f.refuseDisk("cluster-id", fmt.Errorf("the copy is of cluster %x, etcd answers for %x", f.warm.cluster, head.ClusterId))
	case head.Revision < rev:
		return f.refuseDisk("head-below-disk", fmt.Errorf("etcd's head %d is below the copy's revision %d", head.Revision, rev))
	}
	readable, err := f.compaction.readable(ctx, rev)
	if err != nil {
		return &loadError{err}
	}
	if !readable {
		return f.refuseDisk("compacted", fmt.Errorf("etcd compacted past the copy's revision %d", rev))
	}
	compactRev, err := f.compaction.find(ctx, f.store.CompactRev(), rev, 0)
	if err != nil {
		return &loadError{err}
	}
	f.store.Compact(compactRev) // nothing watches yet
	f.timeline.loaded(f.warm.cluster)
	f.warm.target = head.Revision
	f.loads.Add(1) // the store holds a keyspace: the feed resumes, not loads
	f.changes.notify()
	return f.followOn(ctx, bo, true)
}

// verifyWarm is verifyResume for a store restored from disk: the watch
// from rev is created, and etcd's keys at rev must be the store's. With
// next (etcd compacted at rev+1) they cannot be compared any more.
func (f *Follower) verifyWarm(ctx context.Context, rev int64, next bool) error {
	if next || f.store.CompactRev() > rev {
		return f.refuseDisk("compacted", fmt.Errorf("etcd compacted past the copy's revision %d", rev))
	}
	if f.cfg.VerifyHistory == nil {
		return f.refuseDisk("history", errors.New("no way to compare etcd's keys with the copy's"))
	}
	same, err := f.cfg.VerifyHistory(ctx, rev)
	switch {
	case etcderr.Is(err, rpctypes.ErrCompacted):
		return f.refuseDisk("compacted", err)
	case etcderr.Is(err, rpctypes.ErrFutureRev):
		return f.refuseDisk("head-below-disk", err)
	case err != nil:
		return fmt.Errorf("verifying the copy on disk at revision %d: %w", rev, err)
	case !same:
		return f.refuseDisk("history", fmt.Errorf("etcd's keys at revision %d differ from the copy's", rev))
	}
	f.cfg.Disk.Accepted()
	target := f.warm.target
	f.warm = warmState{}
	f.loaded(target)
	return nil
}

// refuseDisk throws the restored store away: the feed loads from etcd.
func (f *Follower) refuseDisk(check string, err error) error {
	f.cfg.Disk.Refused(check, err)
	f.lg.Warn("not serving the cache's copy on disk", zap.String("check", check), zap.Error(err))
	f.warm = warmState{}
	f.store.Unload()
	// Nothing of the copy's history holds, not even its compaction
	// revision.
	f.store.ForgetCompaction()
	return fmt.Errorf("%w: %s: %w", errDiskRefused, check, err)
}
