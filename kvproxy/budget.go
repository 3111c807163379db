package kvproxy

import (
	"container/list"
	"context"
	"sync"
	"sync/atomic"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// DefaultMaxCachedReadBytes bounds the bytes of responses served from the
// cache that are being built, encoded and handed to gRPC at once: 256 MiB,
// beside the default history budget on a 4 GiB control-plane node. A full
// LIST of a large Kubernetes cluster still runs (alone, if it is larger
// than the bound), and a burst of them cannot take the process past that
// node's memory.
const DefaultMaxCachedReadBytes = 256 << 20

// Estimates of a response's size before it is built.
const (
	// initialKVBytes is the encoded size assumed of a key-value before any
	// was measured: a small Kubernetes object.
	initialKVBytes = 1024
	// headerBytes is what a response costs beyond its key-values.
	headerBytes = 64
	// countWalkLimit: a read with a limit up to this is estimated at its
	// limit; a larger or unlimited one has its range counted first (a walk
	// of the tree that allocates nothing).
	countWalkLimit = 1000
)

// admitCached waits for room for the estimated answer to r from view under
// the bound of cached read bytes; it returns the bytes held.
func (s *Server) admitCached(ctx context.Context, view revtree.View, r *pb.RangeRequest, opts revtree.RangeOptions) (int64, error) {
	if s.budget == nil {
		return 0, nil
	}
	n := s.budget.clamp(s.budget.estimate(view, r, opts))
	if s.budget.tryAcquire(n) {
		return n, nil // no wait: no context for one
	}
	wctx, cancel := s.queueContext(ctx)
	defer cancel()
	held, err := s.budget.acquire(wctx, n)
	if err != nil {
		return 0, admissionError(ctx, errMemory)
	}
	return held, nil
}

// fitCached changes a holding of held bytes into the built response's
// encoded size, of kvs key-values, waiting for more room if the estimate
// fell short; it returns the bytes held.
func (s *Server) fitCached(ctx context.Context, held int64, size, kvs int) (int64, error) {
	if s.budget == nil {
		return 0, nil
	}
	n := s.budget.clamp(s.budget.learn(int64(size), kvs))
	if s.budget.resizeNow(held, n) {
		return n, nil // no wait: no context for one
	}
	wctx, cancel := s.queueContext(ctx)
	defer cancel()
	held, err := s.budget.acquire(wctx, n)
	if err != nil {
		return 0, admissionError(ctx, errMemory)
	}
	return held, nil
}

// releaseCached gives back bytes held for a cached response.
func (s *Server) releaseCached(held int64) {
	if s.budget == nil {
		return
	}
	s.budget.release(held)
}

// CachedReadBytes is the bytes of responses served from the cache that are
// being built, encoded and sent now (at most --max-cached-read-bytes): heap
// that is live besides the store's.
func (s *Server) CachedReadBytes() int64 {
	if s.budget == nil {
		return 0
	}
	return s.budget.inUse()
}

// releaseCachedWhenDone gives back held bytes once ctx, a call's context,
// ends.
func (s *Server) releaseCachedWhenDone(ctx context.Context, held int64) {
	if s.budget == nil || held == 0 {
		return
	}
	if ctx.Done() == nil {
		s.releaseCached(held) // a context that never ends: nothing to wait for
		return
	}
	context.AfterFunc(ctx, func() { s.releaseCached(held) })
}

// byteBudget admits work by the bytes it holds, first come, first served:
// a request that does not fit waits, and the ones behind it wait too, so
// that a large request is not starved by small ones. A request larger than
// the whole budget is admitted alone.
type byteBudget struct {
	size int64
	// report, if set, is told the bytes held after every change.
	report func(used int64)
	// avgKV estimates the encoded size of one key-value, from the
	// responses measured so far.
	avgKV atomic.Int64

	mu sync.Mutex
	// Guarded by mu.
	used    int64
	waiters list.List // of *budgetWaiter, in arrival order
}

type budgetWaiter struct {
	n     int64
	ready chan struct{} // closed once admitted
}

// newByteBudget returns a budget of size bytes that reports the bytes held
// to report (if set); nil (no bound) if size <= 0.
func newByteBudget(size int64, report func(used int64)) *byteBudget {
	if size <= 0 {
		return nil
	}
	b := &byteBudget{size: size, report: report}
	b.avgKV.Store(initialKVBytes)
	return b
}

// clamp is what a request of n bytes holds: at most the whole budget.
func (b *byteBudget) clamp(n int64) int64 { return max(min(n, b.size), 0) }

// acquire waits until n bytes (clamped) fit, or ctx is done; it returns
// the bytes held, to release.
func (b *byteBudget) acquire(ctx context.Context, n int64) (int64, error) {
	n = b.clamp(n)
	b.mu.Lock()
	if b.waiters.Len() == 0 && b.used+n <= b.size {
		b.used += n
		b.reportLocked()
		b.mu.Unlock()
		return n, nil
	}
	w := &budgetWaiter{n: n, ready: make(chan struct{})}
	elem := b.waiters.PushBack(w)
	b.mu.Unlock()
	select {
	case <-w.ready:
		return n, nil
	case <-ctx.Done():
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	select {
	case <-w.ready:
		// Admitted meanwhile: give it back.
		b.used -= n
	default:
		b.waiters.Remove(elem)
	}
	b.admitLocked()
	b.reportLocked()
	return 0, ctx.Err()
}

// tryAcquire takes n more bytes if they fit now and nobody waits.
func (b *byteBudget) tryAcquire(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.waiters.Len() > 0 || b.used+n > b.size {
		return false
	}
	b.used += n
	b.reportLocked()
	return true
}

// release gives back n bytes and admits the waiters that now fit.
func (b *byteBudget) release(n int64) {
	if n <= 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.used -= n
	b.admitLocked()
	b.reportLocked()
}

func (b *byteBudget) reportLocked() {
	if b.report != nil {
		b.report(b.used)
	}
}

// admitLocked admits waiters in order while the first one fits.
func (b *byteBudget) admitLocked() {
	for e := b.waiters.Front(); e != nil; e = b.waiters.Front() {
		w := e.Value.(*budgetWaiter)
		if b.used+w.n > b.size {
			return
		}
		b.used += w.n
		b.waiters.Remove(e)
		close(w.ready)
	}
}

// inUse returns the bytes held.
func (b *byteBudget) inUse() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used
}

// estimate is the encoded size of the answer to r from view, before it is
// built: the key-values it will hold (its limit, or its range counted)
// times the average size of a key-value.
func (b *byteBudget) estimate(view revtree.View, r *pb.RangeRequest, opts revtree.RangeOptions) int64 {
	var n int64
	switch {
	case r.CountOnly:
	case r.RangeEnd == nil:
		n = 1
	case r.Limit > 0 && r.Limit <= countWalkLimit:
		n = r.Limit
	default:
		n = view.Range(&pb.RangeRequest{Key: r.Key, RangeEnd: r.RangeEnd, CountOnly: true}, opts).Count
		if r.Limit > 0 {
			n = min(n, r.Limit)
		}
	}
	return headerBytes + n*b.avgKV.Load()
}

// learn returns size, the encoded size of a built response with kvs
// key-values, and learns the average size of a key-value from it.
func (b *byteBudget) learn(size int64, kvs int) int64 {
	if n := int64(kvs); n > 0 {
		observed := max((size-headerBytes)/n, 1)
		// An approximate moving average; concurrent updates may lose one.
		b.avgKV.Store((3*b.avgKV.Load() + observed) / 4)
	}
	return size
}

// resize changes a holding of held bytes into one of n bytes (clamped):
// it gives back what is not needed, or takes more, waiting for it only
// after giving back what it held, so that two requests never wait for each
// other. It returns the bytes now held.
func (b *byteBudget) resize(ctx context.Context, held, n int64) (int64, error) {
	n = b.clamp(n)
	if b.resizeNow(held, n) {
		return n, nil
	}
	return b.acquire(ctx, n)
}

// resizeNow is resize's part that never waits: it reports whether the
// held bytes became n (clamped); if not, it gave back what it held, and
// the caller waits for n with acquire.
func (b *byteBudget) resizeNow(held, n int64) bool {
	switch {
	case n <= held:
		b.release(held - n)
		return true
	case b.tryAcquire(n - held):
		return true
	}
	b.release(held)
	return false
}
