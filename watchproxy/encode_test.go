package watchproxy

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// randInt64 returns 0, a small, a large, or a negative value: the varint
// lengths proto3 distinguishes.
func randInt64(rng *rand.Rand) int64 {
	switch rng.IntN(5) {
	case 0:
		return 0
	case 1:
		return rng.Int64N(128)
	case 2:
		return rng.Int64()
	case 3:
		return -1 - rng.Int64N(1000)
	default:
		return math.MaxInt64
	}
}

func randBytes(rng *rand.Rand, max int) []byte {
	if rng.IntN(4) == 0 {
		return nil
	}
	b := make([]byte, rng.IntN(max+1))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

func randKV(rng *rand.Rand, maxValue int) *mvccpb.KeyValue {
	return &mvccpb.KeyValue{
		Key:            randBytes(rng, 40),
		CreateRevision: randInt64(rng),
		ModRevision:    randInt64(rng),
		Version:        randInt64(rng),
		Value:          randBytes(rng, maxValue),
		Lease:          randInt64(rng),
	}
}

func randEvents(rng *rand.Rand, n, maxValue int) []*mvccpb.Event {
	evs := make([]*mvccpb.Event, n)
	for i := range evs {
		ev := &mvccpb.Event{Type: mvccpb.Event_EventType(rng.IntN(2)), Kv: randKV(rng, maxValue)}
		if rng.IntN(3) > 0 {
			ev.PrevKv = randKV(rng, maxValue)
		}
		evs[i] = ev
	}
	return evs
}

// randResponse is any WatchResponse the Watch service can send: events,
// progress, created, canceled (with a reason or a compaction), fragments.
func randResponse(rng *rand.Rand) *pb.WatchResponse {
	r := &pb.WatchResponse{WatchId: randInt64(rng)}
	if rng.IntN(5) > 0 {
		r.Header = &pb.ResponseHeader{
			ClusterId: rng.Uint64() >> rng.IntN(64),
			MemberId:  rng.Uint64() >> rng.IntN(64),
			Revision:  randInt64(rng),
			RaftTerm:  rng.Uint64() >> rng.IntN(64),
		}
	}
	switch rng.IntN(5) {
	case 0: // created, maybe refused
		r.Created = true
		if rng.IntN(2) == 0 {
			r.Canceled, r.CancelReason = true, "mvcc: duplicate watch ID — ✗"
		}
	case 1: // canceled
		r.Canceled = true
		if rng.IntN(2) == 0 {
			r.CompactRevision = randInt64(rng)
		} else {
			r.CancelReason = string(randBytes(rng, 10)) // made valid UTF-8 by the caller
		}
	case 2: // progress
	default: // events, maybe a fragment
		r.Fragment = rng.IntN(3) == 0
		r.Events = randEvents(rng, rng.IntN(6), 300)
	}
	return r
}

// TestEncodedResponsesAreProtoMarshal: a response's own fields followed by
// its events' pre-encoded entries are the bytes proto.Marshal gives for
// the response, for every kind of response, and an event's entry without
// its prev_kv is that of the event stripped of it.
func TestEncodedResponsesAreProtoMarshal(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 5000 {
		r := randResponse(rng)
		if !validUTF8(r.CancelReason) {
			r.CancelReason = "etcdserver: permission denied"
		}
		want, err := proto.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		got := appendFields(nil, r)
		for _, ev := range r.Events {
			got = appendEvent(got, ev)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("response %d: %v\nencoded %x\nproto.Marshal %x", i, r, got, want)
		}

		// The shared encodings, with and without prev_kv.
		for _, prevKV := range []bool{true, false} {
			var ee encodedEvents
			ee.encode(r.Events, prevKV)
			bare := &pb.WatchResponse{Header: r.Header, WatchId: r.WatchId, Fragment: r.Fragment}
			for _, ev := range r.Events {
				if !prevKV {
					ev = &mvccpb.Event{Type: ev.Type, Kv: ev.Kv}
				}
				bare.Events = append(bare.Events, ev)
			}
			want, _ := proto.Marshal(bare)
			pieces := []mem.Buffer{wirecodec.Piece(appendFields(nil, bare))}
			if len(r.Events) > 0 {
				if all := append(appendFields(nil, bare), ee.all.ReadOnlyData()...); !bytes.Equal(all, want) {
					t.Fatalf("response %d (prev_kv %v): all entries give %x, want %x", i, prevKV, all, want)
				}
			}
			pieces = append(pieces, ee.each...)
			if got := wirecodec.NewEncoded(watchResponseType, pieces).Bytes(); !bytes.Equal(got, want) {
				t.Fatalf("response %d (prev_kv %v): entries give %x, want %x", i, prevKV, got, want)
			}
		}
	}
}

// validUTF8 reports whether proto.Marshal accepts s in a string field.
func validUTF8(s string) bool {
	_, err := proto.Marshal(&pb.WatchResponse{CancelReason: s})
	return err == nil
}

// captureStream records the bytes of every message sent.
type captureStream struct {
	pb.Watch_WatchServer
	sent [][]byte
}

func (c *captureStream) SendMsg(m any) error {
	e, ok := m.(*wirecodec.Encoded)
	if !ok {
		return fmt.Errorf("sent a %T, want pre-encoded", m)
	}
	c.sent = append(c.sent, e.Bytes())
	return nil
}

// TestEncodedSendsAreEtcds: the pre-encoded event sends are byte for byte
// the legacy ones (proto.Marshal of what sendFragments sends), fragments
// included: same split points, same fragment flags, whatever the event
// sizes against the limit.
func TestEncodedSendsAreEtcds(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	fragmented := 0
	for i := range 3000 {
		evs := randEvents(rng, 1+rng.IntN(8), 2000)
		cr := &pb.WatchCreateRequest{PrevKv: rng.IntN(2) == 0, Fragment: rng.IntN(4) > 0}
		w := newWatcher(randInt64(rng), cr, []byte{}, []byte{}) // every key, even empty
		h := &pb.ResponseHeader{ClusterId: 7, MemberId: 8, Revision: rng.Int64N(1 << 40), RaftTerm: 9}
		maxBytes := 1 + rng.IntN(6000)

		cs := &captureStream{}
		st := &stream{s: &Server{maxBytes: maxBytes}, gs: cs}
		var ee encodedEvents
		ee.encode(evs, w.prevKV)
		entries, n := w.matchingEncoded(nil, evs, func() *encodedEvents { return &ee })
		if n != len(evs) {
			t.Fatalf("matched %d of %d events of a watcher of every key", n, len(evs))
		}
		if err := st.sendEntries(w, wirecodec.Piece(appendMessage(nil, fieldHeader, h)), entries); err != nil {
			t.Fatal(err)
		}

		var want [][]byte
		resp := &pb.WatchResponse{Header: h, WatchId: w.id, Events: w.matching(nil, evs, math.MinInt64)} // random revisions: none compacted
		record := func(r *pb.WatchResponse) error {
			b, err := proto.Marshal(r)
			want = append(want, b)
			return err
		}
		if w.fragment {
			_ = sendFragments(resp, maxBytes, record)
		} else {
			_ = record(resp)
		}
		if len(cs.sent) != len(want) {
			t.Fatalf("case %d (limit %d, fragment %v): %d responses, want %d", i, maxBytes, w.fragment, len(cs.sent), len(want))
		}
		for j := range want {
			if !bytes.Equal(cs.sent[j], want[j]) {
				t.Fatalf("case %d (limit %d, fragment %v): response %d is\n%x, want\n%x", i, maxBytes, w.fragment, j, cs.sent[j], want[j])
			}
		}
		if len(want) > 1 {
			fragmented++
		}
	}
	if fragmented < 500 {
		t.Fatalf("only %d of the cases were fragmented", fragmented)
	}
}

// TestMatchingEncodedTakesOnlyWantedEvents: a watcher's entries are those
// of the events in its range that its filters keep, in order, and a
// revision it wants nothing of is never encoded.
func TestMatchingEncodedTakesOnlyWantedEvents(t *testing.T) {
	evs := []*mvccpb.Event{
		{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("a")}},
		{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte("b")}},
		{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("c")}},
	}
	var ee encodedEvents
	ee.encode(evs, true)
	for _, tc := range []struct {
		name string
		cr   *pb.WatchCreateRequest
		want []int // indexes of the events sent
	}{
		{"one key", &pb.WatchCreateRequest{Key: []byte("b")}, []int{1}},
		{"range", &pb.WatchCreateRequest{Key: []byte("b"), RangeEnd: []byte("d")}, []int{1, 2}},
		{"no put", &pb.WatchCreateRequest{Key: []byte("a"), RangeEnd: []byte{0}, Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NOPUT}}, []int{1}},
		{"no delete", &pb.WatchCreateRequest{Key: []byte("a"), RangeEnd: []byte{0}, Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NODELETE}}, []int{0, 2}},
		{"nothing", &pb.WatchCreateRequest{Key: []byte("x")}, nil},
		{"all", &pb.WatchCreateRequest{Key: []byte("a"), RangeEnd: []byte{0}}, []int{0, 1, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			end := tc.cr.RangeEnd
			if len(end) == 1 && end[0] == 0 {
				end = []byte{}
			}
			w := newWatcher(1, tc.cr, tc.cr.Key, end)
			encoded := false
			got, n := w.matchingEncoded(nil, evs, func() *encodedEvents { encoded = true; return &ee })
			if n != len(tc.want) {
				t.Fatalf("%d events, want %d", n, len(tc.want))
			}
			if encoded != (n > 0) {
				t.Fatalf("encoded %v for %d events wanted", encoded, n)
			}
			var want []byte
			for _, i := range tc.want {
				want = append(want, ee.each[i].ReadOnlyData()...)
			}
			if b := mem.BufferSlice(got).Materialize(); !bytes.Equal(b, want) {
				t.Fatalf("entries %x, want %x", b, want)
			}
		})
	}
}

