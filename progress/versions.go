package progress

import (
	"errors"
	"fmt"
)

// errUnsupportedRelease is wrapped by checkRelease's refusals.
var errUnsupportedRelease = errors.New("unsupported etcd release")

// Releases of etcd the follower cannot rely on, for bugs that break what it
// builds on. Each entry is a range [first, fixed) within one minor release.
var unsupportedReleases = []struct {
	minor        int
	before       int // the patch release that fixed it
	bug, because string
}{
	{4, 1 << 30, "etcd 3.4", "is older than the releases the proxy follows (3.5.13 and later)"},
	{5, 8, "etcd #15220", "progress notifications can overtake events, and the cache would skip those events"},
	{5, 13, "etcd #17507", "progress requests can go unanswered, and linearizable reads would wait for their timeout"},
	{6, 2, "etcd #20221 and #20229", "a watch started ahead of a lagging member can receive lower revisions"},
}

// checkRelease returns why the proxy cannot follow etcd release version,
// or nil. An unknown or unparsable version is not refused: it is treated
// conservatively where it matters (kvproxy), and read again.
func checkRelease(version string) error {
	var major, minor, patch int
	if _, err := fmt.Sscanf(version, "%d.%d.%d", &major, &minor, &patch); err != nil {
		return nil
	}
	if major != 3 || minor < 4 {
		return fmt.Errorf("%w: etcd %s: the proxy follows etcd 3.5.13 and later 3.5, 3.6.2 and later 3.6, and 3.7", errUnsupportedRelease, version)
	}
	for _, u := range unsupportedReleases {
		if minor == u.minor && patch < u.before {
			return fmt.Errorf("%w: etcd %s (%s: %s); the proxy follows etcd 3.5.13 and later 3.5, 3.6.2 and later 3.6, and 3.7", errUnsupportedRelease, version, u.bug, u.because)
		}
	}
	return nil
}
