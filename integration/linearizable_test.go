package integration

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

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
