package server

import (
	"context"

	"github.com/etcd-snapcache/etcd-snapcache/persist"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
)

// diskCopy is the persister as the follower restores from it: progress
// knows the copy's header as its own type, not persist's.
type diskCopy struct{ *persist.Persister }

func (d diskCopy) Open(ctx context.Context) (progress.DiskHeader, bool) {
	h, ok := d.Persister.Open(ctx)
	// The same fields: a change to either fails to compile here.
	return progress.DiskHeader(h), ok
}
