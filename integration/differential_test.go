package integration

// TestDifferentialRange: the proxy's KV.Range against etcd's, end to end.
//
// A seeded random workload is written half through the proxy and half
// straight to etcd: puts over a small key space whose keys are prefixes of
// one another (some with a lease), single and prefix deletes, multi-op Txns
// (several keys in one revision, so mod_revision ties), kube-apiserver's
// create/update/delete Txns, lease revocations (several deletes in one
// revision) and compactions through either path. After each batch, with
// writes quiescent and the cache synced, many random RangeRequests go to
// both etcd and the proxy over raw gRPC; the whole responses, headers
// included, must be proto.Equal, and errors must have the same gRPC code and
// message. The proxy's metrics must show that every request that can be
// served from the cache was.

import (
	"context"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// diffKeys is the key space: keys that are prefixes of each other, with
// 0x00 and 0xff bytes, and the extremes of the keyspace.
var diffKeys = []string{
	"\x00", "\x00\x00", "a", "a\x00", "a\xff", "ab", "abc", "abd", "b", "b/1", "b/10",
	"b/2", "ba", "foo", "foo/", "foo/a", "foo/a/b", "foo0", "k", "k\xff", "z", "\xff", "\xff\xff",
}

// diffBounds are range boundaries that are not keys.
var diffBounds = []string{"0", "a\x01", "ac", "b/", "b0", "foo/\xff", "j", "y", "\xff\xff\xff"}

// diffValues are few, so that sorting by value has ties.
var diffValues = []string{"", "v", "a", "b", "zz", "v"}

var diffLimits = []int64{0, 0, 0, 1, 1, 2, 3, 5, 100, -1, -5}

const (
	diffBatches         = 10
	diffWritesPerBatch  = 40
	diffQueriesPerBatch = 300
)

// diffSeed returns the workload seed: SNAPCACHE_SEED if set, else the clock.
func diffSeed(t *testing.T) uint64 {
	if s := os.Getenv("SNAPCACHE_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("SNAPCACHE_SEED: %v", err)
		}
		return n
	}
	return uint64(time.Now().UnixNano())
}

// workload writes random changes through the proxy and straight to etcd.
type workload struct {
	t      *testing.T
	c      *cluster
	r      *rand.Rand
	leases []clientv3.LeaseID
	writes int
}

func newWorkload(t *testing.T, c *cluster, seed uint64) *workload {
	w := &workload{t: t, c: c, r: rand.New(rand.NewPCG(seed, seed^0x5eed))}
	for range 2 {
		w.grantLease()
	}
	return w
}

// cli picks the path of one write: the proxy or etcd itself.
func (w *workload) cli() *clientv3.Client {
	if w.r.IntN(2) == 0 {
		return w.c.viaProxy
	}
	return w.c.direct
}

func (w *workload) grantLease() {
	l, err := w.cli().Grant(context.Background(), 3600)
	if err != nil {
		w.t.Fatal(err)
	}
	w.leases = append(w.leases, l.ID)
}

func (w *workload) key() string { return diffKeys[w.r.IntN(len(diffKeys))] }
func (w *workload) value() string {
	return diffValues[w.r.IntN(len(diffValues))] + strconv.Itoa(w.r.IntN(3))
}

func (w *workload) putOpts() []clientv3.OpOption {
	if w.r.IntN(3) == 0 {
		return []clientv3.OpOption{clientv3.WithLease(w.leases[w.r.IntN(len(w.leases))])}
	}
	return nil
}

// modRev is key's current mod_revision in etcd (0 if absent).
func (w *workload) modRev(key string) int64 {
	resp, err := w.c.direct.Get(context.Background(), key)
	if err != nil {
		w.t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return 0
	}
	return resp.Kvs[0].ModRevision
}

