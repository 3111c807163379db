package integration

import "testing"

// TestTiered runs differential suites through two tiers of proxies: an edge
// proxy whose --endpoints is another proxy in front of etcd, the tiered
// deployment that fans one etcd out to many clients. Every answer must
// still be etcd's, as with a single tier.
func TestTiered(t *testing.T) {
	tiered := clusterOptions{tiered: true}
	for name, run := range map[string]func(*testing.T, clusterOptions){
		"DifferentialRange":              testDifferentialRange,
		"RangeStreamDifferential":        testRangeStreamDifferential,
		"NoStaleLinearizableRead":        testNoStaleLinearizableRead,
		"WatchDifferentialCreateOptions": testWatchDifferentialCreateOptions,
		"WatchDifferentialCompaction":    testWatchDifferentialCompaction,
		"WatchProgressUnderWrites":       testWatchProgressUnderWrites,
	} {
		t.Run(name, func(t *testing.T) { run(t, tiered) })
	}
}