// TestEncodingsSharedAndBounded: a revision is encoded once for every
// reader of the same history, again only for another history's events,
// and the cache drops its oldest revisions beyond its bounds of
// revisions and bytes.
func TestEncodingsSharedAndBounded(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	batch := func(rev int64) revtree.Batch { return revtree.Batch{Rev: rev, Events: randEvents(rng, 2, 100)} }

	c := newEncodings(1<<30, 4, nil)
	b := batch(1)
	e := c.lookup(b)
	if c.lookup(b) != e {
		t.Fatal("a second lookup of the same revision made a new entry")
	}
	full := c.encoded(e, true)
	if c.encoded(c.lookup(b), true) != full {
		t.Fatal("the events were encoded twice")
	}
	if bare := c.encoded(e, false); bare == full || bare.all.Len() >= full.all.Len() {
		t.Fatal("the events without prev_kv share the encoding with it")
	}
	reloaded := revtree.Batch{Rev: 1, Events: append([]*mvccpb.Event(nil), b.Events...)}
	if c.lookup(reloaded) == e {
		t.Fatal("another history's events took the old entry")
	}

	noPrev := revtree.Batch{Rev: 2, Events: []*mvccpb.Event{{Kv: &mvccpb.KeyValue{Key: []byte("k")}}}}
	if e := c.lookup(noPrev); c.encoded(e, false) != c.encoded(e, true) {
		t.Fatal("events without prev_kv encoded twice")
	}

	for rev := int64(3); rev <= 10; rev++ {
		c.lookup(batch(rev))
	}
	if len(c.queue) != 4 || len(c.byRev) != 4 || c.byRev[7] == nil || c.byRev[6] != nil {
		t.Fatalf("held %d entries (%d revisions), want the newest 4", len(c.queue), len(c.byRev))
	}

	// The byte bound: each entry encoded is accounted, and the oldest go.
	c = newEncodings(3000, 1000, nil)
	var total int64
	for rev := int64(1); rev <= 50; rev++ {
		e := c.lookup(batch(rev))
		c.encoded(e, true)
		c.encoded(e, false)
		total += e.bytes
		if c.bytes > c.maxBytes {
			t.Fatalf("holding %d bytes, over the bound of %d", c.bytes, c.maxBytes)
		}
		var sum int64
		for _, e := range c.queue {
			sum += e.bytes
		}
		if sum != c.bytes {
			t.Fatalf("accounted %d bytes, the entries hold %d", c.bytes, sum)
		}
	}
	if total <= c.maxBytes || len(c.queue) == 50 {
		t.Fatalf("nothing dropped: %d bytes encoded, %d entries held", total, len(c.queue))
	}
}

