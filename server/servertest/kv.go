package servertest

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// ListPages reads [key, end) at rev the way kube-apiserver paginates a
// LIST: pages of limit key-values, each starting just after the previous
// page's last key, until More is false. It returns the number of keys
// read.
func ListPages(ctx context.Context, kv pb.KVClient, key, end []byte, limit, rev int64) (int, error) {
	n := 0
	for {
		resp, err := kv.Range(ctx, &pb.RangeRequest{Key: key, RangeEnd: end, Limit: limit, Revision: rev})
		if err != nil {
			return n, err
		}
		n += len(resp.Kvs)
		if !resp.More {
			return n, nil
		}
		if len(resp.Kvs) == 0 {
			return n, fmt.Errorf("page with More but no keys after %q", key)
		}
		key = append(bytes.Clone(resp.Kvs[len(resp.Kvs)-1].Key), 0)
	}
}

// PutConcurrently sends the puts request(0) .. request(n-1) with workers
// concurrent workers, one revision each, and returns the highest revision
// written, or the first error (after every put was tried).
func PutConcurrently(kv pb.KVClient, n, workers int, request func(i int) *pb.PutRequest) (int64, error) {
	var mu sync.Mutex
	var head int64
	var firstErr error
	var wg sync.WaitGroup
	next := make(chan int, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				r, err := kv.Put(context.Background(), request(i))
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				if err == nil {
					head = max(head, r.Header.Revision)
				}
				mu.Unlock()
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return head, firstErr
}

// PutAndWait puts a, b and c straight to etcd (direct) and waits until
// p's cache has applied them; it returns the last put's revision.
func PutAndWait(ctx context.Context, tb testing.TB, direct *clientv3.Client, p *server.Server) int64 {
	tb.Helper()
	var last int64
	for _, k := range []string{"a", "b", "c"} {
		resp, err := direct.Put(ctx, k, "v")
		if err != nil {
			tb.Fatal(err)
		}
		last = resp.Header.Revision
	}
	testsupport.WaitFor(tb, ReadyTimeout, "the cache at etcd's revision", func() bool { return p.Store().Rev() >= last })
	return last
}

// ReadAndWatch makes, through the proxy (viaProxy), what the proxy counts
// as served from its cache: a serializable read of a at the head and at
// last-1 (PutAndWait's last put), and a watch of w, open until ctx ends.
func ReadAndWatch(ctx context.Context, tb testing.TB, viaProxy *clientv3.Client, last int64) {
	tb.Helper()
	if _, err := viaProxy.Get(ctx, "a", clientv3.WithSerializable()); err != nil {
		tb.Fatal(err)
	}
	if _, err := viaProxy.Get(ctx, "a", clientv3.WithRev(last-1), clientv3.WithSerializable()); err != nil {
		tb.Fatal(err)
	}
	if resp := <-viaProxy.Watch(ctx, "w", clientv3.WithCreatedNotify()); !resp.Created {
		tb.Fatalf("watch through the proxy: %+v", resp)
	}
}
