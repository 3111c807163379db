package server

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/proxy/grpcproxy"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/internal/coalesce"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
	"github.com/etcd-snapcache/etcd-snapcache/watchproxy"
)

// etcd's gRPC server limits and defaults (server/embed/config.go,
// api/v3rpc/grpc.go), and the proxy's own.
const (
	defaultMaxRequestBytes        = 1.5 * 1024 * 1024
	grpcOverheadBytes             = 512 * 1024
	maxSendBytes                  = math.MaxInt32
	defaultKeepAliveMinTime       = 5 * time.Second
	defaultKeepAliveInterval      = 2 * time.Hour
	defaultKeepAliveTimeout       = 20 * time.Second
	defaultDialTimeout            = 5 * time.Second
	defaultAuthTokenCheckInterval = 5 * time.Second
	gracefulStopTimeout           = 10 * time.Second
	defaultMemberName             = "etcd-snapcache"
	// defaultDialKeepAliveTime: grpc-proxy pings etcd never by default;
	// the proxy pings every 30 s, because a silently dead connection
	// would leave its cache stale without any error.
	defaultDialKeepAliveTime = 30 * time.Second
)

// Metrics levels, etcd's --metrics.
const (
	MetricsBasic     = "basic"
	MetricsExtensive = "extensive" // adds grpc_server_handling_seconds
)

// Config configures a Server. Durations and limits follow one rule: 0 is
// the default, a negative value disables.
type Config struct {
	// Endpoints of the upstream etcd cluster, as host:port or URLs.
	Endpoints []string
	// EndpointsAutoSyncInterval makes the upstream client sync its
	// endpoints from etcd's member list (0: never).
	EndpointsAutoSyncInterval time.Duration
	// ListenAddr is where the etcd API (gRPC) and the HTTP endpoints are
	// served (host:port; port 0 picks).
	ListenAddr string
	// MetricsAddr also serves the HTTP endpoints: a URL (http:// or
	// https://, served with the serving TLS) or host:port; empty: none.
	MetricsAddr string
	// AdvertiseClientURLs are what MemberList returns as the proxy's
	// client URLs. Nil defaults to the listen address with the serving
	// scheme; with ForwardMemberList, MemberList is etcd's.
	AdvertiseClientURLs []string
	ForwardMemberList   bool
	// ResolverPrefix and ResolverTTL register the proxy under the prefix in
	// etcd, with a lease of that TTL (seconds), and make MemberList list
	// the proxies registered there, as grpc-proxy's --resolver-prefix.
	ResolverPrefix string
	ResolverTTL    int
	// ServerTLS secures the client port when CertFile is set (with
	// CRLFile, CipherSuites and the TLS versions); a TrustedCAFile makes it
	// require and verify client certificates.
	ServerTLS transport.TLSInfo
	// AutoTLS serves TLS with a self-signed certificate, kept under
	// DataDir, when ServerTLS has none; SelfSignedCertValidity is its
	// validity in years (1 if 0).
	AutoTLS                bool
	DataDir                string
	SelfSignedCertValidity uint
	// User and Password are the proxy's own identity in etcd, for its load,
	// watch, probes, consistency check and auth mirror (etcdctl's --user
	// and --password). Requests forwarded for callers never carry it.
	User, Password string
	// ClientCertAuth is etcd's --client-cert-auth, and must match the
	// upstream's: a caller without a token is the user its verified client
	// certificate names (the proxy must then serve TLS with a trusted CA).
	// Without it, a certificate's common name means nothing, as in front
	// of an etcd without the flag.
	ClientCertAuth bool
	// AuthToken is the upstream's --auth-token: "simple" (or empty), or
	// "jwt,pub-key=<file>,sign-method=<alg>", whose public key lets the
	// proxy verify the JWTs etcd issued and serve their reads from the
	// cache. A JWT the proxy cannot verify is forwarded with its request.
	AuthToken string
	// AuthTokenCheckInterval is how long the proxy trusts a token etcd
	// accepted before showing it to etcd again; each showing is a use that
	// keeps a simple token alive in etcd (default 5 s, well under etcd's
	// --auth-token-ttl of 300 s).
	AuthTokenCheckInterval time.Duration
	// UpstreamTLS secures the connection to etcd when any file is set;
	// InsecureSkipTLSVerify skips verifying etcd's certificate.
	UpstreamTLS           transport.TLSInfo
	InsecureSkipTLSVerify bool
	// DialTimeout bounds the first connection to etcd.
	DialTimeout time.Duration
	// DialKeepAliveTime and DialKeepAliveTimeout are the upstream
	// connection's keepalive pings (defaults 30 s and 20 s);
	// PermitWithoutStream pings without open streams too.
	DialKeepAliveTime, DialKeepAliveTimeout time.Duration
	PermitWithoutStream                     bool
	// MaxSendBytes and MaxRecvBytes bound the messages sent to and received
	// from etcd (default: unlimited, so that etcd judges request sizes).
	MaxSendBytes, MaxRecvBytes int
	// MaxConcurrentStreams bounds each client connection's streams
	// (default: unlimited, as etcd).
	MaxConcurrentStreams uint32
	// GRPCKeepAliveMinTime, GRPCKeepAliveInterval and GRPCKeepAliveTimeout
	// are the client port's keepalive policy (etcd's 5 s, 2 h, 20 s).
	GRPCKeepAliveMinTime, GRPCKeepAliveInterval, GRPCKeepAliveTimeout time.Duration
	// EnablePprof serves /debug/pprof/ on the client port.
	EnablePprof bool
	// EnableGRPCLogging logs every request and response.
	EnableGRPCLogging bool
	// Metrics is MetricsBasic (default) or MetricsExtensive.
	Metrics string
	// GRPCServerOptions are added to the gRPC server's options (tests use
	// them to add interceptors).
	GRPCServerOptions []grpc.ServerOption

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
	// WatchProgressNotifyInterval, if set, is the interval of periodic
	// progress notifications to idle progress_notify watchers; if 0 they
	// follow etcd's own interval.
	WatchProgressNotifyInterval time.Duration

	Logger *zap.Logger
}

