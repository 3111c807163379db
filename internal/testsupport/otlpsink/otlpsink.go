// Package otlpsink is an OpenTelemetry trace receiver for tests: the
// processes under test (etcd, kube-apiserver, the proxy) export their
// spans to it over OTLP/gRPC, as they would to a collector, and the test
// reads them back. It listens on loopback and stops when the test ends.
package otlpsink

import (
	"context"
	"encoding/hex"
	"net"
	"slices"
	"sync"
	"testing"

	"google.golang.org/grpc"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
)

// Span is one span received, with its ids in hex as W3C traceparent
// writes them.
type Span struct {
	Service  string // the resource's service.name
	Name     string
	TraceID  string
	SpanID   string
	ParentID string // "" for a root span
	Kind     tracepb.Span_SpanKind
	Attrs    map[string]*commonpb.AnyValue
	Links    []*tracepb.Span_Link
	Events   []*tracepb.Span_Event
}

// Sink is a running receiver.
type Sink struct {
	coltracepb.UnimplementedTraceServiceServer
	addr string

	mu    sync.Mutex
	spans []Span // guarded by mu
}

// Start starts a receiver on a free loopback port.
func Start(tb testing.TB) *Sink {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	s := &Sink{addr: lis.Addr().String()}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, s)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = gs.Serve(lis)
	}()
	tb.Cleanup(func() {
		gs.Stop()
		<-served
	})
	return s
}

// Addr is the receiver's host:port, for an exporter's endpoint.
func (s *Sink) Addr() string { return s.addr }

// Export receives a batch of spans.
func (s *Sink) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				got := Span{
					Service:  service,
					Name:     sp.GetName(),
					TraceID:  hex.EncodeToString(sp.GetTraceId()),
					SpanID:   hex.EncodeToString(sp.GetSpanId()),
					ParentID: hex.EncodeToString(sp.GetParentSpanId()),
					Kind:     sp.GetKind(),
					Attrs:    map[string]*commonpb.AnyValue{},
					Links:    sp.GetLinks(),
					Events:   sp.GetEvents(),
				}
				for _, kv := range sp.GetAttributes() {
					got.Attrs[kv.GetKey()] = kv.GetValue()
				}
				s.spans = append(s.spans, got)
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// Spans returns the spans received so far of the trace traceID (hex).
func (s *Sink) Spans(traceID string) []Span {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(s.spans), func(sp Span) bool { return sp.TraceID != traceID })
}
