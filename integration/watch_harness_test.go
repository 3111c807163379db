package integration

// Helpers of the watch suites (watch_*_test.go): raw Watch streams opened on
// etcd and on the proxy, recording every response; per-stream invariant
// checks; and the comparison of what etcd determines (created responses,
// each watch's events, cancels) between the two.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// watchStream is one raw Watch stream whose responses are all recorded, in
// order, by a receive goroutine.
type watchStream struct {
	tb     testing.TB
	name   string
	cs     pb.Watch_WatchClient
	cancel context.CancelFunc
	done   chan struct{}

	sendMu sync.Mutex

	mu     sync.Mutex
	log    []*pb.WatchResponse
	err    error // the error that ended the receive loop
	notify chan struct{}
	closed atomic.Bool
}

func openWatchStream(tb testing.TB, conn *grpc.ClientConn, name string) *watchStream {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cs, err := pb.NewWatchClient(conn).Watch(ctx)
	if err != nil {
		cancel()
		tb.Fatalf("%s: opening a watch stream: %v", name, err)
	}
	s := &watchStream{tb: tb, name: name, cs: cs, cancel: cancel, done: make(chan struct{}), notify: make(chan struct{})}
	go s.recvLoop()
	tb.Cleanup(s.close)
	return s
}

func (s *watchStream) recvLoop() {
	defer close(s.done)
	for {
		resp, err := s.cs.Recv()
		s.mu.Lock()
		if err != nil {
			s.err = err
		} else {
			s.log = append(s.log, resp)
		}
		close(s.notify)
		s.notify = make(chan struct{})
		s.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// close ends the stream and waits for its receive goroutine.
func (s *watchStream) close() {
	if s.closed.Swap(true) {
		return
	}
	s.cancel()
	<-s.done
}

func (s *watchStream) send(req *pb.WatchRequest) {
	s.tb.Helper()
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	if err := s.cs.Send(req); err != nil {
		// The stream's status is Recv's to report.
		select {
		case <-s.done:
		case <-time.After(waitTimeout):
		}
		s.mu.Lock()
		recvErr, log := s.err, s.log
		s.mu.Unlock()
		s.tb.Fatalf("%s: send %s: %v; the stream ended with %v; received:\n%s", s.name, fmtMsg(req), err, recvErr, dumpResponses(log))
	}
}

func (s *watchStream) create(cr *pb.WatchCreateRequest) {
	s.tb.Helper()
	s.send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: cr}})
}

func (s *watchStream) cancelWatch(id int64) {
	s.tb.Helper()
	s.send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CancelRequest{CancelRequest: &pb.WatchCancelRequest{WatchId: id}}})
}

func (s *watchStream) requestProgress() {
	s.tb.Helper()
	s.send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}})
}

// responses returns a copy of the responses received so far.
func (s *watchStream) responses() []*pb.WatchResponse {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*pb.WatchResponse(nil), s.log...)
}

func (s *watchStream) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.log)
}

// waitUntil waits until cond holds on the responses received so far and
// returns them. The receive goroutine signals every response, so this is a
// condition wait, bounded by waitTimeout.
func (s *watchStream) waitUntil(what string, cond func(log []*pb.WatchResponse) bool) []*pb.WatchResponse {
	s.tb.Helper()
	deadline := time.NewTimer(waitTimeout)
	defer deadline.Stop()
	for {
		s.mu.Lock()
		log, err, ch := s.log, s.err, s.notify
		ok := cond(log)
		s.mu.Unlock()
		if ok {
			return append([]*pb.WatchResponse(nil), log...)
		}
		if err != nil {
			s.tb.Fatalf("%s: stream ended (%v) while waiting for %s; received:\n%s", s.name, err, what, dumpResponses(log))
		}
		select {
		case <-ch:
		case <-deadline.C:
			s.tb.Fatalf("%s: timed out waiting for %s; received:\n%s", s.name, what, dumpResponses(log))
		}
	}
}

