package progress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/backoff"
	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"
	"github.com/etcd-snapcache/etcd-snapcache/internal/etcderr"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Bounds of the pause between attempts to load or resume against a failing
// upstream.
const (
	minRetryPause = 50 * time.Millisecond
	maxRetryPause = 2 * time.Second
)

var (
	wholeKey      = []byte{0}
	wholeRangeEnd = []byte{0}
)

// reloadError ends a watch that cannot resume: the store must be loaded
// again.
type reloadError struct {
	reason string
	err    error
}

func (e *reloadError) Error() string { return fmt.Sprintf("reload (%s): %v", e.reason, e.err) }
func (e *reloadError) Unwrap() error { return e.err }

// ErrIdentityRefused says etcd refused the proxy's own identity the
// keyspace: auth is enabled, and the proxy has no identity of its own, or
// one without the root role. It lasts until an operator acts (or auth is
// disabled); meanwhile the cache is off.
var ErrIdentityRefused = errors.New("etcd has auth enabled and the proxy's own identity cannot read the whole keyspace")

// loadFailed records and logs why a load failed. A refusal by etcd's auth
// is the operator's to fix: the proxy's identity must read every key. It
// is logged once, not at every retry; so is any other failure, until the
// load works again.
func (f *Follower) loadFailed(err error) {
	switch e := etcderr.Of(err); {
	case errors.Is(err, errUnsupportedRelease):
	case errors.Is(e, rpctypes.ErrPermissionDenied), errors.Is(e, rpctypes.ErrUserEmpty),
		errors.Is(e, rpctypes.ErrAuthFailed), errors.Is(e, rpctypes.ErrInvalidAuthToken):
		err = fmt.Errorf("%w; give it a user with the root role (--user name:password) or a client certificate naming one: %w", ErrIdentityRefused, err)
	}
	prev := f.loadErr.Swap(&err)
	switch {
	case prev != nil && failureKind(*prev) == failureKind(err):
		f.lg.Debug("loading the keyspace from etcd failed again", zap.Error(err))
	case errors.Is(err, errUnsupportedRelease):
		f.lg.Error("cannot follow etcd; not ready", zap.Error(err))
	case errors.Is(err, ErrIdentityRefused):
		f.lg.Warn("cannot load the keyspace until etcd lets the proxy read it; retrying", zap.Error(err))
	default:
		f.lg.Warn("loading the keyspace from etcd failed; retrying", zap.Error(err))
	}
}

// failureKind is what the log tells load failures apart by: a refusal of
// the proxy's identity and an unsupported release each last until an
// operator acts, whatever etcd's message; other failures by their text.
func failureKind(err error) string {
	switch {
	case errors.Is(err, ErrIdentityRefused):
		return "identity refused"
	case errors.Is(err, errUnsupportedRelease):
		return "unsupported release"
	}
	return err.Error()
}

// loadError is a load that failed: the feed waits and loads again.
type loadError struct{ err error }

func (e *loadError) Error() string { return "loading the keyspace: " + e.err.Error() }
func (e *loadError) Unwrap() error { return e.err }

