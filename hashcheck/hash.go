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

// pageSize is the number of keys of the cache in each chunk etcd is asked
// for (viewEntries), and the limit of each page RangeEntries reads, as
// kube-apiserver's consistency checker lists.
const pageSize = 10000

// prefetch is how many of etcd's answers viewEntries holds read ahead of
// the comparison, besides the one being read.
const prefetch = 1

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
//
// Each page is a Range from the page's first key to the end of the
// keyspace, and etcd counts every key of that range to answer it, so the
// walk costs etcd time quadratic in the keyspace (1M keys: tens of seconds
// of etcd's CPU). With a view of the cache at hand, Checker reads etcd in
// chunks bounded by the cache's keys instead (viewEntries).
func RangeEntries(ctx context.Context, kv pb.KVClient, rev int64) iter.Seq2[Entry, error] {
	return rangeEntries(ctx, kv, rev, pageSize)
}

// rangeEntries is RangeEntries with pages of page keys.
func rangeEntries(ctx context.Context, kv pb.KVClient, rev int64, page int) iter.Seq2[Entry, error] {
	return func(yield func(Entry, error) bool) {
		key := []byte{0}
		for {
			resp, err := kv.Range(ctx, &pb.RangeRequest{Key: key, RangeEnd: []byte{0}, Revision: rev, Limit: int64(page), KeysOnly: true})
			if err != nil {
				yield(Entry{}, readError(rev, err))
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

func readError(rev int64, err error) error {
	return fmt.Errorf("reading keys at revision %d: %w", rev, err)
}

// viewEntries walks every key at rev through an etcd KV API, in key order,
// as RangeEntries does (the same entries; etcd's errors wrapped alike, and
// the end of ctx reported as an error, never as the end of the keys), with
// keys-only Ranges over chunks of the keyspace bounded by v's keys: every
// page-th key of v begins a chunk, the first chunk begins at "\x00" and
// the last ends at the end of the keyspace. etcd counts only the keys of a
// chunk to answer for it, so where etcd has v's keys the walk costs etcd
// time linear in the keyspace. A chunk where etcd has more keys than v is
// read in pages of at most 2*page keys, each counting the rest of that
// chunk, so no answer is larger than that however much etcd and v differ.
//
// A goroutine reads the chunks ahead of the caller (prefetch answers and
// the one being read); the walk stops it and waits for it before it
// returns, however it ends.
func viewEntries(ctx context.Context, kv pb.KVClient, v revtree.View, rev int64, page int) iter.Seq2[Entry, error] {
	if page < 1 {
		page = pageSize
	}
	// Every page-th key of v, from the page-th: the first chunk begins at
	// "\x00".
	bounds := func(yield func([]byte) bool) {
		n := 0
		v.Ascend([]byte{0}, nil, func(kv *mvccpb.KeyValue) bool {
			ok := n == 0 || n%page != 0 || yield(bytes.Clone(kv.Key))
			n++
			return ok
		})
	}
	return chunkEntries(ctx, kv, bounds, rev, page)
}

// boundsEntries is viewEntries with the chunks cut at bounds, keys in
// increasing order (of a copy of the cache: any keys will do, the chunks
// only bound what etcd counts).
func boundsEntries(ctx context.Context, kv pb.KVClient, bounds [][]byte, rev int64, page int) iter.Seq2[Entry, error] {
	if page < 1 {
		page = pageSize
	}
	return chunkEntries(ctx, kv, func(yield func([]byte) bool) {
		for _, b := range bounds {
			if len(b) > 0 && string(b) > "\x00" && !yield(b) {
				return
			}
		}
	}, rev, page)
}

// chunkEntries walks etcd's keys at rev in chunks beginning at "\x00" and
// at each key of bounds, in order, reading ahead on a goroutine it stops
// and waits for however the walk ends.
func chunkEntries(ctx context.Context, kv pb.KVClient, bounds iter.Seq[[]byte], rev int64, page int) iter.Seq2[Entry, error] {
	return func(yield func(Entry, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		pages := make(chan []Entry, prefetch)
		var failed error // the reader's error; read after pages is closed
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer close(pages)
			failed = readChunks(ctx, kv, bounds, rev, page, pages)
		}()
		defer func() {
			cancel()
			<-done
		}()
		for es := range pages {
			for _, e := range es {
				if !yield(e, nil) {
					return
				}
			}
		}
		if failed != nil {
			yield(Entry{}, failed)
		}
	}
}

// readChunks reads etcd's keys at rev, chunk by chunk (chunkEntries), and
// sends each answer's entries to pages. It returns the error that ended
// the reading early, if any: etcd's, or ctx's end.
func readChunks(ctx context.Context, kv pb.KVClient, bounds iter.Seq[[]byte], rev int64, page int, pages chan<- []Entry) error {
	// read reads the chunk [key, end) of the keyspace.
	read := func(key, end []byte) error {
		for {
			resp, err := kv.Range(ctx, &pb.RangeRequest{Key: key, RangeEnd: end, Revision: rev, Limit: 2 * int64(page), KeysOnly: true})
			if err != nil {
				return readError(rev, err)
			}
			if len(resp.Kvs) > 0 {
				es := make([]Entry, len(resp.Kvs))
				for i, kv := range resp.Kvs {
					es[i] = Entry{Key: kv.Key, ModRevision: kv.ModRevision}
				}
				select {
				case pages <- es:
				case <-ctx.Done():
					return readError(rev, ctx.Err())
				}
			}
			if !resp.More || len(resp.Kvs) == 0 {
				return nil
			}
			key = append(bytes.Clone(resp.Kvs[len(resp.Kvs)-1].Key), 0)
		}
	}
	start := []byte{0}
	for end := range bounds {
		if err := read(start, end); err != nil {
			return err
		}
		start = end
	}
	return read(start, []byte{0})
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
