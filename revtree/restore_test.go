package revtree_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Tests of Store.Restore: a store restored from a keyspace and the events
// after it (as persist reads them back from disk) is the store that Reset,
// an Apply of each revision and Advance make, and bad input leaves a store
// as it was.

// restoreWorkload writes random revisions: puts of new and existing keys,
// deletes, Txns that touch one key twice, revisions skipped (no events),
// empty values and leases.
type restoreWorkload struct {
	rng  *rand.Rand
	rev  int64
	live map[string]*mvccpb.KeyValue
	made int // new keys made so far
}

// newRestoreWorkload returns a workload and the keyspace at base it
// starts from.
func newRestoreWorkload(seed uint64, base int64, keys int) (*restoreWorkload, []*mvccpb.KeyValue) {
	w := &restoreWorkload{rng: rand.New(rand.NewPCG(seed, 17)), rev: base, live: map[string]*mvccpb.KeyValue{}}
	var kvs []*mvccpb.KeyValue
	for i := range keys {
		create := 1 + w.rng.Int64N(base)
		mod := create + w.rng.Int64N(base-create+1)
		kv := &mvccpb.KeyValue{
			Key:            fmt.Appendf(nil, "b%03d", i),
			Value:          w.value("b", mod),
			CreateRevision: create,
			ModRevision:    mod,
			Version:        1 + w.rng.Int64N(mod-create+1),
			Lease:          w.lease(),
		}
		w.live[string(kv.Key)] = kv
		kvs = append(kvs, kv)
	}
	return w, kvs
}

func (w *restoreWorkload) value(key string, rev int64) []byte {
	switch w.rng.IntN(8) {
	case 0:
		return nil // etcd allows empty values: no value field
	case 1:
		return []byte(strings.Repeat(fmt.Sprintf("%s@%d/", key, rev), 20))
	}
	return fmt.Appendf(nil, "%s@%d/%d", key, rev, w.rng.IntN(1000))
}

func (w *restoreWorkload) lease() int64 {
	if w.rng.IntN(4) == 0 {
		return 1 + w.rng.Int64N(1<<40)
	}
	return 0
}

// liveKey returns a live key, "" if none.
func (w *restoreWorkload) liveKey(state map[string]*mvccpb.KeyValue) string {
	keys := make([]string, 0, len(state))
	for k, kv := range state {
		if kv != nil {
			keys = append(keys, k)
		}
	}
	if len(keys) == 0 {
		return ""
	}
	slices.Sort(keys)
	return keys[w.rng.IntN(len(keys))]
}

// next returns the events of the next revision with events, as etcd sends
// them (no PrevKv), and applies them to the workload's keyspace.
func (w *restoreWorkload) next() (int64, []*mvccpb.Event) {
	w.rev++
	if w.rng.IntN(5) == 0 {
		w.rev += 1 + w.rng.Int64N(3) // revisions whose events the store never sees
	}
	rev := w.rev
	var evs []*mvccpb.Event
	put := func(key string) {
		kv := &mvccpb.KeyValue{Key: []byte(key), Value: w.value(key, rev), CreateRevision: rev, ModRevision: rev, Version: 1, Lease: w.lease()}
		if prev := w.live[key]; prev != nil {
			kv.CreateRevision, kv.Version = prev.CreateRevision, prev.Version+1
		}
		w.live[key] = kv
		evs = append(evs, &mvccpb.Event{Type: mvccpb.PUT, Kv: kv})
	}
	del := func(key string) {
		delete(w.live, key)
		evs = append(evs, &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(key), ModRevision: rev}})
	}
	newKey := func() string {
		w.made++
		return fmt.Sprintf("n%03d", w.made)
	}
	ops := 1
	if w.rng.IntN(3) == 0 {
		ops = 2 + w.rng.IntN(4)
	}
	for range ops {
		switch op := w.rng.IntN(100); {
		case op < 30:
			put(newKey())
		case op < 70:
			if k := w.liveKey(w.live); k != "" {
				put(k)
			} else {
				put(newKey())
			}
		case op < 85:
			if k := w.liveKey(w.live); k != "" {
				del(k)
			} else {
				put(newKey())
			}
		default:
			// A Txn that touches one key twice: put then put, put then
			// delete, or delete then put (the key is created again).
			k := w.liveKey(w.live)
			if k == "" {
				k = newKey()
			}
			switch w.rng.IntN(3) {
			case 0:
				put(k)
				put(k)
			case 1:
				put(k)
				del(k)
			default:
				if w.live[k] != nil {
					del(k)
				}
				put(k)
			}
		}
	}
	return rev, evs
}

