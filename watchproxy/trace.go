package watchproxy

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// A Watch stream's span (otelgrpc's server span, with
// --enable-distributed-tracing) lasts as long as the stream; each watcher
// it creates, catches up or cancels is an event on it.
const (
	attrWatchID       = attribute.Key("snapcache.watch_id")
	attrKey           = attribute.Key("key")
	attrRangeEnd      = attribute.Key("range_end")
	attrStartRevision = attribute.Key("start_rev")
	attrNextRevision  = attribute.Key("snapcache.next_revision") // the first revision it sends
	attrSynced        = attribute.Key("snapcache.synced")        // at the head, as etcd's synced watchers
	attrFrom          = attribute.Key("snapcache.from")
	attrHistoryStart  = attribute.Key("snapcache.history_start") // the cache's oldest retained revision
	attrCancelReason  = attribute.Key("snapcache.cancel_reason")
	attrCompactRev    = attribute.Key("snapcache.compact_revision")
	attrReason        = attribute.Key("snapcache.reason")
	attrFallback      = attribute.Key("snapcache.fallback")
)

// fallbackEvent names the event of a stream that etcd serves, or that
// ends, because the cache cannot answer for etcd (as kvproxy's).
const fallbackEvent = "snapcache.fallback"

// traceFallback puts a fallback event on the span of ctx, if it records.
func traceFallback(ctx context.Context, reason, what string) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.AddEvent(fallbackEvent, trace.WithAttributes(attrReason.String(reason), attrFallback.String(what)))
	}
}

// traced reports whether the stream's span records: the events' attributes
// are built only then.
func (st *stream) traced() bool { return st.span.IsRecording() }

func (st *stream) event(name string, attrs ...attribute.KeyValue) {
	st.span.AddEvent(name, trace.WithAttributes(attrs...))
}
