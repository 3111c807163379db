package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestRangeStreamDifferential: etcd 3.7's chunked Range (which kube-apiserver
// 1.37 lists with) answered from the cache sends exactly etcd's chunks:
// the same key-values in the same chunk boundaries, with count, more and the
// header on the last chunk, and etcd's errors for unsupported options.
func TestRangeStreamDifferential(t *testing.T) { testRangeStreamDifferential(t, clusterOptions{}) }

func testRangeStreamDifferential(t *testing.T, opts clusterOptions) {
	c := newCluster(t, opts)
	ctx := context.Background()
	value := make([]byte, 8<<10) // big enough for etcd to grow and cap chunks
	for i := 0; i < 300; i++ {
		value[0] = byte(i)
		if _, err := c.direct.Put(ctx, fmt.Sprintf("/rs/%03d", i), string(value)); err != nil {
			t.Fatal(err)
		}
	}
	past := c.etcdRev(t)
	for i := 0; i < 300; i += 7 {
		if _, err := c.direct.Delete(ctx, fmt.Sprintf("/rs/%03d", i)); err != nil {
			t.Fatal(err)
		}
	}
	c.waitSynced(t)
	cacheBefore, _, _ := c.rangeSources(t)

	reqs := []*pb.RangeRequest{
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), Revision: past},
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), Revision: past, Limit: 123},
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), Revision: past, KeysOnly: true},
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), Revision: past, CountOnly: true},
		{Key: []byte("/rs/150"), RangeEnd: []byte{0}, Revision: past + 10},
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), Serializable: true},
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0")}, // linearizable: relayed
		{Key: []byte("/rs/007")},
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), Revision: past + 1000},                    // future
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), SortOrder: pb.RangeRequest_DESCEND},       // unsupported
		{Key: []byte("/rs/"), RangeEnd: []byte("/rs0"), Revision: past, MinModRevision: past - 5}, // unsupported
		{RangeEnd: []byte("/rs0")}, // empty key
	}
	for _, req := range reqs {
		want, werr := collectStream(ctx, c.directKV, req)
		got, gerr := collectStream(ctx, c.proxyKV, req)
		if diff := sameOutcome(req, &pb.RangeStreamResponse{}, werr, &pb.RangeStreamResponse{}, gerr); werr != nil || gerr != nil {
			if diff != "" {
				t.Fatal(diff)
			}
			continue
		}
		if len(want) != len(got) {
			t.Fatalf("%v: etcd sent %d chunks, the proxy %d", req, len(want), len(got))
		}
		for i := range want {
			if diff := sameOutcome(req, want[i], nil, got[i], nil); diff != "" {
				t.Fatalf("chunk %d of %d: %s", i, len(want), diff)
			}
		}
	}
	if cacheAfter, _, _ := c.rangeSources(t); cacheAfter-cacheBefore < 6 {
		t.Fatalf("only %v RangeStreams were served from the cache, want at least 6", cacheAfter-cacheBefore)
	}
}

// collectStream reads a whole RangeStream.
func collectStream(ctx context.Context, kv pb.KVClient, req *pb.RangeRequest) ([]*pb.RangeStreamResponse, error) {
	stream, err := kv.RangeStream(ctx, req)
	if err != nil {
		return nil, err
	}
	var out []*pb.RangeStreamResponse
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, resp)
	}
}
