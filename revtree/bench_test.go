package revtree_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// benchDegrees are the B-tree degrees compared by the benchmarks.
var benchDegrees = []int{2, 4, 8, 16, 32, 64}

// benchKeyspace is a loaded keyspace of n keys "key/%08d" with values of
// valueSize bytes, created at revisions 1..n, loaded at revision n.
type benchKeyspace struct {
	s        *revtree.Store
	keys     [][]byte
	versions []int64
	creates  []int64
	rev      int64
	value    []byte
}

func newBenchKeyspace(degree, n, valueSize int) *benchKeyspace {
	ks := &benchKeyspace{
		s:        revtree.New(degree),
		keys:     make([][]byte, n),
		versions: make([]int64, n),
		creates:  make([]int64, n),
		rev:      int64(n),
		value:    bytes.Repeat([]byte{'v'}, valueSize),
	}
	kvs := make([]*mvccpb.KeyValue, n)
	for i := range n {
		ks.keys[i] = fmt.Appendf(nil, "key/%08d", i)
		ks.versions[i] = 1
		ks.creates[i] = int64(i + 1)
		kvs[i] = &mvccpb.KeyValue{Key: ks.keys[i], Value: bytes.Clone(ks.value), CreateRevision: int64(i + 1), ModRevision: int64(i + 1), Version: 1}
	}
	ks.s.Reset(ks.rev, kvs, 0)
	return ks
}

// nextPut returns the events of the next revision: a put of key i with a
// fresh KeyValue (own key and value bytes, as decoded from a watch stream).
func (ks *benchKeyspace) nextPut(i int) (int64, []*mvccpb.Event) {
	ks.rev++
	ks.versions[i]++
	kv := &mvccpb.KeyValue{
		Key:            bytes.Clone(ks.keys[i]),
		Value:          bytes.Clone(ks.value),
		CreateRevision: ks.creates[i],
		ModRevision:    ks.rev,
		Version:        ks.versions[i],
	}
	return ks.rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}
}

func (ks *benchKeyspace) apply(b *testing.B, rev int64, evs []*mvccpb.Event) {
	if _, err := ks.s.Apply(rev, evs); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkApply measures Apply of one single-key put per revision over 100k
// keys. A real feed also retains snapshots only for a window, so the store
// is compacted every 1024 revisions to keep the last 1024; the KeyValue and
// Event allocations of each op (3 objects, what a watch decoder produces)
// are included in allocs/op.
func BenchmarkApply(b *testing.B) {
	for _, degree := range benchDegrees {
		b.Run(fmt.Sprintf("degree=%d", degree), func(b *testing.B) {
			ks := newBenchKeyspace(degree, 100_000, 64)
			rng := rand.New(rand.NewPCG(1, 2))
			b.ReportAllocs()
			for b.Loop() {
				rev, evs := ks.nextPut(rng.IntN(len(ks.keys)))
				ks.apply(b, rev, evs)
				if rev%1024 == 0 {
					ks.s.Compact(rev - 1024)
				}
			}
		})
	}
}

// BenchmarkApplyUnderBudget measures Apply of one single-key put per
// revision over 100k keys under a history budget, which drops a revision
// for about every one applied and leaves the sweep to free what they
// displaced: random keys with 64-byte values, and one key rewritten with a
// 64 KiB value, where the sweep must finish at once to keep up. It
// reports the slowest Apply too (worst-ms).
func BenchmarkApplyUnderBudget(b *testing.B) {
	for _, c := range []struct {
		name   string
		value  int
		budget int64
		hot    bool
	}{{"random-64B", 64, 16 << 20, false}, {"hot-64KiB", 64 << 10, 4 << 20, true}} {
		b.Run(c.name, func(b *testing.B) {
			ks := newBenchKeyspace(revtree.DefaultDegree, 100_000, 64)
			ks.value = bytes.Repeat([]byte{'v'}, c.value)
			ks.s.SetMaxHistoryBytes(c.budget)
			rng := rand.New(rand.NewPCG(1, 2))
			var worst time.Duration
			b.ReportAllocs()
			for b.Loop() {
				key := 0
				if !c.hot {
					key = rng.IntN(len(ks.keys))
				}
				rev, evs := ks.nextPut(key)
				start := time.Now()
				ks.apply(b, rev, evs)
				worst = max(worst, time.Since(start))
			}
			b.ReportMetric(float64(worst.Microseconds())/1000, "worst-ms")
		})
	}
}

// BenchmarkRangePast measures a Range at a past revision: 10k keys with 1 KiB
// values loaded at revision 10000, then 2000 single-key updates; the Range
// reads revision 10000, the whole keyspace or a first page of 500. "all"
// makes the KeyValues (View.Range); "encoded" makes the response's pieces,
// the stored bytes themselves, as kvproxy sends them (View.Result,
// Result.AppendPieces).
func BenchmarkRangePast(b *testing.B) {
	for _, degree := range benchDegrees {
		benchRangePast(b, fmt.Sprintf("degree=%d", degree), degree, 1024, 2000, 0)
	}
}

// BenchmarkRangePastByHistory is BenchmarkRangePast at the default degree
// with 128-byte values for several lengths of history after the load
// (updates, each of one random key: up to 10 versions per key), reading
// the load's revision (every updated key searches its versions) and the
// head (every key's newest version).
func BenchmarkRangePastByHistory(b *testing.B) {
	for _, updates := range []int{0, 2000, 20_000, 100_000} {
		for _, at := range []struct {
			name  string
			ahead int64
		}{{"load", 0}, {"head", int64(updates)}} {
			benchRangePast(b, fmt.Sprintf("updates=%d/at=%s", updates, at.name), revtree.DefaultDegree, 128, updates, at.ahead)
		}
	}
}

// benchRangePast runs BenchmarkRangePast's reads at revision 10000+ahead
// after the given number of updates.
func benchRangePast(b *testing.B, name string, degree, valueSize, updates int, ahead int64) {
	ks := newBenchKeyspace(degree, 10_000, valueSize)
	past := ks.rev + ahead
	rng := rand.New(rand.NewPCG(3, 4))
	for range updates {
		rev, evs := ks.nextPut(rng.IntN(len(ks.keys)))
		ks.apply(b, rev, evs)
	}
	for _, tc := range []struct {
		name    string
		limit   int64
		want    int
		encoded bool
	}{{"all", 0, 10_000, false}, {"all/encoded", 0, 10_000, true}, {"limit=500/encoded", 500, 500, true}} {
		// (limit=500 last: its flattened range would serve the others.)
		b.Run(name+"/"+tc.name, func(b *testing.B) {
			// A View per read, as kvproxy takes one: the flattened-range
			// cache keeps a slice per snapshot, so this measures the walk.
			ks.s.SetMinFlatKVsForTest(1 << 30)
			req := &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, Revision: past, Limit: tc.limit}
			b.ReportAllocs()
			for b.Loop() {
				if tc.encoded {
					// The response in pieces, as kvproxy sends it.
					v, err := ks.s.View(req.Revision)
					if err != nil {
						b.Fatal(err)
					}
					x := v.Result(req, revtree.RangeOptions{})
					if _, err := x.AppendPieces(nil, nil); err != nil || x.Len() != tc.want || x.Count != 10_000 {
						b.Fatalf("Result: %d kvs, count %d, %v", x.Len(), x.Count, err)
					}
					continue
				}
				resp, err := ks.s.Range(req, revtree.RangeOptions{})
				if err != nil || len(resp.Kvs) != tc.want || resp.Count != 10_000 {
					b.Fatalf("Range: %d kvs, count %d, %v", len(resp.Kvs), resp.Count, err)
				}
			}
		})
	}
}

