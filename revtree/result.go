package revtree

import (
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Result is a Range's answer from a view (View.Result). Its key-values
// are kept as the store holds them, unless the request needed KeyValues
// to sort, filter or strip; Response makes the RangeResponse, and Size
// and AppendTo size and encode that response from the stored encodings
// without making it.
type Result struct {
	// Header, Count and More are the response's. The caller may change
	// them (the header's cluster fields; a stream's chunk) before it
	// sizes and encodes the result, and not after.
	Header *pb.ResponseHeader
	Count  int64
	More   bool

	r    *pb.RangeRequest
	vs   []version          // the key-values as stored, unless made
	kvs  []*mvccpb.KeyValue // the key-values, if made
	made bool
}

// Len returns the number of key-values.
func (x *Result) Len() int {
	if x.made {
		return len(x.kvs)
	}
	return len(x.vs)
}

// LastKey returns the key of the last key-value, nil if there is none.
func (x *Result) LastKey() []byte {
	switch {
	case x.made && len(x.kvs) > 0:
		return x.kvs[len(x.kvs)-1].Key
	case !x.made && len(x.vs) > 0:
		return x.vs[len(x.vs)-1].key()
	}
	return nil
}

// Response returns the RangeResponse: etcd's answer to the request.
func (x *Result) Response() *pb.RangeResponse {
	kvs := x.kvs
	if !x.made {
		kvs = makeKVs(x.vs)
	}
	return &pb.RangeResponse{Header: x.Header, Kvs: kvs, More: x.More, Count: x.Count}
}

// Field numbers and tags of RangeResponse (rpc.proto).
const (
	rangeHeaderTag = 1<<3 | 2 // header, length-delimited
	rangeKVTag     = 2<<3 | 2 // kvs, length-delimited
	rangeMoreTag   = 3<<3 | 0 // more, varint
	rangeCountTag  = 4<<3 | 0 // count, varint
)

// Size returns the encoded size of the response: proto.Size's.
func (x *Result) Size() int {
	n := 0
	if x.Header != nil {
		n += bytesFieldSize(proto.Size(x.Header))
	}
	if x.made {
		for _, kv := range x.kvs {
			if enc := x.storedEncoding(kv); enc != nil {
				n += bytesFieldSize(len(enc))
			} else {
				n += bytesFieldSize(proto.Size(kv))
			}
		}
	} else {
		for _, ver := range x.vs {
			if enc := versionEncoding(ver); enc != nil {
				n += bytesFieldSize(len(enc))
			} else {
				n += bytesFieldSize(proto.Size(&ver.entry().kv))
			}
		}
	}
	if x.More {
		n += 2
	}
	return n + varintFieldSize(x.Count)
}

// AppendTo appends the encoding of the response, the bytes proto.Marshal
// gives, with each stored key-value's encoding copied rather than made
// again.
func (x *Result) AppendTo(b []byte) ([]byte, error) {
	var err error
	if x.Header != nil {
		b = protowire.AppendVarint(b, rangeHeaderTag)
		b = protowire.AppendVarint(b, uint64(proto.Size(x.Header)))
		if b, err = (proto.MarshalOptions{UseCachedSize: true}).MarshalAppend(b, x.Header); err != nil {
			return nil, err
		}
	}
	if x.made {
		for _, kv := range x.kvs {
			if b, err = appendKVField(b, x.storedEncoding(kv), kv); err != nil {
				return nil, err
			}
		}
	} else {
		for _, ver := range x.vs {
			enc := versionEncoding(ver)
			var kv *mvccpb.KeyValue
			if enc == nil {
				kv = &ver.entry().kv
			}
			if b, err = appendKVField(b, enc, kv); err != nil {
				return nil, err
			}
		}
	}
	if x.More {
		b = append(b, rangeMoreTag, 1)
	}
	if x.Count != 0 {
		b = protowire.AppendVarint(b, rangeCountTag)
		b = protowire.AppendVarint(b, uint64(x.Count))
	}
	return b, nil
}

// appendKVField appends a kvs field: enc, the stored encoding, or kv
// encoded if enc is nil.
func appendKVField(b, enc []byte, kv *mvccpb.KeyValue) ([]byte, error) {
	b = protowire.AppendVarint(b, rangeKVTag)
	if enc != nil {
		b = protowire.AppendVarint(b, uint64(len(enc)))
		return append(b, enc...), nil
	}
	b = protowire.AppendVarint(b, uint64(proto.Size(kv)))
	return (proto.MarshalOptions{UseCachedSize: true}).MarshalAppend(b, kv)
}

// storedEncoding returns the stored encoding of kv, a made key-value of the
// result; nil for the copies of a keys-only response, which have none,
// and for a stored key-value without one.
func (x *Result) storedEncoding(kv *mvccpb.KeyValue) []byte {
	if x.r.KeysOnly {
		return nil
	}
	return encoding(kv)
}

// versionEncoding returns the encoding of what a put's version holds, nil
// for an entry without one.
func versionEncoding(ver version) []byte {
	if ver.isBare() {
		return bareEncoding(ver.p)
	}
	return encoding(&ver.entry().kv)
}
