package progress

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/broadcast"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// DefaultLoadPageSize is the page size of the initial load, as kube-apiserver
// uses for its watch cache.
const DefaultLoadPageSize = 10000

// DefaultCompactionProbeInterval is how often etcd's compaction revision
// is checked: compactions by other clients, and etcd's auto-compaction,
// are mirrored within about this long.
const DefaultCompactionProbeInterval = time.Second

// Config configures a Follower.
type Config struct {
	// Client is the upstream etcd client.
	Client *clientv3.Client
	// Store is the store the follower keeps in step with etcd.
	Store *revtree.Store
	// Logger; zap.NewNop() if nil.
	Logger *zap.Logger
	// Metrics; none are exported if nil.
	Metrics *Metrics
	// LoadPageSize is the limit of each page of the initial load (at
	// least 1).
	LoadPageSize int64
	// CompactionProbeInterval is how often etcd's compaction revision is
	// checked (one count-only single-key Range; more than 0).
	CompactionProbeInterval time.Duration
	// BeforeLoadPage, if set, is called before each page of a load. Only
	// tests set it, to hold a load in progress.
	BeforeLoadPage func()
	// LoadRetainedHistory makes the first load start at etcd's compaction
	// revision and replay all of etcd's retained history into snapshots, so
	// historical reads are served from memory after a proxy restart.
	LoadRetainedHistory bool
	// History, if set, proves that etcd's history is the store's: on
	// every resume of the upstream watch, before the store serves again
	// (timeline.go), and for the store restored from Disk (warm.go).
	History HistoryVerifier
	// Disk, if set, is the copy of the cache a previous process left on
	// disk: the first load restores it and follows etcd from its
	// revision, once it is proven etcd's history (warm.go).
	Disk DiskCopy
	// Tracer, if set, traces each freshness proof as a span of its own
	// (ProofSpanName), which the reads that waited on it link to.
	Tracer trace.Tracer
}

// ProofSpanName names the span of a freshness proof's quorum read, shared
// by the linearizable reads that joined it.
const ProofSpanName = "snapcache.freshness_proof"

// Follower keeps a revtree.Store in step with etcd. Create it with New and
// start it with Run. It is the one type consumers see; each of its jobs
// lives in its own part:
//
//   - the upstream feed: load, watch, resume and reload (feed.go);
//   - the phase, which the feed moves: loading, serving, reloading,
//     stopped (lifecycle, phase.go);
//   - freshness proofs: Fence, WaitRevision and WaitFresh (freshness.go),
//     over shared quorum reads (headProbe) and coalesced RequestProgress
//     calls (progressRequests);
//   - compaction discovery (compactionProber);
//   - what the upstream member reports of itself: header fields, head and
//     release (upstreamState, versionTracker);
//   - whether the upstream has a leader (leaderState);
//   - one timeline: signs that etcd's history is no longer the store's
//     (timeline.go);
//   - etcd's periodic progress interval, from an idle watch
//     (progressTicker).
type Follower struct {
	cfg   Config
	lg    *zap.Logger
	store *revtree.Store
	kv    pb.KVClient
	wc    pb.WatchClient
	m     *Metrics // nil-safe

	upstream *upstreamState
	version  *versionTracker
	leader   leaderState
	changes  broadcast.Signal
	// beforeCompact, if set, runs before each compaction drops the history
	// below it: the watch server's, which reads the follower and so is
	// built after it, set by server before Run (SetBeforeCompact).
	beforeCompact atomic.Pointer[func()]
	requests      *progressRequests
	probes        *headProbe
	compaction    *compactionProber
	ticker        *progressTicker

	life      *lifecycle  // the phase: loading, serving, reloading, stopped
	following followState // the upstream watch is established, and since when not
	// watchMember is the member the upstream watch stream was picked on,
	// while follow runs.
	watchMember atomic.Pointer[string]
	// avoidNext is the member the upstream watch avoids (with the calls
	// made for it: the load, the resume's checks) until it is followed
	// again: the last one stalled there. Used by the feed's goroutine
	// alone.
	avoidNext string
	timeline  timeline
	warm      warmState // the feed's warm start from Config.Disk
	// verified is the generation of the upstream watch stream while it is
	// established and verified to continue the store's history; 0 while
	// none is. A read fence holds only if one stream was, from before its
	// quorum read until the store reached the head.
	verified   atomic.Uint64
	streamGens atomic.Uint64 // the last generation handed out
	lag        watchLag      // since when fences have found the verified stream behind
	loads      atomic.Int64  // loads completed
	// loadErr is why the last load attempt failed; nil once one succeeds.
	loadErr atomic.Pointer[error]

	mu sync.Mutex
	// Guarded by mu.
	reloadReason string                  // a reload asked for by Reload, not yet begun
	cancelFollow context.CancelCauseFunc // ends the current upstream watch; nil between watches
}

