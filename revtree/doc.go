// Package revtree is an in-memory MVCC copy of an etcd keyspace: a key index
// that keeps every key's versions, as etcd's keyIndex does, and the events of
// every revision retained, so that a Range at any retained revision is
// answered exactly as etcd would answer it.
//
// # Layout
//
// The key index (keyindex.go) is a B-tree of keys ordered by key, each with
// its versions in revision order: the KeyValue a put stored, or nothing for
// a delete. A KeyValue is stored as its protobuf encoding (storedkv), with
// the KeyValue struct beside it only while a retained event holds it: the
// live keyspace costs its encodings, its versions and the tree. The store also keeps one snapshot per retained revision, ordered
// by revision, holding that revision's events. Applying revision N appends
// a version to each key its events touch (inserting the keys it creates)
// and publishes snapshot N. A read at revision R takes the snapshot with
// the greatest revision <= R (a floor lookup) and walks the index over the
// requested range, taking each key's newest version at or below it. No
// tree is copied per revision: a retained revision costs its snapshot, its
// events, its versions and the KeyValues it displaced. KeyValues are never
// mutated after insertion.
//
// How key-values and versions are laid out in memory (entries, bare
// encodings, tagged versions, version arrays, slabs) is package
// internal/storedkv's, whose doc comment states the invariants the layout
// keeps; the store uses its API only.
//
// # Worked example
//
// Load at revision 4 with {a@2, b@4}, then apply put(c)@5, del(a)@6, and a
// Txn put(b),put(d)@7:
//
//	index: a: [2:a@2 6:deleted]
//	       b: [4:b@4 7:b@7]
//	       c: [5:c@5]
//	       d: [7:d@7]
//	snapshots: 4 (load, no events), 5: PUT c, 6: DELETE a (prev a@2),
//	           7: PUT b (prev b@4), PUT d
//
// A read at 5 takes a@2, b@4 and c@5; at 6, b@4 and c@5. Once a progress
// notification proves etcd is at 9 with no change after 7, Advance(9)
// makes revisions 8 and 9 readable from snapshot 7. A read at 3 is older
// than every snapshot: ErrNotRetained (the caller asks etcd). A read at 10
// is ErrFutureRev.
//
// Compact(6) records compaction revision 6 and drops every snapshot older
// than the floor of 6: snapshots 4 and 5 go, 6 stays because a read at
// exactly the compaction revision is still valid in etcd. A read at 5 is
// then ErrCompacted. The sweep then prunes the keys of the dropped
// snapshots' events (here c, which loses nothing). A version goes with the
// snapshot whose event displaced it, whose bytes count it until then: a@2
// stays beside a's delete until snapshot 6 goes, and a then leaves the
// index; b@4 stays until snapshot 7 goes.
//
// # Memory
//
// The store counts its memory per applied revision, with a deterministic
// estimate of each object it keeps (memory.go): the live keyspace (its
// KeyValues, one version of each key and the index's tree) and, on top of
// it, history: per retained revision its snapshot, its events and the
// KeyValues it displaced, the versions and deleted keys the index keeps
// for it, plus the flattened-range cache (flat.go). TestMemoryEstimate
// checks the estimate against runtime.MemStats.
//
// A snapshot dropped from the store (by Compact or the budget) frees its
// snapshot and events at once. The versions only it could read, and the
// KeyValues they hold, go when a sweep prunes their keys, which the drop
// marks (sweep.go): Compact sweeps every marked key before it returns;
// under the budget, a sweep starts once dropped snapshots have left a 64th of
// history to it and advances a stretch of keys per Apply, outside the
// store's lock. ApproxBytes counts what awaits the sweep; the budget
// bounds retained history alone.
//
// SetMaxHistoryBytes bounds history. Past the bound, Apply drops the oldest
// snapshots, as Compact does, but leaves the compaction revision alone:
// etcd still has those revisions, so a read below the new oldest snapshot
// gets ErrNotRetained (the caller asks etcd) and EventsFrom below the new
// history start too (the caller catches up from etcd). The newest snapshot
// always stays. The flattened-range cache takes at most half the budget,
// and never keeps a dropped snapshot's key-values alive.
//
// Unload drops the keyspace and the history before a reload reads the
// keyspace again, so that a reload never holds two stores.
//
// # Concurrency
//
// Every method is safe for concurrent use. Apply, Reset, Unload, Compact
// and SetMaxHistoryBytes change the index (Compact and the budget through
// the sweep) and are serialised by a write lock, so they apply whole
// revisions one at a time; the published state (the store's revision, the
// compaction revision, the snapshot index, the published key index)
// changes under the store's lock, which writers hold only to publish.
// Range, View and the accessors never wait for a writer beyond that lock:
// a View holds the key index published when it was taken, whose histories
// only ever gain versions above the view's revision (keyindex.go), and the
// sweep gives a key a new history rather than change one a view may read,
// so a view stays readable for as long as it is held. A Range that
// flattens a range takes the cache's own lock, and then the store's lock
// to drop snapshots while history is over the budget.
package revtree
