package persist

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Header is a copy on disk as Open finds it, before it is read whole:
// enough to check it against etcd while it is restored.
type Header struct {
	// Cluster is the id of the etcd cluster the copy was taken from.
	Cluster uint64
	// Rev is the revision the copy is complete up to; CompactRev etcd's
	// compaction revision as the cache last mirrored it.
	Rev, CompactRev int64
	// Bounds are every BoundsEvery-th key of the copy, in key order: where
	// a reader of etcd's keys at Rev may cut its chunks.
	Bounds [][]byte
}

// BoundsEvery is the spacing of Header.Bounds, the chunk hashcheck reads
// etcd's keys in.
const BoundsEvery = 10000

// Open opens the copy on disk, if there is a whole one, and returns its
// header; Restore then reads it into the store. It reports false when
// there is none or it is damaged (and says why in the log and the
// etcd_snapcache_disk_restores_total metric). The caller must prove the
// restored store is etcd's history before serving from it, and tell
// Accepted or Refused.
func (p *Persister) Open(ctx context.Context) (Header, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := os.Remove(p.path + ".new"); err == nil {
		p.lg.Info("removed a whole copy that a previous process did not finish writing", zap.String("path", p.path+".new"))
	}
	if _, err := os.Stat(p.path); errors.Is(err, fs.ErrNotExist) {
		p.lg.Info("no copy of the cache on disk: loading from etcd", zap.String("path", p.path))
		p.m.observeRestore("none")
		return Header{}, false
	}
	h, err := p.openLocked(ctx)
	if err != nil {
		p.unusableLocked(err)
		return Header{}, false
	}
	return h, true
}

// openLocked opens cache.db and reads its state and bounds.
func (p *Persister) openLocked(ctx context.Context) (Header, error) {
	db, err := openDB(p.path, false)
	if err != nil {
		return Header{}, err
	}
	var h Header
	err = db.View(func(tx *bolt.Tx) error {
		meta, kvb, evb := tx.Bucket(metaBucket), tx.Bucket(kvBucket), tx.Bucket(eventsBucket)
		if meta == nil || kvb == nil || evb == nil {
			return fmt.Errorf("%w: buckets missing", ErrCorrupt)
		}
		rec := meta.Get(stateKey)
		if rec == nil {
			return fmt.Errorf("%w: no state record: the copy was never finished", ErrCorrupt)
		}
		s, err := unmarshalState(rec)
		if err != nil {
			return err
		}
		p.disk = s
		h = Header{Cluster: s.cluster, Rev: s.rev, CompactRev: s.compactRev}
		if rec := meta.Get(boundsKey); rec != nil {
			// Written with the whole copy: folds since change kv a
			// little, and any keys in order will do as bounds.
			h.Bounds, err = unmarshalBounds(rec)
			return err
		}
		c, n := kvb.Cursor(), 0
		for k, _ := c.First(); k != nil; k, _ = c.Next() {
			if n%BoundsEvery == 0 {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				h.Bounds = append(h.Bounds, bytes.Clone(k))
			}
			n++
		}
		return nil
	})
	if err != nil {
		db.Close()
		return Header{}, err
	}
	p.db = db
	return h, nil
}

// unusableLocked records and logs a copy that cannot be read. A damaged
// one is thrown away; one that could not be read now (another process
// holds it, the start was cancelled) is closed and left for a later
// start.
func (p *Persister) unusableLocked(err error) {
	if errors.Is(err, ErrCorrupt) || errors.Is(err, revtree.ErrInconsistent) {
		p.m.observeRestore("damaged")
		p.lg.Warn("the cache's copy on disk is damaged: throwing it away and loading from etcd", zap.String("path", p.path), zap.Error(err))
		p.discardLocked()
		return
	}
	p.m.observeRestore("unreadable")
	p.lg.Warn("cannot read the cache's copy on disk now: loading from etcd", zap.String("path", p.path), zap.Error(err))
	p.closeDBLocked()
	p.gen, p.disk = 0, state{}
	p.diskRev.Store(0)
}

// Restore fills the store from the copy Open opened. On an error the
// store is unchanged, and the error is logged and counted: a damaged copy
// is thrown away, one that could not be read now (ctx ended) is kept.
func (p *Persister) Restore(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.db == nil {
		return errors.New("no copy on disk is open")
	}
	start := time.Now()
	// What a restore allocates it keeps: a collection meanwhile would
	// only mark the growing store again and again (GOMEMLIMIT still
	// holds).
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	if err := p.restoreLocked(ctx); err != nil {
		p.unusableLocked(err)
		return err
	}
	s := p.disk
	p.lg.Info("restored the cache from its copy on disk; verifying it against etcd before serving",
		zap.String("path", p.path), zap.Uint64("cluster-id", s.cluster),
		zap.Int64("base-revision", s.base), zap.Int64("revision", s.rev), zap.Int64("compact-revision", s.compactRev),
		zap.Duration("took", time.Since(start)))
	return nil
}

