package integration

// The services the proxy forwards or relays (Lease, Cluster, Maintenance,
// Watch, and the KV writes) behave through the proxy as they do on etcd.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

func TestLeaseThroughProxy(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	grant, err := c.viaProxy.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	if grant.TTL != 600 || grant.ID == 0 {
		t.Fatalf("grant through the proxy: %+v", grant)
	}
	other, err := c.direct.Grant(ctx, 300)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.viaProxy.Put(ctx, "lease/a", "1", clientv3.WithLease(grant.ID)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.direct.Put(ctx, "lease/b", "2", clientv3.WithLease(grant.ID)); err != nil {
		t.Fatal(err)
	}

	// TimeToLive with keys, through both.
	for _, id := range []clientv3.LeaseID{grant.ID, other.ID, 0x7777} {
		d, err := c.direct.TimeToLive(ctx, id, clientv3.WithAttachedKeys())
		if err != nil {
			t.Fatal(err)
		}
		p, err := c.viaProxy.TimeToLive(ctx, id, clientv3.WithAttachedKeys())
		if err != nil {
			t.Fatal(err)
		}
		// etcd lists the attached keys from a map: in any order.
		for _, r := range []*clientv3.LeaseTimeToLiveResponse{d, p} {
			slices.SortFunc(r.Keys, bytes.Compare)
		}
		// TTL is in whole seconds of a running clock: allow one second.
		if d.ID != p.ID || d.GrantedTTL != p.GrantedTTL || !slices.EqualFunc(d.Keys, p.Keys, slices.Equal) || max(d.TTL-p.TTL, p.TTL-d.TTL) > 1 {
			t.Fatalf("TimeToLive(%x): etcd id=%x ttl=%d granted=%d keys=%q; proxy id=%x ttl=%d granted=%d keys=%q",
				id, d.ID, d.TTL, d.GrantedTTL, d.Keys, p.ID, p.TTL, p.GrantedTTL, p.Keys)
		}
	}

	// Leases: the same set.
	dl, err := c.direct.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pl, err := c.viaProxy.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids := func(r *clientv3.LeaseLeasesResponse) []clientv3.LeaseID {
		var out []clientv3.LeaseID
		for _, l := range r.Leases {
			out = append(out, l.ID)
		}
		slices.Sort(out)
		return out
	}
	if !slices.Equal(ids(dl), ids(pl)) || len(ids(pl)) != 2 {
		t.Fatalf("Leases: etcd %v, proxy %v", ids(dl), ids(pl))
	}

	// KeepAliveOnce and the KeepAlive channel.
	ka, err := c.viaProxy.KeepAliveOnce(ctx, grant.ID)
	if err != nil || ka.ID != grant.ID || ka.TTL != 600 {
		t.Fatalf("KeepAliveOnce through the proxy: %+v %v", ka, err)
	}
	if _, err := c.viaProxy.KeepAliveOnce(ctx, 0x7777); !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		t.Fatalf("KeepAliveOnce of an unknown lease through the proxy: %v, want %v", err, rpctypes.ErrLeaseNotFound)
	}
	kctx, kcancel := context.WithCancel(ctx)
	ch, err := c.viaProxy.KeepAlive(kctx, grant.ID)
	if err != nil {
		t.Fatal(err)
	}
	ch2, err := c.viaProxy.KeepAlive(kctx, other.ID)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct {
		ch  <-chan *clientv3.LeaseKeepAliveResponse
		id  clientv3.LeaseID
		ttl int64
	}{{ch, grant.ID, 600}, {ch2, other.ID, 300}} {
		select {
		case r, ok := <-want.ch:
			if !ok || r.ID != want.id || r.TTL != want.ttl {
				t.Fatalf("KeepAlive channel: %+v (open %v), want lease %x TTL %d", r, ok, want.id, want.ttl)
			}
		case <-ctx.Done():
			t.Fatal("no KeepAlive response through the proxy")
		}
	}
	kcancel()

	// Raw KeepAlive streams: every response equal to etcd's, header
	// included; an unknown lease gets TTL 0; a half-closed stream ends.
	dls := pb.NewLeaseClient(c.direct.ActiveConnection())
	pls := pb.NewLeaseClient(c.viaProxy.ActiveConnection())
	ds, err := dls.LeaseKeepAlive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ps, err := pls.LeaseKeepAlive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []int64{int64(grant.ID), 0x7777, int64(other.ID), int64(grant.ID)} {
		req := &pb.LeaseKeepAliveRequest{ID: id}
		if err := ds.Send(req); err != nil {
			t.Fatal(err)
		}
		if err := ps.Send(req); err != nil {
			t.Fatal(err)
		}
		dr, dErr := ds.Recv()
		pr, pErr := ps.Recv()
		if diff := sameOutcome(req, dr, dErr, pr, pErr); diff != "" {
			t.Fatal(diff)
		}
	}
	if err := ps.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if r, err := ps.Recv(); err != io.EOF {
		t.Fatalf("a half-closed KeepAlive stream through the proxy: %v %v, want EOF", r, err)
	}
	ds.CloseSend()

	// Revoke: the lease's keys go, in etcd and in the cache; a second
	// revoke gets etcd's error from both.
	if _, err := c.viaProxy.Revoke(ctx, grant.ID); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	c.mustSameRange(t, &pb.RangeRequest{Key: []byte("lease/"), RangeEnd: []byte("lease0"), Serializable: true})
	if resp, err := c.proxyKV.Range(ctx, &pb.RangeRequest{Key: []byte("lease/"), RangeEnd: []byte("lease0"), Serializable: true}); err != nil || resp.Count != 0 {
		t.Fatalf("after revoke the cache still has %v (%v)", resp, err)
	}
	req := &pb.LeaseRevokeRequest{ID: int64(grant.ID)}
	dr, dErr := dls.LeaseRevoke(ctx, req)
	pr, pErr := pls.LeaseRevoke(ctx, req)
	if diff := sameOutcome(req, dr, dErr, pr, pErr); diff != "" || !isErr(dErr, rpctypes.ErrGRPCLeaseNotFound) {
		t.Fatalf("second revoke: %v %s", dErr, diff)
	}
	ttl, err := c.viaProxy.TimeToLive(ctx, grant.ID)
	if err != nil || ttl.TTL != -1 {
		t.Fatalf("TimeToLive of a revoked lease through the proxy: %+v %v", ttl, err)
	}
}

