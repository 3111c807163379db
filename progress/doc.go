// Package progress keeps a revtree.Store in step with an etcd cluster through
// one watch on the whole keyspace, and tells readers how fresh the store is.
//
// The Follower loads the keyspace with a paginated Range at one revision R,
// then watches from R+1 with progress notifications. It applies events a
// revision at a time, and resumes a broken watch from the store's revision
// + 1, so no event is skipped or applied twice: a revision that does not
// follow the store's revision exactly, or events inconsistent with the store,
// make it reload instead of guessing. A watch that cannot resume because etcd
// compacted the revision meanwhile also makes it reload.
//
// It mirrors etcd's compaction revision: compactions made through the proxy
// are reported with ObserveCompaction, a write to compact_rev_key (what
// kube-apiserver's compactor writes before it compacts) triggers prompt
// probes, and a cheap periodic probe finds all others, such as etcd's own
// auto-compaction.
//
// Invariant: the store's revision never exceeds a revision etcd has proven
// complete, by events applied or by a progress notification on the watch.
package progress
