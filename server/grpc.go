package server

import (
	"context"
	"math"
	"os"
	"path"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"
	"go.etcd.io/etcd/server/v3/proxy/grpcproxy"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/internal/tlsmux"
	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/watchproxy"
)

// streamWorkers is the number of the gRPC server's stream workers: enough
// for the calls in flight of a busy proxy, most of them waiting for a read
// fence; an idle worker costs only its goroutine.
const streamWorkers = 128

// services are the etcd API's services as the proxy serves them: KV and
// Watch from the cache, Lease with its keepalives coalesced, Cluster as
// grpc-proxy answers it, the rest forwarded. newServices builds them and
// newGRPCServer registers them.
type services struct {
	kv    *kvproxy.Server
	watch *watchproxy.Server
	// kvMetrics and watchMetrics are the KV and Watch services' metrics,
	// which /proxy/status reads too.
	kvMetrics    *kvproxy.Metrics
	watchMetrics *watchproxy.Metrics
	// lease's keepalive coalescers run on goroutines of the server
	// (runBackground).
	lease       *leaseServer
	cluster     pb.ClusterServer
	maintenance pb.MaintenanceServer
	auth        pb.AuthServer
	lock        v3lockpb.LockServer
	election    v3electionpb.ElectionServer
	// health follows readiness (followReadiness); NOT_SERVING until then.
	health *health.Server
}

// newServices builds the services over the cache, the gate and the
// forwarding connection; the lease keepalives' upstream streams live as
// long as ctx.
func (s *Server) newServices(ctx context.Context) services {
	conn := s.client.ActiveConnection()
	svc := services{kvMetrics: kvproxy.NewMetrics(s.registry), watchMetrics: watchproxy.NewMetrics(s.registry)}
	svc.kv = kvproxy.New(kvproxy.Config{
		Store:                  s.store,
		Follower:               s.follower,
		Upstream:               pb.NewKVClient(conn),
		Logger:                 s.lg.Named("kv"),
		Metrics:                svc.kvMetrics,
		RevisionWait:           s.cfg.RevisionWait,
		FreshnessTimeout:       s.cfg.FreshnessTimeout,
		ConsistentReadFallback: s.cfg.ConsistentReadFallback,
		MaxForwardedReads:      s.cfg.MaxForwardedReads,
		MaxCachedReadBytes:     s.cfg.MaxCachedReadBytes,
		Inconsistent:           s.checker.Fallback,
		Gate:                   s.gate,
	})
	svc.watch = watchproxy.New(watchproxy.Config{
		Store:                  s.store,
		Follower:               s.follower,
		Upstream:               pb.NewWatchClient(conn),
		ProgressNotifyInterval: s.cfg.WatchProgressNotifyInterval,
		FollowEtcdProgress:     s.cfg.FollowEtcdProgressInterval,
		FragmentBytes:          s.cfg.MaxRequestBytes + grpcOverheadBytes,
		Consistency:            s.checker,
		Gate:                   s.gate,
		Logger:                 s.lg.Named("watch"),
		Metrics:                svc.watchMetrics,
	})
	// The watch server reads the follower, so it is built after it; the
	// follower's compactions must first let the watch server's notifier
	// catch its watchers up. Set before the follower runs.
	s.follower.SetBeforeCompact(svc.watch.SyncWatchers)
	leases := pb.NewLeaseClient(conn)
	svc.lease = &leaseServer{
		upstream:  leases,
		ka:        newKeepAlives(ctx, leases, s.lg.Named("lease")),
		asProxyKA: newKeepAlives(gate.AsProxy(ctx), leases, s.lg.Named("lease")),
		callerOf:  s.gate.CallerOf,
	}
	svc.cluster = s.newClusterServer()
	svc.maintenance = grpcproxy.NewMaintenanceProxy(s.client)
	svc.auth = s.gate.AuthServer(grpcproxy.NewAuthProxy(s.client))
	svc.lock = grpcproxy.NewLockProxy(s.client)
	svc.election = grpcproxy.NewElectionProxy(s.client)
	svc.health = health.NewServer()
	svc.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	return svc
}

