package main

import (
	"errors"
	"fmt"
	"os/signal"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap"

	"go.etcd.io/etcd/client/pkg/v3/transport"

	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/kvproxy"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/watchproxy"
)

const (
	catUpstream = "Upstream etcd"
	catServing  = "Serving"
	catEmbedded = "Embedded etcd (when --endpoints is not set)"
	catCache    = "Cache"
)

func serveCommand() *cli.Command {
	return &cli.Command{
		Name:  "serve",
		Usage: "serve the etcd v3 API in front of an etcd cluster (or of an embedded etcd)",
		Description: "Without --endpoints, serve starts an etcd inside the process, with its data in\n" +
			"--data-dir, and serves in front of it: a complete single-node setup.",
		Flags: []cli.Flag{
			&cli.StringSliceFlag{Name: "endpoints", Category: catUpstream, EnvVars: []string{"ETCD_SNAPCACHE_ENDPOINTS"},
				Usage: "upstream etcd client endpoints, host:port or http(s)://host:port, comma-separated; empty starts an embedded etcd"},
			&cli.StringFlag{Name: "cacert", Category: catUpstream, Usage: "verify the upstream's certificate with this CA bundle"},
			&cli.StringFlag{Name: "cert", Category: catUpstream, Usage: "client certificate for the upstream"},
			&cli.StringFlag{Name: "key", Category: catUpstream, Usage: "client key for the upstream"},
			&cli.DurationFlag{Name: "dial-timeout", Category: catUpstream, Value: 5 * time.Second, Usage: "timeout of the first connection to the upstream"},

			&cli.StringFlag{Name: "listen-addr", Category: catServing, Value: "127.0.0.1:23790", Usage: "address to serve the etcd gRPC API on"},
			&cli.StringFlag{Name: "metrics-addr", Category: catServing, Value: "127.0.0.1:23791", Usage: "address to serve /metrics, /livez and /readyz on; empty disables"},
			&cli.StringSliceFlag{Name: "advertise-client-url", Category: catServing,
				Usage: "client URL(s) MemberList returns for the proxy (default: the listen address)"},
			&cli.StringFlag{Name: "cert-file", Category: catServing, Usage: "serve TLS with this certificate"},
			&cli.StringFlag{Name: "key-file", Category: catServing, Usage: "key of --cert-file"},
			&cli.StringFlag{Name: "trusted-ca-file", Category: catServing, Usage: "require client certificates signed by this CA"},
			&cli.IntFlag{Name: "max-request-bytes", Category: catServing, Value: 1.5 * 1024 * 1024,
				Usage: "the upstream's --max-request-bytes: the largest request accepted, and where fragmenting watch responses are split"},
			&cli.DurationFlag{Name: "watch-progress-notify-interval", Category: catServing, Value: watchproxy.DefaultProgressNotifyInterval,
				Usage: "interval of progress notifications to idle watchers that asked for them (etcd's default)"},
			&cli.StringFlag{Name: "log-level", Category: catServing, Value: "info", Usage: "debug, info, warn or error"},

			&cli.StringFlag{Name: "data-dir", Category: catEmbedded, Value: ".snapcache/etcd", Usage: "data directory of the embedded etcd"},
			&cli.StringFlag{Name: "embedded-client-url", Category: catEmbedded, Value: "http://127.0.0.1:23792", Usage: "client URL of the embedded etcd"},
			&cli.StringFlag{Name: "embedded-peer-url", Category: catEmbedded, Value: "http://127.0.0.1:23793", Usage: "peer URL of the embedded etcd"},

			&cli.IntFlag{Name: "btree-degree", Category: catCache, Value: revtree.DefaultDegree, Usage: "B-tree degree of the snapshot trees (memory per revision vs scan speed)"},
			&cli.DurationFlag{Name: "revision-wait", Category: catCache, Value: kvproxy.DefaultRevisionWait,
				Usage: "how long a read at a revision the cache has not reached waits for it before going to etcd"},
			&cli.DurationFlag{Name: "consistent-read-timeout", Category: catCache, Value: kvproxy.DefaultFreshnessTimeout,
				Usage: "how long a linearizable read waits for proof that the cache is fresh"},
			&cli.StringFlag{Name: "consistent-read-fallback", Category: catCache, Value: "forward",
				Usage: "what a linearizable read does when freshness is not proven in time: 'forward' it to etcd, or 'fail' with Unavailable (under overload, falling back multiplies etcd's load)"},
			&cli.IntFlag{Name: "max-forwarded-reads", Category: catCache, Value: kvproxy.DefaultMaxForwardedReads,
				Usage: "most reads in flight to etcd at once (forwarded reads wait for a slot, then fail with Unavailable)"},
			&cli.DurationFlag{Name: "consistency-check-interval", Category: catCache, Value: hashcheck.DefaultInterval,
				Usage: "how often to compare a hash of the cache with etcd's at one revision; on a mismatch reads go to etcd until the reloaded cache passes (0 disables)"},
			&cli.DurationFlag{Name: "compaction-probe-interval", Category: catCache, Value: time.Second,
				Usage: "how often to check etcd's compaction revision (finds auto-compaction and compactions by other clients)"},
			&cli.Int64Flag{Name: "load-page-size", Category: catCache, Value: progress.DefaultLoadPageSize, Usage: "page size of the initial load"},
			&cli.BoolFlag{Name: "load-retained-history", Category: catCache,
				Usage: "at start, replay every revision etcd retains, so historical reads are served from memory right after a restart"},
		},
		Action: serve,
	}
}

