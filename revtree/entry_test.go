package revtree

import (
	"bytes"
	"math"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

func randomKeyValue(r *rand.Rand) *mvccpb.KeyValue {
	revs := []int64{0, 1, 127, 128, 1 << 20, math.MaxInt64, -1}
	kv := &mvccpb.KeyValue{
		Key:            make([]byte, 1+r.IntN(300)),
		CreateRevision: revs[r.IntN(len(revs))],
		ModRevision:    revs[r.IntN(len(revs))],
		Version:        revs[r.IntN(len(revs))],
		Lease:          revs[r.IntN(len(revs))],
	}
	for i := range kv.Key {
		kv.Key[i] = byte(r.IntN(256))
	}
	switch r.IntN(4) {
	case 0: // no value
	case 1:
		kv.Value = []byte{}
	default:
		kv.Value = make([]byte, r.IntN(20000))
		for i := range kv.Value {
			kv.Value[i] = byte(r.IntN(256))
		}
	}
	if r.IntN(8) == 0 {
		// A field a newer etcd could add: kept, and encoded last, as
		// protobuf does.
		unknown := protowire.AppendTag(nil, 99, protowire.VarintType)
		kv.ProtoReflect().SetUnknown(protowire.AppendVarint(unknown, 7))
	}
	return kv
}

func TestEntryEncodingIsProtobufs(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 2000; i++ {
		kv := randomKeyValue(r)
		want, err := proto.Marshal(kv)
		if err != nil {
			t.Fatal(err)
		}
		stored := storedkv.New(kv)
		if !proto.Equal(stored, kv) {
			t.Fatalf("stored copy %v, want %v", stored, kv)
		}
		if got := storedkv.Encoding(stored); !bytes.Equal(got, want) {
			t.Fatalf("encoding of %v:\n%x\nproto.Marshal:\n%x", kv, got, want)
		}
		// The stored key and value are slices of the encoding that an
		// append cannot write through.
		if cap(stored.Key) != len(stored.Key) || cap(stored.Value) != len(stored.Value) {
			t.Fatalf("key cap %d len %d, value cap %d len %d", cap(stored.Key), len(stored.Key), cap(stored.Value), len(stored.Value))
		}
	}
}

func TestEntryWithoutEncoding(t *testing.T) {
	kv := &mvccpb.KeyValue{ModRevision: 3, Value: []byte("v")} // an empty key: never from etcd
	stored := storedkv.New(kv)
	if !proto.Equal(stored, kv) || storedkv.Encoding(stored) != nil {
		t.Fatalf("stored %v, encoding %x", stored, storedkv.Encoding(stored))
	}
	resp := &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: 3}, Kvs: []*mvccpb.KeyValue{stored, storedkv.New(&mvccpb.KeyValue{Key: []byte("a")})}, Count: 2}
	want, _ := proto.Marshal(resp)
	x := &Result{Header: resp.Header, Count: resp.Count, r: &pb.RangeRequest{}, kvs: resp.Kvs, made: true}
	got, err := x.AppendTo(nil)
	if x.Size() != len(want) {
		t.Errorf("size %d, encoded %d bytes", x.Size(), len(want))
	}
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("encoded %x, %v; want %x", got, err, want)
	}
}
