package integration

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestLeaseKeepAliveCoalesced: many client streams keeping the same and
// different leases alive through the proxy each get one answer per request,
// with etcd's TTL, over one upstream stream; a lease nobody keeps alive
// expires on etcd's schedule, and keepalives of an unknown lease get TTL 0
// as from etcd.
func TestLeaseKeepAliveCoalesced(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	const ttl = 30
	leases := make([]clientv3.LeaseID, 3)
	for i := range leases {
		g, err := c.viaProxy.Grant(ctx, ttl)
		if err != nil {
			t.Fatal(err)
		}
		leases[i] = g.ID
	}

	// etcd's own counter of streams it served (process-wide, so deltas).
	upstreamStreams := func() float64 {
		return metricSum(t, prometheus.DefaultGatherer, "grpc_server_started_total", map[string]string{"grpc_method": "LeaseKeepAlive"})
	}
	before := upstreamStreams()

	const streams, rounds = 8, 20
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	for s := 0; s < streams; s++ {
		wg.Add(1)
		go func(s int) {
			defer wg.Done()
			ka, err := pb.NewLeaseClient(c.viaProxy.ActiveConnection()).LeaseKeepAlive(ctx)
			if err != nil {
				errs <- err
				return
			}
			for r := 0; r < rounds; r++ {
				id := int64(leases[(s+r)%len(leases)])
				if err := ka.Send(&pb.LeaseKeepAliveRequest{ID: id}); err != nil {
					errs <- err
					return
				}
				resp, err := ka.Recv()
				if err != nil {
					errs <- err
					return
				}
				if resp.ID != id || resp.TTL != ttl {
					t.Errorf("stream %d: keepalive of %x answered with id %x ttl %d", s, id, resp.ID, resp.TTL)
				}
			}
			ka.CloseSend()
		}(s)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// The proxy may have opened its one stream before or after `before`.
	if opened := upstreamStreams() - before; opened > 1 {
		t.Fatalf("%d client streams opened %v upstream keepalive streams, want at most 1", streams, opened)
	}

	// An unknown lease: etcd answers TTL 0, and so must the proxy.
	for _, cli := range []*clientv3.Client{c.direct, c.viaProxy} {
		ka, err := pb.NewLeaseClient(cli.ActiveConnection()).LeaseKeepAlive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := ka.Send(&pb.LeaseKeepAliveRequest{ID: 0x7fff}); err != nil {
			t.Fatal(err)
		}
		resp, err := ka.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if resp.ID != 0x7fff || resp.TTL != 0 {
			t.Fatalf("unknown lease answered with id %x ttl %d, want ttl 0", resp.ID, resp.TTL)
		}
	}

	// A half-closed stream gets its pending answers, then ends.
	ka, err := pb.NewLeaseClient(c.viaProxy.ActiveConnection()).LeaseKeepAlive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range leases {
		if err := ka.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
			t.Fatal(err)
		}
	}
	ka.CloseSend()
	for range leases {
		if _, err := ka.Recv(); err != nil {
			t.Fatalf("answer after half-close: %v", err)
		}
	}
}
