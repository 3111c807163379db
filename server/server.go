package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/proxy/grpcproxy"

	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
	"github.com/etcd-snapcache/etcd-snapcache/watchproxy"
)

// etcd's gRPC server limits (server/embed/config.go, api/v3rpc/grpc.go).
const (
	defaultMaxRequestBytes = 1.5 * 1024 * 1024
	grpcOverheadBytes      = 512 * 1024
	maxSendBytes           = math.MaxInt32
	keepAliveMinTime       = 5 * time.Second
	keepAliveInterval      = 2 * time.Hour
	keepAliveTimeout       = 20 * time.Second
	defaultDialTimeout     = 5 * time.Second
	gracefulStopTimeout    = 10 * time.Second
	defaultMemberName      = "etcd-snapcache"
	upstreamKeepAliveTime  = 30 * time.Second
)

// Config configures a Server.
type Config struct {
	// Endpoints of the upstream etcd cluster, as host:port or URLs.
	Endpoints []string
	// ListenAddr is where the gRPC API is served (host:port; port 0 picks).
	ListenAddr string
	// MetricsAddr is where /metrics, /livez and /readyz are served; empty
	// disables the HTTP endpoint.
	MetricsAddr string
	// AdvertiseClientURLs are returned by MemberList; default: the listen
	// address with the serving scheme.
	AdvertiseClientURLs []string
	// ServerTLS secures the gRPC API when CertFile is set; a TrustedCAFile
	// makes it require and verify client certificates.
	ServerTLS transport.TLSInfo
	// UpstreamTLS secures the connection to etcd when any file is set.
	UpstreamTLS transport.TLSInfo
	// DialTimeout bounds the first connection to etcd.
	DialTimeout time.Duration

	// BTreeDegree of the key trees (revtree.DefaultDegree if 0).
	BTreeDegree int
	// RevisionWait bounds how long a serializable read ahead of the cache
	// waits for it.
	RevisionWait time.Duration
	// FreshnessTimeout bounds how long a linearizable read waits for proof
	// that the cache is fresh (kvproxy.DefaultFreshnessTimeout if 0).
	FreshnessTimeout time.Duration
	// MaxForwardedReads bounds the reads in flight to etcd at once.
	MaxForwardedReads int
	// BeforeLoadPage is called before each page of a load; tests only.
	BeforeLoadPage func()
	// ConsistencyCheckInterval is how often the cache is checked against
	// etcd (hashcheck.DefaultInterval if 0; negative disables).
	ConsistencyCheckInterval time.Duration
	// ConsistentReadFallback is what a linearizable read does when its
	// freshness was not proven in time: go to etcd, or fail with
	// Unavailable (--consistent-read-fallback).
	ConsistentReadFallback kvproxy.ConsistentReadFallback
	// CompactionProbeInterval is how often etcd's compaction revision is
	// checked.
	CompactionProbeInterval time.Duration
	// LoadRetainedHistory replays etcd's retained history at start.
	LoadRetainedHistory bool
	// LoadPageSize is the page size of the initial load.
	LoadPageSize int64
	// MaxRequestBytes is etcd's --max-request-bytes of the upstream: the
	// largest request accepted (plus gRPC overhead, as etcd) and the size
	// at which fragmenting watchers' responses are split. Default 1.5 MiB.
	MaxRequestBytes int
	// WatchProgressNotifyInterval is the interval of periodic progress
	// notifications to idle progress_notify watchers (etcd's default if 0).
	WatchProgressNotifyInterval time.Duration

	Logger *zap.Logger
}

// Server is a running etcd-snapcache.
type Server struct {
	cfg      Config
	lg       *zap.Logger
	client   *clientv3.Client
	store    *revtree.Store
	follower *progress.Follower
	registry *prometheus.Registry

	grpcServer *grpc.Server
	grpcLis    net.Listener
	httpServer *http.Server
	httpLis    net.Listener
	health     *health.Server
	checker    *hashcheck.Checker
	keepAlives *keepAlives
	watch      *watchproxy.Server

	cancel context.CancelFunc
	wg     sync.WaitGroup
	errc   chan error
	once   sync.Once
}

