package server

import (
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"go.etcd.io/etcd/client/pkg/v3/transport"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/internal/tracing"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/persist"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
	"github.com/etcd-snapcache/etcd-snapcache/watchproxy"
)

// Limits of etcd's gRPC server that are not configurable
// (api/v3rpc/grpc.go), and the proxy's own.
const (
	grpcOverheadBytes   = 512 * 1024
	maxSendBytes        = math.MaxInt32
	gracefulStopTimeout = 10 * time.Second
	defaultMemberName   = "etcd-snapcache"
	// connectTimeout bounds the dial of the proxy's own API (for
	// /proxy/health), and each reconnection attempt to etcd.
	connectTimeout = 5 * time.Second
	// readinessInterval is how often the gRPC health service is brought in
	// line with the readiness checks.
	readinessInterval = 100 * time.Millisecond
)

// Metrics levels, etcd's --metrics.
const (
	MetricsBasic     = "basic"
	MetricsExtensive = "extensive" // adds grpc_server_handling_seconds
)

// Config configures a Server. Every field means what it says, and a zero
// duration or limit is off (none, unbounded, never), as the flags say;
// DefaultConfig holds the defaults. Fields that cannot be off say so, and
// Start refuses them at zero.
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
	// validity in years (at least 1 with AutoTLS).
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
	// keeps a simple token alive in etcd. 0: shown at every cached read.
	AuthTokenCheckInterval time.Duration
	// UpstreamTLS secures the connection to etcd when any file is set;
	// InsecureSkipTLSVerify skips verifying etcd's certificate.
	UpstreamTLS           transport.TLSInfo
	InsecureSkipTLSVerify bool
	// DialTimeout bounds the first connection to etcd (0: no bound).
	DialTimeout time.Duration
	// DialKeepAliveTime and DialKeepAliveTimeout are the upstream
	// connection's keepalive pings (0: none); PermitWithoutStream pings
	// without open streams too.
	DialKeepAliveTime, DialKeepAliveTimeout time.Duration
	PermitWithoutStream                     bool
	// MaxSendBytes and MaxRecvBytes bound the messages sent to and received
	// from etcd (0: no bound, so that etcd judges request sizes).
	MaxSendBytes, MaxRecvBytes int
	// MaxConcurrentStreams bounds each client connection's streams (0: no
	// bound, as etcd's default).
	MaxConcurrentStreams uint32
	// GRPCKeepAliveMinTime, GRPCKeepAliveInterval and GRPCKeepAliveTimeout
	// are the client port's keepalive policy (0: gRPC's own).
	GRPCKeepAliveMinTime, GRPCKeepAliveInterval, GRPCKeepAliveTimeout time.Duration
	// EnablePprof serves /debug/pprof/ on the client port.
	EnablePprof bool
	// EnableGRPCGateway serves etcd's HTTP/JSON gateway (/v3/...) on the
	// client port, as etcd's --enable-grpc-gateway.
	EnableGRPCGateway bool
	// EnableGRPCLogging logs every request and response.
	EnableGRPCLogging bool
	// Metrics is MetricsBasic or MetricsExtensive.
	Metrics string
	// GRPCServerOptions are added to the gRPC server's options (tests use
	// them to add interceptors).
	GRPCServerOptions []grpc.ServerOption
	// Tracing is etcd's distributed tracing flags
	// (--enable-distributed-tracing and the rest).
	Tracing tracing.Config

	// BTreeDegree of the key index (at least 2).
	BTreeDegree int
	// MaxHistoryBytes bounds the memory of retained history on top of the
	// live keyspace (--max-history-bytes): past revisions' snapshots and
	// events, and the flattened-range cache. Past it, the oldest revisions
	// are dropped; reads of them go to etcd, watches from them catch up
	// from etcd. 0: no bound.
	MaxHistoryBytes int64
	// RevisionWait bounds how long a serializable read ahead of the cache
	// waits for it (0: it goes to etcd at once).
	RevisionWait time.Duration
	// FreshnessTimeout bounds how long a linearizable read waits for proof
	// that the cache is fresh (0: it falls back at once).
	FreshnessTimeout time.Duration
	// MaxForwardedReads bounds the reads in flight to etcd at once (at
	// least 1).
	MaxForwardedReads int
	// MaxCachedReadBytes bounds the bytes of responses served from the
	// cache in flight at once (0: no bound).
	MaxCachedReadBytes int64
	// UpstreamLostThreshold is how long the upstream watch may be down
	// before /readyz and the gRPC health service report the proxy not
	// ready (0: never).
	UpstreamLostThreshold time.Duration
	// Inherited, if it has a Client, are the listening sockets a running
	// proxy handed over: they are served instead of ListenAddr and
	// MetricsAddr, from when the proxy is ready.
	Inherited Inherited
	// OnReady, if set, is called once, when the proxy is first ready and
	// accepts (systemd's READY=1, a handover's signal to drain).
	OnReady func()
	// BeforeLoadPage is called before each page of a load; tests only.
	BeforeLoadPage func()
	// ConsistencyCheckInterval is how often the cache is checked against
	// etcd (0: never).
	ConsistencyCheckInterval time.Duration
	// ConsistentReadFallback is what a linearizable read does when its
	// freshness was not proven in time: go to etcd, or fail with
	// Unavailable (--consistent-read-fallback).
	ConsistentReadFallback kvproxy.ConsistentReadFallback
	// CompactionProbeInterval is how often etcd's compaction revision is
	// checked (more than 0: compactions by others are found this way).
	CompactionProbeInterval time.Duration
	// LoadRetainedHistory replays etcd's retained history at start.
	LoadRetainedHistory bool
	// PersistDir, if set, is where the cache keeps its copy on disk
	// (package persist; --persist-cache: <DataDir>/snapcache): a restart
	// starts warm from it. PersistInterval is how often the copy is
	// brought up to date (more than 0).
	PersistDir      string
	PersistInterval time.Duration
	// LoadPageSize is the page size of the initial load (at least 1).
	LoadPageSize int64
	// MaxRequestBytes is etcd's --max-request-bytes of the upstream: the
	// largest request accepted (plus gRPC overhead, as etcd) and the size
	// at which fragmenting watchers' responses are split (at least 1).
	MaxRequestBytes int
	// WatchProgressNotifyInterval is the interval of periodic progress
	// notifications to idle progress_notify watchers (more than 0). With
	// FollowEtcdProgressInterval (the default, the flag not given) they
	// follow etcd's own interval, learned from an idle upstream watch, and
	// this one is only the fallback while etcd sends none.
	WatchProgressNotifyInterval time.Duration
	FollowEtcdProgressInterval  bool
	// MemoryLimit is the Go runtime's soft memory limit (--memory-limit):
	// none, fixed, automatic (following the cache) or the cgroup's share
	// (MemoryLimitMode). GOMEMLIMIT in the environment wins over it. The
	// limit is the process's: of the servers of one process, the first to
	// start sets it, until it stops.
	MemoryLimit MemoryLimit

	// Logger logs the server's work; nil: nothing is logged.
	Logger *zap.Logger
}

