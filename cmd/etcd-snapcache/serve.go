package main

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap"

	"go.etcd.io/etcd/client/pkg/v3/srv"
	"go.etcd.io/etcd/client/pkg/v3/tlsutil"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/etcd-snapcache/etcd-snapcache/internal/handover"
	"github.com/etcd-snapcache/etcd-snapcache/internal/memlimit"
	"github.com/etcd-snapcache/etcd-snapcache/internal/tracing"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

const (
	catUpstream = "Upstream etcd (grpc-proxy's flags)"
	catServing  = "Serving (grpc-proxy's flags)"
	catIgnored  = "grpc-proxy flags accepted for compatibility"
	catEmbedded = "Embedded etcd (when --endpoints is not given)"
	catCache    = "Cache"
	catTracing  = "Tracing (etcd's flags)"
)

// serveCommand takes every flag of `etcd grpc-proxy start`, with its name,
// forms and meaning, so that a grpc-proxy command line works unchanged.
func serveCommand() *cli.Command {
	d := server.DefaultConfig()
	return &cli.Command{
		Name:  "serve",
		Usage: "serve the etcd v3 API in front of an etcd cluster (or of an embedded etcd)",
		Description: "serve takes the flags of `etcd grpc-proxy start`. Without --endpoints, it starts an\n" +
			"etcd inside the process, with its data in --data-dir, and serves in front of it:\n" +
			"a complete single-node setup for development.",
		Flags: []cli.Flag{
			&cli.StringSliceFlag{Name: "endpoints", Category: catUpstream, EnvVars: []string{"ETCD_SNAPCACHE_ENDPOINTS"},
				Usage: "upstream etcd client endpoints, host:port or http(s)://host:port, comma-separated; not given: an embedded etcd"},
			&cli.DurationFlag{Name: "endpoints-auto-sync-interval", Category: catUpstream,
				Usage: "sync the upstream endpoints from etcd's member list at this interval (0 disables)"},
			&cli.StringFlag{Name: "discovery-srv", Category: catUpstream, Usage: "domain name to query for SRV records describing the cluster's endpoints"},
			&cli.StringFlag{Name: "discovery-srv-name", Category: catUpstream, Usage: "service name to query when using DNS discovery"},
			&cli.BoolFlag{Name: "insecure-discovery", Category: catUpstream, Usage: "accept SRV records without validating the endpoints' TLS"},
			&cli.StringFlag{Name: "user", Category: catUpstream, EnvVars: []string{"ETCD_SNAPCACHE_USER"},
				Usage: "the proxy's own etcd user, name:password or name with --password (etcdctl's forms), for its load, watch and auth mirror; never lent to callers"},
			&cli.StringFlag{Name: "password", Category: catUpstream, EnvVars: []string{"ETCD_SNAPCACHE_PASSWORD"}, Usage: "password of --user"},
			&cli.StringFlag{Name: "cacert", Category: catUpstream, Usage: "verify the upstream's certificate with this CA bundle"},
			&cli.StringFlag{Name: "cert", Category: catUpstream, Usage: "client certificate for the upstream (a common name is allowed)"},
			&cli.StringFlag{Name: "key", Category: catUpstream, Usage: "client key for the upstream"},
			&cli.BoolFlag{Name: "insecure-skip-tls-verify", Category: catUpstream, Usage: "skip verifying the upstream's TLS certificate (testing only)"},
			&cli.DurationFlag{Name: "dial-timeout", Category: catUpstream, Value: d.DialTimeout, Usage: "timeout of the first connection to the upstream (0: none)"},
			&cli.DurationFlag{Name: "dial-keepalive-time", Category: catUpstream, Value: d.DialKeepAliveTime,
				Usage: "keepalive ping interval of the upstream connection (0 disables; grpc-proxy's default is 0, the proxy's 30s keeps a dead connection from leaving the cache stale)"},
			&cli.DurationFlag{Name: "dial-keepalive-timeout", Category: catUpstream, Value: d.DialKeepAliveTimeout, Usage: "keepalive timeout of the upstream connection"},
			&cli.BoolFlag{Name: "permit-without-stream", Category: catUpstream, Usage: "send keepalive pings to the upstream even without open streams"},
			&cli.IntFlag{Name: "max-send-bytes", Category: catUpstream, Value: d.MaxSendBytes,
				Usage: "largest message sent to the upstream (grpc-proxy's default is 1.5 MiB; unlimited lets etcd judge and answer request sizes itself)"},
			&cli.IntFlag{Name: "max-recv-bytes", Category: catUpstream, Value: d.MaxRecvBytes, Usage: "largest message received from the upstream (0: no bound)"},

			&cli.StringFlag{Name: "listen-addr", Category: catServing, Value: d.ListenAddr, Usage: "address to serve the etcd API and the HTTP endpoints on"},
			&cli.StringSliceFlag{Name: "advertise-client-url", Category: catServing,
				Usage: "client URL MemberList returns for the proxy (default: the listen address); explicitly empty: MemberList is etcd's"},
			&cli.StringFlag{Name: "metrics-addr", Category: catServing,
				Usage: "also serve the HTTP endpoints here: http://host:port, https://host:port (with the serving TLS) or host:port; empty: not"},
			&cli.StringFlag{Name: "metrics", Category: catServing, Value: d.Metrics,
				Usage: "'basic' or 'extensive' (adds grpc_server_handling_seconds), as etcd's --metrics"},
			&cli.StringFlag{Name: "cert-file", Category: catServing, Usage: "serve TLS with this certificate"},
			&cli.StringFlag{Name: "key-file", Category: catServing, Usage: "key of --cert-file"},
			&cli.StringFlag{Name: "trusted-ca-file", Category: catServing, Usage: "require client certificates signed by this CA"},
			&cli.StringFlag{Name: "client-crl-file", Category: catServing, Usage: "refuse client certificates this revocation list revokes (with serving TLS; ignored without, as grpc-proxy)"},
			&cli.BoolFlag{Name: "client-cert-auth", Category: catServing,
				Usage: "etcd's --client-cert-auth, set as the upstream sets it: a caller without a token is the user its verified client certificate names (needs --trusted-ca-file)"},
			&cli.StringFlag{Name: "auth-token", Category: catServing, Value: d.AuthToken,
				Usage: "the upstream's --auth-token: 'simple', or 'jwt,pub-key=<file>,sign-method=<alg>' to verify etcd's JWTs and serve their reads from the cache"},
			&cli.DurationFlag{Name: "auth-token-check-interval", Category: catServing, Value: d.AuthTokenCheckInterval,
				Usage: "how long a token etcd accepted is trusted before it is shown to etcd again (each showing keeps a simple token alive; keep it well under etcd's --auth-token-ttl)"},
			&cli.BoolFlag{Name: "auto-tls", Category: catServing, Usage: "serve TLS with a generated self-signed certificate, kept in --data-dir"},
			&cli.UintFlag{Name: "self-signed-cert-validity", Category: catServing, Value: d.SelfSignedCertValidity, Usage: "validity of the --auto-tls certificate, in years"},
			&cli.StringSliceFlag{Name: "listen-cipher-suites", Category: catServing, Usage: "TLS cipher suites served (empty: Go's)"},
			&cli.StringFlag{Name: "tls-min-version", Category: catServing, Value: tlsVersionName(d.ServerTLS.MinVersion), Usage: "minimum TLS version served: TLS1.2 or TLS1.3"},
			&cli.StringFlag{Name: "tls-max-version", Category: catServing, Value: tlsVersionName(d.ServerTLS.MaxVersion), Usage: "maximum TLS version served: TLS1.2 or TLS1.3 (empty: Go's)"},
			&cli.UintFlag{Name: "max-concurrent-streams", Category: catServing, Value: uint(d.MaxConcurrentStreams), Usage: "most concurrent streams of one client connection (0: no bound)"},
			&cli.DurationFlag{Name: "grpc-keepalive-min-time", Category: catServing, Value: d.GRPCKeepAliveMinTime, Usage: "least interval a client may ping at (0: gRPC's)"},
			&cli.DurationFlag{Name: "grpc-keepalive-interval", Category: catServing, Value: d.GRPCKeepAliveInterval, Usage: "interval of the server's pings to clients (0 disables)"},
			&cli.DurationFlag{Name: "grpc-keepalive-timeout", Category: catServing, Value: d.GRPCKeepAliveTimeout, Usage: "wait for a ping's answer before closing the connection (0 disables)"},
			&cli.StringFlag{Name: "resolver-prefix", Category: catServing, Usage: "register the proxy in etcd under this prefix; MemberList lists the proxies registered there"},
			&cli.IntFlag{Name: "resolver-ttl", Category: catServing, Usage: "TTL in seconds of the registration under --resolver-prefix"},
			&cli.IntFlag{Name: "max-request-bytes", Category: catServing, Value: d.MaxRequestBytes,
				Usage: "the upstream's --max-request-bytes: the largest request accepted, and where fragmenting watch responses are split"},
			&cli.DurationFlag{Name: "watch-progress-notify-interval", Category: catServing, Value: d.WatchProgressNotifyInterval,
				Usage: "interval of progress notifications to idle watchers that asked for them; not given: etcd's own interval, followed through an idle upstream watch (this default while etcd sends none)"},
			&cli.BoolFlag{Name: "enable-pprof", Category: catServing, Usage: "serve runtime profiles at /debug/pprof/ on the client port"},
			&cli.BoolFlag{Name: "enable-grpc-gateway", Category: catServing, Value: d.EnableGRPCGateway,
				Usage: "serve etcd's HTTP/JSON gateway (/v3/kv/range, /v3/watch, ...) on the client port, as etcd does: reads from the cache, the rest forwarded"},
			&cli.BoolFlag{Name: "debug", Category: catServing, Usage: "log at debug level"},
			&cli.StringFlag{Name: "log-level", Category: catServing, Value: "info", Usage: "debug, info, warn or error"},
			&cli.BoolFlag{Name: "experimental-enable-grpc-logging", Category: catServing, Usage: "log every gRPC request and response"},
			&cli.StringFlag{Name: "data-dir", Category: catServing, Value: d.DataDir,
				Usage: "with --endpoints: where the cache keeps its copy on disk (--persist-cache) and --auto-tls its certificates; without: the embedded etcd's data"},

			&cli.BoolFlag{Name: "enable-distributed-tracing", Category: catTracing,
				Usage: "trace the requests served with OpenTelemetry, each span in its caller's trace (W3C trace context), and send etcd the trace context of the calls made for them"},
			&cli.StringFlag{Name: "distributed-tracing-address", Category: catTracing, Value: d.Tracing.Address, Usage: "the OTLP/gRPC collector spans go to (plaintext)"},
			&cli.StringFlag{Name: "distributed-tracing-service-name", Category: catTracing, Value: d.Tracing.ServiceName, Usage: "the spans' service.name"},
			&cli.StringFlag{Name: "distributed-tracing-instance-id", Category: catTracing, Usage: "the spans' service.instance.id (none if empty)"},
			&cli.IntFlag{Name: "distributed-tracing-sampling-rate", Category: catTracing,
				Usage: "traces begun at the proxy that are sampled, per million (0 to 1000000); a caller's sampled trace context is followed whatever the rate"},

			&cli.StringFlag{Name: "namespace", Category: catIgnored, Usage: "prefix every key with this string: not supported, refused when set"},
			&cli.StringFlag{Name: "experimental-leasing-prefix", Category: catIgnored, Usage: "leasing metadata prefix: not supported, refused when set"},
			&cli.BoolFlag{Name: "experimental-serializable-ordering", Category: catIgnored,
				Usage: "accepted; the cache already serves serializable reads from one store whose revision never goes back"},

			&cli.StringFlag{Name: "embedded-client-url", Category: catEmbedded, Value: "http://127.0.0.1:23792", Usage: "client URL of the embedded etcd"},
			&cli.StringFlag{Name: "embedded-peer-url", Category: catEmbedded, Value: "http://127.0.0.1:23793", Usage: "peer URL of the embedded etcd"},

			&cli.IntFlag{Name: "btree-degree", Category: catCache, Value: d.BTreeDegree, Usage: "B-tree degree of the key index (scan speed vs the nodes a revision that creates a key copies)"},
			&cli.Int64Flag{Name: "max-history-bytes", Category: catCache, Value: d.MaxHistoryBytes,
				Usage: "memory retained history may use on top of the live keyspace (past revisions' snapshots and events, flattened ranges); past it the oldest revisions are dropped and their reads go to etcd (0: unbounded)"},
			&cli.DurationFlag{Name: "revision-wait", Category: catCache, Value: d.RevisionWait,
				Usage: "how long a read at a revision the cache has not reached waits for it before going to etcd"},
			&cli.DurationFlag{Name: "consistent-read-timeout", Category: catCache, Value: d.FreshnessTimeout,
				Usage: "how long a linearizable read waits for proof that the cache is fresh"},
			&cli.StringFlag{Name: "consistent-read-fallback", Category: catCache, Value: d.ConsistentReadFallback.String(),
				Usage: "what a linearizable read does when freshness is not proven in time: 'forward' it to etcd, or 'fail' with Unavailable (under overload, falling back multiplies etcd's load)"},
			&cli.IntFlag{Name: "max-forwarded-reads", Category: catCache, Value: d.MaxForwardedReads,
				Usage: "most reads in flight to etcd at once (forwarded reads wait for a slot, then fail with Unavailable)"},
			&cli.Int64Flag{Name: "max-cached-read-bytes", Category: catCache, Value: d.MaxCachedReadBytes,
				Usage: "most bytes of responses served from the cache in flight at once (reads wait for room, then fail with Unavailable; a larger one runs alone; 0 disables)"},
			&cli.DurationFlag{Name: "consistency-check-interval", Category: catCache, Value: d.ConsistencyCheckInterval,
				Usage: "how often to compare a hash of the cache with etcd's at one revision; on a mismatch reads go to etcd until the reloaded cache passes (0 disables)"},
			&cli.DurationFlag{Name: "compaction-probe-interval", Category: catCache, Value: d.CompactionProbeInterval,
				Usage: "how often to check etcd's compaction revision (finds auto-compaction and compactions by other clients)"},
			&cli.Int64Flag{Name: "load-page-size", Category: catCache, Value: d.LoadPageSize, Usage: "page size of the initial load"},
			&cli.BoolFlag{Name: "persist-cache", Category: catCache, Value: d.PersistDir != "",
				Usage: "keep a copy of the cache in <data-dir>/snapcache, written off the request path, so that a restart starts warm: it reads from etcd only what changed since, after proving the copy is etcd's history"},
			&cli.DurationFlag{Name: "persist-interval", Category: catCache, Value: d.PersistInterval,
				Usage: "how often the copy on disk is brought up to date (one fsynced bbolt transaction each)"},
			&cli.BoolFlag{Name: "load-retained-history", Category: catCache,
				Usage: "at start, replay every revision etcd retains, so historical reads are served from memory right after a restart"},
			&cli.StringFlag{Name: "memory-limit", Category: catCache, Value: d.MemoryLimit.String(),
				Usage: "the Go runtime's soft memory limit, bytes or a size such as 3GiB or 512Mi; 'auto' follows the cache's live memory and the cached responses in flight, with headroom (1.25x plus 32MiB, at least 64MiB), within 90% of the cgroup's memory limit; 0: none (the heap grows to twice the live data between collections). GOMEMLIMIT wins when set"},
		},
		Action: serve,
	}
}

