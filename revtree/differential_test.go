package revtree_test

// Differential test: revtree against etcd v3.7.3's own MVCC storage engine.
//
// The oracle is a real, in-process etcd watchable mvcc store (bbolt backend
// in a temp dir, FakeLessor). A seeded random workload writes to it; one
// watch over the whole keyspace feeds every event, revision by revision, into
// several revtree stores (one per B-tree degree), which are reset at revision
// 1, etcd's empty initial revision, so every revision etcd still retains is
// also retained by revtree; or, in half the runs, which load the keyspace
// etcd holds after a first few writes and a compaction there, as the proxy
// loads it (packed into slabs). After every write, random RangeRequests at
// random revisions are answered by etcd's own Range (etcdserver/txn.Range,
// the code behind the KV.Range RPC) and by revtree, and must be identical:
// same error, or proto.Equal responses (Kvs in order, Count, More,
// Header.Revision); revtree's response encoded from the stored encodings,
// and in the pieces that a proxy sends, is byte for byte proto.Marshal's of
// etcd's, and stays so while the stores move on.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/pkg/v3/traceutil"
	"go.etcd.io/etcd/server/v3/etcdserver/txn"
	"go.etcd.io/etcd/server/v3/lease"
	"go.etcd.io/etcd/server/v3/storage/backend"
	"go.etcd.io/etcd/server/v3/storage/mvcc"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// diffDegrees are the B-tree degrees every workload is mirrored into.
var diffDegrees = []int{2, 3, 8, 32}

// diffKeys is the small key space: keys that are prefixes of each other,
// keys with 0x00 and 0xff bytes, and the extremes of the keyspace.
var diffKeys = [][]byte{
	[]byte("\x00"), []byte("\x00\x00"), []byte("\x00\x01"), []byte("\x01"),
	[]byte("a"), []byte("a\x00"), []byte("a\x00\x00"), []byte("a\x00b"),
	[]byte("a\xff"), []byte("a\xff\xff"), []byte("aa"), []byte("ab"),
	[]byte("abc"), []byte("abd"), []byte("b"), []byte("b\x00"),
	[]byte("ba"), []byte("foo"), []byte("foo/"), []byte("foo/a"),
	[]byte("foo/a/b"), []byte("foo/b"), []byte("foo0"), []byte("foo\xff"),
	[]byte("fop"), []byte("k1"), []byte("k10"), []byte("k2"),
	[]byte("k20"), []byte("k3"), []byte("m"), []byte("m\xff"),
	[]byte("mm"), []byte("z"), []byte("zz"), []byte("\xfe"),
	[]byte("\xff"), []byte("\xff\x00"), []byte("\xff\xff"), []byte("\xff\xff\xff"),
}

// diffBounds are extra range boundaries that are not keys.
var diffBounds = [][]byte{
	[]byte("0"), []byte("a\x01"), []byte("a\x00a"), []byte("ac"), []byte("foo/\xff"),
	[]byte("k"), []byte("y"), []byte("\xff\xff\xff\xff"), []byte("\x00\x00\x00"),
}

var diffValues = [][]byte{nil, []byte("v"), []byte("a"), []byte("b"), []byte("zz"), []byte("\x00"), []byte("\xff")}

var diffLimits = []int64{0, 0, 0, 1, 1, 2, 3, 5, 8, 39, 40, 41, 1000, -1, -7, math.MaxInt64, math.MinInt64}

// source is the randomness the harness draws from: a seeded PRNG in the
// differential test, the fuzzer's bytes in the fuzz target.
type source interface {
	IntN(n int) int
}

// byteSource turns fuzz input into choices; it returns 0 once exhausted.
type byteSource struct {
	b []byte
	i int
}

func (s *byteSource) IntN(n int) int {
	if n <= 1 {
		return 0
	}
	v := 0
	for m := n - 1; m > 0; m >>= 8 {
		if s.i < len(s.b) {
			v = v<<8 | int(s.b[s.i])
			s.i++
		} else {
			v <<= 8
		}
	}
	return v % n
}

