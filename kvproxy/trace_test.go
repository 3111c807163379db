package kvproxy

import (
	"context"
	"slices"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestRangeSpanAttributes: with tracing on, a Range's span says where it
// was answered and why, as the metrics count it, and what it answered; a
// context without a recording span gets nothing and costs nothing more.
func TestRangeSpanAttributes(t *testing.T) {
	recorder := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder))
	defer tp.Shutdown(context.Background())

	for _, tc := range []struct {
		name  string
		setup func(e *routeEnv)
		req   *pb.RangeRequest
		want  map[attribute.Key]attribute.Value
	}{
		{"served from the cache", nil, &pb.RangeRequest{Key: []byte("a")}, map[attribute.Key]attribute.Value{
			attrSource: attribute.StringValue("cache"), attrReason: attribute.StringValue("linearizable"),
			attrRevision: attribute.Int64Value(13), attrStoreRevision: attribute.Int64Value(13), attrKVs: attribute.IntValue(1),
		}},
		{"forwarded", func(e *routeEnv) { e.follower.serving = false }, &pb.RangeRequest{Key: []byte("a")}, map[attribute.Key]attribute.Value{
			attrSource: attribute.StringValue("forwarded"), attrReason: attribute.StringValue("loading"),
			attrRevision: attribute.Int64Value(upstreamRev), attrKVs: attribute.IntValue(0),
		}},
		{"refused", func(e *routeEnv) { e.follower.serving = false }, &pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")}, map[attribute.Key]attribute.Value{
			attrSource: attribute.StringValue("rejected"), attrReason: attribute.StringValue("loading"),
		}},
		{"forwarded: the cache found inconsistent", func(e *routeEnv) { e.cfg.Inconsistent = func() bool { return true } }, &pb.RangeRequest{Key: []byte("a")}, map[attribute.Key]attribute.Value{
			attrSource: attribute.StringValue("forwarded"), attrReason: attribute.StringValue("inconsistent"),
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newRouteEnv(t)
			if tc.setup != nil {
				tc.setup(e)
			}
			s := New(e.cfg)
			ctx, span := tp.Tracer("test").Start(context.Background(), tc.name)
			_, _ = s.Range(ctx, tc.req)
			span.End()
			// Not recording: nothing to set, nothing set.
			if _, err := s.Range(context.Background(), tc.req); err != nil && tc.name != "refused" {
				t.Fatal(err)
			}
			spans := recorder.Ended()
			got := map[attribute.Key]attribute.Value{}
			for _, kv := range spans[len(spans)-1].Attributes() {
				got[kv.Key] = kv.Value
			}
			for k, v := range tc.want {
				if got[k] != v {
					t.Errorf("%s = %v, want %v (all: %v)", k, got[k].Emit(), v.Emit(), got)
				}
			}
			if _, ok := got[attrBytes]; ok != (tc.name != "refused") {
				t.Errorf("%s set: %v; attributes %v", attrBytes, ok, got)
			}
			// A fallback (the cache loading, or found inconsistent) is an
			// event on the span; a read the cache answered has none.
			why := reason(tc.want[attrReason].AsString())
			_, fallback := fallbacks[why]
			var events []string
			for _, ev := range spans[len(spans)-1].Events() {
				events = append(events, ev.Name)
			}
			if got := slices.Contains(events, fallbackEvent); got != fallback {
				t.Errorf("events %v: a %s event %v, want %v", events, fallbackEvent, got, fallback)
			}
		})
	}
}
