package server

import (
	"crypto/tls"
	"fmt"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
)

// ClientTLSConfig is the TLS configuration of a client of etcd from
// etcdctl's --cert, --key and --cacert, and grpc-proxy's
// --insecure-skip-tls-verify: nil when none is set. As in clientv3, TLS is
// then used for https:// endpoints only, and with a configuration for bare
// host:port endpoints too.
//
// Unlike grpc-proxy, a client certificate with a common name is accepted:
// kubeadm's apiserver-etcd-client certificate has one.
func ClientTLSConfig(info transport.TLSInfo, insecureSkipVerify bool) (*tls.Config, error) {
	if info.Empty() && info.TrustedCAFile == "" && !insecureSkipVerify {
		return nil, nil
	}
	cfg, err := info.ClientConfig()
	if err != nil {
		return nil, err
	}
	cfg.InsecureSkipVerify = insecureSkipVerify
	return cfg, nil
}

// The upstream connection's flow-control windows. At 4 MiB a stream
// carries about 4 GB/s at 1 ms of round trip, more than a forwarded Range
// is read at; the connection's window is what the estimator would reach.
const (
	upstreamStreamWindow = 4 << 20
	upstreamConnWindow   = 16 << 20
)

// connectUpstream dials etcd: the connection of the proxy's own identity
// (--user) first, if there is one, then the forwarding connection, whose
// calls lend the requests checked as the proxy to the first and run the
// gate's token watcher. Without --user the two are one.
func (s *Server) connectUpstream() error {
	clientMetrics := grpcprom.NewClientMetrics()
	s.registry.MustRegister(clientMetrics)
	var lend *lender
	if s.cfg.User != "" {
		own, err := s.dialUpstream(clientMetrics, s.cfg.User, s.cfg.Password, nil)
		if err != nil {
			return err
		}
		s.own, lend = own, &lender{own: own.ActiveConnection()}
	}
	client, err := s.dialUpstream(clientMetrics, "", "", lend, s.gate.WatchTokens)
	if err != nil {
		if s.own != nil {
			s.own.Close()
			s.own = nil
		}
		return err
	}
	s.client = client
	if s.own == nil {
		s.own = s.client
	}
	return nil
}

// dialUpstream returns a client of the upstream etcd, authenticated as user
// if one is given. Its calls carry the caller's token and hasleader
// metadata, and are counted in grpc_client_*; lend, if set, comes before
// them, and unary after.
func (s *Server) dialUpstream(clientMetrics *grpcprom.ClientMetrics, user, password string, lend *lender, unary ...grpc.UnaryClientInterceptor) (*clientv3.Client, error) {
	tlsCfg, err := ClientTLSConfig(s.cfg.UpstreamTLS, s.cfg.InsecureSkipTLSVerify)
	if err != nil {
		return nil, fmt.Errorf("upstream TLS: %w", err)
	}
	if s.cfg.InsecureSkipTLSVerify && user == "" {
		s.lg.Warn("--insecure-skip-tls-verify was given: the upstream's TLS certificate is not verified; use it only for testing")
	}
	// The connection that forwards callers' requests makes one attempt:
	// the caller's own client retries as it sees fit, and clientv3's
	// retries would hold an invalid token's or an empty user's refusal for
	// seconds (it retries those up to 100 times) where etcd answers at once.
	maxRetries := uint(0) // clientv3's default
	var unaryFirst []grpc.UnaryClientInterceptor
	var streamFirst []grpc.StreamClientInterceptor
	if user == "" {
		maxRetries = 1
	}
	if lend != nil {
		// A request checked here for a certificate caller goes as the
		// proxy's own identity.
		unaryFirst, streamFirst = []grpc.UnaryClientInterceptor{lend.unary}, []grpc.StreamClientInterceptor{lend.stream}
	}
	client, err := clientv3.New(clientv3.Config{
		MaxUnaryRetries:      maxRetries,
		Endpoints:            s.cfg.Endpoints,
		AutoSyncInterval:     s.cfg.EndpointsAutoSyncInterval,
		DialTimeout:          s.cfg.DialTimeout,
		DialKeepAliveTime:    s.cfg.DialKeepAliveTime,
		DialKeepAliveTimeout: s.cfg.DialKeepAliveTimeout,
		PermitWithoutStream:  s.cfg.PermitWithoutStream,
		TLS:                  tlsCfg,
		Username:             user,
		Password:             password,
		Logger:               s.lg.Named("upstream"),
		// The balancer is round_robin, as clientv3 picks, that also ends
		// the proxy's own long-lived streams when their member drains.
		DialOptions: append(append(drain.DialOptions(),
			// The raw stubs used here do not get clientv3's
			// MaxCallSendMsgSize/MaxCallRecvMsgSize, so the limits go on
			// the connection. By default responses may be as large as
			// etcd sends (a catch-up watch response batches many
			// revisions; a forwarded Range may be any size).
			grpc.WithDefaultCallOptions(
				grpc.MaxCallRecvMsgSize(orNoBound(s.cfg.MaxRecvBytes)),
				grpc.MaxCallSendMsgSize(orNoBound(s.cfg.MaxSendBytes))),
			// Fixed flow-control windows: gRPC's dynamic window (BDP
			// estimation) pings etcd on data received whenever no ping is
			// out, so each event of a quiet upstream watch cost a ping
			// and its ack on both sides. A fixed window also bounds what
			// one unread stream (a relayed client's watch) can buffer here
			// to upstreamStreamWindow, where the estimator may grow every
			// stream's window to 16 MiB.
			grpc.WithInitialWindowSize(upstreamStreamWindow),
			grpc.WithInitialConnWindowSize(upstreamConnWindow),
			// Reconnect within about a second of etcd coming back, even
			// after a long outage (grpc-go's default backoff reaches 120 s,
			// and a 5 s cap still left the proxy 3-4 s behind a restarted
			// etcd): while disconnected the cache is stale.
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
				MinConnectTimeout: connectTimeout,
			}),
			grpc.WithChainUnaryInterceptor(append(unaryFirst, append([]grpc.UnaryClientInterceptor{forwardUnaryMetadata, clientMetrics.UnaryClientInterceptor()}, unary...)...)...),
			grpc.WithChainStreamInterceptor(append(streamFirst, forwardStreamMetadata, clientMetrics.StreamClientInterceptor())...),
		), s.tracing.DialOptions()...),
	})
	if err != nil {
		return nil, fmt.Errorf("connecting to etcd %v: %w", s.cfg.Endpoints, err)
	}
	return client, nil
}