func (s *byteSource) done() bool { return s.i >= len(s.b) }

// harness is one etcd mvcc store plus the revtree stores mirroring it.
type harness struct {
	t       testing.TB
	lg      *zap.Logger
	kv      mvcc.WatchableKV
	ws      mvcc.WatchStream
	stores  []*revtree.Store
	degrees []int // degrees[i] is the B-tree degree of stores[i]
	opts    revtree.RangeOptions

	rev        int64 // etcd's current revision, as seen by the harness
	compactRev int64 // last compaction revision (0: none)
	events     map[int64][]*mvccpb.Event
	compares   int
	ops        []string // the last writes, for failure messages
	errs       int      // comparisons where both sides returned the same error

	// sent are the pieces of some responses checked before, with the
	// bytes they must still hold (checkSent): the last maxSent/2, and one
	// in 64 of those for the 32 times longer (over many writes).
	sent [maxSent]sentPieces
	kept int // responses kept so far
}

// maxSent is how many responses' pieces a harness keeps checking.
const maxSent = 32

// sentPieces are the pieces of a response and the bytes they make.
type sentPieces struct {
	req    *pb.RangeRequest
	pieces [][]byte
	want   []byte
}

func newHarness(t testing.TB, degrees []int) *harness {
	// etcd reports broken invariants with lg.Fatal, which exits even on a
	// no-op logger: make it panic instead so the test can report the ops.
	lg := zap.NewNop().WithOptions(zap.WithFatalHook(zapcore.WriteThenPanic))
	be := backend.NewDefaultBackend(lg, filepath.Join(t.TempDir(), "db"))
	kv := mvcc.New(lg, be, &lease.FakeLessor{}, mvcc.StoreConfig{CompactionBatchLimit: 1 << 20})
	ws := kv.NewWatchStream()
	t.Cleanup(func() {
		ws.Close()
		kv.Close()
		be.Close()
	})
	// Watch everything, as v3rpc does for key "\x00", range_end "\x00":
	// key []byte{0} and a non-nil empty end (nil would mean a single key).
	// startRev 0 makes the watcher synced: it gets every revision after
	// the current one, synchronously from each write's End.
	if _, err := ws.Watch(context.Background(), 0, []byte{0}, []byte{}, 0); err != nil {
		t.Fatalf("watch: %v", err)
	}
	h := &harness{
		t:      t,
		lg:     lg,
		kv:     kv,
		ws:     ws,
		opts:   revtree.RangeOptions{KeysOnlyWithoutLease: true},
		rev:    kv.Rev(),
		events: make(map[int64][]*mvccpb.Event),
	}
	if h.rev != 1 {
		t.Fatalf("fresh etcd store at revision %d, want 1", h.rev)
	}
	for i, d := range degrees {
		st := revtree.New(d)
		if i%2 == 1 {
			// Every read without a limit goes through the flattened
			// ranges too, not only the large ones.
			st.SetMinFlatKVsForTest(1)
		}
		st.Reset(h.rev, nil, 0)
		h.stores = append(h.stores, st)
		h.degrees = append(h.degrees, d)
	}
	return h
}

func pick[T any](r source, xs []T) T { return xs[r.IntN(len(xs))] }

func (h *harness) randKey(r source) []byte { return pick(r, diffKeys) }

func (h *harness) randBound(r source) []byte {
	if r.IntN(4) == 0 {
		return pick(r, diffBounds)
	}
	return pick(r, diffKeys)
}

func (h *harness) randValue(r source) []byte {
	if r.IntN(4) == 0 {
		v := make([]byte, 1+r.IntN(6))
		for i := range v {
			v[i] = byte(r.IntN(256))
		}
		return v
	}
	return pick(r, diffValues)
}

func (h *harness) randLease(r source) lease.LeaseID {
	switch r.IntN(10) {
	case 0, 1:
		return lease.LeaseID(1 + r.IntN(4))
	case 2:
		return lease.LeaseID(math.MaxInt64)
	}
	return lease.NoLease
}

