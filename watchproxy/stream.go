package watchproxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/storage/mvcc"

	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// maxRevisionsPerPass bounds the history one pass of a send loop reads: a
// watcher catching up a long history holds at most that many revisions of
// events at once, and the loop serves its requests between passes.
const maxRevisionsPerPass = 256

var errNotReady = status.Error(codes.Unavailable, "etcd-snapcache: the cache is loading; retry")

// errInconsistent ends a running stream once the consistency checker finds
// the store inconsistent, after its watchers were canceled as compacted.
var errInconsistent = status.Error(codes.Unavailable, "etcd-snapcache: the cache was found inconsistent with etcd; retry")

// errTimeline ends a stream whose watchers followed a history etcd no
// longer has.
var errTimeline = status.Error(codes.Unavailable, "etcd-snapcache: etcd's history changed (restored or replaced); retry")

// ready is always closed: selecting on it never blocks.
var ready = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// stream is one client watch stream and the state of its send loop.
//
// run is the root of the stream's goroutines. It starts the receive loop,
// whose owner is the gRPC stream: it ends when Recv fails, which gRPC makes
// happen once the handler returns. Every other goroutine (freshness checks,
// catch-ups) is counted in wg, and close waits for them.
type stream struct {
	epoch uint64 // of etcd's history when the stream began (Follower.Epoch)
	// inconsistencies is Consistency.Failures when the stream began.
	inconsistencies uint64
	s               *Server
	gs              pb.Watch_WatchServer
	ctx             context.Context // canceled when run returns
	cancel          context.CancelFunc
	span            trace.Span      // the stream's span; it records only with tracing on
	leaderLost      <-chan struct{} // closed when etcd loses its leader; nil unless the client requires one

	reqs    chan *pb.WatchRequest // requests, in order, from the receive loop
	recvErr chan error            // the receive loop's final error (not io.EOF)
	// wake is signalled (never blocking) when the store has events for a
	// watcher of the stream (notifier), and for what streamWaker wakes
	// it for.
	wake chan struct{}
	// progressDue is set by streamWaker's tick: the send loop sends the
	// periodic progress on its next pass.
	progressDue atomic.Bool
	// progressWatchers counts the stream's progress_notify watchers, which
	// streamWaker ticks for; written by the send loop only.
	progressWatchers atomic.Int32

	// Fields below are touched only by the send loop (run).
	watchers map[int64]*watcher
	nextID   int64
	// RequestProgress bookkeeping (requestProgress). Each request is
	// answered once a freshness check it may share has proven a revision
	// F, and every watcher has been sent everything up to some R >= F.
	progressUnchecked int              // arrived after the running check began, or with none running
	progressChecking  int              // covered by the running check
	progressProven    []provenProgress // proven by a check, awaiting the watchers; oldest first
	freshPending      bool             // a freshness check is running

	// Scratch of the event sends, reused so that a send allocates only
	// its message: a watcher's event entries, and a response's pieces.
	entries, pieces []mem.Buffer
	// headerField is the header field of responses at headerFieldRev,
	// encoded once per pass (nil when not yet).
	headerFieldRev int64
	headerField    mem.Buffer
	// unsent counts the events sent this pass, not yet in the metrics.
	unsent int
	// passCompactRev is the compaction revision as the pass began: the
	// pass's sends decide prev_kv against it, as etcd's send loop reads
	// each prev_kv as it sends.
	passCompactRev int64

	freshc   chan freshResult  // a freshness check's result, to the send loop
	catchupc chan catchupBatch // catch-up events and results, to the send loop
	wg       sync.WaitGroup    // freshness-check and catch-up goroutines
}

// provenProgress is n progress requests that a freshness check proved
// answerable at any revision >= rev.
type provenProgress struct {
	n   int
	rev int64
}

// freshResult is the outcome of one follower.WaitFresh.
type freshResult struct {
	rev int64
	err error
}

func newStream(s *Server, gs pb.Watch_WatchServer, leaderLost <-chan struct{}) *stream {
	ctx, cancel := context.WithCancel(gs.Context())
	epoch, _ := s.follower.Epoch()
	return &stream{
		epoch:           epoch,
		inconsistencies: s.consistency.Failures(),
		s:               s,
		gs:              gs,
		ctx:             ctx,
		cancel:          cancel,
		span:            trace.SpanFromContext(ctx),
		leaderLost:      leaderLost,
		reqs:            make(chan *pb.WatchRequest, 16),
		recvErr:         make(chan error, 1),
		wake:            make(chan struct{}, 1),
		watchers:        map[int64]*watcher{},
		freshc:          make(chan freshResult, 1),
		catchupc:        make(chan catchupBatch),
	}
}

