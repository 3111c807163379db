package servertest

import (
	"bytes"
	"context"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
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
