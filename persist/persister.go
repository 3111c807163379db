package persist

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
	"go.uber.org/zap"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/backoff"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// DefaultInterval is how often the copy on disk is brought up to date.
const DefaultInterval = time.Second

// FileName is the copy's file in its directory.
const FileName = "cache.db"

// Bounds of the pause after a write failed (a full disk, a read-only
// directory): retrying a whole copy of a large keyspace every interval
// would cost more than it could save.
const (
	minRetryPause = time.Second
	maxRetryPause = time.Minute
)

// chunkBytes bounds one transaction of a whole copy: bbolt holds a
// transaction's pages in memory until it commits.
const chunkBytes = 16 << 20

// finalFlushTimeout bounds the write at stop: a whole copy of a large
// keyspace takes seconds, and a restart from it saves far more, but a stop
// must end.
const finalFlushTimeout = 20 * time.Second

// lockTimeout bounds the wait for bbolt's file lock, which another process
// on the same directory holds.
const lockTimeout = time.Second

// Store is the cache a Persister copies and restores (a *revtree.Store).
type Store interface {
	Generation() uint64
	Rev() int64
	CompactRev() int64
	OldestRev() int64
	HistoryStart() int64
	ViewHeld(rev int64) (revtree.View, error)
	EventsHeld(from, upTo int64, max int) ([]revtree.Batch, int64, error)
	NewLoad() *revtree.Load
	RestoreLoad(base int64, loads []*revtree.Load, batches []revtree.Batch, rev, compactRev int64) error
}

// Source tells whether the store answers for etcd, and for which cluster
// (a *progress.Follower): only a history the proxy serves is copied. It is
// given to each call that copies the store (Run, Flush, Release), not to
// New: the follower is built after the persister, which it restores from.
type Source interface {
	// Ready is closed when the store first serves.
	Ready() <-chan struct{}
	Serving() bool
	ClusterID() uint64
}

// Config configures a Persister.
type Config struct {
	// Dir is the directory of the copy, created if missing.
	Dir   string
	Store Store
	// Interval between writes; DefaultInterval if 0.
	Interval time.Duration
	// Logger; zap.NewNop() if nil.
	Logger *zap.Logger
	// Metrics; none are exported if nil.
	Metrics *Metrics
}

// Persister keeps the copy of the store on disk (see the package doc). It
// restores the store from the copy once, at start (Restore), and then
// writes until Run ends.
type Persister struct {
	cfg  Config
	lg   *zap.Logger
	m    *Metrics // nil-safe
	path string

	mu sync.Mutex
	// Guarded by mu.
	db *bolt.DB // cache.db while open; nil before the first write or after a failed one
	// disk is what cache.db holds, and gen the store generation it
	// continues: 0 when the copy cannot be continued, and the next write
	// is a whole copy.
	disk state
	gen  uint64
	// served is the store generation last seen serving, the only one
	// copied, and cluster the etcd cluster it served.
	served, cluster uint64
	// failing is why the last write failed; nil once one works.
	failing error
	// released: a new process owns the copy (Release); nothing is
	// written until Resume.
	released bool

	// diskRev is disk.rev, and failed is failing, for the metrics: read
	// without mu, which a whole copy holds for seconds.
	diskRev atomic.Int64
	failed  atomic.Pointer[error]
	// marshalled is the bytes of records made for the append being
	// written, which are garbage only once it commits (InFlightBytes).
	marshalled atomic.Int64
}

// InFlightBytes is the memory of the records of the append being written:
// an append holds every revision since the last one (a burst of large
// writes makes it large) until its transaction commits. An automatic
// memory limit counts it, as it counts the cached responses in flight,
// so that the collector does not run again and again under a limit that
// does not know of it.
func (p *Persister) InFlightBytes() int64 { return p.marshalled.Load() }

// New returns a Persister of the copy in cfg.Dir. It touches nothing on
// disk until Restore or Run.
func New(cfg Config) *Persister {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	p := &Persister{cfg: cfg, lg: cfg.Logger, m: cfg.Metrics, path: filepath.Join(cfg.Dir, FileName)}
	p.m.bind(p)
	return p
}

