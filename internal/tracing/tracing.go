// Package tracing sets up the proxy's OpenTelemetry tracing as etcd's
// --enable-distributed-tracing flags set up etcd's: spans exported over
// OTLP/gRPC, sampled at a rate per million under a sampled parent's
// decision, W3C trace context and baggage read from callers and written to
// etcd, and otelgrpc's stats handlers on the proxy's gRPC server and on
// its connections to etcd. With tracing off nothing is installed, and the
// proxy forwards its callers' trace context untouched (package server).
package tracing

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// Defaults of Config, as the flags give them: etcd's address, and the
// proxy's own service name.
const (
	DefaultAddress     = "localhost:4317"
	DefaultServiceName = "etcd-snapcache"
	// MaxSamplingRatePerMillion samples every trace.
	MaxSamplingRatePerMillion = 1000000
)

// Config is the tracing flags' values.
type Config struct {
	// Enabled is --enable-distributed-tracing.
	Enabled bool
	// Address is the OTLP/gRPC collector, --distributed-tracing-address
	// (plaintext, as etcd's).
	Address string
	// ServiceName and InstanceID are the resource's service.name and
	// service.instance.id (none if empty).
	ServiceName, InstanceID string
	// SamplingRatePerMillion is --distributed-tracing-sampling-rate: the
	// traces begun at the proxy that are sampled, per million. A caller's
	// sampled trace context is followed whatever the rate.
	SamplingRatePerMillion int
}

// Validate checks the rate, with etcd's bounds, when tracing is on.
func (c Config) Validate() error {
	if !c.Enabled {
		return nil
	}
	if c.SamplingRatePerMillion < 0 || c.SamplingRatePerMillion > MaxSamplingRatePerMillion {
		return fmt.Errorf("--distributed-tracing-sampling-rate %d: want 0 to %d (per million)", c.SamplingRatePerMillion, MaxSamplingRatePerMillion)
	}
	if c.Address == "" {
		return errors.New("--distributed-tracing-address is empty")
	}
	return nil
}

// Tracing is the proxy's tracer provider and the gRPC options that use it.
// A nil *Tracing is tracing off: it installs nothing.
type Tracing struct {
	provider *sdktrace.TracerProvider
	// rootRate is the sampling rate per million of traces begun at the
	// proxy.
	rootRate int
	rpc      rpcTracer
}

// New starts the exporter and the provider; nil, nil when cfg is off. The
// exporter connects lazily: a collector that is down costs spans, not the
// proxy's start.
func New(ctx context.Context, cfg Config) (*Tracing, error) {
	if !cfg.Enabled {
		return nil, nil
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	exporter, err := otlptracegrpc.New(ctx, otlptracegrpc.WithInsecure(), otlptracegrpc.WithEndpoint(cfg.Address))
	if err != nil {
		return nil, fmt.Errorf("the tracing exporter to %s: %w", cfg.Address, err)
	}
	attrs := []attribute.KeyValue{semconv.ServiceName(cfg.ServiceName)}
	if cfg.InstanceID != "" {
		attrs = append(attrs, semconv.ServiceInstanceID(cfg.InstanceID))
	}
	res, err := resource.New(ctx, resource.WithAttributes(attrs...))
	if err != nil {
		_ = exporter.Shutdown(ctx)
		return nil, fmt.Errorf("the tracing resource: %w", err)
	}
	t := &Tracing{
		provider: sdktrace.NewTracerProvider(
			sdktrace.WithBatcher(exporter),
			sdktrace.WithResource(res),
			sdktrace.WithSampler(ownCallsUnsampled{sdktrace.ParentBased(rootSampler(cfg.SamplingRatePerMillion))}),
		),
		rootRate: cfg.SamplingRatePerMillion,
	}
	// otelgrpc's defaults are the process's globals, which the proxy
	// leaves alone: the provider and the propagators are explicit.
	opts := []otelgrpc.Option{
		otelgrpc.WithTracerProvider(t.provider),
		otelgrpc.WithPropagators(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
	}
	t.rpc = rpcTracer{server: otelgrpc.NewServerHandler(opts...), client: otelgrpc.NewClientHandler(opts...), serverMaySample: t.serverMaySample}
	return t, nil
}

// rootSampler samples the traces begun at the proxy, as etcd's
// determineSampler: none at rate 0.
func rootSampler(perMillion int) sdktrace.Sampler {
	if perMillion == 0 {
		return sdktrace.NeverSample()
	}
	return sdktrace.TraceIDRatioBased(float64(perMillion) / MaxSamplingRatePerMillion)
}

// ownCallsUnsampled samples the proxy's own work only for a sampled
// caller. A span with no parent that is not a server span is the proxy's
// own: a call to etcd (its upstream watch, the members' probes every
// second, the compaction probe) or a run shared by many requests (a
// freshness proof, an AuthStatus; package coalesce), which no one caller
// is the parent of. It is sampled when a sampled caller's span is linked
// at its start (a shared run links to the sampled requests that joined
// it), and dropped otherwise: at any rate above 0 the proxy's background
// calls would fill the collector. Everything else is the inner
// sampler's.
type ownCallsUnsampled struct{ inner sdktrace.Sampler }

func (s ownCallsUnsampled) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	if p.Kind == trace.SpanKindServer || trace.SpanContextFromContext(p.ParentContext).IsValid() {
		return s.inner.ShouldSample(p)
	}
	for _, l := range p.Links {
		if l.SpanContext.IsSampled() {
			return sdktrace.SamplingResult{Decision: sdktrace.RecordAndSample}
		}
	}
	return sdktrace.SamplingResult{Decision: sdktrace.Drop}
}

func (s ownCallsUnsampled) Description() string {
	return "OwnCallsUnsampled{" + s.inner.Description() + "}"
}

// Tracer is the proxy's tracer of its own spans (shared proofs); nil when
// tracing is off.
func (t *Tracing) Tracer() trace.Tracer {
	if t == nil {
		return nil
	}
	return t.provider.Tracer("github.com/etcd-snapcache/etcd-snapcache")
}

// UnaryServerInterceptor and StreamServerInterceptor trace every RPC the
// proxy serves that may be sampled, each span a child of its caller's
// trace context if it sent one: the first of the server's interceptors,
// so that the others see the span. nil when tracing is off.
func (t *Tracing) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	if t == nil {
		return nil
	}
	return t.rpc.unaryServer
}

