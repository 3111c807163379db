package revtree

import (
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/storedkv"
)

// Load is a keyspace read from etcd page by page, kept as the store's
// copies (storedkv: bare encodings, packed into slabs): each
// page is copied as it arrives, so that what was
// decoded from etcd is garbage before the next page is read, and the load
// holds one copy of the keyspace, not two. The store counts a load's
// copies in ApproxBytes while it grows (a soft memory limit follows it).
// ResetLoad makes it the store's keyspace; Discard drops one that will not
// be. A Load is used by one goroutine.
type Load struct {
	s      *Store
	vs     []version // one put of each key
	packer storedkv.Packer
	bytes  int64 // counted in s.loadingBytes
}

// loadSlotBytes is what a loaded key costs besides its copy until the
// index is built (ResetLoad): its version in the load's slice.
const loadSlotBytes = 16

// NewLoad starts a load of the keyspace into the store.
func (s *Store) NewLoad() *Load { return &Load{s: s} }

// Add copies kvs, a page of the keyspace in key order after the pages
// added before it, into the load; kvs are not kept.
func (l *Load) Add(kvs []*mvccpb.KeyValue) {
	var n int64
	packed := l.packer.Bytes()
	for _, kv := range kvs {
		v, ok := l.packer.Pack(kv)
		if !ok {
			v = storedkv.Loaded(kv)
			n += v.Bytes()
		}
		l.vs = append(l.vs, v)
		n += loadSlotBytes
	}
	l.count(n, packed)
}

// count counts n bytes and the slabs started since the packer's slabs
// took packed bytes.
func (l *Load) count(n, packed int64) {
	n += l.packer.Bytes() - packed
	l.bytes += n
	l.s.loadingBytes.Add(n)
}

// AddEncoded adds the key-value encoded in enc, a record of a copy on disk
// (AppendKeyValue's), after the keys added before it; enc is not kept. It
// returns the key, the store's copy of it.
func (l *Load) AddEncoded(enc []byte) ([]byte, error) {
	packed := l.packer.Bytes()
	var n int64
	v, ok := l.packer.PackEncoding(enc)
	if !ok {
		kv, err := DecodeKeyValue(enc)
		if err != nil {
			return nil, err
		}
		v = storedkv.Stored(kv)
		n += v.Bytes()
	}
	l.vs = append(l.vs, v)
	l.count(n+loadSlotBytes, packed)
	return v.Key(), nil
}

// Len is the number of keys added.
func (l *Load) Len() int { return len(l.vs) }

// Discard drops the load: its copies are no longer counted, and are
// garbage. A discarded (or reset) load cannot be used again.
func (l *Load) Discard() {
	l.s.loadingBytes.Add(-l.bytes)
	l.bytes, l.vs, l.packer = 0, nil, storedkv.Packer{}
}

// ResetLoad replaces the whole store with the load's keys as the keyspace
// at rev, as Reset(rev, kvs, compactRev) would with the pages added, and
// ends the load.
func (s *Store) ResetLoad(rev int64, l *Load, compactRev int64) {
	s.reset(rev, l.vs, l.packer.Slabs(), compactRev)
	l.Discard()
}