// waitCreated waits until n created responses were received in all.
func (s *watchStream) waitCreated(n int) []*pb.WatchResponse {
	s.tb.Helper()
	return s.waitUntil(fmt.Sprintf("%d created responses", n), func(log []*pb.WatchResponse) bool {
		k := 0
		for _, r := range log {
			if r.Created {
				k++
			}
		}
		return k >= n
	})
}

// syncTo waits for a requested progress notification at rev or later,
// received after the call began: by etcd's guarantee every watcher of the
// stream has then been sent every event up to rev. The request is re-sent
// until answered, because etcd drops one that arrives while a watcher of
// the stream is unsynced. The stream must have a watcher, all of whose
// start revisions are at most rev.
func (s *watchStream) syncTo(rev int64) []*pb.WatchResponse {
	s.tb.Helper()
	mark := s.len()
	deadline := time.NewTimer(waitTimeout)
	defer deadline.Stop()
	resend := time.NewTicker(50 * time.Millisecond) // the pace of re-sent requests, not a synchronisation
	defer resend.Stop()
	s.requestProgress()
	for {
		s.mu.Lock()
		log, err, ch := s.log, s.err, s.notify
		s.mu.Unlock()
		for _, r := range log[mark:] {
			if isProgress(r) && r.WatchId == clientv3.InvalidWatchID && r.Header.GetRevision() >= rev {
				return append([]*pb.WatchResponse(nil), log...)
			}
		}
		if err != nil {
			s.tb.Fatalf("%s: stream ended (%v) while waiting for progress at %d; received:\n%s", s.name, err, rev, dumpResponses(log))
		}
		select {
		case <-ch:
		case <-resend.C:
			s.requestProgress()
		case <-deadline.C:
			s.tb.Fatalf("%s: no progress notification at revision >= %d; received:\n%s", s.name, rev, dumpResponses(log))
		}
	}
}

// streamPair is the same sequence of requests on a stream to etcd (d) and one to
// the proxy (p).
type streamPair struct{ d, p *watchStream }

func openStreamPair(tb testing.TB, c *cluster) *streamPair {
	tb.Helper()
	return &streamPair{
		d: openWatchStream(tb, c.direct.ActiveConnection(), "etcd"),
		p: openWatchStream(tb, c.viaProxy.ActiveConnection(), "proxy"),
	}
}

func (pr *streamPair) create(cr *pb.WatchCreateRequest) {
	pr.d.create(proto.Clone(cr).(*pb.WatchCreateRequest))
	pr.p.create(proto.Clone(cr).(*pb.WatchCreateRequest))
}

func (pr *streamPair) cancelWatch(id int64) {
	pr.d.cancelWatch(id)
	pr.p.cancelWatch(id)
}

func (pr *streamPair) waitCreated(n int) {
	pr.d.waitCreated(n)
	pr.p.waitCreated(n)
}

func (pr *streamPair) syncTo(rev int64) {
	pr.d.syncTo(rev)
	pr.p.syncTo(rev)
}

// isProgress reports whether r is a progress notification: no events, not
// created, not canceled, no compaction.
func isProgress(r *pb.WatchResponse) bool {
	return len(r.Events) == 0 && !r.Created && !r.Canceled && r.CompactRevision == 0 && !r.Fragment
}

// watchRecord is what one watch id received on a stream.
type watchRecord struct {
	id       int64
	created  *pb.WatchResponse
	resps    []*pb.WatchResponse // responses with events, in order
	events   []*mvccpb.Event     // their events, flattened
	canceled *pb.WatchResponse
	progress []*pb.WatchResponse // periodic progress notifications
}

