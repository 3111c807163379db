package proxytest

import (
	"bytes"
	"context"
	"fmt"

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