func (w *workload) step() {
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	var err error
	switch n := w.r.IntN(100); {
	case n < 35: // put, a third of them with a lease
		_, err = w.cli().Put(ctx, w.key(), w.value(), w.putOpts()...)
	case n < 40: // put keeping the key's lease and value-only update
		key := w.key()
		if w.modRev(key) != 0 {
			_, err = w.cli().Put(ctx, key, w.value(), clientv3.WithIgnoreLease())
		}
	case n < 48: // delete one key (maybe absent: no revision)
		_, err = w.cli().Delete(ctx, w.key())
	case n < 53: // delete a prefix or a range
		if w.r.IntN(2) == 0 {
			_, err = w.cli().Delete(ctx, w.key(), clientv3.WithPrefix())
		} else {
			a, b := w.key(), diffBounds[w.r.IntN(len(diffBounds))]
			if a > b {
				a, b = b, a
			}
			_, err = w.cli().Delete(ctx, a, clientv3.WithRange(b))
		}
	case n < 70: // several distinct keys in one revision: mod_revision ties
		seen := map[string]bool{}
		var ops []clientv3.Op
		for range 2 + w.r.IntN(4) {
			k := w.key()
			if seen[k] {
				continue
			}
			seen[k] = true
			if w.r.IntN(4) == 0 {
				ops = append(ops, clientv3.OpDelete(k))
			} else {
				ops = append(ops, clientv3.OpPut(k, w.value(), w.putOpts()...))
			}
		}
		_, err = w.cli().Txn(ctx).Then(ops...).Commit()
	case n < 96: // kube-apiserver's guarded create, update and delete
		key := w.key()
		mr := w.modRev(key)
		if w.r.IntN(5) == 0 {
			mr += 1 + int64(w.r.IntN(2)) // stale: the Else branch runs
		}
		cmp := clientv3.Compare(clientv3.ModRevision(key), "=", mr)
		var then clientv3.Op
		switch {
		case mr == 0:
			then = clientv3.OpPut(key, w.value(), w.putOpts()...)
		case w.r.IntN(4) == 0:
			then = clientv3.OpDelete(key)
		default:
			then = clientv3.OpPut(key, w.value(), w.putOpts()...)
		}
		_, err = w.cli().Txn(ctx).If(cmp).Then(then).Else(clientv3.OpGet(key)).Commit()
	default: // revoke a lease: all its keys go in one revision
		i := w.r.IntN(len(w.leases))
		_, err = w.cli().Revoke(ctx, w.leases[i])
		w.leases = append(w.leases[:i], w.leases[i+1:]...)
		w.grantLease()
	}
	if err != nil {
		w.t.Fatalf("write %d: %v", w.writes, err)
	}
	w.writes++
}

// compact compacts at a random revision past etcd's compaction revision
// that leaves a later revision readable, through either path.
func (w *workload) compact(compactRev, head int64) {
	if head-1 <= compactRev {
		return
	}
	rev := compactRev + 1 + w.r.Int64N(head-1-compactRev)
	via := "proxy"
	cli := w.c.viaProxy
	if w.r.IntN(2) == 0 {
		via, cli = "etcd", w.c.direct
	}
	if _, err := cli.Compact(context.Background(), rev); err != nil {
		w.t.Fatalf("compact at %d via %s: %v", rev, via, err)
	}
	w.t.Logf("compacted at %d via %s", rev, via)
}

// randRange returns a random RangeRequest over the key space at a revision
// around [compactRev-2, head+2], or 0.
func randRange(r *rand.Rand, compactRev, head int64) *pb.RangeRequest {
	key := func() []byte {
		if r.IntN(4) == 0 {
			return []byte(diffBounds[r.IntN(len(diffBounds))])
		}
		return []byte(diffKeys[r.IntN(len(diffKeys))])
	}
	req := &pb.RangeRequest{}
	switch r.IntN(7) {
	case 0, 1: // a single key
		req.Key = key()
	case 2: // [key, end)
		req.Key, req.RangeEnd = key(), key()
		if string(req.Key) > string(req.RangeEnd) {
			req.Key, req.RangeEnd = req.RangeEnd, req.Key
		}
	case 3: // a prefix
		req.Key = key()
		req.RangeEnd = []byte(clientv3.GetPrefixRangeEnd(string(req.Key)))
	case 4: // from key on
		req.Key, req.RangeEnd = key(), []byte{0}
	case 5: // the whole keyspace
		req.Key, req.RangeEnd = []byte{0}, []byte{0}
	case 6: // inverted or empty
		req.Key, req.RangeEnd = key(), key()
		if string(req.Key) < string(req.RangeEnd) {
			req.Key, req.RangeEnd = req.RangeEnd, req.Key
		}
	}
	if r.IntN(4) != 0 {
		lo := compactRev - 2
		req.Revision = lo + r.Int64N(head+2-lo+1)
	}
	req.Serializable = r.IntN(2) == 0
	req.Limit = diffLimits[r.IntN(len(diffLimits))]
	if r.IntN(5) < 3 {
		req.SortTarget = pb.RangeRequest_SortTarget(r.IntN(5))
		req.SortOrder = pb.RangeRequest_SortOrder(r.IntN(3))
	}
	req.KeysOnly = r.IntN(3) == 0
	req.CountOnly = r.IntN(10) == 0
	if r.IntN(3) == 0 {
		filter := func() int64 {
			if r.IntN(2) == 0 {
				return 0
			}
			return r.Int64N(head + 2)
		}
		req.MinModRevision, req.MaxModRevision = filter(), filter()
		req.MinCreateRevision, req.MaxCreateRevision = filter(), filter()
	}
	return req
}