// run is the send loop. It returns when the client goes away, a send fails,
// the upstream loses its leader (for streams that require one), or the
// server closes. It has no timer: it runs a pass when something wakes it
// (a request, an event of its watchers, streamWaker), and sleeps
// otherwise.
func (st *stream) run() error {
	defer st.close()
	st.s.waker.join(st)
	go st.recvLoop()
	for {
		if st.s.consistency.Fallback() || st.s.consistency.Failures() != st.inconsistencies {
			return st.endRelist("the cache was found inconsistent with etcd", errInconsistent, 0)
		}
		if epoch, _ := st.s.follower.Epoch(); epoch != st.epoch {
			return st.endRelist("etcd's history changed (restored from a snapshot, or another cluster)", errTimeline, st.s.follower.CompactRevAtEpochChange())
		}
		more, err := st.deliver()
		if err != nil {
			return err
		}
		if st.progressDue.Swap(false) {
			// The tick's progress reports what the pass just sent.
			if err := st.periodicProgress(); err != nil {
				return err
			}
		}
		if err := st.answerProgress(); err != nil {
			return err
		}
		var proceed <-chan struct{}
		if more {
			proceed = ready // more history to send: do not wait
		}
		select {
		case req := <-st.reqs:
			err = st.handle(req)
		case err = <-st.recvErr:
		case res := <-st.freshc:
			st.onFresh(res)
		case b := <-st.catchupc:
			err = st.onCatchup(b)
		case <-st.wake:
		case <-proceed:
		case <-st.leaderLost:
			err = rpctypes.ErrGRPCNoLeader
		case <-st.s.closing:
			err = rpctypes.ErrGRPCStopped
		case <-st.ctx.Done():
			err = st.ctx.Err()
		}
		if err != nil {
			return err
		}
	}
}

// wakeUp wakes the send loop, if it is not already to wake.
func (st *stream) wakeUp() {
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

func (st *stream) close() {
	st.s.waker.leave(st)
	st.s.notify.leave(st)
	st.cancel()
	st.wg.Wait()
	st.s.m.watchersRemoved(len(st.watchers))
}

func (st *stream) recvLoop() {
	for {
		req, err := st.gs.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				// A half-close (EOF) is not the end: etcd goes on
				// sending events until the client goes away.
				st.recvErr <- err
			}
			return
		}
		select {
		case st.reqs <- req:
		case <-st.ctx.Done():
			return
		}
	}
}

func (st *stream) header(rev int64) *pb.ResponseHeader {
	h := &pb.ResponseHeader{Revision: rev}
	st.s.follower.FillHeader(h)
	return h
}

func (st *stream) handle(req *pb.WatchRequest) error {
	switch r := req.RequestUnion.(type) {
	case *pb.WatchRequest_CreateRequest:
		if r.CreateRequest != nil {
			return st.create(r.CreateRequest)
		}
	case *pb.WatchRequest_CancelRequest:
		if r.CancelRequest != nil {
			return st.cancelWatch(r.CancelRequest.WatchId)
		}
	case *pb.WatchRequest_ProgressRequest:
		if r.ProgressRequest != nil {
			st.requestProgress()
		}
	default:
		// etcd ignores a request it does not know rather than ending
		// the stream.
	}
	return nil
}

