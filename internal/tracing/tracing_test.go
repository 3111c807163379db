package tracing

import (
	"context"
	"io"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg Config
		ok  bool
	}{
		{Config{}, true},
		{Config{SamplingRatePerMillion: -1}, true}, // off: not read
		{Config{Enabled: true, Address: DefaultAddress}, true},
		{Config{Enabled: true, Address: DefaultAddress, SamplingRatePerMillion: MaxSamplingRatePerMillion}, true},
		{Config{Enabled: true, Address: DefaultAddress, SamplingRatePerMillion: -1}, false},
		{Config{Enabled: true, Address: DefaultAddress, SamplingRatePerMillion: MaxSamplingRatePerMillion + 1}, false},
		{Config{Enabled: true}, false},
	} {
		if err := tc.cfg.Validate(); (err == nil) != tc.ok {
			t.Errorf("%+v: Validate = %v, want ok %v", tc.cfg, err, tc.ok)
		}
	}
}

// TestSampler: etcd's parent-based sampling, except that the proxy's own
// calls to etcd (client spans with no parent) begin no trace.
func TestSampler(t *testing.T) {
	sampledParent := trace.ContextWithRemoteSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled, Remote: true}))
	unsampledParent := trace.ContextWithRemoteSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, Remote: true}))
	sampledCaller := trace.Link{SpanContext: trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{3}, SpanID: trace.SpanID{3}, TraceFlags: trace.FlagsSampled})}
	unsampledCaller := trace.Link{SpanContext: trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{4}, SpanID: trace.SpanID{4}})}
	for _, tc := range []struct {
		name  string
		rate  int
		ctx   context.Context
		kind  trace.SpanKind
		links []trace.Link
		want  sdktrace.SamplingDecision
	}{
		{"a caller's sampled trace, rate 0", 0, sampledParent, trace.SpanKindServer, nil, sdktrace.RecordAndSample},
		{"the call to etcd for it", 0, sampledParent, trace.SpanKindClient, nil, sdktrace.RecordAndSample},
		{"a caller's unsampled trace, every trace sampled", MaxSamplingRatePerMillion, unsampledParent, trace.SpanKindServer, nil, sdktrace.Drop},
		{"a request with no trace, rate 0", 0, context.Background(), trace.SpanKindServer, nil, sdktrace.Drop},
		{"a request with no trace, every trace sampled", MaxSamplingRatePerMillion, context.Background(), trace.SpanKindServer, nil, sdktrace.RecordAndSample},
		{"the proxy's own call, every trace sampled", MaxSamplingRatePerMillion, context.Background(), trace.SpanKindClient, nil, sdktrace.Drop},
		{"a shared proof a sampled caller joined, rate 0", 0, context.Background(), trace.SpanKindInternal, []trace.Link{unsampledCaller, sampledCaller}, sdktrace.RecordAndSample},
		{"a shared proof no sampled caller joined, every trace sampled", MaxSamplingRatePerMillion, context.Background(), trace.SpanKindInternal, []trace.Link{unsampledCaller}, sdktrace.Drop},
		{"a shared proof's call to etcd, the proof sampled", 0, sampledParent, trace.SpanKindClient, nil, sdktrace.RecordAndSample},
		{"a shared proof's call to etcd, the proof unsampled", MaxSamplingRatePerMillion, unsampledParent, trace.SpanKindClient, nil, sdktrace.Drop},
	} {
		s := ownCallsUnsampled{sdktrace.ParentBased(rootSampler(tc.rate))}
		got := s.ShouldSample(sdktrace.SamplingParameters{ParentContext: tc.ctx, TraceID: trace.TraceID{2}, Name: "etcdserverpb.KV/Range", Kind: tc.kind, Links: tc.links})
		if got.Decision != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got.Decision, tc.want)
		}
	}
}

// TestOffInstallsNothing: with tracing off there is no provider, and the
// nil *Tracing adds no option and shuts down as a no-op.
func TestOffInstallsNothing(t *testing.T) {
	tr, err := New(context.Background(), Config{Address: DefaultAddress})
	if err != nil || tr != nil {
		t.Fatalf("New(off) = %v, %v; want nil, nil", tr, err)
	}
	if tr.UnaryServerInterceptor() != nil || tr.StreamServerInterceptor() != nil || len(tr.DialOptions()) != 0 || tr.Shutdown(context.Background()) != nil {
		t.Fatal("a nil Tracing installs something")
	}
}