func serve(c *cli.Context) error {
	level := c.String("log-level")
	if c.Bool("debug") {
		level = "debug"
	}
	lg, err := newLogger(level)
	if err != nil {
		return err
	}
	defer lg.Sync()
	cfg, err := serverConfig(c, lg)
	if err != nil {
		return err
	}
	// Two signals: the first stops gracefully, the second at once.
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	// SIGHUP hands over to a new process of the proxy.
	hups := make(chan os.Signal, 1)
	signal.Notify(hups, syscall.SIGHUP)
	defer signal.Stop(hups)
	if err := takeOver(lg, &cfg); err != nil {
		return err
	}

	embedded := len(cfg.Endpoints) == 0
	if embedded && cfg.MemoryLimit.Mode == server.MemoryLimitAuto {
		// The embedded etcd's heap is the process's too: the cache's
		// estimate does not cover it.
		cfg.MemoryLimit = server.MemoryLimit{Mode: server.MemoryLimitCgroup}
	}
	if embedded {
		e, err := startEmbedded(lg, server.EmbeddedConfig{
			Dir:       c.String("data-dir"),
			ClientURL: c.String("embedded-client-url"),
			PeerURL:   c.String("embedded-peer-url"),
			Logger:    lg,
		})
		if err != nil {
			return err
		}
		defer e.Close()
		cfg.Endpoints = []string{server.EmbeddedEndpoint(e)}
		// The data directory is the embedded etcd's; auto-TLS keeps its
		// certificates beside it.
		cfg.DataDir = filepath.Dir(c.String("data-dir"))
		if cfg.PersistDir != "" {
			cfg.PersistDir = filepath.Join(cfg.DataDir, server.PersistSubdir)
		}
	}

	srv, err := server.Start(cfg)
	if err != nil {
		return err
	}
	var child *handover.Child
	hup := func() bool {
		if embedded {
			lg.Warn("SIGHUP: a handover needs --endpoints; the embedded etcd cannot be handed over")
			return false
		}
		var ok bool
		child, ok = handOver(lg, srv, sigs)
		return ok
	}
	if err := serveUntilStopped(lg, c.Context.Done(), sigs, hups, hup, srv); err != nil {
		return err
	}
	if child != nil {
		return reapAsInit(lg, child)
	}
	return nil
}

