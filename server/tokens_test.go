package server

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/metadata"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestTokensTrustOnlyWhatEtcdAcceptedRecently: a token is trusted for cached
// reads only at the auth revision etcd accepted it at and within
// the check interval; etcd's invalid-token answer ends it, a permission
// refusal proves it valid.
func TestTokensTrustOnlyWhatEtcdAcceptedRecently(t *testing.T) {
	ts := newTokens()
	if _, ok := ts.trusted("t1", 5, defaultAuthTokenCheckInterval); ok {
		t.Fatal("a token never issued through the proxy is trusted")
	}
	ts.issued("t1", "alice", 5)
	if user, ok := ts.trusted("t1", 5, defaultAuthTokenCheckInterval); !ok || user != "alice" {
		t.Fatalf("a token just issued: %q, %v", user, ok)
	}
	if _, ok := ts.trusted("t1", 6, defaultAuthTokenCheckInterval); ok {
		t.Fatal("a token is trusted after the auth revision moved")
	}
	ts.answered("t1", 6, rpctypes.ErrGRPCPermissionDenied)
	if _, ok := ts.trusted("t1", 6, defaultAuthTokenCheckInterval); !ok {
		t.Fatal("etcd's permission refusal did not prove the token valid at the new revision")
	}
	ts.mu.Lock()
	ts.byToken["t1"].verifiedAt = time.Now().Add(-2 * defaultAuthTokenCheckInterval)
	ts.mu.Unlock()
	if _, ok := ts.trusted("t1", 6, defaultAuthTokenCheckInterval); ok {
		t.Fatal("a token etcd last accepted long ago is trusted")
	}
	ts.answered("t1", 6, nil)
	if _, ok := ts.trusted("t1", 6, defaultAuthTokenCheckInterval); !ok {
		t.Fatal("a forwarded read etcd answered did not renew the token")
	}
	ts.answered("t1", 6, rpctypes.ErrGRPCInvalidAuthToken)
	if _, ok := ts.trusted("t1", 6, defaultAuthTokenCheckInterval); ok {
		t.Fatal("a token etcd called invalid is still trusted")
	}
	ts.issued("t2", "bob", 6)
	ts.answered("t2", 6, errors.New("unavailable"))
	if _, ok := ts.trusted("t2", 6, defaultAuthTokenCheckInterval); !ok {
		t.Fatal("an unrelated error ended a token")
	}
}

// TestTokenOf: the token is read where etcd reads it.
func TestTokenOf(t *testing.T) {
	for _, tc := range []struct {
		md   metadata.MD
		want string
	}{
		{nil, ""},
		{metadata.Pairs(rpctypes.TokenFieldNameGRPC, "simple.1"), "simple.1"},
		{metadata.Pairs(rpctypes.TokenFieldNameSwagger, "Bearer jwt.x.y"), "jwt.x.y"},
		{metadata.Pairs(rpctypes.TokenFieldNameGRPC, "a", rpctypes.TokenFieldNameSwagger, "Bearer b"), "a"},
	} {
		ctx := context.Background()
		if tc.md != nil {
			ctx = metadata.NewIncomingContext(ctx, tc.md)
		}
		if got := tokenOf(ctx); got != tc.want {
			t.Errorf("tokenOf(%v) = %q, want %q", tc.md, got, tc.want)
		}
	}
}