// New returns a follower; it does nothing until Run.
func New(cfg Config) *Follower {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	conn := cfg.Client.ActiveConnection()
	f := &Follower{
		cfg:      cfg,
		lg:       cfg.Logger,
		store:    cfg.Store,
		kv:       pb.NewKVClient(conn),
		wc:       pb.NewWatchClient(conn),
		m:        cfg.Metrics,
		upstream: &upstreamState{},
		requests: newProgressRequests(),
		life:     newLifecycle(),
	}
	f.following.since.Store(time.Now().UnixNano())
	f.version = newVersionTracker(f.upstream, pb.NewMaintenanceClient(conn), f.lg)
	f.version.unsupported = func(err error) {
		f.lg.Error("etcd now runs a release the proxy cannot follow; reloading, which waits for a supported one", zap.Error(err))
		f.Reload("unsupported-release")
	}
	f.probes = newHeadProbe(func(ctx context.Context, rev int64) (int64, error) {
		return hedgedRead(ctx, rev, headHedgeDelay, f.readHead)
	})
	f.probes.calls.Trace(cfg.Tracer, ProofSpanName)
	f.ticker = &progressTicker{wc: f.wc, lg: f.lg}
	f.compaction = newCompactionProber(f.store, f.kv, f.lg, cfg.CompactionProbeInterval, f.ObserveCompaction)
	f.compaction.witness, f.compaction.checkHead = f.witness, f.checkHead
	f.m.bindStore(cfg.Store)
	f.m.bindFollower(f)
	return f
}

// Run follows etcd until ctx is done, and returns ctx.Err() once every
// goroutine it started has ended. Call it once.
func (f *Follower) Run(ctx context.Context) error {
	f.probes.start(ctx)
	defer f.probes.stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(3)
	go func() {
		defer wg.Done()
		f.compaction.run(ctx)
	}()
	go func() {
		defer wg.Done()
		f.ticker.run(ctx)
	}()
	go func() {
		defer wg.Done()
		f.version.run(ctx)
	}()
	defer f.life.stop()
	f.feed(ctx)
	return ctx.Err()
}

// Ready is closed once the store holds etcd's keyspace and has caught up
// with the revision etcd had when loading started.
func (f *Follower) Ready() <-chan struct{} { return f.life.ready }

// IsReady reports whether Ready is closed: whether the follower has left
// PhaseLoading for PhaseServing, whatever its phase now.
func (f *Follower) IsReady() bool {
	select {
	case <-f.life.ready:
		return true
	default:
		return false
	}
}

// Serving reports whether the store answers for etcd (PhaseServing): the
// first load has caught up and no reload is under way.
func (f *Follower) Serving() bool { return f.Phase() == PhaseServing }

// LoadError is why the last attempt to load the keyspace failed, nil if
// it did not.
func (f *Follower) LoadError() error {
	if p := f.loadErr.Load(); p != nil {
		return *p
	}
	return nil
}

// IdentityRefused reports whether the last load failed because etcd
// refuses the proxy's own identity the keyspace (ErrIdentityRefused).
func (f *Follower) IdentityRefused() bool {
	return errors.Is(f.LoadError(), ErrIdentityRefused)
}

// Following reports whether the upstream watch is currently established.
func (f *Follower) Following() bool { return f.following.Load() }

// WatchMember returns the etcd member the upstream watch runs on, as its
// address was given (--endpoints, or as cluster sync found it); "" while
// the watch is not established.
func (f *Follower) WatchMember() string {
	m := f.watchMember.Load()
	if m == nil || !f.Following() {
		return ""
	}
	return *m
}

// NotFollowingSince returns the zero time while the upstream watch is
// established; otherwise when the follower last had etcd's keyspace in
// step without it: when the watch was lost, or a load since then ended
// (when the follower was made, before any).
func (f *Follower) NotFollowingSince() time.Time { return f.following.downSince() }

// followState is whether the upstream watch is established, and since when
// the store is not kept in step. Only the feed stores it.
type followState struct {
	on    atomic.Bool
	since atomic.Int64 // unix nanoseconds: the watch lost, a load ended, or the follower made
}

// Store records whether the watch is established.
func (s *followState) Store(on bool) {
	if s.on.Swap(on) && !on {
		s.since.Store(time.Now().UnixNano())
	}
}

// loaded records that a load brought the store in step with etcd.
func (s *followState) loaded() {
	if !s.on.Load() {
		s.since.Store(time.Now().UnixNano())
	}
}

