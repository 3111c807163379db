package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"

	gw "github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"github.com/tmc/grpc-websocket-proxy/wsproxy"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"

	etcdservergw "go.etcd.io/etcd/api/v3/etcdserverpb/gw"
	v3electiongw "go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb/gw"
	v3lockgw "go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb/gw"
)

// etcd's HTTP/JSON gateway (etcd's embed/serve.go: registerGateway,
// createMux and accessController), served on the client port.
//
// The gateway is a client of the proxy's own gRPC API, as etcd's is of its
// own: a JSON Range is the gRPC Range, served from the cache by the same
// code, a JSON watch is served from the proxy's history, and the rest is
// forwarded to etcd. The gRPC-gateway runtime hands the Authorization
// header to the gRPC call as the "authorization" metadata, which the proxy
// takes for a token exactly as etcd does.

// gatewayPrefix is the gateway's path prefix; gatewayBetaPrefix is the
// older one etcd still redirects to it.
const (
	gatewayPrefix     = "/v3/"
	gatewayBetaPrefix = "/v3beta/"
)

// gateway is the JSON gateway and the connection it calls the proxy
// through; close closes the connection.
type gateway struct {
	lg   *zap.Logger
	conn *grpc.ClientConn
	http http.Handler
	// clientCertAuth and authEnabled are for etcd's refusal of a gateway
	// request over TLS that presents a client certificate with a common
	// name while auth is enabled: the gateway's own connection is the
	// caller etcd sees, and its certificate's name is not the requester's.
	clientCertAuth bool
	authEnabled    func() bool
}

// newGateway dials the proxy's client port as etcd's gateway dials etcd's:
// over the serving TLS, presenting the serving certificate and trusting
// the local server without verifying it, with no bound on the size of a
// response. The connection is made on first use.
func (s *Server) newGateway() (*gateway, error) {
	opts := []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32))}
	if s.tls != nil {
		tlsCfg, err := s.tls.ServerConfig()
		if err != nil {
			return nil, fmt.Errorf("the JSON gateway's TLS: %w", err)
		}
		dtls := tlsCfg.Clone()
		dtls.InsecureSkipVerify = true // the local server, as etcd's gateway
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(dtls)))
	} else {
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	conn, err := grpc.NewClient(s.selfAddr(), opts...)
	if err != nil {
		return nil, fmt.Errorf("the JSON gateway's connection to the proxy: %w", err)
	}
	// etcd's options: the protobuf field names, no unset fields, unknown
	// fields of a request ignored.
	mux := gw.NewServeMux(
		gw.WithIncomingHeaderMatcher(gatewayHeader),
		gw.WithMarshalerOption(gw.MIMEWildcard,
			&gw.HTTPBodyMarshaler{
				Marshaler: compactJSON{&gw.JSONPb{
					MarshalOptions:   protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: false},
					UnmarshalOptions: protojson.UnmarshalOptions{DiscardUnknown: true},
				}},
			},
		),
	)
	// The handlers' context only scopes their registration.
	ctx := context.Background()
	for _, register := range []func(context.Context, *gw.ServeMux, *grpc.ClientConn) error{
		etcdservergw.RegisterKVHandler,
		etcdservergw.RegisterWatchHandler,
		etcdservergw.RegisterLeaseHandler,
		etcdservergw.RegisterClusterHandler,
		etcdservergw.RegisterMaintenanceHandler,
		etcdservergw.RegisterAuthHandler,
		v3lockgw.RegisterLockHandler,
		v3electiongw.RegisterElectionHandler,
	} {
		if err := register(ctx, mux, conn); err != nil {
			conn.Close()
			return nil, fmt.Errorf("registering the JSON gateway: %w", err)
		}
	}
	lg := s.lg.Named("gateway")
	g := &gateway{
		lg:   lg,
		conn: conn,
		http: wsproxy.WebsocketProxy(mux,
			// Streams (watch, lease keep-alive) are POSTs over a websocket.
			wsproxy.WithRequestMutator(func(_ *http.Request, outgoing *http.Request) *http.Request {
				outgoing.Method = http.MethodPost
				return outgoing
			}),
			wsproxy.WithMaxRespBodyBufferSize(0x7fffffff),
			wsproxy.WithLogger(wsLogger{lg}),
		),
		clientCertAuth: s.cfg.ClientCertAuth,
		authEnabled: func() bool {
			on, known := s.gate.AuthEnabled()
			return on || !known // unknown: refused as etcd would if enabled
		},
	}
	return g, nil
}