// Path is the copy's file.
func (p *Persister) Path() string { return p.path }

// Run brings the copy up to date when src first serves and then every
// interval until ctx is done, then once more, so that a clean stop leaves
// the latest copy, and closes the file.
func (p *Persister) Run(ctx context.Context, src Source) {
	defer p.close()
	bo := backoff.New(minRetryPause, maxRetryPause)
	// The first copy as soon as the store serves: a stop before the
	// first interval then finds a copy to continue.
	t := time.NewTimer(p.cfg.Interval)
	t.Stop()
	ready := src.Ready()
	for {
		select {
		case <-ctx.Done():
			final, cancel := context.WithTimeout(context.Background(), finalFlushTimeout)
			defer cancel()
			if err := p.flush(final, src); err != nil {
				p.lg.Warn("could not write the cache's copy on disk at stop; the next start loads from etcd what it lacks", zap.Error(err))
			}
			return
		case <-ready:
			ready = nil
		case <-t.C:
		}
		next := p.cfg.Interval
		if p.flush(ctx, src) != nil {
			next = max(next, bo.Next())
		} else {
			bo.Reset()
		}
		t.Reset(next)
	}
}

func (p *Persister) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeDBLocked()
}

func (p *Persister) closeDBLocked() {
	if p.db == nil {
		return
	}
	if err := p.db.Close(); err != nil {
		p.lg.Warn("closing the cache's copy on disk", zap.Error(err))
	}
	p.db = nil
}

// errMoved: the store was reset while it was being read; the next write
// reads it again.
var errMoved = errors.New("the store was reloaded while it was copied")

// Flush brings the copy on disk up to date with the store, if src says
// the store serves a history (or last did, in this generation). It returns
// why the write failed; the copy on disk is then the previous one, whole.
func (p *Persister) Flush(src Source) error { return p.flush(context.Background(), src) }

// flush is Flush; ctx ends a whole copy under way (the old one stays).
func (p *Persister) flush(ctx context.Context, src Source) error {
	st := p.cfg.Store
	gen := st.Generation()
	serving := src.Serving()
	var cluster uint64
	if serving {
		cluster = src.ClusterID()
	}
	if st.Generation() != gen {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.released {
		return nil
	}
	if serving && cluster != 0 {
		p.served, p.cluster = gen, cluster
	}
	if p.served == 0 || p.served != gen {
		return nil // never served, or not this generation
	}
	start := time.Now()
	kind := "append"
	var err error
	// A whole copy unless the one on disk continues this generation of
	// the store, for its cluster, and the store still holds every
	// revision after it.
	if p.gen != gen || p.db == nil || p.disk.cluster != p.cluster || st.HistoryStart() > p.disk.rev+1 {
		kind = "rewrite"
		err = p.rewriteLocked(ctx, gen)
	} else {
		err = p.appendLocked(gen)
	}
	if errors.Is(err, errMoved) || (ctx.Err() != nil && errors.Is(err, ctx.Err())) {
		return nil
	}
	p.m.observeWrite(kind, err, time.Since(start))
	if err != nil {
		p.failedLocked(err)
		return err
	}
	if p.failing != nil {
		p.lg.Info("the cache's copy on disk is written again", zap.String("path", p.path), zap.Int64("revision", p.disk.rev))
		p.failing = nil
		p.failed.Store(nil)
	}
	p.diskRev.Store(p.disk.rev)
	return nil
}

// failedLocked closes the copy after a failed write: bbolt may not take
// another transaction after one failed, and the next write is a whole
// copy, which replaces the file. The log says it once per cause.
func (p *Persister) failedLocked(err error) {
	p.closeDBLocked()
	p.gen = 0
	if p.failing == nil || p.failing.Error() != err.Error() {
		p.lg.Warn("cannot write the cache's copy on disk: serving from memory; a restart will load from etcd what the copy lacks, or all of it",
			zap.String("path", p.path), zap.Error(err))
	}
	p.failing = err
	p.failed.Store(&err)
}

// Release brings the copy up to date a last time, as src serves it, and
// closes it, for a new process to restore from (a handover); nothing is
// written again until Resume.
func (p *Persister) Release(src Source) error {
	ctx, cancel := context.WithTimeout(context.Background(), finalFlushTimeout)
	defer cancel()
	err := p.flush(ctx, src)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.released = true
	p.closeDBLocked()
	if err != nil {
		return fmt.Errorf("writing the copy on disk for the new process: %w", err)
	}
	return nil
}

// Resume takes the copy back after a handover failed: the next write is a
// whole copy, whatever the new process left.
func (p *Persister) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.released, p.gen = false, 0
}

