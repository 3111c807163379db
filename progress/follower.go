package progress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// CompactRevKey is the key kube-apiserver's compactor writes the revision it
// is about to compact to, in the same Txn that guards the compaction.
const CompactRevKey = "compact_rev_key"

// DefaultLoadPageSize is the page size of the initial load, as kube-apiserver
// uses for its watch cache.
const DefaultLoadPageSize = 10000

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
	// LoadPageSize is the limit of each page of the initial load.
	LoadPageSize int64
	// CompactionProbeInterval is how often etcd's compaction revision is
	// checked (one count-only single-key Range); 0 means one second.
	CompactionProbeInterval time.Duration
	// BeforeLoadPage, if set, is called before each page of a load. Only
	// tests set it, to hold a load in progress.
	BeforeLoadPage func()
	// LoadRetainedHistory makes the first load start at etcd's compaction
	// revision and replay all of etcd's retained history into snapshots, so
	// historical reads are served from memory after a proxy restart.
	LoadRetainedHistory bool
}

// Follower keeps a revtree.Store in step with etcd. Create it with New and
// start it with Run.
type Follower struct {
	cfg   Config
	lg    *zap.Logger
	store *revtree.Store
	kv    pb.KVClient
	mt    pb.MaintenanceClient
	wc    pb.WatchClient
	m     *Metrics

	ready     chan struct{} // closed once the first load has caught up
	leader    leaderState
	readyOnce sync.Once
	following atomic.Bool  // the upstream watch is established
	loading   atomic.Bool  // a load or reload is under way
	version   atomic.Value // string: upstream etcd version

	mu       sync.Mutex
	cluster  clusterFields // of the latest upstream response
	changed  chan struct{} // closed and replaced whenever the store advances
	progress progressState
	kick     chan struct{} // wakes the watch loop to send a progress request

	compactHint chan int64 // revisions announced in compact_rev_key
	probeNow    chan struct{}

	reloadReason string             // a reload asked for by Reload, not yet begun
	cancelFollow context.CancelFunc // ends the current upstream watch
	loads        atomic.Int64       // loads completed

	probes headProbe    // quorum reads of etcd's head, shared by readers
	head   atomic.Int64 // the highest head etcd has reported
}

// New returns a follower; it does nothing until Run.
func New(cfg Config) *Follower {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.LoadPageSize <= 0 {
		cfg.LoadPageSize = DefaultLoadPageSize
	}
	if cfg.CompactionProbeInterval <= 0 {
		cfg.CompactionProbeInterval = time.Second
	}
	conn := cfg.Client.ActiveConnection()
	f := &Follower{
		cfg:         cfg,
		lg:          cfg.Logger,
		store:       cfg.Store,
		kv:          pb.NewKVClient(conn),
		mt:          pb.NewMaintenanceClient(conn),
		wc:          pb.NewWatchClient(conn),
		m:           cfg.Metrics,
		ready:       make(chan struct{}),
		changed:     make(chan struct{}),
		kick:        make(chan struct{}, 1),
		compactHint: make(chan int64, 16),
		probeNow:    make(chan struct{}, 1),
	}
	f.version.Store("")
	f.probes.read = f.readHead
	f.loading.Store(true)
	if f.m != nil {
		f.m.bindStore(cfg.Store)
		f.m.bindFollower(f)
	}
	return f
}

// Ready is closed once the store holds etcd's keyspace and has caught up
// with the revision etcd had when loading started.
func (f *Follower) Ready() <-chan struct{} { return f.ready }

// IsReady reports whether Ready is closed.
func (f *Follower) IsReady() bool {
	select {
	case <-f.ready:
		return true
	default:
		return false
	}
}

// Loading reports whether the store is being loaded or reloaded from etcd,
// and so cannot answer for etcd's current state.
func (f *Follower) Loading() bool { return f.loading.Load() }

// Following reports whether the upstream watch is currently established.
func (f *Follower) Following() bool { return f.following.Load() }

// UpstreamVersion returns the etcd version reported by the upstream's
// Maintenance.Status at the last load, or "" if unknown.
func (f *Follower) UpstreamVersion() string { return f.version.Load().(string) }

