package revtree

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// TestResultPiecesAreTheStoredBytes: a Range response's pieces are
// proto.Marshal's bytes of the response, and its key-values' fields are
// the stored bytes themselves, not copies, but for those under
// minPieceBytes, copied into the result's own buffer: fields packed one
// after the other in a slab make one piece, which never reaches past its
// slab nor includes the slab's last byte, so that no piece spans two
// allocations. The counting pass counts exactly what is made, and counts
// gone stale (the header changed after Size) cost nothing but room.
// Checked for a loaded keyspace of many slabs (values of every size up to
// past storedkv.MaxPackedBytes, which are not packed; and fields of 64 bytes each,
// which fill slabs of a multiple of 64 bytes to the last byte but for the
// rule), and after writes and a compaction have left entries, bare
// encodings of their own and evacuated slabs beside the packed ones.
func TestResultPiecesAreTheStoredBytes(t *testing.T) {
	t.Run("random", func(t *testing.T) {
		r := rand.New(rand.NewPCG(7, 8))
		testResultPieces(t, r, func() int {
			if r.IntN(100) == 0 {
				return storedkv.MaxPackedBytes + r.IntN(100)
			}
			return r.IntN(400)
		})
	})
	t.Run("64-byte fields", func(t *testing.T) {
		kv := &mvccpb.KeyValue{Key: []byte("k/00000"), CreateRevision: 5000, ModRevision: 5000, Version: 1}
		for len(storedkv.Field(storedkv.Encoding(storedkv.New(kv)))) < 64 {
			kv.Value = append(kv.Value, 'v')
		}
		testResultPieces(t, rand.New(rand.NewPCG(9, 10)), func() int { return len(kv.Value) })
	})
}

// testResultPieces is TestResultPiecesAreTheStoredBytes for values of the
// sizes size returns: 5000 keys loaded at revision 5000.
func testResultPieces(t *testing.T, r *rand.Rand, size func() int) {
	const keys = 5000
	value := func() []byte {
		v := make([]byte, size())
		for i := range v {
			v[i] = byte(r.IntN(256))
		}
		return v
	}
	s := New(8)
	kvs := make([]*mvccpb.KeyValue, keys)
	for i := range kvs {
		kvs[i] = &mvccpb.KeyValue{Key: fmt.Appendf(nil, "k/%05d", i), Value: value(), CreateRevision: keys, ModRevision: keys, Version: 1}
	}
	s.Reset(keys, kvs, 0)
	if len(s.slabs.Slabs()) < 10 {
		t.Fatalf("the load packed %d slabs; want more", len(s.slabs.Slabs()))
	}
	all := &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}
	check := func(name string, rev int64, maxPieces int) {
		t.Helper()
		if maxPieces <= 0 {
			t.Fatalf("%s: no bound", name) // keep the bound's arithmetic honest
		}
		v, err := s.View(rev)
		if err != nil {
			t.Fatal(err)
		}
		x := v.Result(all, RangeOptions{})
		want, err := proto.Marshal(x.Response())
		if err != nil {
			t.Fatal(err)
		}
		pieces, err := x.AppendPieces(nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := bytes.Join(pieces, nil); !bytes.Equal(got, want) {
			t.Fatalf("%s: the pieces are not proto.Marshal's bytes of the response", name)
		}
		// The counting pass counts what the second one makes.
		x.Size()
		c := pieceWriter{count: true}
		if x.writePieces(&c) != nil {
			t.Fatal("writePieces failed")
		}
		w := pieceWriter{own: make([]byte, 0, c.ownBytes)}
		if x.writePieces(&w) != nil {
			t.Fatal("writePieces failed")
		}
		x.releaseFields()
		if len(w.out) != c.pieces || len(w.own) != c.ownBytes || cap(w.own) != c.ownBytes || len(pieces) != c.pieces {
			t.Fatalf("%s: counted %d pieces and %d own bytes, made %d and %d (AppendPieces %d)", name, c.pieces, c.ownBytes, len(w.out), len(w.own), len(pieces))
		}
		own := uintptr(unsafe.Pointer(unsafe.SliceData(w.own)))
		for _, p := range w.out {
			if a := uintptr(unsafe.Pointer(unsafe.SliceData(p))); (a < own || a >= own+uintptr(len(w.own))) && len(p) < minPieceBytes {
				t.Fatalf("%s: a piece of the store's bytes of %d bytes, under %d", name, len(p), minPieceBytes)
			}
		}
		if len(pieces) > maxPieces {
			t.Errorf("%s: %d pieces for %d key-values; want at most %d", name, len(pieces), x.Len(), maxPieces)
		}
		stored := 0
		for _, p := range pieces {
			start := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
			sl := s.slabs.Find(p)
			if sl == nil {
				continue
			}
			stored++
			if slabEnd, _ := sl.Contains(p); start+uintptr(len(p)) >= slabEnd {
				t.Fatalf("%s: a piece of %d bytes reaches the last byte of its slab or past it", name, len(p))
			}
		}
		if stored == 0 {
			t.Fatalf("%s: no piece is a slab's bytes: the fields were copied", name)
		}
		t.Logf("%s: %d key-values in %d pieces, %d of them in slabs", name, x.Len(), len(pieces), stored)

		// Sized, then changed: the counts are short, the bytes right.
		x.Size()
		x.Header, x.More, x.Count = &pb.ResponseHeader{ClusterId: 1 << 60, MemberId: 7, Revision: rev, RaftTerm: 3}, true, 1<<40
		if want, err = proto.Marshal(x.Response()); err != nil {
			t.Fatal(err)
		}
		if pieces, err = x.AppendPieces(nil, nil); err != nil || !bytes.Equal(bytes.Join(pieces, nil), want) {
			t.Fatalf("%s: changed after Size, the pieces are not proto.Marshal's bytes (%v)", name, err)
		}
	}
	// A header, each slab's run and each unpacked value between, a count.
	check("loaded", keys, 2*len(s.slabs.Slabs())+keys/50)

	// Rewrite one key in four, then drop every revision but the last:
	// the sweep bares the entries and evacuates the slabs left under half.
	rev := int64(keys)
	for i := range keys {
		if r.IntN(4) > 0 {
			continue
		}
		rev++
		kv := &mvccpb.KeyValue{Key: kvs[i].Key, Value: value(), CreateRevision: kvs[i].CreateRevision, ModRevision: rev, Version: 2}
		if _, err := s.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}); err != nil {
			t.Fatal(err)
		}
	}
	check("rewritten, at the load", keys, keys)
	check("rewritten, at the head", rev, keys+2)
	s.Compact(rev)
	check("compacted", rev, keys+2)
}