// stoppable is the running server, as serveUntilStopped stops it.
type stoppable interface {
	Stop()
	StopNow()
	Err() <-chan error
}

// serveUntilStopped serves until a signal, the end of done, a fatal
// error, or a handover: a signal on hups runs hup, which reports whether
// a new process took over. A signal or a handover stops the server
// gracefully (Stop: not ready first, then open requests finish); a second
// signal during that stop cuts them at once (StopNow).
func serveUntilStopped(lg *zap.Logger, done <-chan struct{}, sigs, hups <-chan os.Signal, hup func() bool, srv stoppable) error {
wait:
	for {
		select {
		case err := <-srv.Err():
			srv.Stop()
			return err
		case <-done:
			lg.Info("shutting down")
			break wait
		case sig := <-sigs:
			lg.Info("shutting down: not ready, ending streams, letting open requests finish; signal again to stop at once", zap.Stringer("signal", sig))
			break wait
		case <-hups:
			if hup != nil && hup() {
				lg.Info("handed over: ending streams (clients resume them on the new process), letting open requests finish")
				break wait
			}
		}
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		srv.Stop()
	}()
	select {
	case <-stopped:
	case sig := <-sigs:
		lg.Warn("second signal: stopping at once", zap.Stringer("signal", sig))
		srv.StopNow()
		<-stopped
	}
	return nil
}

