package e2e

import (
	"context"
	"flag"
	"math/rand/v2"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/server"
)

var (
	memKeys      = flag.Int("snapcache.e2e.keys", 100_000, "keys loaded before the measured revisions")
	memRevisions = flag.Int("snapcache.e2e.revisions", 200_000, "measured revisions: single-key updates of random keys")
	memValue     = flag.Int("snapcache.e2e.value", 64, "value size in bytes")
	memBudget    = flag.Int64("snapcache.e2e.budget", 64<<20, "--max-history-bytes of the budget case")
	memWriters   = flag.Int("snapcache.e2e.writers", 16, "concurrent writers")
)

const mib = 1 << 20

// BenchmarkHistoryMemory measures what retained history costs the proxy:
// etcd runs as a separate process; -snapcache.e2e.keys keys (kube-apiserver-
// shaped, -snapcache.e2e.value bytes each) are written, the proxy (in this
// process) loads them, and its live heap H0 is read; then
// -snapcache.e2e.revisions revisions, each a put of a random key by
// concurrent writers, and once the cache has applied them the live heap H1.
// It is a memory measurement: each case writes its revisions once, and the
// timed loop only reads a random retained revision through the proxy.
//
//	unbounded   (--max-history-bytes=0): every revision retained.
//	            B/rev = (H1-H0)/revisions, the heap per retained revision;
//	            est-B/rev the store's own estimate of it.
//	budget      (--max-history-bytes=-snapcache.e2e.budget): the oldest
//	            revisions dropped past the budget. history-MiB = H1-H0,
//	            the heap history takes under the budget; budget-MiB;
//	            est-history-MiB the store's accounting; heap-MiB = H1, the
//	            proxy's whole live heap; retained the revisions it holds.
//
// Both report etcd-RSS-MiB, etcd's resident memory, which is not in H.
func BenchmarkHistoryMemory(b *testing.B) {
	for _, tc := range []struct {
		name   string
		budget int64
	}{{"unbounded", -1}, {"budget", *memBudget}} {
		b.Run(tc.name, func(b *testing.B) {
			etcd := startEtcd(b)
			ks := keyspace{n: *memKeys}
			w := newWriter(dial(b, etcd.endpoint, nil, "", ""), *memValue, *memWriters)
			loaded := w.put(b, ks.n, ks.key)
			p := startProxy(b, etcd.endpoint, func(c *server.Config) { c.MaxHistoryBytes = tc.budget })
			waitApplied(b, p, loaded)
			st := p.Store()
			h0, est0, hist0 := liveHeap(), st.ApproxBytes(), st.HistoryBytes()

			head := w.put(b, *memRevisions, ks.random(1))
			waitApplied(b, p, head)
			h1 := liveHeap()
			revs := float64(head - loaded)
			retained := head - st.OldestRev()
			b.Logf("%s: %d keys, %d revisions, %d retained; live heap %.1f MiB after the load, %.1f MiB after the revisions; estimate %.1f MiB, history %.1f MiB; etcd RSS %.1f MiB",
				tc.name, ks.n, head-loaded, retained, float64(h0)/mib, float64(h1)/mib,
				float64(st.ApproxBytes())/mib, float64(st.HistoryBytes())/mib, float64(etcd.rssBytes())/mib)

			kv := pb.NewKVClient(dial(b, p.Addr(), nil, "", "").ActiveConnection())
			rng := rand.New(rand.NewPCG(2, 3))
			for b.Loop() {
				rev := st.OldestRev() + rng.Int64N(max(retained, 1))
				if _, err := kv.Range(context.Background(), &pb.RangeRequest{Key: ks.key(rng.IntN(ks.n)), Revision: rev, Serializable: true}); err != nil {
					b.Fatal(err)
				}
			}
			// After the loop: b.Loop's timer reset drops earlier metrics.
			if tc.budget < 0 {
				b.ReportMetric(float64(h1-h0)/revs, "B/rev")
				b.ReportMetric(float64(st.ApproxBytes()-est0)/revs, "est-B/rev")
			} else {
				b.ReportMetric(float64(h1-h0)/mib, "history-MiB")
				b.ReportMetric(float64(tc.budget)/mib, "budget-MiB")
				b.ReportMetric(float64(st.HistoryBytes()-hist0)/mib, "est-history-MiB")
				b.ReportMetric(float64(h1)/mib, "heap-MiB")
				b.ReportMetric(float64(retained), "retained")
			}
			b.ReportMetric(float64(etcd.rssBytes())/mib, "etcd-RSS-MiB")
		})
	}
}
