// Package hashcheck checks the cache against etcd, as KEP-4988's consistency
// checker checks kube-apiserver's cache: at one revision R it hashes every
// key of the cache and every key of etcd's answer to a paginated keys-only
// Range at R, and compares.
//
// The hash is FNV-64a over the keys in key order: each key's bytes, then its
// mod_revision as 8 big-endian bytes. Both sides are walked side by side, so
// a mismatch also names the first key that differs.
//
// A Checker runs the check periodically. On a mismatch it puts the proxy in
// fallback, where every read goes to etcd, and makes the follower reload the
// cache. It lifts the fallback only after a later check passes.
package hashcheck
