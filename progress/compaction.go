package progress

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// probeKey is read by the compaction probe: a count-only single-key Range is
// the cheapest request that etcd refuses below its compaction revision.
var probeKey = []byte("\x00etcd-snapcache-compaction-probe")

// hintChaseTimeout bounds how long a compact_rev_key announcement is chased
// by fast probes before the periodic probe takes over.
const hintChaseTimeout = 10 * time.Second

// probeLoop finds compactions nobody reported: periodically, and promptly
// after kube-apiserver announced one in compact_rev_key.
func (f *Follower) probeLoop(ctx context.Context) {
	t := time.NewTicker(f.cfg.CompactionProbeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f.probeCompaction(ctx, 0, "probe")
		case <-f.probeNow:
			f.probeCompaction(ctx, 0, "probe")
		case rev := <-f.compactHint:
			f.chaseHint(ctx, rev)
		}
	}
}

// ProbeCompaction checks etcd's compaction revision now rather than at the
// next tick.
func (f *Follower) ProbeCompaction() {
	select {
	case f.probeNow <- struct{}{}:
	default:
	}
}

// chaseHint probes with growing pauses until etcd has compacted at rev or
// the chase times out (the Compact may have failed or been skipped).
func (f *Follower) chaseHint(ctx context.Context, rev int64) {
	deadline := time.Now().Add(hintChaseTimeout)
	pause := 5 * time.Millisecond
	for f.store.CompactRev() < rev && time.Now().Before(deadline) {
		f.probeCompaction(ctx, rev, CompactRevKey)
		if f.store.CompactRev() >= rev {
			return
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		pause = min(2*pause, 500*time.Millisecond)
	}
}

// probeCompaction mirrors etcd's compaction revision if it moved past the
// store's. It costs one request when nothing changed.
func (f *Follower) probeCompaction(ctx context.Context, hint int64, source string) {
	if !f.store.Loaded() {
		return
	}
	known := f.store.CompactRev()
	ok, err := f.readable(ctx, max(known, 1))
	if err != nil || ok {
		if err != nil && ctx.Err() == nil {
			f.lg.Debug("compaction probe failed", zap.Error(err))
		}
		return
	}
	head, err := f.kv.Range(ctx, &pb.RangeRequest{Key: probeKey, CountOnly: true})
	if err != nil {
		return
	}
	rev, err := f.findCompactRev(ctx, known+1, head.Header.Revision, hint)
	if err != nil {
		if ctx.Err() == nil {
			f.lg.Warn("finding etcd's compaction revision failed", zap.Error(err))
		}
		return
	}
	f.ObserveCompaction(rev, source)
}

// findCompactRev returns etcd's compaction revision: the smallest readable
// revision in [lo, current], by binary search over count-only Ranges (about
// log2(current-lo) requests), trying hint first. 0 means never compacted.
func (f *Follower) findCompactRev(ctx context.Context, lo, current, hint int64) (int64, error) {
	lo = max(lo, 1)
	hi := current // always readable: etcd cannot compact past its head
	if hint > lo && hint <= hi {
		ok, err := f.readable(ctx, hint)
		if err != nil {
			return 0, err
		}
		if ok {
			hi = hint
		} else {
			lo = hint + 1
		}
	}
	for lo < hi {
		mid := lo + (hi-lo)/2
		ok, err := f.readable(ctx, mid)
		if err != nil {
			return 0, err
		}
		if ok {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	if lo <= 1 {
		return 0, nil
	}
	return lo, nil
}

// readable reports whether etcd still serves reads at rev.
func (f *Follower) readable(ctx context.Context, rev int64) (bool, error) {
	_, err := f.kv.Range(ctx, &pb.RangeRequest{Key: probeKey, Revision: rev, CountOnly: true})
	switch {
	case err == nil:
		return true, nil
	case errors.Is(rpctypes.Error(err), rpctypes.ErrCompacted):
		return false, nil
	default:
		return false, fmt.Errorf("probing revision %d: %w", rev, err)
	}
}