// expectedSource says where the proxy must answer req from: "cache",
// "forwarded", "rejected", or "" when this test does not pin it down.
// Linearizable reads go through a read fence, whose quorum read lets etcd
// itself refuse a compacted or future revision.
func expectedSource(req *pb.RangeRequest, compactRev, head int64) string {
	switch {
	case req.Revision < 0:
		return "" // see TestNegativeRevisionLinearizable
	case req.Revision == 0:
		return "cache"
	case req.Revision > head && req.Serializable:
		return "forwarded" // the cache cannot tell it is ahead of etcd
	case req.Revision > head:
		return "rejected"
	case req.Revision < compactRev:
		return "rejected"
	default:
		return "cache"
	}
}

func TestDifferentialRange(t *testing.T) { testDifferentialRange(t, clusterOptions{}) }

func testDifferentialRange(t *testing.T, opts clusterOptions) {
	seed := diffSeed(t)
	t.Logf("seed %d (rerun with SNAPCACHE_SEED=%d)", seed, seed)
	c := newCluster(t, opts)
	w := newWorkload(t, c, seed)
	qr := rand.New(rand.NewPCG(seed^0xabcdef, seed))

	var compared, fromCache, errs int
	for batch := range diffBatches {
		for range diffWritesPerBatch {
			w.step()
		}
		if batch >= 2 && w.r.IntN(3) != 0 {
			w.compact(c.etcdCompactRev(t), c.etcdRev(t))
		}
		c.waitSynced(t)
		head, compactRev := c.etcdRev(t), c.etcdCompactRev(t)
		if got := c.proxy.Store().CompactRev(); got != compactRev {
			t.Fatalf("batch %d: proxy compact revision %d, etcd's %d", batch, got, compactRev)
		}

		want := map[string]int{}
		cache0, fwd0, rej0 := c.rangeSources(t)
		for q := range diffQueriesPerBatch {
			req := randRange(qr, compactRev, head)
			diff, _, err := c.compareRange(t, req)
			if diff != "" {
				t.Fatalf("seed %d batch %d query %d (etcd revision %d, compacted at %d):\n%s", seed, batch, q, head, compactRev, diff)
			}
			if err != nil {
				errs++
			}
			want[expectedSource(req, compactRev, head)]++
			compared++
		}
		cache1, fwd1, rej1 := c.rangeSources(t)
		dc, df, dr := int(cache1-cache0), int(fwd1-fwd0), int(rej1-rej0)
		loose := want[""]
		if dr != want["rejected"] || dc < want["cache"] || df < want["forwarded"] || dc+df != want["cache"]+want["forwarded"]+loose {
			t.Fatalf("batch %d: proxy served cache=%d forwarded=%d rejected=%d; want cache=%d forwarded=%d rejected=%d (+%d negative-revision requests either way)",
				batch, dc, df, dr, want["cache"], want["forwarded"], want["rejected"], loose)
		}
		fromCache += dc
		if head != c.etcdRev(t) {
			t.Fatalf("batch %d: etcd's revision moved during the comparison", batch)
		}
	}

	// Every retained revision, and the boundaries, in a few fixed shapes;
	// the leased keys are covered by keys-only with and without value sort.
	c.waitSynced(t)
	head, compactRev := c.etcdRev(t), c.etcdCompactRev(t)
	cache0, _, _ := c.rangeSources(t)
	shapes := []*pb.RangeRequest{
		{Key: []byte{0}, RangeEnd: []byte{0}},
		{Key: []byte{0}, RangeEnd: []byte{0}, KeysOnly: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, KeysOnly: true, SortTarget: pb.RangeRequest_VALUE},
		{Key: []byte{0}, RangeEnd: []byte{0}, SortTarget: pb.RangeRequest_MOD, SortOrder: pb.RangeRequest_DESCEND, Limit: 4},
	}
	var sawLeasedKeysOnly bool
	for rev := max(compactRev-1, 1); rev <= head+1; rev++ {
		for _, shape := range shapes {
			req := proto.Clone(shape).(*pb.RangeRequest)
			req.Revision = rev
			resp, err := c.mustSameRange(t, req)
			compared++
			if err == nil && req.KeysOnly && req.SortTarget == pb.RangeRequest_VALUE {
				for _, kv := range resp.Kvs {
					sawLeasedKeysOnly = sawLeasedKeysOnly || kv.Lease != 0
				}
			}
		}
	}
	cache1, _, _ := c.rangeSources(t)
	if served, want := int(cache1-cache0), int(head-max(compactRev, 1)+1)*len(shapes); served != want {
		t.Fatalf("revision sweep: %d requests served from cache, want %d", served, want)
	}
	fromCache += int(cache1 - cache0)
	if !sawLeasedKeysOnly {
		// The random workload left no leased key in the window: write one,
		// so that the lease quirk of keys-only ranges sorted by value is
		// exercised whatever the seed.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		lease, err := c.direct.Grant(ctx, 60)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.direct.Put(ctx, "leased-quirk", "v", clientv3.WithLease(lease.ID)); err != nil {
			t.Fatal(err)
		}
		c.waitSynced(t)
		resp, err := c.mustSameRange(t, &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}, KeysOnly: true, SortTarget: pb.RangeRequest_VALUE})
		for _, kv := range resp.GetKvs() {
			sawLeasedKeysOnly = sawLeasedKeysOnly || (err == nil && kv.Lease != 0)
		}
	}
	if !sawLeasedKeysOnly {
		t.Fatalf("no leased key in keys-only ranges sorted by value: the lease quirk was not exercised")
	}
	t.Logf("%d writes, head %d, compacted at %d: %d ranges compared (%d errors), %d served from cache",
		w.writes, head, compactRev, compared, errs, fromCache)
}

