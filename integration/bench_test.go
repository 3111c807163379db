package integration

// Throughput of the proxy beside direct etcd: the same process, cluster,
// data and client settings for both; only the gRPC connection differs. Each
// top-level benchmark loads the cluster once (untimed), then runs the
// sub-benchmarks "etcd" and "proxy". The proxy's reports "x-etcd", its
// throughput as a multiple of etcd's, and every top-level benchmark logs a
// SUMMARY line. Run:
//
//	go test -run '^$' -bench 'Historical|Paginated|Serializable' -benchtime 3s ./integration/
//
// The same with auth enabled on both sides: the ...Auth benchmarks
// (benchauth_test.go).
//
// etcd, the proxy and the clients share the process, so allocs/op and B/op
// count all three, and every side competes for the same CPUs.

import (
	"context"
	"fmt"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// BenchmarkHistoricalRange: a full Range of the prefix (10k keys x 1 KiB) at
// revision R, with 2000 revisions after R.
func BenchmarkHistoricalRange(b *testing.B) { benchHistoricalRange(b, benchOptions{}) }

func benchHistoricalRange(b *testing.B, opts benchOptions) {
	env := newBenchEnv(b, opts)
	req := env.fullRange()
	compareBackends(b, env, env.rangeBytes, func(ctx context.Context, kv pb.KVClient) error {
		resp, err := kv.Range(ctx, req)
		if err != nil {
			return err
		}
		if len(resp.Kvs) != benchKeys {
			return fmt.Errorf("got %d keys, want %d", len(resp.Kvs), benchKeys)
		}
		return nil
	})
}

// BenchmarkPaginatedList: one op is a whole kube-apiserver-style LIST at R,
// 20 pages of 500 keys.
func BenchmarkPaginatedList(b *testing.B) { benchPaginatedList(b, benchOptions{}) }

func benchPaginatedList(b *testing.B, opts benchOptions) {
	env := newBenchEnv(b, opts)
	compareBackends(b, env, env.rangeBytes, func(ctx context.Context, kv pb.KVClient) error {
		n, err := env.paginatedList(ctx, kv)
		if err != nil {
			return err
		}
		if n != benchKeys {
			return fmt.Errorf("listed %d keys, want %d", n, benchKeys)
		}
		return nil
	})
}

// BenchmarkSerializableGet: one key, serializable, at the latest revision.
func BenchmarkSerializableGet(b *testing.B) {
	env := newBenchEnv(b, benchOptions{})
	req := &pb.RangeRequest{Key: env.keys[benchKeys/2], Serializable: true}
	compareBackends(b, env, 0, func(ctx context.Context, kv pb.KVClient) error {
		resp, err := kv.Range(ctx, req)
		if err != nil {
			return err
		}
		if len(resp.Kvs) != 1 {
			return fmt.Errorf("got %d keys, want 1", len(resp.Kvs))
		}
		return nil
	})
}

// BenchmarkLinearizableGet: a linearizable single-key Get (kube-apiserver's
// GET and health check) from 32 concurrent clients. The proxy serves it from
// its cache behind a read fence: one quorum read of etcd's revision shared
// by the readers that arrived before it started.
func BenchmarkLinearizableGet(b *testing.B) { benchLinearizableGet(b, benchOptions{}) }

func benchLinearizableGet(b *testing.B, opts benchOptions) {
	env := newBenchEnv(b, opts)
	req := &pb.RangeRequest{Key: env.keys[benchKeys/3]}
	compareBackendsN(b, env, 32, 0, func(ctx context.Context, kv pb.KVClient) error {
		resp, err := kv.Range(ctx, req)
		if err == nil && len(resp.Kvs) != 1 {
			err = fmt.Errorf("got %d keys, want 1", len(resp.Kvs))
		}
		return err
	})
}