// splitResponses sorts a stream's responses: the created responses in order (one
// per create request, refused ones included), the watches by id, and the
// requested progress notifications (watch id -1).
func splitResponses(log []*pb.WatchResponse) (creates []*pb.WatchResponse, watches map[int64]*watchRecord, progress []*pb.WatchResponse) {
	watches = map[int64]*watchRecord{}
	get := func(id int64) *watchRecord {
		w := watches[id]
		if w == nil {
			w = &watchRecord{id: id}
			watches[id] = w
		}
		return w
	}
	for _, r := range log {
		switch {
		case r.Created:
			creates = append(creates, r)
			if !r.Canceled {
				get(r.WatchId).created = r
			}
		case r.Canceled:
			if w := get(r.WatchId); w.canceled == nil {
				w.canceled = r // the first: etcd answers a cancel of a compacted watch again
			}
		case len(r.Events) > 0:
			w := get(r.WatchId)
			w.resps = append(w.resps, r)
			w.events = append(w.events, r.Events...)
		case r.WatchId == clientv3.InvalidWatchID:
			progress = append(progress, r)
		default:
			get(r.WatchId).progress = append(get(r.WatchId).progress, r)
		}
	}
	return creates, watches, progress
}

// checkStream verifies the ordering guarantees of one stream's responses:
//   - events only for a created watch, in revision order, each revision
//     whole in one response unless fragment splits it; a fragment response
//     is followed on the stream by the rest of the same watch's response;
//   - an event response's header revision is at least its last event's;
//   - no progress notification (requested or periodic) has revision 0 or
//     precedes an event, of a watch it covers, at or below its revision;
//     requested ones never go backwards;
//   - a compaction cancel has compact_revision > 0 and header revision 0.
//
// strict adds the proxy's own promise: nothing for a watch after its
// cancel response (etcd may still flush events queued before the cancel).
func checkStream(tb testing.TB, name string, log []*pb.WatchResponse, strict bool) {
	tb.Helper()
	fail := func(i int, format string, args ...any) {
		tb.Helper()
		tb.Fatalf("%s: response %d: %s\nstream:\n%s", name, i, fmt.Sprintf(format, args...), dumpResponses(log))
	}
	type state struct {
		live         bool
		gone         bool  // canceled
		last         int64 // mod revision of the last event sent
		lastFragment bool  // the last event response was a fragment
		compacted    bool  // canceled for compaction, not by the client
		progressed   int64 // highest progress revision covering this watch
	}
	watches := map[int64]*state{}
	var lastProgress int64
	pendingFragment := int64(-2) // watch id whose fragments must continue, -2 none
	for i, r := range log {
		if pendingFragment != -2 && (len(r.Events) == 0 || r.WatchId != pendingFragment) {
			fail(i, "a fragment of watch %d is not followed by the rest of its response", pendingFragment)
		}
		pendingFragment = -2
		switch {
		case r.Created && r.Canceled:
			if r.WatchId != clientv3.InvalidWatchID {
				fail(i, "created and canceled with watch id %d, not -1", r.WatchId)
			}
			if r.CancelReason == "" {
				fail(i, "refused create without a cancel reason")
			}
		case r.Created:
			if w := watches[r.WatchId]; w != nil && w.live {
				fail(i, "watch %d created twice", r.WatchId)
			}
			watches[r.WatchId] = &state{live: true}
		case r.Canceled:
			w := watches[r.WatchId]
			// etcd answers the client's cancel of a watch it canceled for
			// compaction: once.
			if w == nil || (!w.live && strict && !w.compacted) {
				fail(i, "cancel of watch %d that is not live", r.WatchId)
			}
			w.compacted = w.live && r.CompactRevision != 0
			w.live, w.gone = false, true
			if r.CompactRevision != 0 && r.Header.GetRevision() != 0 {
				fail(i, "compaction cancel with header revision %d, etcd sends 0", r.Header.GetRevision())
			}
			if len(r.Events) != 0 {
				fail(i, "cancel with events")
			}
		case len(r.Events) > 0:
			w := watches[r.WatchId]
			if w == nil || (!w.live && (strict || !w.gone)) {
				fail(i, "events for watch %d that is not live", r.WatchId)
			}
			first, lastEv := r.Events[0].Kv.ModRevision, r.Events[len(r.Events)-1].Kv.ModRevision
			for j := 1; j < len(r.Events); j++ {
				if r.Events[j].Kv.ModRevision < r.Events[j-1].Kv.ModRevision {
					fail(i, "events out of revision order")
				}
			}
			switch {
			case w.lastFragment && first < w.last:
				fail(i, "fragment continues at revision %d after %d", first, w.last)
			case !w.lastFragment && first <= w.last:
				fail(i, "revision %d after revision %d was sent (repeated or split revision)", first, w.last)
			}
			if first <= w.progressed {
				fail(i, "event at revision %d after a progress notification at %d", first, w.progressed)
			}
			if r.Header.GetRevision() < lastEv {
				fail(i, "header revision %d below its last event's %d", r.Header.GetRevision(), lastEv)
			}
			w.last, w.lastFragment = lastEv, r.Fragment
			if r.Fragment {
				pendingFragment = r.WatchId
			}
		default: // progress
			rev := r.Header.GetRevision()
			if rev <= 0 {
				fail(i, "progress notification at revision %d", rev)
			}
			if r.WatchId == clientv3.InvalidWatchID {
				if rev < lastProgress {
					fail(i, "progress went back from %d to %d", lastProgress, rev)
				}
				lastProgress = rev
				for _, w := range watches {
					if w.live {
						w.progressed = max(w.progressed, rev)
					}
				}
			} else {
				w := watches[r.WatchId]
				if w == nil || !w.live {
					fail(i, "progress for watch %d that is not live", r.WatchId)
				}
				w.progressed = max(w.progressed, rev)
			}
		}
	}
}

