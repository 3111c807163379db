package persist

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// fakeSource is a Source whose serving and cluster the test sets. Each
// Serving call (one per flush) is signalled on polled, if there is room.
type fakeSource struct {
	ready     chan struct{}
	readyOnce sync.Once
	serving   atomic.Bool
	cluster   atomic.Uint64
	polled    chan struct{}
}

func newFakeSource(serving bool, cluster uint64) *fakeSource {
	s := &fakeSource{ready: make(chan struct{}), polled: make(chan struct{}, 1)}
	s.cluster.Store(cluster)
	if serving {
		s.serve()
	}
	return s
}

// serve makes the store serve (Ready closes the first time).
func (s *fakeSource) serve() {
	s.serving.Store(true)
	s.readyOnce.Do(func() { close(s.ready) })
}

func (s *fakeSource) Ready() <-chan struct{} { return s.ready }
func (s *fakeSource) ClusterID() uint64      { return s.cluster.Load() }
func (s *fakeSource) Serving() bool {
	select {
	case s.polled <- struct{}{}:
	default:
	}
	return s.serving.Load()
}

// history writes random revisions to stores, as the follower applies
// etcd's: puts of new and existing keys, deletes, Txns that touch a key
// twice, revisions without events. It keeps its own model of the
// keyspace at every revision, which the stores and their copies on disk
// are checked against.
type history struct {
	t      testing.TB
	rng    *rand.Rand
	stores []*revtree.Store
	rev    int64
	live   map[string]*mvccpb.KeyValue
	made   int
	value  int              // bytes of a value
	at     map[int64]string // the keyspace at each revision with events, and at the load
	revs   []int64          // the revisions of at, ascending
}

func newHistory(t testing.TB, seed uint64, stores ...*revtree.Store) *history {
	return &history{t: t, rng: rand.New(rand.NewPCG(seed, 5)), stores: stores, value: 24}
}

// load resets the stores with keys new keys named prefix... at rev.
func (h *history) load(rev int64, keys int, prefix string) {
	h.rev, h.live, h.at, h.revs = rev, map[string]*mvccpb.KeyValue{}, map[int64]string{}, nil
	var kvs []*mvccpb.KeyValue
	for i := range keys {
		create := 1 + h.rng.Int64N(rev)
		mod := create + h.rng.Int64N(rev-create+1)
		kv := &mvccpb.KeyValue{Key: fmt.Appendf(nil, "%s%04d", prefix, i), Value: h.newValue(mod), CreateRevision: create, ModRevision: mod, Version: 1 + h.rng.Int64N(mod-create+1), Lease: h.lease()}
		h.live[string(kv.Key)] = kv
		kvs = append(kvs, kv)
	}
	for _, s := range h.stores {
		s.Reset(rev, kvs, 0)
	}
	h.record()
}

func (h *history) newValue(rev int64) []byte {
	if h.rng.IntN(10) == 0 {
		return nil
	}
	v := fmt.Appendf(nil, "v@%d/%d/", rev, h.rng.IntN(1e6))
	for len(v) < h.value {
		v = append(v, byte('a'+h.rng.IntN(26)))
	}
	return v
}

func (h *history) lease() int64 {
	if h.rng.IntN(5) == 0 {
		return 1 + h.rng.Int64N(1<<40)
	}
	return 0
}

func (h *history) liveKey() string {
	keys := make([]string, 0, len(h.live))
	for k := range h.live {
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return ""
	}
	slices.Sort(keys)
	return keys[h.rng.IntN(len(keys))]
}

// step applies the next revision with events to the stores.
func (h *history) step() {
	h.t.Helper()
	h.rev++
	rev := h.rev
	var evs []*mvccpb.Event
	put := func(key string) {
		kv := &mvccpb.KeyValue{Key: []byte(key), Value: h.newValue(rev), CreateRevision: rev, ModRevision: rev, Version: 1, Lease: h.lease()}
		if prev := h.live[key]; prev != nil {
			kv.CreateRevision, kv.Version = prev.CreateRevision, prev.Version+1
		}
		h.live[key] = kv
		evs = append(evs, &mvccpb.Event{Type: mvccpb.PUT, Kv: kv})
	}
	del := func(key string) {
		delete(h.live, key)
		evs = append(evs, &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(key), ModRevision: rev}})
	}
	newKey := func() string {
		h.made++
		return fmt.Sprintf("new%05d", h.made)
	}
	ops := 1
	if h.rng.IntN(3) == 0 {
		ops = 2 + h.rng.IntN(3)
	}
	for range ops {
		k := h.liveKey()
		switch op := h.rng.IntN(100); {
		case op < 30 || k == "":
			put(newKey())
		case op < 70:
			put(k)
		case op < 85:
			del(k)
		default: // a Txn that touches the key twice
			switch h.rng.IntN(3) {
			case 0:
				put(k)
				put(k)
			case 1:
				put(k)
				del(k)
			default:
				del(k)
				put(k)
			}
		}
	}
	for _, s := range h.stores {
		copied := make([]*mvccpb.Event, len(evs))
		for i, ev := range evs {
			copied[i] = &mvccpb.Event{Type: ev.Type, Kv: proto.Clone(ev.Kv).(*mvccpb.KeyValue)}
		}
		if _, err := s.Apply(rev, copied); err != nil {
			h.t.Fatalf("Apply(%d): %v", rev, err)
		}
	}
	h.record()
}

func (h *history) steps(n int) {
	h.t.Helper()
	for range n {
		h.step()
	}
}

// advance moves the stores n revisions on without events.
func (h *history) advance(n int64) {
	h.rev += n
	for _, s := range h.stores {
		s.Advance(h.rev)
	}
}

func (h *history) record() {
	kvs := make([]*mvccpb.KeyValue, 0, len(h.live))
	for _, kv := range h.live {
		kvs = append(kvs, kv)
	}
	slices.SortFunc(kvs, func(a, b *mvccpb.KeyValue) int { return bytes.Compare(a.Key, b.Key) })
	h.at[h.rev] = renderKVs(kvs)
	h.revs = append(h.revs, h.rev)
}

// keyspaceAt is the model's keyspace at rev, and whether the model has it.
func (h *history) keyspaceAt(rev int64) (string, bool) {
	i, found := slices.BinarySearch(h.revs, rev)
	if !found {
		i--
	}
	if i < 0 || rev > h.rev {
		return "", false
	}
	return h.at[h.revs[i]], true
}

func renderKV(kv *mvccpb.KeyValue) string {
	if kv == nil {
		return "<nil>"
	}
	return fmt.Sprintf("%q=%q c%d m%d v%d l%d", kv.Key, kv.Value, kv.CreateRevision, kv.ModRevision, kv.Version, kv.Lease)
}

func renderKVs(kvs []*mvccpb.KeyValue) string {
	parts := make([]string, len(kvs))
	for i, kv := range kvs {
		parts[i] = renderKV(kv)
	}
	return strings.Join(parts, "\n")
}

