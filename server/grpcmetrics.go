package server

import (
	"context"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// grpcMetrics are the gRPC server's grpc_server_* metrics, the series
// go-grpc-middleware's Prometheus provider exports (as etcd and grpc-proxy
// do), with the same names, help, labels and counts. The provider's
// interceptors look up four series by their label values on every call,
// allocating the labels and a reporter; these resolve each method's series
// once, when the server's services are known (initialize), so that a call
// only increments them.
type grpcMetrics struct {
	started  *prometheus.CounterVec
	handled  *prometheus.CounterVec
	received *prometheus.CounterVec
	sent     *prometheus.CounterVec
	handling *prometheus.HistogramVec // nil: not recorded (--metrics=basic)

	// methods are the series of each registered method, by full method
	// name; set once by initialize, before the server serves.
	methods atomic.Pointer[map[string]*methodMetrics]
}

// methodMetrics are one method's series.
type methodMetrics struct {
	started, received, sent prometheus.Counter
	handled                 [codes.Unauthenticated + 1]prometheus.Counter // by code: 0 to 16
	handling                prometheus.Observer                           // nil without grpcMetrics.handling
	// labels are grpc_type, grpc_service, grpc_method: for a code beyond
	// the known ones.
	labels [3]string
}

// grpcCodes are the codes whose grpc_server_handled_total series exist
// from the start, as the provider's InitializeMetrics creates them.
var grpcCodes = []codes.Code{
	codes.OK, codes.Canceled, codes.Unknown, codes.InvalidArgument, codes.DeadlineExceeded, codes.NotFound,
	codes.AlreadyExists, codes.PermissionDenied, codes.Unauthenticated, codes.ResourceExhausted,
	codes.FailedPrecondition, codes.Aborted, codes.OutOfRange, codes.Unimplemented, codes.Internal,
	codes.Unavailable, codes.DataLoss,
}

func newGRPCMetrics(handlingTime bool) *grpcMetrics {
	labels := []string{"grpc_type", "grpc_service", "grpc_method"}
	m := &grpcMetrics{
		started: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "grpc_server_started_total",
			Help: "Total number of RPCs started on the server.",
		}, labels),
		handled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "grpc_server_handled_total",
			Help: "Total number of RPCs completed on the server, regardless of success or failure.",
		}, append(labels[:len(labels):len(labels)], "grpc_code")),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "grpc_server_msg_received_total",
			Help: "Total number of RPC stream messages received on the server.",
		}, labels),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "grpc_server_msg_sent_total",
			Help: "Total number of gRPC stream messages sent by the server.",
		}, labels),
	}
	if handlingTime {
		m.handling = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "grpc_server_handling_seconds",
			Help:    "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
			Buckets: prometheus.DefBuckets,
		}, labels)
	}
	return m
}

// Describe and Collect make grpcMetrics a prometheus.Collector.
func (m *grpcMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

func (m *grpcMetrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}

func (m *grpcMetrics) collectors() []prometheus.Collector {
	cs := []prometheus.Collector{m.started, m.handled, m.received, m.sent}
	if m.handling != nil {
		cs = append(cs, m.handling)
	}
	return cs
}

// initialize resolves the series of every method gs serves, creating them
// at zero: every method's series exist from the start. It is called once
// every service is registered, before gs serves.
func (m *grpcMetrics) initialize(gs *grpc.Server) {
	methods := make(map[string]*methodMetrics)
	for service, info := range gs.GetServiceInfo() {
		for _, mi := range info.Methods {
			methods["/"+service+"/"+mi.Name] = m.resolve(grpcTypeOf(mi.IsClientStream, mi.IsServerStream, true), service, mi.Name)
		}
	}
	m.methods.Store(&methods)
}

func (m *grpcMetrics) resolve(typ, service, method string) *methodMetrics {
	mm := &methodMetrics{labels: [3]string{typ, service, method}}
	mm.started = m.started.WithLabelValues(typ, service, method)
	mm.received = m.received.WithLabelValues(typ, service, method)
	mm.sent = m.sent.WithLabelValues(typ, service, method)
	for _, code := range grpcCodes {
		mm.handled[code] = m.handled.WithLabelValues(typ, service, method, code.String())
	}
	if m.handling != nil {
		mm.handling = m.handling.WithLabelValues(typ, service, method)
	}
	return mm
}

// of returns the series of a call of fullMethod, as a method of typ: those
// resolved by initialize, else resolved now.
func (m *grpcMetrics) of(fullMethod string, isClientStream, isServerStream, stream bool) *methodMetrics {
	if methods := m.methods.Load(); methods != nil {
		if mm := (*methods)[fullMethod]; mm != nil {
			return mm
		}
	}
	service, method := "unknown", "unknown"
	if s, meth, ok := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/"); ok {
		service, method = s, meth
	}
	return m.resolve(grpcTypeOf(isClientStream, isServerStream, stream), service, method)
}

// grpcTypeOf is the grpc_type label.
func grpcTypeOf(isClientStream, isServerStream, stream bool) string {
	switch {
	case !stream || !isClientStream && !isServerStream:
		return "unary"
	case isClientStream && !isServerStream:
		return "client_stream"
	case !isClientStream && isServerStream:
		return "server_stream"
	}
	return "bidi_stream"
}

// now is the start of a call, if handling times are recorded.
func (m *grpcMetrics) now() time.Time {
	if m.handling == nil {
		return time.Time{}
	}
	return time.Now()
}

// done counts a call that ended with err, begun at start.
func (m *grpcMetrics) done(mm *methodMetrics, err error, start time.Time) {
	code := codeOf(err)
	if code >= 0 && int(code) < len(mm.handled) && mm.handled[code] != nil {
		mm.handled[code].Inc()
	} else {
		m.handled.WithLabelValues(mm.labels[0], mm.labels[1], mm.labels[2], code.String()).Inc()
	}
	if mm.handling != nil {
		mm.handling.Observe(time.Since(start).Seconds())
	}
}

// codeOf is the grpc_code of a call that ended with err, as the provider
// tells it: a context error counts as the status gRPC answers it with.
func codeOf(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	return status.FromContextError(err).Code()
}

// unary counts unary calls, then passes them to next, an interceptor
// itself: one interceptor in all spares gRPC's chaining closures per call.
func (m *grpcMetrics) unary(next grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := m.now()
		mm := m.of(info.FullMethod, false, false, false)
		mm.started.Inc()
		mm.received.Inc()
		resp, err := next(ctx, req, info, handler)
		mm.sent.Inc()
		m.done(mm, err, start)
		return resp, err
	}
}

// stream counts streaming calls and their messages, as the provider does.
func (m *grpcMetrics) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	start := m.now()
	mm := m.of(info.FullMethod, info.IsClientStream, info.IsServerStream, true)
	mm.started.Inc()
	err := handler(srv, &countedStream{ServerStream: ss, mm: mm})
	m.done(mm, err, start)
	return err
}

// countedStream counts a stream's messages, every call of SendMsg and
// RecvMsg, whatever it returns.
type countedStream struct {
	grpc.ServerStream
	mm *methodMetrics
}

func (c *countedStream) SendMsg(msg any) error {
	err := c.ServerStream.SendMsg(msg)
	c.mm.sent.Inc()
	return err
}

func (c *countedStream) RecvMsg(msg any) error {
	err := c.ServerStream.RecvMsg(msg)
	c.mm.received.Inc()
	return err
}
