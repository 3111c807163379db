package integration

// Bad and extreme input gets exactly etcd's answer (same gRPC code and
// message) through the proxy, and leaves the proxy serving.

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

func txnPut(key, value string) *pb.RequestOp {
	return &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: []byte(key), Value: []byte(value)}}}
}

func txnGet(key string) *pb.RequestOp {
	return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte(key)}}}
}

func TestBadInput(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx := context.Background()
	for i := range 6 {
		if _, err := c.direct.Put(ctx, fmt.Sprintf("bad/%d", i), "v"); err != nil {
			t.Fatal(err)
		}
	}
	c.waitSynced(t)
	head := c.etcdRev(t)

	ranges := []struct {
		name    string
		req     *pb.RangeRequest
		wantErr error // etcd's own answer, to keep the case honest; nil: success
	}{
		{"empty key", &pb.RangeRequest{}, rpctypes.ErrGRPCEmptyKey},
		{"empty key with range end", &pb.RangeRequest{RangeEnd: []byte("z")}, rpctypes.ErrGRPCEmptyKey},
		{"empty key serializable historical", &pb.RangeRequest{Revision: head, Serializable: true}, rpctypes.ErrGRPCEmptyKey},
		{"inverted range", &pb.RangeRequest{Key: []byte("bad/5"), RangeEnd: []byte("bad/1")}, nil},
		{"inverted range historical", &pb.RangeRequest{Key: []byte("bad/5"), RangeEnd: []byte("bad/1"), Revision: head}, nil},
		{"key equals range end", &pb.RangeRequest{Key: []byte("bad/1"), RangeEnd: []byte("bad/1"), Revision: head}, nil},
		{"negative limit", &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Limit: -1, Revision: head}, nil},
		{"most negative limit", &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Limit: math.MinInt64, Revision: head}, nil},
		{"largest limit", &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Limit: math.MaxInt64, Revision: head}, nil},
		{"unknown sort order", &pb.RangeRequest{Key: []byte("bad/"), SortOrder: 99}, rpctypes.ErrGRPCInvalidSortOption},
		{"negative sort order", &pb.RangeRequest{Key: []byte("bad/"), SortOrder: -1, Revision: head}, rpctypes.ErrGRPCInvalidSortOption},
		{"unknown sort target", &pb.RangeRequest{Key: []byte("bad/"), SortTarget: 99, Revision: head}, rpctypes.ErrGRPCInvalidSortOption},
		{"unknown sort target and order", &pb.RangeRequest{Key: []byte("bad/"), SortTarget: 99, SortOrder: 99, Serializable: true}, rpctypes.ErrGRPCInvalidSortOption},
		{"empty key and unknown sort", &pb.RangeRequest{SortTarget: 99}, rpctypes.ErrGRPCEmptyKey},
		{"far future revision", &pb.RangeRequest{Key: []byte("bad/1"), Revision: 1 << 62}, rpctypes.ErrGRPCFutureRev},
		{"far future revision serializable", &pb.RangeRequest{Key: []byte("bad/1"), Revision: 1 << 62, Serializable: true}, rpctypes.ErrGRPCFutureRev},
		{"largest revision", &pb.RangeRequest{Key: []byte("bad/1"), Revision: math.MaxInt64}, rpctypes.ErrGRPCFutureRev},
		{"next revision", &pb.RangeRequest{Key: []byte("bad/1"), Revision: head + 1}, rpctypes.ErrGRPCFutureRev},
		{"negative revision", &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Revision: -1}, nil},
		{"negative revision serializable", &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Revision: -1, Serializable: true}, nil},
		{"most negative revision", &pb.RangeRequest{Key: []byte("bad/1"), Revision: math.MinInt64}, nil},
		{"negative filters", &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Revision: head, MinModRevision: -5, MaxCreateRevision: -1}, nil},
		{"count and keys only", &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Revision: head, CountOnly: true, KeysOnly: true, Limit: 1}, nil},
		{"1.8 MiB key", &pb.RangeRequest{Key: bytes.Repeat([]byte("k"), 1800<<10), Revision: head}, nil},
	}
	for _, tc := range ranges {
		t.Run("Range/"+tc.name, func(t *testing.T) {
			_, err := c.mustSameRange(t, tc.req)
			if (tc.wantErr == nil) != (err == nil) || (err != nil && !isErr(err, tc.wantErr)) {
				t.Fatalf("etcd answered %v, want %v", err, tc.wantErr)
			}
		})
	}

	// Writes etcd refuses: forwarded, so the refusal is etcd's own.
	tooMany := &pb.TxnRequest{}
	for i := range 129 {
		tooMany.Success = append(tooMany.Success, txnPut(fmt.Sprintf("bad/many/%d", i), "v"))
	}
	writes := []struct {
		name    string
		call    func(kv pb.KVClient) (proto.Message, error)
		wantErr error
	}{
		{"Put empty key", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Put(ctx, &pb.PutRequest{Value: []byte("v")})
		}, rpctypes.ErrGRPCEmptyKey},
		{"Put ignore_value with a value", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Put(ctx, &pb.PutRequest{Key: []byte("bad/1"), Value: []byte("v"), IgnoreValue: true})
		}, rpctypes.ErrGRPCValueProvided},
		{"Put ignore_lease with a lease", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Put(ctx, &pb.PutRequest{Key: []byte("bad/1"), Lease: 7, IgnoreLease: true})
		}, rpctypes.ErrGRPCLeaseProvided},
		{"Put ignore_value of an absent key", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Put(ctx, &pb.PutRequest{Key: []byte("bad/absent"), IgnoreValue: true})
		}, rpctypes.ErrGRPCKeyNotFound},
		{"Put with an unknown lease", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Put(ctx, &pb.PutRequest{Key: []byte("bad/1"), Value: []byte("v"), Lease: 0x1234})
		}, rpctypes.ErrGRPCLeaseNotFound},
		{"Put 1.8 MiB value", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Put(ctx, &pb.PutRequest{Key: []byte("bad/big"), Value: bytes.Repeat([]byte("v"), 1800<<10)})
		}, rpctypes.ErrGRPCRequestTooLarge},
		{"DeleteRange empty key", func(kv pb.KVClient) (proto.Message, error) {
			return kv.DeleteRange(ctx, &pb.DeleteRangeRequest{RangeEnd: []byte("z")})
		}, rpctypes.ErrGRPCEmptyKey},
		{"Txn too many ops", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Txn(ctx, tooMany)
		}, rpctypes.ErrGRPCTooManyOps},
		{"Txn duplicate keys", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Txn(ctx, &pb.TxnRequest{Success: []*pb.RequestOp{txnPut("bad/dup", "1"), txnPut("bad/dup", "2")}})
		}, rpctypes.ErrGRPCDuplicateKey},
		{"Txn put inside a deleted range", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Txn(ctx, &pb.TxnRequest{Success: []*pb.RequestOp{txnPut("bad/3", "1"), {Request: &pb.RequestOp_RequestDeleteRange{
				RequestDeleteRange: &pb.DeleteRangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0")}}}}})
		}, rpctypes.ErrGRPCDuplicateKey},
		{"Txn compare with empty key", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Txn(ctx, &pb.TxnRequest{Compare: []*pb.Compare{{Target: pb.Compare_VERSION}}, Success: []*pb.RequestOp{txnGet("bad/1")}})
		}, rpctypes.ErrGRPCEmptyKey},
		{"Txn range with an unknown sort", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Txn(ctx, &pb.TxnRequest{Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte("bad/1"), SortTarget: 99}}}}})
		}, rpctypes.ErrGRPCInvalidSortOption},
		{"Txn range at a future revision", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Txn(ctx, &pb.TxnRequest{Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte("bad/1"), Revision: 1 << 62}}}}})
		}, rpctypes.ErrGRPCFutureRev},
		{"Compact far future", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Compact(ctx, &pb.CompactionRequest{Revision: 1 << 62})
		}, rpctypes.ErrGRPCFutureRev},
		{"Compact negative", func(kv pb.KVClient) (proto.Message, error) {
			return kv.Compact(ctx, &pb.CompactionRequest{Revision: -5})
		}, rpctypes.ErrGRPCCompacted},
	}
	for _, tc := range writes {
		t.Run(tc.name, func(t *testing.T) {
			dResp, dErr := tc.call(c.directKV)
			pResp, pErr := tc.call(c.proxyKV)
			if diff := sameOutcome(nil, dResp, dErr, pResp, pErr); diff != "" {
				t.Fatalf("%s: %s", tc.name, diff)
			}
			if !isErr(dErr, tc.wantErr) {
				t.Fatalf("etcd answered %v, want %v", dErr, tc.wantErr)
			}
		})
	}

	// Over the 2 MiB gRPC limit (etcd's --max-request-bytes 1.5 MiB plus
	// 512 KiB): refused by the gRPC server itself, before any handler. The
	// Go client would refuse to send it, so plain gRPC connections are used.
	t.Run("over the gRPC limit", func(t *testing.T) {
		dkv := pb.NewKVClient(rawConn(t, c.etcdAddr))
		pkv := pb.NewKVClient(rawConn(t, c.proxyAddr))
		huge := bytes.Repeat([]byte("h"), 2500<<10)
		for _, req := range []proto.Message{
			&pb.RangeRequest{Key: huge},
			&pb.RangeRequest{Key: []byte("a"), RangeEnd: huge, Revision: head},
			&pb.PutRequest{Key: []byte("bad/huge"), Value: huge},
		} {
			var dResp, pResp proto.Message
			var dErr, pErr error
			switch r := req.(type) {
			case *pb.RangeRequest:
				dResp, dErr = dkv.Range(ctx, r)
				pResp, pErr = pkv.Range(ctx, r)
			case *pb.PutRequest:
				dResp, dErr = dkv.Put(ctx, r)
				pResp, pErr = pkv.Put(ctx, r)
			}
			if status.Code(dErr) != codes.ResourceExhausted {
				t.Fatalf("etcd answered an oversized request with %v", dErr)
			}
			if diff := sameOutcome(nil, dResp, dErr, pResp, pErr); diff != "" {
				t.Fatal(diff)
			}
		}
	})

	// The proxy still serves, from the cache and through to etcd.
	put, err := c.viaProxy.Put(ctx, "bad/after", "ok")
	if err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	cache0, _, _ := c.rangeSources(t)
	if _, err := c.mustSameRange(t, &pb.RangeRequest{Key: []byte("bad/"), RangeEnd: []byte("bad0"), Revision: put.Header.Revision}); err != nil {
		t.Fatal(err)
	}
	if cache1, _, _ := c.rangeSources(t); cache1 != cache0+1 {
		t.Fatal("the proxy no longer serves historical reads from the cache")
	}
	if c.etcdRev(t) != put.Header.Revision {
		t.Fatal("a refused write changed etcd")
	}
}

