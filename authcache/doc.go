// Package authcache mirrors etcd's users, roles and permissions in memory
// and answers permission questions about them with etcd's own code: a
// Checker runs etcd's auth store (go.etcd.io/etcd/server/v3/auth) on an
// in-memory backend filled from a Snapshot, so that a cached read is
// allowed or refused exactly as etcd would allow or refuse it, error and
// all (root role, range, prefix and from-key semantics, auth disabled, an
// unknown user, an empty user name, an old auth revision).
//
// A Snapshot is read from etcd with the Auth admin RPCs, which need the
// root role, between two AuthStatus calls that agree on the auth revision,
// so that it is one auth revision's state.
//
// Invariant: a Checker is immutable; a newer auth revision gets a new one.
package authcache