// diff describes how got differs from want, two renderings of key-values
// or events, one to a line.
func diff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	for i := range max(len(w), len(g)) {
		var wl, gl = "<none>", "<none>"
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			return fmt.Sprintf("%d lines, want %d; first difference at line %d:\n got %s\nwant %s", len(g), len(w), i+1, gl, wl)
		}
	}
	return "no difference"
}

// viewAt renders the keyspace of s at rev.
func viewAt(t testing.TB, s *revtree.Store, rev int64) (string, error) {
	t.Helper()
	v, err := s.ViewHeld(rev)
	if err != nil {
		return "", err
	}
	resp := v.Range(&pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}, revtree.RangeOptions{})
	if int(resp.Count) != len(resp.Kvs) {
		t.Errorf("count %d for %d key-values at %d", resp.Count, len(resp.Kvs), rev)
	}
	return renderKVs(resp.Kvs), nil
}

func renderEvents(t testing.TB, s *revtree.Store, from, upTo int64) string {
	t.Helper()
	batches, complete, err := s.EventsHeld(from, upTo, 0)
	if err != nil {
		return fmt.Sprintf("events from %d: %v", from, err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "events %d..%d:\n", from, complete)
	for _, bt := range batches {
		fmt.Fprintf(&b, "%d[", bt.Rev)
		for _, ev := range bt.Events {
			fmt.Fprintf(&b, " %s %s prev %s;", ev.Type, renderKV(ev.Kv), renderKV(ev.PrevKv))
		}
		b.WriteString("]\n")
	}
	return b.String()
}

// sameStore fails t unless got, restored from a copy of want, holds every
// revision want holds and answers alike at each: keyspace, events with
// their prev_kv, revision and compaction revision.
func sameStore(t testing.TB, stage string, want, got *revtree.Store) {
	t.Helper()
	if !got.Loaded() {
		t.Fatalf("%s: the restored store is not loaded", stage)
	}
	if got.Rev() != want.Rev() || got.CompactRev() != want.CompactRev() || got.HistoryStart() != want.HistoryStart() {
		t.Errorf("%s: rev %d compact %d history-start %d; want %d %d %d", stage,
			got.Rev(), got.CompactRev(), got.HistoryStart(), want.Rev(), want.CompactRev(), want.HistoryStart())
	}
	// The copy's base is the revision before the first whose events the
	// store holds: the restored store holds it, the original may not.
	if got.OldestRev() > want.OldestRev() || got.OldestRev() != got.HistoryStart()-1 {
		t.Errorf("%s: oldest snapshot %d, history from %d; the original's oldest %d", stage, got.OldestRev(), got.HistoryStart(), want.OldestRev())
	}
	for rev := want.OldestRev(); rev <= want.Rev(); rev++ {
		w, err := viewAt(t, want, rev)
		if err != nil {
			t.Fatalf("%s: the original at %d: %v", stage, rev, err)
		}
		g, err := viewAt(t, got, rev)
		if err != nil {
			t.Errorf("%s: at %d: %v", stage, rev, err)
			return
		}
		if g != w {
			t.Errorf("%s: keyspace at %d: %s", stage, rev, diff(w, g))
			return
		}
	}
	if w, g := renderEvents(t, want, want.HistoryStart(), want.Rev()), renderEvents(t, got, want.HistoryStart(), want.Rev()); w != g {
		t.Errorf("%s: events: %s", stage, diff(w, g))
	}
}

// matchesModel fails t unless s holds the model's keyspace at every
// revision it holds, from its oldest snapshot to rev.
func matchesModel(t testing.TB, stage string, h *history, s *revtree.Store, rev int64) {
	t.Helper()
	if s.Rev() != rev {
		t.Errorf("%s: revision %d, want %d", stage, s.Rev(), rev)
	}
	for r := s.OldestRev(); r <= s.Rev(); r++ {
		want, ok := h.keyspaceAt(r)
		if !ok {
			t.Fatalf("%s: the model has no keyspace at %d", stage, r)
		}
		got, err := viewAt(t, s, r)
		if err != nil {
			t.Errorf("%s: at %d: %v", stage, r, err)
			return
		}
		if got != want {
			t.Errorf("%s: keyspace at %d, against the model: %s", stage, r, diff(want, got))
			return
		}
	}
}

// restoreCopy opens the copy and restores p's store from it, as the
// follower does (Open, then Restore), and returns the copy's cluster.
func restoreCopy(ctx context.Context, p *Persister) (uint64, bool) {
	h, ok := p.Open(ctx)
	if !ok {
		return 0, false
	}
	if err := p.Restore(ctx); err != nil {
		return 0, false
	}
	return h.Cluster, true
}

// restoreInto restores a fresh store from the copy in dir, with the
// history budget budget (none if 0), and closes the copy.
func restoreInto(t testing.TB, dir string, budget int64) (*revtree.Store, uint64, bool) {
	t.Helper()
	st := revtree.New(0)
	st.SetMaxHistoryBytes(budget)
	r := New(Config{Dir: dir, Store: st})
	cluster, ok := restoreCopy(context.Background(), r)
	r.close()
	return st, cluster, ok
}

// mustRestore restores the copy in dir, which must be of cluster.
func mustRestore(t testing.TB, dir string, cluster uint64) *revtree.Store {
	t.Helper()
	st, got, ok := restoreInto(t, dir, 0)
	if !ok || got != cluster {
		t.Fatalf("Restore: cluster %d, %v; want %d, true", got, ok, cluster)
	}
	return st
}

func mustFlush(t testing.TB, p *Persister, src Source) {
	t.Helper()
	if err := p.Flush(src); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	if err := p.Failing(); err != nil {
		t.Fatalf("Failing after a Flush that worked: %v", err)
	}
}

func stat(t testing.TB, path string) os.FileInfo {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi
}

func absent(t testing.TB, path string) {
	t.Helper()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s: %v, want it absent", path, err)
	}
}

