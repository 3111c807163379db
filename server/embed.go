package server

import (
	"fmt"
	"net/url"
	"time"

	"go.uber.org/zap"

	"go.etcd.io/etcd/server/v3/embed"
)

// EmbeddedConfig configures an in-process etcd.
type EmbeddedConfig struct {
	// Dir holds etcd's data.
	Dir string
	// ClientURL and PeerURL are where etcd listens; a port of 0 picks a free
	// one. Defaults: http://127.0.0.1:0 for both.
	ClientURL, PeerURL string
	// AutoCompactionMode and AutoCompactionRetention are etcd's
	// --auto-compaction-mode and --auto-compaction-retention.
	AutoCompactionMode, AutoCompactionRetention string
	// MaxRequestBytes is etcd's --max-request-bytes (etcd's default if 0).
	MaxRequestBytes uint
	// AuthToken is etcd's --auth-token (simple if empty).
	AuthToken string
	// UnsafeNoFsync is etcd's --unsafe-no-fsync: no fsync of the WAL and
	// the backend; tests that write many revisions only.
	UnsafeNoFsync bool
	Logger        *zap.Logger
}

// StartEmbedded starts a single-member etcd in this process and waits until
// it serves. Its first client URL is e.Clients[0].Addr().
func StartEmbedded(cfg EmbeddedConfig) (*embed.Etcd, error) {
	if cfg.ClientURL == "" {
		cfg.ClientURL = "http://127.0.0.1:0"
	}
	if cfg.PeerURL == "" {
		cfg.PeerURL = "http://127.0.0.1:0"
	}
	curl, err := url.Parse(cfg.ClientURL)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd client URL: %w", err)
	}
	purl, err := url.Parse(cfg.PeerURL)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd peer URL: %w", err)
	}
	ec := embed.NewConfig()
	ec.Name = "etcd-snapcache-embedded"
	ec.Dir = cfg.Dir
	ec.ListenClientUrls = []url.URL{*curl}
	ec.AdvertiseClientUrls = []url.URL{*curl}
	ec.ListenPeerUrls = []url.URL{*purl}
	ec.AdvertisePeerUrls = []url.URL{*purl}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	if cfg.AutoCompactionMode != "" {
		ec.AutoCompactionMode = cfg.AutoCompactionMode
		ec.AutoCompactionRetention = cfg.AutoCompactionRetention
	}
	if cfg.MaxRequestBytes > 0 {
		ec.MaxRequestBytes = cfg.MaxRequestBytes
	}
	if cfg.AuthToken != "" {
		ec.AuthToken = cfg.AuthToken
	}
	ec.UnsafeNoFsync = cfg.UnsafeNoFsync
	ec.LogLevel = "error"
	// Without a logger of the caller's (tests), etcd stays quiet: it logs
	// every listener it closes at shutdown as an error.
	lg := zap.NewNop()
	if cfg.Logger != nil {
		lg = cfg.Logger.Named("etcd")
	}
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg)
	e, err := embed.StartEtcd(ec)
	if err != nil {
		return nil, fmt.Errorf("starting embedded etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("embedded etcd failed: %w", err)
	case <-time.After(time.Minute):
		e.Close()
		return nil, fmt.Errorf("embedded etcd not ready after a minute")
	}
}

// EmbeddedEndpoint returns the client endpoint of an embedded etcd.
func EmbeddedEndpoint(e *embed.Etcd) string {
	return "http://" + e.Clients[0].Addr().String()
}
