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

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
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
	provider    *sdktrace.TracerProvider
	propagators propagation.TextMapPropagator
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
	return &Tracing{
		provider: sdktrace.NewTracerProvider(
			sdktrace.WithBatcher(exporter),
			sdktrace.WithResource(res),
			sdktrace.WithSampler(ownCallsUnsampled{sdktrace.ParentBased(rootSampler(cfg.SamplingRatePerMillion))}),
		),
		propagators: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}),
	}, nil
}

// rootSampler samples the traces begun at the proxy, as etcd's
// determineSampler: none at rate 0.
func rootSampler(perMillion int) sdktrace.Sampler {
	if perMillion == 0 {
		return sdktrace.NeverSample()
	}
	return sdktrace.TraceIDRatioBased(float64(perMillion) / MaxSamplingRatePerMillion)
}

// ownCallsUnsampled drops the root spans of the proxy's own calls to etcd
// (client spans with no parent: its upstream watch, the quorum reads that
// prove the cache fresh, the probes of its members every second), which
// no caller asked for; a sampled rate would otherwise fill the collector
// with them. Everything else is the inner sampler's.
type ownCallsUnsampled struct{ inner sdktrace.Sampler }

func (s ownCallsUnsampled) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	if p.Kind == trace.SpanKindClient && !trace.SpanContextFromContext(p.ParentContext).IsValid() {
		return sdktrace.SamplingResult{Decision: sdktrace.Drop}
	}
	return s.inner.ShouldSample(p)
}

func (s ownCallsUnsampled) Description() string {
	return "OwnCallsUnsampled{" + s.inner.Description() + "}"
}

// options are otelgrpc's, with the provider and propagators explicit:
// otelgrpc's defaults are the process's globals, which the proxy leaves
// alone.
func (t *Tracing) options() []otelgrpc.Option {
	return []otelgrpc.Option{otelgrpc.WithTracerProvider(t.provider), otelgrpc.WithPropagators(t.propagators)}
}

// ServerOptions trace every RPC the proxy serves, each span a child of
// its caller's trace context if it sent one.
func (t *Tracing) ServerOptions() []grpc.ServerOption {
	if t == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(t.options()...))}
}

// DialOptions trace the calls to etcd, each a child of the span of the
// RPC it is made for, and send etcd the trace context.
func (t *Tracing) DialOptions() []grpc.DialOption {
	if t == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(t.options()...))}
}

// Shutdown exports the spans still buffered and stops the exporter.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t == nil {
		return nil
	}
	return t.provider.Shutdown(ctx)
}
