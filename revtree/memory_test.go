package revtree

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// liveHeapNow is the live heap: HeapAlloc right after a full collection.
func liveHeapNow() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// memWorkload generates revisions over a keyspace the way a watch decoder
// hands them to Apply: fresh KeyValues and Events, referenced afterwards
// by nothing but the store.
type memWorkload struct {
	rng      *rand.Rand
	value    int
	rev      int64
	live     []bool // by key index
	versions []int64
	creates  []int64
	after    []int32 // a created key's place: after the loaded key of this index
	n        int     // key indexes in use: 0..n-1
	loaded   int     // keys loaded
}

func newMemWorkload(keys, revs, value int) *memWorkload {
	return &memWorkload{
		rng:      rand.New(rand.NewPCG(uint64(keys), uint64(value))),
		value:    value,
		live:     make([]bool, keys+revs*4),
		versions: make([]int64, keys+revs*4),
		creates:  make([]int64, keys+revs*4),
		after:    make([]int32, keys+revs*4),
	}
}

// key is the key of index i: the loaded keys in index order, a created
// one at a random place between them.
func (w *memWorkload) key(i int) []byte {
	if i < w.loaded {
		return fmt.Appendf(nil, "/registry/pods/pod-%08d", i)
	}
	return fmt.Appendf(nil, "/registry/pods/pod-%08d-%06d", w.after[i], i)
}

func (w *memWorkload) kv(i int) *mvccpb.KeyValue {
	if !w.live[i] {
		w.live[i], w.creates[i], w.versions[i] = true, w.rev, 0
	}
	w.versions[i]++
	return &mvccpb.KeyValue{Key: w.key(i), Value: bytes.Repeat([]byte{'v'}, w.value),
		CreateRevision: w.creates[i], ModRevision: w.rev, Version: w.versions[i]}
}

// load returns the keyspace of keys keys, created in key order.
func (w *memWorkload) load(keys int) []*mvccpb.KeyValue {
	kvs := make([]*mvccpb.KeyValue, keys)
	w.loaded = keys
	for i := range kvs {
		w.rev++
		kvs[i] = w.kv(i)
	}
	w.n = keys
	return kvs
}

// loadAt returns Reset's arguments for a load of keys keys.
func (w *memWorkload) loadAt(keys int) (int64, []*mvccpb.KeyValue, int64) {
	kvs := w.load(keys)
	return w.rev, kvs, 0
}

// liveKey returns a random live key index.
func (w *memWorkload) liveKey() int {
	for {
		if i := w.rng.IntN(w.n); w.live[i] {
			return i
		}
	}
}

// next returns the events of the next revision: updates of random keys
// ("update"), creates, deletes and updates ("churn"), or Txns of four
// updates ("txn").
func (w *memWorkload) next(kind string) (int64, []*mvccpb.Event) {
	w.rev++
	switch kind {
	case "update":
		return w.rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: w.kv(w.liveKey())}}
	case "txn":
		var evs []*mvccpb.Event
		seen := map[int]bool{}
		for len(evs) < 4 {
			if i := w.liveKey(); !seen[i] {
				seen[i] = true
				evs = append(evs, &mvccpb.Event{Type: mvccpb.PUT, Kv: w.kv(i)})
			}
		}
		return w.rev, evs
	}
	switch r := w.rng.IntN(10); {
	case r < 4:
		w.after[w.n] = int32(w.rng.IntN(w.loaded))
		w.n++
		return w.rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: w.kv(w.n - 1)}}
	case r < 7:
		i := w.liveKey()
		w.live[i] = false
		return w.rev, []*mvccpb.Event{{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: w.key(i), ModRevision: w.rev}}}
	default:
		return w.rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: w.kv(w.liveKey())}}
	}
}

// within reports whether est is within tol (a fraction) of real.
func within(est, real int64, tol float64) bool {
	d := float64(est - real)
	return d <= tol*float64(real) && -d <= tol*float64(real)
}