// DefaultDataDir is --data-dir's default: with --endpoints, where the
// copy on disk (PersistSubdir) and --auto-tls's certificates are kept;
// without, the embedded etcd's data.
const DefaultDataDir = ".snapcache/etcd"

// PersistSubdir is where, under DataDir, --persist-cache keeps the copy on
// disk.
const PersistSubdir = "snapcache"

// DefaultConfig returns the configuration of `etcd-snapcache serve` with
// no flags but --endpoints: every default, in one place, as etcd's
// embed.NewConfig. The flags take their defaults from it.
func DefaultConfig() Config {
	return Config{
		ListenAddr: "127.0.0.1:23790",
		// etcd's --tls-min-version default.
		ServerTLS:              transport.TLSInfo{MinVersion: tls.VersionTLS12},
		SelfSignedCertValidity: 1,
		AuthToken:              "simple",
		AuthTokenCheckInterval: gate.DefaultTokenCheckInterval,
		DialTimeout:            5 * time.Second,
		// grpc-proxy pings etcd never by default; the proxy pings every
		// 30 s, because a silently dead connection would leave its cache
		// stale without any error.
		DialKeepAliveTime:    30 * time.Second,
		DialKeepAliveTimeout: 20 * time.Second,
		// Unlike grpc-proxy's 1.5 MiB, no bound: etcd judges request
		// sizes and answers with its own error.
		MaxSendBytes:         math.MaxInt32,
		MaxRecvBytes:         math.MaxInt32,
		MaxConcurrentStreams: math.MaxUint32,
		// etcd's (server/embed/config.go): clients ping every 30 s on
		// open streams, which a minimum of 5 s allows.
		GRPCKeepAliveMinTime:  5 * time.Second,
		GRPCKeepAliveInterval: 2 * time.Hour,
		GRPCKeepAliveTimeout:  20 * time.Second,
		Metrics:               MetricsBasic,
		BTreeDegree:           revtree.DefaultDegree,
		MaxHistoryBytes:       revtree.DefaultMaxHistoryBytes,
		RevisionWait:          kvproxy.DefaultRevisionWait,
		FreshnessTimeout:      kvproxy.DefaultFreshnessTimeout,
		MaxForwardedReads:     kvproxy.DefaultMaxForwardedReads,
		MaxCachedReadBytes:    kvproxy.DefaultMaxCachedReadBytes,
		// Longer than a watch takes to resume after an etcd leader
		// election (an election timeout of 1 s, and the follower's retry
		// pauses of up to 2 s), shorter than the 10 s period of a
		// Kubernetes readiness probe, so that a lost upstream is
		// reported within one probe.
		UpstreamLostThreshold:    5 * time.Second,
		ConsistencyCheckInterval: hashcheck.DefaultInterval,
		ConsistentReadFallback:   kvproxy.FallbackForward,
		CompactionProbeInterval:  progress.DefaultCompactionProbeInterval,
		LoadPageSize:             progress.DefaultLoadPageSize,
		MaxRequestBytes:          1.5 * 1024 * 1024, // etcd's
		MemoryLimit:              MemoryLimit{Mode: MemoryLimitAuto},
		EnableGRPCGateway:        true,
		DataDir:                  DefaultDataDir,
		PersistDir:               filepath.Join(DefaultDataDir, PersistSubdir),
		PersistInterval:          persist.DefaultInterval,
		// etcd's own, and this etcd's default while it sends none.
		WatchProgressNotifyInterval: watchproxy.DefaultProgressNotifyInterval,
		FollowEtcdProgressInterval:  true,
		Tracing:                     tracing.Config{Address: tracing.DefaultAddress, ServiceName: tracing.DefaultServiceName},
	}
}