// Load reports whether the watch is established.
func (s *followState) Load() bool { return s.on.Load() }

func (s *followState) downSince() time.Time {
	if s.on.Load() {
		return time.Time{}
	}
	return time.Unix(0, s.since.Load())
}

// UpstreamVersion returns the etcd release reported by the upstream's
// Maintenance.Status, read again after every reconnect, or "" while it is
// unknown (not read yet, or Status refused, as etcd 3.6 refuses non-admins
// with auth on).
func (f *Follower) UpstreamVersion() string { return f.upstream.getVersion() }

// ClusterID is the id of the etcd cluster whose history the store holds,
// 0 before the first load.
func (f *Follower) ClusterID() uint64 {
	f.timeline.mu.Lock()
	defer f.timeline.mu.Unlock()
	return f.timeline.clusterID
}

// FillHeader sets h's cluster_id, member_id and raft_term to those of the
// latest upstream response, for responses served from the store.
func (f *Follower) FillHeader(h *pb.ResponseHeader) { f.upstream.fill(h) }

// ObserveHeader records the cluster fields and head revision of an upstream
// response header.
func (f *Follower) ObserveHeader(h *pb.ResponseHeader) { f.observeHeader(h) }

// HeadSeen is the highest revision any etcd answer has reported to the
// proxy: a write acknowledged through it, a forwarded read, a probe. A read
// served at a lower revision would show a client less than it has seen.
func (f *Follower) HeadSeen() int64 { return f.upstream.head.Load() }

// RevisionLag is how many revisions the store is behind the highest head
// etcd has reported: the revision lag metric's value, and /proxy/status's.
func (f *Follower) RevisionLag() int64 { return max(f.upstream.head.Load()-f.store.Rev(), 0) }

// LeaderLost returns whether etcd has reported that it has no leader (and no
// watch has been created since), and a channel closed when it next does.
// Streams that require a leader end on it, as etcd ends them.
func (f *Follower) LeaderLost() (bool, <-chan struct{}) { return f.leader.state() }

// SetBeforeCompact sets a function that runs before each compaction drops
// the store's history below it: the watch server's notifier reads every
// revision's keys then, so that no quiet watcher is left behind them.
func (f *Follower) SetBeforeCompact(fn func()) { f.beforeCompact.Store(&fn) }

// ObserveCompaction records a compaction etcd has acknowledged at rev, such
// as a Compact call forwarded by the proxy.
func (f *Follower) ObserveCompaction(rev int64, source string) {
	if rev <= f.store.CompactRev() {
		return
	}
	if fn := f.beforeCompact.Load(); fn != nil {
		(*fn)()
	}
	f.store.Compact(rev)
	f.lg.Info("mirrored compaction", zap.Int64("compact-revision", rev), zap.String("source", source))
	f.m.observeCompaction(source)
}

// Reload makes the follower drop the store and load the keyspace from etcd
// again, as after an unresumable watch; reason labels the reload metric.
func (f *Follower) Reload(reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reloadReason = reason
	if f.cancelFollow != nil {
		f.cancelFollow(context.Canceled)
	}
}

// moveLaggingWatch ends the upstream watch of generation gen, so that it
// resumes on another member: its member has not applied a revision a
// quorum read reported for watchStallTimeout (a defragmentation, a slow
// disk). A watch of another generation is left alone.
func (f *Follower) moveLaggingWatch(gen uint64, rev int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cancelFollow == nil || f.verified.Load() != gen {
		return
	}
	f.cancelFollow(fmt.Errorf("%w: it had not applied revision %d %v after a quorum read reported it", errWatchStalled, rev, watchStallTimeout))
}

// Loads returns the number of loads of the keyspace completed so far.
func (f *Follower) Loads() int64 { return f.loads.Load() }

// Changed returns a channel that is closed the next time the store advances
// (events applied, a progress notification, a load) or is reset.
func (f *Follower) Changed() <-chan struct{} { return f.changes.Wait() }

// loaded records a load that reset the store: it serves once the store
// reaches target, at once unless the load replays etcd's history.
func (f *Follower) loaded(target int64) {
	f.following.loaded()
	if f.life.loaded(f.store.Rev(), target) {
		f.lg.Info("cache is ready", zap.Int64("revision", f.store.Rev()))
	}
}

// advanced wakes waiters after the store's revision moved.
func (f *Follower) advanced() {
	if f.life.advanced(f.store.Rev()) {
		f.lg.Info("cache is ready", zap.Int64("revision", f.store.Rev()))
	}
	f.changes.Notify()
}