// newGRPCServer returns the gRPC server of the etcd API with svc
// registered. Its calls are counted in grpc_server_*, with handling times
// when Metrics is "extensive", as etcd's --metrics.
func (s *Server) newGRPCServer(svc services) *grpc.Server {
	serverMetrics := newGRPCMetrics(s.cfg.Metrics == MetricsExtensive)
	s.registry.MustRegister(serverMetrics)
	unary := []grpc.UnaryServerInterceptor{serverMetrics.unary(s.gate.UnaryServerInterceptor)}
	stream := []grpc.StreamServerInterceptor{serverMetrics.stream, s.endOnStop, s.gate.StreamServerInterceptor}
	if s.tracing != nil {
		// First, so that the others (the gate's checks) see the span.
		unary = append([]grpc.UnaryServerInterceptor{s.tracing.UnaryServerInterceptor()}, unary...)
		stream = append([]grpc.StreamServerInterceptor{s.tracing.StreamServerInterceptor()}, stream...)
	}
	if s.cfg.EnableGRPCLogging {
		unary = append(unary, interceptors.UnaryServerInterceptor(payloadLogger(s.lg.Named("grpc"))))
		stream = append(stream, interceptors.StreamServerInterceptor(payloadLogger(s.lg.Named("grpc"))))
	}
	opts := []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(unary...),
		grpc.ChainStreamInterceptor(stream...),
		grpc.MaxRecvMsgSize(s.cfg.MaxRequestBytes + grpcOverheadBytes),
		grpc.MaxSendMsgSize(maxSendBytes),
		grpc.MaxConcurrentStreams(s.maxConcurrentStreams()),
		// Watch events and Range responses from the cache go out
		// pre-encoded (an event once for every watcher, a key-value
		// once for every read); every other message is gRPC's proto
		// codec's.
		wirecodec.ServerOption(),
		// Calls run on long-lived goroutines whose stacks have grown to
		// what a call needs, rather than each on a new goroutine that
		// grows its stack again (runtime.morestack: a tenth of a cached
		// read's CPU). A call finding every worker busy gets a goroutine
		// of its own, as without workers.
		grpc.NumStreamWorkers(streamWorkers),
	}
	if s.cfg.GRPCKeepAliveMinTime > 0 {
		// As etcd: clients ping every 30 s on open streams, which a
		// minimum of 5 s allows; grpc-go's default would GOAWAY them.
		opts = append(opts, grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: s.cfg.GRPCKeepAliveMinTime}))
	}
	if s.cfg.GRPCKeepAliveInterval > 0 || s.cfg.GRPCKeepAliveTimeout > 0 {
		opts = append(opts, grpc.KeepaliveParams(keepalive.ServerParameters{Time: s.cfg.GRPCKeepAliveInterval, Timeout: s.cfg.GRPCKeepAliveTimeout}))
	}
	if s.tls != nil {
		// The TLS handshake is done before a connection reaches the
		// server (serveClientPort): its credentials expose it.
		opts = append(opts, grpc.Creds(tlsmux.Credentials()))
	}
	opts = append(opts, s.cfg.GRPCServerOptions...)
	gs := grpc.NewServer(opts...)

	kvproxy.Register(gs, svc.kv)
	pb.RegisterWatchServer(gs, svc.watch)
	pb.RegisterLeaseServer(gs, svc.lease)
	pb.RegisterClusterServer(gs, svc.cluster)
	pb.RegisterMaintenanceServer(gs, svc.maintenance)
	pb.RegisterAuthServer(gs, svc.auth)
	v3lockpb.RegisterLockServer(gs, svc.lock)
	v3electionpb.RegisterElectionServer(gs, svc.election)
	healthpb.RegisterHealthServer(gs, svc.health)
	// Every method's series exist from the start, at zero.
	serverMetrics.initialize(gs)
	return gs
}

// advertise registers the proxy's advertised URL under --resolver-prefix,
// as grpc-proxy does, for clients that find the proxies in etcd.
func (s *Server) advertise() {
	if s.cfg.ResolverPrefix == "" {
		return
	}
	if urls := s.advertiseURLs(); len(urls) > 0 {
		s.clientDone = append(s.clientDone, grpcproxy.Register(s.lg.Named("resolver"), s.client, s.cfg.ResolverPrefix, urls[0], s.cfg.ResolverTTL))
	}
}

// maxConcurrentStreams is the bound of each client connection's streams:
// MaxConcurrentStreams, or none for 0.
func (s *Server) maxConcurrentStreams() uint32 {
	if s.cfg.MaxConcurrentStreams == 0 {
		return math.MaxUint32
	}
	return s.cfg.MaxConcurrentStreams
}

// newClusterServer follows grpc-proxy: with --resolver-prefix, MemberList
// lists the proxies registered under the prefix (etcd's own cluster
// proxy); otherwise the advertised URL, or etcd's members when none is
// advertised.
func (s *Server) newClusterServer() pb.ClusterServer {
	urls := s.advertiseURLs()
	if s.cfg.ResolverPrefix != "" && len(urls) > 0 {
		cp, done := grpcproxy.NewClusterProxy(s.lg.Named("cluster"), s.client, urls[0], s.cfg.ResolverPrefix)
		s.clientDone = append(s.clientDone, done)
		return cp
	}
	return newClusterServer(pb.NewClusterClient(s.client.ActiveConnection()), memberName(), urls)
}

func memberName() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return defaultMemberName + "-" + h
	}
	return defaultMemberName
}

// payloadLogger logs every request and response payload, as grpc-proxy's
// --experimental-enable-grpc-logging.
func payloadLogger(lg *zap.Logger) interceptors.CommonReportableFunc {
	return func(ctx context.Context, c interceptors.CallMeta) (interceptors.Reporter, context.Context) {
		fields := []zap.Field{
			zap.String("grpc.service", path.Dir(c.FullMethod())[1:]),
			zap.String("grpc.method", path.Base(c.FullMethod())),
		}
		if p, ok := peer.FromContext(ctx); ok {
			fields = append(fields, zap.String("peer.address", p.Addr.String()))
		}
		return &payloadReporter{lg: lg.With(fields...)}, ctx
	}
}

type payloadReporter struct{ lg *zap.Logger }

func (r *payloadReporter) PostCall(error, time.Duration) {}

func (r *payloadReporter) PostMsgReceive(payload any, err error, _ time.Duration) {
	r.lg.Info("received payload logged as grpc.request.content field", payloadFields("request", payload, err)...)
}

func (r *payloadReporter) PostMsgSend(payload any, err error, _ time.Duration) {
	r.lg.Info("returned response payload logged as grpc.response.content field", payloadFields("response", payload, err)...)
}

func payloadFields(kind string, payload any, err error) []zap.Field {
	var fields []zap.Field
	if err != nil {
		fields = append(fields, zap.NamedError("grpc."+kind+".error", err))
	}
	if m, ok := payload.(proto.Message); ok {
		b, _ := protojson.Marshal(m)
		fields = append(fields, zap.ByteString("grpc."+kind+".content", b))
	}
	return fields
}
