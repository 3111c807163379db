// Package kvproxy serves etcd's KV service in front of an etcd cluster.
//
// A Range is answered from the revtree store when the store provably holds
// etcd's answer: at a revision the store retains; serializable at a
// revision the store has reached; or linearizable, once the follower's read
// fence has proven that the store holds every write etcd acknowledged
// before the read arrived. Otherwise it goes to etcd: a revision older than
// the store's oldest snapshot, a revision the store has not reached in time,
// a linearizable read whose freshness was not proven in time (unless
// --consistent-read-fallback=fail), a keys-only read while the upstream's
// release is unknown, or a read carrying an auth token (the store cannot
// check permissions). decide, a pure function of the request and the
// state route reads, decides, with one typed reason per decision; route
// waits for what it asks and carries it out.
// Put, DeleteRange, Txn and Compact always go to etcd and their responses
// are returned unchanged; a successful Compact is mirrored into the store.
//
// Invariant: a response served from the store is the response etcd gives for
// the same request at the same revision, error codes and messages included.
package kvproxy