// withDefaults fills in the defaults of zero fields, and turns negative
// ones (disabled) into the zero their consumers read as disabled.
func (cfg Config) withDefaults() Config {
	orDefault := func(d *time.Duration, def time.Duration) {
		switch {
		case *d == 0:
			*d = def
		case *d < 0:
			*d = 0
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	orDefault(&cfg.DialTimeout, defaultDialTimeout)
	orDefault(&cfg.AuthTokenCheckInterval, defaultAuthTokenCheckInterval)
	orDefault(&cfg.DialKeepAliveTime, defaultDialKeepAliveTime)
	orDefault(&cfg.DialKeepAliveTimeout, defaultKeepAliveTimeout)
	orDefault(&cfg.GRPCKeepAliveMinTime, defaultKeepAliveMinTime)
	orDefault(&cfg.GRPCKeepAliveInterval, defaultKeepAliveInterval)
	orDefault(&cfg.GRPCKeepAliveTimeout, defaultKeepAliveTimeout)
	if cfg.FreshnessTimeout <= 0 {
		cfg.FreshnessTimeout = kvproxy.DefaultFreshnessTimeout
	}
	if cfg.MaxRequestBytes <= 0 {
		cfg.MaxRequestBytes = defaultMaxRequestBytes
	}
	if cfg.MaxSendBytes <= 0 {
		cfg.MaxSendBytes = math.MaxInt32
	}
	if cfg.MaxRecvBytes <= 0 {
		cfg.MaxRecvBytes = defaultMaxRecvBytes
	}
	if cfg.MaxConcurrentStreams == 0 {
		cfg.MaxConcurrentStreams = math.MaxUint32
	}
	if cfg.SelfSignedCertValidity == 0 {
		cfg.SelfSignedCertValidity = 1
	}
	if cfg.Metrics == "" {
		cfg.Metrics = MetricsBasic
	}
	return cfg
}

// Server is a running etcd-snapcache.
type Server struct {
	cfg    Config
	lg     *zap.Logger
	tls    *transport.TLSInfo // the client port's TLS; nil: plaintext
	client *clientv3.Client   // of the upstream etcd, for callers' requests: no identity of its own
	own    *clientv3.Client   // of the upstream etcd, as the proxy itself (User); client if none
	self   *clientv3.Client   // of the proxy's own API, for /proxy/health
	// upstreamCN is the common name of the proxy's upstream client
	// certificate: etcd with --client-cert-auth takes it for a user.
	upstreamCN string
	authMirror *authcache.Mirror
	tokens     *tokens // the callers' tokens the proxy can attribute
	// probeKV reads etcd through the forwarding connection: with a
	// caller's context it shows etcd the caller's token.
	probeKV pb.KVClient
	// disabledProof shares the anonymous quorum reads that prove auth
	// disabled (freshAuth).
	disabledProof *coalesce.Call[bool]
	noMirrorLog   sync.Once // the error of refusing certificate callers
	releaseRules  atomic.Pointer[releaseRules]
	store         *revtree.Store
	follower      *progress.Follower
	registry      *prometheus.Registry

	grpcServer        *grpc.Server
	clientLis         net.Listener // gRPC and HTTP
	clientHTTP        *http.Server
	metricsLis        net.Listener // nil without MetricsAddr
	metricsHTTP       *http.Server
	health            *health.Server
	checker           *hashcheck.Checker
	keepAlives        *keepAlives // anonymous callers' keepalives
	asProxyKeepAlives *keepAlives // certificate callers', checked, as the proxy
	watch             *watchproxy.Server
	// clientDone are closed when goroutines of etcd's grpcproxy that live
	// as long as the upstream client end, after it is closed.
	clientDone []<-chan struct{}

	cancel   context.CancelFunc
	wg       sync.WaitGroup // every goroutine the server starts
	errc     chan error
	stopping atomic.Bool
	once     sync.Once
}

// Start dials etcd, starts following it and serves until Stop. It returns
// once the listeners are bound; the cache loads in the background.
func Start(cfg Config) (*Server, error) {
	cfg = cfg.withDefaults()
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("no upstream etcd endpoints")
	}
	s := &Server{cfg: cfg, lg: cfg.Logger, errc: make(chan error, 4), registry: prometheus.NewRegistry()}
	s.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var err error
	if s.tls, err = s.servingTLS(); err != nil {
		return nil, err
	}
	if cfg.ClientCertAuth && (s.tls == nil || s.tls.TrustedCAFile == "") {
		return nil, errors.New("--client-cert-auth: client certificates are verified only with serving TLS and --trusted-ca-file")
	}
	if s.upstreamCN, err = certCommonName(cfg.UpstreamTLS.CertFile); err != nil {
		return nil, fmt.Errorf("--cert: %w", err)
	}
	clientMetrics := grpcprom.NewClientMetrics()
	s.registry.MustRegister(clientMetrics)
	s.tokens = newTokens()
	if s.client, err = s.dialUpstream(clientMetrics, "", "", s.watchTokens); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			s.closeAll()
		}
	}()
	s.own = s.client
	if cfg.User != "" {
		if s.own, err = s.dialUpstream(clientMetrics, cfg.User, cfg.Password); err != nil {
			return nil, err
		}
	}
	jwt, err := authcache.NewJWTProvider(s.lg.Named("auth"), cfg.AuthToken)
	if err != nil {
		return nil, fmt.Errorf("--auth-token: %w", err)
	}
	s.authMirror = authcache.NewMirror(authcache.MirrorConfig{
		Auth:         pb.NewAuthClient(s.own.ActiveConnection()),
		EnabledProbe: s.authEnabledProbe(),
		JWT:          jwt,
		Logger:       s.lg.Named("auth"),
	})
	s.probeKV = pb.NewKVClient(s.client.ActiveConnection())
	s.disabledProof = coalesce.New(s.authEnabledNow)

	s.store = revtree.New(cfg.BTreeDegree)
	s.follower = progress.New(progress.Config{
		Client:                  s.own,
		Store:                   s.store,
		Logger:                  s.lg.Named("follower"),
		Metrics:                 progress.NewMetrics(s.registry),
		LoadPageSize:            cfg.LoadPageSize,
		CompactionProbeInterval: cfg.CompactionProbeInterval,
		LoadRetainedHistory:     cfg.LoadRetainedHistory,
		BeforeLoadPage:          cfg.BeforeLoadPage,
		// The checker is built next; resumes happen only once Run began.
		VerifyHistory: func(ctx context.Context, rev int64) (bool, error) { return s.checker.SameHistory(ctx, rev) },
	})
	s.checker = hashcheck.New(hashcheck.Config{
		Store:      s.store,
		Follower:   s.follower,
		Upstream:   pb.NewKVClient(s.own.ActiveConnection()),
		Interval:   cfg.ConsistencyCheckInterval,
		Logger:     s.lg.Named("hashcheck"),
		Registerer: s.registry,
	})
	s.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_ready",
		Help: "1 while the cache answers for etcd (loaded, not reloading), as /readyz reports.",
	}, func() float64 { return boolGauge(s.follower.Serving()) }), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_upstream_watch_connected",
		Help: "1 while the upstream watch that feeds the cache is established.",
	}, func() float64 { return boolGauge(s.follower.Following()) }))

	if s.clientLis, err = net.Listen("tcp", cfg.ListenAddr); err != nil {
		return nil, fmt.Errorf("--listen-addr %s: %w", cfg.ListenAddr, err)
	}
	if cfg.MetricsAddr != "" {
		if s.metricsLis, err = listenMetrics(cfg.MetricsAddr, s.tls); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	if s.grpcServer, err = s.newGRPCServer(ctx); err != nil {
		return nil, err
	}
	if cfg.ResolverPrefix != "" {
		if urls := s.advertiseURLs(); len(urls) > 0 {
			s.clientDone = append(s.clientDone, grpcproxy.Register(s.lg.Named("resolver"), s.client, cfg.ResolverPrefix, urls[0], cfg.ResolverTTL))
		}
	}
	if s.self, err = s.dialSelf(); err != nil {
		return nil, err
	}
	endpoints, err := s.newHTTPEndpoints()
	if err != nil {
		return nil, err
	}
	if err := s.serveClientPort(s.grpcServer, newHTTPMux(endpoints, cfg.EnablePprof)); err != nil {
		return nil, err
	}
	if s.metricsLis != nil {
		s.metricsHTTP = s.newHTTPServer(newHTTPMux(endpoints, false))
		s.serve("metrics", func() error { return s.metricsHTTP.Serve(s.metricsLis) })
	}
	s.run(func() { s.keepAlives.run() })
	s.run(func() { s.asProxyKeepAlives.run() })
	if cfg.ConsistencyCheckInterval >= 0 {
		s.run(func() { s.checker.Run(ctx) })
	}
	s.run(func() { s.follower.Run(ctx) })
	s.run(func() { s.authMirror.Run(ctx) })
	s.disabledProof.Start(ctx)
	s.run(func() {
		<-ctx.Done()
		s.disabledProof.Stop()
	})
	s.run(func() {
		select {
		case <-s.follower.Ready():
			s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		case <-ctx.Done():
		}
	})
	ok = true
	// grpc-proxy's words: tooling (etcd's e2e framework) waits for them.
	s.lg.Info("started gRPC proxy",
		zap.String("listen-addr", s.clientLis.Addr().String()),
		zap.Bool("tls", s.tls != nil),
		zap.String("metrics-addr", s.MetricsAddr()),
		zap.Strings("upstream", cfg.Endpoints),
		zap.Strings("advertise-client-urls", s.advertiseURLs()))
	return s, nil
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// run runs fn on a goroutine the server owns.
func (s *Server) run(fn func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		fn()
	}()
}