// TestOnStartsAndStops: on, the exporter and the provider start without a
// collector, and Shutdown stops every goroutine they started (goleak).
func TestOnStartsAndStops(t *testing.T) {
	tr, err := New(context.Background(), Config{Enabled: true, Address: "127.0.0.1:1", ServiceName: DefaultServiceName, SamplingRatePerMillion: 1})
	if err != nil {
		t.Fatal(err)
	}
	if tr.UnaryServerInterceptor() == nil || tr.StreamServerInterceptor() == nil || len(tr.DialOptions()) != 2 {
		t.Fatalf("interceptors: unary %v, stream %v, dial options %d; want both and 2", tr.UnaryServerInterceptor() != nil, tr.StreamServerInterceptor() != nil, len(tr.DialOptions()))
	}
	if err := tr.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestRPCTracer: otelgrpc's handlers run only for the RPCs that may be
// sampled: a served RPC whose caller sent a sampled trace context, or none
// (or one the propagator refuses) while traces begun at the proxy are
// sampled; a call to etcd made in a sampled span. The rest cost a check.
// A traced call's stream ends its span when it ends.
func TestRPCTracer(t *testing.T) {
	const (
		sampled   = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
		zeroTrace = "00-00000000000000000000000000000000-b7ad6b7169203331-01"
		upperFlag = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0A"
		future    = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-more"
	)
	for _, tc := range []struct {
		name        string
		rate        int
		traceparent string // none if empty
		want        bool
	}{
		{"sampled caller, rate 0", 0, sampled, true},
		{"unsampled caller, every trace sampled", MaxSamplingRatePerMillion, unsampled, false},
		{"no trace context, rate 0", 0, "", false},
		{"no trace context, rate above 0", 1, "", true},
		{"an invalid trace id, rate 0: no parent", 0, zeroTrace, false},
		{"an invalid trace id, rate above 0: a root", 1, zeroTrace, true},
		{"upper-case flags, rate 0: no parent", 0, upperFlag, false},
		{"a later version: otelgrpc reads it", 0, future, true},
	} {
		tr := &Tracing{rootRate: tc.rate}
		ctx := context.Background()
		if tc.traceparent != "" {
			ctx = metadata.NewIncomingContext(ctx, metadata.Pairs("traceparent", tc.traceparent))
		}
		inner := &countingHandler{}
		r := rpcTracer{server: inner, serverMaySample: tr.serverMaySample}
		var inHandler context.Context
		_, err := r.unaryServer(ctx, nil, &grpc.UnaryServerInfo{FullMethod: "/etcdserverpb.KV/Range"}, func(ctx context.Context, _ any) (any, error) {
			inHandler = ctx
			return nil, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got := inner.tagged == 1 && inner.ended == 1; got != tc.want || inner.tagged != inner.ended {
			t.Errorf("%s: otelgrpc tagged %d, ended %d; want it to run: %v", tc.name, inner.tagged, inner.ended, tc.want)
		}
		if tagged := inHandler.Value(tagged{}) != nil; tagged != tc.want {
			t.Errorf("%s: the handler's context tagged %v, want %v", tc.name, tagged, tc.want)
		}
	}

	sampledSpan := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled}))
	unsampledSpan := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}}))
	for _, tc := range []struct {
		name string
		ctx  context.Context
		want bool
	}{
		{"a call in a sampled span", sampledSpan, true},
		{"a call in an unsampled span", unsampledSpan, false},
		{"the proxy's own call", context.Background(), false},
	} {
		inner := &countingHandler{}
		r := rpcTracer{client: inner}
		err := r.unaryClient(tc.ctx, "/etcdserverpb.KV/Put", nil, nil, nil, func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got := inner.tagged == 1 && inner.ended == 1; got != tc.want {
			t.Errorf("%s: otelgrpc tagged %d, ended %d; want it to run: %v", tc.name, inner.tagged, inner.ended, tc.want)
		}
	}

	// A traced stream's span ends when its reader reaches its end, once.
	inner := &countingHandler{}
	r := rpcTracer{client: inner}
	fake := &fakeClientStream{ctx: context.Background(), msgs: 2}
	cs, err := r.streamClient(sampledSpan, &grpc.StreamDesc{ServerStreams: true}, nil, "/etcdserverpb.Watch/Watch",
		func(context.Context, *grpc.StreamDesc, *grpc.ClientConn, string, ...grpc.CallOption) (grpc.ClientStream, error) {
			return fake, nil
		})
	if err != nil {
		t.Fatal(err)
	}
	for cs.RecvMsg(nil) == nil {
		if inner.ended != 0 {
			t.Fatal("the stream's span ended before the stream")
		}
	}
	_ = cs.RecvMsg(nil)
	if inner.tagged != 1 || inner.ended != 1 {
		t.Fatalf("stream: otelgrpc tagged %d, ended %d; want 1 each", inner.tagged, inner.ended)
	}

	// A stream whose context is done as it is made ends its span at once,
	// and once.
	ended := make(chan struct{})
	canceled, cancel := context.WithCancel(sampledSpan)
	cancel()
	r = rpcTracer{client: &endNotifier{countingHandler: &countingHandler{}, ended: ended}}
	cs, err = r.streamClient(canceled, &grpc.StreamDesc{ServerStreams: true}, nil, "/etcdserverpb.Watch/Watch",
		func(context.Context, *grpc.StreamDesc, *grpc.ClientConn, string, ...grpc.CallOption) (grpc.ClientStream, error) {
			return &fakeClientStream{ctx: canceled}, nil
		})
	if err != nil {
		t.Fatal(err)
	}
	<-ended
	_ = cs.RecvMsg(nil) // io.EOF: no second end
}

// endNotifier is a countingHandler that closes ended at the first end,
// and fails the test's goroutine with a panic at a second.
type endNotifier struct {
	*countingHandler
	ended chan struct{}
}

func (h *endNotifier) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.End); ok {
		close(h.ended) // a second end would panic: closed twice
	}
}

// fakeClientStream answers msgs messages, then io.EOF.
type fakeClientStream struct {
	grpc.ClientStream
	ctx  context.Context
	msgs int
}

func (s *fakeClientStream) Context() context.Context { return s.ctx }

func (s *fakeClientStream) RecvMsg(any) error {
	if s.msgs == 0 {
		return io.EOF
	}
	s.msgs--
	return nil
}

// countingHandler counts the RPCs it is given, and their ends.
type countingHandler struct{ tagged, ended int }

type tagged struct{}

func (h *countingHandler) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	h.tagged++
	return context.WithValue(ctx, tagged{}, true)
}

func (h *countingHandler) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.End); ok && ctx.Value(tagged{}) != nil {
		h.ended++
	}
}
func (h *countingHandler) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (h *countingHandler) HandleConn(context.Context, stats.ConnStats) {}