// create registers a watcher and answers with its created response, with
// etcd's answers to a negative start revision, an empty range and a
// duplicate id (api/v3rpc/watch.go, mvcc/watcher.go).
func (st *stream) create(cr *pb.WatchCreateRequest) error {
	rev := st.s.store.Rev()
	refuse := func(reason string) error {
		if st.traced() {
			st.event("watch refused", attrKey.String(string(cr.Key)), attrCancelReason.String(reason))
		}
		return st.gs.Send(&pb.WatchResponse{Header: st.header(rev), WatchId: clientv3.InvalidWatchID, Created: true, Canceled: true, CancelReason: reason})
	}
	key := cr.Key
	if len(key) == 0 {
		key = []byte{0} // the smallest key
	}
	if cr.StartRevision < 0 {
		return refuse(rpctypes.ErrCompacted.Error())
	}
	// etcd checks the range as the request gives it, before it reads a
	// "\x00" range end as "from key on"; its cancel reason is the gRPC
	// error's text.
	if err := st.s.gate.AuthorizeWatch(st.ctx, key, cr.RangeEnd); err != nil {
		return refuse(err.Error())
	}
	end := cr.RangeEnd
	switch {
	case len(end) == 0:
		end = nil // one key
	case len(end) == 1 && end[0] == 0:
		end = []byte{} // from key on
	}
	if len(end) != 0 && bytes.Compare(key, end) >= 0 {
		return refuse(mvcc.ErrEmptyWatcherRange.Error())
	}
	id := cr.WatchId
	if id == clientv3.AutoWatchID {
		for st.watchers[st.nextID] != nil {
			st.nextID++
		}
		id = st.nextID
		st.nextID++
	} else if st.watchers[id] != nil {
		return refuse(mvcc.ErrWatcherDuplicateID.Error())
	}
	w := newWatcher(id, cr, key, end)
	// As etcd: from the current revision + 1 for 0 or a future revision
	// not yet reached, else from the start revision.
	w.nextRev = cr.StartRevision
	if cr.StartRevision == 0 || cr.StartRevision > rev {
		w.nextRev = max(rev+1, cr.StartRevision)
	}
	// etcd's synced watchers start at its head. A start between the
	// store's head and a compaction mirrored above it is not one: etcd,
	// whose head is past that compaction, would cancel it.
	w.synced = cr.StartRevision == 0 || (cr.StartRevision > rev && cr.StartRevision >= st.s.store.CompactRev())
	w.idle = true
	st.watchers[id] = w
	if w.progressNotify {
		st.progressWatchers.Add(1)
	}
	st.s.notify.watch(st, id, w.keyRange)
	st.s.m.watchersAdded(1)
	if st.traced() {
		st.event("watch created", attrWatchID.Int64(id), attrKey.String(string(cr.Key)), attrRangeEnd.String(string(cr.RangeEnd)),
			attrStartRevision.Int64(cr.StartRevision), attrNextRevision.Int64(w.nextRev), attrSynced.Bool(w.synced))
	}
	return st.gs.Send(&pb.WatchResponse{Header: st.header(rev), WatchId: id, Created: true})
}

func (st *stream) cancelWatch(id int64) error {
	w := st.watchers[id]
	if w == nil {
		return nil // etcd answers nothing for an unknown id
	}
	st.remove(w)
	if st.traced() {
		st.event("watch canceled", attrWatchID.Int64(id), attrCancelReason.String("by the client"))
	}
	return st.gs.Send(&pb.WatchResponse{Header: st.header(st.s.store.Rev()), WatchId: id, Canceled: true})
}

func (st *stream) remove(w *watcher) {
	if w.cancelCatchup != nil {
		w.cancelCatchup()
	}
	delete(st.watchers, w.id)
	if w.progressNotify {
		st.progressWatchers.Add(-1)
	}
	st.s.notify.unwatch(st, w.id)
	st.s.m.watchersRemoved(1)
}

// cancelCompacted ends a watcher whose next revision etcd has compacted, as
// etcd does: a canceled response with compact_revision and header revision
// 0. The watcher stays registered, sending nothing, until the client
// cancels it, as in etcd's watch stream.
func (st *stream) cancelCompacted(w *watcher, compactRev int64) error {
	if w.cancelCatchup != nil {
		w.cancelCatchup()
	}
	w.compacted, w.catchingUp, w.cancelCatchup = true, false, nil
	st.s.m.compacted()
	if st.traced() {
		st.event("watch canceled", attrWatchID.Int64(w.id), attrCancelReason.String("compacted"), attrCompactRev.Int64(compactRev))
	}
	return st.gs.Send(&pb.WatchResponse{Header: st.header(0), WatchId: w.id, CompactRevision: compactRev, Canceled: true})
}

// cancelFailed ends one watcher whose catch-up from etcd failed for good,
// with a canceled response and the reason, as etcd ends a watch it will not
// serve. The stream and its other watchers go on; the id is free again.
func (st *stream) cancelFailed(w *watcher, reason string) error {
	st.remove(w)
	if st.traced() {
		st.event("watch canceled", attrWatchID.Int64(w.id), attrCancelReason.String(reason))
	}
	return st.gs.Send(&pb.WatchResponse{Header: st.header(st.s.store.Rev()), WatchId: w.id, Canceled: true, CancelReason: reason})
}

