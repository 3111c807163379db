package integration

// Compaction from each of its three sources must be mirrored by the proxy so
// that it refuses exactly the revisions etcd refuses and serves the rest:
// Compact through the proxy, kube-apiserver's compact_rev_key Txn followed by
// a Compact straight to etcd, and etcd's own auto-compaction.

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// writeSome writes n changes over a few keys, alternating paths, including
// deletes and a multi-key Txn, and returns etcd's revision after them.
func writeSome(tb testing.TB, c *cluster, prefix string, n int) int64 {
	tb.Helper()
	ctx := context.Background()
	var rev int64
	for i := range n {
		cli := c.direct
		if i%2 == 0 {
			cli = c.viaProxy
		}
		key := fmt.Sprintf("%s%d", prefix, i%5)
		var err error
		var hdr *pb.ResponseHeader
		switch i % 7 {
		case 3:
			var r *clientv3.DeleteResponse
			r, err = cli.Delete(ctx, key)
			if err == nil {
				hdr = r.Header
			}
		case 5:
			var r *clientv3.TxnResponse
			r, err = cli.Txn(ctx).Then(
				clientv3.OpPut(key, "t"+strconv.Itoa(i)),
				clientv3.OpPut(key+"/x", "t"+strconv.Itoa(i)),
				clientv3.OpDelete(prefix+"gone"),
			).Commit()
			if err == nil {
				hdr = r.Header
			}
		default:
			var r *clientv3.PutResponse
			r, err = cli.Put(ctx, key, "v"+strconv.Itoa(i))
			if err == nil {
				hdr = r.Header
			}
		}
		if err != nil {
			tb.Fatalf("write %d: %v", i, err)
		}
		rev = max(rev, hdr.Revision)
	}
	return rev
}

// aroundShapes are the requests compared at each revision near a
// compaction: single key, prefix, whole keyspace, keys-only, count-only,
// sorted with a limit, linearizable and serializable.
func aroundShapes(prefix string) []*pb.RangeRequest {
	p := []byte(prefix)
	return []*pb.RangeRequest{
		{Key: append(p, '1')},
		{Key: p, RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), Serializable: true},
		{Key: []byte{0}, RangeEnd: []byte{0}},
		{Key: []byte{0}, RangeEnd: []byte{0}, KeysOnly: true, Serializable: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, CountOnly: true},
		{Key: p, RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), SortTarget: pb.RangeRequest_MOD, SortOrder: pb.RangeRequest_DESCEND, Limit: 2},
	}
}

// diffsAround compares every shape at revisions compactRev-2 .. compactRev+1
// (and the head and 0) and returns the differences. It also checks that
// etcd itself refuses compactRev-1 and serves compactRev and compactRev+1.
func diffsAround(tb testing.TB, c *cluster, prefix string, compactRev, head int64) []string {
	tb.Helper()
	var diffs []string
	revs := []int64{compactRev - 2, compactRev - 1, compactRev, compactRev + 1, head, head + 1, 0}
	for _, rev := range revs {
		for _, shape := range aroundShapes(prefix) {
			req := cloneRange(shape)
			req.Revision = rev
			diff, _, err := c.compareRange(tb, req)
			if diff != "" {
				diffs = append(diffs, fmt.Sprintf("at revision %d (compacted at %d, head %d): %s", rev, compactRev, head, diff))
				continue
			}
			switch {
			case rev > 0 && rev < compactRev:
				if !isErr(err, rpctypes.ErrGRPCCompacted) {
					tb.Fatalf("etcd answered revision %d below its compaction %d with %v", rev, compactRev, err)
				}
			case rev > head:
				if !isErr(err, rpctypes.ErrGRPCFutureRev) {
					tb.Fatalf("etcd answered future revision %d with %v", rev, err)
				}
			case err != nil:
				tb.Fatalf("etcd refused revision %d (compacted at %d): %v", rev, compactRev, err)
			}
		}
	}
	return diffs
}

