package gate

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"testing"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
)

// TestCallerOf: who a request is from, as etcd's AuthInfoFromCtx decides:
// a token first, then (with --client-cert-auth only) the verified
// certificate's common name, unless the request came through a gRPC
// gateway; else nobody.
func TestCallerOf(t *testing.T) {
	verified := func(ctx context.Context, cn string) context.Context {
		chain := []*x509.Certificate{{Subject: pkix.Name{CommonName: cn}}}
		return peer.NewContext(ctx, &peer.Peer{AuthInfo: credentials.TLSInfo{State: tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{chain}}}})
	}
	md := func(kv ...string) context.Context {
		return metadata.NewIncomingContext(context.Background(), metadata.Pairs(kv...))
	}
	withCN := &Gate{cfg: Config{ClientCertAuth: true}}
	withoutCN := &Gate{}
	for _, tc := range []struct {
		name string
		g    *Gate
		ctx  context.Context
		want Caller
	}{
		{"nothing", withCN, md(), Caller{Kind: Anonymous}},
		{"token", withCN, verified(md("token", "t1"), "alice"), Caller{Kind: TokenCaller, Token: "t1"}},
		{"certificate", withCN, verified(md(), "alice"), Caller{Kind: CertCaller, CN: "alice"}},
		{"certificate without a name", withCN, verified(md(), ""), Caller{Kind: CertCaller, CN: ""}},
		{"certificate, no --client-cert-auth", withoutCN, verified(md(), "alice"), Caller{Kind: Anonymous}},
		{"gateway", withCN, verified(md("grpcgateway-accept", "application/json"), "server"), Caller{Kind: Anonymous}},
		{"unverified", withCN, peer.NewContext(md(), &peer.Peer{AuthInfo: credentials.TLSInfo{}}), Caller{Kind: Anonymous}},
	} {
		if got := tc.g.CallerOf(tc.ctx); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
