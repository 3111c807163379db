package kvproxy

import (
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// ValidateWrite is etcd's validation of a Put, DeleteRange or Txn
// (api/v3rpc/key.go), which comes before its permission checks: a request
// checked here before it is forwarded gets etcd's validation error first.
// Two checks are left to etcd, which knows its own limits: a Txn's
// operation count (--max-txn-ops) and overlapping writes in one Txn.
func ValidateWrite(req any) error {
	switch r := req.(type) {
	case *pb.PutRequest:
		return checkPutRequest(r)
	case *pb.DeleteRangeRequest:
		return checkDeleteRequest(r)
	case *pb.TxnRequest:
		return checkTxnRequest(r)
	}
	return nil
}

func checkPutRequest(r *pb.PutRequest) error {
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

func checkDeleteRequest(r *pb.DeleteRangeRequest) error {
	if len(r.Key) == 0 {
		return rpctypes.ErrGRPCEmptyKey
	}
	return nil
}

func checkTxnRequest(r *pb.TxnRequest) error {
	for _, c := range r.Compare {
		if len(c.Key) == 0 {
			return rpctypes.ErrGRPCEmptyKey
		}
	}
	for _, ops := range [][]*pb.RequestOp{r.Success, r.Failure} {
		for _, op := range ops {
			if err := checkRequestOp(op); err != nil {
				return err
			}
		}
	}
	return nil
}

func checkRequestOp(op *pb.RequestOp) error {
	switch o := op.Request.(type) {
	case *pb.RequestOp_RequestRange:
		return checkRangeRequest(o.RequestRange)
	case *pb.RequestOp_RequestPut:
		return checkPutRequest(o.RequestPut)
	case *pb.RequestOp_RequestDeleteRange:
		return checkDeleteRequest(o.RequestDeleteRange)
	case *pb.RequestOp_RequestTxn:
		return checkTxnRequest(o.RequestTxn)
	}
	return rpctypes.ErrGRPCKeyNotFound // an empty operation, as etcd answers it
}