// forApply returns fresh copies of events for Apply, which changes them.
func forApply(evs []*mvccpb.Event) []*mvccpb.Event {
	out := make([]*mvccpb.Event, len(evs))
	for i, ev := range evs {
		out[i] = &mvccpb.Event{Type: ev.Type, Kv: proto.Clone(ev.Kv).(*mvccpb.KeyValue)}
	}
	return out
}

// decoded is the store's copy of kv as persist reads it back from disk.
func decoded(t testing.TB, kv *mvccpb.KeyValue) *mvccpb.KeyValue {
	t.Helper()
	enc, err := proto.Marshal(kv)
	if err != nil {
		t.Fatal(err)
	}
	out, err := revtree.DecodeKeyValue(enc)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// forRestore returns events as Restore takes them: each put's Kv the
// store's copy (DecodeKeyValue), each delete's a fresh tombstone, no
// PrevKv.
func forRestore(t testing.TB, evs []*mvccpb.Event) []*mvccpb.Event {
	out := make([]*mvccpb.Event, len(evs))
	for i, ev := range evs {
		if ev.Type == mvccpb.PUT {
			out[i] = &mvccpb.Event{Type: mvccpb.PUT, Kv: decoded(t, ev.Kv)}
			continue
		}
		out[i] = &mvccpb.Event{Type: ev.Type, Kv: proto.Clone(ev.Kv).(*mvccpb.KeyValue)}
	}
	return out
}

func decodedAll(t testing.TB, kvs []*mvccpb.KeyValue) []*mvccpb.KeyValue {
	out := make([]*mvccpb.KeyValue, len(kvs))
	for i, kv := range kvs {
		out[i] = decoded(t, kv)
	}
	return out
}

// renderKV renders every field of a KeyValue, and checks that the store's
// encoding of it is protobuf's.
func renderKV(t testing.TB, kv *mvccpb.KeyValue, stored bool) string {
	t.Helper()
	if kv == nil {
		return "<nil>"
	}
	if stored {
		enc, err := revtree.AppendKeyValue(nil, kv)
		if err != nil {
			t.Fatalf("AppendKeyValue(%q): %v", kv.Key, err)
		}
		want, err := proto.Marshal(kv)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(enc, want) {
			t.Errorf("stored encoding of %q is %x, protobuf's %x", kv.Key, enc, want)
		}
	}
	return fmt.Sprintf("%q=%q c%d m%d v%d l%d", kv.Key, kv.Value, kv.CreateRevision, kv.ModRevision, kv.Version, kv.Lease)
}

// renderView renders the whole keyspace of a view.
func renderView(t testing.TB, v revtree.View) string { return renderViewEnc(t, v, true) }

// renderViewEnc is renderView, checking the key-values' encodings if
// check.
func renderViewEnc(t testing.TB, v revtree.View, check bool) string {
	t.Helper()
	resp := v.Range(&pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}, revtree.RangeOptions{})
	var b strings.Builder
	fmt.Fprintf(&b, "rev %d store %d count %d:", v.Rev, v.StoreRev, resp.Count)
	for _, kv := range resp.Kvs {
		b.WriteString(" ")
		b.WriteString(renderKV(t, kv, check))
	}
	return b.String()
}