// Failing is why the last write failed, nil if it did not.
func (p *Persister) Failing() error {
	if err := p.failed.Load(); err != nil {
		return *err
	}
	return nil
}

// openDB opens bbolt's file at path, waiting at most lockTimeout for
// another process's lock.
//
// The freelist is written with each transaction: without it, bbolt
// rebuilds it at every open by reading every page of the file through its
// mmap, which left the whole copy resident in the proxy's memory (1.3 GiB
// of file pages at 10^6 keys of 1 KiB). The copy frees few pages, so its
// freelist is small.
func openDB(path string, noSync bool) (*bolt.DB, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: lockTimeout, NoSync: noSync, FreelistType: bolt.FreelistMapType})
	if errors.Is(err, berrors.ErrTimeout) {
		return nil, fmt.Errorf("opening %s: another process holds it: %w", path, err)
	}
	if errors.Is(err, berrors.ErrInvalid) || errors.Is(err, berrors.ErrVersionMismatch) || errors.Is(err, berrors.ErrChecksum) {
		return nil, fmt.Errorf("%w: opening %s: %w", ErrCorrupt, path, err)
	}
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", path, err)
	}
	return db, nil
}

// appendLocked writes the events of the revisions after the copy's, and
// folds into kv those the store no longer retains, in one transaction.
func (p *Persister) appendLocked(gen uint64) error {
	st := p.cfg.Store
	rev, compact := st.Rev(), st.CompactRev()
	if rev == p.disk.rev && compact == p.disk.compactRev && st.HistoryStart() <= p.disk.base+1 {
		return nil
	}
	batches, upTo, err := st.EventsHeld(p.disk.rev+1, rev, 0)
	if errors.Is(err, revtree.ErrNotRetained) {
		// The budget dropped them since HistoryStart was read: the next
		// write is a whole copy.
		p.gen = 0
		return errMoved
	}
	if err != nil {
		return fmt.Errorf("reading the store's events after revision %d: %w", p.disk.rev, err)
	}
	start := st.HistoryStart()
	if st.Generation() != gen {
		return errMoved
	}
	next := p.disk
	next.rev, next.compactRev = max(upTo, p.disk.rev), compact
	next.base = max(p.disk.base, min(start-1, next.rev))
	defer p.marshalled.Store(0)
	err = p.db.Update(func(tx *bolt.Tx) error {
		events := tx.Bucket(eventsBucket)
		events.FillPercent = 1 // revisions only ever grow
		for _, b := range batches {
			// bbolt keeps a value, not a copy, until the commit: a
			// buffer per record.
			rec, err := marshalEvents(nil, b.Events)
			if err != nil {
				return err
			}
			p.marshalled.Add(int64(len(rec)))
			if err := events.Put(revKey(b.Rev), rec); err != nil {
				return fmt.Errorf("writing revision %d: %w", b.Rev, err)
			}
		}
		if err := fold(tx, next.base); err != nil {
			return err
		}
		return putState(tx, next)
	})
	if err != nil {
		return err
	}
	p.disk = next
	return nil
}

