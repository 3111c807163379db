package integration

// The client side of BenchmarkWatchFanout: raw watch streams whose receive
// goroutines check every event and record its delivery latency in a
// histogram, and the histogram itself.

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/bits"
	"runtime/metrics"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

var (
	fanoutWatchers = flag.Int("snapcache.bench.watchers", 10000,
		"watchers of BenchmarkWatchFanout, spread evenly over its streams")
	fanoutStreams = flag.Int("snapcache.bench.watchstreams", 100,
		"watch streams of BenchmarkWatchFanout (each a pb.Watch_WatchClient), spread round-robin over its connections")
	fanoutConns = flag.Int("snapcache.bench.watchconns", 10,
		"gRPC connections of BenchmarkWatchFanout's watch streams")
	fanoutWrites = flag.Int("snapcache.bench.watchwrites", 1000,
		"Puts BenchmarkWatchFanout makes under the watched prefix (each one revision)")
	fanoutWriteInterval = flag.Duration("snapcache.bench.watchwriteinterval", 0,
		"pace of BenchmarkWatchFanout's writes: one every interval; 0 writes sequentially, each as soon as the previous one is committed")
	fanoutHeapProfile = flag.String("snapcache.bench.watchheapprofile", "",
		"if set, BenchmarkWatchFanout writes a heap profile (after a GC) to this file plus .etcd or .proxy when its writes end, when the backlog of events is largest")
	fanoutWindow = flag.Int("snapcache.bench.watchwindow", 0,
		"HTTP/2 receive window of BenchmarkWatchFanout's connections, per stream (the connection's is 10 times it); 0 keeps grpc-go's default, 64 KiB grown by its BDP estimator, as clientv3 has it")
	fanoutTimeout = flag.Duration("snapcache.bench.watchtimeout", 10*time.Minute,
		"how long BenchmarkWatchFanout waits for every event to be delivered")
)

const (
	fanoutPrefix      = "/registry/pods/watchbench/"
	fanoutKeys        = 100  // keys the writes cycle over, created before the watchers
	fanoutValueSize   = 1024 // bytes of every value
	fanoutValueHeader = 16   // value prefix: send time (ns since the run's base), write sequence number
)

// fanoutValue is the value of write seq, sent at sent (time since the run's base).
func fanoutValue(seq int, sent time.Duration, pad []byte) []byte {
	v := make([]byte, fanoutValueSize)
	binary.BigEndian.PutUint64(v[0:8], uint64(sent))
	binary.BigEndian.PutUint64(v[8:16], uint64(seq))
	copy(v[fanoutValueHeader:], pad)
	return v
}

// fanoutWatcher is one watcher's progress, touched only by its stream's receive
// goroutine.
type fanoutWatcher struct {
	events  int   // events received; also the sequence number of the next
	lastRev int64 // mod revision of the last event
}

// fanoutStream is one client watch stream with n watchers on the prefix.
type fanoutStream struct {
	ws       pb.Watch_WatchClient
	n        int // watchers
	expected int // events to receive: n * writes
	base     time.Time
	hist     *latHist

	// The receive goroutine's state.
	watchers map[int64]*fanoutWatcher
	received atomic.Int64 // events; read by the benchmark while it waits
	lastAt   atomic.Int64 // ns since base of the last expected event's receipt
	created  chan struct{}
	done     chan struct{}
	errc     chan<- error
}

// startFanoutStream opens a watch stream on conn, starts its receive goroutine and
// sends n create requests for the prefix with prev_kv, as kube-apiserver
// watches. Failures go to errc.
func startFanoutStream(ctx context.Context, conn *grpc.ClientConn, n, writes int, base time.Time, hist *latHist, errc chan<- error) (*fanoutStream, error) {
	ws, err := pb.NewWatchClient(conn).Watch(ctx)
	if err != nil {
		return nil, err
	}
	s := &fanoutStream{
		ws:       ws,
		n:        n,
		expected: n * writes,
		base:     base,
		hist:     hist,
		watchers: make(map[int64]*fanoutWatcher, n),
		created:  make(chan struct{}),
		done:     make(chan struct{}),
		errc:     errc,
	}
	go s.recvLoop(ctx)
	go func() {
		end := []byte(clientv3.GetPrefixRangeEnd(fanoutPrefix))
		for range n {
			err := ws.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{
				CreateRequest: &pb.WatchCreateRequest{Key: []byte(fanoutPrefix), RangeEnd: end, PrevKv: true},
			}})
			if err != nil {
				s.fail(ctx, fmt.Errorf("sending a create request: %w", err))
				return
			}
		}
	}()
	return s, nil
}

func (s *fanoutStream) fail(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return // the benchmark closed the stream
	}
	select {
	case s.errc <- err:
	default:
	}
}