// Start dials etcd, starts following it and serves until Stop. It returns
// once the listeners are bound; the cache loads in the background.
func Start(cfg Config) (*Server, error) {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = defaultDialTimeout
	}
	if cfg.MaxRequestBytes <= 0 {
		cfg.MaxRequestBytes = defaultMaxRequestBytes
	}
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("no upstream etcd endpoints")
	}
	s := &Server{cfg: cfg, lg: cfg.Logger, errc: make(chan error, 3), registry: prometheus.NewRegistry()}
	s.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	client, err := s.dialUpstream()
	if err != nil {
		return nil, err
	}
	s.client = client

	s.store = revtree.New(cfg.BTreeDegree)
	s.follower = progress.New(progress.Config{
		Client:                  client,
		Store:                   s.store,
		Logger:                  s.lg.Named("follower"),
		Metrics:                 progress.NewMetrics(s.registry),
		LoadPageSize:            cfg.LoadPageSize,
		CompactionProbeInterval: cfg.CompactionProbeInterval,
		LoadRetainedHistory:     cfg.LoadRetainedHistory,
		BeforeLoadPage:          cfg.BeforeLoadPage,
	})

	s.checker = hashcheck.New(hashcheck.Config{
		Store:      s.store,
		Follower:   s.follower,
		Upstream:   pb.NewKVClient(client.ActiveConnection()),
		Interval:   cfg.ConsistencyCheckInterval,
		Logger:     s.lg.Named("hashcheck"),
		Registerer: s.registry,
	})

	if err := s.listen(); err != nil {
		client.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.grpcServer, err = s.newGRPCServer(ctx)
	if err != nil {
		cancel()
		s.closeListeners()
		client.Close()
		return nil, err
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.keepAlives.run()
	}()
	if cfg.ConsistencyCheckInterval >= 0 {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.checker.Run(ctx)
		}()
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.follower.Run(ctx)
	}()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		select {
		case <-s.follower.Ready():
			s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		case <-ctx.Done():
		}
	}()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := s.grpcServer.Serve(s.grpcLis); err != nil {
			s.errc <- fmt.Errorf("serving gRPC: %w", err)
		}
	}()
	if s.httpLis != nil {
		s.httpServer = &http.Server{
			Handler:           newHTTPHandler(s.registry, s.follower.Serving),
			ReadHeaderTimeout: 10 * time.Second,
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := s.httpServer.Serve(s.httpLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.errc <- fmt.Errorf("serving metrics: %w", err)
			}
		}()
	}
	s.lg.Info("serving the etcd API",
		zap.String("listen-addr", s.grpcLis.Addr().String()),
		zap.Strings("upstream", cfg.Endpoints),
		zap.Strings("advertise-client-urls", s.advertiseURLs()))
	return s, nil
}

func (s *Server) dialUpstream() (*clientv3.Client, error) {
	tlsCfg, err := ClientTLSConfig(s.cfg.UpstreamTLS)
	if err != nil {
		return nil, fmt.Errorf("upstream TLS: %w", err)
	}
	client, err := clientv3.New(clientv3.Config{
		Endpoints:            s.cfg.Endpoints,
		DialTimeout:          s.cfg.DialTimeout,
		DialKeepAliveTime:    upstreamKeepAliveTime,
		DialKeepAliveTimeout: keepAliveTimeout,
		TLS:                  tlsCfg,
		Logger:               s.lg.Named("upstream"),
		DialOptions: []grpc.DialOption{
			// Responses from etcd may be as large as etcd sends (a catch-up
			// watch response batches many revisions; a forwarded Range may
			// be any size). clientv3's MaxCallRecvMsgSize applies only to
			// its own wrappers, not to the raw stubs used here, so the
			// limit is set on the connection.
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxSendBytes)),
			// Reconnect within about a second of etcd coming back, even
			// after a long outage (grpc-go's default backoff reaches 120 s,
			// and a 5 s cap still left the proxy 3-4 s behind a restarted
			// etcd): while disconnected the cache is stale.
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
				MinConnectTimeout: defaultDialTimeout,
			}),
			grpc.WithChainUnaryInterceptor(forwardUnaryMetadata),
			grpc.WithChainStreamInterceptor(forwardStreamMetadata),
		},
	})
	if err != nil {
		return nil, fmt.Errorf("connecting to etcd %v: %w", s.cfg.Endpoints, err)
	}
	return client, nil
}

// ClientTLSConfig is the TLS configuration of a client of etcd from
// etcdctl's --cert, --key and --cacert: nil when none is set. As in
// clientv3, TLS is then used for https:// endpoints only, and with a
// configuration for bare host:port endpoints too.
func ClientTLSConfig(info transport.TLSInfo) (*tls.Config, error) {
	if info.Empty() && info.TrustedCAFile == "" {
		return nil, nil
	}
	return info.ClientConfig()
}

func (s *Server) listen() error {
	lis, err := net.Listen("tcp", s.cfg.ListenAddr)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", s.cfg.ListenAddr, err)
	}
	s.grpcLis = lis
	if s.cfg.MetricsAddr != "" {
		if s.httpLis, err = net.Listen("tcp", s.cfg.MetricsAddr); err != nil {
			lis.Close()
			return fmt.Errorf("listening on %s: %w", s.cfg.MetricsAddr, err)
		}
	}
	return nil
}

func (s *Server) closeListeners() {
	s.grpcLis.Close()
	if s.httpLis != nil {
		s.httpLis.Close()
	}
}