// counter is the value of the counter with labels of vec.
func counter(t testing.TB, vec *prometheus.CounterVec, labels ...string) float64 {
	t.Helper()
	var m dto.Metric
	if err := vec.WithLabelValues(labels...).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// gauge is the value of the gauge name in reg.
func gauge(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// onDisk is what a copy holds, read with bbolt itself.
type onDisk struct {
	state  state
	kvs    string  // the kv bucket, rendered in key order
	revs   []int64 // the events bucket's revisions, in order
	events int     // events in them
}

// readDisk reads the copy at path; the Persister must have closed it.
func readDisk(t testing.TB, path string) onDisk {
	t.Helper()
	db, err := bolt.Open(path, 0o400, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		t.Fatalf("opening %s: %v", path, err)
	}
	defer db.Close()
	var d onDisk
	if err := db.View(func(tx *bolt.Tx) error {
		if d.state, err = unmarshalState(tx.Bucket(metaBucket).Get(stateKey)); err != nil {
			return err
		}
		var kvs []*mvccpb.KeyValue
		if err := tx.Bucket(kvBucket).ForEach(func(k, v []byte) error {
			kv, err := unmarshalKV(v)
			if err != nil {
				return err
			}
			if !bytes.Equal(kv.Key, k) {
				return fmt.Errorf("key %q holds %q", k, kv.Key)
			}
			kvs = append(kvs, kv)
			return nil
		}); err != nil {
			return err
		}
		d.kvs = renderKVs(kvs)
		return tx.Bucket(eventsBucket).ForEach(func(k, v []byte) error {
			rev, err := revOf(k)
			if err != nil {
				return err
			}
			evs, err := unmarshalEvents(v)
			if err != nil {
				return err
			}
			d.revs = append(d.revs, rev)
			d.events += len(evs)
			return nil
		})
	}); err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	return d
}

// heldRevs is the revisions with events s holds.
func heldRevs(t testing.TB, s *revtree.Store) []int64 {
	t.Helper()
	batches, _, err := s.EventsHeld(s.HistoryStart(), s.Rev(), 0)
	if err != nil {
		t.Fatal(err)
	}
	var revs []int64
	for _, b := range batches {
		revs = append(revs, b.Rev)
	}
	return revs
}

// checkDisk fails t unless the closed copy at path is exactly what s
// holds: kv the keyspace before its first held revision, the events of
// every held revision and nothing older.
func checkDisk(t testing.TB, path string, h *history, s *revtree.Store, cluster uint64) onDisk {
	t.Helper()
	d := readDisk(t, path)
	start := s.HistoryStart()
	want := state{cluster: cluster, base: start - 1, rev: s.Rev(), compactRev: s.CompactRev()}
	if d.state != want {
		t.Errorf("state on disk %+v, want %+v", d.state, want)
	}
	if len(d.revs) > 0 && d.revs[0] < start {
		t.Errorf("the copy holds revision %d, below the store's history start %d", d.revs[0], start)
	}
	if got, want := d.revs, heldRevs(t, s); !slices.Equal(got, want) {
		t.Errorf("revisions on disk %v, want %v", got, want)
	}
	if ks, ok := h.keyspaceAt(start - 1); !ok || d.kvs != ks {
		t.Errorf("kv on disk is not the keyspace at %d: %s", start-1, diff(ks, d.kvs))
	}
	return d
}

// TestRoundTrip: a copy written whole, then appended to, restores the
// store as it was at every revision it held, with the cluster it served;
// the restored store's copy is continued, not written again.
func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	st := revtree.New(0)
	h := newHistory(t, 1, st)
	h.load(100, 200, "k")
	h.steps(30)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st, Metrics: m})
	if gauge(t, reg, "etcd_snapcache_disk_revision") != 0 {
		t.Errorf("disk revision before the first write is not 0")
	}
	mustFlush(t, p, src)
	first := stat(t, p.Path())
	if got := gauge(t, reg, "etcd_snapcache_disk_revision"); got != float64(h.rev) {
		t.Errorf("disk revision %v, want %d", got, h.rev)
	}
	h.steps(40)
	h.advance(3)
	mustFlush(t, p, src)
	mustFlush(t, p, src) // nothing new: nothing to write
	if !os.SameFile(first, stat(t, p.Path())) {
		t.Errorf("the second write replaced the copy rather than append to it")
	}
	if got := counter(t, m.writes, "rewrite", "ok"); got != 1 {
		t.Errorf("%v whole copies, want 1", got)
	}
	if got := counter(t, m.writes, "append", "ok"); got < 1 {
		t.Errorf("%v appends, want at least 1", got)
	}
	if got := gauge(t, reg, "etcd_snapcache_disk_revision"); got != float64(h.rev) {
		t.Errorf("disk revision %v, want %d", got, h.rev)
	}
	p.close()
	checkDisk(t, p.Path(), h, st, 7)

	restored := mustRestore(t, dir, 7)
	sameStore(t, "restored", st, restored)
	matchesModel(t, "restored", h, restored, h.rev)

	// A restore that is accepted goes on, and so does its copy: the
	// Persister that restored it appends to it.
	fresh := revtree.New(0)
	m2 := NewMetrics(prometheus.NewRegistry())
	src2 := newFakeSource(true, 7)
	p2 := New(Config{Dir: dir, Store: fresh, Metrics: m2})
	hdr, ok := p2.Open(context.Background())
	if !ok {
		t.Fatal("Open: no copy")
	}
	// The bounds are of kv, the keyspace before the copy's events.
	atBase, _ := h.keyspaceAt(st.HistoryStart() - 1)
	firstKey, _, _ := strings.Cut(strings.TrimPrefix(atBase, `"`), `"`)
	if hdr.Cluster != 7 || hdr.Rev != st.Rev() || hdr.CompactRev != st.CompactRev() || len(hdr.Bounds) != 1 || string(hdr.Bounds[0]) != firstKey {
		t.Errorf("header %+v; want cluster 7, revision %d, compaction %d, bounds [%s]", hdr, st.Rev(), st.CompactRev(), firstKey)
	}
	if fresh.Loaded() {
		t.Error("Open loaded the store")
	}
	if err := p2.Restore(context.Background()); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	p2.Accepted()
	if got := counter(t, m2.restores, "warm"); got != 1 {
		t.Errorf("%v warm restores, want 1", got)
	}
	sameStore(t, "restored by the second Persister", st, fresh)
	before := stat(t, p2.Path())
	h.stores = append(h.stores, fresh)
	h.steps(20)
	mustFlush(t, p2, src2)
	if got := counter(t, m2.writes, "rewrite", "ok"); got != 0 {
		t.Errorf("%v whole copies after a restore, want 0: the copy is continued", got)
	}
	if got := counter(t, m2.writes, "append", "ok"); got != 1 {
		t.Errorf("%v appends after a restore, want 1", got)
	}
	if !os.SameFile(before, stat(t, p2.Path())) {
		t.Errorf("the copy was replaced after a restore rather than continued")
	}
	p2.close()
	checkDisk(t, p2.Path(), h, st, 7)
	again := mustRestore(t, dir, 7)
	sameStore(t, "restored again", st, again)
	matchesModel(t, "restored again", h, again, h.rev)
}

// TestFoldCompacted: once etcd's compaction drops history from the store,
// the next append folds the copy's events up to the store's history start
// into kv, and the copy restores as the store is.
func TestFoldCompacted(t *testing.T) {
	dir := t.TempDir()
	st := revtree.New(0)
	h := newHistory(t, 2, st)
	h.load(100, 100, "k")
	m := NewMetrics(prometheus.NewRegistry())
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st, Metrics: m})
	h.steps(20)
	mustFlush(t, p, src)
	first := stat(t, p.Path())
	h.steps(40)
	mustFlush(t, p, src)
	compactAt := h.rev - 25
	st.Compact(compactAt)
	if st.HistoryStart() <= 101+20 {
		t.Fatalf("the compaction at %d left history from %d: the test tests nothing", compactAt, st.HistoryStart())
	}
	h.steps(5)
	mustFlush(t, p, src)
	if !os.SameFile(first, stat(t, p.Path())) || counter(t, m.writes, "rewrite", "ok") != 1 {
		t.Errorf("the fold rewrote the copy (%v whole copies) rather than append to it", counter(t, m.writes, "rewrite", "ok"))
	}
	p.close()
	d := checkDisk(t, p.Path(), h, st, 7)
	if d.state.compactRev != compactAt {
		t.Errorf("compaction revision on disk %d, want %d", d.state.compactRev, compactAt)
	}
	restored := mustRestore(t, dir, 7)
	sameStore(t, "restored", st, restored)
	matchesModel(t, "restored", h, restored, h.rev)
	for _, s := range []*revtree.Store{st, restored} {
		if _, err := s.View(compactAt - 1); !errors.Is(err, revtree.ErrCompacted) {
			t.Errorf("View(%d) below the compaction: %v, want ErrCompacted", compactAt-1, err)
		}
	}
}

