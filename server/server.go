package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
	"github.com/etcd-snapcache/etcd-snapcache/internal/memlimit"
	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
	"github.com/etcd-snapcache/etcd-snapcache/internal/tlsmux"
	"github.com/etcd-snapcache/etcd-snapcache/internal/tracing"
	"github.com/etcd-snapcache/etcd-snapcache/persist"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Server is a running etcd-snapcache.
type Server struct {
	cfg    Config
	lg     *zap.Logger
	tls    *transport.TLSInfo // the client port's TLS; nil: plaintext
	client *clientv3.Client   // of the upstream etcd, for callers' requests: no identity of its own
	own    *clientv3.Client   // of the upstream etcd, as the proxy itself (User); client if none
	self   *clientv3.Client   // of the proxy's own API, for /proxy/health
	// tracing is the tracer provider of --enable-distributed-tracing; nil
	// with tracing off.
	tracing *tracing.Tracing
	// gateway serves etcd's JSON gateway on the client port; nil when
	// disabled.
	gateway *gateway
	// gate decides, per request, what etcd would of its caller. It is made
	// before the upstream connections, whose calls run its token watcher;
	// Start gives it them and the follower (Connect) once they exist.
	gate     *gate.Gate
	store    *revtree.Store
	follower *progress.Follower
	checker  *hashcheck.Checker
	// persister keeps the cache's copy on disk; nil without PersistDir.
	persister *persist.Persister
	registry  *prometheus.Registry
	// heapLive is the live heap of the last collection, which an
	// automatic memory limit never goes below (runtimeHeapLive).
	heapLive func() int64

	grpcServer *grpc.Server
	clientLis  net.Listener // gRPC and HTTP
	// clientRaw and metricsRaw are the listening sockets under
	// clientLis and metricsLis (which hold accepts during a handover,
	// and may add TLS): what a handover passes on.
	clientRaw, metricsRaw net.Listener
	// acceptsOpen is closed when the listeners accept: at once, or
	// once ready when they were handed over.
	acceptsOpen chan struct{}
	clientHTTP  *http.Server
	tlsMux      *tlsmux.Mux  // with TLS: the client port's connections by protocol
	metricsLis  net.Listener // nil without MetricsAddr
	metricsHTTP *http.Server
	// svc are the etcd API's services, which grpcServer serves.
	svc services
	// clientDone are closed when goroutines of etcd's grpcproxy that live
	// as long as the upstream client end, after it is closed.
	clientDone []<-chan struct{}

	cancel context.CancelFunc
	wg     sync.WaitGroup // every goroutine the server starts
	errc   chan error
	// stopping is set when Stop begins, or a failed Start closes what it
	// opened: the proxy reports itself not ready while open requests
	// finish, and its listeners' closing errors are expected.
	stopping atomic.Bool
	once     sync.Once
	// stopped is done once Stop begins: it ends the streams that never
	// end by themselves (endOnStop).
	stopped    context.Context
	stopStream context.CancelFunc
	// now closes when StopNow is called: open requests are cut.
	now     chan struct{}
	nowOnce sync.Once
	// firstReady opens the accepts, and tells a handover, the first time
	// the proxy is ready.
	firstReady sync.Once
}

// Start dials etcd, starts following it and serves until Stop. It returns
// once the listeners are bound; the cache loads in the background.
//
// Each step builds what the next ones read, so that the order below is the
// data flow; the few edges back are named where they are made.
func Start(cfg Config) (*Server, error) {
	s, err := newServer(cfg)
	if err != nil {
		return nil, err
	}
	// The gate comes before the connections to etcd: the forwarding one
	// runs its token watcher on every call.
	if s.gate, err = s.newGate(); err != nil {
		return nil, err
	}
	// Made before the connections and the gRPC server that trace with it.
	if s.tracing, err = tracing.New(context.Background(), cfg.Tracing); err != nil {
		return nil, err
	}
	if err := s.connectUpstream(); err != nil {
		s.shutdownTracing()
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			if s.grpcServer != nil {
				s.grpcServer.Stop() // ends its stream workers
			}
			s.closeAll()
		}
	}()
	s.buildCache()
	// The gate gets the connections it was made before, and the follower
	// whose state it reads, before any request (none is served before
	// servePorts).
	s.gate.Connect(gate.Upstream{
		Forwarding: s.client.ActiveConnection(),
		Own:        s.own.ActiveConnection(),
		Follower:   s.follower,
		Tracer:     s.tracing.Tracer(),
	})
	s.registerMetrics()
	if err := s.listen(); err != nil {
		return nil, err
	}
	// Whatever starts from here runs until closeAll cancels ctx, on
	// goroutines the server owns.
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.startGate(ctx)
	s.svc = s.newServices(ctx)
	s.grpcServer = s.newGRPCServer(s.svc)
	s.advertise()
	if err := s.servePorts(); err != nil {
		return nil, err
	}
	s.runBackground(ctx)
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

