package progress

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

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

	c, err := p.join(0)
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
	c, err := p.join(0)
	if err != nil {
		t.Fatal(err)
	}
	p.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if head, err := p.wait(ctx, c, 0, nil, nil); head != 42 || err != nil {
		t.Fatalf("wait = %d, %v; want 42 from the probe put in flight before stop", head, err)
	}
	if _, err := p.join(0); !errors.Is(err, errStopped) {
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
