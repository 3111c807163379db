package kvproxy

import (
	"strings"
	"sync"

	"github.com/coreos/go-semver/semver"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// releaseRules are the differences between etcd releases that change what
// the store must answer.
type releaseRules struct {
	// known is false while the upstream's release is unknown: keys-only
	// reads and RangeStream then go to etcd, which answers for itself.
	known bool
	// rangeStream: etcd 3.7 added RangeStream.
	rangeStream bool
	// opts: etcd 3.7 drops the lease from keys-only results.
	opts revtree.RangeOptions
}

func rulesFor(version string) releaseRules {
	v, err := semver.NewVersion(strings.TrimPrefix(version, "v"))
	if err != nil {
		return releaseRules{}
	}
	is37 := !v.LessThan(semver.Version{Major: 3, Minor: 7})
	return releaseRules{
		known:       true,
		rangeStream: is37,
		opts:        revtree.RangeOptions{KeysOnlyWithoutLease: is37},
	}
}

// releaseCache memoizes rulesFor for the version last asked about; its
// zero value holds the rules of an unknown release.
type releaseCache struct {
	mu sync.Mutex
	// Guarded by mu.
	version string
	rules   releaseRules
}

func (c *releaseCache) get(version string) releaseRules {
	c.mu.Lock()
	defer c.mu.Unlock()
	if version != c.version {
		c.version, c.rules = version, rulesFor(version)
	}
	return c.rules
}