// newServer checks cfg and returns a server with what needs nothing
// opened: its registry, with the Go and process collectors, and its
// serving TLS.
func newServer(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	s := &Server{cfg: cfg, lg: cfg.Logger, errc: make(chan error, 4), registry: prometheus.NewRegistry(), heapLive: memlimit.HeapLive, now: make(chan struct{})}
	s.stopped, s.stopStream = context.WithCancel(context.Background())
	s.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var err error
	if s.tls, err = s.servingTLS(); err != nil {
		return nil, err
	}
	if cfg.ClientCertAuth && (s.tls == nil || s.tls.TrustedCAFile == "") {
		return nil, errors.New("--client-cert-auth: client certificates are verified only with serving TLS and --trusted-ca-file")
	}
	return s, nil
}

// newGate returns the auth gate; it is given etcd by Connect.
func (s *Server) newGate() (*gate.Gate, error) {
	return gate.New(gate.Config{
		User:               s.cfg.User,
		UpstreamCertFile:   s.cfg.UpstreamTLS.CertFile,
		ClientCertAuth:     s.cfg.ClientCertAuth,
		AuthToken:          s.cfg.AuthToken,
		TokenCheckInterval: s.cfg.AuthTokenCheckInterval,
		FreshnessTimeout:   s.cfg.FreshnessTimeout,
		Logger:             s.lg.Named("auth"),
	})
}

// registerMetrics registers the proxy's own gauges: readiness, the
// upstream watch, the mode, and what /proxy/status says of the upstream.
func (s *Server) registerMetrics() {
	s.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_ready",
		Help: "1 while the proxy is ready, as /readyz reports: the cache answers for etcd (loaded, not reloading), the upstream watch is not lost, and the proxy is not stopping.",
	}, func() float64 { return boolGauge(s.notReady() == nil) }), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "etcd_snapcache_upstream_watch_connected",
		Help: "1 while the upstream watch that feeds the cache is established.",
	}, func() float64 { return boolGauge(s.follower.Following()) }))
	for _, m := range proxystatus.Modes {
		s.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "etcd_snapcache_mode",
			Help:        "1 for what the proxy serves from now: cache (the cache answers for etcd), loading (the cache is being loaded or reloaded), forwarding (the cache is off: the proxy has no identity of its own and etcd has auth enabled, so every request goes to etcd as it came), fallback (the consistency checker found the cache inconsistent: reads and watches go to etcd).",
			ConstLabels: prometheus.Labels{"mode": string(m)},
		}, func() float64 { return boolGauge(s.mode() == m) }))
	}
	// Process-wide, as the balancer that probes the members is.
	s.registry.MustRegister(drain.Collector(), watchMemberCollector{s.follower})
	s.registerStatusMetrics()
}

// startGate runs the gate's mirror of etcd's auth state until ctx is done,
// and waits for it then, on a goroutine of the server.
func (s *Server) startGate(ctx context.Context) {
	s.gate.Start(ctx)
	s.run(func() {
		<-ctx.Done()
		s.gate.Stop()
	})
}

// runBackground runs the server's loops until ctx is done, each on a
// goroutine of the server: the lease keepalive coalescers, the checker,
// the follower (which loads the cache), the persister, readiness, and the
// memory limit.
func (s *Server) runBackground(ctx context.Context) {
	s.run(func() { s.svc.lease.ka.run() })
	s.run(func() { s.svc.lease.asProxyKA.run() })
	s.run(func() { s.checker.Run(ctx) })
	s.run(func() { s.follower.Run(ctx) })
	if s.persister != nil {
		s.run(func() { s.persister.Run(ctx, s.follower) })
	}
	s.run(func() { s.followReadiness(ctx) })
	s.startMemoryLimit(ctx)
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
	scheme := "http"
	cfg := clientv3.Config{DialTimeout: connectTimeout, Logger: s.lg.Named("self")}
	if s.tls != nil {
		scheme = "https"
		tlsCfg, err := s.tls.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("serving TLS as a client of the proxy: %w", err)
		}
		cfg.TLS = tlsCfg
	}
	cfg.Endpoints = []string{scheme + "://" + s.selfAddr()}
	return clientv3.New(cfg)
}