// TestFoldBudget: as the history budget drops the oldest revisions, each
// append folds them: the copy holds no more history than memory, and a
// restart under the same budget keeps all of it.
func TestFoldBudget(t *testing.T) {
	const budget = 48 << 10
	dir := t.TempDir()
	st := revtree.New(0)
	st.SetMaxHistoryBytes(budget)
	h := newHistory(t, 3, st)
	h.load(100, 100, "k")
	m := NewMetrics(prometheus.NewRegistry())
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st, Metrics: m})
	mustFlush(t, p, src)
	first := stat(t, p.Path())
	for range 25 {
		h.steps(8)
		mustFlush(t, p, src)
	}
	if st.HistoryTrimmed() == 0 || st.HistoryStart() <= 150 {
		t.Fatalf("the budget left history from %d: the test tests nothing", st.HistoryStart())
	}
	if !os.SameFile(first, stat(t, p.Path())) || counter(t, m.writes, "rewrite", "ok") != 1 {
		t.Errorf("the folds rewrote the copy (%v whole copies) rather than append to it", counter(t, m.writes, "rewrite", "ok"))
	}
	p.close()
	checkDisk(t, p.Path(), h, st, 7)

	restored, cluster, ok := restoreInto(t, dir, budget)
	if !ok || cluster != 7 {
		t.Fatalf("Restore: %d, %v", cluster, ok)
	}
	sameStore(t, "restored under the same budget", st, restored)
	matchesModel(t, "restored under the same budget", h, restored, h.rev)
	unbounded := mustRestore(t, dir, 7)
	sameStore(t, "restored without a budget", st, unbounded)
}

// TestRewriteWhenHistoryOutranTheCopy: when the budget dropped revisions
// the copy never got, it cannot be continued: the next write is a whole
// copy, which replaces the file.
func TestRewriteWhenHistoryOutranTheCopy(t *testing.T) {
	dir := t.TempDir()
	st := revtree.New(0)
	st.SetMaxHistoryBytes(16 << 10)
	h := newHistory(t, 4, st)
	h.load(100, 50, "k")
	m := NewMetrics(prometheus.NewRegistry())
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st, Metrics: m})
	mustFlush(t, p, src)
	first := stat(t, p.Path())
	diskRev := h.rev
	h.steps(200)
	if st.HistoryStart() <= diskRev+1 {
		t.Fatalf("history from %d, the copy up to %d: the test tests nothing", st.HistoryStart(), diskRev)
	}
	mustFlush(t, p, src)
	if os.SameFile(first, stat(t, p.Path())) || counter(t, m.writes, "rewrite", "ok") != 2 {
		t.Errorf("%v whole copies, want 2, the second replacing the file", counter(t, m.writes, "rewrite", "ok"))
	}
	p.close()
	checkDisk(t, p.Path(), h, st, 7)
	restored := mustRestore(t, dir, 7)
	sameStore(t, "restored", st, restored)
	matchesModel(t, "restored", h, restored, h.rev)
}

// TestNewGeneration: a reload (Reset) starts another history, which the
// copy cannot continue: the next write is a whole copy of the new
// keyspace, whatever revision the reload is at.
func TestNewGeneration(t *testing.T) {
	for _, c := range []struct {
		name  string
		delta int64 // the reload's revision after the copy's
		steps int   // revisions applied after the reload
	}{
		{"higher-revision", 50, 5},
		{"higher-revision-no-writes", 50, 0},
		{"same-revision", 0, 5},
		{"same-revision-no-writes", 0, 0},
		{"lower-revision", -20, 5},
		{"lower-revision-no-writes", -20, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			st := revtree.New(0)
			h := newHistory(t, 5, st)
			h.load(100, 50, "old")
			h.steps(30)
			m := NewMetrics(prometheus.NewRegistry())
			src := newFakeSource(true, 7)
			p := New(Config{Dir: dir, Store: st, Metrics: m})
			mustFlush(t, p, src)
			first := stat(t, p.Path())
			gen := st.Generation()

			if c.delta < 0 {
				st.ForgetCompaction() // etcd restored from an older backup
			}
			h.load(h.rev+c.delta, 40, "new")
			h.steps(c.steps)
			if st.Generation() == gen {
				t.Fatal("Reset did not start a generation")
			}
			mustFlush(t, p, src)
			p.close()
			if os.SameFile(first, stat(t, p.Path())) {
				t.Errorf("the copy of the new generation was not written whole: the file was not replaced")
			}
			if got := counter(t, m.writes, "rewrite", "ok"); got != 2 {
				t.Errorf("%v whole copies, want 2", got)
			}
			checkDisk(t, p.Path(), h, st, 7)
			restored, cluster, ok := restoreInto(t, dir, 0)
			if !ok || cluster != 7 {
				t.Fatalf("Restore: %d, %v; want 7, true", cluster, ok)
			}
			sameStore(t, "restored", st, restored)
			matchesModel(t, "restored", h, restored, h.rev)
			if now, _ := viewAt(t, restored, restored.Rev()); strings.Contains(now, `"old`) {
				t.Errorf("the restored keyspace at %d holds keys of the generation before: %s", restored.Rev(), diff(func() string { s, _ := h.keyspaceAt(h.rev); return s }(), now))
			}
		})
	}
}