// randDeleteRange returns a range for DeleteRange in mvcc's encoding: nil
// end is one key, a non-nil empty end is "from key".
func (h *harness) randDeleteRange(r source) (key, end []byte) {
	key = h.randKey(r)
	switch r.IntN(8) {
	case 0, 1, 2:
		return key, nil
	case 3:
		return key, []byte{} // from key (range_end "\x00" in the API)
	case 4:
		return key, mvccRangeEnd([]byte(clientv3.GetPrefixRangeEnd(string(key))))
	default:
		return key, h.randBound(r) // may be inverted: deletes nothing
	}
}

// mvccRangeEnd converts a range end from the API's encoding (nil: the key
// alone; "\x00": every key from the key on) to mvcc's (nil: the key alone;
// empty but not nil: every key from the key on), as etcd's txn.Range does
// before it reads mvcc.
func mvccRangeEnd(end []byte) []byte {
	if len(end) == 1 && end[0] == 0 {
		return []byte{}
	}
	return end
}

// step performs one random write (or compaction) on etcd and mirrors the
// resulting events (if any) into the revtree stores.
func (h *harness) step(r source) {
	defer h.recoverEtcd("write")
	switch op := r.IntN(100); {
	case op < 45: // single put
		w := h.write()
		w.put(h.randKey(r), h.randValue(r), h.randLease(r))
		w.end()
	case op < 60: // delete one key, often absent (no new revision)
		w := h.write()
		w.del(h.randKey(r), nil)
		w.end()
	case op < 66: // delete a range
		w := h.write()
		w.del(h.randDeleteRange(r))
		w.end()
	case op < 96: // multi-op txn: one revision, several events
		//
		// A key may be put several times and deleted after being put, but
		// never put after a delete covering it: etcd 3.7.3's mvcc loses
		// the put's revision from bbolt when it then compacts at exactly
		// that revision (keyIndex.doCompact stops in the tombstoned
		// generation, so the new generation's revision is not kept), and a
		// later Range hits lg.Fatal("range failed to find revision pair").
		// The Txn RPC cannot produce this: checkIntervals rejects a put
		// that overlaps a delete of the same Txn (ErrGRPCDuplicateKey).
		w := h.write()
		n := 2 + r.IntN(6)
		var last []byte
		var dels [][2][]byte
		for range n {
			key := h.randKey(r)
			if last != nil && r.IntN(3) == 0 {
				key = last // touch the same key again in this revision
			}
			last = key
			switch r.IntN(6) {
			case 0:
				w.del(key, nil)
				dels = append(dels, [2][]byte{key, nil})
			case 1:
				k, e := h.randDeleteRange(r)
				w.del(k, e)
				dels = append(dels, [2][]byte{k, e})
			default:
				if !deleted(key, dels) {
					w.put(key, h.randValue(r), h.randLease(r))
				}
			}
		}
		w.end()
	default:
		h.compact(r)
		return
	}
	h.sync()
}

// deleted reports whether key is in one of the mvcc delete ranges dels.
func deleted(key []byte, dels [][2][]byte) bool {
	for _, d := range dels {
		switch {
		case d[1] == nil:
			if bytes.Equal(key, d[0]) {
				return true
			}
		case len(d[1]) == 0:
			if bytes.Compare(key, d[0]) >= 0 {
				return true
			}
		default:
			if bytes.Compare(key, d[0]) >= 0 && bytes.Compare(key, d[1]) < 0 {
				return true
			}
		}
	}
	return false
}

// write is an etcd write txn that logs its operations.
type write struct {
	h   *harness
	w   mvcc.TxnWrite
	ops []string
}

func (h *harness) write() *write { return &write{h: h, w: h.kv.Write(traceutil.TODO())} }

func (w *write) put(key, value []byte, l lease.LeaseID) {
	w.ops = append(w.ops, fmt.Sprintf("put(%q,%q,lease=%d)", key, value, l))
	w.w.Put(key, value, l)
}