func cloneRange(r *pb.RangeRequest) *pb.RangeRequest { return proto.Clone(r).(*pb.RangeRequest) }

func isErr(err, want error) bool {
	if err == nil {
		return false
	}
	g, w := status.Convert(err), status.Convert(want)
	return g.Code() == w.Code() && g.Message() == w.Message()
}

// compareCompactErrors sends Compact requests etcd must refuse (at or below
// its compaction revision, and past its head) to both and compares them.
func compareCompactErrors(tb testing.TB, c *cluster, compactRev, head int64) {
	tb.Helper()
	ctx := context.Background()
	for _, rev := range []int64{compactRev, compactRev - 1, 1, head + 1, head + 1000, 1 << 62} {
		req := &pb.CompactionRequest{Revision: rev}
		dResp, dErr := c.directKV.Compact(ctx, req)
		pResp, pErr := c.proxyKV.Compact(ctx, req)
		if diff := sameOutcome(req, dResp, dErr, pResp, pErr); diff != "" {
			tb.Fatal(diff)
		}
		if dErr == nil {
			tb.Fatalf("etcd accepted Compact(%d) with compaction at %d and head %d", rev, compactRev, head)
		}
		want := rpctypes.ErrGRPCCompacted
		if rev > head {
			want = rpctypes.ErrGRPCFutureRev
		}
		if !isErr(dErr, want) {
			tb.Fatalf("Compact(%d): %v, want %v", rev, dErr, want)
		}
	}
	if got := c.proxy.Store().CompactRev(); got != compactRev {
		tb.Fatalf("refused Compacts moved the proxy's compaction revision to %d, want %d", got, compactRev)
	}
}

// TestCompactThroughProxy: a Compact forwarded by the proxy is mirrored
// before its response returns, so the very next read agrees with etcd.
func TestCompactThroughProxy(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	head := writeSome(t, c, "cp/", 30)
	c.waitSynced(t)
	if _, err := c.viaProxy.Compact(context.Background(), 1); err != nil { // the smallest compaction
		t.Fatal(err)
	}
	for _, compactRev := range []int64{head - 20, head - 8} {
		resp, err := c.proxyKV.Compact(context.Background(), &pb.CompactionRequest{Revision: compactRev})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Header.Revision != head {
			t.Fatalf("Compact response header revision %d, want etcd's %d", resp.Header.Revision, head)
		}
		// No wait: the proxy mirrors the compaction before it answers.
		if got, want := c.proxy.Store().CompactRev(), c.etcdCompactRev(t); got != want || want != compactRev {
			t.Fatalf("after Compact(%d) through the proxy: proxy compact revision %d, etcd %d", compactRev, got, want)
		}
		if diffs := diffsAround(t, c, "cp/", compactRev, head); len(diffs) > 0 {
			t.Fatal(diffs[0])
		}
		compareCompactErrors(t, c, compactRev, head)
	}
	if n := c.proxyMetric(t, "etcd_snapcache_compactions_observed_total", map[string]string{"source": "proxy"}); n != 3 {
		t.Fatalf("compactions_observed_total{source=proxy} = %v, want 3", n)
	}

	// Compacting at the head leaves only the head readable.
	if _, err := c.viaProxy.Compact(context.Background(), head); err != nil {
		t.Fatal(err)
	}
	if diffs := diffsAround(t, c, "cp/", head, head); len(diffs) > 0 {
		t.Fatal(diffs[0])
	}
	compareCompactErrors(t, c, head, head)
}

