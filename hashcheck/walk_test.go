package hashcheck

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"iter"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// walkRev is the revision of every store and walk of these tests; every mod
// revision is at or below it.
const walkRev = 1000

func mkKV(k string, mod int64) *mvccpb.KeyValue {
	return &mvccpb.KeyValue{Key: []byte(k), Value: []byte("v"), CreateRevision: mod, ModRevision: mod, Version: 1}
}

// sortedKVs returns kvs in key order.
func sortedKVs(kvs []*mvccpb.KeyValue) []*mvccpb.KeyValue {
	kvs = slices.Clone(kvs)
	slices.SortFunc(kvs, func(a, b *mvccpb.KeyValue) int { return bytes.Compare(a.Key, b.Key) })
	return kvs
}

// viewOf returns the view at walkRev of a store holding kvs.
func viewOf(tb testing.TB, kvs []*mvccpb.KeyValue) revtree.View {
	tb.Helper()
	s := revtree.New(0)
	s.Reset(walkRev, kvs, 0)
	v, err := s.View(walkRev)
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

// collect returns every entry of a walk, and the error that ended it.
func collect(seq iter.Seq2[Entry, error]) ([]Entry, error) {
	var es []Entry
	for e, err := range seq {
		if err != nil {
			return es, err
		}
		es = append(es, e)
	}
	return es, nil
}

// sameAsUnbounded compares cache with etcd at walkRev through the
// unbounded walk of etcd (rangeEntries) and through the bounded one
// (viewEntries), both with pages of page keys, fails t unless both give
// the same entries of etcd and the same Result, and returns the Result.
func sameAsUnbounded(t *testing.T, cache, etcd []*mvccpb.KeyValue, page int) Result {
	t.Helper()
	ctx := context.Background()
	v := viewOf(t, cache)
	fake := &fakeEtcd{kvs: sortedKVs(etcd)}
	want, err := Compare(walkRev, cacheEntries(v), rangeEntries(ctx, fake, walkRev, page))
	if err != nil {
		t.Fatal(err)
	}
	got, err := Compare(walkRev, cacheEntries(v), viewEntries(ctx, fake, v, walkRev, page))
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("page %d: bounded walk %+v, unbounded %+v", page, got, want)
	}
	wantEs, err := collect(rangeEntries(ctx, fake, walkRev, page))
	if err != nil {
		t.Fatal(err)
	}
	gotEs, err := collect(viewEntries(ctx, fake, v, walkRev, page))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(gotEs, wantEs, func(a, b Entry) bool { return bytes.Equal(a.Key, b.Key) && a.ModRevision == b.ModRevision }) {
		t.Fatalf("page %d: bounded walk read %d entries of etcd, unbounded %d, or not the same", page, len(gotEs), len(wantEs))
	}
	return got
}

