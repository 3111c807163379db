package progress

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// compactRevKey is the key kube-apiserver's compactor writes the revision
// it is about to compact to, in the same Txn that guards the compaction.
const compactRevKey = "compact_rev_key"

// probeKey is read by the compaction probe: a count-only single-key Range is
// the cheapest request that etcd refuses below its compaction revision.
var probeKey = []byte("\x00etcd-snapcache-compaction-probe")

// hintChaseTimeout bounds how long a compact_rev_key announcement is chased
// by fast probes before the periodic probe takes over.
const hintChaseTimeout = 10 * time.Second

// compactionProber finds etcd's compactions that nobody reported to the
// proxy: etcd's auto-compaction, or a Compact sent straight to etcd. It
// probes periodically, and promptly after kube-apiserver announced one in
// compact_rev_key. Each finding goes to observe.
type compactionProber struct {
	store    *revtree.Store
	kv       pb.KVClient
	lg       *zap.Logger
	interval time.Duration
	observe  func(rev int64, source string)
	// hints carries revisions announced in compact_rev_key from the feed
	// to run; buffered, and a full buffer drops hints (the periodic probe
	// still finds the compaction).
	hints chan int64
	// failing is set while probes fail, so that an outage logs one warning,
	// not one per probe; touched only by run's goroutine.
	failing bool
	// witness and checkHead look at each probe's answer for a sign of
	// another history (timeline.go): the probes are quorum reads.
	witness   func() headWitness
	checkHead func(headWitness, int64)
}

func newCompactionProber(store *revtree.Store, kv pb.KVClient, lg *zap.Logger, interval time.Duration, observe func(int64, string)) *compactionProber {
	return &compactionProber{store: store, kv: kv, lg: lg, interval: interval, observe: observe, hints: make(chan int64, 16)}
}

// run probes until ctx is done.
func (c *compactionProber) run(ctx context.Context) {
	t := time.NewTicker(c.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			c.probe(ctx, 0, "probe")
		case rev := <-c.hints:
			c.chaseHint(ctx, rev)
		}
	}
}

// noticeCompactRevKey turns kube-apiserver's announcement of a compaction
// into prompt probes: its Compact call follows the Txn closely.
func (c *compactionProber) noticeCompactRevKey(events []*mvccpb.Event) {
	for _, ev := range events {
		if ev.Type != mvccpb.PUT || string(ev.Kv.Key) != compactRevKey {
			continue
		}
		var rev int64
		if _, err := fmt.Sscan(string(ev.Kv.Value), &rev); err != nil || rev <= 0 {
			continue
		}
		select {
		case c.hints <- rev:
		default:
		}
	}
}

// chaseHint probes with growing pauses until etcd has compacted at rev or
// the chase times out (the Compact may have failed or been skipped).
func (c *compactionProber) chaseHint(ctx context.Context, rev int64) {
	deadline := time.Now().Add(hintChaseTimeout)
	pause := 5 * time.Millisecond
	for c.store.CompactRev() < rev && time.Now().Before(deadline) {
		c.probe(ctx, rev, compactRevKey)
		if c.store.CompactRev() >= rev {
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

// probe mirrors etcd's compaction revision if it moved past the store's.
// It costs one request when nothing changed.
func (c *compactionProber) probe(ctx context.Context, hint int64, source string) {
	if !c.store.Loaded() {
		return
	}
	known := c.store.CompactRev()
	err := c.probeOnce(ctx, known, hint, source)
	switch {
	case ctx.Err() != nil:
	case err != nil && !c.failing:
		c.failing = true
		c.lg.Warn("probing etcd's compaction revision failed; retrying every interval", zap.Int64("known-compact-revision", known), zap.Error(err))
	case err != nil:
		c.lg.Debug("probing etcd's compaction revision failed", zap.Error(err))
	case c.failing:
		c.failing = false
		c.lg.Info("probing etcd's compaction revision works again")
	}
}

func (c *compactionProber) probeOnce(ctx context.Context, known, hint int64, source string) error {
	ok, err := c.readable(ctx, max(known, 1))
	if err != nil || ok {
		return err
	}
	head, err := c.kv.Range(ctx, &pb.RangeRequest{Key: probeKey, CountOnly: true})
	if err != nil {
		return fmt.Errorf("reading etcd's revision: %w", err)
	}
	rev, err := c.find(ctx, known+1, head.Header.Revision, hint)
	if err != nil {
		return err
	}
	c.observe(rev, source)
	return nil
}

// find returns etcd's compaction revision: the smallest readable revision
// in [lo, current], by binary search over count-only Ranges (about
// log2(current-lo) requests), trying hint first. 0 means never compacted.
func (c *compactionProber) find(ctx context.Context, lo, current, hint int64) (int64, error) {
	lo = max(lo, 1)
	hi := current // always readable: etcd cannot compact past its head
	if hint > lo && hint <= hi {
		ok, err := c.readable(ctx, hint)
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
		ok, err := c.readable(ctx, mid)
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
func (c *compactionProber) readable(ctx context.Context, rev int64) (bool, error) {
	var w headWitness
	if c.witness != nil {
		w = c.witness()
	}
	resp, err := c.kv.Range(ctx, &pb.RangeRequest{Key: probeKey, Revision: rev, CountOnly: true})
	switch {
	case err == nil:
		if c.checkHead != nil {
			c.checkHead(w, resp.Header.Revision)
		}
		return true, nil
	case errors.Is(rpctypes.Error(err), rpctypes.ErrCompacted):
		return false, nil
	case errors.Is(rpctypes.Error(err), rpctypes.ErrFutureRev) && c.checkHead != nil:
		c.checkHead(w, rev-1) // etcd's head is below rev
		return false, fmt.Errorf("probing revision %d: %w", rev, err)
	default:
		return false, fmt.Errorf("probing revision %d: %w", rev, err)
	}
}
