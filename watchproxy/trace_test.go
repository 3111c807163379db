package watchproxy

import (
	"slices"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestWatchSpanEvents: with tracing on, a Watch stream's span tells each
// watcher's story: created behind the head (not synced), caught up from
// the cache's history, canceled by the client.
func TestWatchSpanEvents(t *testing.T) {
	recorder := tracetest.NewSpanRecorder()
	tracer := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder)).Tracer("test")
	w := newWorld(t)
	w.apply(put("k", "1")) // 2
	w.apply(put("k", "2")) // 3

	fs := newFakeStream()
	defer fs.cancel()
	ctx, span := tracer.Start(fs.ctx, "etcdserverpb.Watch/Watch")
	fs.ctx = ctx
	done := make(chan error, 1)
	go func() { done <- w.srv.Watch(fs) }()
	checkCreated(t, fs.create(t, &pb.WatchCreateRequest{Key: []byte("k"), StartRevision: 2}), 0, 3)
	if got := revs(fs.eventsOf(t, 0, 3)); !slices.Equal(got, []int64{2, 3}) {
		t.Fatalf("events of revisions %v, want [2 3]", got)
	}
	fs.send(t, &pb.WatchRequest{RequestUnion: &pb.WatchRequest_CancelRequest{CancelRequest: &pb.WatchCancelRequest{WatchId: 0}}})
	if r := fs.next(t); !r.Canceled {
		t.Fatalf("answer to the cancel: %v", r)
	}
	fs.cancel()
	select {
	case <-done:
	case <-time.After(waitTimeout):
		t.Fatal("Watch did not return after its stream was canceled")
	}
	span.End()

	var events []string
	for _, ev := range recorder.Ended()[0].Events() {
		events = append(events, ev.Name)
		if ev.Name == "watch created" {
			for _, kv := range ev.Attributes {
				if kv.Key == attrSynced && kv.Value.AsBool() {
					t.Errorf("a watcher created behind the head says it is synced")
				}
			}
		}
	}
	if want := []string{"watch created", "watch caught up", "watch canceled"}; !slices.Equal(events, want) {
		t.Fatalf("the stream's span has events %v, want %v", events, want)
	}
}