// compareOpts say what of a pair of streams etcd determines.
type compareOpts struct {
	// quiescent: the store did not move while requests were handled, so
	// the headers of created and cancel responses are compared whole.
	quiescent bool
	// boundaries: compare how events are split into responses (count and
	// fragment flag of each) for these watch ids.
	boundaries []int64
}

// compareStreams checks both streams' invariants, then compares etcd's (d) and
// the proxy's (p) responses: the created responses in order, and per watch
// id the exact events and the cancel.
func compareStreams(tb testing.TB, what string, d, p []*pb.WatchResponse, o compareOpts) {
	tb.Helper()
	checkStream(tb, what+": etcd", d, false)
	checkStream(tb, what+": proxy", p, true)
	fail := func(format string, args ...any) {
		tb.Helper()
		tb.Fatalf("%s: %s\netcd's stream:\n%s\nproxy's stream:\n%s", what, fmt.Sprintf(format, args...), dumpResponses(d), dumpResponses(p))
	}
	dc, dw, _ := splitResponses(d)
	pc, pw, _ := splitResponses(p)
	if len(dc) != len(pc) {
		fail("etcd sent %d created responses, the proxy %d", len(dc), len(pc))
	}
	for i := range dc {
		a, b := dc[i], pc[i]
		if !sameControl(a, b, o.quiescent) {
			fail("created response %d differs:\netcd:  %s\nproxy: %s", i, fmtMsg(a), fmtMsg(b))
		}
	}
	for id, a := range dw {
		b := pw[id]
		if b == nil {
			b = &watchRecord{id: id}
		}
		if len(a.events) != len(b.events) {
			fail("watch %d: etcd sent %d events, the proxy %d", id, len(a.events), len(b.events))
		}
		for i := range a.events {
			if !proto.Equal(a.events[i], b.events[i]) {
				fail("watch %d: event %d differs:\netcd:  %s\nproxy: %s", id, i, fmtMsg(a.events[i]), fmtMsg(b.events[i]))
			}
		}
		switch {
		case (a.canceled == nil) != (b.canceled == nil):
			fail("watch %d: canceled by etcd: %v, by the proxy: %v", id, a.canceled != nil, b.canceled != nil)
		case a.canceled != nil && !sameControl(a.canceled, b.canceled, o.quiescent || a.canceled.CompactRevision != 0):
			fail("watch %d: cancel differs:\netcd:  %s\nproxy: %s", id, fmtMsg(a.canceled), fmtMsg(b.canceled))
		}
	}
	for id := range pw {
		if dw[id] == nil {
			fail("watch %d: the proxy sent responses, etcd none", id)
		}
	}
	for _, id := range o.boundaries {
		a, b := responseSplit(dw[id]), responseSplit(pw[id])
		if a != b {
			fail("watch %d: responses split differently (events per response, f = fragment):\netcd:  %s\nproxy: %s", id, a, b)
		}
	}
}

