package integration

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestLargeResponses: more than grpc-go's default 4 MiB must pass through the
// proxy both ways it talks to etcd. The follower catches up after a cut in
// one watch response that batches every missed revision, and a linearizable
// full Range is forwarded to etcd whole. Both must match etcd; and a
// historical one, sent from the cache in pieces of its stored bytes, must
// be on the wire byte for byte what proto.Marshal gives for etcd's
// answer, before and after some keys are rewritten (entries beside the
// loaded encodings, small ones copied, large ones pieces of their own).
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
	c.mustSameWire(t, &pb.RangeRequest{Key: []byte("/large/"), RangeEnd: []byte("/large0"), Revision: rev})
	for i := 0; i < 6000; i += 7 {
		v := bytes.Repeat([]byte{byte(i)}, i%2000) // small ones copied, larger ones pieces, some empty
		if _, err := c.directKV.Put(ctx, &pb.PutRequest{Key: fmt.Appendf(nil, "/large/%02d/%03d", i/100, i%100), Value: v}); err != nil {
			t.Fatal(err)
		}
	}
	c.waitSynced(t)
	c.mustSameWire(t, &pb.RangeRequest{Key: []byte("/large/"), RangeEnd: []byte("/large0"), Revision: c.etcdRev(t)})
	c.mustSameWire(t, &pb.RangeRequest{Key: []byte("/large/"), RangeEnd: []byte("/large0"), Revision: rev, Limit: 500})
}

// mustSameWire fails the test unless the proxy's answer to req, as it is
// on the wire, is the bytes proto.Marshal gives for etcd's answer.
func (c *cluster) mustSameWire(tb testing.TB, req *pb.RangeRequest) {
	tb.Helper()
	want, err := c.mustSameRange(tb, req)
	if err != nil {
		tb.Fatal(err)
	}
	wantBytes, err := proto.Marshal(want)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	var got rawMessage
	if err := c.viaProxy.ActiveConnection().Invoke(ctx, pb.KV_Range_FullMethodName, req, &got, grpc.ForceCodecV2(rawCodec{})); err != nil {
		tb.Fatal(err)
	}
	if !bytes.Equal(got, wantBytes) {
		tb.Fatalf("%v: the proxy sent %d bytes, unlike proto.Marshal's %d of etcd's answer", req, len(got), len(wantBytes))
	}
}

// rawMessage is a response as it is on the wire.
type rawMessage []byte

// rawCodec marshals requests as protobuf and keeps responses' bytes
// (rawMessage) as they are.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return encoding.GetCodecV2(grpcproto.Name).Marshal(v)
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*rawMessage) = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return grpcproto.Name }