// startEmbedded starts the embedded etcd that serves when no --endpoints
// is given, and says loudly that it does, and when its data directory is
// new: a proxy pointed at by production clients must front the real
// cluster, not a fresh, empty etcd of its own.
func startEmbedded(lg *zap.Logger, cfg server.EmbeddedConfig) (*embed.Etcd, error) {
	_, err := os.Stat(filepath.Join(cfg.Dir, "member"))
	fresh := errors.Is(err, fs.ErrNotExist)
	lg.Warn("no --endpoints given: serving in front of an etcd embedded in this process, for development only; "+
		"give --endpoints to front an etcd cluster", zap.String("data-dir", cfg.Dir))
	if fresh {
		lg.Warn("the embedded etcd's data directory is new: its keyspace is empty. "+
			"Do not point kube-apiserver or other clients of a real cluster at this proxy", zap.String("data-dir", cfg.Dir))
	}
	e, err := server.StartEmbedded(cfg)
	if err != nil {
		return nil, err
	}
	lg.Info("started embedded etcd", zap.String("data-dir", cfg.Dir), zap.String("endpoint", server.EmbeddedEndpoint(e)), zap.Bool("new-data-dir", fresh))
	return e, nil
}

// serverConfig checks every flag, as grpc-proxy does before it starts, and
// returns the server's configuration. Each error names its flag.
func serverConfig(c *cli.Context, lg *zap.Logger) (server.Config, error) {
	fallback, err := kvproxy.ParseConsistentReadFallback(c.String("consistent-read-fallback"))
	if err != nil {
		return server.Config{}, fmt.Errorf("--consistent-read-fallback: %w", err)
	}
	if err := refuseUnsupported(c); err != nil {
		return server.Config{}, err
	}
	endpoints, err := upstreamEndpoints(c, lg)
	if err != nil {
		return server.Config{}, err
	}
	serverTLS, err := servingTLSInfo(c)
	if err != nil {
		return server.Config{}, err
	}
	upstreamTLS := transport.TLSInfo{CertFile: c.String("cert"), KeyFile: c.String("key"), TrustedCAFile: c.String("cacert")}
	for _, f := range []string{"cert", "key", "cacert"} {
		if err := fileExists(c, f); err != nil {
			return server.Config{}, err
		}
	}
	if (upstreamTLS.CertFile == "") != (upstreamTLS.KeyFile == "") {
		return server.Config{}, errors.New("--cert and --key: give both or neither")
	}
	if err := checkResolver(c); err != nil {
		return server.Config{}, err
	}
	user, password, err := userFlags(c)
	if err != nil {
		return server.Config{}, err
	}
	if err := checkMetricsAddr(c.String("metrics-addr")); err != nil {
		return server.Config{}, err
	}
	advertise := c.StringSlice("advertise-client-url")
	forwardMembers := c.IsSet("advertise-client-url") && strings.Join(advertise, "") == ""
	if forwardMembers {
		advertise = nil
	}
	if c.Bool("experimental-serializable-ordering") {
		lg.Info("--experimental-serializable-ordering is ignored: serializable reads come from the cache, whose revision never goes back")
	}
	cfg := server.DefaultConfig()
	cfg.Endpoints = endpoints
	cfg.EndpointsAutoSyncInterval = c.Duration("endpoints-auto-sync-interval")
	cfg.ListenAddr = c.String("listen-addr")
	cfg.MetricsAddr = c.String("metrics-addr")
	cfg.AdvertiseClientURLs = advertise
	cfg.ForwardMemberList = forwardMembers
	cfg.ResolverPrefix = c.String("resolver-prefix")
	cfg.ResolverTTL = c.Int("resolver-ttl")
	cfg.ServerTLS = serverTLS
	cfg.AutoTLS = c.Bool("auto-tls")
	cfg.DataDir = c.String("data-dir")
	cfg.SelfSignedCertValidity = c.Uint("self-signed-cert-validity")
	cfg.User, cfg.Password = user, password
	cfg.ClientCertAuth = c.Bool("client-cert-auth")
	cfg.AuthToken = c.String("auth-token")
	cfg.AuthTokenCheckInterval = c.Duration("auth-token-check-interval")
	cfg.UpstreamTLS = upstreamTLS
	cfg.InsecureSkipTLSVerify = c.Bool("insecure-skip-tls-verify")
	cfg.DialTimeout = c.Duration("dial-timeout")
	cfg.DialKeepAliveTime = c.Duration("dial-keepalive-time")
	cfg.DialKeepAliveTimeout = c.Duration("dial-keepalive-timeout")
	cfg.PermitWithoutStream = c.Bool("permit-without-stream")
	cfg.MaxSendBytes = c.Int("max-send-bytes")
	cfg.MaxRecvBytes = c.Int("max-recv-bytes")
	cfg.MaxConcurrentStreams = uint32(min(c.Uint("max-concurrent-streams"), math.MaxUint32))
	cfg.GRPCKeepAliveMinTime = c.Duration("grpc-keepalive-min-time")
	cfg.GRPCKeepAliveInterval = c.Duration("grpc-keepalive-interval")
	cfg.GRPCKeepAliveTimeout = c.Duration("grpc-keepalive-timeout")
	cfg.EnablePprof = c.Bool("enable-pprof")
	cfg.EnableGRPCGateway = c.Bool("enable-grpc-gateway")
	cfg.EnableGRPCLogging = c.Bool("experimental-enable-grpc-logging")
	cfg.Tracing = tracing.Config{
		Enabled:                c.Bool("enable-distributed-tracing"),
		Address:                c.String("distributed-tracing-address"),
		ServiceName:            c.String("distributed-tracing-service-name"),
		InstanceID:             c.String("distributed-tracing-instance-id"),
		SamplingRatePerMillion: c.Int("distributed-tracing-sampling-rate"),
	}
	cfg.Metrics = c.String("metrics")
	cfg.BTreeDegree = c.Int("btree-degree")
	cfg.MaxHistoryBytes = c.Int64("max-history-bytes")
	cfg.RevisionWait = c.Duration("revision-wait")
	cfg.FreshnessTimeout = c.Duration("consistent-read-timeout")
	cfg.ConsistentReadFallback = fallback
	cfg.MaxForwardedReads = c.Int("max-forwarded-reads")
	cfg.MaxCachedReadBytes = c.Int64("max-cached-read-bytes")
	cfg.ConsistencyCheckInterval = c.Duration("consistency-check-interval")
	cfg.CompactionProbeInterval = c.Duration("compaction-probe-interval")
	cfg.LoadRetainedHistory = c.Bool("load-retained-history")
	cfg.PersistDir = ""
	if c.Bool("persist-cache") {
		cfg.PersistDir = filepath.Join(cfg.DataDir, server.PersistSubdir)
	}
	cfg.PersistInterval = c.Duration("persist-interval")
	cfg.LoadPageSize = c.Int64("load-page-size")
	cfg.MaxRequestBytes = c.Int("max-request-bytes")
	// Not given: etcd's own interval, with the flag's default as the
	// fallback while etcd sends none.
	cfg.WatchProgressNotifyInterval = c.Duration("watch-progress-notify-interval")
	cfg.FollowEtcdProgressInterval = !c.IsSet("watch-progress-notify-interval")
	if cfg.MemoryLimit, err = memoryLimit(c.String("memory-limit")); err != nil {
		return server.Config{}, err
	}
	cfg.Logger = lg
	// Without --endpoints the embedded etcd's endpoint is filled in once
	// it has started: everything else is validated now.
	check := cfg
	if len(check.Endpoints) == 0 {
		check.Endpoints = []string{"embedded"}
	}
	if err := check.Validate(); err != nil {
		return server.Config{}, err
	}
	return cfg, nil
}