// selfAddr is the address at which the proxy dials its own client port
// (for /proxy/health and the JSON gateway): the loopback address when it
// listens on every address.
func (s *Server) selfAddr() string {
	addr := s.clientLis.Addr().(*net.TCPAddr)
	host := addr.IP.String()
	if addr.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, strconv.Itoa(addr.Port))
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
		status:       s.status,
		probes: &probes{
			livez:  []probeCheck{{name: "ping", check: func() error { return nil }}},
			readyz: s.readyChecks(),
		},
	}, nil
}

// readyChecks are the checks of /readyz, which the gRPC health service
// and the ready metric follow too: the cache answers for etcd, the proxy
// knows whether etcd has auth enabled, the upstream watch that feeds the
// cache is not lost, and the proxy is not stopping (Kubernetes' "shutdown"
// check).
func (s *Server) readyChecks() []probeCheck {
	return []probeCheck{
		{name: "cache", note: s.forwardingNote, check: func() error {
			if s.gate.Forwarding() {
				// Every request goes to etcd, which answers it: the
				// proxy is a correct proxy, without its cache.
				return nil
			}
			switch s.follower.Phase() {
			case progress.PhaseServing:
				return nil
			case progress.PhaseReloading:
				return errors.New("the cache is reloading from etcd")
			case progress.PhaseStopped:
				return errors.New("the cache is stopped")
			}
			if err := s.follower.LoadError(); err != nil {
				return fmt.Errorf("the cache is loading: %w", err)
			}
			return errors.New("the cache is loading")
		}},
		{name: "auth", check: func() error {
			// Until then a cached read must ask etcd for its auth
			// state (an AuthStatus, which etcd commits through raft)
			// before it is served.
			if !s.gate.AuthStateKnown() {
				return errors.New("etcd's auth state is not known yet")
			}
			return nil
		}},
		{name: "upstream", check: func() error {
			if s.gate.Forwarding() {
				return nil // no cache for the watch to feed
			}
			return upstreamLost(s.follower.NotFollowingSince(), time.Now(), s.cfg.UpstreamLostThreshold)
		}},
		{name: "shutdown", check: func() error {
			if s.stopping.Load() {
				return errors.New("process is shutting down")
			}
			return nil
		}},
	}
}

// forwardingNote says, while the cache is off because the proxy has no
// identity of its own in front of an etcd with auth enabled, what it does
// instead and how to turn the cache on; "" otherwise.
func (s *Server) forwardingNote() string {
	if !s.gate.Forwarding() {
		return ""
	}
	return "the cache is off, every request goes to etcd as it came (as etcd's grpc-proxy sends it): etcd has auth enabled and the proxy has no identity of its own; give it a user with the root role (--user) or a client certificate naming one to turn the cache on"
}

// mode is what the proxy serves from: the cache (it answers for etcd),
// loading (it is being loaded or reloaded), forwarding (it is off: no
// identity of its own in front of an etcd with auth enabled), or fallback
// (the consistency checker found it inconsistent).
func (s *Server) mode() proxystatus.Mode {
	switch {
	case s.gate.Forwarding():
		return proxystatus.ModeForwarding
	case s.checker.Fallback():
		return proxystatus.ModeFallback
	case s.follower.Phase() == progress.PhaseServing:
		return proxystatus.ModeCache
	}
	return proxystatus.ModeLoading
}

// upstreamLost is the upstream check's verdict: an error once the upstream
// watch has been down (since down, zero while it is up) for longer than
// threshold (never with threshold 0).
func upstreamLost(down, now time.Time, threshold time.Duration) error {
	if down.IsZero() || threshold <= 0 {
		return nil
	}
	if d := now.Sub(down); d > threshold {
		return fmt.Errorf("the upstream watch has been down for %v (more than %v)", d.Round(time.Millisecond), threshold)
	}
	return nil
}

// notReady is why the proxy is not ready, nil if it is.
func (s *Server) notReady() error {
	for _, c := range s.readyChecks() {
		if err := c.check(); err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
	}
	return nil
}

