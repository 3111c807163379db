package server

import (
	"testing"
	"time"
)

// TestUpstreamLost: the upstream check fails only once the upstream watch
// has been down for longer than the threshold, and never while it is up
// or with the check disabled.
func TestUpstreamLost(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		name      string
		down      time.Time
		threshold time.Duration
		lost      bool
	}{
		{"watch up", time.Time{}, time.Second, false},
		{"down briefly", now.Add(-500 * time.Millisecond), time.Second, false},
		{"down at the threshold", now.Add(-time.Second), time.Second, false},
		{"down longer", now.Add(-1500 * time.Millisecond), time.Second, true},
		{"check disabled", now.Add(-time.Hour), 0, false},
	} {
		if err := upstreamLost(tc.down, now, tc.threshold); (err != nil) != tc.lost {
			t.Errorf("%s: %v, want lost %v", tc.name, err, tc.lost)
		}
	}
}