// memoryLimit parses --memory-limit: "auto", 0 (none), or a byte size.
func memoryLimit(v string) (server.MemoryLimit, error) {
	if strings.EqualFold(strings.TrimSpace(v), "auto") {
		return server.MemoryLimit{Mode: server.MemoryLimitAuto}, nil
	}
	n, err := memlimit.ParseSize(v)
	if err != nil {
		return server.MemoryLimit{}, fmt.Errorf("--memory-limit: %w (or auto, or 0 for none)", err)
	}
	return server.FixedMemoryLimit(n), nil
}

// refuseUnsupported refuses the grpc-proxy flags that would change what
// clients see and that the proxy does not implement: ignoring them would
// serve the wrong keys.
func refuseUnsupported(c *cli.Context) error {
	for _, f := range []string{"namespace", "experimental-leasing-prefix"} {
		if c.String(f) != "" {
			return fmt.Errorf("--%s: not supported by etcd-snapcache (it would change the keys clients see); run etcd grpc-proxy for it", f)
		}
	}
	return nil
}

// upstreamEndpoints returns the upstream endpoints: from DNS SRV records
// with --discovery-srv, as grpc-proxy discovers them, else --endpoints.
func upstreamEndpoints(c *cli.Context, lg *zap.Logger) ([]string, error) {
	if dns := c.String("discovery-srv"); dns != "" {
		srvs, err := srv.GetClient("etcd-client", dns, c.String("discovery-srv-name"))
		if err != nil {
			return nil, fmt.Errorf("--discovery-srv %q: %w", dns, err)
		}
		eps := srvs.Endpoints
		lg.Info("discovered cluster from SRV", zap.String("srv-server", dns), zap.Strings("endpoints", eps))
		if !c.Bool("insecure-discovery") {
			valid, err := transport.ValidateSecureEndpoints(transport.TLSInfo{TrustedCAFile: c.String("cacert"), ServerName: dns}, eps)
			if err != nil {
				lg.Warn("failed to validate discovered endpoints", zap.String("srv-server", dns), zap.Error(err))
			}
			eps = valid
		}
		if len(eps) > 0 {
			return eps, nil
		}
		if !c.IsSet("endpoints") {
			return nil, fmt.Errorf("--discovery-srv %q: no usable endpoint discovered, and no --endpoints", dns)
		}
	}
	if !c.IsSet("endpoints") {
		return nil, nil // the embedded etcd's
	}
	var eps []string
	for _, ep := range c.StringSlice("endpoints") {
		if ep = strings.TrimSpace(ep); ep == "" {
			continue
		}
		if err := checkEndpoint(ep); err != nil {
			return nil, fmt.Errorf("--endpoints %q: %w", ep, err)
		}
		eps = append(eps, ep)
	}
	if len(eps) == 0 {
		return nil, errors.New("--endpoints: empty; give the etcd cluster's client endpoints, or leave the flag out for an embedded etcd")
	}
	return eps, nil
}