// dialSelf returns a client of the proxy's own API, as grpc-proxy dials
// itself for /proxy/health: over the serving TLS, with the serving
// certificate as its client certificate.
func (s *Server) dialSelf() (*clientv3.Client, error) {
	addr := s.clientLis.Addr().(*net.TCPAddr)
	host := addr.IP.String()
	if addr.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	scheme := "http"
	cfg := clientv3.Config{DialTimeout: defaultDialTimeout, Logger: s.lg.Named("self")}
	if s.tls != nil {
		scheme = "https"
		tlsCfg, err := s.tls.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("serving TLS as a client of the proxy: %w", err)
		}
		cfg.TLS = tlsCfg
	}
	cfg.Endpoints = []string{scheme + "://" + net.JoinHostPort(host, strconv.Itoa(addr.Port))}
	return clientv3.New(cfg)
}

func (s *Server) newHTTPEndpoints() (httpEndpoints, error) {
	tlsCfg, err := ClientTLSConfig(s.cfg.UpstreamTLS, s.cfg.InsecureSkipTLSVerify)
	if err != nil {
		return httpEndpoints{}, fmt.Errorf("upstream TLS: %w", err)
	}
	return httpEndpoints{
		lg:           s.lg.Named("http"),
		gatherer:     s.registry,
		upstream:     s.own,
		upstreamHTTP: &http.Client{Transport: &http.Transport{TLSClientConfig: tlsCfg}, Timeout: 10 * time.Second},
		upstreamEPs:  s.client.Endpoints(),
		self:         s.self,
		probes: &probes{
			livez: []probeCheck{{"ping", func() error { return nil }}},
			readyz: []probeCheck{{"cache", func() error {
				if !s.follower.Serving() {
					if err := s.follower.LoadError(); err != nil {
						return fmt.Errorf("the cache is loading: %w", err)
					}
					return errors.New("the cache is loading")
				}
				return nil
			}}},
		},
	}, nil
}