// TestNotServing: nothing is written for a store that never served in its
// generation; a generation that served is still written after it stops
// serving (a clean stop).
func TestNotServing(t *testing.T) {
	t.Run("unloaded", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "snapcache")
		src := newFakeSource(false, 0)
		p := New(Config{Dir: dir, Store: revtree.New(0)})
		if err := p.Flush(src); err != nil {
			t.Errorf("Flush of a store never loaded nor served: %v", err)
		}
		if err := p.Failing(); err != nil {
			t.Errorf("Failing after a Flush of a store never loaded nor served: %v", err)
		}
		absent(t, dir)
		p.close()
	})
	t.Run("loaded-never-served", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "snapcache")
		st := revtree.New(0)
		h := newHistory(t, 6, st)
		h.load(100, 20, "k")
		h.steps(5)
		src := newFakeSource(false, 7)
		p := New(Config{Dir: dir, Store: st})
		mustFlush(t, p, src)
		mustFlush(t, p, src)
		absent(t, dir)
		// Serving with no cluster known yet is not serving a history.
		src.serving.Store(true)
		src.cluster.Store(0)
		mustFlush(t, p, src)
		absent(t, dir)
		p.close()
	})
	t.Run("served-then-stopped", func(t *testing.T) {
		dir := t.TempDir()
		st := revtree.New(0)
		h := newHistory(t, 7, st)
		h.load(100, 20, "k")
		src := newFakeSource(true, 7)
		p := New(Config{Dir: dir, Store: st})
		mustFlush(t, p, src)
		first := stat(t, p.Path())
		h.steps(10)
		src.serving.Store(false) // the follower stops: a clean stop writes the last revisions
		mustFlush(t, p, src)
		stoppedRev := h.rev
		stopped, _ := h.keyspaceAt(stoppedRev)

		// A reload while not serving: the new generation never served.
		h.load(h.rev+10, 20, "other")
		h.steps(3)
		mustFlush(t, p, src)
		p.close()
		if !os.SameFile(first, stat(t, p.Path())) {
			t.Errorf("a generation that never served replaced the copy")
		}
		restored := mustRestore(t, dir, 7)
		if restored.Rev() != stoppedRev {
			t.Errorf("restored at %d, want %d, the last revision served", restored.Rev(), stoppedRev)
		}
		if got, err := viewAt(t, restored, stoppedRev); err != nil || got != stopped {
			t.Errorf("restored keyspace: %v %s", err, diff(stopped, got))
		}
	})
}

// TestClusterChange: a history of another cluster is another copy, even
// in one store generation.
func TestClusterChange(t *testing.T) {
	dir := t.TempDir()
	st := revtree.New(0)
	h := newHistory(t, 8, st)
	h.load(100, 20, "k")
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st})
	mustFlush(t, p, src)
	first := stat(t, p.Path())
	h.steps(5)
	src.cluster.Store(8)
	mustFlush(t, p, src)
	p.close()
	if os.SameFile(first, stat(t, p.Path())) {
		t.Errorf("the copy of cluster 8 was appended to cluster 7's")
	}
	restored := mustRestore(t, dir, 8)
	sameStore(t, "restored", st, restored)
}

// writeTestCopy writes a copy of a store of cluster 7 to dir and closes
// it: the keys a (value "precious-kv-value-...") and b at revision 10,
// then c at 11 (value "precious-event-value-...") and b again at 12,
// and revisions 13 to 15 without events.
func writeTestCopy(t testing.TB, dir string) *revtree.Store {
	t.Helper()
	st := revtree.New(0)
	st.Reset(10, []*mvccpb.KeyValue{
		{Key: []byte("a"), Value: []byte("precious-kv-value-0123456789"), CreateRevision: 5, ModRevision: 5, Version: 1},
		{Key: []byte("b"), Value: []byte("b-value"), CreateRevision: 6, ModRevision: 8, Version: 2, Lease: 99},
	}, 0)
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st})
	mustFlush(t, p, src)
	for _, ev := range []*mvccpb.Event{
		{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("c"), Value: []byte("precious-event-value-0123456789"), CreateRevision: 11, ModRevision: 11, Version: 1}},
		{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("b"), Value: []byte("b-value-2"), CreateRevision: 6, ModRevision: 12, Version: 3}},
	} {
		if _, err := st.Apply(ev.Kv.ModRevision, []*mvccpb.Event{ev}); err != nil {
			t.Fatal(err)
		}
	}
	st.Advance(15)
	mustFlush(t, p, src)
	p.close()
	return st
}

