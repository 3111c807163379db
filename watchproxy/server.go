package watchproxy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/metadata"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// DefaultProgressNotifyInterval is etcd's default interval of periodic
// progress notifications to idle progress_notify watchers.
const DefaultProgressNotifyInterval = 10 * time.Minute

// etcd's fragment size with its default --max-request-bytes: the request
// limit plus its 512 KiB allowance for gRPC overhead.
const defaultFragmentBytes = 1.5*1024*1024 + 512*1024

// maxCatchups bounds the upstream watches opened at once to catch watchers
// up from history the proxy does not hold; further watchers wait.
const maxCatchups = 8

// catchupStall bounds how long a catch-up holds its slot while its stream's
// send loop does not take its events (a client that does not read): it
// then closes its upstream watch and gives the slot up, so that stalled
// clients cannot keep every other catch-up waiting, and goes on from where
// it was once the client reads again.
const catchupStall = time.Second

// Follower is what the Watch service needs of the upstream follower
// (progress.Follower).
type Follower interface {
	// Serving reports whether the store answers for etcd (loaded, not
	// reloading).
	Serving() bool
	// Changed returns a channel closed the next time the store advances.
	Changed() <-chan struct{}
	// WaitFresh returns a store revision that holds every event etcd had
	// committed when the call began.
	WaitFresh(ctx context.Context) (int64, error)
	// FillHeader sets the member fields of a header served from the store.
	FillHeader(h *pb.ResponseHeader)
	// LeaderLost reports whether etcd has no leader, and a channel closed
	// when it next loses it.
	LeaderLost() (bool, <-chan struct{})
	// PeriodicProgress returns a channel closed at etcd's next periodic
	// progress notification.
	PeriodicProgress() <-chan struct{}
	// Epoch returns the epoch of etcd's history the store follows, and a
	// channel closed when it moves: etcd was restored or replaced, and
	// every watch of an older epoch must end.
	Epoch() (uint64, <-chan struct{})
	// CompactRevAtEpochChange is the store's compaction revision as the
	// epoch last moved, before the reload that follows dropped it.
	CompactRevAtEpochChange() int64
}

// Store is what the Watch service reads of the cache's event history
// (revtree.Store).
type Store interface {
	Rev() int64
	CompactRev() int64
	HistoryStart() int64
	EventsFrom(from, upTo int64, max int) ([]revtree.Batch, int64, error)
	// EventsHeld is EventsFrom without etcd's compaction check: the events
	// the store still holds below its compaction revision, failing only
	// with ErrNotRetained. Synced watchers read their events with it,
	// because etcd never cancels them for a compaction.
	EventsHeld(from, upTo int64, max int) ([]revtree.Batch, int64, error)
}

// Gate is what the Watch service asks of the auth gate.
type Gate interface {
	// AuthorizeWatch is etcd's permission check of a watch of
	// [key, rangeEnd) by the stream's caller: a non-nil error refuses the
	// create, as etcd refuses it.
	AuthorizeWatch(ctx context.Context, key, rangeEnd []byte) error
	// RelayWatch reports whether a stream must be relayed to etcd whole,
	// because only etcd can check its caller (a token the proxy cannot
	// attribute), or the cache is off.
	RelayWatch(ctx context.Context) bool
}

// Consistency is what the Watch service needs of the consistency checker
// (hashcheck.Checker).
type Consistency interface {
	// Fallback reports whether the last check found the store
	// inconsistent, and none has passed since.
	Fallback() bool
	// Failures counts the checks that found the store inconsistent: a
	// stream that ran while the count moved ends, even if the fallback
	// was over before the stream looked at Fallback.
	Failures() uint64
	// NextFailure returns a channel closed at the next failed check, once
	// Failures and Fallback say so.
	NextFailure() <-chan struct{}
}

// neverInconsistent is the Consistency of a proxy without a checker.
type neverInconsistent struct{}

func (neverInconsistent) Fallback() bool               { return false }
func (neverInconsistent) Failures() uint64             { return 0 }
func (neverInconsistent) NextFailure() <-chan struct{} { return nil }

// Config configures a Server.
type Config struct {
	Store    Store
	Follower Follower
	// Upstream is etcd's Watch service: for catching watchers up from
	// etcd's history, and for relaying streams that carry an auth token.
	Upstream pb.WatchClient
	// ProgressNotifyInterval is the interval of periodic progress
	// notifications (more than 0). With FollowEtcdProgress they follow
	// etcd's own (Follower.PeriodicProgress), and the interval is only the
	// fallback while etcd sends none.
	ProgressNotifyInterval time.Duration
	FollowEtcdProgress     bool
	// FragmentBytes is where etcd splits a fragmenting watcher's
	// responses: its --max-request-bytes plus 512 KiB.
	FragmentBytes int
	// Consistency is the consistency checker (hashcheck.Checker): while
	// it holds the store inconsistent, new streams are relayed to etcd,
	// and running ones end their watchers as compacted
	// (stream.endRelist). nil: a store never found inconsistent.
	Consistency Consistency
	// Gate is the auth gate (gate.Gate): etcd's permission check of each
	// watch create, and which streams only etcd can serve; gate.Unchecked
	// in front of an etcd without auth. Required.
	Gate    Gate
	Logger  *zap.Logger
	Metrics *Metrics
}