// renderBatches renders events: types, key-values, prev key-values.
func renderBatches(t testing.TB, batches []revtree.Batch) string {
	t.Helper()
	var b strings.Builder
	for _, bt := range batches {
		fmt.Fprintf(&b, "%d[", bt.Rev)
		for _, ev := range bt.Events {
			fmt.Fprintf(&b, " %s %s prev %s;", ev.Type, renderKV(t, ev.Kv, ev.Type == mvccpb.PUT), renderKV(t, ev.PrevKv, true))
		}
		b.WriteString("]\n")
	}
	return b.String()
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

// storeState is everything a store answers, from revision from on.
func storeState(t testing.TB, s *revtree.Store, from int64) []string {
	t.Helper()
	out := []string{fmt.Sprintf("loaded %v rev %d compact %d oldest %d history-start %d snapshots %d approx %d history %d",
		s.Loaded(), s.Rev(), s.CompactRev(), s.OldestRev(), s.HistoryStart(), s.Snapshots(), s.ApproxBytes(), s.HistoryBytes())}
	for rev := from; rev <= s.Rev()+1; rev++ {
		v, err := s.ViewHeld(rev)
		line := fmt.Sprintf("view %d: %s", rev, errString(err))
		if err == nil {
			// Every key-value of a view between the oldest and the
			// newest is one of those or of an event: check the
			// encodings there only.
			check := rev == s.OldestRev() || rev == s.Rev()
			line = fmt.Sprintf("view %d: %s", rev, renderViewEnc(t, v, check))
		}
		_, err = s.View(rev)
		out = append(out, line, fmt.Sprintf("etcd view %d: %s", rev, errString(err)))
	}
	for _, start := range []int64{from + 1, s.HistoryStart()} {
		batches, upTo, err := s.EventsHeld(start, s.Rev(), 0)
		out = append(out, fmt.Sprintf("events from %d: up to %d, %s\n%s", start, upTo, errString(err), renderBatches(t, batches)))
		batches, upTo, err = s.EventsFrom(start, s.Rev(), 0)
		out = append(out, fmt.Sprintf("etcd events from %d: up to %d, %s\n%s", start, upTo, errString(err), renderBatches(t, batches)))
	}
	return out
}

// sameStores fails t where the stores answer differently.
func sameStores(t testing.TB, stage string, want, got *revtree.Store, from int64) {
	t.Helper()
	w, g := storeState(t, want, from), storeState(t, got, from)
	for i := range max(len(w), len(g)) {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			t.Errorf("%s: restored store differs:\nwant %s\ngot  %s", stage, wl, gl)
			return
		}
	}
}

type restoreCase struct {
	name      string
	seed      uint64
	revisions int
	compact   int64 // the compaction revision, below the base
}

// TestRestoreIsResetApplyAdvance: Restore(base, kvs, batches, rev,
// compact) makes the store that Reset(base, kvs, compact), an Apply of
// each batch and Advance(rev) make, at every revision: keyspace, events,
// counters and memory estimates; and both go on alike.
func TestRestoreIsResetApplyAdvance(t *testing.T) {
	const base = 40
	var cases []restoreCase
	for seed := range uint64(8) {
		cases = append(cases, restoreCase{name: fmt.Sprintf("seed%d", seed), seed: seed, revisions: 60, compact: int64(seed) * 5})
	}
	cases = append(cases,
		restoreCase{name: "no-revisions", seed: 99},
		restoreCase{name: "one-revision", seed: 98, revisions: 1},
	)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { checkRestoreCase(t, c, base) })
	}
}

func checkRestoreCase(t *testing.T, c restoreCase, base int64) {
	w, kvs := newRestoreWorkload(c.seed, base, 30)
	a, b := revtree.New(0), revtree.New(0)
	a.Reset(base, kvs, c.compact)
	var batches []revtree.Batch
	for range c.revisions {
		rev, evs := w.next()
		if _, err := a.Apply(rev, forApply(evs)); err != nil {
			t.Fatalf("Apply(%d): %v", rev, err)
		}
		batches = append(batches, revtree.Batch{Rev: rev, Events: forRestore(t, evs)})
	}
	end := w.rev + 3 // revisions after the last batch without events
	w.rev = end
	a.Advance(end)

	if err := b.Restore(base, decodedAll(t, kvs), batches, end, c.compact); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if !b.Loaded() || b.Generation() != a.Generation() {
		t.Errorf("restored: loaded %v, generation %d; want true, %d", b.Loaded(), b.Generation(), a.Generation())
	}
	sameStores(t, "restored", a, b, base)

	// Both go on alike: the restored index continues each key's versions
	// and fills in PrevKv.
	for range 30 {
		rev, evs := w.next()
		if _, err := a.Apply(rev, forApply(evs)); err != nil {
			t.Fatalf("Apply(%d) to the reset store: %v", rev, err)
		}
		if _, err := b.Apply(rev, forApply(evs)); err != nil {
			t.Fatalf("Apply(%d) to the restored store: %v", rev, err)
		}
	}
	sameStores(t, "after more revisions", a, b, base)
	a.Compact(end)
	b.Compact(end)
	sameStores(t, "after a compaction", a, b, base)
}

// restoreBudget is a history budget that the budget tests' workloads
// pass several times over.
const restoreBudget = 24 << 10