// flipIn flips a bit in the middle of every occurrence of needle in the
// file at path.
func flipIn(t testing.TB, path, needle string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for off := 0; ; {
		i := bytes.Index(data[off:], []byte(needle))
		if i < 0 {
			break
		}
		data[off+i+len(needle)/2] ^= 0x10
		off += i + len(needle)
		n++
	}
	if n == 0 {
		t.Fatalf("%q is not in %s", needle, path)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// updateDisk changes the closed copy at path.
func updateDisk(t testing.TB, path string, fn func(tx *bolt.Tx) error) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.Update(fn); err != nil {
		t.Fatal(err)
	}
}

// TestDamagedCopy: a copy that fails a check of its own is not restored,
// and is removed; the store is left unloaded, and the next write is a
// whole copy.
func TestDamagedCopy(t *testing.T) {
	cases := []struct {
		name   string
		result string // of etcd_snapcache_disk_restores_total
		damage func(t *testing.T, path string)
	}{
		{"kv-record", "damaged", func(t *testing.T, path string) { flipIn(t, path, "precious-kv-value-0123456789") }},
		{"events-record", "damaged", func(t *testing.T, path string) { flipIn(t, path, "precious-event-value-0123456789") }},
		{"no-state-record", "damaged", func(t *testing.T, path string) {
			// A whole copy never finished: the buckets and the keys,
			// no state.
			os.Remove(path)
			updateDisk(t, path, func(tx *bolt.Tx) error {
				for _, name := range [][]byte{metaBucket, kvBucket, eventsBucket} {
					if _, err := tx.CreateBucket(name); err != nil {
						return err
					}
				}
				kv := &mvccpb.KeyValue{Key: []byte("a"), Value: []byte("x"), CreateRevision: 5, ModRevision: 5, Version: 1}
				enc, err := proto.Marshal(kv)
				if err != nil {
					return err
				}
				if kv, err = revtree.DecodeKeyValue(enc); err != nil {
					return err
				}
				rec, err := marshalKV(nil, kv)
				if err != nil {
					return err
				}
				return tx.Bucket(kvBucket).Put([]byte("a"), rec)
			})
		}},
		{"no-buckets", "damaged", func(t *testing.T, path string) {
			updateDisk(t, path, func(tx *bolt.Tx) error { return tx.DeleteBucket(eventsBucket) })
		}},
		{"state-checksum", "damaged", func(t *testing.T, path string) {
			updateDisk(t, path, func(tx *bolt.Tx) error {
				rec := slices.Clone(tx.Bucket(metaBucket).Get(stateKey))
				rec[len(rec)-1] ^= 1
				return tx.Bucket(metaBucket).Put(stateKey, rec)
			})
		}},
		{"another-format", "damaged", func(t *testing.T, path string) {
			updateDisk(t, path, func(tx *bolt.Tx) error {
				rec, _ := seal(nil, func(b []byte) ([]byte, error) {
					b = binary.BigEndian.AppendUint32(b, formatVersion+1)
					return append(b, make([]byte, 32)...), nil
				})
				return tx.Bucket(metaBucket).Put(stateKey, rec)
			})
		}},
		{"revision-past-the-copy", "damaged", func(t *testing.T, path string) {
			updateDisk(t, path, func(tx *bolt.Tx) error {
				rec, err := marshalEvents(nil, []*mvccpb.Event{{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte("a"), ModRevision: 16}}})
				if err != nil {
					return err
				}
				return tx.Bucket(eventsBucket).Put(revKey(16), rec)
			})
		}},
		{"event-under-another-revision", "damaged", func(t *testing.T, path string) {
			updateDisk(t, path, func(tx *bolt.Tx) error {
				rec, err := marshalEvents(nil, []*mvccpb.Event{{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte("a"), ModRevision: 13}}})
				if err != nil {
					return err
				}
				return tx.Bucket(eventsBucket).Put(revKey(14), rec)
			})
		}},
		{"inconsistent-events", "damaged", func(t *testing.T, path string) {
			// Well-formed, but a delete of a key absent at 13: the
			// store refuses it.
			updateDisk(t, path, func(tx *bolt.Tx) error {
				rec, err := marshalEvents(nil, []*mvccpb.Event{{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte("zz"), ModRevision: 13}}})
				if err != nil {
					return err
				}
				return tx.Bucket(eventsBucket).Put(revKey(13), rec)
			})
		}},
		{"not-bbolt", "damaged", func(t *testing.T, path string) {
			if err := os.WriteFile(path, bytes.Repeat([]byte("not a copy of the cache "), 1000), 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{"unfinished-whole-copy", "none", func(t *testing.T, path string) {
			// A whole copy that a previous process did not rename.
			if err := os.Rename(path, path+".new"); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			writeTestCopy(t, dir)
			path := filepath.Join(dir, FileName)
			c.damage(t, path)

			st := revtree.New(0)
			src := newFakeSource(false, 0)
			m := NewMetrics(prometheus.NewRegistry())
			p := New(Config{Dir: dir, Store: st, Metrics: m})
			if cluster, ok := restoreCopy(context.Background(), p); ok {
				t.Fatalf("Restore of a damaged copy: %d, %v", cluster, ok)
			}
			if got := counter(t, m.restores, c.result); got != 1 {
				t.Errorf("%v restores counted %q, want 1", got, c.result)
			}
			absent(t, path)
			absent(t, path+".new")
			if st.Loaded() || st.Generation() != 0 {
				t.Errorf("store after a refused restore: loaded %v, generation %d", st.Loaded(), st.Generation())
			}
			// The store is loaded from etcd and serves: the next write is
			// a whole copy.
			h := newHistory(t, 9, st)
			h.load(200, 10, "k")
			h.steps(3)
			src.cluster.Store(9)
			src.serve()
			mustFlush(t, p, src)
			p.close()
			restored := mustRestore(t, dir, 9)
			sameStore(t, "restored after a damaged copy", st, restored)
		})
	}
}

// TestLeftoverNewFile: a cache.db.new that a previous process left beside
// a whole copy is removed and ignored.
func TestLeftoverNewFile(t *testing.T) {
	dir := t.TempDir()
	st := writeTestCopy(t, dir)
	path := filepath.Join(dir, FileName)
	if err := os.WriteFile(path+".new", []byte("half a copy"), 0o600); err != nil {
		t.Fatal(err)
	}
	restored := mustRestore(t, dir, 7)
	absent(t, path+".new")
	sameStore(t, "restored", st, restored)
}

// TestRefused: a restored copy that fails a check against etcd is thrown
// away; the next write is a whole copy.
func TestRefused(t *testing.T) {
	dir := t.TempDir()
	writeTestCopy(t, dir)
	st := revtree.New(0)
	src := newFakeSource(false, 0)
	m := NewMetrics(prometheus.NewRegistry())
	p := New(Config{Dir: dir, Store: st, Metrics: m})
	if _, ok := restoreCopy(context.Background(), p); !ok {
		t.Fatal("no restore")
	}
	p.Refused("cluster-id", errors.New("another cluster"))
	if got := counter(t, m.restores, "cluster-id"); got != 1 {
		t.Errorf("%v restores refused for the cluster id, want 1", got)
	}
	absent(t, p.Path())
	h := newHistory(t, 10, st)
	h.load(300, 10, "k")
	src.cluster.Store(8)
	src.serve()
	mustFlush(t, p, src)
	if got := counter(t, m.writes, "rewrite", "ok"); got != 1 {
		t.Errorf("%v whole copies after a refused restore, want 1", got)
	}
	p.close()
	sameStore(t, "restored", st, mustRestore(t, dir, 8))
}

// TestReleaseResume: Release writes the copy a last time and closes it for
// a new process, and nothing is written until Resume, after which the
// copy is written whole.
func TestReleaseResume(t *testing.T) {
	dir := t.TempDir()
	st := revtree.New(0)
	h := newHistory(t, 11, st)
	h.load(100, 20, "k")
	m := NewMetrics(prometheus.NewRegistry())
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st, Metrics: m})
	mustFlush(t, p, src)
	h.steps(10)
	if err := p.Release(src); err != nil {
		t.Fatal(err)
	}
	released := h.rev
	h.steps(5)
	mustFlush(t, p, src) // released: nothing is written
	// The new process restores what was released: the file is not locked.
	restored := mustRestore(t, dir, 7)
	if restored.Rev() != released {
		t.Errorf("restored at %d, want %d, the revision released", restored.Rev(), released)
	}
	matchesModel(t, "restored after the release", h, restored, released)

	first := stat(t, p.Path())
	p.Resume()
	mustFlush(t, p, src)
	if os.SameFile(first, stat(t, p.Path())) || counter(t, m.writes, "rewrite", "ok") != 2 {
		t.Errorf("the write after Resume was not a whole copy (%v whole copies)", counter(t, m.writes, "rewrite", "ok"))
	}
	p.close()
	sameStore(t, "restored after Resume", st, mustRestore(t, dir, 7))
}

// TestFullDisk: a write the file system refuses (past RLIMIT_FSIZE, as a
// full disk would) fails, is reported by Flush and Failing, and leaves the
// previous copy whole; once the disk takes writes again, the next Flush
// writes the copy and clears Failing. Not parallel: the limit is the
// process's.
func TestFullDisk(t *testing.T) {
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
			t.Errorf("restoring RLIMIT_FSIZE: %v", err)
		}
	})
	const limit = 64 << 10
	dir := t.TempDir()
	st := revtree.New(0)
	h := newHistory(t, 12, st)
	h.value = 100
	h.load(100, 40, "k")
	h.steps(10)
	m := NewMetrics(prometheus.NewRegistry())
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st, Metrics: m})
	mustFlush(t, p, src)
	if size := stat(t, p.Path()).Size(); size > limit {
		t.Fatalf("the first copy takes %d bytes, over the limit of %d: the test tests nothing", size, limit)
	}
	copied := h.rev
	copiedKeyspace, _ := h.keyspaceAt(copied)

	// A few hundred KiB of values.
	h.value = 8 << 10
	h.steps(40)
	lowered := syscall.Rlimit{Cur: limit, Max: old.Max}
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lowered); err != nil {
		t.Fatal(err)
	}
	err := p.Flush(src)
	if err == nil {
		t.Fatal("Flush past RLIMIT_FSIZE did not fail")
	}
	t.Logf("append past the limit: %v", err)
	if p.Failing() == nil {
		t.Error("Failing is nil after a failed Flush")
	}
	if got := counter(t, m.writes, "append", "error"); got != 1 {
		t.Errorf("%v failed appends, want 1", got)
	}
	// The next write is a whole copy, which fails too, and leaves no
	// half-written file.
	if err := p.Flush(src); err == nil {
		t.Fatal("a whole copy past RLIMIT_FSIZE did not fail")
	} else {
		t.Logf("whole copy past the limit: %v", err)
	}
	if got := counter(t, m.writes, "rewrite", "error"); got != 1 {
		t.Errorf("%v failed whole copies, want 1", got)
	}
	absent(t, p.Path()+".new")

	// The copy before the failures is whole.
	restored := mustRestore(t, dir, 7)
	if restored.Rev() != copied {
		t.Errorf("restored at %d, want %d, the last copy written", restored.Rev(), copied)
	}
	if got, err := viewAt(t, restored, copied); err != nil || got != copiedKeyspace {
		t.Errorf("restored keyspace: %v %s", err, diff(copiedKeyspace, got))
	}

	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
		t.Fatal(err)
	}
	mustFlush(t, p, src)
	p.close()
	sameStore(t, "restored after the disk took writes again", st, mustRestore(t, dir, 7))
}