// TestKeysOnlyLease pins etcd 3.7's keys-only quirk: the lease is dropped
// from keys-only results unless they are sorted by value. It checks etcd
// itself and the proxy, at the current and a past revision.
func TestKeysOnlyLease(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx := context.Background()
	l, err := c.direct.Grant(ctx, 3600)
	if err != nil {
		t.Fatal(err)
	}
	put, err := c.direct.Put(ctx, "lk/a", "x", clientv3.WithLease(l.ID))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.viaProxy.Put(ctx, "lk/b", "y", clientv3.WithLease(l.ID)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.direct.Put(ctx, "lk/c", "z"); err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	for _, rev := range []int64{0, put.Header.Revision} {
		for target := range pb.RangeRequest_SortTarget_name {
			for order := range pb.RangeRequest_SortOrder_name {
				for _, single := range []bool{false, true} {
					req := &pb.RangeRequest{Key: []byte("lk/"), RangeEnd: []byte("lk0"), KeysOnly: true, Revision: rev, Serializable: rev == 0,
						SortTarget: pb.RangeRequest_SortTarget(target), SortOrder: pb.RangeRequest_SortOrder(order)}
					if single {
						req.Key, req.RangeEnd = []byte("lk/a"), nil
					}
					resp, err := c.mustSameRange(t, req)
					if err != nil {
						t.Fatal(err)
					}
					for _, kv := range resp.Kvs {
						hasLease := kv.Lease != 0
						wantLease := req.SortTarget == pb.RangeRequest_VALUE && string(kv.Key) != "lk/c"
						if hasLease != wantLease {
							t.Fatalf("etcd itself: keys-only %s lease=%d (sort %v %v); the quirk this test pins changed", kv.Key, kv.Lease, req.SortTarget, req.SortOrder)
						}
						if len(kv.Value) != 0 {
							t.Fatalf("keys-only returned a value for %s", kv.Key)
						}
					}
				}
			}
		}
	}
	if n := c.proxyMetric(t, "etcd_snapcache_range_requests_total", map[string]string{"source": "cache"}); n == 0 {
		t.Fatal("no keys-only range was served from the cache")
	}
}
