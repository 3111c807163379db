package revtree

import (
	"fmt"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Stored key-values and their encodings.
//
// A KeyValue the store keeps is never changed and is read by every
// snapshot that holds it, so its protobuf encoding is made once, when it
// is applied, and a Range response is its header followed by those
// encodings (AppendRangeResponse): marshalling the key-values was most of
// a large read's CPU. The encoding costs no memory of its own: the
// KeyValue's Key and Value are slices of it, in place of the separate key
// and value a decoded KeyValue has.
//
// Invariant: every *mvccpb.KeyValue in a store's trees, and every Kv of a
// put event the store applied, is the kv field of an entry made by
// newEntry; entryOf relies on it. Delete events keep the tombstone they
// came with.

// entry is a stored KeyValue with the length of its encoding, which starts
// keyOffset bytes before kv.Key's first byte. kv comes first, so that a
// *mvccpb.KeyValue of the store is also a pointer to its entry. The int32
// fits in the KeyValue struct's trailing padding's size class: an entry
// takes the same 128 bytes as a KeyValue.
type entry struct {
	kv     mvccpb.KeyValue
	encLen int32 // 0: no encoding (an empty key, or one past 2 GiB)
}

// newEntry returns the stored copy of kv: the same fields, its key and
// value in one buffer that is also its encoding, the bytes proto.Marshal
// gives for kv.
func newEntry(kv *mvccpb.KeyValue) *mvccpb.KeyValue {
	e := &entry{}
	unknown := kv.ProtoReflect().GetUnknown()
	size := kvEncodedSize(kv, len(unknown))
	if len(kv.Key) == 0 || size > 1<<31-1 {
		// Never from etcd (keys are not empty; requests are far
		// smaller): kept as it is, encoded by protobuf when read.
		e.kv.Key, e.kv.Value = kv.Key, kv.Value
		setFields(&e.kv, kv, unknown)
		return &e.kv
	}
	enc := make([]byte, 0, size)
	enc = protowire.AppendTag(enc, 1, protowire.BytesType)
	enc = protowire.AppendVarint(enc, uint64(len(kv.Key)))
	keyStart := len(enc)
	enc = append(enc, kv.Key...)
	keyEnd := len(enc)
	enc = appendVarintField(enc, 2, kv.CreateRevision)
	enc = appendVarintField(enc, 3, kv.ModRevision)
	enc = appendVarintField(enc, 4, kv.Version)
	valueStart, valueEnd := 0, 0
	if len(kv.Value) > 0 {
		enc = protowire.AppendTag(enc, 5, protowire.BytesType)
		enc = protowire.AppendVarint(enc, uint64(len(kv.Value)))
		valueStart = len(enc)
		enc = append(enc, kv.Value...)
		valueEnd = len(enc)
	}
	enc = appendVarintField(enc, 6, kv.Lease)
	enc = append(enc, unknown...)
	// Three-index slices: an append to Key or Value never writes into
	// the encoding.
	e.kv.Key = enc[keyStart:keyEnd:keyEnd]
	if valueEnd > valueStart {
		e.kv.Value = enc[valueStart:valueEnd:valueEnd]
	}
	setFields(&e.kv, kv, unknown)
	e.encLen = int32(len(enc))
	return &e.kv
}

// setFields copies kv's fields other than key and value into dst.
func setFields(dst, kv *mvccpb.KeyValue, unknown []byte) {
	dst.CreateRevision = kv.CreateRevision
	dst.ModRevision = kv.ModRevision
	dst.Version = kv.Version
	dst.Lease = kv.Lease
	if len(unknown) > 0 {
		dst.ProtoReflect().SetUnknown(append([]byte(nil), unknown...))
	}
}

func kvEncodedSize(kv *mvccpb.KeyValue, unknown int) int {
	n := bytesFieldSize(len(kv.Key)) + varintFieldSize(kv.CreateRevision) +
		varintFieldSize(kv.ModRevision) + varintFieldSize(kv.Version) + varintFieldSize(kv.Lease) + unknown
	if len(kv.Value) > 0 {
		n += bytesFieldSize(len(kv.Value))
	}
	return n
}

// bytesFieldSize is the size of a length-delimited field of n bytes with a
// one-byte tag (field numbers below 16).
func bytesFieldSize(n int) int { return 1 + protowire.SizeVarint(uint64(n)) + n }

// varintFieldSize is the size of an int64 field with a one-byte tag, 0 if
// v is 0 (proto3 leaves it out).
func varintFieldSize(v int64) int {
	if v == 0 {
		return 0
	}
	return 1 + protowire.SizeVarint(uint64(v))
}

func appendVarintField(b []byte, num protowire.Number, v int64) []byte {
	if v == 0 {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.VarintType)
	return protowire.AppendVarint(b, uint64(v))
}

// entryOf returns the entry whose kv field kv is (see the invariant).
func entryOf(kv *mvccpb.KeyValue) *entry { return (*entry)(unsafe.Pointer(kv)) }

// encoding returns the encoding of a stored KeyValue, nil if it has none.
func encoding(kv *mvccpb.KeyValue) []byte {
	n := entryOf(kv).encLen
	if n == 0 {
		return nil
	}
	keyOffset := 1 + protowire.SizeVarint(uint64(len(kv.Key)))
	start := unsafe.Add(unsafe.Pointer(unsafe.SliceData(kv.Key)), -keyOffset)
	return unsafe.Slice((*byte)(start), n)
}

// Field numbers and tags of RangeResponse (rpc.proto).
const (
	rangeHeaderTag = 1<<3 | 2 // header, length-delimited
	rangeKVTag     = 2<<3 | 2 // kvs, length-delimited
	rangeMoreTag   = 3<<3 | 0 // more, varint
	rangeCountTag  = 4<<3 | 0 // count, varint
)

// RangeResponseSize returns the encoded size of resp, a response that
// View.Range returned for r, with its header filled in since; the size
// is proto.Size's, read from the stored encodings.
func RangeResponseSize(r *pb.RangeRequest, resp *pb.RangeResponse) int {
	n := 0
	if resp.Header != nil {
		n += bytesFieldSize(proto.Size(resp.Header))
	}
	for _, kv := range resp.Kvs {
		if enc := storedEncoding(r, kv); enc != nil {
			n += bytesFieldSize(len(enc))
		} else {
			n += bytesFieldSize(proto.Size(kv))
		}
	}
	if resp.More {
		n += 2
	}
	return n + varintFieldSize(resp.Count)
}

// storedEncoding returns the stored encoding of kv, a key-value of
// View.Range's response to r; nil for the copies of a keys-only response,
// which have none, and for a stored key-value without one.
func storedEncoding(r *pb.RangeRequest, kv *mvccpb.KeyValue) []byte {
	if r.KeysOnly {
		return nil
	}
	return encoding(kv)
}

// AppendRangeResponse appends the encoding of resp, a response that
// View.Range returned for r, with its header filled in since: the bytes
// proto.Marshal gives, with each stored key-value's encoding copied
// rather than made again.
func AppendRangeResponse(b []byte, r *pb.RangeRequest, resp *pb.RangeResponse) ([]byte, error) {
	var err error
	if resp.Header != nil {
		b = protowire.AppendVarint(b, rangeHeaderTag)
		b = protowire.AppendVarint(b, uint64(proto.Size(resp.Header)))
		if b, err = (proto.MarshalOptions{UseCachedSize: true}).MarshalAppend(b, resp.Header); err != nil {
			return nil, err
		}
	}
	for _, kv := range resp.Kvs {
		enc := storedEncoding(r, kv)
		if enc == nil {
			b = protowire.AppendVarint(b, rangeKVTag)
			b = protowire.AppendVarint(b, uint64(proto.Size(kv)))
			if b, err = (proto.MarshalOptions{UseCachedSize: true}).MarshalAppend(b, kv); err != nil {
				return nil, err
			}
			continue
		}
		b = protowire.AppendVarint(b, rangeKVTag)
		b = protowire.AppendVarint(b, uint64(len(enc)))
		b = append(b, enc...)
	}
	if resp.More {
		b = append(b, rangeMoreTag, 1)
	}
	if resp.Count != 0 {
		b = protowire.AppendVarint(b, rangeCountTag)
		b = protowire.AppendVarint(b, uint64(resp.Count))
	}
	return b, nil
}

// AppendKeyValue appends the protobuf encoding of kv, the bytes
// proto.Marshal gives, copied from the stored encoding. kv must be a
// KeyValue of the store: one a View returned, or the Kv or PrevKv of a put
// event the store holds (a delete's Kv is the tombstone etcd sent, not the
// store's).
func AppendKeyValue(b []byte, kv *mvccpb.KeyValue) ([]byte, error) {
	if enc := encoding(kv); enc != nil {
		return append(b, enc...), nil
	}
	out, err := proto.MarshalOptions{}.MarshalAppend(b, kv)
	if err != nil {
		return b, fmt.Errorf("encoding key %q: %w", kv.Key, err)
	}
	return out, nil
}

// DecodeKeyValue returns the store's copy of the KeyValue encoded in enc,
// the one newEntry makes of it, copying enc once: a store restored from
// the encodings it gave out (AppendKeyValue) takes them back as they are.
// An encoding other than the one newEntry makes (fields out of order,
// default values written, unknown fields) is decoded and encoded again.
func DecodeKeyValue(enc []byte) (*mvccpb.KeyValue, error) {
	if kv, ok := decodeCanonical(enc); ok {
		return kv, nil
	}
	kv := &mvccpb.KeyValue{}
	if err := proto.Unmarshal(enc, kv); err != nil {
		return nil, fmt.Errorf("decoding a key-value: %w", err)
	}
	if len(kv.Key) == 0 {
		return nil, fmt.Errorf("decoding a key-value: no key")
	}
	return newEntry(kv), nil
}

// decodeCanonical is DecodeKeyValue for an encoding as newEntry makes it:
// key first and not empty, then each other field once, in field order,
// none at its default value, nothing unknown.
func decodeCanonical(enc []byte) (*mvccpb.KeyValue, bool) {
	if len(enc) == 0 || len(enc) > 1<<31-1 {
		return nil, false
	}
	e := &entry{encLen: int32(len(enc))}
	buf := make([]byte, len(enc))
	copy(buf, enc)
	b := buf
	last := protowire.Number(0)
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num <= last || num > 6 {
			return nil, false
		}
		b, last = b[n:], num
		switch typ {
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || len(v) == 0 {
				return nil, false
			}
			off := len(buf) - len(b) + n - len(v)
			switch num {
			case 1:
				e.kv.Key = buf[off : off+len(v) : off+len(v)]
			case 5:
				e.kv.Value = buf[off : off+len(v) : off+len(v)]
			default:
				return nil, false
			}
			b = b[n:]
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 || v == 0 || n != protowire.SizeVarint(v) {
				return nil, false
			}
			switch num {
			case 2:
				e.kv.CreateRevision = int64(v)
			case 3:
				e.kv.ModRevision = int64(v)
			case 4:
				e.kv.Version = int64(v)
			case 6:
				e.kv.Lease = int64(v)
			default:
				return nil, false
			}
			b = b[n:]
		default:
			return nil, false
		}
	}
	if e.kv.Key == nil || &e.kv.Key[0] != &buf[1+protowire.SizeVarint(uint64(len(e.kv.Key)))] {
		return nil, false
	}
	return &e.kv, true
}
