// Package servertest holds the test helpers that need etcd or the proxy's
// own packages: starting an embedded etcd and the proxy in front of it, and
// comparing what etcd and the proxy answer, beside the server it starts (as
// net/http/httptest beside net/http). The main module's tests and the
// robustness module use it; the helpers that need the standard library
// alone are in internal/testsupport.
package servertest

import (
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// ReadyTimeout bounds the wait for the proxy's first load.
const ReadyTimeout = 30 * time.Second

// StartEtcd starts an embedded etcd (in a temporary directory unless
// cfg.Dir is set), closed when the test ends.
func StartEtcd(tb testing.TB, cfg server.EmbeddedConfig) *embed.Etcd {
	tb.Helper()
	if cfg.Dir == "" {
		cfg.Dir = tb.TempDir()
	}
	e, err := server.StartEmbedded(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(e.Close)
	return e
}

// Config is server.DefaultConfig in front of the etcd at endpoint,
// listening on a free port of 127.0.0.1, with edit applied (if any): a
// test says only what it changes, and every other field but MemoryLimit
// (none) and PersistDir (no copy on disk: a test that wants one gives it
// a temporary directory) is the default a user gets.
func Config(endpoint string, edit func(cfg *server.Config)) server.Config {
	cfg := server.DefaultConfig()
	cfg.Endpoints = []string{endpoint}
	cfg.ListenAddr = "127.0.0.1:0"
	// The memory limit is the process's, and a test's heap holds more
	// than one proxy's store (an embedded etcd, other proxies): the
	// runtime's default pacing, unless the test sets one.
	cfg.MemoryLimit = server.MemoryLimit{Mode: server.MemoryLimitNone}
	// The default is relative to the working directory, which tests share.
	cfg.PersistDir = ""
	if edit != nil {
		edit(&cfg)
	}
	return cfg
}

// StartProxy starts the proxy, stopped when the test ends, and waits until
// it is ready (WaitReady).
func StartProxy(tb testing.TB, cfg server.Config) *server.Server {
	tb.Helper()
	p := StartProxyUnready(tb, cfg)
	WaitReady(tb, p)
	return p
}

// StartProxyUnready starts the proxy, stopped when the test ends, without
// waiting for it to be ready.
func StartProxyUnready(tb testing.TB, cfg server.Config) *server.Server {
	tb.Helper()
	p, err := server.Start(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Stop)
	return p
}

// WaitReady waits until p has loaded its cache and serves, and fails tb if
// p reports a fatal error first or is not ready within ReadyTimeout.
func WaitReady(tb testing.TB, p *server.Server) {
	tb.Helper()
	timeout := time.NewTimer(ReadyTimeout)
	defer timeout.Stop()
	select {
	case <-p.Ready():
	case err := <-p.Err():
		tb.Fatalf("proxy failed before it was ready: %v", err)
	case <-timeout.C:
		tb.Fatalf("proxy not ready after %v", ReadyTimeout)
	}
}

// compact formats a message on one line.
var compact = prototext.MarshalOptions{}

// DiffEvents reports the first difference between the events etcd sent and
// the ones the proxy sent (proto.Equal, in order), or "" when they are the
// same.
func DiffEvents(etcd, proxy []*mvccpb.Event) string {
	for i := range min(len(etcd), len(proxy)) {
		if !proto.Equal(etcd[i], proxy[i]) {
			return fmt.Sprintf("event %d differs:\netcd:  %s\nproxy: %s", i, compact.Format(etcd[i]), compact.Format(proxy[i]))
		}
	}
	if len(etcd) != len(proxy) {
		return fmt.Sprintf("etcd sent %d events, the proxy %d", len(etcd), len(proxy))
	}
	return ""
}