// kubeCompact is kube-apiserver's compactor step (storage/etcd3/compact.go):
// a Txn that moves compact_rev_key from version t to t+1 and records rev,
// then, if it won and rev != 0, Compact(rev), all straight to etcd. It
// returns the new version and the Txn's revision (the next rev to compact).
func kubeCompact(tb testing.TB, cli *clientv3.Client, t, rev int64) (int64, int64) {
	tb.Helper()
	ctx := context.Background()
	resp, err := cli.Txn(ctx).If(
		clientv3.Compare(clientv3.Version("compact_rev_key"), "=", t),
	).Then(
		clientv3.OpPut("compact_rev_key", strconv.FormatInt(rev, 10)),
	).Else(
		clientv3.OpGet("compact_rev_key"),
	).Commit()
	if err != nil {
		tb.Fatal(err)
	}
	curRev := resp.Header.Revision
	if !resp.Succeeded {
		return resp.Responses[0].GetResponseRange().Kvs[0].Version, curRev
	}
	if rev != 0 {
		if _, err := cli.Compact(ctx, rev); err != nil {
			tb.Fatal(err)
		}
	}
	return t + 1, curRev
}

// TestCompactKubeStyle: kube-apiserver's compactor goes straight to etcd;
// the proxy learns from the compact_rev_key it watches (or its probe).
func TestCompactKubeStyle(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	writeSome(t, c, "kc/", 10)
	version, next := kubeCompact(t, c.direct, 0, 0) // first run: records a revision only
	for round := range 3 {
		writeSome(t, c, "kc/", 15)
		compactRev := next
		version, next = kubeCompact(t, c.direct, version, compactRev)
		if got := c.etcdCompactRev(t); got != compactRev {
			t.Fatalf("round %d: etcd compacted at %d, want %d", round, got, compactRev)
		}
		testsupport.WaitFor(t, waitTimeout, "the proxy to mirror kube-apiserver's compaction", func() bool {
			return c.proxy.Store().CompactRev() == compactRev
		})
		c.waitSynced(t)
		head := c.etcdRev(t)
		if diffs := diffsAround(t, c, "kc/", compactRev, head); len(diffs) > 0 {
			t.Fatal(diffs[0])
		}
		compareCompactErrors(t, c, compactRev, head)

		// A competing compactor loses the Txn: both paths answer alike.
		lost := &pb.TxnRequest{
			Compare: []*pb.Compare{{Key: []byte("compact_rev_key"), Target: pb.Compare_VERSION, Result: pb.Compare_EQUAL,
				TargetUnion: &pb.Compare_Version{Version: version - 1}}},
			Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: []byte("compact_rev_key"), Value: []byte("1")}}}},
			Failure: []*pb.RequestOp{{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte("compact_rev_key")}}}},
		}
		dResp, dErr := c.directKV.Txn(context.Background(), lost)
		pResp, pErr := c.proxyKV.Txn(context.Background(), lost)
		if diff := sameOutcome(lost, dResp, dErr, pResp, pErr); diff != "" {
			t.Fatal(diff)
		}
		if dErr != nil || dResp.Succeeded {
			t.Fatalf("the competing compactor's Txn should lose: %v %v", dResp, dErr)
		}
	}
	t.Logf("compactions observed: compact_rev_key=%v probe=%v",
		c.proxyMetric(t, "etcd_snapcache_compactions_observed_total", map[string]string{"source": "compact_rev_key"}),
		c.proxyMetric(t, "etcd_snapcache_compactions_observed_total", map[string]string{"source": "probe"}))
}

