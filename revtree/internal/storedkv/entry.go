package storedkv

import (
	"fmt"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// RangeKVTag is the tag of RangeResponse's kvs field, which precedes
// every stored encoding (invariant 2).
const RangeKVTag = 2<<3 | 2 // kvs, length-delimited

// Entry is a stored KeyValue with the length of its encoding, which starts
// keyOffset bytes before kv.Key's first byte. kv comes first, so that a
// *mvccpb.KeyValue of the store is also a pointer to its entry (invariant
// 1). The int32 fits in the KeyValue struct's trailing padding's size
// class: an entry takes the same 128 bytes as a KeyValue. The zero Entry
// is ready for Version.KVIn.
type Entry struct {
	kv     mvccpb.KeyValue
	encLen int32 // 0: no encoding (an empty key, or one past 2 GiB)
	// canonical: the encoding is as newBare makes it (no unknown
	// fields), so that it can be kept bare.
	canonical bool
}

// New returns the stored copy of kv: the same fields, its key and
// value in one buffer that is also its encoding, the bytes proto.Marshal
// gives for kv, after its length.
func New(kv *mvccpb.KeyValue) *mvccpb.KeyValue {
	e := &Entry{}
	unknown := kv.ProtoReflect().GetUnknown()
	size := kvEncodedSize(kv, len(unknown))
	if len(kv.Key) == 0 || size > 1<<31-1 {
		// Never from etcd (keys are not empty; requests are far
		// smaller): kept as it is, encoded by protobuf when read.
		e.kv.Key, e.kv.Value = kv.Key, kv.Value
		setFields(&e.kv, kv, unknown)
		return &e.kv
	}
	buf := appendBareHeader(make([]byte, 0, bareLen(size)), size)
	enc, key, value := appendEncoding(buf[len(buf):], kv, unknown)
	// Three-index slices: an append to Key or Value never writes into
	// the encoding.
	e.kv.Key = enc[key[0]:key[1]:key[1]]
	if value[1] > value[0] {
		e.kv.Value = enc[value[0]:value[1]:value[1]]
	}
	setFields(&e.kv, kv, unknown)
	e.encLen = int32(len(enc))
	e.canonical = len(unknown) == 0
	return &e.kv
}

// newBare returns the bare encoding of kv: its encoding, as New makes
// it, after its length and the tag. It returns nil for a key-value that is
// kept as an entry only: one with no key or unknown fields, or past 2 GiB.
func newBare(kv *mvccpb.KeyValue) unsafe.Pointer {
	size, ok := bareSize(kv)
	if !ok {
		return nil
	}
	return bareAt(appendBare(make([]byte, 0, bareLen(size)), kv, size), 0)
}

// bareSize returns the size of kv's encoding, and whether kv can be kept
// bare: not one with no key or unknown fields, nor one past 2 GiB.
func bareSize(kv *mvccpb.KeyValue) (int, bool) {
	if len(kv.Key) == 0 || len(kv.ProtoReflect().GetUnknown()) > 0 {
		return 0, false
	}
	size := kvEncodedSize(kv, 0)
	return size, size <= 1<<31-1
}

// bareLen is the length of a bare encoding of an encoding of n bytes, the
// tag and the length included: the kvs field of n bytes.
func bareLen(n int) int { return 1 + protowire.SizeVarint(uint64(n)) + n }

// appendBareHeader appends what precedes an encoding of n bytes in its
// bare encoding: the tag, then the length.
func appendBareHeader(b []byte, n int) []byte {
	return protowire.AppendVarint(append(b, RangeKVTag), uint64(n))
}

// bareAt returns the bare encoding appended to b at off: a pointer to its
// length, after the tag.
func bareAt(b []byte, off int) unsafe.Pointer { return unsafe.Pointer(&b[off+1]) }

// appendBare appends the bare encoding of kv, whose encoding is size
// bytes (bareSize).
func appendBare(b []byte, kv *mvccpb.KeyValue, size int) []byte {
	b, _, _ = appendEncoding(appendBareHeader(b, size), kv, nil)
	return b
}

// appendBareEncoding appends a bare encoding of enc.
func appendBareEncoding(b, enc []byte) []byte {
	return append(appendBareHeader(b, len(enc)), enc...)
}

// appendEncoding appends kv's encoding, with unknown as its unknown
// fields, to b, and returns it with where the key and the value are in
// what it appended.
func appendEncoding(b []byte, kv *mvccpb.KeyValue, unknown []byte) (out []byte, key, value [2]int) {
	base := len(b)
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(len(kv.Key)))
	key[0] = len(b) - base
	b = append(b, kv.Key...)
	key[1] = len(b) - base
	b = appendVarintField(b, 2, kv.CreateRevision)
	b = appendVarintField(b, 3, kv.ModRevision)
	b = appendVarintField(b, 4, kv.Version)
	if len(kv.Value) > 0 {
		b = protowire.AppendTag(b, 5, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(len(kv.Value)))
		value[0] = len(b) - base
		b = append(b, kv.Value...)
		value[1] = len(b) - base
	}
	b = appendVarintField(b, 6, kv.Lease)
	return append(b, unknown...), key, value
}

