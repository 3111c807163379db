package persist

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// formatVersion is the layout this package writes and reads; a file of
// another is not read.
const formatVersion = 1

var (
	metaBucket   = []byte("meta")
	kvBucket     = []byte("kv")
	eventsBucket = []byte("events")
	stateKey     = []byte("state")
	// boundsKey holds every BoundsEvery-th key of kv when it was written
	// whole: where Open's reader may cut its chunks without walking kv.
	boundsKey = []byte("bounds")
)

// ErrCorrupt says a copy on disk failed a check of its own: a checksum, its
// format, or the order of its revisions.
var ErrCorrupt = errors.New("the cache's copy on disk is damaged")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// seal prefixes payload with its CRC-32C.
func seal(b []byte, payload func([]byte) ([]byte, error)) ([]byte, error) {
	start := len(b)
	b = append(b, 0, 0, 0, 0)
	b, err := payload(b)
	if err != nil {
		return nil, err
	}
	binary.BigEndian.PutUint32(b[start:], crc32.Checksum(b[start+4:], castagnoli))
	return b, nil
}

// open returns the payload of a sealed record, or ErrCorrupt.
func open(rec []byte) ([]byte, error) {
	if len(rec) < 4 || binary.BigEndian.Uint32(rec) != crc32.Checksum(rec[4:], castagnoli) {
		return nil, fmt.Errorf("%w: a record's checksum does not match", ErrCorrupt)
	}
	return rec[4:], nil
}

// state is the meta record: what the copy is.
type state struct {
	cluster    uint64 // etcd's cluster id
	base       int64  // the revision of kv
	rev        int64  // the copy is complete up to it
	compactRev int64  // etcd's compaction revision, as mirrored
}

func (s state) marshal() ([]byte, error) {
	return seal(nil, func(b []byte) ([]byte, error) {
		b = binary.BigEndian.AppendUint32(b, formatVersion)
		b = binary.BigEndian.AppendUint64(b, s.cluster)
		b = binary.BigEndian.AppendUint64(b, uint64(s.base))
		b = binary.BigEndian.AppendUint64(b, uint64(s.rev))
		return binary.BigEndian.AppendUint64(b, uint64(s.compactRev)), nil
	})
}

func unmarshalState(rec []byte) (state, error) {
	p, err := open(rec)
	if err != nil {
		return state{}, err
	}
	if len(p) < 4 {
		return state{}, fmt.Errorf("%w: short meta record", ErrCorrupt)
	}
	if v := binary.BigEndian.Uint32(p); v != formatVersion {
		return state{}, fmt.Errorf("%w: format %d, this release reads %d", ErrCorrupt, v, formatVersion)
	}
	if len(p) != 4+4*8 {
		return state{}, fmt.Errorf("%w: meta record of %d bytes", ErrCorrupt, len(p))
	}
	s := state{
		cluster:    binary.BigEndian.Uint64(p[4:]),
		base:       int64(binary.BigEndian.Uint64(p[12:])),
		rev:        int64(binary.BigEndian.Uint64(p[20:])),
		compactRev: int64(binary.BigEndian.Uint64(p[28:])),
	}
	if s.base < 0 || s.rev < s.base || s.compactRev < 0 {
		return state{}, fmt.Errorf("%w: base %d, revision %d, compaction %d", ErrCorrupt, s.base, s.rev, s.compactRev)
	}
	return s, nil
}

// revKey is the events bucket's key of a revision: big-endian, so that
// bbolt orders revisions as numbers.
func revKey(rev int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(rev)) }

func revOf(key []byte) (int64, error) {
	if len(key) != 8 {
		return 0, fmt.Errorf("%w: an events key of %d bytes", ErrCorrupt, len(key))
	}
	return int64(binary.BigEndian.Uint64(key)), nil
}

// marshalKV is the kv bucket's record of a key-value of the store (see
// revtree.AppendKeyValue).
func marshalKV(b []byte, kv *mvccpb.KeyValue) ([]byte, error) {
	return seal(b, func(b []byte) ([]byte, error) { return revtree.AppendKeyValue(b, kv) })
}

// loadKV adds the key-value of a kv record to l (revtree.Load.AddEncoded)
// and returns its key.
func loadKV(l *revtree.Load, rec []byte) ([]byte, error) {
	p, err := open(rec)
	if err != nil {
		return nil, err
	}
	key, err := l.AddEncoded(p)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return key, nil
}