// fold applies the events of the revisions up to base to kv and drops
// them: kv becomes the keyspace at base.
func fold(tx *bolt.Tx, base int64) error {
	kvs, c := tx.Bucket(kvBucket), tx.Bucket(eventsBucket).Cursor()
	for k, v := c.First(); k != nil; k, v = c.First() {
		rev, err := revOf(k)
		if err != nil {
			return err
		}
		if rev > base {
			return nil
		}
		events, err := unmarshalEvents(v)
		if err != nil {
			return fmt.Errorf("revision %d: %w", rev, err)
		}
		for _, ev := range events {
			if ev.Type == mvccpb.DELETE {
				err = kvs.Delete(ev.Kv.Key)
			} else {
				var rec []byte
				if rec, err = marshalKV(nil, ev.Kv); err == nil {
					err = kvs.Put(ev.Kv.Key, rec)
				}
			}
			if err != nil {
				return fmt.Errorf("folding revision %d: %w", rev, err)
			}
		}
		if err := c.Delete(); err != nil {
			return fmt.Errorf("folding revision %d: %w", rev, err)
		}
	}
	return nil
}

func putState(tx *bolt.Tx, s state) error {
	rec, err := s.marshal()
	if err != nil {
		return err
	}
	if err := tx.Bucket(metaBucket).Put(stateKey, rec); err != nil {
		return fmt.Errorf("writing the copy's state: %w", err)
	}
	return nil
}

// rewriteLocked writes a whole copy of the store to cache.db.new, then
// renames it over cache.db: the keyspace before the first revision whose
// events the store holds, and the events of that revision and every
// later one.
func (p *Persister) rewriteLocked(ctx context.Context, gen uint64) error {
	st := p.cfg.Store
	rev, oldest, start := st.Rev(), st.OldestRev(), st.HistoryStart()
	view, err := st.ViewHeld(oldest)
	if err != nil {
		return fmt.Errorf("reading the store at revision %d: %w", oldest, err)
	}
	batches, upTo, err := st.EventsHeld(start, rev, 0)
	if errors.Is(err, revtree.ErrNotRetained) {
		return errMoved // dropped since HistoryStart was read: again next time
	}
	if err != nil {
		return fmt.Errorf("reading the store's events from revision %d: %w", start, err)
	}
	next := state{cluster: p.cluster, base: start - 1, rev: max(upTo, start-1), compactRev: st.CompactRev()}
	if st.Generation() != gen {
		return errMoved
	}
	// The view is the keyspace at oldest; if the store holds oldest's
	// events, the copy's base is the revision before it, and they are
	// undone.
	var undo []*mvccpb.Event
	if len(batches) > 0 && batches[0].Rev == oldest {
		undo = batches[0].Events
	}
	if err := os.MkdirAll(p.cfg.Dir, 0o700); err != nil {
		return fmt.Errorf("creating the copy's directory: %w", err)
	}
	tmp := p.path + ".new"
	if err := writeCopy(ctx, tmp, view, undo, batches, next); err != nil {
		os.Remove(tmp)
		return err
	}
	p.closeDBLocked()
	if err := os.Rename(tmp, p.path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("replacing the copy: %w", err)
	}
	if err := syncDir(p.cfg.Dir); err != nil {
		return err
	}
	db, err := openDB(p.path, false)
	if err != nil {
		return err
	}
	p.db, p.disk, p.gen = db, next, gen
	p.lg.Info("wrote a whole copy of the cache to disk", zap.String("path", p.path),
		zap.Int64("base-revision", next.base), zap.Int64("revision", next.rev), zap.Int("revisions", len(batches)))
	return nil
}

