package gate

import (
	"context"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
)

// CallerKind is how etcd identifies a request's caller.
type CallerKind int

const (
	Anonymous   CallerKind = iota // neither: etcd checks nothing, or refuses
	TokenCaller                   // a token in the request metadata: etcd checks it
	CertCaller                    // no token, and the verified certificate's common name
)

// Caller is who sends a request, as etcd's AuthInfoFromCtx decides it: a
// token first (a token key sent empty too: etcd refuses it as invalid,
// and the proxy, which cannot attribute it, leaves that to etcd); else,
// with --client-cert-auth, the common name of the verified client
// certificate; else nobody.
type Caller struct {
	Kind  CallerKind
	Token string // TokenCaller
	CN    string // CertCaller; may be empty, as a certificate may say
}

// CallerOf is the caller of a request.
func (g *Gate) CallerOf(ctx context.Context) Caller {
	if token, stripped, present := bearerTokenOf(ctx); present {
		if stripped {
			if r, err := g.rules(); err != nil || !r.BearerStripped {
				token = "Bearer " + token // the token etcd sees: no proxy knows it
			}
		}
		return Caller{Kind: TokenCaller, Token: token}
	}
	if g.cfg.ClientCertAuth {
		if cn, ok := certCommonNameOf(ctx); ok {
			return Caller{Kind: CertCaller, CN: cn}
		}
	}
	return Caller{Kind: Anonymous}
}

// certCommonNameOf is etcd's AuthInfoFromTLS: the common name of the first
// verified chain's leaf, unless the request comes through etcd's gRPC
// gateway (the Grpcgateway-Accept header), which presents a server
// certificate whose name must never be taken for a user.
func certCommonNameOf(ctx context.Context) (string, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok || p == nil || p.AuthInfo == nil {
		return "", false
	}
	tlsInfo, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return "", false
	}
	for _, chain := range tlsInfo.State.VerifiedChains {
		if len(chain) < 1 {
			continue
		}
		md, ok := metadata.FromIncomingContext(ctx)
		if !ok || len(md["grpcgateway-accept"]) > 0 {
			return "", false
		}
		return chain[0].Subject.CommonName, true
	}
	return "", false
}

// asProxyKey marks a request context whose upstream calls go as the
// proxy's own identity: a certificate caller's request, once checked here.
type asProxyKey struct{}

// AsProxy marks ctx's upstream calls to go as the proxy.
func AsProxy(ctx context.Context) context.Context { return context.WithValue(ctx, asProxyKey{}, true) }

// IsAsProxy reports whether ctx's upstream calls go as the proxy.
func IsAsProxy(ctx context.Context) bool { v, _ := ctx.Value(asProxyKey{}).(bool); return v }