// BenchmarkRetainedRevisionBytes measures the heap cost of a retained
// revision: 100k keys (64-byte values), then 100k retained revisions, each
// a put of one random key. It is a memory measurement, not a timing: each
// sub-benchmark builds its store exactly once (b.Loop runs the function once
// per -count, whatever b.N turns out to be) and reports
//
//	B/rev         live heap growth per retained revision, everything included
//	tree-B/rev    the store's own share: its copy of the KeyValue, the
//	              version, the snapshot and its index slot
//	payload-B/rev what the caller hands to Apply: the KeyValue with its key
//	              and value bytes, the Event and the events slice
//
// measured as live heap (HeapAlloc after runtime.GC) before and after the
// payload is allocated, and after it is applied. The timed loop then does
// point reads (View + Get) at random retained revisions, so ns/op is the
// cost of a past-revision Get with 100k snapshots retained.
func BenchmarkRetainedRevisionBytes(b *testing.B) {
	for _, degree := range benchDegrees {
		benchRetainedRevisionBytes(b, fmt.Sprintf("degree=%d", degree), degree, 100_000, 64)
	}
}

// BenchmarkRetainedRevisionBytesByKeys is BenchmarkRetainedRevisionBytes
// at the default degree over 100k keys with 64-byte values and over 20k
// keys with 100-byte values (5 versions per key on average).
func BenchmarkRetainedRevisionBytesByKeys(b *testing.B) {
	for _, ks := range []struct{ keys, value int }{{100_000, 64}, {20_000, 100}} {
		benchRetainedRevisionBytes(b, fmt.Sprintf("keys=%d/value=%d", ks.keys, ks.value), revtree.DefaultDegree, ks.keys, ks.value)
	}
}

// benchRetainedRevisionBytes runs BenchmarkRetainedRevisionBytes's
// measurement for one store configuration and keyspace.
func benchRetainedRevisionBytes(b *testing.B, name string, degree, keys, valueSize int) {
	const revs = 100_000
	b.Run(name, func(b *testing.B) {
		ks := newBenchKeyspace(degree, keys, valueSize)
		first := ks.rev
		rng := rand.New(rand.NewPCG(5, 6))
		idx := make([]int, revs)
		for i := range idx {
			idx[i] = rng.IntN(keys)
		}
		type batch struct {
			rev int64
			evs []*mvccpb.Event
		}
		batches := make([]batch, revs)

		h0 := liveHeap()
		for i, k := range idx {
			rev, evs := ks.nextPut(k)
			batches[i] = batch{rev, evs}
		}
		h1 := liveHeap()
		est0 := ks.s.ApproxBytes()
		for _, bt := range batches {
			ks.apply(b, bt.rev, bt.evs)
		}
		h2 := liveHeap()
		runtime.KeepAlive(batches)
		if n := ks.s.Snapshots(); n != revs+1 {
			b.Fatalf("%d snapshots retained, want %d", n, revs+1)
		}

		for b.Loop() {
			rev := first + 1 + rng.Int64N(revs)
			v, err := ks.s.View(rev)
			if err != nil {
				b.Fatal(err)
			}
			if _, ok := v.Get(ks.keys[rng.IntN(keys)]); !ok {
				b.Fatal("key missing")
			}
		}
		runtime.KeepAlive(ks)
		// After the loop: b.Loop's timer reset drops earlier metrics.
		b.ReportMetric(float64(h2-h0)/revs, "B/rev")
		b.ReportMetric(float64(h2-h1)/revs, "tree-B/rev")
		b.ReportMetric(float64(h1-h0)/revs, "payload-B/rev")
		// What the cache-bytes metric estimates for the same revisions.
		b.ReportMetric(float64(ks.s.ApproxBytes()-est0)/revs, "est-B/rev")
	})
}

func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}
