package kvproxy

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// The attributes a Range's span gets (otelgrpc's server span, with
// --enable-distributed-tracing): where it was answered and why, as
// etcd_snapcache_range_requests_total counts it, and what it answered.
const (
	attrSource        = attribute.Key("snapcache.source")         // cache, forwarded or rejected
	attrReason        = attribute.Key("snapcache.reason")         // the route's reason
	attrRevision      = attribute.Key("snapcache.revision")       // the answer's header revision
	attrStoreRevision = attribute.Key("snapcache.store_revision") // the cache's head as it answered
	attrKVs           = attribute.Key("snapcache.kvs")            // key-values returned
	attrBytes         = attribute.Key("snapcache.bytes")          // the response's encoded size
	attrFallback      = attribute.Key("snapcache.fallback")       // what a fallback event says happened
)

// fallbackEvent names the event of a read sent to etcd, or refused,
// because the cache could not answer for etcd at all.
const fallbackEvent = "snapcache.fallback"

// fallbacks are the reasons that are fallbacks, and what the event says.
var fallbacks = map[reason]string{
	reasonInconsistent: "the cache failed its consistency check against etcd: etcd answers until it is reloaded",
	reasonNotReady:     "the cache is loading or reloading from etcd",
	reasonLoading:      "the cache is loading from etcd: small reads go to etcd, larger ones are refused",
}

// observe counts a Range by where it went and why, and says so on its
// span, with an event for a fallback. A span that does not record (tracing
// off, or not sampled) costs a context lookup.
func (s *Server) observe(ctx context.Context, src source, why reason) {
	s.m.observe(src, why)
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attrSource.String(string(src)), attrReason.String(string(why)))
		if what, ok := fallbacks[why]; ok {
			span.AddEvent(fallbackEvent, trace.WithAttributes(attrReason.String(string(why)), attrFallback.String(what)))
		}
	}
}

// traceAnswer says on the span what a Range answered: its revision, how
// many key-values and bytes (size; if negative, resp's encoded size,
// computed only for a span that records), and the cache's head then.
func (s *Server) traceAnswer(ctx context.Context, rev int64, kvs, size int, resp *pb.RangeResponse) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		if size < 0 {
			size = proto.Size(resp)
		}
		span.SetAttributes(attrRevision.Int64(rev), attrStoreRevision.Int64(s.store.Rev()), attrKVs.Int(kvs), attrBytes.Int(size))
	}
}
