package memlimit

import (
	"context"
	"time"
)

// DefaultInterval is how often a Tracker re-reads the estimate: often
// enough to follow a cold load, whose heap grows by some hundred MiB a
// second, within Slack.
const DefaultInterval = 250 * time.Millisecond

// quietFactor: while the estimate does not change at all (an idle proxy),
// a Tracker re-reads it this many times less often, so that an idle
// process is not woken four times a second for nothing; the first change
// brings the interval back.
const quietFactor = 4

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
	// Interval is how often Live is read (DefaultInterval if 0), and
	// quietFactor times less often while it returns the same estimate.
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
	timer := time.NewTimer(interval)
	defer timer.Stop()
	last, quiet := int64(-1), 0
	for {
		select {
		case <-ctx.Done():
			return cur
		case <-timer.C:
		}
		live := t.Live()
		// Quiet after quietFactor reads of the same estimate: a change is
		// then seen at most quietFactor intervals late, once.
		if live != last {
			last, quiet = live, 0
		} else if quiet < quietFactor {
			quiet++
		}
		if quiet == quietFactor {
			timer.Reset(quietFactor * interval)
		} else {
			timer.Reset(interval)
		}
		if next := t.Policy.Limit(live); moved(cur, next) {
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
