package integration

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestNoIdentityForwardsEverything: a proxy started without an identity of
// its own (no --user, no client certificate) in front of an etcd with auth
// enabled, as etcd's e2e framework starts grpc-proxy, is a correct
// forwarding proxy: every caller gets etcd's answers at once (an anonymous
// read and watch etcd's refusals, a token caller's reads, large ranges,
// watches and leases etcd's answers), nothing comes from the cache, and
// /readyz and the mode metric say the cache is off and why. Once auth is
// disabled the proxy loads its cache and serves from it, without a
// restart; enabled again, it forwards again.
func TestNoIdentityForwardsEverything(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	etcdEP := "http://" + e.Clients[0].Addr().String()
	setUpAuth(t, callerClient(t, etcdEP, "", "", nil))
	p := servertest.StartProxyUnready(t, servertest.Config(etcdEP, func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	proxyEP := "http://" + p.Addr()
	mode := func() string {
		for _, m := range []string{"cache", "loading", "forwarding", "fallback"} {
			if metricSum(t, p.Registry(), "etcd_snapcache_mode", map[string]string{"mode": m}) == 1 {
				return m
			}
		}
		return "none"
	}
	testsupport.WaitFor(t, waitTimeout, "the forwarding mode", func() bool { return mode() == "forwarding" })
	code, body := readyz(t, p)
	if code != http.StatusOK || !strings.Contains(body, "[+]cache ok: the cache is off") || !strings.Contains(body, "--user") {
		t.Fatalf("/readyz in the forwarding mode: %d\n%s", code, body)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Each caller, straight to etcd and through the proxy.
	type pair struct{ direct, proxy *clientv3.Client }
	anon := pair{callerClient(t, etcdEP, "", "", nil), callerClient(t, proxyEP, "", "", nil)}
	alice := pair{callerClient(t, etcdEP, "alice", "alicepw", nil), callerClient(t, proxyEP, "alice", "alicepw", nil)}
	root := pair{callerClient(t, etcdEP, "root", "rootpw", nil), callerClient(t, proxyEP, "root", "rootpw", nil)}

	sameRange := func(what string, c pair, req *pb.RangeRequest) {
		t.Helper()
		start := time.Now()
		want, werr := pb.NewKVClient(c.direct.ActiveConnection()).Range(ctx, req)
		got, gerr := pb.NewKVClient(c.proxy.ActiveConnection()).Range(ctx, req)
		if diff := sameOutcome(req, want, werr, got, gerr); diff != "" {
			t.Fatalf("%s: %s", what, diff)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("%s took %v: a refusal must come at once, as etcd's", what, d)
		}
	}
	all := &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}
	for _, c := range []struct {
		what string
		c    pair
		req  *pb.RangeRequest
	}{
		{"anonymous serializable get", anon, &pb.RangeRequest{Key: []byte("/alice/x"), Serializable: true}},
		{"anonymous get", anon, &pb.RangeRequest{Key: []byte("/alice/x")}},
		{"alice's own key", alice, &pb.RangeRequest{Key: []byte("/alice/x"), Serializable: true}},
		{"alice's refused key", alice, &pb.RangeRequest{Key: []byte("/secret")}},
		{"root's whole keyspace", root, all},
		{"root's whole keyspace, serializable", root, &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, Serializable: true}},
	} {
		sameRange(c.what, c.c, c.req)
	}

	// Watches: refused as etcd refuses them, or relayed.
	for _, c := range []struct {
		what string
		c    pair
		cr   *pb.WatchCreateRequest
	}{
		{"anonymous watch", anon, &pb.WatchCreateRequest{Key: []byte("/alice/x"), StartRevision: 1}},
		{"alice's refused watch", alice, &pb.WatchCreateRequest{Key: []byte("/secret"), StartRevision: 1}},
	} {
		want := firstWatchResponse(t, c.c.direct, c.cr)
		got := firstWatchResponse(t, c.c.proxy, c.cr)
		want.Header, got.Header = nil, nil
		if !proto.Equal(want, got) {
			t.Fatalf("%s: etcd %v, proxy %v", c.what, want, got)
		}
	}
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	wch := alice.proxy.Watch(wctx, "/alice/", clientv3.WithPrefix(), clientv3.WithRev(1), clientv3.WithPrevKV())
	put, err := alice.proxy.Put(ctx, "/alice/y", "through the proxy")
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	for wr := range wch {
		if err := wr.Err(); err != nil {
			t.Fatal(err)
		}
		for _, ev := range wr.Events {
			seen = append(seen, string(ev.Kv.Key))
		}
		if wr.Header.Revision >= put.Header.Revision && len(seen) >= 2 {
			break
		}
	}
	if strings.Join(seen, " ") != "/alice/x /alice/y" {
		t.Fatalf("alice's watch through the proxy saw %v", seen)
	}

	// Leases work.
	lease, err := alice.proxy.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := alice.proxy.KeepAliveOnce(ctx, lease.ID); err != nil {
		t.Fatal(err)
	}
	if n := metricSum(t, p.Registry(), "etcd_snapcache_range_requests_total", map[string]string{"source": "cache"}); n != 0 {
		t.Fatalf("%v ranges were served from the cache while it is off", n)
	}
	if n := metricSum(t, p.Registry(), "etcd_snapcache_range_requests_total", map[string]string{"reason": "forwarding"}); n == 0 {
		t.Fatal("no range was counted as forwarded for the forwarding mode")
	}

	// Auth disabled: the proxy loads its cache and serves from it.
	if _, err := root.direct.AuthDisable(ctx); err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the cache mode", func() bool { return mode() == "cache" })
	servertest.WaitReady(t, p)
	sameRange("anonymous read, auth disabled", anon, &pb.RangeRequest{Key: []byte("/secret"), Serializable: true})
	if n := metricSum(t, p.Registry(), "etcd_snapcache_range_requests_total", map[string]string{"source": "cache"}); n == 0 {
		t.Fatal("no range was served from the cache once auth was disabled")
	}
	if _, body := readyz(t, p); strings.Contains(body, "the cache is off") {
		t.Fatalf("/readyz with the cache on:\n%s", body)
	}

	// Enabled again: nothing from the cache, every caller gets etcd's answer.
	if _, err := callerClient(t, etcdEP, "", "", nil).AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the forwarding mode again", func() bool { return mode() == "forwarding" })
	cached := metricSum(t, p.Registry(), "etcd_snapcache_range_requests_total", map[string]string{"source": "cache"})
	sameRange("anonymous read, auth enabled again", anon, &pb.RangeRequest{Key: []byte("/secret"), Serializable: true})
	sameRange("root's whole keyspace, auth enabled again", root, all)
	if n := metricSum(t, p.Registry(), "etcd_snapcache_range_requests_total", map[string]string{"source": "cache"}); n != cached {
		t.Fatalf("%v ranges were served from the cache with auth enabled again", n-cached)
	}
}

// readyz returns the proxy's /readyz?verbose status code and body.
func readyz(t *testing.T, p *server.Server) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + p.MetricsAddr() + "/readyz?verbose")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}
