package backoff

import (
	"context"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestWaitGrowsAndResets(t *testing.T) {
	b := New(time.Millisecond, 4*time.Millisecond)
	var waits []time.Duration
	for range 5 {
		waits = append(waits, b.policy.NextBackOff())
	}
	// 1, 2, 4, 4, 4 ms, each within the 20% jitter.
	want := []time.Duration{1, 2, 4, 4, 4}
	for i, w := range waits {
		lo, hi := want[i]*time.Millisecond*8/10, want[i]*time.Millisecond*12/10
		if w < lo || w > hi {
			t.Errorf("wait %d = %v, want within [%v, %v]", i, w, lo, hi)
		}
	}
	b.Reset()
	if w := b.policy.NextBackOff(); w > 1200*time.Microsecond {
		t.Errorf("after Reset: wait %v, want about 1ms", w)
	}
}

func TestWaitHonoursContext(t *testing.T) {
	b := New(time.Hour, time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if b.Wait(ctx) {
		t.Fatal("Wait on a canceled context reported a full wait")
	}
	if !New(time.Microsecond, time.Microsecond).Wait(context.Background()) {
		t.Fatal("Wait did not complete its interval")
	}
}