// sameHeldHistory fails t unless got answers as want at every revision
// want holds, and holds every one of them.
func sameHeldHistory(t testing.TB, stage string, want, got *revtree.Store) {
	t.Helper()
	if got.Rev() != want.Rev() || got.CompactRev() != want.CompactRev() {
		t.Errorf("%s: rev %d compact %d, want %d %d", stage, got.Rev(), got.CompactRev(), want.Rev(), want.CompactRev())
	}
	if got.HistoryStart() > want.HistoryStart() || got.OldestRev() > want.OldestRev() {
		t.Errorf("%s: holds history from %d (oldest snapshot %d), %d revisions fewer than the store it restores, which holds it from %d (oldest %d)",
			stage, got.HistoryStart(), got.OldestRev(), got.HistoryStart()-want.HistoryStart(), want.HistoryStart(), want.OldestRev())
		return
	}
	for rev := want.OldestRev(); rev <= want.Rev(); rev++ {
		wv, err := want.ViewHeld(rev)
		if err != nil {
			t.Fatalf("%s: ViewHeld(%d) of the original: %v", stage, rev, err)
		}
		gv, err := got.ViewHeld(rev)
		if err != nil {
			t.Errorf("%s: ViewHeld(%d): %v", stage, rev, err)
			continue
		}
		if w, g := renderView(t, wv), renderView(t, gv); w != g {
			t.Errorf("%s: at %d:\nwant %s\ngot  %s", stage, rev, w, g)
		}
	}
	wb, _, err := want.EventsHeld(want.HistoryStart(), want.Rev(), 0)
	if err != nil {
		t.Fatal(err)
	}
	gb, _, err := got.EventsHeld(want.HistoryStart(), want.Rev(), 0)
	if err != nil {
		t.Errorf("%s: EventsHeld(%d): %v", stage, want.HistoryStart(), err)
	} else if w, g := renderBatches(t, wb), renderBatches(t, gb); w != g {
		t.Errorf("%s: events from %d:\nwant %s\ngot  %s", stage, want.HistoryStart(), w, g)
	}
}

// retainedHistory reads what s holds as persist copies it: the keyspace
// before its first held revision (the view at its oldest snapshot, with
// that snapshot's events undone), and the events from then on, as
// Restore takes them.
func retainedHistory(t testing.TB, s *revtree.Store) (base int64, kvs []*mvccpb.KeyValue, batches []revtree.Batch) {
	t.Helper()
	start := s.HistoryStart()
	v, err := s.ViewHeld(s.OldestRev())
	if err != nil {
		t.Fatal(err)
	}
	held, _, err := s.EventsHeld(start, s.Rev(), 0)
	if err != nil {
		t.Fatal(err)
	}
	keyspace := map[string]*mvccpb.KeyValue{}
	v.Ascend([]byte{0}, nil, func(kv *mvccpb.KeyValue) bool {
		keyspace[string(kv.Key)] = proto.Clone(kv).(*mvccpb.KeyValue) // kv is the call's
		return true
	})
	if len(held) > 0 && held[0].Rev == s.OldestRev() {
		undone := map[string]bool{}
		for _, ev := range held[0].Events {
			if undone[string(ev.Kv.Key)] {
				continue
			}
			undone[string(ev.Kv.Key)] = true
			if ev.PrevKv == nil {
				delete(keyspace, string(ev.Kv.Key))
			} else {
				keyspace[string(ev.Kv.Key)] = ev.PrevKv
			}
		}
	}
	for _, kv := range keyspace {
		kvs = append(kvs, decoded(t, kv))
	}
	for _, b := range held {
		evs := make([]*mvccpb.Event, len(b.Events))
		for i, ev := range b.Events {
			evs[i] = &mvccpb.Event{Type: ev.Type, Kv: ev.Kv}
		}
		batches = append(batches, revtree.Batch{Rev: b.Rev, Events: forRestore(t, evs)})
	}
	return start - 1, kvs, batches
}