// bare returns the entry's bare encoding, which its Key and Value are
// slices of; nil if it has none (newBare's cases). A bare encoding is
// a pointer to its length, after the tag.
func (e *Entry) bare() unsafe.Pointer {
	if e.encLen == 0 || !e.canonical {
		return nil
	}
	start := unsafe.Pointer(unsafe.SliceData(Encoding(&e.kv)))
	return unsafe.Add(start, -protowire.SizeVarint(uint64(e.encLen)))
}

// bareEncoding returns the encoding of a bare encoding, without its
// length.
func bareEncoding(p unsafe.Pointer) []byte {
	// The length, a varint, read a byte at a time: the buffer may end
	// a few bytes after it.
	var n uint64
	i := 0
	for shift := 0; ; shift += 7 {
		b := *(*byte)(unsafe.Add(p, i))
		i++
		n |= uint64(b&0x7f) << shift
		if b < 0x80 {
			break
		}
	}
	return unsafe.Slice((*byte)(unsafe.Add(p, i)), n)
}

// bareKey returns the key of a bare encoding.
func bareKey(p unsafe.Pointer) []byte {
	enc := bareEncoding(p)
	n, m := protowire.ConsumeVarint(enc[1:]) // the key's is the first field
	return enc[1+m : 1+m+int(n) : 1+m+int(n)]
}

// bareEntry makes e the entry of a bare encoding: its KeyValue's Key and
// Value are slices of it.
func bareEntry(p unsafe.Pointer, e *Entry) {
	if !parseCanonical(bareEncoding(p), e) {
		panic("revtree: a bare encoding that newBare did not make")
	}
}

// KVMaker makes the KeyValues of bare encodings for one read, in slabs
// that grow with the read: one allocation per slab, not per key-value.
type KVMaker struct {
	First int // entries of the first slab, if known (else 4)
	slab  []Entry
	made  int
}

// maxKVSlab is the most entries in one slab of a KVMaker (128 KiB).
const maxKVSlab = 1024

