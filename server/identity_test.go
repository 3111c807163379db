package server

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
	withCN := &Server{cfg: Config{ClientCertAuth: true}}
	withoutCN := &Server{}
	for _, tc := range []struct {
		name string
		s    *Server
		ctx  context.Context
		want caller
	}{
		{"nothing", withCN, md(), caller{kind: anonymous}},
		{"token", withCN, verified(md("token", "t1"), "alice"), caller{kind: tokenCaller, token: "t1"}},
		{"certificate", withCN, verified(md(), "alice"), caller{kind: certCaller, cn: "alice"}},
		{"certificate without a name", withCN, verified(md(), ""), caller{kind: certCaller, cn: ""}},
		{"certificate, no --client-cert-auth", withoutCN, verified(md(), "alice"), caller{kind: anonymous}},
		{"gateway", withCN, verified(md("grpcgateway-accept", "application/json"), "server"), caller{kind: anonymous}},
		{"unverified", withCN, peer.NewContext(md(), &peer.Peer{AuthInfo: credentials.TLSInfo{}}), caller{kind: anonymous}},
	} {
		if got := tc.s.callerOf(tc.ctx); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