// feed is the upstream feed: it loads the keyspace, follows it with one
// watch, resumes the watch when it breaks and reloads when it cannot
// resume, until ctx is done.
//
// A load opens the watch first, at etcd's head, and reads the keyspace at
// the revision etcd created it at (loadAtHead): etcd counts a watch from
// its head as synced, and a compaction never cancels a synced watcher, so
// no compaction made while the proxy starts can cost it the history it
// just began to follow. Loading first and watching from the load's
// revision leaves a window in which etcd has moved on, the watch is one
// etcd still has to catch up, and a compaction cancels it.
func (f *Follower) feed(ctx context.Context) {
	defer f.warm.settle()
	bo := backoff.New(minRetryPause, maxRetryPause)
	needLoad := true
	// replay: the first load replays etcd's retained history.
	replay := f.cfg.LoadRetainedHistory
	// warm: the first load starts from the copy on disk.
	warm := f.cfg.Disk != nil
	for ctx.Err() == nil {
		loads := f.loads.Load()
		var err error
		switch {
		case needLoad && warm:
			err = f.warmStart(ctx, bo)
		case needLoad && replay:
			// From etcd's compaction revision: the watch is one etcd
			// catches up, by design.
			if err = f.load(ctx, nil, true); err == nil {
				err = f.followOn(ctx, bo, false)
			}
		case needLoad:
			err = f.follow(ctx, bo, loadAtHead, false)
		default:
			// A resumed watch: etcd's history must be verified to be the
			// store's before the stream is trusted.
			err = f.followOn(ctx, bo, true)
		}
		loaded := f.loads.Load() != loads
		if loaded {
			needLoad, replay = false, false
		}
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, errNoDiskCopy) || errors.Is(err, errDiskRefused) {
			warm, needLoad, replay = false, true, f.cfg.LoadRetainedHistory
			continue
		}
		var reload *reloadError
		if needLoad && !errors.As(err, &reload) {
			// The load failed, or the watch it opens first did.
			var failed *loadError
			if errors.As(err, &failed) {
				err = failed.err
			}
			f.loadFailed(err)
			bo.Wait(ctx)
			continue
		}
		if errors.As(err, &reload) {
			if f.warm.opened {
				// A sign of another history came before the copy on
				// disk was verified: it is not served.
				_ = f.refuseDisk(reload.reason, reload.err)
			}
			f.takeReloadReason() // this reload serves any asked for meanwhile
			f.lg.Warn("reloading the keyspace from etcd", zap.String("reason", reload.reason), zap.Error(reload.err))
			f.m.observeReload(reload.reason)
			f.life.reloading()
			needLoad = true
			continue
		}
		f.lg.Warn("upstream watch broken; resuming", zap.Int64("store-revision", f.store.Rev()), zap.Error(err))
		f.m.observeWatchRestart()
		bo.Wait(ctx)
	}
}

// followOn follows etcd from the store's revision: from etcd's head if
// that is the store's revision, else from the store's revision as a watch
// etcd catches up, or from the revision after it if etcd compacted exactly
// there.
func (f *Follower) followOn(ctx context.Context, bo *backoff.Backoff, resumed bool) error {
	err := f.follow(ctx, bo, fromHead, resumed)
	if errors.Is(err, errBehindHead) && ctx.Err() == nil {
		// etcd moved on since the store's revision: follow from there, as
		// an unsynced watcher that etcd catches up.
		err = f.follow(ctx, bo, fromStore, resumed)
	}
	if errors.Is(err, errCompactedAtNext) && ctx.Err() == nil {
		// etcd compacted exactly past the store's revision: the store
		// holds every revision below the compaction, so a watch from the
		// next one continues it, where a reload would start over.
		err = f.follow(ctx, bo, fromNext, resumed)
	}
	return err
}

// load reads the whole keyspace at one revision and resets the store to
// it: at the revision of at, the header of the created response of a watch
// from etcd's head, or with history at etcd's compaction revision, so that
// the watch replays every retained revision. Errors are *loadError.
func (f *Follower) load(ctx context.Context, at *pb.ResponseHeader, history bool) error {
	if err := f.loadKeyspace(ctx, at, history); err != nil {
		return &loadError{err}
	}
	return nil
}