// Event field numbers (kv.proto).
const (
	eventTypeField = 1
	eventKVField   = 2
)

// marshalEvents is the events bucket's record of one revision the store
// holds: each event as etcd encodes an Event without its prev_kv,
// length-prefixed.
func marshalEvents(b []byte, events []*mvccpb.Event) ([]byte, error) {
	return seal(b, func(b []byte) ([]byte, error) {
		var ev []byte
		for _, e := range events {
			ev = ev[:0]
			if e.Type != mvccpb.PUT {
				ev = protowire.AppendTag(ev, eventTypeField, protowire.VarintType)
				ev = protowire.AppendVarint(ev, uint64(e.Type))
			}
			ev = protowire.AppendTag(ev, eventKVField, protowire.BytesType)
			// A put's Kv is the store's; a delete's, etcd's tombstone.
			var kv []byte
			var err error
			if e.Type == mvccpb.PUT {
				kv, err = revtree.AppendKeyValue(nil, e.Kv)
			} else {
				kv, err = proto.MarshalOptions{}.MarshalAppend(nil, e.Kv)
			}
			if err != nil {
				return nil, err
			}
			ev = protowire.AppendBytes(ev, kv)
			b = protowire.AppendBytes(b, ev)
		}
		return b, nil
	})
}

// unmarshalEvents decodes an events record: each put's Kv into the
// store's copy of it (revtree.DecodeKeyValue), each delete's tombstone as
// it is.
func unmarshalEvents(rec []byte) ([]*mvccpb.Event, error) {
	p, err := open(rec)
	if err != nil {
		return nil, err
	}
	var events []*mvccpb.Event
	for len(p) > 0 {
		ev, n := protowire.ConsumeBytes(p)
		if n < 0 {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, protowire.ParseError(n))
		}
		p = p[n:]
		e, err := unmarshalEvent(ev)
		if err != nil {
			return nil, err
		}
		events = append(events, e)
	}
	if len(events) == 0 {
		return nil, fmt.Errorf("%w: a revision without events", ErrCorrupt)
	}
	return events, nil
}

// unmarshalEvent decodes one event as marshalEvents wrote it.
func unmarshalEvent(b []byte) (*mvccpb.Event, error) {
	e := &mvccpb.Event{}
	var kv []byte
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, protowire.ParseError(n))
		}
		b = b[n:]
		switch {
		case num == eventTypeField && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 || v != uint64(mvccpb.DELETE) {
				return nil, fmt.Errorf("%w: an event of type %d", ErrCorrupt, v)
			}
			e.Type, b = mvccpb.DELETE, b[n:]
		case num == eventKVField && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, fmt.Errorf("%w: %w", ErrCorrupt, protowire.ParseError(n))
			}
			kv, b = v, b[n:]
		default:
			return nil, fmt.Errorf("%w: an event with field %d", ErrCorrupt, num)
		}
	}
	if kv == nil {
		return nil, fmt.Errorf("%w: an event without a key-value", ErrCorrupt)
	}
	if e.Type == mvccpb.PUT {
		var err error
		if e.Kv, err = revtree.DecodeKeyValue(kv); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
		}
		return e, nil
	}
	e.Kv = &mvccpb.KeyValue{}
	if err := proto.Unmarshal(kv, e.Kv); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return e, nil
}

// marshalBounds is the meta bucket's record of bounds: each key
// length-prefixed.
func marshalBounds(bounds [][]byte) ([]byte, error) {
	return seal(nil, func(b []byte) ([]byte, error) {
		for _, k := range bounds {
			b = protowire.AppendBytes(b, k)
		}
		return b, nil
	})
}

func unmarshalBounds(rec []byte) ([][]byte, error) {
	p, err := open(rec)
	if err != nil {
		return nil, err
	}
	var bounds [][]byte
	for len(p) > 0 {
		k, n := protowire.ConsumeBytes(p)
		if n < 0 {
			return nil, fmt.Errorf("%w: %w", ErrCorrupt, protowire.ParseError(n))
		}
		bounds = append(bounds, bytes.Clone(k))
		p = p[n:]
	}
	return bounds, nil
}
