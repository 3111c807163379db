//go:build snapcachetest

package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// TestConsistencyCheckDetectsFallsBackAndRecovers: a corruption injected
// into the cache (a test hook) is found by the next check, which names the
// key; from then on every read, at the head or at the corrupted revision,
// answers as etcd does; the cache reloads, a later check passes on its own,
// and reads come from the cache again, correct.
func TestConsistencyCheckDetectsFallsBackAndRecovers(t *testing.T) {
	c := newCluster(t, clusterOptions{configure: func(cfg *server.Config) {
		cfg.ConsistencyCheckInterval = time.Hour // checks are made by the test
	}})
	ctx := context.Background()
	for i := range 50 {
		if _, err := c.direct.Put(ctx, fmt.Sprintf("/hc/%02d", i), "v"); err != nil {
			t.Fatal(err)
		}
	}
	c.waitSynced(t)
	checker := c.proxy.Checker()
	checks := func(result string) float64 {
		return c.proxyMetric(t, "etcd_snapcache_consistency_checks_total", map[string]string{"result": result})
	}
	if res, err := checker.Check(ctx); err != nil || !res.Match() || res.Keys != 50 {
		t.Fatalf("check of a healthy cache: %+v, %v", res, err)
	}

	head := c.etcdRev(t)
	key := []byte("/hc/07")
	c.proxy.Store().CorruptForTest(&mvccpb.KeyValue{Key: key, Value: []byte("CORRUPT"), CreateRevision: 2, ModRevision: 3, Version: 9})
	res, err := checker.Check(ctx)
	if err != nil || res.Match() || checks("failure") != 1 {
		t.Fatalf("check of a corrupted cache: %+v, %v (failures %v)", res, err, checks("failure"))
	}
	t.Logf("detected: %s", res.FirstDiff)

	// Once detected, no read returns the corrupted data: every read
	// answers as etcd does until a later check passes.
	fallbackSeen := checker.Fallback() || checks("success") >= 2 // the recovery is quick
	if !fallbackSeen {
		t.Fatal("no fallback after a failed check")
	}
	for _, req := range []*pb.RangeRequest{
		{Key: key},
		{Key: key, Serializable: true},
		{Key: key, Revision: head},
		{Key: key, Revision: head, Serializable: true},
		{Key: []byte("/hc/"), RangeEnd: []byte("/hc0"), Revision: head, Serializable: true},
	} {
		if checker.Fallback() { // the recovery may already be complete
			c.mustSameRange(t, req)
		}
	}

	testsupport.WaitFor(t, waitTimeout, "a passing check after the reload", func() bool { return !checker.Fallback() })
	if checks("success") < 2 {
		t.Fatalf("fallback lifted after %v successful checks", checks("success"))
	}
	if n := c.proxyMetric(t, "etcd_snapcache_reloads_total", map[string]string{"reason": "inconsistent"}); n != 1 {
		t.Fatalf("%v reloads for the inconsistency, want 1", n)
	}
	cache0, _, _ := c.rangeSources(t)
	got, err := c.mustSameRange(t, &pb.RangeRequest{Key: key, Serializable: true})
	if err != nil || len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "v" {
		t.Fatalf("after recovery: %v, %v", got, err)
	}
	if cache1, _, _ := c.rangeSources(t); cache1 != cache0+1 {
		t.Fatal("after recovery the read did not come from the cache")
	}
}
