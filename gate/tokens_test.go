package gate

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// TestTokensTrustOnlyWhatEtcdAcceptedRecently: a token is trusted for cached
// reads only at the auth revision etcd accepted it at and within
// the check interval; etcd's invalid-token answer ends it, a permission
// refusal proves it valid.
func TestTokensTrustOnlyWhatEtcdAcceptedRecently(t *testing.T) {
	ts := newTokens()
	if _, ok := ts.trusted("t1", 5, DefaultTokenCheckInterval); ok {
		t.Fatal("a token never issued through the proxy is trusted")
	}
	ts.issued("t1", "alice", 5, true)
	if user, ok := ts.trusted("t1", 5, DefaultTokenCheckInterval); !ok || user != "alice" {
		t.Fatalf("a token just issued: %q, %v", user, ok)
	}
	if _, ok := ts.trusted("t1", 6, DefaultTokenCheckInterval); ok {
		t.Fatal("a token is trusted after the auth revision moved")
	}
	ts.answered("t1", 6, true, rpctypes.ErrGRPCPermissionDenied)
	if _, ok := ts.trusted("t1", 6, DefaultTokenCheckInterval); !ok {
		t.Fatal("etcd's permission refusal did not prove the token valid at the new revision")
	}
	ts.mu.Lock()
	ts.byToken["t1"].verifiedAt = time.Now().Add(-2 * DefaultTokenCheckInterval)
	ts.mu.Unlock()
	if _, ok := ts.trusted("t1", 6, DefaultTokenCheckInterval); ok {
		t.Fatal("a token etcd last accepted long ago is trusted")
	}
	ts.answered("t1", 6, true, nil)
	if _, ok := ts.trusted("t1", 6, DefaultTokenCheckInterval); !ok {
		t.Fatal("a forwarded read etcd answered did not renew the token")
	}
	ts.answered("t1", 6, true, rpctypes.ErrGRPCInvalidAuthToken)
	if _, ok := ts.trusted("t1", 6, DefaultTokenCheckInterval); ok {
		t.Fatal("a token etcd called invalid is still trusted")
	}
	ts.issued("t2", "bob", 6, true)
	ts.answered("t2", 6, true, errors.New("unavailable"))
	if _, ok := ts.trusted("t2", 6, DefaultTokenCheckInterval); !ok {
		t.Fatal("an unrelated error ended a token")
	}

	// An answer while the mirrored revision moved, or a token issued
	// while it moved, proves nothing at the new revision: etcd may have
	// checked the token before the change.
	ts.issued("t3", "carol", 7, false)
	if _, ok := ts.trusted("t3", 7, DefaultTokenCheckInterval); ok || !ts.known("t3") {
		t.Fatal("a token issued while the auth revision moved is trusted, or not known")
	}
	ts.answered("t3", 7, false, nil)
	if _, ok := ts.trusted("t3", 7, DefaultTokenCheckInterval); ok {
		t.Fatal("an answer given while the auth revision moved made a token trusted")
	}
}

// TestTokensForgetIdleOnes: tokens etcd has not accepted through the proxy
// for tokenIdle are forgotten once enough are known; the rest stay.
func TestTokensForgetIdleOnes(t *testing.T) {
	ts := newTokens()
	for i := range minTokensPrune {
		ts.issued(fmt.Sprint("idle", i), "alice", 1, true)
	}
	ts.mu.Lock()
	for _, e := range ts.byToken {
		e.verifiedAt = time.Now().Add(-2 * tokenIdle)
	}
	ts.mu.Unlock()
	ts.issued("fresh", "bob", 1, true)
	if ts.known("idle0") || !ts.known("fresh") {
		t.Fatalf("after pruning: idle0 known %v, fresh known %v", ts.known("idle0"), ts.known("fresh"))
	}
	if n := len(ts.byToken); n != 1 {
		t.Fatalf("%d tokens known after pruning, want 1", n)
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
		{metadata.Pairs(rpctypes.TokenFieldNameGRPC, ""), ""},
		{metadata.Pairs(rpctypes.TokenFieldNameSwagger, "Bearer "), ""},
	} {
		ctx := context.Background()
		if tc.md != nil {
			ctx = metadata.NewIncomingContext(ctx, tc.md)
		}
		if got := tokenOf(ctx); got != tc.want {
			t.Errorf("tokenOf(%v) = %q, want %q", tc.md, got, tc.want)
		}
		// A token key sent empty is a token still, which etcd refuses.
		if _, _, present := bearerTokenOf(ctx); present != (tc.md != nil) {
			t.Errorf("bearerTokenOf(%v): present %v", tc.md, present)
		}
	}
}