func (f *Follower) loadKeyspace(ctx context.Context, at *pb.ResponseHeader, history bool) error {
	start := time.Now()
	// The release decides how some reads are answered: read it before the
	// store can serve. A failure leaves it unknown, and the version
	// tracker retries.
	if err := checkRelease(f.version.refresh(ctx)); err != nil {
		return err
	}
	if f.timeline.pending.Load() {
		// Another history: nothing of the old one holds, not even its
		// compaction revision or the heads it reported.
		f.store.ForgetCompaction()
		f.upstream.resetHead()
	}
	// The current revision: the load revision, or with history the
	// revision the replay must reach before the cache is ready.
	if at == nil {
		head, err := f.readHeadForLoad(ctx)
		if err != nil {
			return err
		}
		at = head
	}
	clusterID, current := at.ClusterId, at.Revision
	for {
		f.upstream.observeHead(current)
		compactRev, err := f.compaction.find(ctx, f.store.CompactRev(), current, 0)
		if err != nil {
			return err
		}
		loadRev := current
		if history {
			loadRev = max(compactRev, 1)
		}
		f.unloadForLoad()
		load, err := f.rangeAll(ctx, loadRev)
		if errors.Is(etcderr.Of(err), rpctypes.ErrCompacted) && !history {
			// etcd compacted past the load revision meanwhile. The watch
			// delivers every revision after the one it was created at, so
			// the keyspace at any later revision continues it: the events
			// up to it are skipped as already applied.
			head, herr := f.readHeadForLoad(ctx)
			if herr != nil {
				return herr
			}
			f.lg.Info("etcd compacted past the load revision during the load; loading at its head",
				zap.Int64("revision", loadRev), zap.Int64("head", head.Revision))
			clusterID, current = head.ClusterId, head.Revision
			continue
		}
		if err != nil {
			return err
		}
		keys := load.Len()
		f.store.ResetLoad(loadRev, load, compactRev)
		f.timeline.loaded(clusterID)
		f.loads.Add(1) // before waking waiters, which may be waiting for it
		f.changes.Notify()
		f.lg.Info("loaded the keyspace from etcd",
			zap.Int64("revision", loadRev),
			zap.Int64("compact-revision", compactRev),
			zap.Int("keys", keys),
			zap.Bool("retained-history", history),
			zap.Duration("took", time.Since(start)))
		f.m.observeLoad()
		if prev := f.loadErr.Swap(nil); prev != nil && errors.Is(*prev, ErrIdentityRefused) {
			f.lg.Info("etcd lets the proxy read the keyspace now: the cache is on")
		}
		f.loaded(current)
		return nil
	}
}

// unloadForLoad drops the store's keyspace and history before a reload
// reads the keyspace again, so that the old store is garbage before the
// new one is built: a reload then needs the memory of one store, not two.
// Nothing serves from the store meanwhile: reads go to etcd or are refused
// while loading, and watchers wait for the load (revtree.ErrNotLoaded),
// then catch up from etcd if they are older than its history. The
// store's revision and compaction revision stay. A first load finds
// nothing to drop.
func (f *Follower) unloadForLoad() {
	if !f.store.Loaded() {
		return
	}
	f.lg.Info("dropping the cache's keyspace and history before reloading",
		zap.Int64("store-revision", f.store.Rev()),
		zap.Int64("approx-bytes", f.store.ApproxBytes()))
	f.store.Unload()
}

// readHeadForLoad reads etcd's current revision.
func (f *Follower) readHeadForLoad(ctx context.Context) (*pb.ResponseHeader, error) {
	head, err := f.kv.Range(ctx, &pb.RangeRequest{Key: wholeKey, RangeEnd: wholeRangeEnd, CountOnly: true})
	if err != nil {
		return nil, fmt.Errorf("reading the current revision: %w", err)
	}
	f.observeHeader(head.Header)
	return head.Header, nil
}

// rangeAll reads every key at rev in pages, as kube-apiserver lists, into
// a load of the store: each page is copied as it arrives, and what was
// decoded is garbage before the next page (a load holds one copy of the
// keyspace, not two). A failed load is discarded.
func (f *Follower) rangeAll(ctx context.Context, rev int64) (_ *revtree.Load, err error) {
	load := f.store.NewLoad()
	defer func() {
		if err != nil {
			load.Discard()
		}
	}()
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
		f.observeHeader(resp.Header)
		load.Add(resp.Kvs)
		if !resp.More || len(resp.Kvs) == 0 {
			return load, nil
		}
		last := resp.Kvs[len(resp.Kvs)-1].Key
		key = append(append(make([]byte, 0, len(last)+1), last...), 0)
	}
}

// takeReloadReason returns and clears a reload asked for by Reload.
func (f *Follower) takeReloadReason() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	reason := f.reloadReason
	f.reloadReason = ""
	return reason
}

// errBehindHead ends a watch created at etcd's head when that head is past
// the store's revision: its events would leave a gap.
var errBehindHead = errors.New("etcd's head is past the store's revision")

// startMode is where an upstream watch starts.
type startMode int