// sameControl compares a created or cancel response; the header only when
// withHeader (it holds the revision of the moment of the request).
func sameControl(a, b *pb.WatchResponse, withHeader bool) bool {
	if a.WatchId != b.WatchId || a.Created != b.Created || a.Canceled != b.Canceled ||
		a.CompactRevision != b.CompactRevision || a.CancelReason != b.CancelReason ||
		a.Fragment != b.Fragment || len(a.Events) != len(b.Events) {
		return false
	}
	return !withHeader || proto.Equal(a.Header, b.Header)
}

func responseSplit(w *watchRecord) string {
	if w == nil {
		return "none"
	}
	var parts []string
	for _, r := range w.resps {
		s := fmt.Sprint(len(r.Events))
		if r.Fragment {
			s += "f"
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, " ")
}

// dumpResponses is a readable listing of a stream's responses, one a line.
func dumpResponses(log []*pb.WatchResponse) string {
	var b strings.Builder
	const maxLines = 120
	for i, r := range log {
		if i == maxLines && len(log) > maxLines+20 {
			fmt.Fprintf(&b, "  … %d more …\n", len(log)-maxLines-20)
		}
		if i >= maxLines && i < len(log)-20 {
			continue
		}
		fmt.Fprintf(&b, "  %3d: id=%d rev=%d", i, r.WatchId, r.Header.GetRevision())
		if r.Created {
			b.WriteString(" created")
		}
		if r.Canceled {
			fmt.Fprintf(&b, " canceled(%q)", r.CancelReason)
		}
		if r.CompactRevision != 0 {
			fmt.Fprintf(&b, " compact=%d", r.CompactRevision)
		}
		if r.Fragment {
			b.WriteString(" fragment")
		}
		if isProgress(r) {
			b.WriteString(" progress")
		}
		if n := len(r.Events); n > 0 {
			fmt.Fprintf(&b, " %d events:", n)
			for j, ev := range r.Events {
				if j == 6 {
					b.WriteString(" …")
					break
				}
				fmt.Fprintf(&b, " %s %q@%d", ev.Type, shortKey(ev.Kv.Key), ev.Kv.ModRevision)
				if ev.PrevKv != nil {
					fmt.Fprintf(&b, "(prev@%d)", ev.PrevKv.ModRevision)
				}
			}
		}
		b.WriteByte('\n')
	}
	return b.String()
}

func shortKey(key []byte) string {
	if len(key) > 24 {
		return string(key[:24]) + "…"
	}
	return string(key)
}

// eventsUpTo returns the events of evs with mod revision <= rev.
func eventsUpTo(evs []*mvccpb.Event, rev int64) []*mvccpb.Event {
	var out []*mvccpb.Event
	for _, ev := range evs {
		if ev.Kv.ModRevision <= rev {
			out = append(out, ev)
		}
	}
	return out
}

// etcdWriter writes to etcd directly, in order, through one client.
type etcdWriter struct {
	tb  testing.TB
	cli *clientv3.Client
}

func (w etcdWriter) put(key, val string, opts ...clientv3.OpOption) int64 {
	w.tb.Helper()
	r, err := w.cli.Put(context.Background(), key, val, opts...)
	if err != nil {
		w.tb.Fatalf("put %q: %v", key, err)
	}
	return r.Header.Revision
}

// putEach puts val at prefix+"0" to prefix+"<n-1>", in order, and returns
// the first put's revision.
func (w etcdWriter) putEach(prefix string, n int, val string) int64 {
	w.tb.Helper()
	first := w.put(prefix+"0", val)
	for i := 1; i < n; i++ {
		w.put(fmt.Sprintf("%s%d", prefix, i), val)
	}
	return first
}

func (w etcdWriter) del(key string, opts ...clientv3.OpOption) int64 {
	w.tb.Helper()
	r, err := w.cli.Delete(context.Background(), key, opts...)
	if err != nil {
		w.tb.Fatalf("delete %q: %v", key, err)
	}
	return r.Header.Revision
}

func (w etcdWriter) txn(ops ...clientv3.Op) int64 {
	w.tb.Helper()
	r, err := w.cli.Txn(context.Background()).Then(ops...).Commit()
	if err != nil {
		w.tb.Fatalf("txn: %v", err)
	}
	return r.Header.Revision
}

// parallelPuts writes n puts of keyOf(i) with workers goroutines and
// returns the highest revision written. Each put is its own revision.
func parallelPuts(tb testing.TB, cli *clientv3.Client, n, workers int, keyOf func(i int) string) int64 {
	tb.Helper()
	var next, head atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				r, err := cli.Put(context.Background(), keyOf(i), fmt.Sprint("v", i))
				if err != nil {
					errc <- err
					return
				}
				for {
					h := head.Load()
					if r.Header.Revision <= h || head.CompareAndSwap(h, r.Header.Revision) {
						break
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	if err := <-errc; err != nil {
		tb.Fatal(err)
	}
	return head.Load()
}

// referenceEvents opens a watch of [key, end) from rev on etcd and collects its
// events up to upTo: the reference a proxy watch is compared with.
func referenceEvents(tb testing.TB, c *cluster, cr *pb.WatchCreateRequest, upTo int64) []*mvccpb.Event {
	tb.Helper()
	s := openWatchStream(tb, c.direct.ActiveConnection(), "etcd reference")
	defer s.close()
	s.create(cr)
	s.waitCreated(1)
	log := s.syncTo(upTo)
	_, ws, _ := splitResponses(log)
	for _, w := range ws {
		if w.canceled != nil {
			tb.Fatalf("etcd reference watch canceled: %s", fmtMsg(w.canceled))
		}
		return eventsUpTo(w.events, upTo)
	}
	return nil
}

// checkProgressBehindHistory creates a synced watch on prefix and then cr (a
// watcher with history to send), requests progress right behind them, and
// checks the notification: at least head (etcd's revision when requested),
// and only after every event of cr up to it (want is etcd's events for cr).
func checkProgressBehindHistory(t *testing.T, c *cluster, prefix string, cr *pb.WatchCreateRequest, want []*mvccpb.Event, head int64) {
	t.Helper()
	s := openWatchStream(t, c.viaProxy.ActiveConnection(), "proxy")
	s.create(&pb.WatchCreateRequest{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix))}) // synced
	s.create(cr)
	s.requestProgress() // right behind the create: the history is not sent yet
	log := s.waitUntil("a progress notification", func(l []*pb.WatchResponse) bool { return progressCount(l) >= 1 })
	i := nthProgress(log, 1)
	r := log[i]
	if r.Header.Revision < head {
		t.Fatalf("progress at %d, below etcd's revision %d when it was requested", r.Header.Revision, head)
	}
	_, ws, _ := splitResponses(log[:i])
	if diff := servertest.DiffEvents(eventsUpTo(want, r.Header.Revision), ws[1].events); diff != "" {
		t.Fatalf("progress at %d sent before the watcher's events up to it (%d events sent before it): %s", r.Header.Revision, len(ws[1].events), diff)
	}
	checkStream(t, "proxy", log, true)
}
