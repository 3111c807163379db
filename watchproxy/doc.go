// Package watchproxy serves etcd's Watch service from the proxy's own event
// history, so that any number of client watches cost etcd one watch: the
// follower's.
//
// Every client stream has one send loop, and only that loop sends on the
// stream. It handles the stream's requests in order (a create is answered
// with its created response before any event of that watch), and reads each
// watcher's events from the immutable per-revision history in revtree at its
// own pace. A slow client therefore only delays its own stream: it never
// blocks the follower or another stream, and it holds no queue of events,
// only the batch being sent. Compaction cancels watchers as etcd's mvcc
// does: an unsynced watcher (one that started in the past and has not
// reached the head yet) whose next revision etcd compacted gets the cancel
// with compact_revision; a synced one never does, even for a compaction
// mirrored above the store's head, and reads on from the history, unless
// its slow client let the events it needs be dropped.
//
// A send loop has no timer: it is woken by its client's requests, by
// events that concern its watchers (notifier, by key, as etcd's
// watchableStore.notify), and by one goroutine for every stream for what
// no event announces (streamWaker: the periodic progress tick, a failed
// consistency check, a new epoch of etcd's history). An idle stream costs
// nothing.
//
// Events are encoded once, not once per watcher: a server-wide cache holds
// the newest revisions' events in their wire form, with and without
// prev_kv, and every stream sends those bytes behind each response's own
// header and watch id, through the gRPC codec of internal/wirecodec, which
// the server must install (wirecodec.ServerOption; without it the
// responses are decoded and encoded again, correct but slow). The bytes
// are those proto.Marshal gives for the same response, fragments
// included.
//
// A watcher whose start revision is older than the proxy's history but still
// retained by etcd (after a proxy restart or reload) is caught up from etcd
// with one bounded upstream watch of its range. Its events up to where the
// proxy's history begins are relayed. The watcher then continues from the
// history, with no gap and no duplicate. At most maxCatchups such watches
// are open at once; one whose client stops reading gives its slot up after
// catchupStall and goes on later from where it was, one whose upstream
// watch breaks is opened again, and one that etcd refuses ends its own
// watcher with etcd's cancel, never the stream. Streams whose requests
// carry an auth token are relayed to etcd whole, because only etcd can check
// the caller's permissions. While the consistency checker holds the cache
// wrong, new streams are relayed, and running ones cancel every watcher as
// compacted, so that clients relist, and end with Unavailable.
//
// Ordering invariants, per stream:
//   - responses leave in the order the send loop produces them, so created
//     precedes events, and progress never overtakes events;
//   - a watcher's events are in revision order, each revision whole (unless
//     the watcher asked for fragments), none repeated or skipped;
//   - a requested progress notification (watch id -1) reports revision R
//     only after every watcher of the stream has been sent everything up to
//     R, and R is at least etcd's revision when the request arrived.
package watchproxy