func (w *write) del(key, end []byte) {
	w.ops = append(w.ops, fmt.Sprintf("del(%q,%q,nilEnd=%v)", key, end, end == nil))
	w.w.DeleteRange(key, end)
}

func (w *write) end() {
	w.w.End()
	w.h.logOp(fmt.Sprintf("txn %v -> rev %d", w.ops, w.h.kv.Rev()))
}

func (h *harness) logOp(s string) {
	const keep = 60
	if len(h.ops) >= keep {
		h.ops = append(h.ops[:0], h.ops[len(h.ops)-keep/2:]...)
	}
	h.ops = append(h.ops, s)
}

// recoverEtcd turns a panic of etcd (see the fatal hook in newHarness) into
// a test failure listing the last writes.
func (h *harness) recoverEtcd(what string) {
	if p := recover(); p != nil {
		h.t.Fatalf("etcd panicked in %s: %v\nlast writes (compactRev %d):\n%s", what, p, h.compactRev, strings.Join(h.ops, "\n"))
	}
}

func (h *harness) compact(r source) {
	if h.rev <= h.compactRev || h.rev <= 1 {
		return
	}
	// Mostly a small step, so that a long window of revisions stays
	// readable; sometimes exactly the current revision.
	lo := max(h.compactRev+1, 1)
	rev := h.rev
	if r.IntN(4) > 0 {
		rev = lo + int64(r.IntN(int(h.rev-lo)/4+1))
	}
	h.logOp(fmt.Sprintf("compact(%d)", rev))
	ch, err := h.kv.Compact(traceutil.TODO(), rev)
	if err != nil {
		h.t.Fatalf("etcd compact %d (compactRev %d, rev %d): %v", rev, h.compactRev, h.rev, err)
	}
	if ch != nil {
		<-ch
	}
	h.compactRev = rev
	for _, st := range h.stores {
		st.Compact(rev)
	}
}

// load writes most keys in a few revisions, compacts etcd at the last, and
// resets every store with etcd's keyspace there, as the proxy loads it:
// packed into slabs, which the writes after it rewrite, sweep and
// evacuate. Values are larger than the writes', so that the keyspace
// takes several slabs.
func (h *harness) load(r source) {
	for range 1 + r.IntN(3) {
		w := h.write()
		for _, k := range diffKeys {
			if r.IntN(4) > 0 {
				v := make([]byte, r.IntN(300))
				for i := range v {
					v[i] = byte(r.IntN(256))
				}
				w.put(k, v, h.randLease(r))
			}
		}
		w.end()
	}
	cur := h.kv.Rev()
	for got := h.rev; got < cur; {
		select {
		case wr := <-h.ws.Chan():
			if len(wr.Events) > 0 {
				got = wr.Events[len(wr.Events)-1].Kv.ModRevision
			}
		case <-time.After(10 * time.Second):
			h.t.Fatalf("no watch response for revisions (%d, %d]", got, cur)
		}
	}
	h.logOp(fmt.Sprintf("load(%d)", cur))
	ch, err := h.kv.Compact(traceutil.TODO(), cur)
	if err != nil {
		h.t.Fatalf("etcd compact %d: %v", cur, err)
	}
	<-ch
	rr, err := h.kv.Range(context.Background(), []byte{0}, []byte{}, mvcc.RangeOptions{Rev: cur})
	if err != nil {
		h.t.Fatalf("etcd range at %d: %v", cur, err)
	}
	for _, st := range h.stores {
		st.Reset(cur, rr.KVs, cur)
	}
	h.rev, h.compactRev = cur, cur
}

