package integration

import (
	"context"
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport/proxytest"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// TestWhileLoading (KEP-4568, one layer down): while the cache loads, small
// reads go to etcd and answer as etcd does, large ranges and new watches get
// a clear Unavailable at once, /readyz fails, and nothing hangs; once loaded,
// all is served from the cache. The load is held on its second page by the
// BeforeLoadPage test hook.
func TestWhileLoading(t *testing.T) {
	e := proxytest.StartEtcd(t, server.EmbeddedConfig{})
	direct := newClient(t, e.Clients[0].Addr().String())
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c", "d"} {
		if _, err := direct.Put(ctx, k, "v"); err != nil {
			t.Fatal(err)
		}
	}

	pages := make(chan struct{}, 10)
	release := make(chan struct{})
	p, err := server.Start(server.Config{
		Endpoints:    []string{server.EmbeddedEndpoint(e)},
		ListenAddr:   "127.0.0.1:0",
		MetricsAddr:  "127.0.0.1:0",
		LoadPageSize: 2,
		BeforeLoadPage: func() {
			pages <- struct{}{}
			if len(pages) == 2 { // hold the load on its second page
				<-release
			}
		},
	})
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
	proxytest.WaitReady(t, p)
	got, err := kv.Range(ctx, &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")})
	if err != nil || got.Count != 4 {
		t.Fatalf("after the load: %v, %v", got, err)
	}
}
