// Package wirecodec is the gRPC server codec that sends messages already
// encoded: a watch event goes to thousands of watchers on many streams, and
// encoding it once for all of them instead of once per watcher is most of
// the fan-out's cost. grpc.PreparedMsg cannot do that, since it is encoded
// for one stream.
//
// An Encoded message is a list of pieces, byte slices sent one after the
// other, that may be shared by any number of messages and streams (a watch
// event's), be the bytes of a store (a Range response's key-values), or be
// a pooled buffer's, which gRPC gives back once it has written the message
// (NewEncodedOnce). Every other message goes through gRPC's own proto
// codec, unchanged.
//
// Invariant: the producer of an Encoded guarantees that its bytes are what
// proto.Marshal produces for the message it stands for; clients cannot tell
// the difference. The pieces are never modified once built.
package wirecodec

import (
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto" // registers the proto codec
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Piece wraps b as one piece of an Encoded. gRPC neither frees nor pools
// it (a mem.SliceBuffer's Ref and Free do nothing), so one piece can be in
// any number of messages, sent any number of times, concurrently; b must
// not be modified afterwards. Making the piece boxes the slice header: a
// piece used by many messages is worth making once.
func Piece(b []byte) mem.Buffer { return mem.SliceBuffer(b) }

// inlinePieces is how many pieces an Encoded holds without a second
// allocation: a watch response with one event is three (header, watch id,
// event).
const inlinePieces = 4

// Encoded is a message in its wire form. It is a proto.Message too, by
// decoding its bytes (ProtoReflect), so that whatever inspects a payload
// (interceptors, payload logging) still sees the message, and so that a
// server without this codec still sends it correctly, only slower.
type Encoded struct {
	typ    protoreflect.MessageType
	pieces mem.BufferSlice // every one a Piece, or a slice's (NewEncodedSlices)
	inline [inlinePieces]mem.Buffer

	decodeOnce sync.Once
	decoded    protoreflect.Message // set by decodeOnce
}

// NewEncoded returns the message of type typ whose encoding is the
// concatenation of pieces, each made by Piece. The pieces slice is copied,
// so the caller may reuse it.
func NewEncoded(typ protoreflect.MessageType, pieces []mem.Buffer) *Encoded {
	e := &Encoded{typ: typ}
	if len(pieces) <= len(e.inline) {
		e.pieces = e.inline[:copy(e.inline[:], pieces)]
	} else {
		e.pieces = slices.Clone(pieces)
	}
	return e
}

// NewEncodedSlices returns the message of type typ whose encoding is the
// concatenation of b's slices, each a piece as Piece would make it but
// without an allocation of its own: the pieces are b's elements
// themselves. The Encoded keeps b, which must not change afterwards, nor
// any of the bytes its slices hold. A message of many pieces costs one
// slot (a mem.Buffer) per piece, however large they are: a Range
// response whose pieces are the store's own bytes is not copied before
// gRPC's transport copies it into HTTP/2 frames.
func NewEncodedSlices(typ protoreflect.MessageType, b [][]byte) *Encoded {
	e := &Encoded{typ: typ}
	if len(b) <= len(e.inline) {
		e.pieces = e.inline[:len(b)]
	} else {
		e.pieces = make(mem.BufferSlice, len(b))
	}
	for i := range b {
		// A pointer to a slice header is a Buffer too, with
		// SliceBuffer's methods, and boxes without an allocation.
		e.pieces[i] = (*mem.SliceBuffer)(&b[i])
	}
	return e
}

// NewEncodedOnce returns the message of type typ whose encoding is the
// concatenation of the slices fill returns: slices of memory that never
// changes, as NewEncodedSlices takes them, and slices of own, a buffer
// with room for ownLen bytes that fill appends the message's own bytes
// to. A large own comes from a pool, its bytes not cleared (fill
// overwrites them), and goes back to it once gRPC has written the message
// and freed its pieces: the message can be sent once, and is not to be
// read after. A slice fill returns of bytes appended past own's room is a
// slice of memory of its own, which is not pooled.
func NewEncodedOnce(typ protoreflect.MessageType, ownLen int, fill func(own []byte) ([][]byte, error)) (*Encoded, error) {
	if mem.IsBelowBufferPoolingThreshold(ownLen) {
		b, err := fill(make([]byte, 0, ownLen))
		if err != nil {
			return nil, err
		}
		return NewEncodedSlices(typ, b), nil
	}
	pool := ownBuffers
	buf := pool.Get(ownLen)
	*buf = (*buf)[:cap(*buf)]
	b, err := fill((*buf)[:0])
	if err != nil {
		pool.Put(buf)
		return nil, err
	}
	// The slices of own are views of one Buffer, which gives own back to
	// the pool once gRPC has freed them all.
	root := mem.NewBuffer(buf, pool)
	start := uintptr(unsafe.Pointer(unsafe.SliceData(*buf)))
	e := NewEncodedSlices(typ, b)
	for i, piece := range b {
		if off := uintptr(unsafe.Pointer(unsafe.SliceData(piece))) - start; len(piece) > 0 && off < uintptr(len(*buf)) {
			e.pieces[i] = root.Slice(int(off), int(off)+len(piece))
		}
	}
	root.Free()
	return e, nil
}

// Len is the size of the encoding.
func (e *Encoded) Len() int { return e.pieces.Len() }

// Bytes returns the encoding in one new slice.
func (e *Encoded) Bytes() []byte { return e.pieces.Materialize() }

// ProtoReflect returns the message decoded, once: the payload logger shows
// it, and gRPC's proto codec, if the server lacks this one, encodes it
// again to the same bytes. It must return the same message on every call,
// because that codec sizes and then marshals it with the cached size.
// Encoded bytes that do not decode, which the producer's invariant rules
// out, give an empty message.
func (e *Encoded) ProtoReflect() protoreflect.Message {
	e.decodeOnce.Do(func() {
		m := e.typ.New()
		if err := proto.Unmarshal(e.Bytes(), m.Interface()); err != nil {
			m = e.typ.New()
		}
		e.decoded = m
	})
	return e.decoded
}

var _ proto.Message = (*Encoded)(nil)

// codec sends an Encoded as it is and hands every other message to gRPC's
// proto codec.
type codec struct {
	proto encoding.CodecV2
}

// Codec returns the server codec: Encoded messages are sent as they are,
// every other message is gRPC's proto codec's.
func Codec() encoding.CodecV2 {
	c := encoding.GetCodecV2(grpcproto.Name)
	if c == nil {
		// The import above registers it; nil would be a broken build.
		panic(fmt.Sprintf("wirecodec: gRPC's %q codec is not registered", grpcproto.Name))
	}
	return codec{proto: c}
}

// ServerOption makes a gRPC server use Codec for every call, whatever the
// content-subtype: the etcd API is protobuf only.
func ServerOption() grpc.ServerOption {
	return grpc.ForceServerCodecV2(Codec())
}

// Marshal returns an Encoded's pieces themselves: gRPC reads them and then
// frees them, which a piece ignores (a mem.SliceBuffer's Free does
// nothing), so the message can be sent again.
func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(*Encoded); ok {
		return e.pieces, nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

// Name is the proto codec's: the bytes on the wire are protobuf.
func (c codec) Name() string { return grpcproto.Name }

// ownBuffers is the pool of NewEncodedOnce's buffers (an unclearedPool;
// a test's wrapper of one).
var ownBuffers mem.BufferPool = &unclearedPool{}

// unclearedPool is a mem.BufferPool whose buffers keep whatever bytes they
// held: for a caller that overwrites every byte it uses. Buffers come in
// power-of-two capacities from 4 KiB to 16 MiB, each class a sync.Pool;
// a larger one is allocated and never kept. (A read's own bytes are its
// small key-values; the large ones are pieces of the store's, which a
// read does not allocate, so collections, which empty the pools, are
// rare.)
type unclearedPool struct {
	classes [unclearedClasses]sync.Pool // of *[]byte; class i holds cap 4 KiB << i
}

const (
	unclearedMinShift = 12 // 4 KiB
	unclearedClasses  = 13 // up to 16 MiB
)

// class returns the class of a buffer of n bytes, or -1 if none holds it.
func (p *unclearedPool) class(n int) int {
	for i := range unclearedClasses {
		if n <= 1<<(unclearedMinShift+i) {
			return i
		}
	}
	return -1
}

// Get returns a buffer of length n, its bytes not cleared.
func (p *unclearedPool) Get(n int) *[]byte {
	c := p.class(n)
	if c < 0 {
		b := make([]byte, n)
		return &b
	}
	if buf, ok := p.classes[c].Get().(*[]byte); ok {
		*buf = (*buf)[:n]
		return buf
	}
	b := make([]byte, n, 1<<(unclearedMinShift+c))
	return &b
}

// Put gives back a buffer that Get returned.
func (p *unclearedPool) Put(buf *[]byte) {
	if c := p.class(cap(*buf)); c >= 0 && cap(*buf) == 1<<(unclearedMinShift+c) {
		p.classes[c].Put(buf)
	}
}

var _ mem.BufferPool = (*unclearedPool)(nil)
