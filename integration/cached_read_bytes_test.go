package integration

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestCachedReadBytesBounded: the bytes of responses served from the cache
// in flight are bounded. A RangeStream client that stops reading holds a
// chunk, and so the whole bound; meanwhile other cached reads wait for
// room and, past their deadline, get DeadlineExceeded rather than adding
// to memory. Once that client goes, a read larger than the bound is
// served, alone.
func TestCachedReadBytesBounded(t *testing.T) {
	const (
		bound  = 128 << 10
		keys   = 100
		valueN = 20 << 10
	)
	e := servertest.StartEtcd(t, server.EmbeddedConfig{})
	p := servertest.StartProxy(t, servertest.Config("http://"+e.Clients[0].Addr().String(), func(cfg *server.Config) {
		cfg.MaxCachedReadBytes = bound
		cfg.Logger = zaptest.NewLogger(t)
	}))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	etcdKV := pb.NewKVClient(rawConn(t, e.Clients[0].Addr().String()))
	var rev int64
	for i := range keys {
		resp, err := etcdKV.Put(ctx, &pb.PutRequest{Key: fmt.Appendf(nil, "/big/%03d", i), Value: bytes.Repeat([]byte{'v'}, valueN)})
		if err != nil {
			t.Fatal(err)
		}
		rev = resp.Header.Revision
	}
	testsupport.WaitFor(t, waitTimeout, "the cache to apply the writes", func() bool { return p.Store().Rev() >= rev })
	all := &pb.RangeRequest{Key: []byte("/big/"), RangeEnd: []byte("/big0"), Serializable: true}

	// A client that reads nothing: 64 KiB windows, and no window growth.
	stalled, err := grpc.NewClient(p.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	sctx, stopStalled := context.WithCancel(ctx)
	defer stopStalled()
	if _, err := pb.NewKVClient(stalled).RangeStream(sctx, all); err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "the stalled stream to hold the bound", func() bool {
		return proxyMetricValue(t, p, "etcd_snapcache_cached_read_bytes") == bound
	})

	kv := pb.NewKVClient(rawConn(t, p.Addr()))
	testsupport.Poll(t, waitTimeout, time.Millisecond, "a cached read to wait past its deadline", func() (bool, error) {
		rctx, rcancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer rcancel()
		_, err := kv.Range(rctx, all)
		if status.Code(err) == codes.DeadlineExceeded {
			return true, nil
		}
		return false, fmt.Errorf("a cached read while the bound is held: %v", err)
	})
	// The client's deadline may end its call just before the proxy counts it.
	testsupport.WaitFor(t, waitTimeout, "a read counted as rejected for memory", func() bool {
		return proxyMetricValue(t, p, "etcd_snapcache_range_requests_total", "source", "rejected", "reason", "memory") > 0
	})

	stopStalled()
	resp, err := kv.Range(ctx, all)
	if err != nil || len(resp.Kvs) != keys {
		t.Fatalf("read of %d keys after the stalled client left: %d keys, %v", keys, len(resp.GetKvs()), err)
	}
	testsupport.WaitFor(t, waitTimeout, "the bytes to be given back", func() bool {
		return proxyMetricValue(t, p, "etcd_snapcache_cached_read_bytes") == 0
	})
}
