package main

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// recorder collects durations (of ops, or informer event delays) and
// errors until taken.
type recorder struct {
	mu      sync.Mutex
	samples []float64 // milliseconds
	errors  int64
}

func (r *recorder) observe(d time.Duration, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		r.errors++
		return
	}
	r.samples = append(r.samples, float64(d)/float64(time.Millisecond))
}

// dist is a distribution of durations, in milliseconds.
type dist struct {
	N      int64   `json:"n"`
	Errors int64   `json:"errors,omitempty"`
	P50    float64 `json:"p50_ms"`
	P99    float64 `json:"p99_ms"`
	Max    float64 `json:"max_ms"`
}

// drain returns what r has collected, and empties it.
func (r *recorder) drain() ([]float64, int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, errs := r.samples, r.errors
	r.samples, r.errors = nil, 0
	return s, errs
}

func (r *recorder) take() dist { return distOf(r.drain()) }

// distOf is the distribution of s (which it sorts).
func distOf(s []float64, errs int64) dist {
	slices.Sort(s)
	d := dist{N: int64(len(s)), Errors: errs}
	if len(s) > 0 {
		d.P50, d.P99, d.Max = quantile(s, 0.5), quantile(s, 0.99), s[len(s)-1]
	}
	return d
}

// quantile of sorted s: the smallest value with at least q of s at or
// below it.
func quantile(s []float64, q float64) float64 {
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// stats is everything the load measures, per phase (taken and reset by
// each report).
type stats struct {
	mu      sync.Mutex
	ops     map[string]*recorder // by op kind
	delays  map[string]*recorder // informer event delay, by resource
	samples []string             // the first errors' messages

	skipped     atomic.Int64 // ops not started: every worker busy
	lists       atomic.Int64 // informers' LISTs (the initial ones and relists)
	watches     atomic.Int64 // informers' WATCHes opened (resumes included)
	watchErrors atomic.Int64 // informers' list and watch errors
	// outOfOrder and repeated count updates an informer received at a
	// resourceVersion older than, and the same as, the object's it had
	// (informer.ordered).
	outOfOrder, repeated atomic.Int64
}

func newStats() *stats {
	return &stats{ops: map[string]*recorder{}, delays: map[string]*recorder{}}
}

func (s *stats) rec(m map[string]*recorder, name string) *recorder {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := m[name]
	if r == nil {
		r = &recorder{}
		m[name] = r
	}
	return r
}

// op records one op of kind: its latency, or its error.
func (s *stats) op(kind string, d time.Duration, err error) {
	s.rec(s.ops, kind).observe(d, err)
	if err != nil {
		s.sample(kind + ": " + err.Error())
	}
}

func (s *stats) delay(resource string, d time.Duration) { s.rec(s.delays, resource).observe(d, nil) }

func (s *stats) sample(msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.samples) < 10 {
		if len(msg) > 400 {
			msg = msg[:400]
		}
		s.samples = append(s.samples, msg)
	}
}

// report is what the load prints for a phase.
type report struct {
	Secs        float64         `json:"secs"`
	Ops         map[string]dist `json:"ops"`
	Skipped     int64           `json:"skipped"`
	Delay       dist            `json:"delay"`
	DelayByRes  map[string]dist `json:"delay_by_resource"`
	Lists       int64           `json:"lists"`
	Watches     int64           `json:"watches"`
	WatchErrors int64           `json:"watch_errors"`
	OutOfOrder  int64           `json:"out_of_order"`
	Repeated    int64           `json:"repeated"`
	Errors      []string        `json:"error_samples,omitempty"`
}

// take reports what s has collected since the last take, and resets it.
func (s *stats) take(secs float64) report {
	r := report{Secs: secs, Ops: map[string]dist{}, DelayByRes: map[string]dist{}}
	s.mu.Lock()
	ops, delays := s.ops, s.delays
	r.Errors, s.samples = s.samples, nil
	s.mu.Unlock()
	for k, rec := range ops {
		r.Ops[k] = rec.take()
	}
	// All resources' delays together, and each.
	var all []float64
	for k, rec := range delays {
		s, errs := rec.drain()
		r.DelayByRes[k] = distOf(s, errs)
		all = append(all, s...)
	}
	r.Delay = distOf(all, 0)
	r.Skipped = s.skipped.Swap(0)
	r.Lists = s.lists.Swap(0)
	r.Watches = s.watches.Swap(0)
	r.WatchErrors = s.watchErrors.Swap(0)
	r.OutOfOrder = s.outOfOrder.Swap(0)
	r.Repeated = s.repeated.Swap(0)
	return r
}
