package progress

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/etcd-snapcache/etcd-snapcache/internal/coalesce"
	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// fakeHead is a controllable quorum read: each call announces itself and
// returns what the test releases it with.
type fakeHead struct {
	started chan int64 // the revision each read was made at
	release chan int64 // the head each read returns
}

func (f *fakeHead) read(ctx context.Context, rev int64) (int64, error) {
	f.started <- rev
	select {
	case head := <-f.release:
		return head, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// TestHeadProbeNeverJoinsAProbeInFlight is the race the coalescing exists
// to get right: a reader that arrives while a probe is in flight must not be
// answered by it (etcd may have answered it before a write the reader saw
// acknowledged); it joins the next probe, which every later arrival shares.
func TestHeadProbeNeverJoinsAProbeInFlight(t *testing.T) {
	f := &fakeHead{started: make(chan int64, 10), release: make(chan int64)}
	p := newHeadProbe(f.read)
	ctx := context.Background()
	p.start(ctx)
	defer p.stop()

	type result struct {
		name string
		head int64
	}
	results := make(chan result, 10)
	read := func(name string, rev int64) {
		head, err := p.do(ctx, rev)
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
		results <- result{name, head}
	}

	go read("A", 0)
	if rev := <-f.started; rev != 0 {
		t.Fatalf("first probe at %d, want 0", rev)
	}
	// B, C and D arrive while A's probe is in flight.
	var wg sync.WaitGroup
	for _, r := range []struct {
		name string
		rev  int64
	}{{"B", 0}, {"C", 7}, {"D", 5}} {
		wg.Add(1)
		go func() { defer wg.Done(); read(r.name, r.rev) }()
	}
	waitQueued(t, p, 3)

	f.release <- 100 // A's probe returns the head it saw
	if r := <-results; r.name != "A" || r.head != 100 {
		t.Fatalf("%s got %d from the first probe; only A may", r.name, r.head)
	}
	// The second probe starts only now, after B, C and D arrived, at the
	// least revision they want.
	if rev := <-f.started; rev != 5 {
		t.Fatalf("second probe at %d, want 5 (the least revision of its readers)", rev)
	}
	select {
	case r := <-results:
		t.Fatalf("%s answered before the probe it joined returned", r.name)
	default:
	}
	f.release <- 105
	wg.Wait()
	close(results)
	for r := range results {
		if r.head != 105 {
			t.Errorf("%s got head %d, want 105 from the second probe", r.name, r.head)
		}
	}
	select {
	case rev := <-f.started:
		t.Fatalf("a third probe at %d: three readers should have shared one", rev)
	default:
	}
}

// TestHeadProbeVerdicts: a compacted or future verdict on another reader's
// revision is not this reader's; a head below this reader's revision is.
func TestHeadProbeVerdicts(t *testing.T) {
	calls := 0
	p := newHeadProbe(func(_ context.Context, rev int64) (int64, error) {
		calls++
		switch {
		case rev != 0 && rev < 10:
			return 0, ErrCompacted
		case rev > 50:
			return 0, ErrFutureRev
		}
		return 50, nil
	})
	ctx := context.Background()
	p.start(ctx)
	defer p.stop()
	for _, tc := range []struct {
		rev     int64
		want    int64
		wantErr error
	}{
		{0, 50, nil}, {10, 50, nil}, {50, 50, nil}, {9, 0, ErrCompacted}, {51, 0, ErrFutureRev},
	} {
		head, err := p.do(ctx, tc.rev)
		if head != tc.want || !errors.Is(err, tc.wantErr) {
			t.Errorf("do(%d) = %d, %v; want %d, %v", tc.rev, head, err, tc.want, tc.wantErr)
		}
	}
	if calls != 5 {
		t.Errorf("%d quorum reads for 5 sequential readers, want 5", calls)
	}
}

// TestHeadProbeJoinThenWait: a reader joins a probe at once and collects
// its answer later (the probe runs meanwhile); a wait that expires gives
// up with DeadlineExceeded while the probe runs on.
func TestHeadProbeJoinThenWait(t *testing.T) {
	f := &fakeHead{started: make(chan int64, 10), release: make(chan int64)}
	p := newHeadProbe(f.read)
	ctx := context.Background()
	p.start(ctx)
	defer p.stop()

	c, err := p.join(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if rev := <-f.started; rev != 0 {
		t.Fatalf("probe at %d, want 0", rev)
	}
	expired := make(chan time.Time, 1)
	expired <- time.Now()
	if _, err := p.wait(ctx, c, 0, expired, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("an expired wait returned %v, want DeadlineExceeded", err)
	}
	f.release <- 7
	if head, err := p.wait(ctx, c, 0, nil, nil); head != 7 || err != nil {
		t.Fatalf("wait = %d, %v; want 7 from the probe joined", head, err)
	}
}

// TestHeadProbeStopRunsTheProbeInFlight: a probe put in flight just before
// stop still runs, so that its reader gets an answer rather than waiting
// out its own deadline; after stop, readers are refused.
func TestHeadProbeStopRunsTheProbeInFlight(t *testing.T) {
	p := newHeadProbe(func(context.Context, int64) (int64, error) { return 42, nil })
	p.start(context.Background())
	c, err := p.join(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	p.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if head, err := p.wait(ctx, c, 0, nil, nil); head != 42 || err != nil {
		t.Fatalf("wait = %d, %v; want 42 from the probe put in flight before stop", head, err)
	}
	if _, err := p.join(context.Background(), 0); !errors.Is(err, errStopped) {
		t.Fatalf("join after stop: %v, want errStopped", err)
	}
}

// waitQueued waits until n readers are parked on the queued probe.
func waitQueued(t *testing.T, p *headProbe, n int) {
	t.Helper()
	testsupport.WaitFor(t, 10*time.Second, fmt.Sprintf("%d readers queued behind the probe in flight", n), func() bool {
		return p.calls.Waiting() == n
	})
}

// TestHedgedRead: a second read goes out only when the first has not
// answered within the delay (or drain ended it); the first answer of the
// two wins, a verdict on the revision being one, and the other read is
// canceled and waited for.
func TestHedgedRead(t *testing.T) {
	const rev = 7
	type call struct {
		ctx  context.Context
		done chan struct{} // closed when the call returned
	}
	// reads answers each call i with behave(i, ctx): it may block on ctx.
	reads := func(behave func(i int, ctx context.Context) (int64, error)) (func(context.Context, int64) (int64, error), *[]call, *sync.Mutex) {
		var mu sync.Mutex
		var calls []call
		return func(ctx context.Context, r int64) (int64, error) {
			if r != rev {
				t.Errorf("read at %d, want %d", r, rev)
			}
			mu.Lock()
			i := len(calls)
			c := call{ctx, make(chan struct{})}
			calls = append(calls, c)
			mu.Unlock()
			defer close(c.done)
			return behave(i, ctx)
		}, &calls, &mu
	}
	hang := func(ctx context.Context) (int64, error) { <-ctx.Done(); return 0, ctx.Err() }
	unavailable := errors.New("unavailable")

	for _, tc := range []struct {
		name     string
		behave   func(i int, ctx context.Context) (int64, error)
		delay    time.Duration
		head     int64
		err      error
		wantRead int
	}{
		{"first answers", func(int, context.Context) (int64, error) { return 10, nil }, time.Hour, 10, nil, 1},
		{"first fails before the delay, second answers", func(i int, ctx context.Context) (int64, error) {
			if i == 0 {
				return 0, unavailable
			}
			return 11, nil
		}, time.Hour, 11, nil, 2},
		{"both fail before the delay", func(int, context.Context) (int64, error) { return 0, unavailable }, time.Hour, 0, unavailable, 2},
		{"first compacted", func(int, context.Context) (int64, error) { return 0, ErrCompacted }, time.Hour, 0, ErrCompacted, 1},
		{"first hangs, second answers", func(i int, ctx context.Context) (int64, error) {
			if i == 0 {
				return hang(ctx)
			}
			return 11, nil
		}, time.Millisecond, 11, nil, 2},
		{"first hangs, second future", func(i int, ctx context.Context) (int64, error) {
			if i == 0 {
				return hang(ctx)
			}
			return 0, ErrFutureRev
		}, time.Millisecond, 0, ErrFutureRev, 2},
		{"both fail", func(i int, ctx context.Context) (int64, error) {
			if i == 0 {
				// Fails only once the second did, so that the
				// second's failure does not end the call alone.
				<-ctx.Done()
				return 0, unavailable
			}
			return 0, unavailable
		}, time.Millisecond, 0, unavailable, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			read, calls, mu := reads(tc.behave)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			var head int64
			var err error
			done := make(chan struct{})
			go func() {
				defer close(done)
				head, err = hedgedRead(ctx, rev, tc.delay, read)
			}()
			if tc.name == "both fail" {
				// The second failed; the first waits on the call's
				// context, which the caller ends.
				testsupport.Poll(t, 10*time.Second, time.Millisecond, "two reads", func() (bool, error) {
					mu.Lock()
					defer mu.Unlock()
					return len(*calls) == 2, nil
				})
				<-(*calls)[1].done
				cancel()
			}
			<-done
			if head != tc.head || !errors.Is(err, tc.err) && !(tc.name == "both fail" && err != nil) {
				t.Errorf("hedgedRead = %d, %v; want %d, %v", head, err, tc.head, tc.err)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(*calls) != tc.wantRead {
				t.Errorf("%d reads, want %d", len(*calls), tc.wantRead)
			}
			for i, c := range *calls {
				select {
				case <-c.done:
				default:
					t.Errorf("read %d still running after hedgedRead returned", i)
				}
				if c.ctx.Err() == nil {
					t.Errorf("read %d's context not canceled after hedgedRead returned", i)
				}
			}
		})
	}
}

// TestHeadProbeTraced: a traced probe is one span of its own, in which its
// quorum read runs, linked to the sampled readers that joined it; each
// reader's span links back to it once answered, and says how long its
// fence waited and the head the proof reported.
func TestHeadProbeTraced(t *testing.T) {
	recorder := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder))
	defer tp.Shutdown(context.Background())
	tracer := tp.Tracer("test")

	readIn := make(chan trace.SpanContext, 3)
	p := newHeadProbe(func(ctx context.Context, rev int64) (int64, error) {
		readIn <- trace.SpanContextFromContext(ctx)
		return 7, nil
	})
	p.calls.Trace(tracer, ProofSpanName)
	p.start(context.Background())
	defer p.stop()

	var readers []trace.Span
	var runs []*coalesce.Run[int64]
	// The first reader's probe starts at once; the next two share the one
	// after it.
	for range 3 {
		ctx, span := tracer.Start(context.Background(), "etcdserverpb.KV/Range")
		c, err := p.join(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		readers, runs = append(readers, span), append(runs, c)
	}
	for i, span := range readers {
		ctx := trace.ContextWithSpan(context.Background(), span)
		if head, err := p.wait(ctx, runs[i], 0, nil, nil); head != 7 || err != nil {
			t.Fatalf("reader %d: wait = %d, %v; want 7", i, head, err)
		}
		traceFence(ctx, time.Millisecond, 0, 7)
		span.End()
	}
	proofs := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, sp := range recorder.Ended() {
		if sp.Name() == ProofSpanName {
			proofs[sp.SpanContext().SpanID()] = sp
		}
	}
	if len(proofs) != 2 {
		t.Fatalf("%d proof spans, want 2 (one at once, one shared by the two readers after)", len(proofs))
	}
	for range 2 {
		in := <-readIn
		if _, ok := proofs[in.SpanID()]; !ok {
			t.Fatalf("a quorum read ran in span %v, not a proof's", in.SpanID())
		}
	}
	for i, sp := range recorder.Ended() {
		if sp.Name() != "etcdserverpb.KV/Range" {
			continue
		}
		if len(sp.Links()) != 1 {
			t.Fatalf("reader %d has links %v, want its proof", i, sp.Links())
		}
		proof, ok := proofs[sp.Links()[0].SpanContext.SpanID()]
		if !ok {
			t.Fatalf("reader %d links to %v, not a proof", i, sp.Links()[0].SpanContext.SpanID())
		}
		if !slices.ContainsFunc(proof.Links(), func(l sdktrace.Link) bool { return l.SpanContext.SpanID() == sp.SpanContext().SpanID() }) {
			t.Errorf("the proof reader %d waited on does not link to it: %v", i, proof.Links())
		}
		if proof.Parent().IsValid() {
			t.Errorf("a proof has parent %v, want a trace of its own", proof.Parent())
		}
		attrs := map[attribute.Key]attribute.Value{}
		for _, kv := range sp.Attributes() {
			attrs[kv.Key] = kv.Value
		}
		if attrs[attrProofHead].AsInt64() != 7 || attrs[attrFreshnessWait].Type() != attribute.FLOAT64 {
			t.Errorf("reader %d's attributes %v, want the proof's head and the fence's wait", i, attrs)
		}
	}
	for _, proof := range proofs {
		attrs := map[attribute.Key]attribute.Value{}
		for _, kv := range proof.Attributes() {
			attrs[kv.Key] = kv.Value
		}
		if n := attrs["snapcache.callers"].AsInt64(); n != int64(len(proof.Links())) {
			t.Errorf("proof with %d callers and links %v: want a link to each", n, proof.Links())
		}
	}
}
