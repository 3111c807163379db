package progress

import (
	"testing"
	"time"
)

// TestWatchLagCountsFromTheFirstFence: the upstream watch moves once it
// has lagged watchStallTimeout since the first fence found it behind,
// whichever fence waits then, so readers that give up early (a patience)
// do not keep a lagging watch where it is.
func TestWatchLagCountsFromTheFirstFence(t *testing.T) {
	var l watchLag
	t0 := time.Unix(1000, 0)
	for _, step := range []struct {
		name         string
		gen          uint64
		rev, applied int64
		at           time.Duration
		want         time.Duration
	}{
		{"first fence finds the store behind", 1, 10, 5, 0, watchStallTimeout},
		{"a later fence, still behind the first's revision", 1, 12, 7, 600 * time.Millisecond, watchStallTimeout - 600*time.Millisecond},
		{"lagged past the timeout: move now", 1, 14, 9, 1200 * time.Millisecond, 0},
		{"caught up with the first lag's revision: a new lag", 1, 20, 10, 1300 * time.Millisecond, watchStallTimeout},
		{"another stream: a new lag", 2, 21, 19, 1400 * time.Millisecond, watchStallTimeout},
		{"a fence of the replaced stream does not restart it", 1, 23, 20, 2000 * time.Millisecond, watchStallTimeout},
		{"that lag goes on", 2, 22, 20, 1900 * time.Millisecond, watchStallTimeout - 500*time.Millisecond},
	} {
		if got := l.untilMove(step.gen, step.rev, step.applied, t0.Add(step.at)); got != step.want {
			t.Errorf("%s: untilMove = %v, want %v", step.name, got, step.want)
		}
	}
}
