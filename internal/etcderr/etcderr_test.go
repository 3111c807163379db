package etcderr

import (
	"errors"
	"fmt"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

func TestWrapped(t *testing.T) {
	err := fmt.Errorf("listing users: %w", rpctypes.ErrGRPCPermissionDenied)
	if !Is(err, rpctypes.ErrPermissionDenied) {
		t.Fatalf("%v is not recognised as permission denied", err)
	}
	if Is(err, rpctypes.ErrUserEmpty) || Is(nil, rpctypes.ErrUserEmpty) {
		t.Fatal("a different error matched")
	}
	if !Is(rpctypes.ErrGRPCUserEmpty, rpctypes.ErrUserEmpty) {
		t.Fatal("an unwrapped error is not recognised")
	}
}

func TestOfCancelReason(t *testing.T) {
	if err := OfCancelReason(rpctypes.ErrGRPCPermissionDenied.Error()); !errors.Is(err, rpctypes.ErrPermissionDenied) {
		t.Fatalf("permission denied reason: %v", err)
	}
	if err := OfCancelReason("something else"); err == nil || err.Error() != "something else" {
		t.Fatalf("unknown reason: %v", err)
	}
}
