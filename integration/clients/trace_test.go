package clients

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport/otlpsink"
)

// TestTraceContextForwarded: a call carrying a W3C trace context, as
// kube-apiserver's etcd client sends it (traceparent), reaches etcd with it
// through the proxy as it does directly: etcd, tracing with every sampled
// parent followed (its sampling rate 0 is parent-based), records its span
// of the call in the caller's trace, as the child of the caller's span.
// The proxy runs with tracing off, so it forwards the context untouched.
func TestTraceContextForwarded(t *testing.T) {
	sink := otlpsink.Start(t)
	etcd := startEtcd(t, "etcd",
		"--enable-distributed-tracing",
		"--distributed-tracing-address="+sink.Addr(),
		"--distributed-tracing-service-name=etcd")
	px := startProxy(t, "proxy", etcd.url)

	calls := []struct {
		span string // etcd's span of the call
		call func(ctx context.Context, cli *clientv3.Client) error
	}{
		{"etcdserverpb.KV/Put", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.Put(ctx, "traced", "v")
			return err
		}},
		{"etcdserverpb.KV/Txn", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.Version("traced"), ">", 0)).Then(clientv3.OpPut("traced", "w")).Commit()
			return err
		}},
		{"etcdserverpb.Lease/LeaseGrant", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.Grant(ctx, 60)
			return err
		}},
		{"etcdserverpb.Cluster/MemberList", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.MemberList(ctx)
			return err
		}},
	}
	type sent struct{ side, span, traceID, parentID string }
	var all []sent
	for _, side := range []struct{ name, addr string }{{"direct", etcd.addr}, {"proxy", px.addr}} {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{side.addr}, DialTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer cli.Close()
		for _, c := range calls {
			s := sent{side.name, c.span, randomHex(t, 16), randomHex(t, 8)}
			ctx := metadata.AppendToOutgoingContext(t.Context(), "traceparent", fmt.Sprintf("00-%s-%s-01", s.traceID, s.parentID))
			if err := c.call(ctx, cli); err != nil {
				t.Fatalf("%s: %s: %v", side.name, c.span, err)
			}
			all = append(all, s)
		}
	}
	// etcd exports in batches, every 5 s.
	waitUntil(t, 30*time.Second, "etcd's span of each call in the caller's trace", func() (bool, error) {
		for _, s := range all {
			var names []string
			found := false
			for _, sp := range sink.Spans(s.traceID) {
				if sp.Service == "etcd" && sp.Name == s.span {
					if sp.ParentID != s.parentID {
						return false, fmt.Errorf("%s: etcd's %s span has parent %q, want the caller's %q", s.side, s.span, sp.ParentID, s.parentID)
					}
					found = true
				}
				names = append(names, sp.Service+" "+sp.Name)
			}
			if !found {
				return false, fmt.Errorf("%s: no etcd %s span in the caller's trace; its spans: %v", s.side, s.span, names)
			}
		}
		return true, nil
	}, etcd.process)
}

// randomHex returns n random bytes in hex: a trace id (16) or span id (8).
func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
