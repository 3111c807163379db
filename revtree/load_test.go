package revtree

import (
	"runtime"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/proto"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// TestLoad: a keyspace loaded page by page is the keyspace Reset makes of
// the same KeyValues; the pages are not kept; ApproxBytes counts a load's
// copies while it grows (within TestMemoryEstimate's tolerance of the
// heap they take), and the store's own estimate once it is reset; a
// discarded load is no longer counted.
func TestLoad(t *testing.T) {
	const keys, page, tol = 10_000, 1000, 0.10
	for _, value := range []int{64, 1024} {
		w := newMemWorkload(keys, 0, value)
		rev, kvs, _ := w.loadAt(keys)
		want := New(DefaultDegree)
		want.Reset(rev, kvs, 0)

		s := New(DefaultDegree)
		h0 := liveHeapNow()
		l := s.NewLoad()
		for i := 0; i < len(kvs); i += page {
			// A fresh copy of each page, as decoded from etcd: the
			// load must not keep it.
			p := make([]*mvccpb.KeyValue, 0, page)
			for _, kv := range kvs[i:min(i+page, len(kvs))] {
				p = append(p, proto.Clone(kv).(*mvccpb.KeyValue))
			}
			l.Add(p)
		}
		h1 := liveHeapNow()
		if est := s.ApproxBytes(); !within(est, h1-h0, tol) {
			t.Errorf("value %d: a load of %d keys: estimate %d, heap %d", value, keys, est, h1-h0)
		}
		if l.Len() != keys {
			t.Fatalf("Len %d, want %d", l.Len(), keys)
		}
		s.ResetLoad(rev, l, 0)
		if got, want := s.ApproxBytes(), want.ApproxBytes(); got != want {
			t.Errorf("value %d: ApproxBytes %d after ResetLoad, %d after Reset", value, got, want)
		}
		if s.Rev() != rev || !s.Loaded() {
			t.Fatalf("store at %d (loaded %v), want %d", s.Rev(), s.Loaded(), rev)
		}
		gotView, err := s.View(rev)
		if err != nil {
			t.Fatal(err)
		}
		wantView, err := want.View(rev)
		if err != nil {
			t.Fatal(err)
		}
		var got []*mvccpb.KeyValue
		var m storedkv.KVMaker
		gotView.ascend([]byte{0}, nil, func(ver version) bool { got = append(got, ver.KV(&m)); return true })
		i := 0
		wantView.Ascend([]byte{0}, nil, func(kv *mvccpb.KeyValue) bool {
			if i >= len(got) || !proto.Equal(got[i], kv) {
				t.Fatalf("value %d: key %d differs from Reset's: %v", value, i, kv.Key)
			}
			if e1, e2 := storedkv.Encoding(got[i]), storedkv.Encoding(kv); string(e1) != string(e2) {
				t.Fatalf("value %d: key %q: encoding differs from Reset's", value, kv.Key)
			}
			i++
			return true
		})
		if i != len(got) || i != keys {
			t.Fatalf("value %d: %d keys loaded, Reset has %d, want %d", value, len(got), i, keys)
		}

		d := New(DefaultDegree)
		l = d.NewLoad()
		l.Add(kvs[:page])
		if d.ApproxBytes() == 0 {
			t.Error("a load in progress is not counted")
		}
		l.Discard()
		if got := d.ApproxBytes(); got != 0 {
			t.Errorf("ApproxBytes %d after Discard, want 0", got)
		}
		runtime.KeepAlive(want)
	}
}