// clusterFields are the parts of a response header that come from the
// member that answered rather than from the keyspace.
type clusterFields struct{ clusterID, memberID, raftTerm uint64 }

// FillHeader sets h's cluster_id, member_id and raft_term to those of the
// latest upstream response, for responses served from the store.
func (f *Follower) FillHeader(h *pb.ResponseHeader) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h.ClusterId, h.MemberId, h.RaftTerm = f.cluster.clusterID, f.cluster.memberID, f.cluster.raftTerm
}

// ObserveHeader records the cluster fields of an upstream response header.
func (f *Follower) ObserveHeader(h *pb.ResponseHeader) {
	if h == nil || h.ClusterId == 0 {
		return
	}
	f.observeHead(h.Revision)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cluster = clusterFields{h.ClusterId, h.MemberId, h.RaftTerm}
}

// ObserveCompaction records a compaction etcd has acknowledged at rev, such
// as a Compact call forwarded by the proxy.
func (f *Follower) ObserveCompaction(rev int64, source string) {
	if rev <= f.store.CompactRev() {
		return
	}
	f.store.Compact(rev)
	f.lg.Info("mirrored compaction", zap.Int64("compact-revision", rev), zap.String("source", source))
	if f.m != nil {
		f.m.compactions.WithLabelValues(source).Inc()
	}
}

// Reload makes the follower drop the store and load the keyspace from etcd
// again, as after an unresumable watch; reason labels the reload metric.
func (f *Follower) Reload(reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reloadReason = reason
	if f.cancelFollow != nil {
		f.cancelFollow()
	}
}

// Loads returns the number of loads of the keyspace completed so far.
func (f *Follower) Loads() int64 { return f.loads.Load() }

// Changed returns a channel that is closed the next time the store advances
// (events applied, a progress notification, a load) or is reset.
func (f *Follower) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

func (f *Follower) notifyChanged() {
	f.mu.Lock()
	defer f.mu.Unlock()
	close(f.changed)
	f.changed = make(chan struct{})
}

// Run follows etcd until ctx is done. It returns ctx.Err().
func (f *Follower) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		f.probeLoop(ctx)
	}()
	defer wg.Wait()

	bo := newBackoff()
	needLoad := true
	firstLoad := true
	for ctx.Err() == nil {
		if needLoad {
			target, err := f.load(ctx, firstLoad && f.cfg.LoadRetainedHistory)
			if err != nil {
				if ctx.Err() == nil {
					f.lg.Warn("loading the keyspace from etcd failed; retrying", zap.Error(err))
				}
				bo.wait(ctx)
				continue
			}
			firstLoad = false
			needLoad = false
			f.loading.Store(false)
			f.readyAt(target)
		}
		err := f.follow(ctx, bo)
		if ctx.Err() != nil {
			break
		}
		var reload *reloadError
		if errors.As(err, &reload) {
			f.lg.Warn("reloading the keyspace from etcd", zap.String("reason", reload.reason), zap.Error(reload.err))
			if f.m != nil {
				f.m.reloads.WithLabelValues(reload.reason).Inc()
			}
			f.loading.Store(true)
			needLoad = true
			continue
		}
		f.lg.Warn("upstream watch broken; resuming", zap.Int64("store-revision", f.store.Rev()), zap.Error(err))
		if f.m != nil {
			f.m.watchRestarts.Inc()
		}
		bo.wait(ctx)
	}
	return ctx.Err()
}

// readyAt closes Ready once the store reaches target.
func (f *Follower) readyAt(target int64) {
	if f.store.Rev() >= target {
		f.readyOnce.Do(func() {
			close(f.ready)
			f.lg.Info("cache is ready", zap.Int64("revision", f.store.Rev()))
		})
		return
	}
	f.mu.Lock()
	f.progress.readyTarget = target
	f.mu.Unlock()
}

type reloadError struct {
	reason string
	err    error
}

func (e *reloadError) Error() string { return fmt.Sprintf("reload (%s): %v", e.reason, e.err) }
func (e *reloadError) Unwrap() error { return e.err }

var (
	wholeKey      = []byte{0}
	wholeRangeEnd = []byte{0}
)

