package memlimit

import (
	"context"
	"time"
)

// DefaultInterval is how often a Tracker re-reads the estimate: often
// enough to follow a cold load, whose heap grows by some hundred MiB a
// second, within Slack.
const DefaultInterval = 250 * time.Millisecond

// Tracker keeps a limit in line with an estimate of the live heap.
type Tracker struct {
	Policy Policy
	// Live is the estimate of the live heap, in bytes.
	Live func() int64
	// Set applies a limit (debug.SetMemoryLimit): it is called at the
	// start, then only when the limit moves by more than 1/32.
	Set func(limit int64)
	// Changed, if set, is called after each change, with the limit
	// before it.
	Changed func(limit, prev int64)
	// Interval is how often Live is read (DefaultInterval if 0).
	Interval time.Duration

	cur int64 // the limit Start set; Run's from then on
}

// Start sets the limit for the estimate now, and returns it. Call it
// once, before Run.
func (t *Tracker) Start() int64 {
	t.cur = t.Policy.Limit(t.Live())
	t.Set(t.cur)
	return t.cur
}

// Run keeps the limit Start set in line with Live until ctx ends; a
// Policy that does not follow the estimate is not set again. It returns
// the last limit set.
func (t *Tracker) Run(ctx context.Context) int64 {
	cur := t.cur
	if t.Policy.Static() {
		<-ctx.Done()
		return cur
	}
	interval := t.Interval
	if interval <= 0 {
		interval = DefaultInterval
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return cur
		case <-tick.C:
		}
		if next := t.Policy.Limit(t.Live()); moved(cur, next) {
			t.Set(next)
			if t.Changed != nil {
				t.Changed(next, cur)
			}
			cur = next
		}
	}
}

// moved reports whether next differs from cur by more than 1/32 of cur.
func moved(cur, next int64) bool {
	d := next - cur
	if d < 0 {
		d = -d
	}
	return d > cur/32
}
