package coalesce

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

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
