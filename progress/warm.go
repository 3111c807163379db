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
// watch is. The restore runs beside the checks: while the proxy decodes
// the copy, etcd reads its keys at R. Nothing is served from it until it
// is proven to be etcd's history, with the checks a resume makes and
// stricter ones:
//
//   - the copy's cluster is the one etcd answers for;
//   - etcd's head (a quorum read) is not below R;
//   - etcd has not compacted past R, so R can still be compared;
//   - once the watch from R is created, etcd's keys and mod revisions at
//     R are the store's (Config.History): a restore that kept the
//     cluster id and moved on from an older snapshot fails here.
//
// A copy that fails a check is thrown away and the keyspace is loaded from
// etcd, as on a first start. The compaction revision is found again
// before serving: the copy's may be older than etcd's.

// DiskCopy is the copy of the cache a previous process left on local disk
// (server adapts a *persist.Persister).
type DiskCopy interface {
	// Open finds the copy and reads its header; false if there is no
	// usable copy (it says why).
	Open(ctx context.Context) (DiskHeader, bool)
	// Restore fills the store from the opened copy; an error if it is
	// damaged (it says why, and throws it away).
	Restore(ctx context.Context) error
	// Accepted is told the restored store is proven etcd's history.
	Accepted()
	// Refused is told the restored store failed check against etcd.
	Refused(check string, err error)
}

// DiskHeader is a copy on disk as Open finds it, before it is read whole
// (persist.Header): enough to check it against etcd while it is restored.
type DiskHeader struct {
	// Cluster is the id of the etcd cluster the copy was taken from.
	Cluster uint64
	// Rev is the revision the copy is complete up to; CompactRev etcd's
	// compaction revision as the cache last mirrored it.
	Rev, CompactRev int64
	// Bounds are keys of the copy, in key order: where a reader of etcd's
	// keys at Rev may cut its chunks (HistoryVerifier.SameHistoryAhead).
	Bounds [][]byte
}

var (
	// errNoDiskCopy: there is no copy to start from, or it is damaged;
	// the feed loads.
	errNoDiskCopy = errors.New("no usable copy of the cache on disk")
	// errDiskRefused: the restored copy failed a check against etcd;
	// the feed loads.
	errDiskRefused = errors.New("the cache's copy on disk is not etcd's history")
)

// warmState is the feed's warm start; only the feed's goroutine uses it.
type warmState struct {
	opened bool       // the copy is open, not yet verified or refused
	header DiskHeader // the copy's
	// restore fills the store from the copy, beside the checks against
	// etcd: etcd reads its keys at the copy's revision while the proxy
	// decodes the copy.
	restore *restoring
	// compactRev is etcd's compaction revision, found before the watch.
	compactRev int64
	// target is etcd's head when the copy was checked: the store serves
	// once verified and caught up with it.
	target int64
}

// restoring is a restore of the store from the copy, on a goroutine the
// feed waits for.
type restoring struct {
	done chan struct{}
	err  error // Restore's, once done is closed
}

// wait waits for the restore and returns its error.
func (r *restoring) wait() error {
	<-r.done
	return r.err
}

// errRestore wraps a restore's error: the copy was damaged.
type restoreError struct{ err error }

func (e *restoreError) Error() string { return "restoring the copy on disk: " + e.err.Error() }
func (e *restoreError) Unwrap() error { return e.err }

// settle waits for a restore under way: the feed returns only once it has.
func (w *warmState) settle() {
	if w.restore != nil {
		w.restore.wait()
	}
}

// resumeRev is the revision the upstream watch continues: the store's, or
// while a copy on disk is being restored and verified, the copy's.
func (f *Follower) resumeRev() int64 {
	if f.warm.opened {
		return f.warm.header.Rev
	}
	return f.store.Rev()
}

