// Package persist keeps a copy of the cache on local disk, so that a
// restarted proxy starts warm: it restores the keyspace and the history it
// retained from the copy and reads from etcd only what changed since,
// instead of the whole keyspace. progress.Follower proves the copy is
// etcd's history before anything is served from it.
//
// # On disk
//
// One bbolt file, <data-dir>/snapcache/cache.db, holds one consistent copy:
//
//	meta    "state":  format version, etcd's cluster id, the base revision
//	                  B, the revision R the copy is complete up to, etcd's
//	                  compaction revision as the cache mirrored it
//	        "bounds": every BoundsEvery-th key of kv when it was written
//	                  whole, where the check against etcd cuts its reads
//	kv      key:      the KeyValue of the key at B, as etcd encodes it
//	events  revision: the events of that revision (put or delete, without
//	                  prev_kv), for every revision with events in (B, R]
//
// The keyspace at R is kv with the events applied; each revision between
// B and R is readable and watchable after a restore, as it was before.
// Every value starts with a CRC-32C of the rest, and the meta record
// names the format, so that a damaged file is found on reading, never
// served.
//
// # When it is written
//
// A Persister copies the store on its own goroutine, every interval (a
// second by default), never on the path of event apply, reads or watch
// sends, and only while the follower serves: a copy is always of a
// history the proxy served. Each copy is one bbolt transaction, committed
// with fsync, so a kill -9 or a power cut leaves the previous copy or the
// new one, never a mix. It appends the events of the revisions after R,
// and folds into kv the events of the revisions the store no longer
// retains (compacted, or dropped for --max-history-bytes), so that the
// copy holds no more history than memory does.
//
// When the copy cannot continue the store's history (the first copy, a
// reload, history dropped faster than it was copied), the Persister
// writes a whole new copy to cache.db.new, in transactions of a few MiB,
// meta last, and renames it over cache.db: until the rename the old copy
// stays whole.
//
// A write that fails (a full disk, a read-only --data-dir) is logged and
// counted, the proxy keeps serving from memory, and the copy is written
// whole again once the disk takes it.
package persist
