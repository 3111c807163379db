package kvcheck

import (
	"errors"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// TestWrite: each of etcd's validation errors of a write, nested Txn
// operations included, and none for a valid write or another request.
func TestWrite(t *testing.T) {
	op := func(r any) *pb.RequestOp {
		switch r := r.(type) {
		case *pb.RangeRequest:
			return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: r}}
		case *pb.PutRequest:
			return &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: r}}
		case *pb.TxnRequest:
			return &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: r}}
		}
		return &pb.RequestOp{}
	}
	k := []byte("k")
	for _, tc := range []struct {
		name string
		req  any
		want error
	}{
		{"put", &pb.PutRequest{Key: k}, nil},
		{"put without key", &pb.PutRequest{}, rpctypes.ErrGRPCEmptyKey},
		{"put ignoring a value given", &pb.PutRequest{Key: k, IgnoreValue: true, Value: k}, rpctypes.ErrGRPCValueProvided},
		{"put ignoring a lease given", &pb.PutRequest{Key: k, IgnoreLease: true, Lease: 1}, rpctypes.ErrGRPCLeaseProvided},
		{"delete without key", &pb.DeleteRangeRequest{}, rpctypes.ErrGRPCEmptyKey},
		{"txn compare without key", &pb.TxnRequest{Compare: []*pb.Compare{{}}}, rpctypes.ErrGRPCEmptyKey},
		{"txn range with a bad sort", &pb.TxnRequest{Success: []*pb.RequestOp{op(&pb.RangeRequest{Key: k, SortOrder: 9})}}, rpctypes.ErrGRPCInvalidSortOption},
		{"nested txn put without key", &pb.TxnRequest{Failure: []*pb.RequestOp{op(&pb.TxnRequest{Success: []*pb.RequestOp{op(&pb.PutRequest{})}})}}, rpctypes.ErrGRPCEmptyKey},
		{"txn empty operation", &pb.TxnRequest{Success: []*pb.RequestOp{op(nil)}}, rpctypes.ErrGRPCKeyNotFound},
		{"not a write", &pb.RangeRequest{}, nil},
	} {
		if err := Write(tc.req); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}
