package revtree

import (
	"encoding/binary"
	"slices"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// Result is a Range's answer from a view (View.Result). Its key-values
// are kept as the store holds them, unless the request needed KeyValues
// to sort, filter or strip; Response makes the RangeResponse, and Size
// and AppendPieces size and encode that response without making it, its
// key-values' fields being the stored bytes themselves.
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

	// fields are the stored fields of the key-values (field), nil for
	// one that has none, found by Size for AppendPieces, which walks
	// them rather than the key-values (each a cache miss or two for a
	// written key's entry) and gives them back to fieldsPool.
	fields *[][]byte
	// What the last Size counted, for AppendPieces: the pieces, and the
	// bytes of the result's own buffer. A change to the result since (a
	// header set after it was sized) leaves them short, which costs
	// AppendPieces a larger allocation and nothing else.
	pieces, ownBytes int
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
		return x.vs[len(x.vs)-1].Key()
	}
	return nil
}

// Response returns the RangeResponse: etcd's answer to the request.
func (x *Result) Response() *pb.RangeResponse {
	x.releaseFields()
	kvs := x.kvs
	if !x.made {
		kvs = makeKVs(x.vs)
	}
	return &pb.RangeResponse{Header: x.Header, Kvs: kvs, More: x.More, Count: x.Count}
}

// Field numbers and tags of RangeResponse (rpc.proto).
const (
	rangeHeaderTag = 1<<3 | 2 // header, length-delimited
	rangeKVTag     = storedkv.RangeKVTag
	rangeMoreTag   = 3<<3 | 0 // more, varint
	rangeCountTag  = 4<<3 | 0 // count, varint
)

// Size returns the encoded size of the response: proto.Size's. It finds
// the key-values' stored fields and counts the pieces AppendPieces makes
// of them, so that AppendPieces need not walk the key-values again.
func (x *Result) Size() int {
	if x.fields == nil {
		x.fields = getFields(x.Len())
	}
	fields := (*x.fields)[:x.Len()]
	if x.made {
		for i, kv := range x.kvs {
			fields[i] = nil
			if enc := x.storedEncoding(kv); enc != nil {
				fields[i] = storedkv.Field(enc)
			}
		}
	} else {
		for i, ver := range x.vs {
			fields[i] = nil
			if enc := ver.Encoding(); enc != nil {
				fields[i] = storedkv.Field(enc)
			}
		}
	}
	c := pieceWriter{count: true}
	x.writePieces(&c) // counting fails on nothing
	x.pieces, x.ownBytes = c.pieces, c.ownBytes
	return c.ownBytes + c.storedBytes
}

// fieldsPool holds the fields of Results (Result.fields) between reads:
// a large read's would be as much garbage as its pieces.
var fieldsPool sync.Pool // of *[][]byte

// maxPooledFields bounds the fields kept in fieldsPool (6 MiB): a read of
// more key-values allocates its own.
const maxPooledFields = 256 << 10

func getFields(n int) *[][]byte {
	if f, ok := fieldsPool.Get().(*[][]byte); ok && cap(*f) >= n {
		return f
	}
	f := make([][]byte, n)
	return &f
}

// releaseFields gives the fields Size found back, cleared (they point
// into the store), if it kept them.
func (x *Result) releaseFields() {
	f := x.fields
	if f == nil {
		return
	}
	x.fields = nil
	if cap(*f) <= maxPooledFields {
		clear((*f)[:cap(*f)])
		fieldsPool.Put(f)
	}
}

// AppendTo appends the encoding of the response, the bytes proto.Marshal
// gives: its pieces (AppendPieces), one after the other.
func (x *Result) AppendTo(b []byte) ([]byte, error) {
	pieces, err := x.AppendPieces(nil, nil)
	if err != nil {
		return nil, err
	}
	for _, p := range pieces {
		b = append(b, p...)
	}
	return b, nil
}

// AppendPieces appends the encoding of the response, the bytes
// proto.Marshal gives, to pieces, as byte slices to be sent one after the
// other, and returns them. A stored key-value's kvs field is its stored
// bytes themselves (storedkv.Field), and the fields of key-values packed one
// after the other in a slab are one piece: a read copies none of them. The
// rest (the header, more and count, a key-value without a stored encoding
// or stripped to its key, and fields under minPieceBytes, cheaper to copy
// than to send as pieces of their own) is the result's own bytes, appended
// to own (nil: a new buffer): the pieces of them are slices of own's
// array if it has room for OwnSize bytes more. No piece of the store's is
// ever written again, and each keeps what it points into alive: they may
// be sent after the view is gone, and any number of times.
//
// The pieces and the own bytes are counted first (by Size, if the caller
// sized the result), so that each takes one allocation of its size rather
// than the garbage of growing.
func (x *Result) AppendPieces(pieces [][]byte, own []byte) ([][]byte, error) {
	if x.fields == nil {
		x.Size()
	}
	defer x.releaseFields()
	if own == nil {
		own = make([]byte, 0, x.ownBytes)
	}
	w := pieceWriter{out: slices.Grow(pieces, x.pieces), own: own, flushed: len(own)}
	if err := x.writePieces(&w); err != nil {
		return nil, err
	}
	return w.out, nil
}