// followReadiness keeps the gRPC health service in line with /readyz
// until ctx is done, and logs each change.
func (s *Server) followReadiness(ctx context.Context) {
	t := time.NewTicker(readinessInterval)
	defer t.Stop()
	serving := false
	// Each nil once closed: turn SERVING at once when the last one is,
	// rather than at the next tick.
	loaded, authKnown := s.follower.Ready(), s.gate.AuthKnown()
	for {
		err := s.notReady()
		switch {
		case err == nil && !serving:
			s.svc.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
			s.lg.Info("ready")
			s.firstReady.Do(s.firstReadiness)
		case err != nil && serving:
			s.svc.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
			s.lg.Warn("not ready", zap.Error(err))
		}
		serving = err == nil
		select {
		case <-ctx.Done():
			return
		case <-loaded:
			loaded = nil
		case <-authKnown:
			authKnown = nil
		case <-t.C:
		}
	}
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

// Stop stops serving. First the proxy reports itself not ready (/readyz,
// the gRPC health service), then it stops gracefully: the streams that
// never end by themselves (watches, relayed ones included, lease
// keepalives, election observers) end with etcd's "server stopped", which
// clients retry elsewhere, and the other open RPCs get up to ten seconds
// to finish, or until StopNow, before they are cut. It waits for every
// goroutine the server started.
func (s *Server) Stop() {
	s.once.Do(func() {
		s.stopping.Store(true)
		s.svc.health.Shutdown()
		s.lg.Info("stopping: not ready; ending watch and keepalive streams; open requests get up to " + gracefulStopTimeout.String())
		s.stopStream()
		s.svc.watch.Close()
		stopped := make(chan struct{})
		go func() {
			s.grpcServer.GracefulStop()
			close(stopped)
		}()
		t := time.NewTimer(gracefulStopTimeout)
		select {
		case <-stopped:
		case <-t.C:
			s.lg.Warn("open requests did not finish in time; cutting them")
			s.grpcServer.Stop()
			<-stopped
		case <-s.now:
			s.lg.Warn("stopping at once; cutting open requests")
			s.grpcServer.Stop()
			<-stopped
		}
		t.Stop()
		s.closeAll()
	})
}

// StopNow stops as Stop does, except that open RPCs are cut at once; during
// a Stop, it cuts the RPCs that Stop waits for (a second signal).
func (s *Server) StopNow() {
	s.nowOnce.Do(func() { close(s.now) })
	s.Stop()
}

// endlessStreams are the streaming methods that never end by themselves.
var endlessStreams = map[string]bool{
	"/etcdserverpb.Watch/Watch":          true,
	"/etcdserverpb.Lease/LeaseKeepAlive": true,
	"/v3electionpb.Election/Observe":     true,
}

// endOnStop ends the streams that never end by themselves, relayed ones
// included, when Stop begins, with etcd's "server stopped" (Unavailable),
// so that a graceful stop does not wait for them.
func (s *Server) endOnStop(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if !endlessStreams[info.FullMethod] {
		return handler(srv, ss)
	}
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	stop := context.AfterFunc(s.stopped, cancel)
	defer stop()
	err := handler(srv, &stoppableStream{ServerStream: ss, ctx: ctx})
	if err != nil && s.stopped.Err() != nil && ss.Context().Err() == nil {
		return rpctypes.ErrGRPCStopped
	}
	return err
}

// stoppableStream is a server stream whose context also ends when the
// server stops.
type stoppableStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *stoppableStream) Context() context.Context { return s.ctx }

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
	if s.tlsMux != nil {
		s.tlsMux.Close()
	}
	if s.cancel != nil {
		s.cancel()
	}
	s.wg.Wait()
	if s.gateway != nil {
		s.gateway.close()
	}
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
	s.shutdownTracing()
}

// shutdownTracing exports the spans still buffered, for a second at most,
// and stops the exporter.
func (s *Server) shutdownTracing() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := s.tracing.Shutdown(ctx); err != nil {
		s.lg.Warn("exporting the last spans failed", zap.Error(err))
	}
}

var watchMemberDesc = prometheus.NewDesc("etcd_snapcache_upstream_watch_member",
	"Always 1, for the etcd member the upstream watch runs on (as its address was given); none while the watch is not established.",
	[]string{"member"}, nil)

// watchMemberCollector reports the member the upstream watch runs on.
type watchMemberCollector struct{ f *progress.Follower }

func (watchMemberCollector) Describe(ch chan<- *prometheus.Desc) { ch <- watchMemberDesc }

func (c watchMemberCollector) Collect(ch chan<- prometheus.Metric) {
	if m := c.f.WatchMember(); m != "" {
		ch <- prometheus.MustNewConstMetric(watchMemberDesc, prometheus.GaugeValue, 1, m)
	}
}