// TestLeaseExpiry: a key put through the proxy with a short lease expires
// in etcd, and the deletion reaches the cache.
func TestLeaseExpiry(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx := context.Background()
	l, err := c.viaProxy.Grant(ctx, 1) // etcd raises it to its minimum TTL
	if err != nil {
		t.Fatal(err)
	}
	put, err := c.viaProxy.Put(ctx, "exp/a", "1", clientv3.WithLease(l.ID))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.direct.Put(ctx, "exp/b", "2", clientv3.WithLease(l.ID)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.direct.Put(ctx, "exp/c", "3"); err != nil {
		t.Fatal(err)
	}
	testsupport.WaitFor(t, waitTimeout, "etcd to expire the lease", func() bool {
		r, err := c.direct.Get(ctx, "exp/", clientv3.WithPrefix())
		return err == nil && r.Count == 1
	})
	testsupport.WaitFor(t, waitTimeout, "the cache to see the expiry", func() bool {
		r, err := c.proxyKV.Range(ctx, &pb.RangeRequest{Key: []byte("exp/"), RangeEnd: []byte("exp0"), Serializable: true})
		return err == nil && r.Count == 1
	})
	c.waitSynced(t)
	head := c.etcdRev(t)
	if head != put.Header.Revision+3 {
		t.Fatalf("etcd at %d, want the two puts and one expiry (a Txn of two deletes) after %d", head, put.Header.Revision)
	}
	for rev := put.Header.Revision; rev <= head; rev++ {
		c.mustSameRange(t, &pb.RangeRequest{Key: []byte("exp/"), RangeEnd: []byte("exp0"), Revision: rev})
		c.mustSameRange(t, &pb.RangeRequest{Key: []byte("exp/"), RangeEnd: []byte("exp0"), Revision: rev, KeysOnly: true, SortTarget: pb.RangeRequest_VALUE})
	}
	c.mustSameRange(t, &pb.RangeRequest{Key: []byte("exp/"), RangeEnd: []byte("exp0"), Revision: head, SortTarget: pb.RangeRequest_MOD})
}

func TestMemberListThroughProxy(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx := context.Background()
	d, err := c.direct.MemberList(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p, err := c.viaProxy.MemberList(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Members) != 1 || !slices.Equal(p.Members[0].ClientURLs, []string{"http://" + c.proxyAddr}) {
		t.Fatalf("MemberList through the proxy: %v, want the proxy's own URL http://%s", p.Members, c.proxyAddr)
	}
	if p.Header.ClusterId != d.Header.ClusterId {
		t.Fatalf("cluster id %x through the proxy, %x from etcd", p.Header.ClusterId, d.Header.ClusterId)
	}
	// A client that syncs its endpoints from the member list stays on the proxy.
	if err := c.viaProxy.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if eps := c.viaProxy.Endpoints(); !slices.Equal(eps, []string{"http://" + c.proxyAddr}) {
		t.Fatalf("endpoints after Sync: %v", eps)
	}
	if _, err := c.viaProxy.Put(ctx, "after-sync", "1"); err != nil {
		t.Fatal(err)
	}
}

func TestMaintenanceThroughProxy(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx := context.Background()
	d, err := c.direct.Status(ctx, c.etcdAddr)
	if err != nil {
		t.Fatal(err)
	}
	p, err := c.viaProxy.Status(ctx, c.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	if p.Version != d.Version || p.Version == "" || p.Header.ClusterId != d.Header.ClusterId || p.Leader != d.Leader {
		t.Fatalf("Status through the proxy: version %q leader %x cluster %x; etcd: %q %x %x",
			p.Version, p.Leader, p.Header.ClusterId, d.Version, d.Leader, d.Header.ClusterId)
	}
	if got := c.proxy.Follower().UpstreamVersion(); got != d.Version {
		t.Fatalf("the follower saw upstream version %q, etcd is %q", got, d.Version)
	}
	// The health service turns SERVING once the cache is loaded and
	// etcd's auth state is known, which may come just after the load.
	hc := healthpb.NewHealthClient(c.viaProxy.ActiveConnection())
	testsupport.WaitFor(t, waitTimeout, "health SERVING", func() bool {
		h, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		return err == nil && h.Status == healthpb.HealthCheckResponse_SERVING
	})
}

// collectEvents reads a watch channel until it has seen revision upTo.
func collectEvents(t *testing.T, ch clientv3.WatchChan, upTo int64) []*mvccpb.Event {
	t.Helper()
	var evs []*mvccpb.Event
	timeout := time.After(30 * time.Second)
	for len(evs) == 0 || evs[len(evs)-1].Kv.ModRevision < upTo {
		select {
		case resp, ok := <-ch:
			if !ok {
				t.Fatalf("watch closed after %d events", len(evs))
			}
			if err := resp.Err(); err != nil {
				t.Fatalf("watch: %v", err)
			}
			for _, ev := range resp.Events {
				evs = append(evs, (*mvccpb.Event)(ev))
			}
		case <-timeout:
			t.Fatalf("watch: only %d events, waiting for revision %d", len(evs), upTo)
		}
	}
	return evs
}

func TestWatchThroughProxy(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l, err := c.direct.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	write := func(n int) int64 {
		var last int64
		for i := range n {
			cli := c.direct
			if i%2 == 1 {
				cli = c.viaProxy
			}
			key := fmt.Sprintf("w/%d", i%4)
			var hdr *pb.ResponseHeader
			switch i % 4 {
			case 1:
				r, err := cli.Delete(ctx, key)
				if err != nil {
					t.Fatal(err)
				}
				hdr = r.Header
			case 2:
				r, err := cli.Txn(ctx).Then(clientv3.OpPut(key, "t"), clientv3.OpPut(key+"/x", "t", clientv3.WithLease(l.ID)), clientv3.OpDelete("w/3")).Commit()
				if err != nil {
					t.Fatal(err)
				}
				hdr = r.Header
			default:
				r, err := cli.Put(ctx, key, fmt.Sprint(i))
				if err != nil {
					t.Fatal(err)
				}
				hdr = r.Header
			}
			last = max(last, hdr.Revision)
		}
		return last
	}
	first := write(2)
	head := write(20)

	// From a past revision, with prev_kv, then live.
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithRev(first), clientv3.WithPrevKV()}
	dw := c.direct.Watch(ctx, "w/", opts...)
	pw := c.viaProxy.Watch(ctx, "w/", opts...)
	if diff := servertest.DiffEvents(collectEvents(t, dw, head), collectEvents(t, pw, head)); diff != "" {
		t.Fatalf("history: %s", diff)
	}
	head = write(9)
	if diff := servertest.DiffEvents(collectEvents(t, dw, head), collectEvents(t, pw, head)); diff != "" {
		t.Fatalf("live: %s", diff)
	}

	// A progress request on the proxy's watch is answered at etcd's head.
	if err := c.viaProxy.RequestProgress(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case resp := <-pw:
		if !resp.IsProgressNotify() || resp.Header.Revision != head {
			t.Fatalf("progress through the proxy: %+v, want a notification at %d", resp, head)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no progress notification through the proxy")
	}

	// From a compacted revision: canceled with etcd's compaction revision.
	if _, err := c.viaProxy.Compact(ctx, head-3); err != nil {
		t.Fatal(err)
	}
	for name, cli := range map[string]*clientv3.Client{"etcd": c.direct, "proxy": c.viaProxy} {
		w := cli.Watch(ctx, "w/", clientv3.WithPrefix(), clientv3.WithRev(first))
		select {
		case resp := <-w:
			if !resp.Canceled || resp.CompactRevision != head-3 || !errors.Is(resp.Err(), rpctypes.ErrCompacted) {
				t.Fatalf("%s: watch from compacted revision %d: %+v", name, first, resp)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: no answer to a watch from a compacted revision", name)
		}
	}
}

// TestTxnThroughProxy: Txns are etcd's; read-only ones, which do not move
// the revision, give identical answers through both paths.
func TestTxnThroughProxy(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx := context.Background()
	for i := range 5 {
		if _, err := c.direct.Put(ctx, fmt.Sprintf("tx/%d", i), fmt.Sprint("v", i)); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := c.viaProxy.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision("tx/new"), "=", 0)).
		Then(clientv3.OpPut("tx/new", "n"), clientv3.OpPut("tx/4", "w"), clientv3.OpGet("tx/", clientv3.WithPrefix())).Commit()
	if err != nil || !resp.Succeeded {
		t.Fatalf("create Txn through the proxy: %v %v", resp, err)
	}
	head := resp.Header.Revision
	c.waitSynced(t)
	rng := func(r *pb.RangeRequest) *pb.RequestOp {
		return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: r}}
	}
	txns := []*pb.TxnRequest{
		{ // kube-apiserver's update that lost: the Else Range
			Compare: []*pb.Compare{{Key: []byte("tx/1"), Target: pb.Compare_MOD, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_ModRevision{ModRevision: 1}}},
			Success: []*pb.RequestOp{txnPut("tx/1", "x")},
			Failure: []*pb.RequestOp{txnGet("tx/1")},
		},
		{ // several failing compares and ranges of every shape in the Else
			Compare: []*pb.Compare{
				{Key: []byte("tx/2"), Target: pb.Compare_VALUE, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_Value{Value: []byte("nope")}},
				{Key: []byte("tx/"), RangeEnd: []byte("tx0"), Target: pb.Compare_VERSION, Result: pb.Compare_GREATER, TargetUnion: &pb.Compare_Version{Version: 0}},
			},
			Success: []*pb.RequestOp{txnPut("tx/2", "x")},
			Failure: []*pb.RequestOp{
				rng(&pb.RangeRequest{Key: []byte("tx/"), RangeEnd: []byte("tx0"), SortTarget: pb.RangeRequest_MOD, SortOrder: pb.RangeRequest_DESCEND, Limit: 2}),
				rng(&pb.RangeRequest{Key: []byte("tx/"), RangeEnd: []byte("tx0"), Revision: head - 2, KeysOnly: true}),
				rng(&pb.RangeRequest{Key: []byte("tx/"), RangeEnd: []byte("tx0"), CountOnly: true}),
				{Request: &pb.RequestOp_RequestTxn{RequestTxn: &pb.TxnRequest{Success: []*pb.RequestOp{txnGet("tx/new")}}}},
			},
		},
		{ // read-only success
			Compare: []*pb.Compare{{Key: []byte("tx/new"), Target: pb.Compare_CREATE, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_CreateRevision{CreateRevision: head}}},
			Success: []*pb.RequestOp{txnGet("tx/new"), rng(&pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, Revision: 1})},
		},
		{ // a range at a future revision inside a Txn
			Success: []*pb.RequestOp{rng(&pb.RangeRequest{Key: []byte("tx/1"), Revision: head + 5})},
		},
	}
	for i, txn := range txns {
		dr, dErr := c.directKV.Txn(ctx, txn)
		pr, pErr := c.proxyKV.Txn(ctx, txn)
		if diff := sameOutcome(txn, dr, dErr, pr, pErr); diff != "" {
			t.Fatalf("txn %d: %s", i, diff)
		}
	}
	if c.etcdRev(t) != head {
		t.Fatal("a read-only Txn moved etcd's revision")
	}
}