// TestRestoreUnderBudget: with a history budget, Restore drops history
// over it, oldest first, as Apply drops it: the restored store holds (at
// least) the history the applied one holds, within the budget, and
// answers alike at every revision of it. Its memory estimates are not
// compared: Apply's sweep runs a stretch at a time (sweep.go), so what
// awaits it depends on the path.
func TestRestoreUnderBudget(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			const base = 40
			w, kvs := newRestoreWorkload(100+seed, base, 30)
			a := revtree.New(0)
			a.SetMaxHistoryBytes(restoreBudget)
			a.Reset(base, kvs, 0)
			var all []revtree.Batch
			for range 150 {
				rev, evs := w.next()
				if _, err := a.Apply(rev, forApply(evs)); err != nil {
					t.Fatalf("Apply(%d): %v", rev, err)
				}
				all = append(all, revtree.Batch{Rev: rev, Events: forRestore(t, evs)})
			}
			a.Advance(w.rev + 2)
			if a.OldestRev() == base || a.HistoryTrimmed() == 0 {
				t.Fatalf("the budget dropped no history: the test tests nothing")
			}

			// What persist restores: the history the store held, under
			// the same budget. Nothing is dropped.
			t.Run("retained-history", func(t *testing.T) {
				b := revtree.New(0)
				b.SetMaxHistoryBytes(restoreBudget)
				base, kvs, batches := retainedHistory(t, a)
				if err := b.Restore(base, kvs, batches, a.Rev(), a.CompactRev()); err != nil {
					t.Fatal(err)
				}
				sameHeldHistory(t, "restored", a, b)
				if b.HistoryStart() != a.HistoryStart() || b.HistoryBytes() > restoreBudget {
					t.Errorf("restored: history from %d, %d bytes; want from %d, within %d", b.HistoryStart(), b.HistoryBytes(), a.HistoryStart(), restoreBudget)
				}
			})
			// Every revision since the load, more than the budget takes:
			// Restore drops what Apply dropped, and no more.
			t.Run("all-history", func(t *testing.T) {
				b := revtree.New(0)
				b.SetMaxHistoryBytes(restoreBudget)
				if err := b.Restore(base, decodedAll(t, kvs), all, a.Rev(), a.CompactRev()); err != nil {
					t.Fatal(err)
				}
				if b.HistoryBytes() > restoreBudget {
					t.Errorf("restored history of %d bytes, over the budget of %d", b.HistoryBytes(), restoreBudget)
				}
				t.Logf("budget %d: applied store holds %d revisions from %d in %d bytes; restored store %d from %d in %d bytes",
					restoreBudget, a.Snapshots(), a.HistoryStart(), a.HistoryBytes(), b.Snapshots(), b.HistoryStart(), b.HistoryBytes())
				sameHeldHistory(t, "restored", a, b)
			})
		})
	}
}

// restoreBase is a small keyspace at revision 100 for the refusals:
// a at version 3, b at version 1.
func restoreBase() []*mvccpb.KeyValue {
	return []*mvccpb.KeyValue{
		{Key: []byte("a"), Value: []byte("a3"), CreateRevision: 20, ModRevision: 50, Version: 3},
		{Key: []byte("b"), Value: []byte("b1"), CreateRevision: 60, ModRevision: 60, Version: 1},
	}
}