const (
	// fromHead: at etcd's head (start revision 0), which etcd counts as
	// synced: it delivers events at once, answers progress requests, and a
	// compaction cannot cancel it. That is right only if the head is the
	// store's revision, which the created response tells (etcd reads its
	// revision after registering the watcher); otherwise follow returns
	// errBehindHead.
	fromHead startMode = iota
	// fromStore: at the store's revision, not the next one, because etcd
	// drops every progress request on a stream whose watcher starts beyond
	// its head; etcd catches that unsynced watcher up within its sync
	// interval (100 ms), and the store's own revision comes back as a
	// duplicate and is skipped.
	fromStore
	// fromNext: at the revision after the store's: etcd compacted exactly
	// there (errCompactedAtNext), so the store's own revision can no
	// longer be watched, nor its history compared.
	fromNext
	// loadAtHead: at etcd's head, as fromHead, and the keyspace is loaded
	// at the revision of the created response before the watch's events
	// are read: they continue it, and events up to the revision the load
	// ends at are skipped.
	loadAtHead
)

// follow runs one upstream watch until it breaks. It returns a
// *reloadError when resuming is impossible, and a *loadError when its
// load failed.
//
// A resumed watch is followed only once etcd's history is verified to be
// the store's (verifyResume); then the stream counts as verified for read
// fences until it ends.
func (f *Follower) follow(ctx context.Context, bo *backoff.Backoff, mode startMode, resumed bool) error {
	// The stream ends as soon as its connection drains (a member's
	// graceful stop): it resumes elsewhere rather than hold the member's
	// shutdown for its request timeout. It also ends when its member stops
	// answering while another answers, to resume there.
	wctx, cancelDrain := drain.Context(drain.Avoid(clientv3.WithRequireLeader(ctx), f.avoidNext))
	defer cancelDrain()
	// A stalled stream is ended with its own cause (the sender's).
	wctx, cancelStream := context.WithCancelCause(wctx)
	cancel := func() { cancelStream(context.Canceled) }
	defer cancel()
	f.mu.Lock()
	if reason := f.reloadReason; reason != "" {
		f.reloadReason = ""
		f.mu.Unlock()
		return &reloadError{reason: reason, err: errors.New("reload requested")}
	}
	f.cancelFollow = cancelStream
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.cancelFollow = nil
		f.mu.Unlock()
	}()
	defer f.following.Store(false)
	defer f.verified.Store(0)
	stream, err := f.wc.Watch(wctx)
	if err != nil {
		return fmt.Errorf("opening the upstream watch: %w", err)
	}
	// The stream was picked as it opened: later calls made with wctx
	// for it (the load, the check of a resume) may go to other members.
	member := drain.Member(wctx)
	f.watchMember.Store(&member)
	defer f.watchMember.Store(nil)
	startRev := f.resumeRev()
	createRev := startRev
	switch mode {
	case fromHead, loadAtHead:
		createRev = 0
	case fromNext:
		createRev = startRev + 1
	}
	err = stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{
		Key:            wholeKey,
		RangeEnd:       wholeRangeEnd,
		StartRevision:  createRev,
		ProgressNotify: true,
	}}})
	if err != nil {
		return fmt.Errorf("creating the upstream watch: %w", err)
	}

	// The sender owns stream.Send after the create: it sends the coalesced
	// progress requests for as long as this stream lives.
	sendErr := make(chan error, 1)
	var sender sync.WaitGroup
	sender.Add(1)
	go func() {
		defer sender.Done()
		err := f.requests.sendLoop(wctx, stream, f.Following, f.m.observeProgressRequest)
		if errors.Is(err, errWatchStalled) {
			err = fmt.Errorf("%w: %s delivered nothing for %v while a progress request waited", err, member, watchStallTimeout)
			cancelStream(err)
		}
		sendErr <- err
	}()
	defer sender.Wait()
	defer cancel()

	ws := &watchStream{ctx: wctx, bo: bo, mode: mode, resumed: resumed, startRev: startRev}
	for {
		resp, err := stream.Recv()
		if err != nil {
			if errors.Is(context.Cause(wctx), errWatchStalled) {
				// Elsewhere next time, if another member answers.
				f.avoidNext = member
			}
			return f.streamBroken(ctx, wctx, err, sendErr)
		}
		f.requests.receivedResponse()
		f.observeHeader(resp.Header)
		if err := f.handle(ws, resp); err != nil {
			return err
		}
	}
}

// watchStream is what follow knows of its upstream watch while it reads it.
type watchStream struct {
	ctx      context.Context // the stream's; canceled when it ends
	bo       *backoff.Backoff
	mode     startMode
	resumed  bool  // verify etcd's history is the store's once created
	startRev int64 // the store's revision the stream continues
}