// TestReadOnlyDir: a directory that refuses writes fails the Flush, with
// the path in the error, and sets Failing; nothing panics, and a copy
// written before stays whole.
func TestReadOnlyDir(t *testing.T) {
	t.Run("empty", func(t *testing.T) {
		dir := t.TempDir()
		testsupport.ReadOnly(t, dir)
		st := revtree.New(0)
		h := newHistory(t, 13, st)
		h.load(100, 20, "k")
		src := newFakeSource(true, 7)
		p := New(Config{Dir: dir, Store: st})
		defer p.close()
		err := p.Flush(src)
		if err == nil || !strings.Contains(err.Error(), dir) {
			t.Fatalf("Flush into a read-only directory: %v, want an error naming %s", err, dir)
		}
		if got := p.Failing(); got == nil || got.Error() != err.Error() {
			t.Errorf("Failing: %v, want %v", got, err)
		}
		absent(t, p.Path())
	})
	t.Run("with-a-copy", func(t *testing.T) {
		dir := t.TempDir()
		st := revtree.New(0)
		h := newHistory(t, 14, st)
		h.load(100, 20, "k")
		h.steps(5)
		src := newFakeSource(true, 7)
		p := New(Config{Dir: dir, Store: st})
		mustFlush(t, p, src)
		copied := h.rev
		copiedKeyspace, _ := h.keyspaceAt(copied)
		p.close() // the copy is opened again, on the read-only directory
		writable := testsupport.ReadOnly(t, dir)
		h.steps(5)
		err := p.Flush(src)
		if err == nil || !strings.Contains(err.Error(), dir) {
			t.Fatalf("Flush into a read-only directory: %v, want an error naming %s", err, dir)
		}
		if p.Failing() == nil {
			t.Error("Failing is nil after a failed Flush")
		}
		// A reload: the whole copy it needs fails too.
		h.load(h.rev+5, 10, "other")
		if err := p.Flush(src); err == nil || !strings.Contains(err.Error(), dir) {
			t.Fatalf("Flush into a read-only directory: %v, want an error naming %s", err, dir)
		}
		p.close()
		// Once the directory is writable again, the copy written before
		// is whole.
		writable()
		absent(t, p.Path()+".new")
		restored := mustRestore(t, dir, 7)
		if got, err := viewAt(t, restored, copied); err != nil || got != copiedKeyspace || restored.Rev() != copied {
			t.Errorf("restored at %d, want %d: %v %s", restored.Rev(), copied, err, diff(copiedKeyspace, got))
		}
	})
}

// waitFor waits until cond holds, checking it after each flush of Run
// starts (each Serving call) and every few milliseconds (the metrics
// change when a flush ends, which nothing signals), for at most 20
// seconds.
func waitFor(t *testing.T, src *fakeSource, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(20 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-src.polled:
		case <-tick.C:
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestRun: Run writes the copy when the store first serves and then every
// interval, and once more when ctx ends, and returns (goleak checks that
// nothing it started is left).
func TestRun(t *testing.T) {
	t.Run("interval", func(t *testing.T) {
		dir := t.TempDir()
		st := revtree.New(0)
		h := newHistory(t, 15, st)
		h.load(100, 20, "k")
		src := newFakeSource(false, 7)
		reg := prometheus.NewRegistry()
		m := NewMetrics(reg)
		p := New(Config{Dir: dir, Store: st, Metrics: m, Interval: 5 * time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			p.Run(ctx, src)
		}()
		defer func() {
			cancel()
			<-done
		}()
		diskRev := func() bool { return gauge(t, reg, "etcd_snapcache_disk_revision") == float64(h.rev) }
		src.serve()
		waitFor(t, src, "the first copy", diskRev)
		for range 3 {
			h.steps(10)
			waitFor(t, src, fmt.Sprintf("the copy at %d", h.rev), diskRev)
		}
		if got := counter(t, m.writes, "append", "ok"); got < 3 {
			t.Errorf("%v appends, want at least 3", got)
		}
		cancel()
		<-done
		sameStore(t, "restored", st, mustRestore(t, dir, 7))
	})
	t.Run("final-flush", func(t *testing.T) {
		dir := t.TempDir()
		st := revtree.New(0)
		h := newHistory(t, 16, st)
		h.load(100, 20, "k")
		src := newFakeSource(true, 7)
		reg := prometheus.NewRegistry()
		p := New(Config{Dir: dir, Store: st, Metrics: NewMetrics(reg), Interval: time.Hour})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			p.Run(ctx, src)
		}()
		waitFor(t, src, "the first copy", func() bool { return gauge(t, reg, "etcd_snapcache_disk_revision") == 100 })
		h.steps(10)
		// The next write is an hour away: only the one at stop writes
		// these revisions.
		cancel()
		<-done
		restored := mustRestore(t, dir, 7)
		sameStore(t, "restored", st, restored)
		matchesModel(t, "restored", h, restored, h.rev)
	})
}

// TestRestoreKeepsAnUndamagedCopy: a restore that fails for a reason
// other than damage (the proxy stopped while it restored, another process
// holds the copy) restores nothing, and leaves the copy as it is: it is
// not damaged, and the next start can use it.
func TestRestoreKeepsAnUndamagedCopy(t *testing.T) {
	t.Run("cancelled", func(t *testing.T) {
		dir := t.TempDir()
		st := writeTestCopy(t, dir)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		fresh := revtree.New(0)
		p := New(Config{Dir: dir, Store: fresh})
		if _, ok := restoreCopy(ctx, p); ok {
			t.Fatal("Restore with a cancelled context restored")
		}
		p.close()
		if fresh.Loaded() {
			t.Error("the store is loaded after a cancelled restore")
		}
		if _, err := os.Stat(p.Path()); err != nil {
			t.Fatalf("the copy is gone after a cancelled restore: %v", err)
		}
		sameStore(t, "restored after a cancelled restore", st, mustRestore(t, dir, 7))
	})
	t.Run("locked", func(t *testing.T) {
		dir := t.TempDir()
		st := writeTestCopy(t, dir)
		path := filepath.Join(dir, FileName)
		holder, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second}) // another process's lock
		if err != nil {
			t.Fatal(err)
		}
		fresh := revtree.New(0)
		p := New(Config{Dir: dir, Store: fresh})
		if _, ok := restoreCopy(context.Background(), p); ok {
			t.Fatal("Restore of a copy another process holds restored")
		}
		p.close()
		if err := holder.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("the copy another process holds is gone after a restore failed on its lock: %v", err)
		}
		sameStore(t, "restored once the other process let go", st, mustRestore(t, dir, 7))
	})
}