// checkEndpoint accepts what clientv3 dials: host:port, or a URL with an
// http, https, unix or unixs scheme.
func checkEndpoint(ep string) error {
	if !strings.Contains(ep, "://") {
		_, _, err := net.SplitHostPort(ep)
		return err
	}
	u, err := url.Parse(ep)
	if err != nil {
		return err
	}
	switch u.Scheme {
	case "http", "https":
		if u.Host == "" {
			return errors.New("no host")
		}
	case "unix", "unixs":
	default:
		return fmt.Errorf("scheme %q, want http, https, unix or unixs", u.Scheme)
	}
	return nil
}

// servingTLSInfo checks the serving TLS flags as grpc-proxy does.
func servingTLSInfo(c *cli.Context) (transport.TLSInfo, error) {
	info := transport.TLSInfo{
		CertFile:      c.String("cert-file"),
		KeyFile:       c.String("key-file"),
		TrustedCAFile: c.String("trusted-ca-file"),
		CRLFile:       c.String("client-crl-file"),
	}
	for _, f := range []string{"cert-file", "key-file", "trusted-ca-file"} {
		if err := fileExists(c, f); err != nil {
			return info, err
		}
	}
	serving := info.CertFile != "" || info.KeyFile != "" || info.TrustedCAFile != "" || c.Bool("auto-tls")
	if (info.CertFile != "" || info.KeyFile != "" || info.TrustedCAFile != "") && (info.CertFile == "" || info.KeyFile == "") {
		return info, errors.New("--cert-file and --key-file: give both to serve TLS")
	}
	if serving {
		if err := fileExists(c, "client-crl-file"); err != nil {
			return info, err
		}
	}
	if c.Bool("auto-tls") && c.Uint("self-signed-cert-validity") == 0 {
		return info, errors.New("--self-signed-cert-validity: must be greater than 0 with --auto-tls")
	}
	minVersion, err := tlsutil.GetTLSVersion(c.String("tls-min-version"))
	if err != nil {
		return info, fmt.Errorf("--tls-min-version: %w", err)
	}
	maxVersion, err := tlsutil.GetTLSVersion(c.String("tls-max-version"))
	if err != nil {
		return info, fmt.Errorf("--tls-max-version: %w", err)
	}
	if maxVersion != 0 && minVersion > maxVersion {
		return info, fmt.Errorf("--tls-min-version %s is greater than --tls-max-version %s", c.String("tls-min-version"), c.String("tls-max-version"))
	}
	info.MinVersion, info.MaxVersion = minVersion, maxVersion
	if suites := c.StringSlice("listen-cipher-suites"); len(suites) > 0 {
		if minVersion == tls.VersionTLS13 {
			return info, errors.New("--listen-cipher-suites: cipher suites cannot be configured when only TLS1.3 is enabled")
		}
		cs, err := tlsutil.GetCipherSuites(suites)
		if err != nil {
			return info, fmt.Errorf("--listen-cipher-suites: %w", err)
		}
		info.CipherSuites = cs
	}
	return info, nil
}

