package revtree

import (
	"bytes"
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// TestPackedSlabsEvacuate: a load packs its encodings into slabs; as the
// sweep prunes rewritten keys' loaded versions, a slab left holding less
// than half of its bytes is evacuated (its live encodings copied out, the
// slab forgotten), never one holding more; reads answer the same
// throughout, and the estimate counts what slabs hold beyond the index.
func TestPackedSlabsEvacuate(t *testing.T) {
	const keys = 3000
	value := bytes.Repeat([]byte{'v'}, 1000)
	s := New(8)
	kvs := make([]*mvccpb.KeyValue, keys)
	for i := range kvs {
		kvs[i] = &mvccpb.KeyValue{Key: fmt.Appendf(nil, "/registry/configmaps/%05d", i), Value: value, CreateRevision: 1, ModRevision: 1, Version: 1}
	}
	s.Reset(1, kvs, 0)
	loaded := len(s.slabs.Slabs())
	if loaded < 10 || s.slabs.Live() != s.liveBytes {
		t.Fatalf("after the load: %d slabs, %d live bytes in them, %d live bytes in all", loaded, s.slabs.Live(), s.liveBytes)
	}
	all := &pb.RangeRequest{Key: []byte{0}, RangeEnd: []byte{0}}
	rev := int64(1)
	// Rewrite two keys in three, then compact: their loaded versions go.
	for i := range keys {
		if i%3 == 2 {
			continue
		}
		rev++
		kv := &mvccpb.KeyValue{Key: kvs[i].Key, Value: []byte("new"), CreateRevision: 1, ModRevision: rev, Version: 2}
		if _, err := s.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}); err != nil {
			t.Fatal(err)
		}
	}
	before, _ := s.Range(all, RangeOptions{})
	s.Compact(rev)
	after, _ := s.Range(all, RangeOptions{})
	if len(after.Kvs) != keys || !proto.Equal(before, after) {
		t.Fatalf("reads changed when slabs were evacuated")
	}
	for _, sl := range s.slabs.Slabs() {
		if 2*sl.Live() < int64(sl.Cap()) {
			t.Errorf("a slab holds %d of its %d bytes, and was not evacuated", sl.Live(), sl.Cap())
		}
	}
	if len(s.slabs.Slabs()) >= loaded/2 {
		t.Errorf("%d of %d slabs left once two keys in three were rewritten", len(s.slabs.Slabs()), loaded)
	}
	if s.slabDead != s.slabs.Dead() {
		t.Errorf("the estimate counts %d dead slab bytes, the slabs hold %d", s.slabDead, s.slabs.Dead())
	}
	// The keys left from the load were copied out of their slabs.
	for i := 2; i < keys; i += 3 {
		h, ok := s.index.Get(searchFor(kvs[i].Key))
		if !ok || !bytes.Equal(h.latest().KV(&storedkv.KVMaker{}).Value, value) {
			t.Fatalf("%q lost its value", kvs[i].Key)
		}
	}
}
