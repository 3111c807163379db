// Package e2e holds the process-level benchmarks (`make bench-e2e`): etcd
// runs as a separate process, the etcd binary that tools/build.sh builds
// into .tools/bin, so that what is measured of the proxy is the proxy's
// own, never etcd's.
//
// The harness (harness_test.go) starts that etcd on free ports with its
// data in a temporary directory, starts the proxy in front of it, and
// writes with concurrent clients. The proxy runs in the benchmark's
// process: its live heap is then read exactly, with runtime.ReadMemStats
// right after a forced collection, whereas a proxy process's /metrics
// (go_memstats_heap_alloc_bytes) counts garbage not yet collected, up to
// twice the live heap at GOGC=100. The benchmark's own clients keep
// little and the same amount before and after what is measured.
//
// Benchmarks:
//
//   - BenchmarkHistoryMemory: the proxy's heap per retained revision,
//     without a history budget, and its heap under a budget
//     (--max-history-bytes).
//
// Flags (after -args, or in BENCH_E2E_FLAGS for make): -snapcache.e2e.keys,
// -snapcache.e2e.revisions, -snapcache.e2e.value, -snapcache.e2e.budget;
// $ETCD_BIN overrides the etcd binary.
package e2e