// TestBoundedWalkSameAsUnbounded: reading etcd in chunks cut at the
// cache's keys gives the Result of reading it in pages to the end of the
// keyspace, however etcd and the cache differ, wherever the difference
// falls against the chunks (with pages of 3 keys and keys k00..k09, the
// chunks are [\x00, k03), [k03, k06), [k06, k09) and [k09, end)).
func TestBoundedWalkSameAsUnbounded(t *testing.T) {
	base := func(n int) []*mvccpb.KeyValue {
		var kvs []*mvccpb.KeyValue
		for i := range n {
			kvs = append(kvs, mkKV(fmt.Sprintf("k%02d", i), int64(10+i)))
		}
		return kvs
	}
	keys := base(10)
	with := func(kvs []*mvccpb.KeyValue, extra ...*mvccpb.KeyValue) []*mvccpb.KeyValue {
		return sortedKVs(append(slices.Clone(kvs), extra...))
	}
	without := func(kvs []*mvccpb.KeyValue, drop ...string) []*mvccpb.KeyValue {
		return slices.DeleteFunc(slices.Clone(kvs), func(kv *mvccpb.KeyValue) bool { return slices.Contains(drop, string(kv.Key)) })
	}
	modified := func(kvs []*mvccpb.KeyValue, key string, mod int64) []*mvccpb.KeyValue {
		kvs = without(kvs, key)
		return with(kvs, mkKV(key, mod))
	}
	var many []*mvccpb.KeyValue // 26 keys inside the chunk [k03, k06)
	for c := 'a'; c <= 'z'; c++ {
		many = append(many, mkKV("k04"+string(c), 500))
	}
	for _, tc := range []struct {
		name        string
		cache, etcd []*mvccpb.KeyValue
		diff        string // substring of FirstDiff; "" for a match
	}{
		{"identical", keys, keys, ""},
		{"empty", nil, nil, ""},
		{"one key", base(1), base(1), ""},
		{"smaller than a page", base(2), base(2), ""},
		{"one page", base(3), base(3), ""},
		{"one page and a key", base(4), base(4), ""},
		{"two pages", base(6), base(6), ""},
		{"etcd has a key inside a chunk", keys, with(keys, mkKV("k04a", 5)), `where etcd has "k04a"`},
		{"etcd has many keys inside a chunk", keys, with(keys, many...), `where etcd has "k04a"`},
		{"etcd has keys before the first", keys, with(keys, mkKV("\x00", 3), mkKV("\x00\x00", 4), mkKV("a", 5)), `where etcd has "\x00"`},
		{"etcd has a key before the first boundary", keys, with(keys, mkKV("k01a", 5)), `where etcd has "k01a"`},
		{"etcd has a key just before a boundary", keys, with(keys, mkKV("k02\xff\xff", 5)), `where etcd has "k02\xff\xff"`},
		{"etcd has a key just after a boundary", keys, with(keys, mkKV("k03\x00", 5)), `where etcd has "k03\x00"`},
		{"etcd has keys after the last", keys, with(keys, mkKV("z", 5), mkKV("\xff\xff", 6)), `etcd has key "z" (mod_revision 5) past the cache's last key`},
		{"etcd has keys past the cache's only page", base(2), with(base(2), many...), `etcd has key "k04a"`},
		{"etcd lacks a boundary key", keys, without(keys, "k03"), `the cache has key "k03" where etcd has "k04"`},
		{"etcd lacks every boundary key", keys, without(keys, "k03", "k06", "k09"), `the cache has key "k03" where etcd has "k04"`},
		{"etcd lacks the first key", keys, without(keys, "k00"), `the cache has key "k00" where etcd has "k01"`},
		{"etcd lacks the last key", keys, without(keys, "k09"), `the cache has key "k09" (mod_revision 19) past etcd's last key`},
		{"the cache lacks a boundary key", without(keys, "k03"), keys, `the cache has key "k04" where etcd has "k03"`},
		{"mod revision differs at a boundary", keys, modified(keys, "k06", 900), `key "k06" has mod_revision 16 in the cache, 900 in etcd`},
		{"mod revision differs inside a chunk", keys, modified(keys, "k04", 900), `key "k04" has mod_revision 14 in the cache, 900 in etcd`},
		{"mod revision differs in the last chunk", keys, modified(keys, "k09", 900), `key "k09" has mod_revision 19 in the cache, 900 in etcd`},
		{"the cache is empty", nil, with(keys, many...), `etcd has key "k00"`},
		{"etcd is empty", keys, nil, `the cache has key "k00"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, page := range []int{1, 2, 3, 4, 7, pageSize} {
				res := sameAsUnbounded(t, tc.cache, tc.etcd, page)
				if res.Match() != (tc.diff == "") || !strings.Contains(res.FirstDiff, tc.diff) {
					t.Fatalf("page %d: match %v, first difference %q; want %q", page, res.Match(), res.FirstDiff, tc.diff)
				}
				if res.Keys != len(tc.cache) {
					t.Fatalf("page %d: %d keys, want %d", page, res.Keys, len(tc.cache))
				}
			}
		})
	}
}

// TestBoundedWalkSameAsUnboundedRandom: random keyspaces over a small
// alphabet (with "\x00" and "\xff" bytes, so keys fall next to the
// boundaries), the cache's a random edit of etcd's.
func TestBoundedWalkSameAsUnboundedRandom(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("SNAPCACHE_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("SNAPCACHE_SEED: %v", err)
		}
	}
	t.Logf("seed %d (rerun with SNAPCACHE_SEED=%d)", seed, seed)
	r := rand.New(rand.NewPCG(seed, seed>>1))
	alphabet := []byte{0, 1, 'a', 'b', 0xff}
	randKey := func() string {
		k := make([]byte, 1+r.IntN(3))
		for i := range k {
			k[i] = alphabet[r.IntN(len(alphabet))]
		}
		return string(k)
	}
	for round := range 300 {
		etcd := map[string]int64{}
		for range r.IntN(40) {
			etcd[randKey()] = 1 + r.Int64N(walkRev)
		}
		cache := map[string]int64{}
		for k, mod := range etcd {
			switch p := r.IntN(20); {
			case p == 0:
				// dropped from the cache
			case p == 1:
				cache[k] = 1 + r.Int64N(walkRev)
			default:
				cache[k] = mod
			}
		}
		for range r.IntN(3) {
			cache[randKey()] = 1 + r.Int64N(walkRev)
		}
		if r.IntN(10) == 0 { // often the same
			clear(cache)
			for k, mod := range etcd {
				cache[k] = mod
			}
		}
		kvs := func(m map[string]int64) []*mvccpb.KeyValue {
			var kvs []*mvccpb.KeyValue
			for k, mod := range m {
				kvs = append(kvs, mkKV(k, mod))
			}
			return sortedKVs(kvs)
		}
		page := 1 + r.IntN(6)
		t.Run(fmt.Sprintf("%d", round), func(t *testing.T) {
			sameAsUnbounded(t, kvs(cache), kvs(etcd), page)
		})
	}
}

// TestBoundedWalkCountsEachKeyOnce: with the cache and etcd alike, the
// bounded walk has etcd count each key once, in one Range per chunk, where
// the unbounded walk has it count the rest of the keyspace for every page.
func TestBoundedWalkCountsEachKeyOnce(t *testing.T) {
	const n, page = 2000, 100
	var kvs []*mvccpb.KeyValue
	for i := range n {
		kvs = append(kvs, mkKV(fmt.Sprintf("/registry/pods/ns/p%06d", i), int64(1+i%walkRev)))
	}
	v := viewOf(t, kvs)
	ctx := context.Background()

	bounded := &fakeEtcd{kvs: kvs}
	if res, err := Compare(walkRev, cacheEntries(v), viewEntries(ctx, bounded, v, walkRev, page)); err != nil || !res.Match() || res.Keys != n {
		t.Fatalf("bounded walk: %+v, %v", res, err)
	}
	if r, w := bounded.ranges.Load(), bounded.walked.Load(); r != n/page || w != n {
		t.Fatalf("bounded walk: %d Ranges counting %d keys; want %d counting %d", r, w, n/page, n)
	}

	unbounded := &fakeEtcd{kvs: kvs}
	if res, err := Compare(walkRev, cacheEntries(v), rangeEntries(ctx, unbounded, walkRev, page)); err != nil || !res.Match() {
		t.Fatalf("unbounded walk: %+v, %v", res, err)
	}
	if w := unbounded.walked.Load(); w != n*(n/page+1)/2 {
		t.Fatalf("unbounded walk counted %d keys, want %d", w, n*(n/page+1)/2)
	}

	// etcd with many more keys than the cache in a chunk: pages of 2*page.
	over := &fakeEtcd{kvs: kvs}
	few := viewOf(t, kvs[:page+1]) // chunks [\x00, kvs[page]) and [kvs[page], end)
	res, err := Compare(walkRev, cacheEntries(few), viewEntries(ctx, over, few, walkRev, page))
	if err != nil || res.Match() {
		t.Fatalf("bounded walk of a cache missing keys: %+v, %v", res, err)
	}
	if r, want := over.ranges.Load(), int64(1+(n-page+2*page-1)/(2*page)); r != want {
		t.Fatalf("bounded walk of a cache missing keys: %d Ranges, want %d", r, want)
	}
}

// TestSameHistoryBounded: the verifier walks etcd in chunks of its page
// size and tells a matching etcd from a differing one.
func TestSameHistoryBounded(t *testing.T) {
	var kvs []*mvccpb.KeyValue
	for i := range 10 {
		kvs = append(kvs, mkKV(fmt.Sprintf("k%02d", i), int64(10+i)))
	}
	store := revtree.New(0)
	store.Reset(walkRev, kvs, 0)
	etcd := &fakeEtcd{kvs: slices.Clone(kvs)}
	v := NewVerifier(store, etcd, nil)
	v.pageSize = 3
	c := New(Config{Verifier: v, Follower: &fakeFollower{}})
	ctx := context.Background()
	if same, err := v.SameHistory(ctx, walkRev); err != nil || !same {
		t.Fatalf("SameHistory against a matching etcd: %v, %v", same, err)
	}
	if r := etcd.ranges.Load(); r != 4 {
		t.Fatalf("SameHistory asked %d Ranges, want 4 (chunks of 3 keys of 10)", r)
	}
	etcd.kvs[6] = mkKV("k06", 900)
	if same, err := v.SameHistory(ctx, walkRev); err != nil || same {
		t.Fatalf("SameHistory against a differing etcd: %v, %v", same, err)
	}
	etcd.kvs[6], etcd.failAt = kvs[6], etcd.ranges.Load()+2
	if same, err := v.SameHistory(ctx, walkRev); !errors.Is(err, errFake) || same {
		t.Fatalf("SameHistory against a failing etcd: %v, %v; want %v", same, err, errFake)
	}
	if res, err := c.Check(ctx); err != nil || !res.Match() || res.Keys != 10 {
		t.Fatalf("Check against a matching etcd: %+v, %v", res, err)
	}
}

// manyKVs returns n keys k0000, k0001, ...
func manyKVs(n int) []*mvccpb.KeyValue {
	var kvs []*mvccpb.KeyValue
	for i := range n {
		kvs = append(kvs, mkKV(fmt.Sprintf("k%04d", i), int64(1+i)))
	}
	return kvs
}

// TestBoundedWalkStopsAtFirstDifference: a walk the caller stops at the
// first difference has read only a few chunks ahead of it, and leaves no
// goroutine behind.
func TestBoundedWalkStopsAtFirstDifference(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	kvs := manyKVs(100)
	v := viewOf(t, kvs)
	etcd := &fakeEtcd{kvs: slices.Clone(kvs)}
	etcd.kvs[4] = mkKV("k0004", 900) // in the second chunk of 3 keys
	nextCache, stop := iter.Pull2(cacheEntries(v))
	defer stop()
	var diff string
	for e, err := range viewEntries(context.Background(), etcd, v, walkRev, 3) {
		if err != nil {
			t.Fatal(err)
		}
		c, _, _ := nextCache()
		if c.ModRevision != e.ModRevision {
			diff = string(e.Key)
			break
		}
	}
	if diff != "k0004" {
		t.Fatalf("first difference at %q, want k0004", diff)
	}
	// The second chunk compared, the third read ahead, the fourth read
	// while the third waits: 4 of 34.
	if r := etcd.ranges.Load(); r > 4 {
		t.Fatalf("%d Ranges asked by a walk stopped in the second chunk, want at most 4", r)
	}
}

// TestBoundedWalkStopsWhileReading: a walk stopped while its reader waits
// for etcd ends that Range, and waits for it and the reader, before it
// returns.
func TestBoundedWalkStopsWhileReading(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	kvs := manyKVs(30)
	v := viewOf(t, kvs)
	etcd := &fakeEtcd{kvs: kvs, block: make(chan struct{}, 1)}
	etcd.block <- struct{}{} // the first Range alone is answered
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n := 0
	for _, err := range viewEntries(ctx, etcd, v, walkRev, 3) {
		if err != nil {
			t.Fatal(err)
		}
		if n++; n == 2 {
			break
		}
	}
	if r := etcd.ranges.Load(); r > 2 {
		t.Fatalf("%d Ranges asked, want at most 2", r)
	}
	if p := etcd.pending.Load(); p != 0 {
		t.Fatalf("the walk returned with %d Ranges not returned", p)
	}
}

// TestBoundedWalkErrors: etcd's error ends the walk after every entry read
// before it, in order; so does the end of the caller's context, never
// taken for the end of the keyspace; neither leaves a goroutine behind.
func TestBoundedWalkErrors(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	kvs := manyKVs(100)
	v := viewOf(t, kvs)

	etcd := &fakeEtcd{kvs: kvs, failAt: 3}
	es, err := collect(viewEntries(context.Background(), etcd, v, walkRev, 3))
	if !errors.Is(err, errFake) || !strings.Contains(err.Error(), "reading keys at revision 1000") {
		t.Fatalf("walk of a failing etcd ended with %v", err)
	}
	if len(es) != 6 || string(es[0].Key) != "k0000" || string(es[5].Key) != "k0005" {
		t.Fatalf("walk of a failing etcd read %d entries before the error, want the 6 of two chunks", len(es))
	}
	res, err := Compare(walkRev, cacheEntries(v), viewEntries(context.Background(), &fakeEtcd{kvs: kvs, failAt: 5}, v, walkRev, 3))
	if !errors.Is(err, errFake) {
		t.Fatalf("Compare with a failing etcd: %+v, %v", res, err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n := 0
	for e, err := range viewEntries(ctx, &fakeEtcd{kvs: kvs}, v, walkRev, 3) {
		if err != nil {
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("walk ended by its context with %v", err)
			}
			return
		}
		if want := fmt.Sprintf("k%04d", n); string(e.Key) != want {
			t.Fatalf("entry %d: %q, want %q", n, e.Key, want)
		}
		if n++; n == 1 {
			cancel()
		}
	}
	t.Fatalf("walk ended by its context read %d entries and no error", n)
}

// BenchmarkWalk: the cost to etcd (keys counted) of each walk of 100k keys
// in pages of 1000, against a fake etcd that counts as etcd does.
func BenchmarkWalk(b *testing.B) {
	const n, page = 100_000, 1000
	var kvs []*mvccpb.KeyValue
	for i := range n {
		kvs = append(kvs, mkKV(fmt.Sprintf("/registry/configmaps/ns%03d/cm%06d", i%100, i), int64(1+i%walkRev)))
	}
	kvs = sortedKVs(kvs)
	v := viewOf(b, kvs)
	for _, w := range []struct {
		name string
		walk func(ctx context.Context, e *fakeEtcd) iter.Seq2[Entry, error]
	}{
		{"unbounded", func(ctx context.Context, e *fakeEtcd) iter.Seq2[Entry, error] {
			return rangeEntries(ctx, e, walkRev, page)
		}},
		{"bounded", func(ctx context.Context, e *fakeEtcd) iter.Seq2[Entry, error] {
			return viewEntries(ctx, e, v, walkRev, page)
		}},
	} {
		b.Run(w.name, func(b *testing.B) {
			etcd := &fakeEtcd{kvs: kvs}
			for b.Loop() {
				res, err := Compare(walkRev, cacheEntries(v), w.walk(b.Context(), etcd))
				if err != nil || !res.Match() {
					b.Fatalf("%+v, %v", res, err)
				}
			}
			b.ReportMetric(float64(etcd.walked.Load())/float64(b.N), "counted/op")
		})
	}
}
