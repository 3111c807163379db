// Package kvcheck is etcd's validation of KV requests, as etcd's v3rpc
// handlers run it (api/v3rpc/key.go) before anything else: a Range
// (Range), and a Put, DeleteRange or Txn (Write). kvproxy validates the
// reads it serves with it, and gate the writes it checks before sending
// them to etcd as the proxy, so that either answers etcd's validation
// error first, as etcd would.
package kvcheck

import (
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// Range is etcd's validation of a Range: the first thing its handler does,
// after the interceptor's leader check.
func Range(r *pb.RangeRequest) error {
	if len(r.Key) == 0 {
		return rpctypes.ErrGRPCEmptyKey
	}
	if _, ok := pb.RangeRequest_SortOrder_name[int32(r.SortOrder)]; !ok {
		return rpctypes.ErrGRPCInvalidSortOption
	}
	if _, ok := pb.RangeRequest_SortTarget_name[int32(r.SortTarget)]; !ok {
		return rpctypes.ErrGRPCInvalidSortOption
	}
	return nil
}

// Write is etcd's validation of a Put, DeleteRange or Txn, which comes
// before its permission checks; nil for any other request. Two checks are
// left to etcd, which knows its own limits: a Txn's operation count
// (--max-txn-ops) and overlapping writes in one Txn.
func Write(req any) error {
	switch r := req.(type) {
	case *pb.PutRequest:
		return put(r)
	case *pb.DeleteRangeRequest:
		return deleteRange(r)
	case *pb.TxnRequest:
		return txn(r)
	}
	return nil
}

func put(r *pb.PutRequest) error {
	switch {
	case len(r.Key) == 0:
		return rpctypes.ErrGRPCEmptyKey
	case r.IgnoreValue && len(r.Value) != 0:
		return rpctypes.ErrGRPCValueProvided
	case r.IgnoreLease && r.Lease != 0:
		return rpctypes.ErrGRPCLeaseProvided
	}
	return nil
}

func deleteRange(r *pb.DeleteRangeRequest) error {
	if len(r.Key) == 0 {
		return rpctypes.ErrGRPCEmptyKey
	}
	return nil
}

func txn(r *pb.TxnRequest) error {
	for _, c := range r.Compare {
		if len(c.Key) == 0 {
			return rpctypes.ErrGRPCEmptyKey
		}
	}
	for _, ops := range [][]*pb.RequestOp{r.Success, r.Failure} {
		for _, op := range ops {
			if err := requestOp(op); err != nil {
				return err
			}
		}
	}
	return nil
}

func requestOp(op *pb.RequestOp) error {
	switch o := op.Request.(type) {
	case *pb.RequestOp_RequestRange:
		return Range(o.RequestRange)
	case *pb.RequestOp_RequestPut:
		return put(o.RequestPut)
	case *pb.RequestOp_RequestDeleteRange:
		return deleteRange(o.RequestDeleteRange)
	case *pb.RequestOp_RequestTxn:
		return txn(o.RequestTxn)
	}
	return rpctypes.ErrGRPCKeyNotFound // an empty operation, as etcd answers it
}