// streamBroken returns the error that ends a stream whose Recv failed:
// a reload asked for meanwhile, the draining of its connection, or the
// failure itself (or the sender's, which broke it).
func (f *Follower) streamBroken(ctx, wctx context.Context, err error, sendErr <-chan error) error {
	if wctx.Err() != nil && ctx.Err() == nil {
		if reason := f.takeReloadReason(); reason != "" {
			return &reloadError{reason: reason, err: errors.New("reload requested")}
		}
	}
	if errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	if drain.Moved(wctx) || errors.Is(context.Cause(wctx), errWatchStalled) {
		err = context.Cause(wctx)
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

// handle takes one response of the upstream watch; an error ends the
// stream.
func (f *Follower) handle(ws *watchStream, resp *pb.WatchResponse) error {
	switch {
	case resp.CompactRevision == ws.startRev+1 && ws.mode == fromStore:
		return errCompactedAtNext
	case resp.CompactRevision != 0:
		// The resume revision was compacted while we were away, or
		// etcd was restored with --mark-compacted: either way every
		// watcher is behind etcd's compaction, and etcd would cancel
		// it.
		err := fmt.Errorf("watch from revision %d canceled: compacted at %d", ws.startRev, resp.CompactRevision)
		if f.warm.opened {
			return f.refuseDisk("compacted", err)
		}
		// Mirrored first, so that the watchers end with etcd's
		// compact_revision, not their own next revision, whether the
		// probe found it before this answer or not.
		f.ObserveCompaction(resp.CompactRevision, "watch")
		f.timelineChanged("compacted-resume", err)
		return &reloadError{reason: "compacted", err: err}
	case resp.Canceled && ws.mode == loadAtHead:
		// etcd refused the watch of the keyspace (its auth): the load
		// fails as a read of it would.
		return &loadError{fmt.Errorf("watching the keyspace: %w", etcderr.OfCancelReason(resp.CancelReason))}
	case resp.Canceled:
		return fmt.Errorf("upstream watch canceled: %s", resp.CancelReason)
	case resp.Created && ws.mode == fromHead && resp.Header.Revision > ws.startRev:
		return errBehindHead
	case resp.Created:
		return f.created(ws, resp)
	case len(resp.Events) == 0:
		f.onProgress(resp.Header.Revision, resp.WatchId == clientv3.InvalidWatchID)
		return nil
	}
	return f.applyEvents(resp.Events)
}

// created starts following on the created response: after the load from
// etcd's head, or once a resumed stream's history is verified to be the
// store's.
func (f *Follower) created(ws *watchStream, resp *pb.WatchResponse) error {
	switch {
	case ws.mode == loadAtHead:
		// The stream is not read meanwhile: etcd holds its events.
		if err := f.load(ws.ctx, resp.Header, false); err != nil {
			return err
		}
		ws.startRev = f.store.Rev()
	case ws.resumed:
		if err := f.verifyResume(ws.ctx, ws.startRev, ws.mode == fromNext); err != nil {
			switch {
			case errors.Is(err, errTimeline):
				return &reloadError{reason: "timeline", err: err}
			case errors.Is(err, errCompactedResume):
				return &reloadError{reason: "compacted", err: err}
			}
			return err
		}
	}
	f.verified.Store(f.streamGens.Add(1))
	f.following.Store(true)
	f.avoidNext = "" // followed again: the member that stalled may serve the next watch
	f.leader.found()
	ws.bo.Reset()
	f.lg.Info("following etcd", zap.Int64("store-revision", ws.startRev), zap.Bool("from-head", ws.mode == fromHead || ws.mode == loadAtHead))
	// The member that answers may run another release now.
	f.version.reconnected()
	// The created response promises nothing about revisions: a progress
	// request is the way to learn the head. Re-send any request that was
	// lost with the previous stream.
	f.requests.streamLost()
	return nil
}

// onProgress handles a progress notification at rev; requested says it
// answers our RequestProgress (watch id -1) rather than being periodic.
func (f *Follower) onProgress(rev int64, requested bool) {
	f.store.Advance(rev)
	if requested {
		f.requests.answer()
	}
	f.advanced()
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
		f.m.observeEvents(len(batch))
		f.compaction.noticeCompactRevKey(batch)
		f.advanced()
	}
	return nil
}
