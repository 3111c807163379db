package memlimit

import (
	"math"
	"runtime/debug"
	"runtime/metrics"
	"sync/atomic"
)

// The Go runtime's memory limit is the process's, while the proxy's servers
// are values: of the servers of one process (tests start many), the first
// to acquire the runtime's limit manages it until it releases it.
var runtimeOwned atomic.Bool

// Runtime is the Go runtime's soft memory limit, held by one owner of the
// process at a time.
type Runtime struct {
	found int64 // the limit when acquired, restored on Release
}

// AcquireRuntime takes the runtime's memory limit for the caller; false if
// another owner of the process holds it.
func AcquireRuntime() (*Runtime, bool) {
	if !runtimeOwned.CompareAndSwap(false, true) {
		return nil, false
	}
	return &Runtime{found: debug.SetMemoryLimit(-1)}, true
}

// Set applies limit; 0 or less is none (never a limit of 0).
func (r *Runtime) Set(limit int64) {
	if limit <= 0 {
		limit = math.MaxInt64
	}
	debug.SetMemoryLimit(limit)
}

// Release restores the limit found at AcquireRuntime and lets another
// owner take it.
func (r *Runtime) Release() {
	debug.SetMemoryLimit(r.found)
	runtimeOwned.Store(false)
}

// RuntimeLimit is the runtime's current soft memory limit; 0: none.
func RuntimeLimit() int64 {
	if l := debug.SetMemoryLimit(-1); l != math.MaxInt64 {
		return l
	}
	return 0
}

// HeapLive is the heap the Go runtime's last collection marked live (the
// runtime/metrics sample /gc/heap/live:bytes); 0 before the first.
func HeapLive() int64 {
	sample := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(sample)
	if sample[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return int64(sample[0].Value.Uint64())
}
