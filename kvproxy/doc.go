// Package kvproxy serves etcd's KV service in front of an etcd cluster.
//
// A Range is answered from the revtree store when the store provably holds
// etcd's answer: at a revision the store retains, or serializable at the
// current revision. Otherwise it goes to etcd: a linearizable read at the
// current revision, a revision older than the store's oldest snapshot, a
// revision the store has not reached in time, or a read carrying an auth
// token (the store cannot check permissions). Put, DeleteRange, Txn and
// Compact always go to etcd and their responses are returned unchanged; a
// successful Compact is mirrored into the store.
//
// Invariant: a response served from the store is the response etcd gives for
// the same request at the same revision, error codes and messages included.
package kvproxy
