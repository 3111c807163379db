package watchproxy

import (
	"sync"
	"unsafe"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Events go out pre-encoded: every event of the history is encoded once,
// with and without its prev_kv, and those bytes are sent to every watcher
// of every stream (wirecodec). A WatchResponse is its fields in field
// number order, as proto.Marshal writes them: the header and the other
// per-watcher fields, then one length-delimited entry per event (field
// 11), so pre-encoded entries behind a response's own fields are the bytes
// proto.Marshal gives for the whole response.

// The WatchResponse fields (rpc.proto).
const (
	fieldHeader          protowire.Number = 1
	fieldWatchID         protowire.Number = 2
	fieldCreated         protowire.Number = 3
	fieldCanceled        protowire.Number = 4
	fieldCompactRevision protowire.Number = 5
	fieldCancelReason    protowire.Number = 6
	fieldFragment        protowire.Number = 7
	fieldEvents          protowire.Number = 11
)

var watchResponseType = (&pb.WatchResponse{}).ProtoReflect().Type()

// fragmentPiece is the fragment field set, as every fragment but the last
// carries it.
var fragmentPiece = wirecodec.Piece(appendBool(nil, fieldFragment, true))

// appendFields appends r's fields but its events, as proto.Marshal writes
// them: the events go after.
func appendFields(b []byte, r *pb.WatchResponse) []byte {
	if r.Header != nil {
		b = appendMessage(b, fieldHeader, r.Header)
	}
	b = appendInt(b, fieldWatchID, r.WatchId)
	b = appendBool(b, fieldCreated, r.Created)
	b = appendBool(b, fieldCanceled, r.Canceled)
	b = appendInt(b, fieldCompactRevision, r.CompactRevision)
	if r.CancelReason != "" {
		b = protowire.AppendTag(b, fieldCancelReason, protowire.BytesType)
		b = protowire.AppendString(b, r.CancelReason)
	}
	return appendBool(b, fieldFragment, r.Fragment)
}

// appendEvent appends ev as one entry of the events field.
func appendEvent(b []byte, ev *mvccpb.Event) []byte {
	return appendMessage(b, fieldEvents, ev)
}

func appendMessage(b []byte, num protowire.Number, m proto.Message) []byte {
	b = protowire.AppendTag(b, num, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(proto.Size(m)))
	// Not UseCachedSize: the events are shared with every other stream,
	// whose legacy sends size them too.
	b, err := proto.MarshalOptions{}.MarshalAppend(b, m)
	if err != nil {
		// Only a message with invalid UTF-8 in a string field fails, and
		// etcd's events and headers have none.
		panic("watchproxy: encoding a " + string(m.ProtoReflect().Descriptor().FullName()) + ": " + err.Error())
	}
	return b
}

// appendInt appends a proto3 int64 field; zero is not written.
func appendInt(b []byte, num protowire.Number, v int64) []byte {
	if v == 0 {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.VarintType)
	return protowire.AppendVarint(b, uint64(v))
}

// appendBool appends a proto3 bool field; false is not written.
func appendBool(b []byte, num protowire.Number, v bool) []byte {
	if !v {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.VarintType)
	return protowire.AppendVarint(b, 1)
}

// revEvents is one revision of the history with its events' encodings,
// shared by every stream. Its fields are set at creation, but for the
// encodings, each computed once, on first use.
type revEvents struct {
	rev    int64
	events []*mvccpb.Event // the history's, which identify the entry
	// noPrev: no event has a prev_kv, so bare is full.
	noPrev bool
	// full is with each event's prev_kv; bare without, for watchers that
	// did not ask for it.
	full, bare encodedEvents

	// Guarded by encodings.mu:
	bytes  int64 // of the events the entry keeps alive, and of its encodings so far
	queued bool  // in encodings.queue, and counted in its bytes
}

// encodedEvents is the events of one revision as entries of the events
// field, in order.
type encodedEvents struct {
	once sync.Once
	// Set by once:
	all  mem.Buffer   // every entry, for a watcher that wants them all
	each []mem.Buffer // the i-th event's entry: slices of all's bytes
}

// encode sets the entries of events, without their prev_kv unless
// prevKV, and returns the bytes it holds.
func (ee *encodedEvents) encode(events []*mvccpb.Event, prevKV bool) int64 {
	var b []byte
	ends := make([]int, len(events))
	for i, ev := range events {
		if !prevKV && ev.PrevKv != nil {
			ev = &mvccpb.Event{Type: ev.Type, Kv: ev.Kv}
		}
		b = appendEvent(b, ev)
		ends[i] = len(b)
	}
	ee.all = wirecodec.Piece(b)
	ee.each = make([]mem.Buffer, len(events))
	start := 0
	for i, end := range ends {
		ee.each[i] = wirecodec.Piece(b[start:end:end])
		start = end
	}
	// The pieces' boxes (16 B each) and their slices (24 B) besides the
	// bytes.
	return int64(cap(b)) + int64(len(events))*(16+24+16)
}

// Defaults of the encodings cache: enough for the revisions every stream
// reads at the head, and for a pass of lagging ones, whatever the load.
const (
	defaultEncodedBytes = 32 << 20
	defaultEncodedRevs  = 2 * maxRevisionsPerPass
)

// encodings is the server's cache of the newest revisions' event
// encodings: the streams that read the same revisions share one encoding.
// It holds at most maxRevs revisions and maxBytes, dropping the oldest.
// The bytes count the encodings and the events, which an entry keeps alive
// even once the history dropped them. A stream still sending a dropped
// entry keeps it until the send is over, then the garbage collector takes
// it.
type encodings struct {
	maxBytes int64
	maxRevs  int
	m        *Metrics

	mu    sync.Mutex
	byRev map[int64]*revEvents // the newest entry of each revision; guarded by mu
	queue []*revEvents         // every entry held, oldest first; guarded by mu
	bytes int64                // the encoded bytes of queue's entries; guarded by mu
}

func newEncodings(maxBytes int64, maxRevs int, m *Metrics) *encodings {
	return &encodings{maxBytes: maxBytes, maxRevs: maxRevs, m: m, byRev: map[int64]*revEvents{}}
}

// lookup returns the entry of the revision of b, created (without
// encodings) unless held.
func (c *encodings) lookup(b revtree.Batch) *revEvents {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.byRev[b.Rev]; e != nil && sameEvents(e.events, b.Events) {
		return e
	}
	// New, or the history was reloaded since and the revision's events
	// are other slices (the same events, unless etcd's history changed,
	// which ends the streams that read the old ones).
	e := &revEvents{rev: b.Rev, events: b.Events, noPrev: true, queued: true}
	for _, ev := range b.Events {
		if ev.PrevKv != nil {
			e.noPrev = false
		}
		e.bytes += eventBytes(ev)
	}
	c.byRev[b.Rev] = e
	c.queue = append(c.queue, e)
	c.bytes += e.bytes
	c.m.encodedBytes(e.bytes)
	c.trimLocked()
	return e
}

// eventBytes estimates the memory of an event: its keys and values, and
// its structs.
func eventBytes(ev *mvccpb.Event) int64 {
	n := int64(len(ev.Kv.Key) + len(ev.Kv.Value) + 200)
	if ev.PrevKv != nil {
		n += int64(len(ev.PrevKv.Key) + len(ev.PrevKv.Value) + 100)
	}
	return n
}

// sameEvents reports whether a and b are the same slice of the history.
func sameEvents(a, b []*mvccpb.Event) bool {
	return len(a) == len(b) && unsafe.SliceData(a) == unsafe.SliceData(b)
}

// encoded returns the entries of e's events, with their prev_kv or not,
// encoding them if no stream did yet.
func (c *encodings) encoded(e *revEvents, prevKV bool) *encodedEvents {
	ee := &e.full
	if !prevKV && !e.noPrev {
		ee = &e.bare
	}
	ee.once.Do(func() {
		n := ee.encode(e.events, prevKV || e.noPrev)
		c.mu.Lock()
		defer c.mu.Unlock()
		e.bytes += n
		if e.queued {
			c.bytes += n
			c.m.encodedBytes(n)
			c.trimLocked()
		}
	})
	return ee
}

// trimLocked drops the oldest entries while over a bound.
func (c *encodings) trimLocked() {
	for len(c.queue) > 0 && (len(c.queue) > c.maxRevs || c.bytes > c.maxBytes) {
		e := c.queue[0]
		c.queue[0] = nil
		c.queue = c.queue[1:]
		e.queued = false
		c.bytes -= e.bytes
		c.m.encodedBytes(-e.bytes)
		if c.byRev[e.rev] == e {
			delete(c.byRev, e.rev)
		}
	}
}