func (s *Server) advertiseURLs() []string {
	switch {
	case s.cfg.ForwardMemberList:
		return nil
	case len(s.cfg.AdvertiseClientURLs) > 0:
		return s.cfg.AdvertiseClientURLs
	}
	scheme := "http"
	if s.tls != nil {
		scheme = "https"
	}
	return []string{scheme + "://" + s.clientLis.Addr().String()}
}

// Addr is the address the gRPC API is served on.
func (s *Server) Addr() string { return s.clientLis.Addr().String() }

// MetricsAddr is the address of the metrics listener, or "" if none.
func (s *Server) MetricsAddr() string {
	if s.metricsLis == nil {
		return ""
	}
	return s.metricsLis.Addr().String()
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
		s.stopping.Store(true)
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
		s.closeAll()
	})
}

// closeAll stops what is left after the gRPC server: the HTTP servers, the
// listeners, the goroutines, and the clients.
func (s *Server) closeAll() {
	s.stopping.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for _, h := range []*http.Server{s.clientHTTP, s.metricsHTTP} {
		if h != nil {
			if h.Shutdown(ctx) != nil {
				h.Close()
			}
		}
	}
	for _, l := range []net.Listener{s.clientLis, s.metricsLis} {
		if l != nil {
			l.Close()
		}
	}
	if s.cancel != nil {
		s.cancel()
	}
	s.wg.Wait()
	if s.self != nil {
		s.self.Close()
	}
	if s.own != nil && s.own != s.client {
		s.own.Close()
	}
	s.client.Close()
	for _, done := range s.clientDone {
		<-done
	}
}
