// Package progress keeps a revtree.Store in step with an etcd cluster through
// one watch on the whole keyspace, and tells readers how fresh the store is.
//
// The Follower loads the keyspace with a paginated Range at one revision R,
// then watches with progress notifications. The watch starts at the store's
// revision, not R+1, on purpose: etcd drops every progress request on a
// stream whose watcher starts beyond its head, which an idle etcd's head + 1
// would be. The events of the store's own revision come back and are
// skipped as duplicates. Events are applied a revision at a time. A broken
// watch resumes the same way, so no event is skipped or applied twice: a
// revision that does not follow the store's revision exactly, or events
// inconsistent with the store, make it reload instead of guessing. A watch
// that cannot resume because etcd compacted the revision meanwhile also
// makes it reload.
//
// Readers prove freshness in two ways: Fence, for a linearizable read, with
// a quorum read of etcd's head shared by concurrent readers (a reader only
// joins a quorum read that started after it arrived); and WaitRevision and
// WaitFresh, with RequestProgress on the watch, coalesced across waiters.
//
// It mirrors etcd's compaction revision: compactions made through the proxy
// are reported with ObserveCompaction, a write to compact_rev_key (what
// kube-apiserver's compactor writes before it compacts) triggers prompt
// probes, and a cheap periodic probe finds all others, such as etcd's own
// auto-compaction.
//
// It also keeps what the upstream member says of itself: the header fields
// copied into responses served from the store, whether it has a leader, and
// its release, read again after every reconnect.
//
// Invariant: the store's revision never exceeds a revision etcd has proven
// complete, by events applied or by a progress notification on the watch.
//
// Every goroutine the Follower starts ends before Run returns.
package progress