// Accepted records that the restored store was proven to be etcd's
// history: the copy is continued from it.
func (p *Persister) Accepted() {
	p.m.observeRestore("warm")
	p.lg.Info("the cache's copy on disk is etcd's history: serving it, and reading from etcd only what changed since", zap.String("path", p.path))
}

// Refused records that the restored store failed a check against etcd
// (check names it); the copy is thrown away, and the next write makes a
// whole new one.
func (p *Persister) Refused(check string, err error) {
	p.m.observeRestore(check)
	p.lg.Warn("the cache's copy on disk is not etcd's history: throwing it away and loading from etcd",
		zap.String("path", p.path), zap.String("check", check), zap.Error(err))
	p.mu.Lock()
	defer p.mu.Unlock()
	p.discardLocked()
}

// discardLocked removes the copy: it cannot serve, and should not be read
// again by a later start.
func (p *Persister) discardLocked() {
	p.closeDBLocked()
	p.gen, p.disk = 0, state{}
	p.diskRev.Store(0)
	if err := os.Remove(p.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		p.lg.Warn("cannot remove the cache's copy on disk", zap.String("path", p.path), zap.Error(err))
	}
}

// restoreLocked reads the open copy whole and restores the store.
func (p *Persister) restoreLocked(ctx context.Context) error {
	s := p.disk
	var loads []*revtree.Load
	var batches []revtree.Batch
	err := p.db.View(func(tx *bolt.Tx) error {
		var err error
		if loads, err = p.readKVs(ctx, tx.Bucket(kvBucket)); err != nil {
			return err
		}
		batches, err = readEvents(ctx, tx.Bucket(eventsBucket), s)
		return err
	})
	if err == nil {
		// Reading the copy mapped every page of it into the process:
		// opened again, the file is mapped afresh and only the pages
		// later writes touch become resident. (What was read is a
		// copy: the decoders copy bytes out of bbolt's pages.)
		err = p.reopenLocked()
	}
	if err == nil {
		err = p.cfg.Store.RestoreLoad(s.base, loads, batches, s.rev, s.compactRev)
	} else {
		for _, l := range loads {
			l.Discard()
		}
	}
	if err != nil {
		return err
	}
	p.gen = p.cfg.Store.Generation()
	p.diskRev.Store(s.rev)
	return nil
}

// reopenLocked closes the open copy and opens it again.
func (p *Persister) reopenLocked() error {
	p.closeDBLocked()
	db, err := openDB(p.path, false)
	if err != nil {
		return fmt.Errorf("opening the copy again: %w", err)
	}
	p.db = db
	return nil
}

// readKVs reads the kv bucket into loads of the store, one per core, each
// a contiguous part in key order: bbolt hands out its keys and values in
// key order without copying, and checking and copying them is most of a
// restore's work.
func (p *Persister) readKVs(ctx context.Context, b *bolt.Bucket) ([]*revtree.Load, error) {
	var recs [][2][]byte
	c := b.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if v == nil {
			return nil, fmt.Errorf("%w: a nested bucket in kv", ErrCorrupt)
		}
		recs = append(recs, [2][]byte{k, v})
	}
	workers := min(runtime.GOMAXPROCS(0), max(1, len(recs)/4096))
	loads := make([]*revtree.Load, workers)
	for w := range loads {
		loads[w] = p.cfg.Store.NewLoad()
	}
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Contiguous ranges: each worker reads its part of the
			// file in order.
			lo, hi := w*len(recs)/workers, (w+1)*len(recs)/workers
			for i := lo; i < hi; i++ {
				if (i-lo)%4096 == 0 && ctx.Err() != nil {
					errs[w] = ctx.Err()
					return
				}
				key, err := loadKV(loads[w], recs[i][1])
				if err != nil {
					errs[w] = err
					return
				}
				// The key is the record's own: a record under another
				// key is damage.
				if string(key) != string(recs[i][0]) {
					errs[w] = fmt.Errorf("%w: key %q holds the record of %q", ErrCorrupt, recs[i][0], key)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, l := range loads {
			l.Discard()
		}
		return nil, err
	}
	return loads, nil
}

// readEvents decodes the events bucket: revisions in order, each in (base,
// rev].
func readEvents(ctx context.Context, b *bolt.Bucket, s state) ([]revtree.Batch, error) {
	var batches []revtree.Batch
	c := b.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if len(batches)%4096 == 0 && ctx.Err() != nil {
			return nil, ctx.Err()
		}
		rev, err := revOf(k)
		if err != nil {
			return nil, err
		}
		if rev <= s.base || rev > s.rev {
			return nil, fmt.Errorf("%w: revision %d outside the copy's (%d, %d]", ErrCorrupt, rev, s.base, s.rev)
		}
		events, err := unmarshalEvents(v)
		if err != nil {
			return nil, fmt.Errorf("revision %d: %w", rev, err)
		}
		for _, ev := range events {
			if ev.Kv.ModRevision != rev {
				return nil, fmt.Errorf("%w: an event of revision %d stored as %d", ErrCorrupt, ev.Kv.ModRevision, rev)
			}
		}
		batches = append(batches, revtree.Batch{Rev: rev, Events: events})
	}
	return batches, nil
}