// load reads the whole keyspace at one revision and resets the store to it.
// With history, it loads at etcd's compaction revision instead, so that the
// watch replays every retained revision. It returns the revision at which
// the cache counts as caught up.
func (f *Follower) load(ctx context.Context, history bool) (int64, error) {
	start := time.Now()
	if st, err := f.mt.Status(ctx, &pb.StatusRequest{}); err == nil {
		f.version.Store(st.Version)
		f.ObserveHeader(st.Header)
	}
	// The current revision first: it is the load revision, or with history
	// the revision the replay must reach before the cache is ready.
	head, err := f.kv.Range(ctx, &pb.RangeRequest{Key: wholeKey, RangeEnd: wholeRangeEnd, CountOnly: true})
	if err != nil {
		return 0, fmt.Errorf("reading the current revision: %w", err)
	}
	f.ObserveHeader(head.Header)
	current := head.Header.Revision
	f.observeHead(current)
	compactRev, err := f.findCompactRev(ctx, f.store.CompactRev(), current, 0)
	if err != nil {
		return 0, err
	}
	loadRev := current
	if history {
		loadRev = max(compactRev, 1)
	}
	kvs, err := f.rangeAll(ctx, loadRev)
	if err != nil {
		return 0, err
	}
	f.store.Reset(loadRev, kvs, compactRev)
	f.loads.Add(1) // before waking waiters, which may be waiting for it
	f.notifyChanged()
	f.lg.Info("loaded the keyspace from etcd",
		zap.Int64("revision", loadRev),
		zap.Int64("compact-revision", compactRev),
		zap.Int("keys", len(kvs)),
		zap.Bool("retained-history", history),
		zap.Duration("took", time.Since(start)))
	if f.m != nil {
		f.m.loads.Inc()
	}
	return current, nil
}

// rangeAll reads every key at rev in pages, as kube-apiserver lists.
func (f *Follower) rangeAll(ctx context.Context, rev int64) ([]*mvccpb.KeyValue, error) {
	var kvs []*mvccpb.KeyValue
	key := wholeKey
	for {
		if f.cfg.BeforeLoadPage != nil {
			f.cfg.BeforeLoadPage()
		}
		resp, err := f.kv.Range(ctx, &pb.RangeRequest{
			Key:      key,
			RangeEnd: wholeRangeEnd,
			Revision: rev,
			Limit:    f.cfg.LoadPageSize,
		})
		if err != nil {
			return nil, fmt.Errorf("loading keys at revision %d: %w", rev, err)
		}
		f.ObserveHeader(resp.Header)
		kvs = append(kvs, resp.Kvs...)
		if !resp.More || len(resp.Kvs) == 0 {
			return kvs, nil
		}
		last := resp.Kvs[len(resp.Kvs)-1].Key
		key = append(append(make([]byte, 0, len(last)+1), last...), 0)
	}
}

