package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// TestNoStaleLinearizableRead: writes go straight to etcd and are read back
// at once through the proxy, thousands of times from concurrent clients. A
// linearizable read must reflect every write acknowledged before it began,
// by any client: its header revision is at least the highest acknowledged
// revision, and it sees its own write. And the reads come from the cache.
func TestNoStaleLinearizableRead(t *testing.T) { testNoStaleLinearizableRead(t, clusterOptions{}) }

func testNoStaleLinearizableRead(t *testing.T, opts clusterOptions) {
	c := newCluster(t, opts)
	const clients, rounds = 8, 250
	var acked atomic.Int64 // highest revision etcd acknowledged to anyone
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	cache0, _, _ := c.rangeSources(t)
	for w := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			key := []byte(fmt.Sprintf("/stale/%d", w))
			for i := range rounds {
				value := []byte(fmt.Sprint(i))
				put, err := c.directKV.Put(ctx, &pb.PutRequest{Key: key, Value: value})
				if err != nil {
					errs <- err
					return
				}
				for {
					cur := acked.Load()
					if put.Header.Revision <= cur || acked.CompareAndSwap(cur, put.Header.Revision) {
						break
					}
				}
				floor := acked.Load() // acknowledged before the read begins
				got, err := c.proxyKV.Range(ctx, &pb.RangeRequest{Key: key})
				if err != nil {
					errs <- err
					return
				}
				if got.Header.Revision < floor {
					errs <- fmt.Errorf("client %d round %d: read at header revision %d after revision %d was acknowledged", w, i, got.Header.Revision, floor)
					return
				}
				if len(got.Kvs) != 1 || string(got.Kvs[0].Value) != string(value) || got.Kvs[0].ModRevision != put.Header.Revision {
					errs <- fmt.Errorf("client %d round %d: read %v after writing %q at %d", w, i, got.Kvs, value, put.Header.Revision)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	cache1, _, _ := c.rangeSources(t)
	if served := cache1 - cache0; served < clients*rounds*9/10 {
		t.Fatalf("only %v of %d linearizable reads were served from the cache", served, clients*rounds)
	}
}

// TestFreshnessTimeout: when freshness cannot be proven in time, a
// linearizable read goes to etcd and is counted; with
// --consistent-read-fallback=fail it fails
// with Unavailable instead. A nanosecond timeout makes every proof late.
func TestFreshnessTimeout(t *testing.T) {
	for _, fail := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail=%v", fail), func(t *testing.T) {
			c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) {
				cfg.FreshnessTimeout = time.Nanosecond
				if fail {
					cfg.ConsistentReadFallback = kvproxy.FallbackFail
				}
			}})
			if _, err := c.direct.Put(context.Background(), "k", "v"); err != nil {
				t.Fatal(err)
			}
			_, fwd0, rej0 := c.rangeSources(t)
			resp, err := c.proxyKV.Range(context.Background(), &pb.RangeRequest{Key: []byte("k")})
			_, fwd1, rej1 := c.rangeSources(t)
			if fail {
				if status.Code(err) != codes.Unavailable || rej1-rej0 != 1 {
					t.Fatalf("unproven read: %v (refused %v); want Unavailable", err, rej1-rej0)
				}
				return
			}
			if err != nil || len(resp.Kvs) != 1 || fwd1-fwd0 != 1 {
				t.Fatalf("unproven read: %v, %v (forwarded %v); want etcd's answer", resp, err, fwd1-fwd0)
			}
			// Serializable reads do not need the proof.
			if _, err := c.proxyKV.Range(context.Background(), &pb.RangeRequest{Key: []byte("k"), Serializable: true}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestLinearizableReadWhileTheWatchLags: the member the proxy's upstream
// watch runs on falls behind (its connection stalls, as a congested path
// or a defragmented member leaves a watch), while another member answers.
// A linearizable read then goes to etcd once the store has not caught up
// with the head for the fence's patience, avoiding the lagging member, and
// gets etcd's latest value: it neither waits for the watch to move nor
// reads the stale cache. The proxy reaches one etcd through two relays,
// two members to the proxy.
func TestLinearizableReadWhileTheWatchLags(t *testing.T) {
	var relays []*testsupport.Relay
	c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) {
		target := strings.TrimPrefix(cfg.Endpoints[0], "http://")
		relays = []*testsupport.Relay{testsupport.NewRelay(t, target), testsupport.NewRelay(t, target)}
		cfg.Endpoints = []string{"http://" + relays[0].Addr(), "http://" + relays[1].Addr()}
	}})
	if _, err := c.direct.Put(context.Background(), "lag/k", "v1"); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	member := c.proxy.Follower().WatchMember()
	i := slices.IndexFunc(relays, func(r *testsupport.Relay) bool { return strings.HasSuffix(member, r.Addr()) })
	if i < 0 {
		t.Fatalf("the upstream watch runs on %q, neither relay", member)
	}
	relays[i].Stall()
	defer relays[i].Flow()
	put, err := c.direct.Put(context.Background(), "lag/k", "v2")
	if err != nil {
		t.Fatal(err)
	}

	before := rangeCounts(t, c.proxy)
	resp, err := c.proxyKV.Range(context.Background(), &pb.RangeRequest{Key: []byte("lag/k")})
	after := rangeCounts(t, c.proxy)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v2" || resp.Header.Revision < put.Header.Revision {
		t.Fatalf("linearizable read while the watch lags: %v; want v2 at revision %d or later", resp, put.Header.Revision)
	}
	if c.proxy.Store().Rev() >= put.Header.Revision {
		t.Fatalf("the store reached revision %d through a stalled watch", put.Header.Revision)
	}
	if d := after["forwarded/fresh_lagging"] - before["forwarded/fresh_lagging"]; d != 1 {
		t.Fatalf("reads forwarded as lagging: %v, want 1; by source and reason, before %v, after %v", d, before, after)
	}
}