// sync reads the watch responses of every revision etcd made since the last
// sync and applies them to the revtree stores, one Apply per revision.
func (h *harness) sync() {
	cur := h.kv.Rev()
	var evs []*mvccpb.Event
	for got := h.rev; got < cur; {
		select {
		case wr := <-h.ws.Chan():
			if wr.CompactRevision != 0 {
				h.t.Fatalf("watch compacted at %d", wr.CompactRevision)
			}
			evs = append(evs, wr.Events...)
			if len(wr.Events) > 0 {
				got = wr.Events[len(wr.Events)-1].Kv.ModRevision
			}
		case <-time.After(10 * time.Second):
			h.t.Fatalf("no watch response for revisions (%d, %d]", got, cur)
		}
	}
	for len(evs) > 0 {
		rev := evs[0].Kv.ModRevision
		n := 1
		for n < len(evs) && evs[n].Kv.ModRevision == rev {
			n++
		}
		h.apply(rev, evs[:n])
		evs = evs[n:]
	}
	if h.rev != cur {
		h.t.Fatalf("after sync at revision %d, etcd is at %d", h.rev, cur)
	}
}

func (h *harness) apply(rev int64, evs []*mvccpb.Event) {
	if rev != h.rev+1 {
		h.t.Fatalf("watch delivered revision %d after %d", rev, h.rev)
	}
	h.events[rev] = evs
	// The key state before this revision, from etcd (rev-1 is never
	// compacted here: compaction is at most at the current revision).
	before := make(map[string]*mvccpb.KeyValue)
	for _, ev := range evs {
		if _, ok := before[string(ev.Kv.Key)]; ok {
			continue
		}
		rr, err := h.kv.Range(context.Background(), ev.Kv.Key, nil, mvcc.RangeOptions{Rev: rev - 1})
		if err != nil {
			h.t.Fatalf("etcd range %q at %d: %v", ev.Kv.Key, rev-1, err)
		}
		var prev *mvccpb.KeyValue
		if len(rr.KVs) > 0 {
			prev = rr.KVs[0]
		}
		before[string(ev.Kv.Key)] = prev
	}
	for i, st := range h.stores {
		cp := make([]*mvccpb.Event, len(evs))
		for j, ev := range evs {
			cp[j] = &mvccpb.Event{Type: ev.Type, Kv: ev.Kv}
		}
		out, err := st.Apply(rev, cp)
		if err != nil {
			h.t.Fatalf("degree %d: Apply(%d, %v): %v", h.degrees[i], rev, evs, err)
		}
		// PrevKv is the key's value before this event. For the first event
		// of a key in the revision that is etcd's value at rev-1, exactly what
		// etcd's watch puts in prev_kv. For a later event of the same key in
		// the same revision (only possible with mvcc directly: the Txn RPC
		// rejects duplicate keys), revtree reports the Txn's own earlier
		// write, while etcd's watch would repeat the value at rev-1.
		state := make(map[string]*mvccpb.KeyValue, len(before))
		for k, v := range before {
			state[k] = v
		}
		for _, ev := range out {
			want := state[string(ev.Kv.Key)]
			if !kvEqual(ev.PrevKv, want) {
				h.t.Fatalf("degree %d: revision %d event %v %q: PrevKv %v, want %v", h.degrees[i], rev, ev.Type, ev.Kv.Key, ev.PrevKv, want)
			}
			if ev.Type == mvccpb.PUT {
				state[string(ev.Kv.Key)] = ev.Kv
			} else {
				state[string(ev.Kv.Key)] = nil
			}
		}
	}
	h.rev = rev
}

func kvEqual(a, b *mvccpb.KeyValue) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return proto.Equal(a, b)
}