// TestMemoryEstimate checks the store's memory estimate (memory.go)
// against the live heap: the loaded keyspace (ApproxBytes), the history
// of 10,000 revisions (HistoryBytes), and what dropping that history for
// the budget frees, for several B-tree degrees, value sizes and
// workloads. Each must be within 10% of what runtime.MemStats measures.
func TestMemoryEstimate(t *testing.T) {
	const keys, revs, tol = 10_000, 10_000, 0.10
	type tc struct {
		degree, value int
		kind          string
	}
	cases := []tc{
		{8, 64, "update"}, {8, 1000, "update"}, {2, 64, "update"}, {32, 64, "update"},
		{8, 64, "churn"}, {32, 200, "churn"}, {8, 64, "txn"},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("degree=%d/value=%d/%s", c.degree, c.value, c.kind), func(t *testing.T) {
			w := newMemWorkload(keys, revs, c.value)
			s := New(c.degree)

			h0 := liveHeapNow()
			s.Reset(w.loadAt(keys))
			h1 := liveHeapNow()
			liveEst := s.ApproxBytes()

			for range revs {
				rev, evs := w.next(c.kind)
				if _, err := s.Apply(rev, evs); err != nil {
					t.Fatal(err)
				}
			}
			h2 := liveHeapNow()
			histEst := s.HistoryBytes()
			approx := s.ApproxBytes()
			totalEst := approx - liveEst

			// Everything but the newest snapshot goes, and the keys its
			// events wrote keep their bare encodings (sweep.go).
			s.SetMaxHistoryBytes(1)
			h3 := liveHeapNow()
			freedEst := approx - s.ApproxBytes()
			runtime.KeepAlive(s)
			runtime.KeepAlive(w)

			t.Logf("load: %d B/key (estimate %d); history: %d B/rev (estimate %d, history alone %d); dropping it freed %d B/rev (estimate %d)",
				(h1-h0)/keys, liveEst/keys, (h2-h1)/revs, totalEst/revs, histEst/revs, (h2-h3)/revs, freedEst/revs)
			if !within(liveEst, h1-h0, tol) {
				t.Errorf("loaded keyspace: estimate %d, heap %d", liveEst, h1-h0)
			}
			if !within(totalEst, h2-h1, tol) {
				t.Errorf("after %d revisions: estimate grew by %d, heap by %d", revs, totalEst, h2-h1)
			}
			if !within(freedEst, h2-h3, tol) {
				t.Errorf("dropping history: estimate %d freed, heap %d", freedEst, h2-h3)
			}
			if s.Snapshots() != 1 || s.CompactRev() != 0 {
				t.Errorf("after trimming: %d snapshots, compaction revision %d; want 1, 0", s.Snapshots(), s.CompactRev())
			}
		})
	}
}

// TestLoadedKeyspaceMemory: a keyspace of 1 KiB values, loaded page by
// page as from etcd, takes at most 1.15 times its keys' and values' bytes
// of live heap (the bound; BenchmarkKeyspaceMemory measures the
// process), and the estimate is within 5% of it.
func TestLoadedKeyspaceMemory(t *testing.T) {
	const keys, value, page = 20_000, 1024, 1000
	w := newMemWorkload(keys, 0, value)
	s := New(0)
	h0 := liveHeapNow()
	l := s.NewLoad()
	var data int64
	w.loaded = keys
	for start := 0; start < keys; start += page {
		kvs := make([]*mvccpb.KeyValue, page)
		for i := range kvs {
			w.rev++
			kvs[i] = w.kv(start + i)
			data += int64(len(kvs[i].Key) + len(kvs[i].Value))
		}
		l.Add(kvs)
	}
	w.n = keys
	s.ResetLoad(w.rev, l, 0)
	h1 := liveHeapNow()
	runtime.KeepAlive(s)
	ratio := float64(h1-h0) / float64(data)
	t.Logf("%d keys: %d B/key of live heap (estimate %d) for %d B/key of data: %.3fx",
		keys, (h1-h0)/keys, s.ApproxBytes()/keys, data/keys, ratio)
	if ratio > 1.15 {
		t.Errorf("the loaded keyspace takes %.3fx its data; want at most 1.15x", ratio)
	}
	if !within(s.ApproxBytes(), h1-h0, 0.05) {
		t.Errorf("loaded keyspace: estimate %d, heap %d", s.ApproxBytes(), h1-h0)
	}
}

