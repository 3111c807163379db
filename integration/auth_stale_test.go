package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestAuthStaleMirrorForwards: the proxy's mirror of etcd's auth state
// cannot read etcd (its polls are held up in a stalled relay between the
// proxy and etcd, as on a congested link or a starved process), and etcd
// enables auth meanwhile, directly. The proxy may go on serving an
// anonymous serializable read from its cache only until its last answered
// poll is authcache.MaxMirrorAge old: no read that arrives later is served
// from the cache. The first one that is not is forwarded to etcd
// (reason auth_stale) and, once the relay flows again, gets etcd's own
// refusal, with etcd's code and message. So does a watch stream opened
// then: it is relayed to etcd whole, and etcd refuses its create.
func TestAuthStaleMirrorForwards(t *testing.T) {
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	etcdAddr := e.Clients[0].Addr().String()
	etcdEP := "http://" + etcdAddr
	setUpAuth(t, callerClient(t, etcdEP, "", "", nil))
	relay := testsupport.NewRelay(t, etcdAddr)
	p := servertest.StartProxy(t, servertest.Config("http://"+relay.Addr(), func(cfg *server.Config) {
		cfg.User, cfg.Password = "root", "rootpw"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	proxyEP := "http://" + p.Addr()
	root := callerClient(t, etcdEP, "root", "rootpw", nil)
	// Without clientv3's retries: each read is answered once.
	etcdKV, proxyKV := rawKV(t, etcdEP, nil), rawKV(t, proxyEP, nil)
	secret := &pb.RangeRequest{Key: []byte("/secret"), Serializable: true}
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitTimeout)
	defer cancel()

	if _, err := root.AuthDisable(ctx); err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the anonymous read served from the cache with auth disabled", func() bool {
		before := rangeCounts(t, p)["cache/serializable"]
		resp, err := proxyKV.Range(ctx, secret)
		return err == nil && len(resp.Kvs) == 1 && rangeCounts(t, p)["cache/serializable"] > before
	})

	// Every poll answered from now on was sent before the stall.
	relay.Stall()
	stalled := time.Now()
	if _, err := root.AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}
	enabled := time.Now()
	_, etcdErr := etcdKV.Range(ctx, secret)
	if got := errText(etcdErr); got != errUserEmpty {
		t.Fatalf("TEST EXPECTATION: etcd answered the anonymous read with %q, want %q", got, errUserEmpty)
	}

	// Read until a read is not answered: with the relay stalled, only the
	// cache answers, and a forwarded read waits in the relay.
	staleBefore := rangeCounts(t, p)["forwarded/auth_stale"]
	cached := 0
	var forwarded chan error
	for forwarded == nil {
		issued := time.Now()
		done := make(chan error, 1)
		go func() {
			_, err := proxyKV.Range(ctx, secret)
			done <- err
		}()
		testsupport.WaitFor(t, waitTimeout, "the read answered from the cache, or forwarded", func() bool {
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("an anonymous read while etcd is out of reach: %v, want the cache's answer or none yet", err)
				}
				cached++
				if late := issued.Sub(stalled); late > authcache.MaxMirrorAge {
					t.Fatalf("an anonymous read that arrived %v after the relay stalled (so at least that long after the mirror's last answered poll was sent; the bound is %v) was served from the cache", late, authcache.MaxMirrorAge)
				}
				return true
			default:
			}
			if rangeCounts(t, p)["forwarded/auth_stale"] > staleBefore {
				forwarded = done
				return true
			}
			return false
		})
	}
	t.Logf("after auth was enabled, %d anonymous reads served from the cache for %v; then forwarded", cached, time.Since(enabled))

	// A watch stream opened now is relayed to etcd whole.
	create := &pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{Key: []byte("/secret")}}}
	relayedBefore := proxyMetricValue(t, p, "etcd_snapcache_watch_relayed_streams_total")
	ws, err := pb.NewWatchClient(rawConn(t, p.Addr())).Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ws.Send(create); err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the anonymous watch stream relayed", func() bool {
		return proxyMetricValue(t, p, "etcd_snapcache_watch_relayed_streams_total") > relayedBefore
	})

	// etcd judges the forwarded read and the relayed watch once the relay
	// flows again.
	relay.Flow()
	var proxyErr error
	select {
	case proxyErr = <-forwarded:
	case <-ctx.Done():
		t.Fatal("the forwarded read was not answered")
	}
	got, want := status.Convert(proxyErr), status.Convert(etcdErr)
	if proxyErr == nil || got.Code() != want.Code() || got.Message() != want.Message() {
		t.Fatalf("the forwarded anonymous read: %v, want etcd's %v", proxyErr, etcdErr)
	}

	proxyResp, err := ws.Recv()
	if err != nil {
		t.Fatal(err)
	}
	etcdWS, err := pb.NewWatchClient(rawConn(t, etcdAddr)).Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := etcdWS.Send(create); err != nil {
		t.Fatal(err)
	}
	etcdResp, err := etcdWS.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if !etcdResp.Canceled || !strings.HasSuffix(etcdResp.CancelReason, errUserEmpty) {
		t.Fatalf("TEST EXPECTATION: etcd answered the anonymous watch create with %v, want it canceled: %s", etcdResp, errUserEmpty)
	}
	if proxyResp.Created != etcdResp.Created || proxyResp.Canceled != etcdResp.Canceled || proxyResp.CancelReason != etcdResp.CancelReason || proxyResp.WatchId != etcdResp.WatchId {
		t.Fatalf("the relayed anonymous watch create: %v, want etcd's %v", proxyResp, etcdResp)
	}

	// The mirror reads etcd again, and the proxy goes on answering as etcd.
	anonEtcd, anonProxy := callerClient(t, etcdEP, "", "", nil), callerClient(t, proxyEP, "", "", nil)
	followEtcd(t, authReenableWithin, "the anonymous read with auth enabled, the mirror caught up", anonEtcd, anonProxy, secret, errUserEmpty)
}
