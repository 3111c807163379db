package integration

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestWhileLoading (KEP-4568, one layer down): while the cache loads, small
// reads go to etcd and answer as etcd does, large ranges and new watches get
// a clear Unavailable at once, /readyz fails, and nothing hangs; once loaded,
// all is served from the cache. The load is held on its second page by the
// BeforeLoadPage test hook.
func TestWhileLoading(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	direct := newClient(t, e.Clients[0].Addr().String())
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c", "d"} {
		if _, err := direct.Put(ctx, k, "v"); err != nil {
			t.Fatal(err)
		}
	}

	pages := make(chan struct{}, 10)
	release := make(chan struct{})
	p, err := server.Start(servertest.Config(server.EmbeddedEndpoint(e), func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.LoadPageSize = 2
		cfg.BeforeLoadPage = func() {
			pages <- struct{}{}
			if len(pages) == 2 { // hold the load on its second page
				<-release
			}
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	for len(pages) < 2 {
		select {
		case <-p.Follower().Changed():
		case <-time.After(time.Millisecond): // poll interval of a condition wait
		}
	}
	proxy := newClient(t, p.Addr())
	kv := pb.NewKVClient(proxy.ActiveConnection())
	directKV := pb.NewKVClient(direct.ActiveConnection())

	// Small reads: forwarded, etcd's answer.
	for _, req := range []*pb.RangeRequest{
		{Key: []byte("b")},
		{Key: []byte("a"), RangeEnd: []byte("z"), Limit: 1},
		{Key: []byte("a"), RangeEnd: []byte("z"), CountOnly: true},
	} {
		want, werr := directKV.Range(ctx, req)
		got, gerr := kv.Range(ctx, req)
		if diff := sameOutcome(req, want, werr, got, gerr); diff != "" {
			t.Fatalf("while loading: %s", diff)
		}
	}
	// A large range and a new watch: Unavailable at once, which clients retry.
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := kv.Range(rctx, &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")}); status.Code(err) != codes.Unavailable {
		t.Fatalf("large range while loading: %v, want Unavailable", err)
	}
	ws, err := pb.NewWatchClient(proxy.ActiveConnection()).Watch(rctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ws.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("watch while loading: %v, want Unavailable", err)
	}
	resp, err := http.Get("http://" + p.MetricsAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/readyz while loading: %d", resp.StatusCode)
	}

	close(release)
	servertest.WaitReady(t, p)
	got, err := kv.Range(ctx, &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")})
	if err != nil || got.Count != 4 {
		t.Fatalf("after the load: %v, %v", got, err)
	}
}

// TestCompactionRightAfterStart (etcd's TestDeleteEventDrop_Issue18089 at
// the proxy's start): etcd writes while the proxy loads, and a compaction
// at one of those revisions, through the proxy, follows at once. The proxy
// opened its watch at etcd's head before it loaded, a watch etcd never
// cancels for a compaction: it loads once, keeps the history it followed,
// and answers a watch from the compaction revision from that history,
// with etcd's events.
func TestCompactionRightAfterStart(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	direct := newClient(t, e.Clients[0].Addr().String())
	ctx := context.Background()
	if _, err := direct.Put(ctx, "other", "v"); err != nil {
		t.Fatal(err)
	}
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	p := servertest.StartProxyUnready(t, servertest.Config(server.EmbeddedEndpoint(e), func(cfg *server.Config) {
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Logger = zaptest.NewLogger(t)
		cfg.BeforeLoadPage = func() {
			once.Do(func() { close(held); <-release })
		}
	}))
	select {
	case <-held:
	case <-time.After(waitTimeout):
		t.Fatal("the proxy's load did not begin")
	}
	var delRev int64
	for _, op := range []clientv3.Op{
		clientv3.OpPut("k", "v2"), clientv3.OpPut("k", "v3"), clientv3.OpPut("k", "v4"),
		clientv3.OpDelete("k"), clientv3.OpPut("k", "v6"),
	} {
		resp, err := direct.Do(ctx, op)
		if err != nil {
			t.Fatal(err)
		}
		if op.IsDelete() {
			delRev = resp.Del().Header.Revision
		}
	}
	close(release)
	servertest.WaitReady(t, p)
	proxy := newClient(t, p.Addr())
	if _, err := proxy.Compact(ctx, delRev, clientv3.WithCompactPhysical()); err != nil {
		t.Fatal(err)
	}

	first := func(cli *clientv3.Client) []*mvccpb.Event {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, waitTimeout)
		defer cancel()
		wr := <-cli.Watch(wctx, "k", clientv3.WithRev(delRev), clientv3.WithPrevKV())
		if err := wr.Err(); err != nil {
			t.Fatal(err)
		}
		return wr.Events
	}
	want, got := first(direct), first(proxy)
	if len(want) != 2 || want[0].Type != mvccpb.DELETE {
		t.Fatalf("etcd's events from the compaction revision: %v", want)
	}
	if diff := servertest.DiffEvents(want, got); diff != "" || len(got) != len(want) {
		t.Fatalf("watch from the compaction revision %d: %s (%d events, etcd %d)", delRev, diff, len(got), len(want))
	}
	if n := p.Follower().Loads(); n != 1 {
		t.Fatalf("the proxy loaded %d times, want once", n)
	}
	if n := metricSum(t, p.Registry(), "etcd_snapcache_watch_catchups_total", nil); n != 0 {
		t.Fatalf("%v watchers caught up from etcd, want none: the history since the load is the proxy's", n)
	}
}
