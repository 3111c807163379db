package tracing

import (
	"context"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport/otlpsink"
)

// BenchmarkUnaryServer is what the server interceptor adds to an RPC with
// tracing on: at rate 0 for a caller that sent no trace context (skipped),
// and for one whose sampled context otelgrpc traces, exported to a test
// receiver. The incoming metadata are a clientv3 caller's.
func BenchmarkUnaryServer(b *testing.B) {
	sink := otlpsink.Start(b)
	tr, err := New(context.Background(), Config{Enabled: true, Address: sink.Addr(), ServiceName: DefaultServiceName})
	if err != nil {
		b.Fatal(err)
	}
	defer tr.Shutdown(context.Background())
	md := metadata.Pairs(":authority", "127.0.0.1:2379", "content-type", "application/grpc", "user-agent", "etcd/3.7 grpc-go/1.77",
		"hasleader", "true")
	info := &grpc.UnaryServerInfo{FullMethod: "/etcdserverpb.KV/Range"}
	handler := func(ctx context.Context, req any) (any, error) { return nil, nil }
	for _, bc := range []struct {
		name string
		md   metadata.MD
	}{
		{"no trace context", md},
		{"sampled caller", metadata.Join(md, metadata.Pairs("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))},
	} {
		ctx := metadata.NewIncomingContext(context.Background(), bc.md)
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, _ = tr.rpc.unaryServer(ctx, nil, info, handler)
			}
		})
	}
}