// TestRestoreRefusesInconsistentInput: Restore returns ErrInconsistent for
// events that do not follow (a delete of an absent key, a version that
// does not continue, revisions out of order or at the base, an event of
// another revision, a revision without events, a restored revision below
// the last batch's) and leaves the store as it was, loaded or not.
func TestRestoreRefusesInconsistentInput(t *testing.T) {
	put := func(key, value string, create, mod, ver int64) *mvccpb.Event {
		return &mvccpb.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(key), Value: []byte(value), CreateRevision: create, ModRevision: mod, Version: ver}}
	}
	del := func(key string, mod int64) *mvccpb.Event {
		return &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(key), ModRevision: mod}}
	}
	batch := func(rev int64, evs ...*mvccpb.Event) revtree.Batch { return revtree.Batch{Rev: rev, Events: evs} }
	// Valid revisions first, so that the refusal comes after the restore
	// has changed its own index: new keys, new versions, a delete.
	valid := func() []revtree.Batch {
		return []revtree.Batch{
			batch(101, put("c", "c1", 101, 101, 1), put("a", "a4", 20, 101, 4)),
			batch(103, del("b", 103), put("d", "d1", 103, 103, 1)),
		}
	}
	cases := []struct {
		name    string
		batches func() []revtree.Batch
		rev     int64
	}{
		{"delete-of-absent-key", func() []revtree.Batch { return []revtree.Batch{batch(101, del("zz", 101))} }, 101},
		{"delete-of-deleted-key", func() []revtree.Batch { return append(valid(), batch(104, del("b", 104))) }, 104},
		{"delete-twice-in-a-txn", func() []revtree.Batch { return []revtree.Batch{batch(101, del("a", 101), del("a", 101))} }, 101},
		{"version-skips", func() []revtree.Batch { return []revtree.Batch{batch(101, put("a", "a5", 20, 101, 5))} }, 101},
		{"version-repeats", func() []revtree.Batch { return append(valid(), batch(104, put("a", "a4'", 20, 104, 4))) }, 104},
		{"new-key-not-at-version-1", func() []revtree.Batch { return append(valid(), batch(104, put("e", "e2", 104, 104, 2))) }, 104},
		{"deleted-key-not-at-version-1", func() []revtree.Batch { return append(valid(), batch(104, put("b", "b2", 60, 104, 2))) }, 104},
		{"txn-version-skips", func() []revtree.Batch {
			return []revtree.Batch{batch(101, put("a", "a4", 20, 101, 4), put("a", "a5", 20, 101, 6))}
		}, 101},
		{"revisions-out-of-order", func() []revtree.Batch {
			return []revtree.Batch{batch(102, put("c", "c1", 102, 102, 1)), batch(101, put("d", "d1", 101, 101, 1))}
		}, 102},
		{"revision-twice", func() []revtree.Batch {
			return []revtree.Batch{batch(101, put("c", "c1", 101, 101, 1)), batch(101, put("d", "d1", 101, 101, 1))}
		}, 101},
		{"revision-at-base", func() []revtree.Batch { return []revtree.Batch{batch(100, put("c", "c1", 100, 100, 1))} }, 100},
		{"revision-below-base", func() []revtree.Batch { return []revtree.Batch{batch(90, put("c", "c1", 90, 90, 1))} }, 100},
		{"event-of-another-revision", func() []revtree.Batch { return []revtree.Batch{batch(101, put("c", "c1", 102, 102, 1))} }, 102},
		{"revision-without-events", func() []revtree.Batch { return append(valid(), batch(104)) }, 104},
		{"unknown-event-type", func() []revtree.Batch {
			ev := put("c", "c1", 104, 104, 1)
			ev.Type = 7
			return append(valid(), batch(104, ev))
		}, 104},
		{"rev-below-last-batch", valid, 102},
		{"rev-below-base", func() []revtree.Batch { return nil }, 99},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// A loaded store, and its twin that no Restore touches.
			w, kvs := newRestoreWorkload(7, 40, 20)
			s, twin := revtree.New(0), revtree.New(0)
			s.Reset(40, kvs, 5)
			twin.Reset(40, kvs, 5)
			for range 15 {
				rev, evs := w.next()
				if _, err := s.Apply(rev, forApply(evs)); err != nil {
					t.Fatal(err)
				}
				if _, err := twin.Apply(rev, forApply(evs)); err != nil {
					t.Fatal(err)
				}
			}
			held, err := s.View(0)
			if err != nil {
				t.Fatal(err)
			}
			heldBefore := renderView(t, held)
			before := storeState(t, s, 40)
			gen := s.Generation()

			batches := c.batches()
			for i := range batches {
				for _, ev := range batches[i].Events {
					if ev.Type == mvccpb.PUT {
						ev.Kv = decoded(t, ev.Kv)
					}
				}
			}
			err = s.Restore(100, decodedAll(t, restoreBase()), batches, c.rev, 0)
			if !errors.Is(err, revtree.ErrInconsistent) {
				t.Fatalf("Restore: %v, want ErrInconsistent", err)
			}
			if g := s.Generation(); g != gen {
				t.Errorf("generation %d after a refused Restore, was %d", g, gen)
			}
			after := storeState(t, s, 40)
			if !slices.Equal(before, after) {
				t.Errorf("a refused Restore changed the store:\nbefore %q\nafter  %q", before, after)
			}
			if got := renderView(t, held); got != heldBefore {
				t.Errorf("a view held across the refused Restore reads %s, was %s", got, heldBefore)
			}
			// The writer's index is the store's own again: the store
			// goes on as its twin does.
			for range 10 {
				rev, evs := w.next()
				if _, err := s.Apply(rev, forApply(evs)); err != nil {
					t.Fatalf("Apply(%d) after a refused Restore: %v", rev, err)
				}
				if _, err := twin.Apply(rev, forApply(evs)); err != nil {
					t.Fatal(err)
				}
			}
			sameStores(t, "after a refused Restore", twin, s, 40)

			// An unloaded store stays unloaded.
			fresh := revtree.New(0)
			batches = c.batches()
			for i := range batches {
				for _, ev := range batches[i].Events {
					if ev.Type == mvccpb.PUT {
						ev.Kv = decoded(t, ev.Kv)
					}
				}
			}
			if err := fresh.Restore(100, decodedAll(t, restoreBase()), batches, c.rev, 0); !errors.Is(err, revtree.ErrInconsistent) {
				t.Fatalf("Restore of an unloaded store: %v, want ErrInconsistent", err)
			}
			if fresh.Loaded() || fresh.Generation() != 0 {
				t.Errorf("unloaded store after a refused Restore: loaded %v, generation %d", fresh.Loaded(), fresh.Generation())
			}
			if _, err := fresh.View(0); !errors.Is(err, revtree.ErrNotLoaded) {
				t.Errorf("View after a refused Restore of an unloaded store: %v, want ErrNotLoaded", err)
			}
		})
	}
}