func serve(c *cli.Context) error {
	lg, err := newLogger(c.String("log-level"))
	if err != nil {
		return err
	}
	defer lg.Sync()
	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	fallback, err := kvproxy.ParseConsistentReadFallback(c.String("consistent-read-fallback"))
	if err != nil {
		return fmt.Errorf("--consistent-read-fallback: %w", err)
	}
	endpoints := c.StringSlice("endpoints")
	if len(endpoints) == 0 {
		e, err := server.StartEmbedded(server.EmbeddedConfig{
			Dir:       c.String("data-dir"),
			ClientURL: c.String("embedded-client-url"),
			PeerURL:   c.String("embedded-peer-url"),
			Logger:    lg,
		})
		if err != nil {
			return err
		}
		defer e.Close()
		endpoints = []string{server.EmbeddedEndpoint(e)}
		lg.Info("started embedded etcd", zap.String("data-dir", c.String("data-dir")), zap.Strings("endpoints", endpoints))
	}

	srv, err := server.Start(server.Config{
		Endpoints:           endpoints,
		ListenAddr:          c.String("listen-addr"),
		MetricsAddr:         c.String("metrics-addr"),
		AdvertiseClientURLs: c.StringSlice("advertise-client-url"),
		ServerTLS: transport.TLSInfo{
			CertFile:      c.String("cert-file"),
			KeyFile:       c.String("key-file"),
			TrustedCAFile: c.String("trusted-ca-file"),
		},
		UpstreamTLS: transport.TLSInfo{
			CertFile:      c.String("cert"),
			KeyFile:       c.String("key"),
			TrustedCAFile: c.String("cacert"),
		},
		DialTimeout:                 c.Duration("dial-timeout"),
		BTreeDegree:                 c.Int("btree-degree"),
		RevisionWait:                c.Duration("revision-wait"),
		FreshnessTimeout:            c.Duration("consistent-read-timeout"),
		ConsistentReadFallback:      fallback,
		MaxForwardedReads:           c.Int("max-forwarded-reads"),
		ConsistencyCheckInterval:    checkInterval(c.Duration("consistency-check-interval")),
		CompactionProbeInterval:     c.Duration("compaction-probe-interval"),
		LoadRetainedHistory:         c.Bool("load-retained-history"),
		LoadPageSize:                c.Int64("load-page-size"),
		MaxRequestBytes:             c.Int("max-request-bytes"),
		WatchProgressNotifyInterval: c.Duration("watch-progress-notify-interval"),
		Logger:                      lg,
	})
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		lg.Info("shutting down")
		srv.Stop()
		return nil
	case err := <-srv.Err():
		srv.Stop()
		return err
	}
}

// checkInterval maps the flag's 0 (disabled) to the server's negative.
func checkInterval(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

func newLogger(level string) (*zap.Logger, error) {
	cfg := zap.NewProductionConfig()
	if err := cfg.Level.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", errors.New("want debug, info, warn or error"))
	}
	return cfg.Build()
}
