package revtree

import (
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// AppendKeyValue appends the protobuf encoding of kv, the bytes
// proto.Marshal gives, copied from the stored encoding. kv must be a
// KeyValue of the store: one a View returned, or the Kv or PrevKv of a put
// event the store holds (a delete's Kv is the tombstone etcd sent, not the
// store's).
func AppendKeyValue(b []byte, kv *mvccpb.KeyValue) ([]byte, error) {
	return storedkv.Append(b, kv)
}

// DecodeKeyValue returns the store's copy of the KeyValue encoded in enc,
// copying enc once: a store restored from the encodings it gave out
// (AppendKeyValue) takes them back as they are. An encoding other than the
// one the store makes (fields out of order, default values written,
// unknown fields) is decoded and encoded again.
func DecodeKeyValue(enc []byte) (*mvccpb.KeyValue, error) {
	return storedkv.Decode(enc)
}
