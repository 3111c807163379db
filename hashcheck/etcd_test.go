package hashcheck_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	clientv3 "go.etcd.io/etcd/client/v3"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// readyFollower is a follower whose store is always loaded.
type readyFollower struct{}

func (readyFollower) IsReady() bool            { return true }
func (readyFollower) Changed() <-chan struct{} { return make(chan struct{}) }
func (readyFollower) Loads() int64             { return 1 }
func (readyFollower) Reload(string)            {}

// TestBoundedWalkAgainstEtcd: against a real etcd, reading in chunks cut
// at the cache's keys gives the Result of reading in pages to the end of
// the keyspace, for caches that match etcd at the revision and caches that
// differ from it in every way, with chunks of every size; and a Verifier
// reading in chunks tells them apart, also while the store is restored
// (SameHistoryAhead).
func TestBoundedWalkAgainstEtcd(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{UnsafeNoFsync: true})
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{server.EmbeddedEndpoint(e)}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	kv := pb.NewKVClient(cli.ActiveConnection())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	put := func(k string) {
		t.Helper()
		if _, err := kv.Put(ctx, &pb.PutRequest{Key: []byte(k), Value: []byte("v")}); err != nil {
			t.Fatal(err)
		}
	}
	keys := []string{"\x00", "\x00\x01", "a", "\xff", "\xff\xff"}
	for i := range 30 {
		keys = append(keys, fmt.Sprintf("k%02d", i))
	}
	for _, k := range keys {
		put(k)
	}
	put("k07") // a mod revision above its create revision
	if _, err := kv.DeleteRange(ctx, &pb.DeleteRangeRequest{Key: []byte("k15")}); err != nil {
		t.Fatal(err)
	}
	all, err := kv.Range(ctx, &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}})
	if err != nil {
		t.Fatal(err)
	}
	rev, etcdKVs := all.Header.Revision, all.Kvs
	// Writes past rev, which no walk at rev may see.
	put("k08")
	put("k15")
	put("k99")

	without := func(drop ...string) []*mvccpb.KeyValue {
		return slices.DeleteFunc(slices.Clone(etcdKVs), func(kv *mvccpb.KeyValue) bool { return slices.Contains(drop, string(kv.Key)) })
	}
	with := func(extra ...string) []*mvccpb.KeyValue {
		kvs := slices.Clone(etcdKVs)
		for _, k := range extra {
			kvs = append(kvs, &mvccpb.KeyValue{Key: []byte(k), Value: []byte("v"), CreateRevision: 2, ModRevision: 2, Version: 1})
		}
		slices.SortFunc(kvs, func(a, b *mvccpb.KeyValue) int { return bytes.Compare(a.Key, b.Key) })
		return kvs
	}
	modified := func(key string) []*mvccpb.KeyValue {
		kvs := slices.Clone(etcdKVs)
		for i, kv := range kvs {
			if string(kv.Key) == key {
				kvs[i] = &mvccpb.KeyValue{Key: kv.Key, Value: kv.Value, CreateRevision: kv.CreateRevision, ModRevision: kv.ModRevision - 1, Version: kv.Version}
			}
		}
		return kvs
	}
	storeOf := func(kvs []*mvccpb.KeyValue) *revtree.Store {
		s := revtree.New(0)
		s.Reset(rev, kvs, 0)
		return s
	}
	for _, tc := range []struct {
		name  string
		cache []*mvccpb.KeyValue
		match bool
	}{
		{"identical", etcdKVs, true},
		{"empty", nil, false},
		{"first keys only", etcdKVs[:2], false},
		{"without the first key", without("\x00"), false},
		{"without keys", without("k03", "k04", "\xff\xff"), false},
		{"with keys", with("\x00\x00", "k07a", "k15", "z"), false},
		{"a mod revision", modified("k07"), false},
		{"another mod revision", modified("\xff\xff"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, err := storeOf(tc.cache).View(rev)
			if err != nil {
				t.Fatal(err)
			}
			for _, page := range []int{1, 2, 3, 7, 10000} {
				want, err := hashcheck.Compare(rev, hashcheck.CacheEntries(v), hashcheck.UnboundedEntries(ctx, kv, rev, page))
				if err != nil {
					t.Fatal(err)
				}
				got, err := hashcheck.Compare(rev, hashcheck.CacheEntries(v), hashcheck.BoundedEntries(ctx, kv, v, rev, page))
				if err != nil {
					t.Fatal(err)
				}
				if got != want {
					t.Fatalf("page %d: bounded walk %+v, unbounded %+v", page, got, want)
				}
				if got.Match() != tc.match {
					t.Fatalf("page %d: match %v (%q), want %v", page, got.Match(), got.FirstDiff, tc.match)
				}
				v := hashcheck.NewVerifier(storeOf(tc.cache), kv, nil)
				v.SetPageSize(page)
				if same, err := v.SameHistory(ctx, rev); err != nil || same != tc.match {
					t.Fatalf("page %d: SameHistory %v, %v; want %v", page, same, err, tc.match)
				}
				// A store still being restored, its etcd keys read in
				// chunks cut at a copy's keys: every page-th key of the
				// cache, and keys of neither side.
				var bounds [][]byte
				for i, kv := range tc.cache {
					if i%page == 0 {
						bounds = append(bounds, kv.Key)
					}
				}
				bounds = append(bounds, []byte("k07a"), []byte("k15"))
				slices.SortFunc(bounds, bytes.Compare)
				bounds = slices.CompactFunc(bounds, bytes.Equal)
				restoring := revtree.New(0)
				v = hashcheck.NewVerifier(restoring, kv, nil)
				v.SetPageSize(page)
				same, err := v.SameHistoryAhead(ctx, rev, bounds, func() error {
					restoring.Reset(rev, tc.cache, 0)
					return nil
				})
				if err != nil || same != tc.match {
					t.Fatalf("page %d: SameHistoryAhead %v, %v; want %v", page, same, err, tc.match)
				}
			}
		})
	}

	// A cache ahead of etcd's head: etcd's error comes through the chunks'
	// reader, and Check counts it as a mismatch.
	head, err := kv.Range(ctx, &pb.RangeRequest{Key: []byte{0}, CountOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	ahead := revtree.New(0)
	ahead.Reset(head.Header.Revision+50, etcdKVs, 0)
	v := hashcheck.NewVerifier(ahead, kv, nil)
	v.SetPageSize(3)
	c := hashcheck.New(hashcheck.Config{Verifier: v, Follower: readyFollower{}})
	res, err := c.Check(ctx)
	if err != nil || res.Match() || !strings.Contains(res.FirstDiff, "etcd's head is below the cache's revision") {
		t.Fatalf("Check of a cache ahead of etcd: %+v, %v", res, err)
	}
}

// TestSameHistoryAheadRestoreFails: a restore that fails is the answer,
// and the read of etcd's keys under way is stopped (goleak checks).
func TestSameHistoryAheadRestoreFails(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{UnsafeNoFsync: true})
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{server.EmbeddedEndpoint(e)}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	kv := pb.NewKVClient(cli.ActiveConnection())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resp, err := kv.Put(ctx, &pb.PutRequest{Key: []byte("a"), Value: []byte("v")})
	if err != nil {
		t.Fatal(err)
	}
	v := hashcheck.NewVerifier(revtree.New(0), kv, nil)
	damaged := errors.New("damaged")
	if _, err := v.SameHistoryAhead(ctx, resp.Header.Revision, [][]byte{[]byte("a")}, func() error { return damaged }); !errors.Is(err, damaged) {
		t.Fatalf("SameHistoryAhead with a failed restore: %v, want %v", err, damaged)
	}
}