func (m *KVMaker) make(p unsafe.Pointer) *mvccpb.KeyValue {
	if len(m.slab) == 0 {
		n := min(max(m.made, 4), maxKVSlab)
		if m.made == 0 && m.First > 0 {
			n = min(m.First, maxKVSlab)
		}
		m.slab = make([]Entry, n)
	}
	e := &m.slab[0]
	m.slab = m.slab[1:]
	m.made++
	bareEntry(p, e)
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

// entryOf returns the entry whose kv field kv is (invariant 1).
func entryOf(kv *mvccpb.KeyValue) *Entry { return (*Entry)(unsafe.Pointer(kv)) }

// Encoding returns the encoding of a stored KeyValue, nil if it has none.
func Encoding(kv *mvccpb.KeyValue) []byte {
	n := entryOf(kv).encLen
	if n == 0 {
		return nil
	}
	keyOffset := 1 + protowire.SizeVarint(uint64(len(kv.Key)))
	start := unsafe.Add(unsafe.Pointer(unsafe.SliceData(kv.Key)), -keyOffset)
	return unsafe.Slice((*byte)(start), n)
}

// CanonicalEncoding returns the encoding of a stored KeyValue if it can be
// kept bare (it has no unknown fields), else nil.
func CanonicalEncoding(kv *mvccpb.KeyValue) []byte {
	if !entryOf(kv).canonical {
		return nil
	}
	return Encoding(kv)
}

// Field returns the kvs field of a stored encoding: the encoding after the
// tag and the length that precede it in the store (invariant 2).
func Field(enc []byte) []byte {
	n := 1 + protowire.SizeVarint(uint64(len(enc)))
	start := unsafe.Add(unsafe.Pointer(unsafe.SliceData(enc)), -n)
	return unsafe.Slice((*byte)(start), n+len(enc))
}

// Join returns run and f, the fields of two packed encodings, as one
// slice, if f starts where run ends: then they are in one slab (invariant
// 4), and the slice is the slab's bytes.
func Join(run, f []byte) ([]byte, bool) {
	if uintptr(unsafe.Pointer(unsafe.SliceData(run)))+uintptr(len(run)) != uintptr(unsafe.Pointer(unsafe.SliceData(f))) {
		return nil, false
	}
	return unsafe.Slice(unsafe.SliceData(run), len(run)+len(f)), true
}

// Append appends the protobuf encoding of kv, the bytes
// proto.Marshal gives, copied from the stored encoding. kv must be a
// KeyValue of the store: one a View returned, or the Kv or PrevKv of a put
// event the store holds (a delete's Kv is the tombstone etcd sent, not the
// store's).
func Append(b []byte, kv *mvccpb.KeyValue) ([]byte, error) {
	if enc := Encoding(kv); enc != nil {
		return append(b, enc...), nil
	}
	out, err := proto.MarshalOptions{}.MarshalAppend(b, kv)
	if err != nil {
		return b, fmt.Errorf("encoding key %q: %w", kv.Key, err)
	}
	return out, nil
}

// Decode returns the store's copy of the KeyValue encoded in enc,
// the one New makes of it, copying enc once: a store restored from
// the encodings it gave out (Append) takes them back as they are.
// An encoding other than the one New makes (fields out of order,
// default values written, unknown fields) is decoded and encoded again.
func Decode(enc []byte) (*mvccpb.KeyValue, error) {
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
	return New(kv), nil
}

// decodeCanonical is Decode for an encoding as New makes it
// (parseCanonical), copied after its length.
func decodeCanonical(enc []byte) (*mvccpb.KeyValue, bool) {
	if len(enc) == 0 || len(enc) > 1<<31-1 {
		return nil, false
	}
	buf := appendBareEncoding(make([]byte, 0, bareLen(len(enc))), enc)
	e := &Entry{}
	if !parseCanonical(buf[len(buf)-len(enc):], e) {
		return nil, false
	}
	return &e.kv, true
}

// parseCanonical makes e, a zero entry, the entry of enc, an encoding as
// New makes it: key first and not empty, then each other field once,
// in field order, none at its default value, nothing unknown. e's Key and
// Value are slices of enc. It reports false for any other encoding. Every
// read of a bare encoding parses it: the fields are read in their order,
// not looked up.
func parseCanonical(enc []byte, e *Entry) bool {
	if len(enc) < 3 || len(enc) > 1<<31-1 || enc[0] != 1<<3|byte(protowire.BytesType) {
		return false
	}
	key, i, ok := bytesAt(enc, 1)
	if !ok {
		return false
	}
	e.kv.Key = key
	last := protowire.Number(1)
	for i < len(enc) {
		tag := enc[i]
		num, typ := protowire.Number(tag>>3), protowire.Type(tag&7)
		if tag >= 0x80 || num <= last || num > 6 {
			return false
		}
		i++
		last = num
		if num == 5 {
			if typ != protowire.BytesType {
				return false
			}
			var value []byte
			if value, i, ok = bytesAt(enc, i); !ok {
				return false
			}
			e.kv.Value = value
			continue
		}
		if typ != protowire.VarintType {
			return false
		}
		var v uint64
		if v, i, ok = varintAt(enc, i); !ok || v == 0 {
			return false
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
		default: // 1: a second key
			return false
		}
	}
	e.encLen, e.canonical = int32(len(enc)), true
	return true
}

// varintAt reads the varint at b[i:], which must be as short as it can be,
// and returns it and the index after it.
func varintAt(b []byte, i int) (uint64, int, bool) {
	if i < len(b) && b[i] < 0x80 {
		return uint64(b[i]), i + 1, true // most are one byte
	}
	if i >= len(b) {
		return 0, i, false
	}
	v, n := protowire.ConsumeVarint(b[i:])
	if n < 0 || n != protowire.SizeVarint(v) {
		return 0, i, false
	}
	return v, i + n, true
}

// bytesAt reads the length-delimited field value, not empty, at b[i:], and
// returns it (a three-index slice of b) and the index after it.
func bytesAt(b []byte, i int) ([]byte, int, bool) {
	n, i, ok := varintAt(b, i)
	if !ok || n == 0 || n > uint64(len(b)-i) {
		return nil, i, false
	}
	end := i + int(n)
	return b[i:end:end], end, true
}

// KeyString returns key as a string without a copy: key must never change,
// as stored bytes never do (invariant 3), nor a tombstone's key.
func KeyString(key []byte) string { return unsafe.String(unsafe.SliceData(key), len(key)) }

// StringKey returns the bytes of a string KeyString made, without a copy;
// they must not be written.
func StringKey(k string) []byte { return unsafe.Slice(unsafe.StringData(k), len(k)) }