func (s *Server) newGRPCServer(ctx context.Context) (*grpc.Server, error) {
	opts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(s.cfg.MaxRequestBytes + grpcOverheadBytes),
		grpc.MaxSendMsgSize(maxSendBytes),
		grpc.MaxConcurrentStreams(math.MaxUint32),
		// As etcd: clients ping every 30 s on open streams, which a
		// minimum of 5 s allows; grpc-go's default would GOAWAY them.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: keepAliveMinTime}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: keepAliveInterval, Timeout: keepAliveTimeout}),
	}
	if s.cfg.ServerTLS.CertFile != "" {
		info := s.cfg.ServerTLS
		info.ClientCertAuth = info.TrustedCAFile != ""
		tlsCfg, err := info.ServerConfig()
		if err != nil {
			return nil, fmt.Errorf("serving TLS: %w", err)
		}
		opts = append(opts, grpc.Creds(credentials.NewTLS(tlsCfg)))
	}
	gs := grpc.NewServer(opts...)
	conn := s.client.ActiveConnection()
	pb.RegisterKVServer(gs, kvproxy.New(kvproxy.Config{
		Store:             s.store,
		Follower:          s.follower,
		Upstream:          pb.NewKVClient(conn),
		Logger:            s.lg.Named("kv"),
		Metrics:           kvproxy.NewMetrics(s.registry),
		RevisionWait:      s.cfg.RevisionWait,
		FreshnessTimeout:  s.cfg.FreshnessTimeout,
		MaxForwardedReads: s.cfg.MaxForwardedReads,
		Inconsistent:      s.checker.Fallback,

		ConsistentReadFallback: s.cfg.ConsistentReadFallback,
	}))
	s.watch = watchproxy.New(watchproxy.Config{
		Store:                  s.store,
		Follower:               s.follower,
		Upstream:               pb.NewWatchClient(conn),
		ProgressNotifyInterval: s.cfg.WatchProgressNotifyInterval,
		FragmentBytes:          s.cfg.MaxRequestBytes + grpcOverheadBytes,
		Inconsistent:           s.checker.Fallback,
		Logger:                 s.lg.Named("watch"),
		Metrics:                watchproxy.NewMetrics(s.registry),
	})
	pb.RegisterWatchServer(gs, s.watch)
	s.keepAlives = newKeepAlives(ctx, pb.NewLeaseClient(conn), s.lg.Named("lease"))
	pb.RegisterLeaseServer(gs, &leaseServer{upstream: pb.NewLeaseClient(conn), ka: s.keepAlives})
	pb.RegisterClusterServer(gs, newClusterServer(pb.NewClusterClient(conn), memberName(), s.advertiseURLs()))
	pb.RegisterMaintenanceServer(gs, grpcproxy.NewMaintenanceProxy(s.client))
	pb.RegisterAuthServer(gs, grpcproxy.NewAuthProxy(s.client))
	s.health = health.NewServer()
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	healthpb.RegisterHealthServer(gs, s.health)
	return gs, nil
}

func memberName() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return defaultMemberName + "-" + h
	}
	return defaultMemberName
}

func (s *Server) advertiseURLs() []string {
	if len(s.cfg.AdvertiseClientURLs) > 0 {
		return s.cfg.AdvertiseClientURLs
	}
	scheme := "http"
	if s.cfg.ServerTLS.CertFile != "" {
		scheme = "https"
	}
	return []string{scheme + "://" + s.grpcLis.Addr().String()}
}

// Addr is the address the gRPC API is served on.
func (s *Server) Addr() string { return s.grpcLis.Addr().String() }

// MetricsAddr is the address of the HTTP endpoint, or "" if disabled.
func (s *Server) MetricsAddr() string {
	if s.httpLis == nil {
		return ""
	}
	return s.httpLis.Addr().String()
}

// Store is the cache, for tests and the consistency checker.
func (s *Server) Store() *revtree.Store { return s.store }

// Follower is the upstream follower, for tests and the consistency checker.
func (s *Server) Follower() *progress.Follower { return s.follower }

// Ready is closed once the cache has loaded etcd's keyspace.
func (s *Server) Ready() <-chan struct{} { return s.follower.Ready() }

// Checker is the consistency checker.
func (s *Server) Checker() *hashcheck.Checker { return s.checker }

// Registry holds the server's metrics.
func (s *Server) Registry() *prometheus.Registry { return s.registry }

// Err reports a fatal serving error; Stop the server after one.
func (s *Server) Err() <-chan error { return s.errc }

// Stop stops serving: open RPCs get up to ten seconds to finish, then are
// cut. It waits for every goroutine the server started.
func (s *Server) Stop() {
	s.once.Do(func() {
		s.health.Shutdown()
		s.watch.Close() // watch streams never end on their own
		stopped := make(chan struct{})
		go func() {
			s.grpcServer.GracefulStop()
			close(stopped)
		}()
		t := time.NewTimer(gracefulStopTimeout)
		select {
		case <-stopped:
			t.Stop()
		case <-t.C:
			s.grpcServer.Stop()
			<-stopped
		}
		if s.httpServer != nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			s.httpServer.Shutdown(ctx)
			cancel()
		}
		s.cancel()
		s.wg.Wait()
		s.client.Close()
	})
}