// TestCompactAutoPeriodic: etcd's own auto-compaction. In etcd 3.7.3 the
// "revision" mode compactor only runs every 5 minutes (v3compactor
// revInterval), so this uses "periodic" with a 1s retention: it samples the
// revision every 100ms and compacts at the revision of 1s ago at most once a
// second, until it reaches an idle etcd's head.
func TestCompactAutoPeriodic(t *testing.T) {
	c := newCluster(t, clusterOptions{autoCompactionMode: "periodic", autoCompactionRetention: "1s"})
	ctx := context.Background()

	// Write until etcd compacts somewhere inside the written history.
	var written int
	for c.etcdCompactRev(t) <= 1 {
		if written >= 20000 {
			t.Fatal("etcd did not auto-compact")
		}
		cli := c.direct
		if written%2 == 0 {
			cli = c.viaProxy
		}
		if _, err := cli.Put(ctx, fmt.Sprintf("ac/%d", written%7), strconv.Itoa(written)); err != nil {
			t.Fatal(err)
		}
		written++
	}
	t.Logf("%d writes until etcd auto-compacted at %d", written, c.etcdCompactRev(t))

	// Writes stop; etcd may still compact once a second until it reaches its
	// head. A comparison counts only if etcd's compaction did not move while
	// it ran.
	for attempt := 0; ; attempt++ {
		if attempt == 20 {
			t.Fatal("etcd's compaction kept moving during every comparison")
		}
		compactRev, head := c.etcdCompactRev(t), c.etcdRev(t)
		testsupport.WaitFor(t, waitTimeout, "the proxy to mirror etcd's auto-compaction", func() bool {
			st := c.proxy.Store()
			return st.CompactRev() >= compactRev && st.Rev() >= head
		})
		diffs := diffsAround(t, c, "ac/", compactRev, head)
		if c.etcdCompactRev(t) != compactRev || c.proxy.Store().CompactRev() != compactRev {
			continue // raced with the next compaction
		}
		if len(diffs) > 0 {
			t.Fatal(diffs[0])
		}
		t.Logf("stable comparison at compaction %d, head %d", compactRev, head)
		break
	}

	// An idle etcd ends up compacted at its head, and stays there.
	head := c.etcdRev(t)
	testsupport.WaitFor(t, waitTimeout, "etcd to auto-compact up to its idle head", func() bool { return c.etcdCompactRev(t) == head })
	testsupport.WaitFor(t, waitTimeout, "the proxy to mirror it", func() bool { return c.proxy.Store().CompactRev() == head })
	if diffs := diffsAround(t, c, "ac/", head, head); len(diffs) > 0 {
		t.Fatal(diffs[0])
	}
	compareCompactErrors(t, c, head, head)
	if n := c.proxyMetric(t, "etcd_snapcache_compactions_observed_total", map[string]string{"source": "probe"}); n == 0 {
		t.Fatal("the proxy's probe observed no compaction")
	}
}

// TestSerializableReadWhileCompactionAhead: the proxy can learn of a
// compaction (from its own forwarded Compact, its probe or a compact_rev_key
// hint) before its watch has delivered the compacted revision. etcd never
// refuses a revision-0 read as compacted (it reads at its head, which is >=
// its compaction revision), so neither may the proxy. The follower is cut
// off from etcd to hold it in that state; the compaction is reported to it
// through Follower.ObserveCompaction, exactly as kvproxy.Compact does after
// etcd acknowledged a Compact.
func TestSerializableReadWhileCompactionAhead(t *testing.T) {
	c := newCluster(t, clusterOptions{relay: true})
	ctx := context.Background()
	if _, err := c.direct.Put(ctx, "ahead", "old"); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	c.cut(t)
	resp, err := c.direct.Put(ctx, "ahead", "new")
	if err != nil {
		t.Fatal(err)
	}
	rev := resp.Header.Revision
	if _, err := c.direct.Compact(ctx, rev); err != nil {
		t.Fatal(err)
	}
	c.proxy.Follower().ObserveCompaction(rev, "test")
	if st := c.proxy.Store(); st.Rev() >= rev {
		t.Fatalf("the cache reached %d while cut off", st.Rev())
	}

	req := &pb.RangeRequest{Key: []byte("ahead"), Serializable: true}
	if _, err := c.directKV.Range(ctx, req); err != nil {
		t.Fatalf("etcd: %v", err)
	}
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = c.proxyKV.Range(rctx, req)
	cancel()
	// A stale answer is allowed for a serializable read, and so is failing
	// to reach etcd; the compaction error is not.
	if isErr(err, rpctypes.ErrGRPCCompacted) {
		t.Errorf("serializable revision-0 Range through the proxy failed with %q (cache at %d, compaction mirrored at %d); etcd never refuses revision 0",
			status.Convert(err).Message(), c.proxy.Store().Rev(), rev)
	}
	c.relay.Restore()
	c.waitSynced(t)
	c.mustSameRange(t, req)
}