// randRequest builds a random RangeRequest covering every range form, limit,
// sort target x order, keys_only, count_only and revision filter.
func (h *harness) randRequest(r source) *pb.RangeRequest {
	req := &pb.RangeRequest{}
	switch r.IntN(11) {
	case 0, 1: // single key (nil range_end, as decoded from the wire)
		req.Key = h.randBound(r)
	case 2, 3, 4: // [key, end), possibly inverted or empty
		req.Key, req.RangeEnd = h.randBound(r), h.randBound(r)
	case 5: // prefix
		req.Key = h.randKey(r)
		req.RangeEnd = []byte(clientv3.GetPrefixRangeEnd(string(req.Key)))
	case 6: // from key
		req.Key, req.RangeEnd = h.randBound(r), []byte{0}
	case 7: // a range_end present on the wire but empty: etcd reads from key on
		req.Key, req.RangeEnd = h.randBound(r), []byte{}
	default: // whole keyspace
		req.Key, req.RangeEnd = []byte{0}, []byte{0}
	}

	lo, hi := h.compactRev-2, h.rev+2
	switch r.IntN(10) {
	case 0:
		req.Revision = 0
	case 1:
		req.Revision = -1 - int64(r.IntN(3))
	default:
		req.Revision = lo + int64(r.IntN(int(hi-lo+1)))
	}

	req.Limit = pick(r, diffLimits)
	if r.IntN(3) > 0 {
		req.SortOrder = pb.RangeRequest_SortOrder(r.IntN(3))
		req.SortTarget = pb.RangeRequest_SortTarget(r.IntN(5))
	}
	req.KeysOnly = r.IntN(4) == 0
	req.CountOnly = r.IntN(10) == 0

	filterRev := func() int64 {
		if r.IntN(3) == 0 {
			return 0
		}
		return int64(r.IntN(int(h.rev + 3)))
	}
	if r.IntN(3) == 0 {
		req.MinModRevision = filterRev()
		req.MaxModRevision = filterRev()
		req.MinCreateRevision = filterRev()
		req.MaxCreateRevision = filterRev()
	}
	return req
}

// cloneRangeRequest copies req with proto.Clone, then puts back a range_end
// that is present but empty. proto3 bytes have no presence, so Clone turns
// []byte{} into nil; txn.Range hands range_end to mvcc as it is, and mvcc
// reads an empty non-nil end as every key from the key on, a nil one as the
// key alone (see mvccRangeEnd).
func cloneRangeRequest(req *pb.RangeRequest) *pb.RangeRequest {
	c := proto.Clone(req).(*pb.RangeRequest)
	if req.RangeEnd != nil && len(req.RangeEnd) == 0 {
		c.RangeEnd = []byte{}
	}
	return c
}

// check answers req with etcd and with every revtree store and fails on
// any difference.
func (h *harness) check(req *pb.RangeRequest) {
	h.compares++
	defer h.recoverEtcd(fmt.Sprintf("Range(%v)", req))
	want, _, werr := txn.Range(context.Background(), h.lg, h.kv, cloneRangeRequest(req), true)
	for i, st := range h.stores {
		if st.Rev() != h.rev || st.CompactRev() != h.compactRev {
			h.t.Fatalf("degree %d: store at rev %d compact %d, etcd at rev %d compact %d",
				h.degrees[i], st.Rev(), st.CompactRev(), h.rev, h.compactRev)
		}
		sent := cloneRangeRequest(req)
		got, gerr := st.Range(sent, h.opts)
		if !proto.Equal(sent, req) {
			h.t.Fatalf("degree %d: Range modified its request: %v, was %v", h.degrees[i], sent, req)
		}
		if werr != nil || gerr != nil {
			if !errors.Is(mapErr(gerr), werr) || !errors.Is(werr, mapErr(gerr)) {
				h.t.Fatalf("degree %d, rev %d, compact %d: request %v\netcd error: %v\nrevtree: %v, %v",
					h.degrees[i], h.rev, h.compactRev, req, werr, gerr, got)
			}
			if i == 0 {
				h.errs++
			}
			continue
		}
		if !proto.Equal(got, want) {
			h.t.Fatalf("degree %d, rev %d, compact %d: request %v\netcd:    %v\nrevtree: %v",
				h.degrees[i], h.rev, h.compactRev, req, want, got)
		}
		if got.Kvs == nil {
			h.t.Fatalf("degree %d: nil Kvs for %v (etcd always returns a slice)", h.degrees[i], req)
		}
		v, err := st.View(req.Revision)
		if err != nil {
			h.t.Fatal(err)
		}
		h.checkEncoding(req, v.Result(cloneRangeRequest(req), h.opts), want)
	}
}

