package integration

import (
	"context"
	"fmt"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestLargeResponses: more than grpc-go's default 4 MiB must pass through the
// proxy both ways it talks to etcd. The follower catches up after a cut in
// one watch response that batches every missed revision, and a linearizable
// full Range is forwarded to etcd whole. Both must match etcd.
func TestLargeResponses(t *testing.T) {
	c := newCluster(t, clusterOptions{relay: true})
	ctx := context.Background()
	c.relay.Cut()
	value := make([]byte, 1024)
	for txn := 0; txn < 60; txn++ { // 6000 keys x 1 KiB, written while cut
		var ops []*pb.RequestOp
		for i := 0; i < 100; i++ {
			ops = append(ops, &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{
				Key: fmt.Appendf(nil, "/large/%02d/%03d", txn, i), Value: value,
			}}})
		}
		if _, err := c.directKV.Txn(ctx, &pb.TxnRequest{Success: ops}); err != nil {
			t.Fatal(err)
		}
	}
	c.relay.Restore()
	c.waitSynced(t)
	rev := c.etcdRev(t)
	for _, req := range []*pb.RangeRequest{
		{Key: []byte("/large/"), RangeEnd: []byte("/large0")},                // linearizable: forwarded
		{Key: []byte("/large/"), RangeEnd: []byte("/large0"), Revision: rev}, // historical: from the cache
	} {
		resp, err := c.mustSameRange(t, req)
		if err != nil || len(resp.Kvs) != 6000 {
			t.Fatalf("%v: %d keys, error %v; want 6000 keys", req, len(resp.GetKvs()), err)
		}
	}
}
