// Package wirecodec is the gRPC server codec that sends messages already
// encoded: a watch event goes to thousands of watchers on many streams, and
// encoding it once for all of them instead of once per watcher is most of
// the fan-out's cost. grpc.PreparedMsg cannot do that, since it is encoded
// for one stream.
//
// An Encoded message is a list of pieces, byte slices sent one after the
// other, that may be shared by any number of messages and streams. Every
// other message goes through gRPC's own proto codec, unchanged.
//
// Invariant: the producer of an Encoded guarantees that its bytes are what
// proto.Marshal produces for the message it stands for; clients cannot tell
// the difference. The pieces are never modified once built.
package wirecodec

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

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
	pieces mem.BufferSlice // every one a Piece
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

// NewEncodedOnce returns the message of type typ whose encoding is what
// fill appends to an empty slice with room for size bytes. A large one's
// bytes come from a pool that gRPC gives them back to once it has written
// them: the message can be sent once, and is not to be read after. A new
// large allocation per response would be zeroed by the runtime first, and
// so would one from gRPC's own pool, which clears what it hands out: fill
// overwrites them anyway.
func NewEncodedOnce(typ protoreflect.MessageType, size int, fill func([]byte) ([]byte, error)) (*Encoded, error) {
	if mem.IsBelowBufferPoolingThreshold(size) {
		b, err := fill(make([]byte, 0, size))
		if err != nil {
			return nil, err
		}
		return NewEncoded(typ, []mem.Buffer{Piece(b)}), nil
	}
	pool := onceBuffers
	buf := pool.Get(size)
	b, err := fill((*buf)[:0])
	switch {
	case err != nil:
		pool.Put(buf)
		return nil, err
	case cap(b) != cap(*buf):
		// fill outgrew the buffer (size was short): b is its own.
		pool.Put(buf)
		return NewEncoded(typ, []mem.Buffer{Piece(b)}), nil
	}
	*buf = b
	return NewEncoded(typ, []mem.Buffer{mem.NewBuffer(buf, pool)}), nil
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
// frees them, which a Piece ignores, so the message can be sent again.
func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(*Encoded); ok {
		return e.pieces, nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

// Name is the proto codec's: the bytes on the wire are protobuf.
func (c codec) Name() string { return grpcproto.Name }

// onceBuffers is the pool of NewEncodedOnce's buffers.
var onceBuffers = &unclearedPool{}

// unclearedPool is a mem.BufferPool whose buffers keep whatever bytes they
// held: for a caller that overwrites every byte it uses. Buffers come in
// power-of-two capacities from 4 KiB. Those under 1 MiB are each class's
// sync.Pool's, which a collection empties; larger ones are kept across
// collections, up to maxKeptBytes in all: a sync.Pool of them, emptied by
// every collection, turned a stream of large reads into a stream of
// large allocations, and with a soft memory limit each of those brought
// the next collection sooner (about a third of the proxy's CPU for
// 10 MiB ranges). One larger than the largest class is allocated and
// never kept.
type unclearedPool struct {
	classes [unclearedClasses]sync.Pool // of *[]byte; class i holds cap 4 KiB << i

	mu sync.Mutex
	// Guarded by mu: the kept buffers of the classes from keptMinShift.
	kept [unclearedClasses][]*[]byte
	// keptBytes is their capacity in all; written under mu.
	keptBytes atomic.Int64
}

const (
	unclearedMinShift = 12 // 4 KiB
	unclearedClasses  = 13 // up to 16 MiB
	// keptMinShift is the least class kept across collections (1 MiB).
	keptMinShift = 20
	// maxKeptBytes bounds the kept buffers' capacity: a few large
	// responses' worth, against --max-cached-read-bytes' 256 MiB in flight.
	maxKeptBytes = 64 << 20
)

// RetainedBytes is the capacity of the large response buffers kept for
// reuse: heap that is live though no response holds it.
func RetainedBytes() int64 { return onceBuffers.keptBytes.Load() }

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
	if unclearedMinShift+c >= keptMinShift {
		if buf := p.takeKept(c); buf != nil {
			*buf = (*buf)[:n]
			return buf
		}
	} else if buf, ok := p.classes[c].Get().(*[]byte); ok {
		*buf = (*buf)[:n]
		return buf
	}
	b := make([]byte, n, 1<<(unclearedMinShift+c))
	return &b
}

func (p *unclearedPool) takeKept(c int) *[]byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := p.kept[c]
	if len(k) == 0 {
		return nil
	}
	buf := k[len(k)-1]
	k[len(k)-1] = nil
	p.kept[c] = k[:len(k)-1]
	p.keptBytes.Add(-int64(cap(*buf)))
	return buf
}

// Put gives back a buffer that Get returned.
func (p *unclearedPool) Put(buf *[]byte) {
	c := p.class(cap(*buf))
	if c < 0 || cap(*buf) != 1<<(unclearedMinShift+c) {
		return
	}
	if unclearedMinShift+c < keptMinShift {
		p.classes[c].Put(buf)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.keptBytes.Load()+int64(cap(*buf)) > maxKeptBytes {
		return // the garbage collector's
	}
	p.kept[c] = append(p.kept[c], buf)
	p.keptBytes.Add(int64(cap(*buf)))
}

var _ mem.BufferPool = (*unclearedPool)(nil)