// TestFlatRangesCounted: the flattened-range cache counts in the history
// budget, within its share of it, and never keeps a tree the store has
// dropped (compaction, the budget, a reset or an unload), not even one a
// reader flattens after the drop.
func TestFlatRangesCounted(t *testing.T) {
	w := newMemWorkload(5000, 100, 16)
	s := New(8)
	s.Reset(w.loadAt(5000))
	for range 100 {
		rev, evs := w.next("update")
		if _, err := s.Apply(rev, evs); err != nil {
			t.Fatal(err)
		}
	}
	list := func(rev int64) {
		t.Helper()
		resp, err := s.Range(&pb.RangeRequest{Key: []byte("/"), RangeEnd: []byte("0"), Revision: rev, Limit: 10}, RangeOptions{})
		if err != nil || !resp.More {
			t.Fatalf("Range at %d: %v, %v", rev, resp, err)
		}
	}
	first := s.OldestRev()
	hist := s.HistoryBytes()
	list(first + 10)
	list(s.Rev())
	if got := s.HistoryBytes() - hist; got < 2*5000*8 {
		t.Fatalf("two flattened ranges of 5000 keys add %d bytes to history", got)
	}

	// A reader holding a view of a snapshot that is then compacted away
	// cannot cache it.
	view, err := s.View(first + 20)
	if err != nil {
		t.Fatal(err)
	}
	s.Compact(first + 30)
	view.Range(&pb.RangeRequest{Key: []byte("/"), RangeEnd: []byte("0"), Limit: 10}, RangeOptions{})
	s.flat.mu.Lock()
	for _, e := range s.flat.entries {
		if e.snap.rev < first+30 {
			t.Errorf("cache holds a range of dropped snapshot %d", e.snap.rev)
		}
	}
	n := len(s.flat.entries)
	s.flat.mu.Unlock()
	if n != 1 {
		t.Errorf("after compaction the cache holds %d ranges, want 1 (the newest snapshot's)", n)
	}

	// A budget: the cache takes at most half of it, and history plus
	// cache stay within it.
	s.SetMaxHistoryBytes(60_000)
	list(s.Rev())
	if got := s.HistoryBytes(); got > 60_000 {
		t.Errorf("history %d bytes over a budget of 60000", got)
	}
	if got := s.flat.size(); got > 30_000 {
		t.Errorf("flattened ranges %d bytes over half the budget", got)
	}

	s.Reset(w.loadAt(100))
	if got := s.flat.size(); got != 0 {
		t.Errorf("after Reset the cache holds %d bytes", got)
	}
	list(0)
	s.Unload()
	if got, entries := s.flat.size(), len(s.flat.entries); got != 0 || entries != 0 {
		t.Errorf("after Unload the cache holds %d ranges, %d bytes", entries, got)
	}
}

// TestSweepKeepsUpWithLargeValues: what dropped snapshots leave to the
// sweep stays within an eighth of the budget, and the heap within the
// budget's reach, with a large index and a 64 KiB value rewritten at every
// revision, which the budget drops about as fast. A sweep that walked the
// whole index in stretches of 256 keys per Apply left 5 MiB awaiting it
// under a 1 MiB budget.
func TestSweepKeepsUpWithLargeValues(t *testing.T) {
	const (
		keys   = 20_000
		budget = 1 << 20
		value  = 64 << 10
	)
	load := make([]*mvccpb.KeyValue, keys)
	for i := range load {
		load[i] = &mvccpb.KeyValue{Key: fmt.Appendf(nil, "k%06d", i), Value: []byte("v"), CreateRevision: 1, ModRevision: 1, Version: 1}
	}
	s := New(0)
	s.SetMaxHistoryBytes(budget)
	s.Reset(1, load, 0)
	load = nil
	base := liveHeapNow()

	var maxPending, maxHeap int64
	val := bytes.Repeat([]byte("x"), value)
	for rev := int64(2); rev <= 300; rev++ {
		kv := &mvccpb.KeyValue{Key: []byte("k000000"), Value: val, CreateRevision: 1, ModRevision: rev, Version: rev}
		if _, err := s.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}); err != nil {
			t.Fatal(err)
		}
		s.mu.RLock()
		maxPending = max(maxPending, s.pendingBytes)
		s.mu.RUnlock()
		if rev%50 == 0 {
			maxHeap = max(maxHeap, liveHeapNow()-base)
		}
	}
	// Drops after Apply's check may add one revision's displaced value.
	if limit := int64(budget/8 + value + 1024); maxPending > limit {
		t.Errorf("%d bytes awaited the sweep, over %d (an eighth of the %d-byte budget and one value)", maxPending, limit, budget)
	}
	if maxHeap > 2*budget {
		t.Errorf("the heap grew by up to %d bytes over the loaded keyspace under a %d-byte budget", maxHeap, budget)
	}
	t.Logf("most awaiting the sweep %d bytes, heap over the keyspace up to %d bytes, history %d bytes in %d snapshots",
		maxPending, maxHeap, s.HistoryBytes(), s.Snapshots())
}
