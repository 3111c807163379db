package server

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
)

// errAuthUnknown answers a caller the proxy cannot yet tell etcd's auth
// state for; clients retry.
var errAuthUnknown = status.Error(codes.Unavailable, "etcd-snapcache: etcd's auth state is not known yet; retry")

// Who calls, for now: a caller with a token is checked by etcd, to which
// its requests go with its token; every other caller is anonymous, as in
// front of an etcd without --client-cert-auth. While auth is enabled, etcd
// refuses an anonymous caller every read and watch with "user name is
// empty", and so does the proxy, whose cache would otherwise answer them.
func hasToken(ctx context.Context) bool { return tokenOf(ctx) != "" }

// authorizeRead is etcd's permission check of a read (kvproxy's
// Authorize). An anonymous caller while auth is enabled gets etcd's
// refusal. A caller with a token the proxy can attribute (issued through
// it, accepted by etcd within tokenVerifyInterval at the mirrored auth
// revision) is checked with etcd's own code on the mirror, and an allowed
// serializable or historical read is served from the cache. Every other
// token read, and every linearizable one (whose permissions must be as of
// its start, which the mirror cannot prove yet), goes to etcd.
func (s *Server) authorizeRead(ctx context.Context, key, rangeEnd []byte, linearizable bool) error {
	token := tokenOf(ctx)
	if token == "" {
		return s.anonymousRefusal()
	}
	enabled, known := s.authMirror.Enabled()
	switch {
	case linearizable || !known:
		return kvproxy.ErrAskEtcd
	case !enabled:
		return nil // etcd ignores tokens while auth is disabled
	}
	c := s.authMirror.Checker()
	if c == nil {
		return kvproxy.ErrAskEtcd
	}
	user, ok := s.tokens.trusted(token, c.Revision())
	if !ok {
		return kvproxy.ErrAskEtcd
	}
	return c.CheckRange(authcache.Identity{User: user}, key, rangeEnd)
}

// authorizeWatch is etcd's permission check of a watch create on a stream
// the proxy serves: streams with a token are relayed to etcd whole, so an
// anonymous caller's, refused while auth is enabled.
func (s *Server) authorizeWatch(ctx context.Context, _, _ []byte) error {
	if hasToken(ctx) {
		return nil
	}
	return s.anonymousRefusal()
}

// anonymousRefusal is etcd's answer to an anonymous caller of a request it
// checks: "user name is empty" while auth is enabled, nothing otherwise.
func (s *Server) anonymousRefusal() error {
	enabled, known := s.authMirror.Enabled()
	switch {
	case !known:
		return errAuthUnknown
	case enabled:
		return rpctypes.ErrGRPCUserEmpty
	}
	return nil
}

// unchecked are the methods etcd answers without an identity, and those
// whose permission the proxy checks itself (reads and watches).
var unchecked = map[string]bool{
	"/etcdserverpb.Auth/Authenticate": true,
	"/etcdserverpb.Auth/AuthStatus":   true,
	"/etcdserverpb.KV/Range":          true,
	"/etcdserverpb.KV/RangeStream":    true,
	"/etcdserverpb.Watch/Watch":       true,
}

// lendsIdentity reports whether a request the proxy forwards without a
// token runs as the proxy's own upstream identity: its client certificate
// carries a common name, which etcd with --client-cert-auth takes for a
// user name. Such a request must not reach etcd from an anonymous caller.
func (s *Server) lendsIdentity(method string) bool {
	return s.upstreamCN != "" && !unchecked[method] && !strings.HasPrefix(method, "/grpc.health.v1.")
}

// gate refuses, while auth is enabled, the forwarded requests of anonymous
// callers that would otherwise run as the proxy's certificate identity.
// etcd answers an anonymous caller "user name is empty" for them.
func (s *Server) gate(ctx context.Context, method string) error {
	if !s.lendsIdentity(method) || hasToken(ctx) {
		return nil
	}
	return s.anonymousRefusal()
}

func (s *Server) gateUnary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := s.gate(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

func (s *Server) gateStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := s.gate(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}

// certCommonName returns the common name of the first certificate in a
// PEM file, "" for none.
func certCommonName(file string) (string, error) {
	if file == "" {
		return "", nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	block, _ := pem.Decode(b)
	if block == nil {
		return "", fmt.Errorf("%s: no PEM certificate", file)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return "", fmt.Errorf("%s: %w", file, err)
	}
	return cert.Subject.CommonName, nil
}

// authEnabledProbe is a cheap test of whether etcd has auth enabled: a
// serializable count-only read of one key by an anonymous caller, which
// etcd refuses with "user name is empty" exactly while auth is enabled. It
// is anonymous only without a certificate identity, so there is none with
// one.
func (s *Server) authEnabledProbe() func(ctx context.Context) (bool, error) {
	if s.upstreamCN != "" {
		return nil
	}
	kv := pb.NewKVClient(s.client.ActiveConnection())
	return func(ctx context.Context) (bool, error) {
		_, err := kv.Range(ctx, &pb.RangeRequest{Key: authProbeKey, CountOnly: true, Serializable: true})
		switch {
		case err == nil:
			return false, nil
		case errors.Is(rpctypes.Error(err), rpctypes.ErrUserEmpty):
			return true, nil
		}
		return false, err
	}
}

// authProbeKey is read, never written, by authEnabledProbe.
var authProbeKey = []byte("\x00etcd-snapcache-auth-probe")