// gatewayHeader passes an HTTP request's W3C trace context and baggage
// to the gRPC call the gateway makes for it, as gRPC metadata of the same
// names (traceContextKeys), so that the call's spans (the proxy's with
// --enable-distributed-tracing, and etcd's for what it forwards) join the
// HTTP caller's trace; etcd's gateway drops them. Other headers are
// grpc-gateway's, as etcd's gateway passes them.
func gatewayHeader(key string) (string, bool) {
	if k := strings.ToLower(key); slices.Contains(traceContextKeys, k) {
		return k, true
	}
	return gw.DefaultHeaderMatcher(key)
}

func (g *gateway) close() {
	if err := g.conn.Close(); err != nil {
		g.lg.Warn("closing the JSON gateway's connection", zap.Error(err))
	}
}

// wrap serves the gateway's paths in front of next, with etcd's access
// rules for them (accessController): /v3beta/ is /v3/; CORS headers for any
// origin, etcd's default --cors; an OPTIONS preflight answered at once;
// and over TLS with --client-cert-auth and auth enabled, a request that
// presents a certificate with a common name refused. Then, as in etcd, an
// http.ServeMux with the gateway at /v3/: it redirects /v3 and unclean
// paths (/v3/kv//range) as etcd does. The other paths keep grpc-proxy's
// handling, which has no CORS.
func (g *gateway) wrap(next http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle(gatewayPrefix, g.http)
	mux.Handle("/", next)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, gatewayBetaPrefix) {
			r.URL.Path = gatewayPrefix + strings.TrimPrefix(r.URL.Path, gatewayBetaPrefix)
		}
		if !isGatewayPath(r.URL.Path) || isGRPC(r) {
			next.ServeHTTP(w, r)
			return
		}
		if r.TLS != nil && g.clientCertAuth && g.authEnabled() {
			for _, chain := range r.TLS.VerifiedChains {
				if len(chain) > 0 && chain[0].Subject.CommonName != "" {
					http.Error(w, "CommonName of client sending a request against gateway will be ignored and not used as expected", http.StatusBadRequest)
					return
				}
			}
		}
		w.Header().Add("Access-Control-Allow-Methods", "POST, GET, OPTIONS, PUT, DELETE")
		w.Header().Add("Access-Control-Allow-Origin", "*")
		w.Header().Add("Access-Control-Allow-Headers", "accept, content-type, authorization")
		if r.Method == http.MethodOptions {
			w.WriteHeader(http.StatusOK)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// isGatewayPath reports whether path is the gateway's: /v3/ and below, or
// /v3 itself, which etcd redirects to /v3/.
func isGatewayPath(path string) bool {
	return path == strings.TrimSuffix(gatewayPrefix, "/") || strings.HasPrefix(path, gatewayPrefix)
}

// isGRPC reports whether r is a gRPC call (served by the gRPC server
// behind next over TLS), whose path never starts with /v3/ anyway.
func isGRPC(r *http.Request) bool {
	return r.ProtoMajor == 2 && strings.Contains(r.Header.Get("Content-Type"), "application/grpc")
}

// compactJSON is etcd's JSON marshaler with protojson's whitespace taken
// out. protojson puts a space after some separators or not depending on
// a hash of the running binary, so that nobody relies on its bytes: an
// answer of the proxy would differ from etcd's by spaces alone. Compact,
// it is the same as that of an etcd build that adds none.
type compactJSON struct{ *gw.JSONPb }

func (c compactJSON) Marshal(v any) ([]byte, error) {
	b, err := c.JSONPb.Marshal(v)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	out.Grow(len(b))
	if err := json.Compact(&out, b); err != nil {
		return nil, fmt.Errorf("compacting the gateway's JSON: %w", err)
	}
	return out.Bytes(), nil
}

func (c compactJSON) NewEncoder(w io.Writer) gw.Encoder {
	return gw.EncoderFunc(func(v any) error {
		b, err := c.Marshal(v)
		if err != nil {
			return err
		}
		if _, err := w.Write(append(b, c.Delimiter()...)); err != nil {
			return fmt.Errorf("writing the gateway's JSON: %w", err)
		}
		return nil
	})
}

// wsLogger is wsproxy's logger.
type wsLogger struct{ *zap.Logger }

func (l wsLogger) Warnln(args ...any)  { l.Warn(fmt.Sprint(args...)) }
func (l wsLogger) Debugln(args ...any) { l.Debug(fmt.Sprint(args...)) }