// TestWatchStreamsShareOneEncoding: the watchers of two streams, one with
// prev_kv and one without, are sent a revision's events from the one
// entry of the revision, each in the form it asked for.
func TestWatchStreamsShareOneEncoding(t *testing.T) {
	w := newWorld(t)
	w.apply(put("k", "1")) // 2
	withPrev, without := w.watch(), w.watch()
	checkCreated(t, withPrev.create(t, &pb.WatchCreateRequest{Key: []byte("k"), PrevKv: true}), 0, 2)
	checkCreated(t, without.create(t, &pb.WatchCreateRequest{Key: []byte("k")}), 0, 2)
	rev := w.apply(put("k", "2")) // 3

	want := w.applied[rev]
	if got := withPrev.eventsOf(t, 0, rev); len(got) != 1 || !proto.Equal(got[0], want[0]) {
		t.Fatalf("with prev_kv: got %v, want %v", got, want)
	}
	bare := &mvccpb.Event{Type: want[0].Type, Kv: want[0].Kv}
	if got := without.eventsOf(t, 0, rev); len(got) != 1 || !proto.Equal(got[0], bare) {
		t.Fatalf("without prev_kv: got %v, want %v", got, bare)
	}

	c := w.srv.enc
	c.mu.Lock()
	defer c.mu.Unlock()
	entries := 0
	for _, e := range c.queue {
		if e.rev == rev {
			entries++
		}
	}
	if entries != 1 || c.byRev[rev] == nil {
		t.Fatalf("%d entries of revision %d, want 1 shared by both streams", entries, rev)
	}
}

// TestEncodingsConcurrentReaders: streams reading the same revisions at
// once get one entry and one encoding of each (run with -race).
func TestEncodingsConcurrentReaders(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	batches := make([]revtree.Batch, 50)
	for i := range batches {
		batches[i] = revtree.Batch{Rev: int64(i) + 2, Events: randEvents(rng, 1+rng.IntN(3), 200)}
	}
	c := newEncodings(1<<30, 1000, nil)
	const readers = 8
	got := make([][]*encodedEvents, readers)
	var wg sync.WaitGroup
	for r := range readers {
		wg.Go(func() {
			for i, b := range batches {
				got[r] = append(got[r], c.encoded(c.lookup(b), (r+i)%2 == 0))
			}
		})
	}
	wg.Wait()
	for r := 2; r < readers; r++ {
		for i := range batches {
			if got[r][i] != got[r%2][i] {
				t.Fatalf("reader %d got another encoding of revision %d", r, batches[i].Rev)
			}
		}
	}
}
