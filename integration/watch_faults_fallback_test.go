//go:build snapcachetest

package integration

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// TestWatchInconsistentCacheEndsRunningStreams: when the consistency check
// finds the cache wrong, watch streams already running are not left on it.
// Each watcher gets the compacted cancel (a clientv3 watch sees
// ErrCompacted, on which kube-apiserver relists), with the revision it
// would go on from, and the stream ends with Unavailable. Watching again
// works, and sees new writes.
func TestWatchInconsistentCacheEndsRunningStreams(t *testing.T) {
	c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) {
		cfg.ConsistencyCheckInterval = time.Hour // checks are made by the test
	}})
	w := etcdWriter{t, c.direct}
	w.put("/wi/a", "1")
	c.waitSynced(t)
	s := openWatchStream(t, c.viaProxy.ActiveConnection(), "proxy")
	s.create(prefixWatch("/wi/", 0, true))
	s.create(&pb.WatchCreateRequest{Key: []byte("/wi/b")})
	s.waitCreated(2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wch := c.viaProxy.Watch(ctx, "/wi/", clientv3.WithPrefix(), clientv3.WithCreatedNotify())
	if r := <-wch; !r.Created {
		t.Fatalf("clientv3 watch: %+v, want created", r)
	}
	last := w.put("/wi/a", "2")
	s.waitUntil("the event", func(log []*pb.WatchResponse) bool { return len(log) == 3 })
	if r := <-wch; len(r.Events) != 1 || r.Events[0].Kv.ModRevision != last {
		t.Fatalf("clientv3 watch: %+v, want the event at %d", r, last)
	}
	c.waitSynced(t)

	c.proxy.Store().CorruptForTest(&mvccpb.KeyValue{Key: []byte("/wi/a"), Value: []byte("CORRUPT"), CreateRevision: 2, ModRevision: 2, Version: 7})
	if res, err := c.proxy.Checker().Check(ctx); err != nil || res.Match() {
		t.Fatalf("check of the corrupted cache: %+v, %v", res, err)
	}

	log := s.waitUntil("two cancels", cancelsAtLeast(2))
	for _, r := range log[3:] {
		if !r.Canceled || r.CompactRevision != last+1 || r.Header.GetRevision() != 0 {
			t.Fatalf("want each watcher canceled as compacted at %d:\n%s", last+1, dumpResponses(log))
		}
	}
	<-s.done
	if status.Code(s.err) != codes.Unavailable {
		t.Fatalf("the stream ended with %v, want Unavailable", s.err)
	}
	select {
	case r := <-wch:
		if !errors.Is(r.Err(), rpctypes.ErrCompacted) || r.CompactRevision != last+1 {
			t.Fatalf("clientv3 watch: %+v (%v), want ErrCompacted at %d", r, r.Err(), last+1)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the clientv3 watch was not canceled")
	}

	// What a client does next: read again and watch from there.
	get, err := c.viaProxy.Get(ctx, "/wi/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	again := c.viaProxy.Watch(ctx, "/wi/", clientv3.WithPrefix(), clientv3.WithRev(get.Header.Revision+1))
	rev := w.put("/wi/b", "3")
	select {
	case r := <-again:
		if r.Err() != nil || len(r.Events) != 1 || r.Events[0].Kv.ModRevision != rev {
			t.Fatalf("the watch made again: %+v (%v), want the event at %d", r, r.Err(), rev)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the watch made again got nothing")
	}
	testsupport.WaitFor(t, waitTimeout, "the fallback to end", func() bool { return !c.proxy.Checker().Fallback() })
}