// Server implements etcdserverpb.WatchServer. Its gRPC server must use
// wirecodec.ServerOption, which sends the pre-encoded event responses.
type Server struct {
	pb.UnsafeWatchServer

	store       Store
	follower    Follower
	upstream    pb.WatchClient
	consistency Consistency
	gate        Gate
	interval    time.Duration
	followEtcd  bool // periodic progress ticks with etcd's (interval is then the fallback)
	maxBytes    int
	lg          *zap.Logger
	m           *Metrics

	enc    *encodings   // events encoded once for every stream
	notify *notifier    // wakes the streams new events concern
	waker  *streamWaker // wakes the streams for ticks, failed checks, new epochs

	catchups     chan struct{} // semaphore of upstream catch-up watches
	catchupStall time.Duration // catchupStall; tests shorten it

	closeOnce sync.Once
	closing   chan struct{} // closed by Close: every stream ends
}

var _ pb.WatchServer = (*Server)(nil)

// New returns a Watch server.
func New(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.ProgressNotifyInterval <= 0 {
		panic(fmt.Sprintf("watchproxy: ProgressNotifyInterval %v: want more than 0", cfg.ProgressNotifyInterval))
	}
	if cfg.Gate == nil {
		panic("watchproxy: no Gate (gate.Unchecked is the gate of an etcd without auth)")
	}
	if cfg.FragmentBytes <= 0 {
		cfg.FragmentBytes = defaultFragmentBytes
	}
	if cfg.Consistency == nil {
		cfg.Consistency = neverInconsistent{}
	}
	s := &Server{
		store:        cfg.Store,
		follower:     cfg.Follower,
		upstream:     cfg.Upstream,
		consistency:  cfg.Consistency,
		gate:         cfg.Gate,
		interval:     cfg.ProgressNotifyInterval,
		followEtcd:   cfg.FollowEtcdProgress,
		maxBytes:     cfg.FragmentBytes,
		lg:           cfg.Logger,
		m:            cfg.Metrics,
		enc:          newEncodings(defaultEncodedBytes, defaultEncodedRevs, cfg.Metrics),
		notify:       newNotifier(cfg.Store, cfg.Follower),
		catchups:     make(chan struct{}, maxCatchups),
		catchupStall: catchupStall,
		closing:      make(chan struct{}),
	}
	s.waker = newStreamWaker(cfg.Follower, cfg.Consistency, s.progressInterval, cfg.FollowEtcdProgress)
	return s
}

// SyncWatchers makes the server take note of every event the store holds
// now. The follower calls it before a compaction drops the history below
// it (progress.Follower.SetBeforeCompact): a watcher that no event
// concerned then moves past the compaction from the notifier's record
// whenever its stream next runs, as etcd's synced watchers do, instead of
// finding the events between its position and the head gone.
func (s *Server) SyncWatchers() { s.notify.sync() }

// Close ends every stream with etcd's "server stopped", which clients
// retry elsewhere. It lets a graceful stop finish, since watch streams
// would otherwise last for ever.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		close(s.closing)
		s.notify.close()
		s.waker.close()
	})
}

// Watch serves one client stream.
func (s *Server) Watch(gs pb.Watch_WatchServer) error {
	ctx := gs.Context()
	md, _ := metadata.FromIncomingContext(ctx)
	if fallback := s.consistency.Fallback(); fallback || s.gate.RelayWatch(ctx) {
		// While the store is found inconsistent, etcd answers; and only
		// etcd can check some callers' permissions.
		if fallback {
			traceFallback(ctx, "inconsistent", "the cache failed its consistency check against etcd: etcd serves the stream")
		}
		s.m.relayed()
		return relay(s.upstream, gs)
	}
	if !s.follower.Serving() {
		traceFallback(ctx, "not_ready", "the cache is loading or reloading from etcd: the stream is refused, and clients retry")
		return errNotReady
	}
	var leaderLost <-chan struct{}
	if v := md.Get(rpctypes.MetadataRequireLeaderKey); len(v) > 0 && v[0] == rpctypes.MetadataHasLeader {
		lost, ch := s.follower.LeaderLost()
		if lost {
			return rpctypes.ErrGRPCNoLeader
		}
		leaderLost = ch
	}
	s.notify.start()
	s.waker.start()
	st := newStream(s, gs, leaderLost)
	s.m.streamOpened()
	defer s.m.streamClosed()
	return st.run()
}

// progressInterval is the periodic progress interval with etcd's jitter of
// up to a tenth, so that watchers created together do not tick together.
func (s *Server) progressInterval() time.Duration {
	return s.interval + time.Duration(rand.Int64N(int64(s.interval)/10+1))
}