// TestRestoreReplacesTheStore: Restore over a loaded store replaces all
// of it in a new generation (views taken before keep reading the old
// one), keeps the highest compaction revision as Reset does, and takes
// the events after the last batch as Advance does.
func TestRestoreReplacesTheStore(t *testing.T) {
	s := revtree.New(0)
	w, kvs := newRestoreWorkload(3, 40, 20)
	s.Reset(40, kvs, 30)
	for range 10 {
		rev, evs := w.next()
		if _, err := s.Apply(rev, forApply(evs)); err != nil {
			t.Fatal(err)
		}
	}
	old, err := s.View(0)
	if err != nil {
		t.Fatal(err)
	}
	oldRender := renderView(t, old)
	gen := s.Generation()

	batches := []revtree.Batch{{Rev: 104, Events: forRestore(t, []*mvccpb.Event{
		{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("a"), Value: []byte("a4"), CreateRevision: 20, ModRevision: 104, Version: 4}},
		{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte("b"), ModRevision: 104}},
	})}}
	if err := s.Restore(100, decodedAll(t, restoreBase()), batches, 110, 10); err != nil {
		t.Fatal(err)
	}
	if s.Generation() != gen+1 {
		t.Errorf("generation %d after Restore, want %d", s.Generation(), gen+1)
	}
	if s.Rev() != 110 || s.CompactRev() != 30 || s.OldestRev() != 100 || s.HistoryStart() != 101 || s.Snapshots() != 2 {
		t.Errorf("restored: rev %d compact %d oldest %d history-start %d snapshots %d; want 110 30 100 101 2",
			s.Rev(), s.CompactRev(), s.OldestRev(), s.HistoryStart(), s.Snapshots())
	}
	for rev, want := range map[int64]string{
		100: `rev 100 store 110 count 2: "a"="a3" c20 m50 v3 l0 "b"="b1" c60 m60 v1 l0`,
		103: `rev 103 store 110 count 2: "a"="a3" c20 m50 v3 l0 "b"="b1" c60 m60 v1 l0`,
		104: `rev 104 store 110 count 1: "a"="a4" c20 m104 v4 l0`,
		110: `rev 110 store 110 count 1: "a"="a4" c20 m104 v4 l0`,
	} {
		v, err := s.View(rev)
		if err != nil {
			t.Fatalf("View(%d): %v", rev, err)
		}
		if got := renderView(t, v); got != want {
			t.Errorf("View(%d):\n got %s\nwant %s", rev, got, want)
		}
	}
	if _, err := s.View(99); !errors.Is(err, revtree.ErrNotRetained) {
		t.Errorf("View(99): %v, want ErrNotRetained", err)
	}
	got, _, err := s.EventsHeld(101, 110, 0)
	if err != nil {
		t.Fatal(err)
	}
	want := "104[ PUT \"a\"=\"a4\" c20 m104 v4 l0 prev \"a\"=\"a3\" c20 m50 v3 l0; DELETE \"b\"=\"\" c0 m104 v0 l0 prev \"b\"=\"b1\" c60 m60 v1 l0;]\n"
	if r := renderBatches(t, got); r != want {
		t.Errorf("events:\n got %s\nwant %s", r, want)
	}
	if got := renderView(t, old); got != oldRender {
		t.Errorf("a view taken before Restore reads %s, was %s", got, oldRender)
	}
}