// endRelist ends the stream once the events it sent cannot be trusted:
// the consistency checker found the store inconsistent, or etcd's history
// changed under it (a restore, another cluster). Every watcher gets the
// compacted cancel, then the stream ends with err, an Unavailable.
//
// Why the compacted cancel: events already sent may have come from the
// wrong cache, and only a relist repairs what a client built from them.
// kube-apiserver relists on it (ErrCompacted is its 410 "too old
// resourceVersion"), and clientv3 hands it to the caller as ErrCompacted,
// whose documented answer is to read again and watch from there. A bare
// Unavailable would be retried by clientv3 from each watcher's last
// revision, silently keeping whatever the wrong cache sent. Then
// Unavailable, so that no new watch of this stream is served from the
// cache: clientv3 opens a new stream, which etcd serves while the
// fallback lasts (Server.Watch relays it).
//
// compact_revision is the watcher's next revision (or etcd's compaction
// revision, if higher: the store's, or compactRev, what the store had
// before a reload dropped it): nonzero, as clients require, and a client
// that watches again from it misses nothing.
func (st *stream) endRelist(why string, err error, compactRev int64) error {
	traceFallback(st.ctx, "relist", why+": every watcher is canceled as compacted, so that clients relist")
	n := 0
	for _, w := range st.watchers {
		if w.compacted {
			continue
		}
		if err := st.cancelCompacted(w, max(w.nextRev, st.s.store.CompactRev(), compactRev)); err != nil {
			return err
		}
		n++
	}
	st.s.lg.Warn(why+": ending a watch stream, its watchers canceled as compacted so that clients relist",
		zap.Int("watchers", n))
	return err
}

// deliver sends every ready watcher its events from the history, up to the
// store's revision or one pass's worth; more says a pass was cut short.
//
// Compaction is etcd's (syncWatchers, watcherGroup.chooseAll): an unsynced
// watcher whose next revision is below the compaction revision is canceled;
// a synced one never is, and reads on from the history while the store
// holds it. A synced watcher is canceled only once its events are gone
// (deliverEach), as etcd cancels a watcher that fell behind its channel.
func (st *stream) deliver() (more bool, err error) {
	// The header's member fields (raft term) may have moved since the
	// last pass.
	st.headerField = nil
	defer st.countSent()
	st.s.notify.skipQuiet(st)
	rev := st.s.store.Rev()
	compactRev := st.s.store.CompactRev()
	st.passCompactRev = compactRev
	from := int64(math.MaxInt64)
	for _, w := range st.watchers {
		if !w.active() {
			continue
		}
		if !w.synced && w.nextRev < compactRev {
			if err := st.cancelCompacted(w, compactRev); err != nil {
				return false, err
			}
			continue
		}
		if w.nextRev <= rev {
			from = min(from, w.nextRev)
		}
	}
	if from != math.MaxInt64 {
		if more, err = st.deliverFrom(from, rev); err != nil {
			return false, err
		}
	}
	for _, w := range st.watchers {
		if w.active() && w.nextRev > rev && !w.synced {
			w.synced = true // sent everything up to the head
			if st.traced() {
				st.event("watch caught up", attrWatchID.Int64(w.id), attrNextRevision.Int64(w.nextRev))
			}
		}
	}
	st.s.notify.delivered(st)
	return more, nil
}

// deliverFrom sends the ready watchers their events from one read of the
// history from their least next revision.
func (st *stream) deliverFrom(from, rev int64) (more bool, err error) {
	// Not EventsFrom: deliver canceled the unsynced watchers behind the
	// compaction, and synced ones read below it.
	batches, complete, err := st.s.store.EventsHeld(from, rev, maxRevisionsPerPass)
	if err != nil {
		// Some watcher is behind the history: settle each on its own.
		return st.deliverEach(rev)
	}
	encs := make([]*revEvents, len(batches))
	for _, w := range st.watchers {
		if w.active() && w.nextRev <= complete {
			if err := st.sendEvents(w, batches, encs, complete); err != nil {
				return false, err
			}
		}
	}
	return complete < rev, nil
}

func (st *stream) deliverEach(rev int64) (more bool, err error) {
	for _, w := range st.watchers {
		if !w.active() || w.nextRev > rev {
			continue
		}
		batches, complete, err := st.s.store.EventsHeld(w.nextRev, rev, maxRevisionsPerPass)
		switch {
		case errors.Is(err, revtree.ErrCompacted),
			errors.Is(err, revtree.ErrNotRetained) && w.nextRev < st.s.store.CompactRev():
			// Gone from the store, and etcd compacted it.
			err = st.cancelCompacted(w, st.s.store.CompactRev())
		case errors.Is(err, revtree.ErrNotRetained):
			st.startCatchup(w)
			err = nil
		case err == nil:
			more = more || complete < rev
			err = st.sendEvents(w, batches, make([]*revEvents, len(batches)), complete)
		default: // not loaded: wait for the load
			err = nil
		}
		if err != nil {
			return false, err
		}
	}
	return more, nil
}