// userFlags reads --user and --password as etcdctl does: name:password, or
// a name with --password. There is no prompt: a proxy runs unattended.
func userFlags(c *cli.Context) (user, password string, err error) {
	user = c.String("user")
	if user == "" {
		if c.String("password") != "" {
			return "", "", errors.New("--password: given without --user")
		}
		return "", "", nil
	}
	if c.IsSet("password") {
		return user, c.String("password"), nil
	}
	name, pw, ok := strings.Cut(user, ":")
	if !ok || name == "" {
		return "", "", errors.New("--user: want name:password, or a name with --password")
	}
	return name, pw, nil
}

// checkResolver is grpc-proxy's rule: a resolver prefix and a positive TTL
// go together.
func checkResolver(c *cli.Context) error {
	prefix, ttl := c.String("resolver-prefix"), c.Int("resolver-ttl")
	switch {
	case prefix != "" && ttl < 1:
		return fmt.Errorf("--resolver-ttl %d: must be at least 1 with --resolver-prefix", ttl)
	case prefix == "" && ttl > 0:
		return errors.New("--resolver-prefix: empty, but --resolver-ttl is set")
	case prefix != "" && c.IsSet("advertise-client-url") && strings.Join(c.StringSlice("advertise-client-url"), "") == "":
		return errors.New("--advertise-client-url: empty, but --resolver-prefix registers it")
	}
	return nil
}

