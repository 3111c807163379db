package revtree

import (
	"bytes"
	"fmt"
	"maps"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// modelKV is a key's state in sweepModel.
type modelKV struct {
	value                string
	create, mod, version int64
}

// sweepModel is the keyspace at every revision a sweep test wrote.
type sweepModel struct {
	mu     sync.Mutex
	states map[int64]map[string]modelKV // guarded by mu
}

func (m *sweepModel) set(rev int64, live map[string]modelKV) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.states[rev] = maps.Clone(live)
}

// check compares the store's view of rev with the model; a revision the
// store dropped meanwhile is skipped.
func (m *sweepModel) check(s *Store, rev int64) error {
	v, err := s.View(rev)
	if err != nil {
		return nil
	}
	m.mu.Lock()
	want := m.states[rev]
	m.mu.Unlock()
	got := map[string]modelKV{}
	v.Ascend([]byte{0}, []byte{0xff}, func(kv *mvccpb.KeyValue) bool {
		got[string(kv.Key)] = modelKV{string(kv.Value), kv.CreateRevision, kv.ModRevision, kv.Version}
		return true
	})
	if !maps.Equal(got, want) {
		return fmt.Errorf("at %d: %v, want %v", rev, got, want)
	}
	return nil
}

// checkSweptIndex sweeps everything pending, then checks that nothing
// awaits the sweep, that the index's counts are its contents', and that
// the only versions no retained revision can read are the ones the oldest
// snapshot's events displaced (its bytes count them until it goes).
func checkSweptIndex(t *testing.T, s *Store, where string) {
	t.Helper()
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	for range 100 { // readers may drop a snapshot between sweepAll and the check
		s.sweepAll()
		s.mu.RLock()
		if s.pendingBytes == 0 {
			break
		}
		s.mu.RUnlock()
	}
	defer s.mu.RUnlock()
	if s.pendingBytes != 0 || len(s.dirty) != 0 || s.sweep.running {
		t.Fatalf("%s: after sweepAll, %d bytes pending, %d keys marked, running %v", where, s.pendingBytes, len(s.dirty), s.sweep.running)
	}
	oldest, _ := s.snapshots.Min()
	displacedByOldest := map[string]bool{}
	for _, ev := range oldest.events {
		displacedByOldest[string(ev.Kv.Key)] = true
	}
	var indexBytes int64
	indexKeys := 0
	s.index.Ascend(func(h *keyHistory) bool {
		indexKeys++
		indexBytes += keyHistoryBytes(h.capacity())
		vs := h.published()
		kept, bared, _ := pruned(vs, oldest.rev)
		if len(kept) < len(vs) && !displacedByOldest[string(h.key())] {
			t.Errorf("%s: %q keeps %d versions no revision from %d on reads: %v", where, h.key(), len(vs)-len(kept), oldest.rev, vs)
		}
		if bared {
			t.Errorf("%s: %q keeps the entry of its one version, at %d, which no event from %d on holds", where, h.key(), vs[0].Rev(), oldest.rev)
		}
		return true
	})
	if indexKeys != s.indexKeys || indexBytes != s.indexBytes {
		t.Errorf("%s: the index holds %d keys in %d bytes, the store counts %d keys, %d bytes", where, indexKeys, indexBytes, s.indexKeys, s.indexBytes)
	}
}

// TestSweepLeavesNoUnreadableVersions: puts, deletes, Txns that touch a
// key twice, Advance gaps, compactions and budget changes, with readers
// that check every view against a model and (on every other seed) drop
// snapshots under mu alone, as enforceBudget does. Every 200 steps, once
// swept, the index keeps no version that the marks should have pruned.
func TestSweepLeavesNoUnreadableVersions(t *testing.T) {
	for seed := uint64(1); seed <= 12; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { sweepWorkload(t, seed, seed%2 == 0) })
	}
}

