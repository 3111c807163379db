package e2e

import (
	"context"
	"flag"
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

var (
	getClients   = flag.Int("snapcache.e2e.get-clients", 32, "concurrent goroutines of BenchmarkLinearizableGet")
	getKeys      = flag.Int("snapcache.e2e.get-keys", 1000, "keys (1 KiB) loaded for BenchmarkLinearizableGet")
	rangeKeys    = flag.Int("snapcache.e2e.range-keys", 10_000, "keys of BenchmarkPaginatedList and BenchmarkHistoricalRange")
	rangeUpdates = flag.Int("snapcache.e2e.range-updates", 2000, "revisions written after the read revision R")
	rangeClients = flag.Int("snapcache.e2e.range-clients", 4, "concurrent goroutines of BenchmarkPaginatedList and BenchmarkHistoricalRange")
	pageSize     = flag.Int64("snapcache.e2e.page", 500, "page size of BenchmarkPaginatedList (kube-apiserver's default)")
)

// rangeData is a pair of etcd and proxy processes loaded with keys of
// keyspace ks, valueSize bytes each, at revision rev, then updates single
// puts of random existing keys: rev is in the past, as a LIST at a
// resourceVersion or a continued LIST reads it.
type rangeData struct {
	env      *pairEnv
	ks       keyspace
	rev      int64
	head     int64
	key, end []byte // the whole keyspace: [key, end)
	bytes    int    // encoded size of the full Range response at rev
}

const rangePrefix = "/registry/pods/"

func loadRangeData(b *testing.B, keys, valueSize, updates int) *rangeData {
	b.Helper()
	start := time.Now()
	env := newPairEnv(b)
	d := &rangeData{env: env, ks: keyspace{n: keys}, key: []byte(rangePrefix), end: []byte(clientv3.GetPrefixRangeEnd(rangePrefix))}
	w := newWriter(env.loader, valueSize, 16)
	d.rev = w.put(b, keys, d.ks.key)
	if updates > 0 {
		d.head = w.put(b, updates, d.ks.random(1))
	} else {
		d.head = d.rev
	}
	if d.rev != env.head(b)-int64(updates) || d.rev < int64(keys) {
		// The writer's puts are one revision each; a lower head would
		// mean something else wrote.
		b.Fatalf("load at revision %d, head %d after %d updates", d.rev, env.head(b), updates)
	}
	env.waitProxy(b, d.head, d.rev)

	// Both sides give the same answer at rev.
	req := d.fullRange()
	ctx := context.Background()
	fromEtcd, err := env.etcdS.kvs[0].Range(ctx, req)
	if err != nil {
		b.Fatal(err)
	}
	fromProxy, err := env.proxyS.kvs[0].Range(ctx, req)
	if err != nil {
		b.Fatal(err)
	}
	if len(fromEtcd.Kvs) != keys || len(fromProxy.Kvs) != keys || fromProxy.Count != fromEtcd.Count || fromProxy.More != fromEtcd.More {
		b.Fatalf("at R: etcd %d keys (count %d), proxy %d keys (count %d), want %d",
			len(fromEtcd.Kvs), fromEtcd.Count, len(fromProxy.Kvs), fromProxy.Count, keys)
	}
	for i := range fromEtcd.Kvs {
		if !proto.Equal(fromEtcd.Kvs[i], fromProxy.Kvs[i]) {
			b.Fatalf("key %d differs at R: proxy %v, etcd %v", i, fromProxy.Kvs[i], fromEtcd.Kvs[i])
		}
	}
	d.bytes = proto.Size(fromEtcd)
	b.Logf("setup: %d keys x %d B at R=%d, %d later revisions, full Range %.1f MiB, auth %v, transport %s; took %v",
		keys, valueSize, d.rev, updates, float64(d.bytes)/mib, env.auth, transportName(env.tls != nil), time.Since(start).Round(time.Millisecond))
	return d
}

// fullRange is the whole keyspace at R, as kube-apiserver's LIST with an
// exact resourceVersion and no limit asks it (linearizable).
func (d *rangeData) fullRange() *pb.RangeRequest {
	return &pb.RangeRequest{Key: d.key, RangeEnd: d.end, Revision: d.rev}
}

// paginatedList reads the keyspace at R as kube-apiserver paginates, in
// pages of limit, and returns the number of keys read.
func (d *rangeData) paginatedList(ctx context.Context, kv pb.KVClient, limit int64) (int, error) {
	return servertest.ListPages(ctx, kv, d.key, d.end, limit, d.rev)
}

// BenchmarkLinearizableGet: a linearizable single-key Get (kube-apiserver's
// GET, and its etcd health check) from -snapcache.e2e.get-clients
// goroutines sharing -snapcache.e2e.conns connections, as one client
// process with a few connections would send them.
func BenchmarkLinearizableGet(b *testing.B) {
	d := loadRangeData(b, *getKeys, 1024, 0)
	req := &pb.RangeRequest{Key: d.ks.key(d.ks.n / 3)}
	compareSides(b, d.env, "op", func(b *testing.B, s *side, m *meter, warm bool) roundOut {
		return closedLoop(b, s, m, warm, *getClients, func(ctx context.Context, kv pb.KVClient) error {
			resp, err := kv.Range(ctx, req)
			if err == nil && len(resp.Kvs) != 1 {
				err = fmt.Errorf("got %d keys, want 1", len(resp.Kvs))
			}
			return err
		})
	})
}

// BenchmarkPaginatedList: one op is a whole kube-apiserver-style paginated
// LIST at the past revision R, -snapcache.e2e.range-keys keys of 1 KiB in
// pages of -snapcache.e2e.page, from -snapcache.e2e.range-clients
// goroutines.
func BenchmarkPaginatedList(b *testing.B) {
	d := loadRangeData(b, *rangeKeys, 1024, *rangeUpdates)
	compareSides(b, d.env, "op", func(b *testing.B, s *side, m *meter, warm bool) roundOut {
		return closedLoop(b, s, m, warm, *rangeClients, func(ctx context.Context, kv pb.KVClient) error {
			n, err := d.paginatedList(ctx, kv, *pageSize)
			if err == nil && n != d.ks.n {
				err = fmt.Errorf("listed %d keys, want %d", n, d.ks.n)
			}
			return err
		})
	})
}

// BenchmarkHistoricalRange: one op is a full Range of the keyspace at the
// past revision R (a LIST at an exact resourceVersion, without a limit),
// -snapcache.e2e.range-keys keys of 128 B, and of 1 KiB, from
// -snapcache.e2e.range-clients goroutines.
func BenchmarkHistoricalRange(b *testing.B) {
	for _, size := range []struct {
		name  string
		bytes int
	}{{"128B", 128}, {"1KiB", 1024}} {
		b.Run(size.name, func(b *testing.B) {
			d := loadRangeData(b, *rangeKeys, size.bytes, *rangeUpdates)
			req := d.fullRange()
			compareSides(b, d.env, "op", func(b *testing.B, s *side, m *meter, warm bool) roundOut {
				return closedLoop(b, s, m, warm, *rangeClients, func(ctx context.Context, kv pb.KVClient) error {
					resp, err := kv.Range(ctx, req)
					if err == nil && len(resp.Kvs) != d.ks.n {
						err = fmt.Errorf("got %d keys, want %d", len(resp.Kvs), d.ks.n)
					}
					return err
				})
			})
		})
	}
}
