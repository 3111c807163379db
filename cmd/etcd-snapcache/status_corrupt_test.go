//go:build snapcachetest

package main

// The status command against a proxy whose cache a test corrupts: it needs
// revtree's CorruptForTest, built only with the snapcachetest tag.

import (
	"context"
	"strings"
	"testing"

	"go.uber.org/zap/zaptest"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestStatusFallback: once a consistency check finds the cache
// inconsistent, status reports the mode fallback and why, until a check
// passes (none here: the periodic check is off).
func TestStatusFallback(t *testing.T) {
	etcd := server.EmbeddedEndpoint(servertest.StartEtcd(t, server.EmbeddedConfig{}))
	p := servertest.StartProxy(t, servertest.Config(etcd, func(cfg *server.Config) {
		cfg.ConsistencyCheckInterval = 0 // checks are made by the test
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	ctx, cancel := context.WithTimeout(context.Background(), statusWait)
	defer cancel()
	servertest.PutAndWait(ctx, t, client(t, etcd, clientv3.Config{}), p)
	args := []string{"--endpoints", "http://" + p.MetricsAddr()}
	if sts, err := statusJSON(t, args...); err != nil || sts[0].Mode != "serving" {
		t.Fatalf("before the corruption: %+v, %v", sts, err)
	}

	p.Store().CorruptForTest(&mvccpb.KeyValue{Key: []byte("b"), Value: []byte("x"), CreateRevision: 3, ModRevision: 99, Version: 7})
	if res, err := p.Checker().Check(ctx); err != nil || res.Match() || !p.Checker().Fallback() {
		t.Fatalf("check of the corrupted cache: %+v, %v, fallback %v", res, err, p.Checker().Fallback())
	}
	// The cache reloads meanwhile; without another check the fallback
	// stays.
	sts, err := statusJSON(t, args...)
	if err != nil || len(sts) != 1 {
		t.Fatalf("status in the fallback: %+v, %v", sts, err)
	}
	if st := sts[0]; st.Mode != "fallback" || st.ModeReason != "consistency check failed" {
		t.Fatalf("mode %q (%q); want fallback, consistency check failed", st.Mode, st.ModeReason)
	}
	row := tableRow(t, statusTable(t, args...), "http://"+p.MetricsAddr())
	if !strings.Contains(row, "fallback (consistency check failed)") {
		t.Fatalf("the row has no fallback mode:\n%s", row)
	}
}