func sweepWorkload(t *testing.T, seed uint64, readersDrop bool) {
	keys := 30
	if seed%3 == 0 {
		keys = 400
	}
	rng := rand.New(rand.NewPCG(seed, 99))
	m := &sweepModel{states: map[int64]map[string]modelKV{}}
	live := map[string]modelKV{}
	var load []*mvccpb.KeyValue
	for i := 0; i < 20; i += 2 {
		k := fmt.Sprintf("k%02d", i)
		live[k] = modelKV{"init", 1, 1, 1}
		load = append(load, &mvccpb.KeyValue{Key: []byte(k), Value: []byte("init"), CreateRevision: 1, ModRevision: 1, Version: 1})
	}
	rev := int64(1)
	m.set(rev, live)
	s := New(2 + int(seed%5))
	s.SetMaxHistoryBytes(40_000)
	s.Reset(rev, load, 0)

	var stop atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	if readersDrop {
		for g := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(g), seed))
				for !stop.Load() {
					if lo, hi := max(s.OldestRev(), s.CompactRev()), s.Rev(); lo > 0 && hi >= lo {
						if err := m.check(s, lo+r.Int64N(hi-lo+1)); err != nil {
							errs <- err
							return
						}
					}
					if g == 1 && r.IntN(50) == 0 {
						s.mu.Lock()
						if s.snapshots.Len() > 2 {
							s.dropOldestLocked()
						}
						s.mu.Unlock()
					}
				}
			}()
		}
	}
	defer func() {
		stop.Store(true)
		wg.Wait()
	}()
	for step := range 4000 {
		switch x := rng.IntN(100); {
		case x < 8:
			for range 1 + rng.IntN(3) {
				rev++
				m.set(rev, live)
			}
			s.Advance(rev)
			continue
		case x < 11:
			if lo := max(s.CompactRev(), s.OldestRev()); rev >= lo {
				s.Compact(lo + rng.Int64N(rev-lo+1))
			}
			continue
		case x < 12:
			s.SetMaxHistoryBytes(int64(20_000 + rng.IntN(60_000)))
			continue
		}
		rev++
		var evs []*mvccpb.Event
		for range 1 + rng.IntN(3) {
			k := fmt.Sprintf("k%02d", rng.IntN(keys))
			if len(evs) > 0 && rng.IntN(3) == 0 {
				k = string(evs[0].Kv.Key) // a Txn that touches a key twice
			}
			cur, ok := live[k]
			if ok && rng.IntN(3) == 0 {
				evs = append(evs, &mvccpb.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(k), ModRevision: rev}})
				delete(live, k)
				continue
			}
			next := modelKV{string(bytes.Repeat([]byte{byte('a' + rng.IntN(26))}, 1+rng.IntN(2000))), rev, rev, 1}
			if ok {
				next.create, next.version = cur.create, cur.version+1
			}
			live[k] = next
			evs = append(evs, &mvccpb.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(k), Value: []byte(next.value), CreateRevision: next.create, ModRevision: rev, Version: next.version}})
		}
		m.set(rev, live)
		if _, err := s.Apply(rev, evs); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-errs:
			t.Fatal(err)
		default:
		}
		if step%50 == 49 {
			for r := max(s.CompactRev(), s.OldestRev()); r <= rev; r++ {
				if err := m.check(s, r); err != nil {
					t.Fatal(err)
				}
			}
		}
		if step%200 == 199 {
			checkSweptIndex(t, s, fmt.Sprintf("step %d, revision %d", step, rev))
		}
	}
}

// TestSweepKeepsBareEncodings: a loaded key is kept as its bare encoding;
// a put keeps its entry, shared with its event and the next put's PrevKv,
// while its event is retained; once compaction drops the event, the sweep
// keeps the bare encoding instead, reads answer the same, the estimate
// falls by the entry, and the next put's PrevKv is made of it.
func TestSweepKeepsBareEncodings(t *testing.T) {
	kv := func(key string, create, mod, ver int64) *mvccpb.KeyValue {
		return &mvccpb.KeyValue{Key: []byte(key), Value: []byte(fmt.Sprintf("%s@%d", key, mod)), CreateRevision: create, ModRevision: mod, Version: ver, Lease: 7}
	}
	s := New(8)
	s.Reset(3, []*mvccpb.KeyValue{kv("a", 1, 1, 1), kv("b", 2, 2, 1), kv("c", 3, 3, 1)}, 0)
	latest := func(key string) version {
		t.Helper()
		h, ok := s.index.Get(searchFor([]byte(key)))
		if !ok {
			t.Fatalf("%q is not in the index", key)
		}
		return h.latest()
	}
	for _, k := range []string{"a", "b", "c"} {
		if !latest(k).IsBare() {
			t.Errorf("loaded %q is kept as an entry", k)
		}
	}
	evs4, err := s.Apply(4, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv("a", 1, 4, 2)}})
	if err != nil {
		t.Fatal(err)
	}
	if got := evs4[0].PrevKv; got == nil || !bytes.Equal(got.Value, []byte("a@1")) || got.Lease != 7 || got.Version != 1 {
		t.Fatalf("PrevKv made of a bare encoding: %v", got)
	}
	if _, err := s.Apply(5, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv("b", 2, 5, 2)}}); err != nil {
		t.Fatal(err)
	}
	if v := latest("a"); v.IsBare() || v.EntryKV() != evs4[0].Kv {
		t.Fatalf("a's put at 4 is not kept as its event's entry")
	}
	all := &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}
	before, _ := s.Range(all, RangeOptions{})
	approx := s.ApproxBytes()

	s.Compact(5) // drops snapshots 3 and 4: a's event
	if !latest("a").IsBare() {
		t.Errorf("a's put at 4, whose event compaction dropped, still keeps its entry")
	}
	if latest("b").IsBare() {
		t.Errorf("b's put at 5, whose event is retained, lost its entry")
	}
	after, _ := s.Range(all, RangeOptions{})
	if !proto.Equal(before, after) {
		t.Errorf("reads changed when the sweep kept bare encodings:\nbefore %v\nafter  %v", before, after)
	}
	// Compaction freed snapshot 3 and 4 (their events) and a's entry.
	if freed := approx - s.ApproxBytes(); freed < storedkv.EntryBytes {
		t.Errorf("the estimate fell by %d bytes; want at least the entry's %d", freed, storedkv.EntryBytes)
	}
	evs, err := s.Apply(6, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv("a", 1, 6, 3)}})
	if err != nil {
		t.Fatal(err)
	}
	if got := evs[0].PrevKv; got == nil || !proto.Equal(got, after.Kvs[0]) {
		t.Errorf("PrevKv of a at 6: %v, want %v", got, after.Kvs[0])
	}
	var enc []byte
	if enc, err = AppendKeyValue(nil, evs[0].PrevKv); err != nil {
		t.Fatal(err)
	}
	if want, _ := proto.Marshal(after.Kvs[0]); !bytes.Equal(enc, want) {
		t.Errorf("the encoding of a PrevKv made of a bare encoding differs from proto.Marshal's")
	}
}
