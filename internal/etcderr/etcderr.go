// Package etcderr recognises etcd's errors inside wrapped errors.
package etcderr

import (
	"errors"
	"strings"

	"google.golang.org/grpc/status"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// Of returns etcd's error (rpctypes.Err*) for the gRPC error err wraps,
// or err: rpctypes.Error alone misses a wrapped one, whose message the
// wrapping changed.
func Of(err error) error {
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		return rpctypes.Error(se.(error))
	}
	return rpctypes.Error(err)
}

// Is reports whether err is, or wraps, etcd's error target (an
// rpctypes.Err* value).
func Is(err, target error) bool { return errors.Is(Of(err), target) }

// OfCancelReason returns etcd's error for the cancel reason of a watch
// etcd refused, which is its gRPC error's text ("rpc error: code =
// PermissionDenied desc = etcdserver: permission denied"), or an error of
// that text when it names none of etcd's errors.
func OfCancelReason(reason string) error {
	desc := reason
	if _, after, ok := strings.Cut(reason, " desc = "); ok {
		desc = after
	}
	var etcdErr rpctypes.EtcdError
	if err := rpctypes.Error(errors.New(desc)); errors.As(err, &etcdErr) {
		return err
	}
	return errors.New(reason)
}
