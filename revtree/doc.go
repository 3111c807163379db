// Package revtree is an in-memory MVCC copy of an etcd keyspace: a key-ordered
// B-tree of *mvccpb.KeyValue, a copy-on-write snapshot of that tree every few
// revisions, and the events of every revision retained, so that a Range at any
// retained revision is answered exactly as etcd would answer it.
//
// # Layout
//
// The store keeps a mutable working tree (latest) that only writers touch,
// one at a time, and an index of immutable snapshots ordered by revision,
// one per applied revision. Applying revision N mutates latest and then
// publishes a snapshot for N that holds N's events. Every
// DefaultCheckpointInterval revisions (SetCheckpointInterval), and after a
// load, the snapshot is a checkpoint: it also holds latest.Clone(). Clone
// is O(1): the checkpoint and latest share every node until latest next
// writes one, at which point latest copies the path from the root to that
// node. The writes of a whole window between two checkpoints copy each
// node once, so a retained revision costs its share of the window's paths
// rather than a path of its own; the window's writes spread over distinct
// leaves, so that share falls slowly as the interval grows. KeyValues are
// shared by all snapshots that contain them and are never mutated after
// insertion.
//
// A snapshot between checkpoints links back to the snapshot before it, up
// to its checkpoint, and is read from the checkpoint's tree overlaid with
// the events of the snapshots on the way (overlay.go): a key's newest
// event in that window is its state, a put's KeyValue or absent after a
// delete. Every Range result is computed from that merged iteration as
// from a tree. The newest snapshot also holds a clone of latest while it
// is the newest, so reads at the head overlay nothing; the next revision
// clears it, and the path copies it caused are garbage.
//
// # Worked example
//
// Load at revision 4 with {a@2, b@4}, then apply put(c)@5, del(a)@6, and a
// Txn put(b),put(d)@7, with a checkpoint interval of 2:
//
//	snapshot 4: tree {a@2 b@4}       events: none (load; a checkpoint)
//	snapshot 5: read as 4 + PUT c    events: PUT c
//	snapshot 6: tree {b@4 c@5}       events: DELETE a (prev a@2); a checkpoint
//	snapshot 7: read as 6 + PUT b, PUT d (and its own tree while newest)
//	                                 events: PUT b (prev b@4), PUT d
//
// A read at 5 overlays PUT c on {a@2 b@4}: {a@2 b@4 c@5}. A read at
// revision R uses the snapshot with the greatest revision <= R (a floor
// lookup). Once a progress notification proves etcd is at 9 with no
// change after 7, Advance(9) makes revisions 8 and 9 readable from snapshot 7.
// A read at 3 is older than every snapshot: ErrNotRetained (the caller asks
// etcd). A read at 10 is ErrFutureRev.
//
// Compact(6) records compaction revision 6 and drops every snapshot older than
// the floor of 6: snapshots 4 and 5 go, 6 stays because a read at exactly the
// compaction revision is still valid in etcd. A read at 5 is then ErrCompacted.
// Had it been Compact(5), snapshot 4 would have left the index but its
// tree would stay, reachable from snapshot 5, for as long as 5 is.
//
// # Memory
//
// The store counts its memory per applied revision, with a deterministic
// estimate of each object it keeps (memory.go): the live keyspace (its
// KeyValues and tree) and, on top of it, history: per retained revision
// its snapshot, its share of the tree nodes its window's writes copied
// (and a cloned tree header for a checkpoint), its events and the
// KeyValues it displaced, plus the flattened-range cache (flat.go).
// TestMemoryEstimate checks the estimate against runtime.MemStats.
//
// A snapshot dropped from the index (by Compact or the budget) frees its
// memory once no retained snapshot links back to it: at once if the new
// oldest snapshot is a checkpoint, else when the rest of its window goes.
// The estimate counts it freed when it is dropped, so it runs ahead of the
// heap by at most one window.
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
// snapshots (but for the newest snapshot's own tree, which View reads and
// Apply clears under the store's lock; a View keeps the tree it took); a
// Range that flattens a range takes the cache's own lock, and then the
// store's to keep history within the budget.
package revtree