// recvLoop reads every response of the stream. It checks that each watcher
// gets every write, in order, once, with its prev_kv, and records each
// event's latency from just before its Put was sent to the receipt of the
// response that carries it.
func (s *fanoutStream) recvLoop(ctx context.Context) {
	received := 0
	for {
		resp, err := s.ws.Recv()
		if err != nil {
			s.fail(ctx, fmt.Errorf("receiving: %w", err))
			return
		}
		now := time.Since(s.base)
		if resp.Created {
			if resp.Canceled || s.watchers[resp.WatchId] != nil {
				s.fail(ctx, fmt.Errorf("create refused or duplicate id: %v", resp))
				return
			}
			s.watchers[resp.WatchId] = &fanoutWatcher{}
			if len(s.watchers) == s.n {
				close(s.created)
			}
			continue
		}
		if resp.Canceled {
			s.fail(ctx, fmt.Errorf("watch %d canceled: %q (compact revision %d)", resp.WatchId, resp.CancelReason, resp.CompactRevision))
			return
		}
		if len(resp.Events) == 0 {
			continue // progress
		}
		w := s.watchers[resp.WatchId]
		if w == nil {
			s.fail(ctx, fmt.Errorf("events for unknown watch id %d", resp.WatchId))
			return
		}
		for _, ev := range resp.Events {
			if err := w.check(ev.Kv.Value, ev.Kv.ModRevision, ev.PrevKv != nil); err != nil {
				s.fail(ctx, fmt.Errorf("watch %d: %w", resp.WatchId, err))
				return
			}
			sent := time.Duration(binary.BigEndian.Uint64(ev.Kv.Value[0:8]))
			s.hist.add(int64(now - sent))
		}
		received += len(resp.Events)
		s.received.Store(int64(received))
		if received == s.expected {
			s.lastAt.Store(int64(now))
			close(s.done)
		} else if received > s.expected {
			s.fail(ctx, fmt.Errorf("stream received %d events, want %d", received, s.expected))
			return
		}
	}
}

func (w *fanoutWatcher) check(value []byte, modRev int64, hasPrev bool) error {
	if len(value) != fanoutValueSize {
		return fmt.Errorf("value of %d bytes, want %d", len(value), fanoutValueSize)
	}
	seq := int(binary.BigEndian.Uint64(value[8:16]))
	switch {
	case seq != w.events:
		return fmt.Errorf("got write #%d after %d events: missing, repeated or out of order", seq, w.events)
	case modRev <= w.lastRev:
		return fmt.Errorf("revision %d after %d", modRev, w.lastRev)
	case !hasPrev:
		return errors.New("event without its prev_kv")
	}
	w.events++
	w.lastRev = modRev
	return nil
}

// dialConns opens n gRPC connections to addr, without client-side limits.
func dialConns(addr string, n int) ([]*grpc.ClientConn, error) {
	conns := make([]*grpc.ClientConn, 0, n)
	for range n {
		opts := []grpc.DialOption{
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1 << 30)),
		}
		if w := *fanoutWindow; w > 0 {
			opts = append(opts, grpc.WithInitialWindowSize(int32(w)), grpc.WithInitialConnWindowSize(int32(10*w)))
		}
		conn, err := grpc.NewClient(addr, opts...)
		if err != nil {
			for _, c := range conns {
				c.Close()
			}
			return nil, err
		}
		conns = append(conns, conn)
	}
	return conns, nil
}

// heapObjects is runtime.MemStats.HeapAlloc (live objects and garbage
// not yet swept), without stopping the world.
func heapObjects() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}

// latHist is a log-linear histogram of non-negative durations in ns: exact
// below 256 ns, then 128 buckets per power of two (relative error < 0.8%).
// Values are clamped to 2^40 ns (18 min).
type latHist struct {
	counts []uint64
	n      uint64
	max    int64
}

const (
	latSubBits = 7
	latSub     = 1 << latSubBits
	latMaxBits = 40
)

func newLatHist() *latHist {
	return &latHist{counts: make([]uint64, (latMaxBits-latSubBits+1)*latSub)}
}

func latBucket(v int64) int {
	u := uint64(max(v, 0))
	u = min(u, 1<<latMaxBits-1)
	if u < 2*latSub {
		return int(u)
	}
	shift := bits.Len64(u) - (latSubBits + 1) // u>>shift is in [latSub, 2*latSub)
	return (shift+1)*latSub + int(u>>shift) - latSub
}

// latBucketMid is the middle of bucket i's range.
func latBucketMid(i int) int64 {
	if i < 2*latSub {
		return int64(i)
	}
	shift := i/latSub - 1
	lo := int64(i%latSub+latSub) << shift
	return lo + (int64(1)<<shift)/2
}

func (h *latHist) add(v int64) {
	h.counts[latBucket(v)]++
	h.n++
	h.max = max(h.max, v)
}

func (h *latHist) merge(o *latHist) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

func (h *latHist) reset() {
	clear(h.counts)
	h.n, h.max = 0, 0
}

// quantile is the value at quantile q (0 < q <= 1), to the histogram's
// resolution, never above the maximum.
func (h *latHist) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q * float64(h.n))
	rank = max(rank, 1)
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			return time.Duration(min(latBucketMid(i), h.max))
		}
	}
	return time.Duration(h.max)
}