// Validate refuses the fields that cannot be off at zero, and values no
// setting means. Each error names the flag of its field.
func (cfg *Config) Validate() error {
	switch {
	case len(cfg.Endpoints) == 0:
		return errors.New("--endpoints: no upstream etcd endpoints")
	case cfg.Metrics != MetricsBasic && cfg.Metrics != MetricsExtensive:
		return fmt.Errorf("--metrics %q: want %s or %s", cfg.Metrics, MetricsBasic, MetricsExtensive)
	case cfg.AutoTLS && cfg.SelfSignedCertValidity == 0:
		return errors.New("--self-signed-cert-validity 0: want at least 1 year")
	case cfg.BTreeDegree < 2:
		return fmt.Errorf("--btree-degree %d: want at least 2", cfg.BTreeDegree)
	case cfg.MaxHistoryBytes < 0:
		return fmt.Errorf("--max-history-bytes %d: want a byte count, or 0 for no bound", cfg.MaxHistoryBytes)
	case cfg.MaxCachedReadBytes < 0:
		return fmt.Errorf("--max-cached-read-bytes %d: want a byte count, or 0 for no bound", cfg.MaxCachedReadBytes)
	case cfg.MaxSendBytes < 0:
		return fmt.Errorf("--max-send-bytes %d: want a byte count, or 0 for no bound", cfg.MaxSendBytes)
	case cfg.MaxRecvBytes < 0:
		return fmt.Errorf("--max-recv-bytes %d: want a byte count, or 0 for no bound", cfg.MaxRecvBytes)
	case cfg.MaxForwardedReads < 1:
		return fmt.Errorf("--max-forwarded-reads %d: want at least 1", cfg.MaxForwardedReads)
	case cfg.CompactionProbeInterval <= 0:
		return fmt.Errorf("--compaction-probe-interval %v: want more than 0", cfg.CompactionProbeInterval)
	case cfg.LoadPageSize < 1:
		return fmt.Errorf("--load-page-size %d: want at least 1", cfg.LoadPageSize)
	case cfg.MaxRequestBytes < 1:
		return fmt.Errorf("--max-request-bytes %d: want at least 1", cfg.MaxRequestBytes)
	case cfg.WatchProgressNotifyInterval <= 0:
		return fmt.Errorf("--watch-progress-notify-interval %v: want more than 0 (not given: etcd's own)", cfg.WatchProgressNotifyInterval)
	case cfg.PersistDir != "" && cfg.PersistInterval <= 0:
		return fmt.Errorf("--persist-interval %v: want more than 0", cfg.PersistInterval)
	case cfg.MemoryLimit.Mode < MemoryLimitNone || cfg.MemoryLimit.Mode > MemoryLimitCgroup,
		cfg.MemoryLimit.Mode == MemoryLimitFixed && cfg.MemoryLimit.Bytes <= 0:
		return fmt.Errorf("--memory-limit %v: want a byte count, auto, or 0 for none", cfg.MemoryLimit)
	}
	if err := cfg.Tracing.Validate(); err != nil {
		return err
	}
	for _, d := range []struct {
		flag string
		d    time.Duration
	}{
		{"endpoints-auto-sync-interval", cfg.EndpointsAutoSyncInterval},
		{"auth-token-check-interval", cfg.AuthTokenCheckInterval},
		{"dial-timeout", cfg.DialTimeout},
		{"dial-keepalive-time", cfg.DialKeepAliveTime},
		{"dial-keepalive-timeout", cfg.DialKeepAliveTimeout},
		{"grpc-keepalive-min-time", cfg.GRPCKeepAliveMinTime},
		{"grpc-keepalive-interval", cfg.GRPCKeepAliveInterval},
		{"grpc-keepalive-timeout", cfg.GRPCKeepAliveTimeout},
		{"revision-wait", cfg.RevisionWait},
		{"consistent-read-timeout", cfg.FreshnessTimeout},
		{"consistency-check-interval", cfg.ConsistencyCheckInterval},
		{"upstream-lost-threshold", cfg.UpstreamLostThreshold},
	} {
		if d.d < 0 {
			return fmt.Errorf("--%s %v: want a duration, or 0 for none", d.flag, d.d)
		}
	}
	return nil
}

// orNoBound is n, or the largest message gRPC takes for 0 (no bound).
func orNoBound(n int) int {
	if n == 0 {
		return math.MaxInt32
	}
	return n
}