// checkMetricsAddr accepts what grpc-proxy accepts, a URL, and host:port.
func checkMetricsAddr(addr string) error {
	if addr == "" {
		return nil
	}
	if !strings.Contains(addr, "://") {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("--metrics-addr %q: %w", addr, err)
		}
		return nil
	}
	u, err := url.Parse(addr)
	if err != nil {
		return fmt.Errorf("--metrics-addr %q: %w", addr, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("--metrics-addr %q: scheme %q, want http or https", addr, u.Scheme)
	}
	if _, _, err := net.SplitHostPort(u.Host); err != nil {
		return fmt.Errorf("--metrics-addr %q: %w", addr, err)
	}
	return nil
}

// fileExists checks that the file a flag names, if any, can be read.
func fileExists(c *cli.Context, flag string) error {
	name := c.String(flag)
	if name == "" {
		return nil
	}
	f, err := os.Open(name)
	if err != nil {
		return fmt.Errorf("--%s: %w", flag, err)
	}
	return f.Close()
}

func newLogger(level string) (*zap.Logger, error) {
	cfg := zap.NewProductionConfig()
	if err := cfg.Level.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", errors.New("want debug, info, warn or error"))
	}
	return cfg.Build()
}

// tlsVersionName is the --tls-min-version and --tls-max-version name of a
// TLS version (tlsutil.GetTLSVersion's inverse); "" is Go's default.
func tlsVersionName(v uint16) string {
	switch v {
	case tls.VersionTLS12:
		return string(tlsutil.TLSVersion12)
	case tls.VersionTLS13:
		return string(tlsutil.TLSVersion13)
	}
	return string(tlsutil.TLSVersionDefault)
}