// sendEvents sends w its events of batches from w.nextRev up to complete,
// and moves it past complete. encs are the batches' shared encodings,
// looked up (and kept in encs) once a watcher wants an event of theirs:
// most revisions concern few of a stream's watchers.
func (st *stream) sendEvents(w *watcher, batches []revtree.Batch, encs []*revEvents, complete int64) error {
	entries, n := st.entries[:0], 0
	for i, b := range batches {
		if b.Rev >= w.nextRev && b.Rev <= complete {
			prevKV := w.prevKV && prevKVReadable(b.Rev, st.passCompactRev)
			var k int
			entries, k = w.matchingEncoded(entries, b.Events, func() *encodedEvents {
				if encs[i] == nil {
					encs[i] = st.s.enc.lookup(b)
				}
				return st.s.enc.encoded(encs[i], prevKV)
			})
			n += k
		}
	}
	w.nextRev = complete + 1
	defer func() {
		// Held until the next send, the entries would keep dropped
		// encodings alive.
		clear(entries)
		st.entries = entries[:0]
	}()
	if n == 0 {
		return nil
	}
	w.idle = false
	st.unsent += n
	return st.sendEntries(w, st.encodedHeader(complete), entries)
}

// encodedHeader returns the header field of responses at rev, encoded
// once per pass.
func (st *stream) encodedHeader(rev int64) mem.Buffer {
	if st.headerField == nil || st.headerFieldRev != rev {
		st.headerFieldRev = rev
		st.headerField = wirecodec.Piece(appendMessage(nil, fieldHeader, st.header(rev)))
	}
	return st.headerField
}

// sendEntries sends w a response of header and events' entries, in
// fragments if it asked for them and the response is too big, as
// sendFragments splits it: the sizes are proto.Size's, since the bytes
// are proto.Marshal's.
func (st *stream) sendEntries(w *watcher, header mem.Buffer, events []mem.Buffer) error {
	fixed := header.Len()
	if w.idField != nil {
		fixed += w.idField.Len()
	}
	size := fixed
	for _, e := range events {
		size += e.Len()
	}
	if !w.fragment || size < st.s.maxBytes || len(events) < 2 {
		return st.sendResponse(header, w.idField, nil, events)
	}
	fixed += fragmentPiece.Len()
	for start := 0; start < len(events); {
		end, size := start, fixed
		for _, e := range events[start:] {
			size += e.Len()
			if end > start && size >= st.s.maxBytes {
				break
			}
			end++
		}
		fragment := fragmentPiece
		if end == len(events) {
			fragment = nil
		}
		if err := st.sendResponse(header, w.idField, fragment, events[start:end]); err != nil {
			return err
		}
		start = end
	}
	return nil
}

// sendResponse sends a WatchResponse of the given fields (nil ones are
// not written), in field order.
func (st *stream) sendResponse(header, id, fragment mem.Buffer, events []mem.Buffer) error {
	pieces := append(st.pieces[:0], header)
	if id != nil {
		pieces = append(pieces, id)
	}
	if fragment != nil {
		pieces = append(pieces, fragment)
	}
	pieces = append(pieces, events...)
	msg := wirecodec.NewEncoded(watchResponseType, pieces)
	clear(pieces)
	st.pieces = pieces[:0]
	return st.gs.SendMsg(msg)
}

// countSent adds the events sent this pass to the metrics.
func (st *stream) countSent() {
	if st.unsent > 0 {
		st.s.m.sent(st.unsent)
		st.unsent = 0
	}
}

// sendWatcherEvents sends w events relayed from etcd by its catch-up,
// encoded for it alone: they are in no history other streams read.
func (st *stream) sendWatcherEvents(w *watcher, evs []*mvccpb.Event, rev int64) error {
	w.idle = false
	st.s.m.sent(len(evs))
	resp := &pb.WatchResponse{Header: st.header(rev), WatchId: w.id, Events: evs}
	if w.fragment {
		return sendFragments(resp, st.s.maxBytes, st.gs.Send)
	}
	return st.gs.Send(resp)
}

