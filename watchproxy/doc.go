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
// only the batch being sent. A watcher that falls behind etcd's compaction
// is canceled with compact_revision, as etcd cancels it.
//
// A watcher whose start revision is older than the proxy's history but still
// retained by etcd (after a proxy restart or reload) is caught up from etcd
// with one bounded upstream watch of its range. Its events up to where the
// proxy's history begins are relayed. The watcher then continues from the
// history, with no gap and no duplicate. Streams whose requests carry an
// auth token are relayed to etcd whole, because only etcd can check the
// caller's permissions.
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