// TestRewriteUndoesTheOldestRevision: a whole copy of a store whose oldest
// snapshot holds its revision's events (here after a compaction) has for
// kv the keyspace before that revision: each key its Txn touched as the
// first event found it, however many times the Txn touched it.
func TestRewriteUndoesTheOldestRevision(t *testing.T) {
	dir := t.TempDir()
	st := revtree.New(0)
	kv := func(key, value string, create, mod, ver int64) *mvccpb.KeyValue {
		return &mvccpb.KeyValue{Key: []byte(key), Value: []byte(value), CreateRevision: create, ModRevision: mod, Version: ver}
	}
	put := func(kv *mvccpb.KeyValue) *mvccpb.Event { return &mvccpb.Event{Type: mvccpb.PUT, Kv: kv} }
	del := func(key string, rev int64) *mvccpb.Event {
		return &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(key), ModRevision: rev}}
	}
	st.Reset(10, []*mvccpb.KeyValue{kv("a", "a1", 3, 3, 1), kv("b", "b2", 4, 9, 2), kv("d", "d1", 5, 5, 1)}, 0)
	for _, r := range []struct {
		rev int64
		evs []*mvccpb.Event
	}{
		{11, []*mvccpb.Event{put(kv("x", "x1", 11, 11, 1))}},
		// Put then delete a, create c twice over, delete then create b
		// again, put d twice.
		{12, []*mvccpb.Event{
			put(kv("a", "a2", 3, 12, 2)), del("a", 12),
			put(kv("c", "c1", 12, 12, 1)), put(kv("c", "c2", 12, 12, 2)),
			del("b", 12), put(kv("b", "b1'", 12, 12, 1)),
			put(kv("d", "d2", 5, 12, 2)), put(kv("d", "d3", 5, 12, 3)),
		}},
		{13, []*mvccpb.Event{put(kv("a", "a1'", 13, 13, 1))}},
	} {
		if _, err := st.Apply(r.rev, r.evs); err != nil {
			t.Fatal(err)
		}
	}
	st.Compact(12)
	if st.OldestRev() != 12 || st.HistoryStart() != 12 {
		t.Fatalf("oldest snapshot %d, history from %d; want 12, 12", st.OldestRev(), st.HistoryStart())
	}
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st})
	mustFlush(t, p, src)
	p.close()
	d := readDisk(t, p.Path())
	want := renderKVs([]*mvccpb.KeyValue{kv("a", "a1", 3, 3, 1), kv("b", "b2", 4, 9, 2), kv("d", "d1", 5, 5, 1), kv("x", "x1", 11, 11, 1)})
	if d.kvs != want {
		t.Errorf("kv on disk is not the keyspace at 11: %s", diff(want, d.kvs))
	}
	if want := (state{cluster: 7, base: 11, rev: 13, compactRev: 12}); d.state != want || !slices.Equal(d.revs, []int64{12, 13}) || d.events != 9 {
		t.Errorf("on disk: %+v, revisions %v, %d events; want %+v, [12 13], 9", d.state, d.revs, d.events, want)
	}
	sameStore(t, "restored", st, mustRestore(t, dir, 7))
}

// TestLargeCopy: a whole copy of a keyspace past chunkBytes, written in
// several transactions, restores whole, its keys decoded on several
// goroutines.
func TestLargeCopy(t *testing.T) {
	dir := t.TempDir()
	st := revtree.New(0)
	value := bytes.Repeat([]byte("v"), 1700)
	var kvs []*mvccpb.KeyValue
	for i := range 10_500 { // 18 MiB, past chunkBytes, and 2 decoders' worth
		kvs = append(kvs, &mvccpb.KeyValue{Key: fmt.Appendf(nil, "/registry/k%06d", i), Value: fmt.Appendf(value[:len(value):len(value)], "%d", i), CreateRevision: 2, ModRevision: 2, Version: 1})
	}
	st.Reset(100, kvs, 0)
	h := newHistory(t, 17)
	h.rev, h.live, h.at = 100, map[string]*mvccpb.KeyValue{}, map[int64]string{}
	for _, kv := range kvs[:50] {
		h.live[string(kv.Key)] = kv
	}
	h.stores = []*revtree.Store{st}
	h.steps(30)
	src := newFakeSource(true, 7)
	p := New(Config{Dir: dir, Store: st})
	mustFlush(t, p, src)
	p.close()
	d := readDisk(t, p.Path())
	if d.state != (state{cluster: 7, base: 100, rev: 130}) || len(d.revs) != 30 || strings.Count(d.kvs, "\n")+1 != len(kvs) {
		t.Errorf("on disk: %+v, %d revisions, %d keys", d.state, len(d.revs), strings.Count(d.kvs, "\n")+1)
	}
	// Every BoundsEvery-th key of the copy, in key order.
	r := New(Config{Dir: dir, Store: revtree.New(0)})
	hdr, ok := r.Open(context.Background())
	r.close()
	if !ok || len(hdr.Bounds) != 2 || !bytes.Equal(hdr.Bounds[0], kvs[0].Key) || !bytes.Equal(hdr.Bounds[1], kvs[BoundsEvery].Key) {
		t.Errorf("Open: %v, bounds %q; want [%q %q]", ok, hdr.Bounds, kvs[0].Key, kvs[BoundsEvery].Key)
	}
	restored := mustRestore(t, dir, 7)
	// Compared by their encodings: rendering 18 MiB takes seconds under
	// -race.
	encoded := func(s *revtree.Store, rev int64) []byte {
		v, err := s.ViewHeld(rev)
		if err != nil {
			t.Fatalf("ViewHeld(%d): %v", rev, err)
		}
		var b []byte
		v.Ascend([]byte{0}, nil, func(kv *mvccpb.KeyValue) bool {
			b, err = revtree.AppendKeyValue(b, kv)
			return err == nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, rev := range []int64{100, 115, 130} {
		if !bytes.Equal(encoded(st, rev), encoded(restored, rev)) {
			t.Errorf("the restored keyspace at %d differs", rev)
		}
	}
	if w, g := renderEvents(t, st, 101, 130), renderEvents(t, restored, 101, 130); w != g {
		t.Errorf("restored events: %s", diff(w, g))
	}
}

// unmarshalKV decodes a kv record into the store's copy of it
// (revtree.DecodeKeyValue).
func unmarshalKV(rec []byte) (*mvccpb.KeyValue, error) {
	p, err := open(rec)
	if err != nil {
		return nil, err
	}
	kv, err := revtree.DecodeKeyValue(p)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return kv, nil
}