// follow runs one upstream watch from the store's revision + 1 until it
// breaks. It returns a *reloadError when resuming is impossible.
func (f *Follower) follow(ctx context.Context, bo *backoff) error {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	f.mu.Lock()
	if reason := f.reloadReason; reason != "" {
		f.reloadReason = ""
		f.mu.Unlock()
		return &reloadError{reason: reason, err: errors.New("reload requested")}
	}
	f.cancelFollow = cancel
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.cancelFollow = nil
		f.mu.Unlock()
	}()
	defer f.following.Store(false)
	stream, err := f.wc.Watch(wctx)
	if err != nil {
		return fmt.Errorf("opening the upstream watch: %w", err)
	}
	// Start at the store's revision, not the next one: etcd drops every
	// progress request on a stream whose watcher starts beyond its head,
	// which an idle etcd's head + 1 would be. The revision itself comes
	// back as a duplicate and is skipped.
	startRev := f.store.Rev()
	err = stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{
		Key:            wholeKey,
		RangeEnd:       wholeRangeEnd,
		StartRevision:  startRev,
		ProgressNotify: true,
	}}})
	if err != nil {
		return fmt.Errorf("creating the upstream watch: %w", err)
	}

	// The sender owns stream.Send after the create: it sends the coalesced
	// progress requests for as long as this stream lives.
	sendErr := make(chan error, 1)
	var senders sync.WaitGroup
	senders.Add(1)
	go func() {
		defer senders.Done()
		sendErr <- f.sendProgressRequests(wctx, stream)
	}()
	defer senders.Wait()
	defer cancel()

	for {
		resp, err := stream.Recv()
		if err != nil && wctx.Err() != nil && ctx.Err() == nil {
			f.mu.Lock()
			reason := f.reloadReason
			f.reloadReason = ""
			f.mu.Unlock()
			if reason != "" {
				return &reloadError{reason: reason, err: errors.New("reload requested")}
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			if errors.Is(rpctypes.Error(err), rpctypes.ErrNoLeader) {
				f.leader.lost()
			}
			select {
			case serr := <-sendErr:
				if serr != nil && !errors.Is(serr, context.Canceled) {
					err = serr
				}
			default:
			}
			return fmt.Errorf("upstream watch: %w", err)
		}
		f.ObserveHeader(resp.Header)
		switch {
		case resp.CompactRevision != 0:
			// The resume revision was compacted while we were away.
			f.ObserveCompaction(resp.CompactRevision, "watch")
			return &reloadError{reason: "compacted", err: fmt.Errorf("watch from revision %d canceled: compacted at %d", startRev, resp.CompactRevision)}
		case resp.Canceled:
			return fmt.Errorf("upstream watch canceled: %s", resp.CancelReason)
		case resp.Created:
			f.following.Store(true)
			f.leader.found()
			bo.reset()
			f.lg.Info("following etcd", zap.Int64("start-revision", startRev))
			// The created response promises nothing about revisions: a
			// progress request is the way to learn the head. Re-send any
			// request that was lost with the previous stream.
			f.resendProgressAfterReconnect()
			continue
		case len(resp.Events) == 0:
			f.onProgress(resp.Header.Revision, resp.WatchId == clientv3.InvalidWatchID)
			continue
		}
		if err := f.applyEvents(resp.Events); err != nil {
			return err
		}
	}
}

// applyEvents applies a watch response's events, one revision at a time.
func (f *Follower) applyEvents(events []*mvccpb.Event) error {
	for len(events) > 0 {
		rev := events[0].Kv.ModRevision
		n := 1
		for n < len(events) && events[n].Kv.ModRevision == rev {
			n++
		}
		batch := events[:n]
		events = events[n:]
		cur := f.store.Rev()
		switch {
		case rev <= cur:
			continue // already applied before the watch resumed
		case rev != cur+1:
			return &reloadError{reason: "gap", err: fmt.Errorf("revision %d follows store revision %d", rev, cur)}
		}
		if _, err := f.store.Apply(rev, batch); err != nil {
			return &reloadError{reason: "inconsistent", err: err}
		}
		if f.m != nil {
			f.m.events.Add(float64(len(batch)))
		}
		f.noticeCompactRevKey(batch)
		f.advanced()
	}
	return nil
}

// noticeCompactRevKey turns kube-apiserver's announcement of a compaction
// into prompt probes: its Compact call follows the Txn closely.
func (f *Follower) noticeCompactRevKey(events []*mvccpb.Event) {
	for _, ev := range events {
		if ev.Type != mvccpb.PUT || string(ev.Kv.Key) != CompactRevKey {
			continue
		}
		var rev int64
		if _, err := fmt.Sscan(string(ev.Kv.Value), &rev); err != nil || rev <= 0 {
			continue
		}
		select {
		case f.compactHint <- rev:
		default:
		}
	}
}

// advanced wakes waiters after the store's revision moved.
func (f *Follower) advanced() {
	f.mu.Lock()
	target := f.progress.readyTarget
	f.mu.Unlock()
	if target != 0 && f.store.Rev() >= target {
		f.readyAt(target)
	}
	f.notifyChanged()
}

// backoff spaces out retries against an upstream that is failing.
type backoff struct{ next time.Duration }

const (
	minBackoff = 50 * time.Millisecond
	maxBackoff = 2 * time.Second
)

func newBackoff() *backoff { return &backoff{next: minBackoff} }

func (b *backoff) reset() { b.next = minBackoff }

func (b *backoff) wait(ctx context.Context) {
	t := time.NewTimer(b.next)
	defer t.Stop()
	b.next = min(2*b.next, maxBackoff)
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
