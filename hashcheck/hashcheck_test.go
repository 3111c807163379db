package hashcheck

import (
	"bytes"
	"context"
	"errors"
	"iter"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func entries(es ...Entry) iter.Seq2[Entry, error] {
	return func(yield func(Entry, error) bool) {
		for _, e := range es {
			if !yield(e, nil) {
				return
			}
		}
	}
}

func failing(err error) iter.Seq2[Entry, error] {
	return func(yield func(Entry, error) bool) { yield(Entry{}, err) }
}

// TestCompare: equal sides match; each kind of difference is named by the
// first key that differs; an error on either side is returned.
func TestCompare(t *testing.T) {
	a2, b3, b4, c5 := Entry{[]byte("a"), 2}, Entry{[]byte("b"), 3}, Entry{[]byte("b"), 4}, Entry{[]byte("c"), 5}
	for _, tc := range []struct {
		name        string
		cache, etcd iter.Seq2[Entry, error]
		diff        string // substring of FirstDiff; "" for a match
	}{
		{"equal", entries(a2, b3, c5), entries(a2, b3, c5), ""},
		{"empty", entries(), entries(), ""},
		{"mod revision", entries(a2, b3), entries(a2, b4), `key "b" has mod_revision 3 in the cache, 4 in etcd`},
		{"missing in cache", entries(a2), entries(a2, b3), `etcd has key "b"`},
		{"extra in cache", entries(a2, b3), entries(a2), `the cache has key "b"`},
		{"other key", entries(a2, c5), entries(a2, b3), `the cache has key "c" where etcd has "b"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, err := Compare(7, tc.cache, tc.etcd)
			if err != nil {
				t.Fatal(err)
			}
			if res.Match() != (tc.diff == "") || !strings.Contains(res.FirstDiff, tc.diff) {
				t.Fatalf("Compare: match %v, first difference %q; want %q", res.Match(), res.FirstDiff, tc.diff)
			}
		})
	}
	boom := errors.New("boom")
	if _, err := Compare(7, entries(a2), failing(boom)); !errors.Is(err, boom) {
		t.Fatalf("etcd side failing: %v", err)
	}
	if _, err := Compare(7, failing(boom), entries(a2)); !errors.Is(err, boom) {
		t.Fatalf("cache side failing: %v", err)
	}
}

// fakeFollower is a follower whose store is always loaded.
type fakeFollower struct {
	mu      sync.Mutex
	reloads []string
}

func (f *fakeFollower) IsReady() bool            { return true }
func (f *fakeFollower) Changed() <-chan struct{} { return make(chan struct{}) }
func (f *fakeFollower) Loads() int64             { return 1 }
func (f *fakeFollower) Reload(reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reloads = append(f.reloads, reason)
}

// fakeEtcd answers keys-only Ranges at any revision from a fixed keyspace
// in key order, as etcd answers them: the keys of [Key, RangeEnd) (a
// RangeEnd of "\x00" means no upper bound, an empty one the key alone), at
// most Limit of them, with the Count of the whole range and More if Limit
// left some out. It counts the keys it walks to count a range, as etcd's
// index does.
type fakeEtcd struct {
	pb.KVClient
	kvs []*mvccpb.KeyValue
	// block, if set, is received from before each Range is answered (or
	// the Range fails with its context).
	block   chan struct{}
	pending atomic.Int64 // Ranges not yet returned
	// failAt, if above 0, fails the failAt-th Range (from 1).
	failAt int64
	ranges atomic.Int64 // Ranges asked
	walked atomic.Int64 // keys counted to answer them
}

var errFake = errors.New("fake etcd failure")

func (e *fakeEtcd) Range(ctx context.Context, r *pb.RangeRequest, _ ...grpc.CallOption) (*pb.RangeResponse, error) {
	n := e.ranges.Add(1)
	e.pending.Add(1)
	defer e.pending.Add(-1)
	if e.block != nil {
		select {
		case <-e.block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if n == e.failAt {
		return nil, errFake
	}
	if !r.KeysOnly {
		return nil, errors.New("fake etcd answers keys-only Ranges alone")
	}
	in := func(k []byte) bool {
		switch {
		case len(r.RangeEnd) == 0:
			return bytes.Equal(k, r.Key)
		case bytes.Equal(r.RangeEnd, []byte{0}):
			return true
		}
		return bytes.Compare(k, r.RangeEnd) < 0
	}
	resp := &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: r.Revision}}
	i, _ := slices.BinarySearchFunc(e.kvs, r.Key, func(kv *mvccpb.KeyValue, k []byte) int { return bytes.Compare(kv.Key, k) })
	for ; i < len(e.kvs) && in(e.kvs[i].Key); i++ {
		resp.Count++
		if r.Limit <= 0 || int64(len(resp.Kvs)) < r.Limit {
			kv := e.kvs[i]
			resp.Kvs = append(resp.Kvs, &mvccpb.KeyValue{Key: kv.Key, CreateRevision: kv.CreateRevision, ModRevision: kv.ModRevision, Version: kv.Version, Lease: kv.Lease})
		}
	}
	e.walked.Add(resp.Count)
	resp.More = resp.Count > int64(len(resp.Kvs))
	return resp, nil
}

// TestCheckerFallsBackAndRecovers: a mismatch puts the checker in fallback
// and asks for a reload; a later passing check lifts the fallback.
func TestCheckerFallsBackAndRecovers(t *testing.T) {
	kv := func(k string, mod int64) *mvccpb.KeyValue {
		return &mvccpb.KeyValue{Key: []byte(k), Value: []byte("v"), CreateRevision: mod, ModRevision: mod, Version: 1}
	}
	store := revtree.New(0)
	store.Reset(5, []*mvccpb.KeyValue{kv("a", 2), kv("b", 5)}, 0)
	etcd := &fakeEtcd{kvs: []*mvccpb.KeyValue{kv("a", 2), kv("b", 4)}}
	f := &fakeFollower{}
	c := New(Config{Verifier: NewVerifier(store, etcd, nil), Follower: f})

	res, err := c.Check(context.Background())
	if err != nil || res.Match() || !c.Fallback() {
		t.Fatalf("check against a differing etcd: %+v, %v; fallback %v", res, err, c.Fallback())
	}
	if len(f.reloads) != 1 || f.reloads[0] != "inconsistent" {
		t.Fatalf("reloads asked: %v, want [inconsistent]", f.reloads)
	}
	etcd.kvs[1] = kv("b", 5)
	if res, err := c.Check(context.Background()); err != nil || !res.Match() || c.Fallback() {
		t.Fatalf("check against a matching etcd: %+v, %v; fallback %v", res, err, c.Fallback())
	}
}