// checkEncoding verifies that the result encoded from the stored
// key-values' encodings is byte for byte etcd's response as protobuf
// encodes it, and that its size is computed right.
func (h *harness) checkEncoding(req *pb.RangeRequest, got *revtree.Result, want *pb.RangeResponse) {
	h.t.Helper()
	wantBytes, err := proto.Marshal(want)
	if err != nil {
		h.t.Fatal(err)
	}
	gotBytes, err := got.AppendTo(nil)
	if err != nil {
		h.t.Fatal(err)
	}
	if !bytes.Equal(gotBytes, wantBytes) {
		h.t.Fatalf("request %v: encoded\n%x\netcd's response encodes as\n%x", req, gotBytes, wantBytes)
	}
	if n := got.Size(); n != len(wantBytes) {
		h.t.Fatalf("request %v: Result.Size %d, encoded %d bytes", req, n, len(wantBytes))
	}
	pieces, err := got.AppendPieces(nil, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	if joined := bytes.Join(pieces, nil); !bytes.Equal(joined, wantBytes) {
		h.t.Fatalf("request %v: pieces\n%x\netcd's response encodes as\n%x", req, joined, wantBytes)
	}
	for _, p := range pieces {
		if len(p) == 0 {
			h.t.Fatalf("request %v: an empty piece in %q", req, pieces)
		}
	}
	sp := sentPieces{req: req, pieces: pieces, want: wantBytes}
	h.sent[h.kept%(maxSent/2)] = sp
	if h.kept%64 == 0 {
		h.sent[maxSent/2+h.kept/64%(maxSent/2)] = sp
	}
	h.kept++
	if n := got.Len(); n != len(want.Kvs) {
		h.t.Fatalf("request %v: Result.Len %d, etcd %d", req, n, len(want.Kvs))
	}
	if len(want.Kvs) > 0 && !bytes.Equal(got.LastKey(), want.Kvs[len(want.Kvs)-1].Key) {
		h.t.Fatalf("request %v: Result.LastKey %q, etcd %q", req, got.LastKey(), want.Kvs[len(want.Kvs)-1].Key)
	}
}

// checkSent verifies that the pieces of the responses kept still hold
// their bytes: whatever the stores did since (writes, sweeps, evacuated
// slabs, compactions, loads), nothing writes to memory a piece points
// into.
func (h *harness) checkSent() {
	for _, s := range h.sent {
		if s.req == nil {
			continue
		}
		if joined := bytes.Join(s.pieces, nil); !bytes.Equal(joined, s.want) {
			h.t.Fatalf("request %v: its pieces changed after it was answered, at revision %d (compactRev %d):\n%x\nwere\n%x\nlast writes:\n%s",
				s.req, h.rev, h.compactRev, joined, s.want, strings.Join(h.ops, "\n"))
		}
	}
}

func mapErr(err error) error {
	switch {
	case errors.Is(err, revtree.ErrCompacted):
		return mvcc.ErrCompacted
	case errors.Is(err, revtree.ErrFutureRev):
		return mvcc.ErrFutureRev
	}
	return err
}

// checkEvents verifies that the events each store retains are exactly the
// ones etcd sent, for every retained revision.
func (h *harness) checkEvents() {
	for i, st := range h.stores {
		// The oldest snapshot is the Reset at 1 (no events) or a compaction
		// floor, whose events are still retained.
		next := st.HistoryStart()
		batches, _, err := st.EventsFrom(next, h.rev, 0)
		if err != nil {
			h.t.Fatalf("degree %d: EventsFrom(%d): %v", h.degrees[i], next, err)
		}
		for _, b := range batches {
			rev, evs := b.Rev, b.Events
			if rev != next {
				h.t.Fatalf("degree %d: EventsFrom gave revision %d, want %d", h.degrees[i], rev, next)
			}
			next++
			want := h.events[rev]
			if len(evs) != len(want) {
				h.t.Fatalf("degree %d: revision %d has %d events, etcd sent %d", h.degrees[i], rev, len(evs), len(want))
			}
			for j := range evs {
				if evs[j].Type != want[j].Type || !kvEqual(evs[j].Kv, want[j].Kv) {
					h.t.Fatalf("degree %d: revision %d event %d is %v, etcd sent %v", h.degrees[i], rev, j, evs[j], want[j])
				}
			}
		}
		if next != h.rev+1 {
			h.t.Fatalf("degree %d: Events ended before revision %d (next %d)", h.degrees[i], h.rev, next)
		}
	}
}

// fixedRequests are checked at every revision in the retained window at
// the end of a run, on top of the random ones.
func fixedRequests() []*pb.RangeRequest {
	return []*pb.RangeRequest{
		{Key: []byte{0}, RangeEnd: []byte{0}},
		{Key: []byte{0}, RangeEnd: []byte{0}, KeysOnly: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, CountOnly: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, Limit: 3},
		{Key: []byte{0}, RangeEnd: []byte{0}, SortTarget: pb.RangeRequest_MOD, SortOrder: pb.RangeRequest_DESCEND, Limit: 5},
		{Key: []byte{0}, RangeEnd: []byte{0}, SortTarget: pb.RangeRequest_VALUE, KeysOnly: true},
		{Key: []byte{0}, RangeEnd: []byte{0}, SortTarget: pb.RangeRequest_CREATE, SortOrder: pb.RangeRequest_NONE, Limit: 4},
		{Key: []byte("a"), RangeEnd: []byte("b")},
		{Key: []byte("foo"), RangeEnd: []byte{0}, Limit: 2},
		{Key: []byte("foo")},
		{Key: []byte("b"), RangeEnd: []byte("a")},
	}
}

// runDifferential drives steps random writes and checks queries random
// requests after each one, then sweeps the fixed requests over every
// revision in [compactRev-2, rev+2].
func runDifferential(t testing.TB, r source, steps, queries int, more func() bool) *harness {
	h := newHarness(t, diffDegrees)
	if r.IntN(2) == 0 {
		h.load(r)
	}
	for i := 0; i < steps && more(); i++ {
		h.step(r)
		h.checkSent()
		for range queries {
			h.check(h.randRequest(r))
		}
	}
	h.checkSent()
	h.checkEvents()
	for rev := h.compactRev - 2; rev <= h.rev+2; rev++ {
		for _, req := range fixedRequests() {
			req.Revision = rev
			h.check(req)
		}
	}
	return h
}

func TestDifferentialEtcd(t *testing.T) {
	seeds, steps, queries := 8, 1200, 12
	if testing.Short() {
		seeds, steps, queries = 3, 250, 8
	}
	for seed := range seeds {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Parallel()
			r := rand.New(rand.NewPCG(uint64(seed), 0x5eed))
			h := runDifferential(t, r, steps, queries, func() bool { return true })
			if h.rev < int64(steps)/2 || h.compactRev == 0 || h.errs == 0 {
				t.Fatalf("weak workload: rev %d, compactRev %d, error comparisons %d", h.rev, h.compactRev, h.errs)
			}
			t.Logf("etcd at revision %d, compacted at %d, %d comparisons (%d errors) x %d degrees",
				h.rev, h.compactRev, h.compares, h.errs, len(h.stores))
		})
	}
}

// FuzzDifferentialEtcd runs the same harness with the workload and the
// requests chosen by the fuzzer's bytes. Its seed corpus runs in go test.
func FuzzDifferentialEtcd(f *testing.F) {
	for seed := range 4 {
		r := rand.New(rand.NewPCG(uint64(seed), 0xf022))
		b := make([]byte, 600+200*seed)
		for i := range b {
			b[i] = byte(r.IntN(256))
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add(bytes.Repeat([]byte{0}, 64))
	f.Add(bytes.Repeat([]byte{0xff}, 64))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &byteSource{b: data}
		runDifferential(t, r, 300, 3, func() bool { return !r.done() })
	})
}
