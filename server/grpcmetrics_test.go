package server

import (
	"context"
	"fmt"
	"net"
	"slices"
	"testing"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// TestGRPCMetricsAsTheProvider: the same calls, counted by grpcMetrics and
// by go-grpc-middleware's provider, give the same grpc_server_* series
// with the same values (for handling times, the same sample counts), with
// and without handling times.
func TestGRPCMetricsAsTheProvider(t *testing.T) {
	pass := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		return handler(ctx, req)
	}
	for _, handlingTime := range []bool{false, true} {
		t.Run(fmt.Sprintf("handling time %v", handlingTime), func(t *testing.T) {
			var opts []grpcprom.ServerMetricsOption
			if handlingTime {
				opts = append(opts, grpcprom.WithServerHandlingTimeHistogram())
			}
			provider := grpcprom.NewServerMetrics(opts...)
			want := prometheus.NewRegistry()
			want.MustRegister(provider)
			countCalls(t, func(gs *grpc.Server) { provider.InitializeMetrics(gs) },
				grpc.ChainUnaryInterceptor(provider.UnaryServerInterceptor()),
				grpc.ChainStreamInterceptor(provider.StreamServerInterceptor()))

			ours := newGRPCMetrics(handlingTime)
			got := prometheus.NewRegistry()
			got.MustRegister(ours)
			countCalls(t, ours.initialize,
				grpc.ChainUnaryInterceptor(ours.unary(pass)),
				grpc.ChainStreamInterceptor(ours.stream))

			w, g := series(t, want), series(t, got)
			// Each of the health service's three methods has its started,
			// received, sent and 17 handled series at least.
			if len(w) < 3*(3+17) {
				t.Fatalf("the provider has only %d series: %q", len(w), w)
			}
			if !slices.Equal(w, g) {
				t.Fatalf("series differ:\nprovider: %q\nours:     %q", w, g)
			}
		})
	}
}

// countCalls serves the health service with opts and makes unary calls
// that succeed and fail, and a server stream that the client cancels.
func countCalls(t *testing.T, initialize func(*grpc.Server), opts ...grpc.ServerOption) {
	t.Helper()
	gs := grpc.NewServer(opts...)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	initialize(gs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	client := healthpb.NewHealthClient(conn)
	ctx := t.Context()
	for range 3 {
		if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: "unknown"}); status.Code(err) != codes.NotFound {
		t.Fatalf("Check of an unknown service: %v, want NotFound", err)
	}
	wctx, cancel := context.WithCancel(ctx)
	stream, err := client.Watch(wctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	conn.Close()
	gs.GracefulStop() // waits for the handlers, the stream's among them
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}

// series are the grpc_server_* series of reg, one line each: name,
// labels and value (a histogram's sample count).
func series(t *testing.T, reg *prometheus.Registry) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels string
			for _, l := range m.GetLabel() {
				labels += l.GetName() + "=" + l.GetValue() + ","
			}
			value := m.GetCounter().GetValue()
			if h := m.GetHistogram(); h != nil {
				value = float64(h.GetSampleCount())
			}
			out = append(out, fmt.Sprintf("%s %s{%s} %s %v", mf.GetName(), mf.GetType(), labels, mf.GetHelp(), value))
		}
	}
	slices.Sort(out)
	return out
}
