package tracing

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
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
	for _, tc := range []struct {
		name string
		rate int
		ctx  context.Context
		kind trace.SpanKind
		want sdktrace.SamplingDecision
	}{
		{"a caller's sampled trace, rate 0", 0, sampledParent, trace.SpanKindServer, sdktrace.RecordAndSample},
		{"the call to etcd for it", 0, sampledParent, trace.SpanKindClient, sdktrace.RecordAndSample},
		{"a caller's unsampled trace, every trace sampled", MaxSamplingRatePerMillion, unsampledParent, trace.SpanKindServer, sdktrace.Drop},
		{"a request with no trace, rate 0", 0, context.Background(), trace.SpanKindServer, sdktrace.Drop},
		{"a request with no trace, every trace sampled", MaxSamplingRatePerMillion, context.Background(), trace.SpanKindServer, sdktrace.RecordAndSample},
		{"the proxy's own call, every trace sampled", MaxSamplingRatePerMillion, context.Background(), trace.SpanKindClient, sdktrace.Drop},
	} {
		s := ownCallsUnsampled{sdktrace.ParentBased(rootSampler(tc.rate))}
		got := s.ShouldSample(sdktrace.SamplingParameters{ParentContext: tc.ctx, TraceID: trace.TraceID{2}, Name: "etcdserverpb.KV/Range", Kind: tc.kind})
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
	if len(tr.ServerOptions()) != 0 || len(tr.DialOptions()) != 0 || tr.Shutdown(context.Background()) != nil {
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
	if len(tr.ServerOptions()) != 1 || len(tr.DialOptions()) != 1 {
		t.Fatalf("options: server %d, dial %d; want 1 each", len(tr.ServerOptions()), len(tr.DialOptions()))
	}
	if err := tr.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}