// OwnSize returns the bytes of the response's own in its pieces, as the
// last Size counted them (AppendPieces).
func (x *Result) OwnSize() int { return x.ownBytes }

// minPieceBytes is the least size of a field that is a piece of its own:
// a piece costs its slice and slot (40 bytes) and, in gRPC's transport,
// more than copying a small field does; and fields of at least 256 bytes
// leave at most 64 pieces to each 16 KiB HTTP/2 frame, the most the
// transport's writer keeps room for.
const minPieceBytes = 256

// writePieces writes the response's pieces to w, of its fields (Size).
func (x *Result) writePieces(w *pieceWriter) error {
	if x.Header != nil {
		if err := w.encode(rangeHeaderTag, x.Header); err != nil {
			return err
		}
	}
	for i, f := range (*x.fields)[:x.Len()] {
		switch {
		case f != nil:
			w.stored(f, !x.made && x.vs[i].IsPacked())
		case x.made:
			if err := w.encode(rangeKVTag, x.kvs[i]); err != nil {
				return err
			}
		default:
			if err := w.encode(rangeKVTag, x.vs[i].EntryKV()); err != nil {
				return err
			}
		}
	}
	if x.More {
		w.copy([]byte{rangeMoreTag, 1})
	}
	if x.Count != 0 {
		var b [1 + binary.MaxVarintLen64]byte
		w.copy(protowire.AppendVarint(append(b[:0], rangeCountTag), uint64(x.Count)))
	}
	w.endRun()
	w.flush()
	return nil
}

// pieceWriter makes the pieces of a response (AppendPieces), or, with
// count, counts them and the bytes of its own buffer.
type pieceWriter struct {
	count       bool
	pieces      int  // counted
	ownBytes    int  // counted
	storedBytes int  // counted: of the store's bytes in pieces
	pending     bool // counted: own bytes not yet in a piece

	out [][]byte
	// own holds the bytes the store does not; own[flushed:] are not yet
	// a piece. It has room for all of them: its pieces are slices of
	// one array, never written again.
	own     []byte
	flushed int

	// run is the fields packed one after the other in a slab added last,
	// not yet a piece.
	run []byte
}

// stored adds f, a stored key-value's field (storedkv.Field), packed in a
// slab or not. A packed field that starts where the run ends joins it
// (storedkv.Join).
func (w *pieceWriter) stored(f []byte, packed bool) {
	if packed && len(w.run) > 0 {
		if run, ok := storedkv.Join(w.run, f); ok {
			w.run = run
			return
		}
	}
	w.endRun()
	if packed {
		w.run = f
		return
	}
	w.span(f)
}

// endRun adds the run.
func (w *pieceWriter) endRun() {
	if len(w.run) > 0 {
		run := w.run
		w.run = nil
		w.span(run)
	}
}

// span adds b, stored bytes: a piece, or copied if it is small.
func (w *pieceWriter) span(b []byte) {
	switch {
	case len(b) < minPieceBytes:
		w.copy(b)
	case w.count:
		w.flush()
		w.pieces++
		w.storedBytes += len(b)
	default:
		w.flush()
		w.out = append(w.out, b)
	}
}

// copy adds b to the own bytes.
func (w *pieceWriter) copy(b []byte) {
	w.endRun()
	if w.count {
		w.ownBytes += len(b)
		w.pending = true
		return
	}
	w.own = append(w.own, b...)
}

// encode adds m, encoded as the length-delimited field of tag.
func (w *pieceWriter) encode(tag byte, m proto.Message) error {
	w.endRun()
	n := proto.Size(m)
	if w.count {
		w.ownBytes += 1 + protowire.SizeVarint(uint64(n)) + n
		w.pending = true
		return nil
	}
	w.own = protowire.AppendVarint(append(w.own, tag), uint64(n))
	var err error
	w.own, err = (proto.MarshalOptions{UseCachedSize: true}).MarshalAppend(w.own, m)
	return err
}

// flush makes a piece of the own bytes not yet in one.
func (w *pieceWriter) flush() {
	switch {
	case w.count && w.pending:
		w.pieces++
		w.pending = false
	case !w.count && len(w.own) > w.flushed:
		w.out = append(w.out, w.own[w.flushed:len(w.own):len(w.own)])
		w.flushed = len(w.own)
	}
}

// storedEncoding returns the stored encoding of kv, a made key-value of the
// result; nil for the copies of a keys-only response, which have none,
// and for a stored key-value without one.
func (x *Result) storedEncoding(kv *mvccpb.KeyValue) []byte {
	if x.r.KeysOnly {
		return nil
	}
	return storedkv.Encoding(kv)
}