// warmStart opens the copy on disk, restores the store from it while it
// checks it against etcd, and follows etcd from its revision. It returns
// errNoDiskCopy or errDiskRefused when the feed must load instead, a
// *loadError when etcd could not be asked (the feed tries again), and
// otherwise what the resumed watch ends with.
func (f *Follower) warmStart(ctx context.Context, bo *backoff.Backoff) error {
	if !f.warm.opened {
		// The release decides how some reads are answered: as a load,
		// read it before the store can serve.
		if err := checkRelease(f.version.refresh(ctx)); err != nil {
			return &loadError{err}
		}
		h, ok := f.cfg.Disk.Open(ctx)
		if !ok {
			return errNoDiskCopy
		}
		r := &restoring{done: make(chan struct{})}
		go func() {
			defer close(r.done)
			r.err = f.cfg.Disk.Restore(ctx)
		}()
		f.warm = warmState{opened: true, header: h, restore: r}
	}
	h := f.warm.header
	head, err := f.readHeadForLoad(ctx)
	if err != nil {
		return &loadError{err}
	}
	switch {
	case head.ClusterId != h.Cluster:
		return f.refuseDisk("cluster-id", fmt.Errorf("the copy is of cluster %x, etcd answers for %x", h.Cluster, head.ClusterId))
	case head.Revision < h.Rev:
		return f.refuseDisk("head-below-disk", fmt.Errorf("etcd's head %d is below the copy's revision %d", head.Revision, h.Rev))
	}
	readable, err := f.compaction.readable(ctx, h.Rev)
	if err != nil {
		return &loadError{err}
	}
	if !readable {
		return f.refuseDisk("compacted", fmt.Errorf("etcd compacted past the copy's revision %d", h.Rev))
	}
	if f.warm.compactRev, err = f.compaction.find(ctx, h.CompactRev, h.Rev, 0); err != nil {
		return &loadError{err}
	}
	f.timeline.loaded(h.Cluster)
	f.warm.target = head.Revision
	f.loads.Add(1) // the feed resumes from the copy, not loads
	return f.followOn(ctx, bo, true)
}

// verifyWarm is verifyResume for a copy on disk: the watch from rev is
// created, and etcd's keys at rev, read while the copy is restored, must
// be the store's. With next (etcd compacted at rev+1) they cannot be
// compared any more.
func (f *Follower) verifyWarm(ctx context.Context, rev int64, next bool) error {
	if next || f.warm.compactRev > rev {
		return f.refuseDisk("compacted", fmt.Errorf("etcd compacted past the copy's revision %d", rev))
	}
	restored := func() error {
		if err := f.warm.restore.wait(); err != nil {
			return &restoreError{err}
		}
		return nil
	}
	var same bool
	var err error
	if f.cfg.History != nil {
		same, err = f.cfg.History.SameHistoryAhead(ctx, rev, f.warm.header.Bounds, restored)
	} else if err = restored(); err == nil {
		err = errors.New("no way to compare etcd's keys with the copy's")
	}
	var damaged *restoreError
	switch {
	case errors.As(err, &damaged):
		// The persister said why, and threw the copy away.
		f.dropDisk()
		return fmt.Errorf("%w: %w", errNoDiskCopy, err)
	case etcderr.Is(err, rpctypes.ErrCompacted):
		return f.refuseDisk("compacted", err)
	case etcderr.Is(err, rpctypes.ErrFutureRev):
		return f.refuseDisk("head-below-disk", err)
	case err != nil:
		return fmt.Errorf("verifying the copy on disk at revision %d: %w", rev, err)
	case !same:
		return f.refuseDisk("history", fmt.Errorf("etcd's keys at revision %d differ from the copy's", rev))
	}
	f.store.Compact(f.warm.compactRev) // nothing watches yet
	f.cfg.Disk.Accepted()
	target := f.warm.target
	f.warm = warmState{}
	f.loaded(target)
	return nil
}

// refuseDisk throws the copy away after a failed check: the feed loads
// from etcd.
func (f *Follower) refuseDisk(check string, err error) error {
	f.warm.settle()
	f.cfg.Disk.Refused(check, err)
	f.lg.Warn("not serving the cache's copy on disk", zap.String("check", check), zap.Error(err))
	f.dropDisk()
	return fmt.Errorf("%w: %s: %w", errDiskRefused, check, err)
}

// dropDisk empties the store of the copy, once its restore has ended.
func (f *Follower) dropDisk() {
	f.warm.settle()
	f.warm = warmState{}
	f.store.Unload()
	// Nothing of the copy's history holds, not even its compaction
	// revision.
	f.store.ForgetCompaction()
}
