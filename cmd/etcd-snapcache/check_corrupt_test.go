//go:build snapcachetest

package main

// The check command against a proxy whose cache a test corrupts: it needs
// revtree's CorruptForTest, built only with the snapcachetest tag.

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap/zaptest"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestCheckCommand: `check` passes against a healthy proxy, and exits 1
// naming the key once the proxy's cache is corrupted.
func TestCheckCommand(t *testing.T) {
	etcd := server.EmbeddedEndpoint(servertest.StartEtcd(t, server.EmbeddedConfig{}))
	p := servertest.StartProxy(t, servertest.Config(etcd, func(cfg *server.Config) {
		cfg.ConsistencyCheckInterval = 0 // never: the proxy must not repair itself here
		cfg.Logger = zaptest.NewLogger(t)
	}))

	client, err := clientv3.New(clientv3.Config{Endpoints: []string{etcd}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	var last int64
	for _, k := range []string{"a", "b", "c"} {
		resp, err := client.Put(context.Background(), k, "v")
		if err != nil {
			t.Fatal(err)
		}
		last = resp.Header.Revision
	}
	for p.Store().Rev() < last {
		select {
		case <-p.Follower().Changed():
		case <-time.After(10 * time.Second):
			t.Fatal("the proxy did not catch up")
		}
	}

	out, err := run("check", "--endpoints", etcd, "--proxy", p.Addr())
	if err != nil || !strings.Contains(out, "OK") {
		t.Fatalf("check of a healthy proxy: %q, %v", out, err)
	}

	p.Store().CorruptForTest(&mvccpb.KeyValue{Key: []byte("b"), Value: []byte("x"), CreateRevision: 3, ModRevision: 99, Version: 7})
	out, err = run("check", "--endpoints", etcd, "--proxy", p.Addr())
	var exit cli.ExitCoder
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(err.Error(), `"b"`) {
		t.Fatalf("check of a corrupted proxy: %q, %v; want exit 1 naming key b", out, err)
	}
}
