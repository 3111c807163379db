// Package backoff spaces out retries against an upstream that is failing:
// the follower's reloads and watch resumes, and the lease keepalive stream's
// reopening share it, so they back off alike.
//
// It wraps github.com/cenkalti/backoff's exponential policy with a wait that
// honours a context.
package backoff

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"
)

// Backoff is an exponential backoff with jitter. It is not safe for
// concurrent use: each retry loop owns one.
type Backoff struct {
	policy *backoff.ExponentialBackOff
}

// New returns a backoff whose first wait is about min and whose waits grow
// to at most about max.
func New(min, max time.Duration) *Backoff {
	p := backoff.NewExponentialBackOff()
	p.InitialInterval = min
	p.MaxInterval = max
	p.Multiplier = 2
	p.RandomizationFactor = 0.2
	p.Reset()
	return &Backoff{policy: p}
}

// Reset makes the next wait the shortest again, after a success.
func (b *Backoff) Reset() { b.policy.Reset() }

// Next returns the next interval, for callers that wait in their own
// select.
func (b *Backoff) Next() time.Duration { return b.policy.NextBackOff() }

// Wait sleeps for the next interval, or until ctx is done. It reports
// whether the full interval passed.
func (b *Backoff) Wait(ctx context.Context) bool {
	t := time.NewTimer(b.Next())
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
