package watchproxy

import (
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
)

// watcher is one watch of a stream.
type watcher struct {
	id int64
	// keyRange is the watched range: end nil for a single key, empty
	// (non-nil) for "from key on", else the exclusive end, as etcd's
	// watch stream encodes it.
	keyRange
	// startRev is the requested start revision; nextRev the next revision
	// whose events the watcher has not been sent.
	startRev, nextRev int64

	prevKV, fragment, progressNotify bool
	noPut, noDelete                  bool

	// idle is etcd's progress flag: no events sent since the last tick.
	idle bool
	// synced is etcd's synced group (mvcc/watchable_store.go): the watcher
	// started at the head, or has since been sent everything up to the
	// store's revision. etcd cancels only unsynced watchers for a
	// compaction, so a synced one reads the events the store still holds
	// even below the compaction revision: a compaction mirrored above the
	// head leaves the revisions up to it still to come.
	synced bool
	// catchingUp is set while etcd's history is relayed to the watcher.
	catchingUp    bool
	cancelCatchup func()
	// compacted is set once the watcher was canceled for compaction. As
	// in etcd, its id stays taken, it blocks requested progress, and the
	// client's cancel is answered, until the client cancels it.
	compacted bool

	// idField is the watch_id field of the watcher's responses, encoded
	// once (nil for id 0, which proto3 does not write).
	idField mem.Buffer
}

func newWatcher(id int64, cr *pb.WatchCreateRequest, key, end []byte) *watcher {
	w := &watcher{
		id:             id,
		keyRange:       keyRange{key: key, end: end},
		startRev:       cr.StartRevision,
		prevKV:         cr.PrevKv,
		fragment:       cr.Fragment,
		progressNotify: cr.ProgressNotify,
	}
	if id != 0 {
		w.idField = wirecodec.Piece(appendInt(nil, fieldWatchID, id))
	}
	for _, f := range cr.Filters {
		switch f {
		case pb.WatchCreateRequest_NOPUT:
			w.noPut = true
		case pb.WatchCreateRequest_NODELETE:
			w.noDelete = true
		}
	}
	return w
}

// active reports whether the watcher is sent events from the history.
func (w *watcher) active() bool { return !w.catchingUp && !w.compacted }

// wants reports whether the watcher is sent ev: its key is in range, and
// no filter drops it.
func (w *watcher) wants(ev *mvccpb.Event) bool {
	if !w.contains(ev.Kv.Key) {
		return false
	}
	return !(ev.Type == mvccpb.PUT && w.noPut) && !(ev.Type == mvccpb.DELETE && w.noDelete)
}

// matchingEncoded appends the entries of the events of one revision that
// the watcher wants, in the form it wants them, to out, and returns how
// many events they are. enc gives the revision's entries, with prev_kv or
// not as the watcher wants; it is called once the watcher wants an event,
// so that a revision no watcher wants is never encoded. A watcher that
// wants every event gets the one piece of them all, unless it fragments
// (fragments split between events).
func (w *watcher) matchingEncoded(out []mem.Buffer, events []*mvccpb.Event, enc func() *encodedEvents) ([]mem.Buffer, int) {
	var ee *encodedEvents
	start := len(out)
	for i, ev := range events {
		if !w.wants(ev) {
			continue
		}
		if ee == nil {
			ee = enc()
		}
		out = append(out, ee.each[i])
	}
	n := len(out) - start
	if n == len(events) && n > 1 && !w.fragment {
		clear(out[start+1:])
		out = append(out[:start], ee.all)
	}
	return out, n
}

// matching appends the events that the watcher wants, in the form it
// wants them, to out: with their prev_kv only where etcd, whose
// compaction revision is compactRev, could still read it.
func (w *watcher) matching(out []*mvccpb.Event, events []*mvccpb.Event, compactRev int64) []*mvccpb.Event {
	for _, ev := range events {
		if !w.wants(ev) {
			continue
		}
		if ev.PrevKv == nil || (w.prevKV && prevKVReadable(ev.Kv.ModRevision, compactRev)) {
			out = append(out, ev) // shared with the history: never modified
		} else {
			out = append(out, &mvccpb.Event{Type: ev.Type, Kv: ev.Kv})
		}
	}
	return out
}

// prevKVReadable reports whether etcd, compacted at compactRev, sends the
// prev_kv of an event of revision rev. etcd fills prev_kv when it sends an
// event, not when it stores it: its send loop (api/v3rpc/watch.go) reads
// the key at rev-1, a read that fails below the compaction revision, and
// then sends the event without prev_kv. So must the proxy, whose history
// still holds the previous version: kube-apiserver relists on an update
// without prev_kv, as it would through etcd.
func prevKVReadable(rev, compactRev int64) bool {
	return rev > compactRev // rev-1 >= compactRev
}

// sendFragments is etcd's (api/v3rpc/watch.go): a response over the request
// size limit with more than one event is split into responses of at most
// that size, all but the last marked fragment.
func sendFragments(wr *pb.WatchResponse, maxBytes int, send func(*pb.WatchResponse) error) error {
	if proto.Size(wr) < maxBytes || len(wr.Events) < 2 {
		return send(wr)
	}
	idx := 0
	for {
		cur := &pb.WatchResponse{
			Header:          wr.Header,
			WatchId:         wr.WatchId,
			Created:         wr.Created,
			Canceled:        wr.Canceled,
			CompactRevision: wr.CompactRevision,
			CancelReason:    wr.CancelReason,
			Fragment:        true,
			Events:          make([]*mvccpb.Event, 0),
		}
		for _, ev := range wr.Events[idx:] {
			cur.Events = append(cur.Events, ev)
			if len(cur.Events) > 1 && proto.Size(cur) >= maxBytes {
				cur.Events = cur.Events[:len(cur.Events)-1]
				break
			}
			idx++
		}
		if idx == len(wr.Events) {
			cur.Fragment = false
		}
		if err := send(cur); err != nil {
			return err
		}
		if !cur.Fragment {
			return nil
		}
	}
}