// StreamServerInterceptor: see UnaryServerInterceptor.
func (t *Tracing) StreamServerInterceptor() grpc.StreamServerInterceptor {
	if t == nil {
		return nil
	}
	return t.rpc.streamServer
}

// DialOptions trace the calls to etcd made in a sampled span, each a child
// of that span, and send etcd its trace context. They come after the
// connection's other interceptors: the trace context they write replaces
// the caller's, which package server copies for every forwarded call.
func (t *Tracing) DialOptions() []grpc.DialOption {
	if t == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithChainUnaryInterceptor(t.rpc.unaryClient), grpc.WithChainStreamInterceptor(t.rpc.streamClient)}
}

// serverMaySample reports whether an RPC the proxy serves may be sampled:
// not when its caller sent a valid unsampled trace context (the sampler
// follows it), nor when it sent none and the rate is 0.
func (t *Tracing) serverMaySample(ctx context.Context) bool {
	v := metadata.ValueFromIncomingContext(ctx, traceparentKey)
	if len(v) == 0 {
		return t.rootRate > 0
	}
	sampled, valid := traceparentFlags(v[0])
	return sampled || !valid && t.rootRate > 0
}

// CallerSampled reports whether the caller of an incoming RPC sent a
// valid W3C trace context that is sampled: one whose work etcd records
// (with its tracing on) when it receives it, whether or not the proxy
// traces.
func CallerSampled(ctx context.Context) bool {
	v := metadata.ValueFromIncomingContext(ctx, traceparentKey)
	if len(v) == 0 {
		return false
	}
	sampled, valid := traceparentFlags(v[0])
	return sampled && valid
}

// inSampledSpan reports whether a call to etcd is made in a sampled span:
// the only ones the sampler records (ownCallsUnsampled, and the parent's
// decision).
func inSampledSpan(ctx context.Context) bool { return trace.SpanContextFromContext(ctx).IsSampled() }

// traceparentKey is the W3C trace context's metadata key.
const traceparentKey = "traceparent"

// traceparentFlags reads the sampled flag of a W3C traceparent
// (version-traceid-parentid-flags), and whether the header is one the
// TraceContext propagator takes for a parent. Only a version 00 header is
// read; any other is taken as possibly valid and sampled, and left for
// otelgrpc to read.
func traceparentFlags(h string) (sampled, valid bool) {
	if len(h) != 55 || h[:3] != "00-" || h[35] != '-' || h[52] != '-' {
		return true, len(h) >= 55 && h[:2] != "00" && h[:2] != "ff"
	}
	if !nonZeroHex(h[3:35]) || !nonZeroHex(h[36:52]) {
		return false, false
	}
	flags, err := strconv.ParseUint(h[53:55], 16, 8)
	if err != nil || strings.ToLower(h[53:55]) != h[53:55] {
		return false, false
	}
	return flags&1 == 1, true
}

// nonZeroHex reports whether s is lower-case hex and not all zeros, as a
// trace or span id must be.
func nonZeroHex(s string) bool {
	zero := true
	for i := range len(s) {
		switch c := s[i]; {
		case c == '0':
		case c >= '1' && c <= '9', c >= 'a' && c <= 'f':
			zero = false
		default:
			return false
		}
	}
	return !zero
}

// Shutdown exports the spans still buffered and stops the exporter.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t == nil {
		return nil
	}
	return t.provider.Shutdown(ctx)
}
