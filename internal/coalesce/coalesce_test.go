package coalesce

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestCallerNeverJoinsACallInFlight: a caller that arrives while a call
// runs gets the answer of a later call, and the callers that arrive
// meanwhile share that one call.
func TestCallerNeverJoinsACallInFlight(t *testing.T) {
	var runs atomic.Int64
	release := make(chan struct{})
	started := make(chan struct{}, 10)
	c := New(func(ctx context.Context) (int64, error) {
		n := runs.Add(1)
		started <- struct{}{}
		if n == 1 {
			<-release
		}
		return n, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	c.Start(ctx)
	defer func() { cancel(); c.Stop() }()

	first := make(chan int64)
	go func() { v, _ := c.Do(context.Background()); first <- v }()
	<-started // the first call runs and holds

	var wg sync.WaitGroup
	got := make([]int64, 5)
	for i := range got {
		wg.Add(1)
		go func() { defer wg.Done(); got[i], _ = c.Do(context.Background()) }()
	}
	// The five wait for the call after the first; the first ends once
	// they all joined it.
	for {
		c.mu.Lock()
		joined := c.next != nil && c.next.waiters == len(got)
		c.mu.Unlock()
		if joined {
			break
		}
		runtime.Gosched()
	}
	close(release)
	if v := <-first; v != 1 {
		t.Fatalf("first caller got run %d", v)
	}
	wg.Wait()
	for i, v := range got {
		if v < 2 {
			t.Fatalf("caller %d got run %d, which started before it arrived", i, v)
		}
	}
	if n := runs.Load(); n != 2 {
		t.Fatalf("%d runs for 6 callers", n)
	}
}

func TestStopped(t *testing.T) {
	c := New(func(context.Context) (int, error) { return 1, nil })
	if _, err := c.Do(context.Background()); err != ErrStopped {
		t.Fatalf("before Start: %v", err)
	}
	c.Start(context.Background())
	if v, err := c.Do(context.Background()); err != nil || v != 1 {
		t.Fatalf("Do: %d %v", v, err)
	}
	c.Stop()
	if _, err := c.Do(context.Background()); err != ErrStopped {
		t.Fatalf("after Stop: %v", err)
	}
}

// TestJoinAtTheLeastRevision: a run is made at the least revision its
// callers asked for, 0 standing for none, and each caller learns which.
func TestJoinAtTheLeastRevision(t *testing.T) {
	started := make(chan int64, 10)
	release := make(chan struct{})
	c := NewAtRev(func(ctx context.Context, rev int64) (int64, error) {
		started <- rev
		<-release
		return rev, nil
	})
	c.Start(context.Background())
	defer c.Stop()

	first, err := c.Join(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if rev := <-started; rev != 0 {
		t.Fatalf("first run at %d, want 0", rev)
	}
	var queued []*Run[int64]
	for _, rev := range []int64{7, 0, 5, 9} {
		r, err := c.Join(context.Background(), rev)
		if err != nil {
			t.Fatal(err)
		}
		queued = append(queued, r)
	}
	if n := c.Waiting(); n != len(queued) {
		t.Fatalf("%d callers waiting, want %d", n, len(queued))
	}
	release <- struct{}{}
	if v, err := first.Wait(context.Background()); v != 0 || err != nil || first.Rev() != 0 {
		t.Fatalf("first run: %d, %v at %d; want 0 at 0", v, err, first.Rev())
	}
	if rev := <-started; rev != 5 {
		t.Fatalf("second run at %d, want 5 (the least revision asked)", rev)
	}
	close(release)
	for i, r := range queued {
		if r != queued[0] {
			t.Fatalf("caller %d joined another run than caller 0", i)
		}
		if v, err := r.Wait(context.Background()); v != 5 || err != nil || r.Rev() != 5 {
			t.Fatalf("caller %d: %d, %v at %d; want 5 at 5", i, v, err, r.Rev())
		}
	}
}

// TestJoinThenWait: a caller joins at once and collects the answer later;
// a wait that gives up leaves the run going, and Done closes when it ends.
func TestJoinThenWait(t *testing.T) {
	release := make(chan struct{})
	c := New(func(ctx context.Context) (int, error) {
		<-release
		return 7, nil
	})
	c.Start(context.Background())
	defer c.Stop()

	r, err := c.Join(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := r.Wait(ctx); err != context.Canceled {
		t.Fatalf("a canceled wait returned %v", err)
	}
	select {
	case <-r.Done():
		t.Fatal("Done before the run ended")
	default:
	}
	close(release)
	<-r.Done()
	if v, err := r.Answer(); v != 7 || err != nil {
		t.Fatalf("Answer = %d, %v; want 7", v, err)
	}
}

// TestStopRunsTheRunInFlight: a run put in flight just before Stop still
// runs, so that its callers get an answer; Stop may be called again.
func TestStopRunsTheRunInFlight(t *testing.T) {
	c := New(func(context.Context) (int, error) { return 42, nil })
	c.Start(context.Background())
	r, err := c.Join(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	c.Stop()
	select {
	case <-r.Done():
	default:
		t.Fatal("Stop returned before the run put in flight ran")
	}
	if v, err := r.Answer(); v != 42 || err != nil {
		t.Fatalf("Answer = %d, %v; want 42 from the run put in flight before Stop", v, err)
	}
	if _, err := c.Join(context.Background(), 0); err != ErrStopped {
		t.Fatalf("Join after Stop: %v", err)
	}
	c.Stop()
}

// TestTracedRun: a traced run that a sampled caller joined is a span of
// its own (no parent), which fn's context carries, linked to its sampled
// callers and linked from each caller's span; a run that no sampled
// caller joined is no span at all.
func TestTracedRun(t *testing.T) {
	recorder := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder))
	defer tp.Shutdown(context.Background())
	tracer := tp.Tracer("test")

	inRun := make(chan trace.SpanContext, 2)
	c := New(func(ctx context.Context) (int, error) {
		inRun <- trace.SpanContextFromContext(ctx)
		return 1, nil
	})
	c.Trace(tracer, "shared")
	ctx, cancel := context.WithCancel(context.Background())
	c.Start(ctx)
	defer func() { cancel(); c.Stop() }()

	// Unsampled: no span for the run.
	if _, err := c.Do(context.Background()); err != nil {
		t.Fatal(err)
	}
	if sc := <-inRun; sc.IsValid() {
		t.Fatalf("a run no sampled caller joined ran in span %v", sc)
	}

	callerCtx, caller := tracer.Start(context.Background(), "caller")
	if _, err := c.Do(callerCtx); err != nil {
		t.Fatal(err)
	}
	caller.End()
	in := <-inRun
	var run, callerSpan sdktrace.ReadOnlySpan
	for _, sp := range recorder.Ended() {
		switch sp.Name() {
		case "shared":
			run = sp
		case "caller":
			callerSpan = sp
		}
	}
	if run == nil || run.SpanContext().SpanID() != in.SpanID() || run.Parent().IsValid() {
		t.Fatalf("run span %v: want the span fn ran in (%v), with no parent", run, in.SpanID())
	}
	if l := run.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != callerSpan.SpanContext().SpanID() {
		t.Errorf("the run links to %v, want its caller", l)
	}
	if l := callerSpan.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != in.SpanID() {
		t.Errorf("the caller links to %v, want the run", l)
	}
}