// requestProgress records a RequestProgress. etcd answers none on a stream
// without watchers. Otherwise the answer waits for proof, through the
// follower's WaitFresh, that the store holds everything etcd had committed
// when the request arrived. The stream's requests share these freshness
// checks under the rule stated in package coalesce's doc: the running
// check covers progressChecking, the next one progressUnchecked. They keep
// a shape of their own, not a coalesce.Call: a request is a count kept by
// the send loop, not a waiting caller, and a check's result comes back
// into the loop's select (freshc), with no goroutine while none runs.
func (st *stream) requestProgress() {
	if len(st.watchers) == 0 {
		return
	}
	st.progressUnchecked++
	if !st.freshPending {
		st.startFreshCheck()
	}
}

// startFreshCheck starts a check covering the requests not yet checked.
func (st *stream) startFreshCheck() {
	st.progressChecking, st.progressUnchecked = st.progressUnchecked, 0
	st.freshPending = true
	st.wg.Add(1)
	go func() {
		defer st.wg.Done()
		rev, err := st.s.follower.WaitFresh(st.ctx)
		select {
		case st.freshc <- freshResult{rev, err}:
		case <-st.ctx.Done():
		}
	}()
}

// onFresh takes a check's result for the requests it covered, and starts
// the next check if requests arrived meanwhile.
func (st *stream) onFresh(res freshResult) {
	st.freshPending = false
	switch {
	case st.progressChecking == 0:
		// Its requests were dropped meanwhile (the last watcher left).
	case res.err != nil:
		// Freshness cannot be proven (etcd unreachable): like requests
		// etcd cannot answer, they are dropped; clients ask again.
		st.s.lg.Debug("dropping progress requests: the cache could not be proven fresh",
			zap.Int("requests", st.progressChecking), zap.Error(res.err))
	default:
		st.progressProven = append(st.progressProven, provenProgress{n: st.progressChecking, rev: res.rev})
	}
	st.progressChecking = 0
	if st.progressUnchecked > 0 {
		st.startFreshCheck()
	}
}

// answerProgress sends the proven progress notifications once every
// watcher has been sent everything up to a revision R at least as new as
// the one their check proved. R is the least position of the stream's
// watchers, not the store's revision, so that a steady stream of writes
// cannot keep the answer waiting.
func (st *stream) answerProgress() error {
	if len(st.progressProven) == 0 {
		return nil
	}
	if len(st.watchers) == 0 {
		// As etcd: nothing is answered on a stream without watchers.
		st.progressProven, st.progressUnchecked, st.progressChecking = nil, 0, 0
		return nil
	}
	rev, startsAfter := int64(math.MaxInt64), int64(0)
	for _, w := range st.watchers {
		if w.catchingUp || w.compacted {
			// etcd sends none while a watcher is not synced; the
			// catch-up's end, or the client's cancel, wakes the loop.
			return nil
		}
		rev = min(rev, w.nextRev-1)
		startsAfter = max(startsAfter, w.startRev)
	}
	// As etcd, no progress while a watcher starts beyond it.
	if want := max(st.progressProven[0].rev, startsAfter); rev < want {
		// A pass moves the watchers up to the store's revision, but a
		// watcher that starts beyond it waits for the store to get
		// there, with writes that may concern no watcher of the
		// stream: the notifier wakes the loop once it has scanned that
		// far (a pass cut short goes on by itself).
		st.s.notify.wakeWhenScanned(st, want)
		return nil
	}
	for len(st.progressProven) > 0 && st.progressProven[0].rev <= rev {
		for range st.progressProven[0].n {
			if err := st.gs.Send(&pb.WatchResponse{Header: st.header(rev), WatchId: clientv3.InvalidWatchID}); err != nil {
				return err
			}
		}
		st.progressProven = st.progressProven[1:]
	}
	return nil
}

// periodicProgress is etcd's progress ticker: each progress_notify watcher
// that was sent no events since the last tick gets a notification of the
// revision it has been sent everything up to, unless it starts beyond it.
// The pass before it moved the quiet watchers with what the notifier has
// scanned, so that revision is not behind the store by more than the
// notifier is.
func (st *stream) periodicProgress() error {
	for _, w := range st.watchers {
		if !w.progressNotify || w.compacted {
			continue
		}
		if rev := w.nextRev - 1; w.idle && !w.catchingUp && rev > 0 && w.startRev <= rev {
			if err := st.gs.Send(&pb.WatchResponse{Header: st.header(rev), WatchId: w.id}); err != nil {
				return err
			}
		}
		w.idle = true
	}
	return nil
}