// TestNegativeRevisionLinearizable: etcd treats a Range with a negative
// revision as one at the current revision (mvcc rangeKeys: rev <= 0), and
// without serializable it is linearizable (v3_server.go Range). The proxy
// must not answer it from a cache that may be behind etcd: here the cache
// is cut off from etcd after a write it has not seen.
func TestNegativeRevisionLinearizable(t *testing.T) {
	c := newCluster(t, clusterOptions{relay: true})
	ctx := context.Background()
	if _, err := c.direct.Put(ctx, "neg", "old"); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	c.cut(t)
	if _, err := c.direct.Put(ctx, "neg", "new"); err != nil {
		t.Fatal(err)
	}
	for _, rev := range []int64{0, -1} {
		req := &pb.RangeRequest{Key: []byte("neg"), Revision: rev}
		want, err := c.directKV.Range(ctx, req)
		if err != nil || len(want.Kvs) != 1 || string(want.Kvs[0].Value) != "new" {
			t.Fatalf("etcd: %v %v", want, err)
		}
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		got, err := c.proxyKV.Range(rctx, req)
		cancel()
		// While the proxy cannot reach etcd, failing is right; answering
		// is right only with etcd's current value.
		if err == nil && (len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "new") {
			t.Errorf("linearizable Range at revision %d through the proxy returned stale %s (header revision %d); etcd has %q at revision %d",
				rev, fmtMsg(got), got.Header.Revision, want.Kvs[0].Value, want.Header.Revision)
		}
	}
	c.relay.Restore()
}
