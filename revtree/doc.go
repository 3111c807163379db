// Package revtree is an in-memory MVCC copy of an etcd keyspace: a key-ordered
// B-tree of *mvccpb.KeyValue, plus one copy-on-write snapshot of that tree for
// every revision retained, so that a Range at any retained revision is answered
// exactly as etcd would answer it.
//
// # Layout
//
// The store keeps a mutable working tree (latest) that only writers touch,
// one at a time, and an index of immutable snapshots ordered by revision. Applying
// revision N mutates latest and then publishes latest.Clone() as the snapshot
// for N. Clone is O(1): the snapshot and latest share every node until latest
// next writes one, at which point latest copies the path from the root to
// that node. A retained revision therefore costs one root-to-leaf path of
// nodes, not a copy of the keyspace. KeyValues are shared by all snapshots
// that contain them and are never mutated after insertion.
//
// # Worked example
//
// Load at revision 4 with {a@2, b@4}, then apply put(c)@5, del(a)@6, and a
// Txn put(b),put(d)@7:
//
//	snapshot 4: {a@2 b@4}            events: none (load)
//	snapshot 5: {a@2 b@4 c@5}        events: PUT c
//	snapshot 6: {b@4 c@5}            events: DELETE a (prev a@2)
//	snapshot 7: {b@7 c@5 d@7}        events: PUT b (prev b@4), PUT d
//
// A read at revision R uses the snapshot with the greatest revision <= R (a
// floor lookup). Once a progress notification proves etcd is at 9 with no
// change after 7, Advance(9) makes revisions 8 and 9 readable from snapshot 7.
// A read at 3 is older than every snapshot: ErrNotRetained (the caller asks
// etcd). A read at 10 is ErrFutureRev.
//
// Compact(6) records compaction revision 6 and drops every snapshot older than
// the floor of 6: snapshots 4 and 5 go, 6 stays because a read at exactly the
// compaction revision is still valid in etcd. A read at 5 is then ErrCompacted.
//
// # Memory
//
// The store counts its memory per applied revision, with a deterministic
// estimate of each object it keeps (memory.go): the live keyspace (its
// KeyValues and tree) and, on top of it, history: per retained revision
// its snapshot, the tree nodes its writes copied, its events and the
// KeyValues it displaced, plus the flattened-range cache (flat.go).
// TestMemoryEstimate checks the estimate against runtime.MemStats.
//
// SetMaxHistoryBytes bounds history. Past the bound, Apply drops the oldest
// snapshots, as Compact does, but leaves the compaction revision alone:
// etcd still has those revisions, so a read below the new oldest snapshot
// gets ErrNotRetained (the caller asks etcd) and EventsFrom below the new
// history start too (the caller catches up from etcd). The newest snapshot
// always stays. The flattened-range cache takes at most half the budget,
// and never keeps a dropped snapshot's tree alive.
//
// Unload drops the keyspace and the history before a reload reads the
// keyspace again, so that a reload never holds two stores.
//
// # Concurrency
//
// Every method is safe for concurrent use. Apply, Reset and Unload change
// latest and are serialised by a write lock, so they apply whole revisions
// one at a time. Advance, Compact and SetMaxHistoryBytes change only the
// published state (the store's revision, the compaction revision, the
// snapshot index) under the store's lock, so the follower, the compaction
// probe and forwarded Compact calls may call them concurrently with Apply.
// Range, View and the accessors only ever touch published, immutable
// snapshots; a Range that flattens a range takes the cache's own lock, and
// then the store's to keep history within the budget.
package revtree
