package hashcheck

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash"
	"hash/fnv"
	"iter"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// pageSize is the limit of each keys-only page read from etcd, as
// kube-apiserver's consistency checker lists.
const pageSize = 10000

// Entry is one key and its mod_revision.
type Entry struct {
	Key         []byte
	ModRevision int64
}

// Result is the outcome of comparing two sides at one revision.
type Result struct {
	Rev                 int64
	CacheHash, EtcdHash uint64
	Keys                int // keys on the cache side
	// FirstDiff describes the first key that differs; empty if none.
	FirstDiff string
}

// Match reports whether both sides hold the same keys at the same
// revisions.
func (r Result) Match() bool { return r.FirstDiff == "" && r.CacheHash == r.EtcdHash }

// cacheEntries walks every key of a view of the store, in key order.
func cacheEntries(v revtree.View) iter.Seq2[Entry, error] {
	return func(yield func(Entry, error) bool) {
		v.Ascend([]byte{0}, nil, func(kv *mvccpb.KeyValue) bool {
			return yield(Entry{Key: kv.Key, ModRevision: kv.ModRevision}, nil)
		})
	}
}

// RangeEntries walks every key at rev through an etcd KV API (etcd's, or the
// proxy's) with keys-only Ranges of pageSize keys, in key order.
func RangeEntries(ctx context.Context, kv pb.KVClient, rev int64) iter.Seq2[Entry, error] {
	return func(yield func(Entry, error) bool) {
		key := []byte{0}
		for {
			resp, err := kv.Range(ctx, &pb.RangeRequest{Key: key, RangeEnd: []byte{0}, Revision: rev, Limit: pageSize, KeysOnly: true})
			if err != nil {
				yield(Entry{}, fmt.Errorf("reading keys at revision %d: %w", rev, err))
				return
			}
			for _, kv := range resp.Kvs {
				if !yield(Entry{Key: kv.Key, ModRevision: kv.ModRevision}, nil) {
					return
				}
			}
			if !resp.More || len(resp.Kvs) == 0 {
				return
			}
			key = append(bytes.Clone(resp.Kvs[len(resp.Kvs)-1].Key), 0)
		}
	}
}

// Compare walks both sides in key order at rev, hashing each and noting the
// first key that differs. An error from either walk is returned.
func Compare(rev int64, cache, etcd iter.Seq2[Entry, error]) (Result, error) {
	res := Result{Rev: rev}
	ch, eh := fnv.New64a(), fnv.New64a()
	nextCache, stopCache := iter.Pull2(cache)
	defer stopCache()
	nextEtcd, stopEtcd := iter.Pull2(etcd)
	defer stopEtcd()
	for {
		c, cerr, cok := nextCache()
		e, eerr, eok := nextEtcd()
		if cerr != nil {
			return res, cerr
		}
		if eerr != nil {
			return res, eerr
		}
		if !cok && !eok {
			break
		}
		if cok {
			res.Keys++
			write(ch, c)
		}
		if eok {
			write(eh, e)
		}
		if res.FirstDiff == "" {
			switch {
			case !cok:
				res.FirstDiff = fmt.Sprintf("etcd has key %q (mod_revision %d) past the cache's last key", e.Key, e.ModRevision)
			case !eok:
				res.FirstDiff = fmt.Sprintf("the cache has key %q (mod_revision %d) past etcd's last key", c.Key, c.ModRevision)
			case !bytes.Equal(c.Key, e.Key):
				res.FirstDiff = fmt.Sprintf("the cache has key %q where etcd has %q", c.Key, e.Key)
			case c.ModRevision != e.ModRevision:
				res.FirstDiff = fmt.Sprintf("key %q has mod_revision %d in the cache, %d in etcd", c.Key, c.ModRevision, e.ModRevision)
			}
		}
	}
	res.CacheHash, res.EtcdHash = ch.Sum64(), eh.Sum64()
	return res, nil
}

func write(h hash.Hash64, e Entry) {
	h.Write(e.Key)
	var rev [8]byte
	binary.BigEndian.PutUint64(rev[:], uint64(e.ModRevision))
	h.Write(rev[:])
}
