// Package hashcheck checks the cache against etcd, as KEP-4988's consistency
// checker checks kube-apiserver's cache: at one revision R it hashes every
// key of the cache and every key etcd has at R, and compares.
//
// etcd is read with keys-only Ranges at R over chunks of the keyspace cut
// at every 10000th key of the cache (the first from "\x00", the last to
// the end of the keyspace), each read in pages of at most 20000 keys; the
// next answers are read while one is compared. etcd counts every key of a
// Range to answer it, so Ranges from each page to the end of the keyspace,
// as RangeEntries reads for callers with no cache at hand, cost etcd time
// quadratic in the number of keys; chunks cost it linear time.
//
// The hash is FNV-64a over the keys in key order: each key's bytes, then its
// mod_revision as 8 big-endian bytes. Both sides are walked side by side, so
// a mismatch also names the first key that differs.
//
// A Checker runs the check periodically. On a mismatch it puts the proxy in
// fallback, where every read goes to etcd, and makes the follower reload the
// cache. It lifts the fallback only after a later check passes.
package hashcheck
