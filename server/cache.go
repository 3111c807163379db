package server

import (
	"context"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/persist"
	"github.com/etcd-snapcache/etcd-snapcache/progress"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// buildCache builds the cache and what keeps it, each part before those
// that read it: the store; the persister, which restores it; the verifier,
// which compares it with etcd; the follower, which restores it from the
// persister, keeps it in step with etcd over the own connection, and
// proves etcd's history with the verifier; and the checker, which
// compares it periodically with the same verifier. Nothing runs until
// runBackground.
func (s *Server) buildCache() {
	cfg := s.cfg
	s.store = revtree.New(cfg.BTreeDegree)
	s.store.SetMaxHistoryBytes(cfg.MaxHistoryBytes)
	var disk progress.DiskCopy // nil without a persister
	if cfg.PersistDir != "" {
		s.persister = persist.New(persist.Config{
			Dir:      cfg.PersistDir,
			Store:    s.store,
			Interval: cfg.PersistInterval,
			Logger:   s.lg.Named("persist"),
			Metrics:  persist.NewMetrics(s.registry),
		})
		disk = diskCopy{s.persister}
	}
	verifier := hashcheck.NewVerifier(s.store, pb.NewKVClient(s.own.ActiveConnection()), s.lg.Named("hashcheck"))
	s.follower = progress.New(progress.Config{
		Client:                  s.own,
		Store:                   s.store,
		Logger:                  s.lg.Named("follower"),
		Metrics:                 progress.NewMetrics(s.registry),
		LoadPageSize:            cfg.LoadPageSize,
		CompactionProbeInterval: cfg.CompactionProbeInterval,
		LoadRetainedHistory:     cfg.LoadRetainedHistory,
		BeforeLoadPage:          cfg.BeforeLoadPage,
		History:                 verifier,
		Disk:                    disk,
		Tracer:                  s.tracing.Tracer(),
	})
	s.checker = hashcheck.New(hashcheck.Config{
		Verifier:   verifier,
		Follower:   s.follower,
		Interval:   cfg.ConsistencyCheckInterval,
		Logger:     s.lg.Named("hashcheck"),
		Registerer: s.registry,
	})
}

// diskCopy is the persister as the follower restores from it: progress
// knows the copy's header as its own type, not persist's.
type diskCopy struct{ *persist.Persister }

func (d diskCopy) Open(ctx context.Context) (progress.DiskHeader, bool) {
	h, ok := d.Persister.Open(ctx)
	// The same fields: a change to either fails to compile here.
	return progress.DiskHeader(h), ok
}