// writeCopy writes a whole copy to a new file at path: the keys of view
// with the events undo undone (each key as its first event's prev_kv has
// it), then the batches, in transactions of about chunkBytes without
// fsync, then, after an fsync, the state, which makes the copy whole.
func writeCopy(ctx context.Context, path string, view revtree.View, undo []*mvccpb.Event, batches []revtree.Batch, s state) (err error) {
	db, err := openDB(path, true)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := db.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("closing %s: %w", path, cerr)
		}
	}()
	if err := db.Update(func(tx *bolt.Tx) error {
		for _, name := range [][]byte{metaBucket, kvBucket, eventsBucket} {
			if _, err := tx.CreateBucket(name); err != nil {
				return fmt.Errorf("creating bucket %s: %w", name, err)
			}
		}
		return nil
	}); err != nil {
		return err
	}
	bounds, err := writeKeyspace(ctx, db, view)
	if err != nil {
		return err
	}
	if err := db.Update(func(tx *bolt.Tx) error { return undoEvents(tx.Bucket(kvBucket), undo) }); err != nil {
		return err
	}
	if err := writeBatches(ctx, db, batches); err != nil {
		return err
	}
	if err := db.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", path, err)
	}
	db.NoSync = false
	rec, err := marshalBounds(bounds)
	if err != nil {
		return err
	}
	return db.Update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(metaBucket).Put(boundsKey, rec); err != nil {
			return fmt.Errorf("writing the copy's bounds: %w", err)
		}
		return putState(tx, s)
	})
}

// writeKeyspace writes the keys of view, a chunk of about chunkBytes per
// transaction, in key order, and returns every BoundsEvery-th key for Open.
func writeKeyspace(ctx context.Context, db *bolt.DB, view revtree.View) (bounds [][]byte, err error) {
	from := []byte{0}
	n := 0
	for from != nil {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		var buf []byte
		var recs [][2][]byte
		var next []byte
		view.Ascend(from, nil, func(kv *mvccpb.KeyValue) bool {
			if len(buf) >= chunkBytes {
				next = kv.Key
				return false
			}
			if n%BoundsEvery == 0 {
				bounds = append(bounds, kv.Key)
			}
			n++
			start := len(buf)
			if buf, err = marshalKV(buf, kv); err != nil {
				return false
			}
			recs = append(recs, [2][]byte{kv.Key, buf[start:len(buf):len(buf)]})
			return true
		})
		if err != nil {
			return nil, err
		}
		if err := db.Update(func(tx *bolt.Tx) error {
			b := tx.Bucket(kvBucket)
			b.FillPercent = 1 // keys come in order
			for _, r := range recs {
				if err := b.Put(r[0], r[1]); err != nil {
					return fmt.Errorf("writing key %q: %w", r[0], err)
				}
			}
			return nil
		}); err != nil {
			return nil, err
		}
		from = next
	}
	return bounds, nil
}

// writeBatches writes the events of batches, about chunkBytes per
// transaction, in revision order.
func writeBatches(ctx context.Context, db *bolt.DB, batches []revtree.Batch) error {
	for len(batches) > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		var size int
		if err := db.Update(func(tx *bolt.Tx) error {
			b := tx.Bucket(eventsBucket)
			b.FillPercent = 1
			for len(batches) > 0 && size < chunkBytes {
				rec, err := marshalEvents(nil, batches[0].Events)
				if err != nil {
					return err
				}
				if err := b.Put(revKey(batches[0].Rev), rec); err != nil {
					return fmt.Errorf("writing revision %d: %w", batches[0].Rev, err)
				}
				size += len(rec)
				batches = batches[1:]
			}
			return nil
		}); err != nil {
			return err
		}
	}
	return nil
}

// undoEvents makes kv the keyspace before the revision of events: each key
// they touch as the first of them found it.
func undoEvents(kv *bolt.Bucket, events []*mvccpb.Event) error {
	undone := map[string]bool{}
	for _, ev := range events {
		if undone[string(ev.Kv.Key)] {
			continue
		}
		undone[string(ev.Kv.Key)] = true
		if ev.PrevKv == nil {
			if err := kv.Delete(ev.Kv.Key); err != nil {
				return fmt.Errorf("undoing revision %d: %w", ev.Kv.ModRevision, err)
			}
			continue
		}
		rec, err := marshalKV(nil, ev.PrevKv)
		if err != nil {
			return err
		}
		if err := kv.Put(ev.Kv.Key, rec); err != nil {
			return fmt.Errorf("undoing revision %d: %w", ev.Kv.ModRevision, err)
		}
	}
	return nil
}

// syncDir makes a rename in dir durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("syncing the copy's directory: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("syncing the copy's directory: %w", err)
	}
	return nil
}
