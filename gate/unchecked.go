package gate

import "context"

// Unchecked is the gate of a proxy in front of an etcd without auth, the
// one kvproxy and watchproxy use when given none: it allows every caller
// it can identify, and leaves a token caller, whom only etcd can judge,
// to etcd (its reads are forwarded, its watch streams relayed).
type Unchecked struct{}

// Forwarding is false: the cache is on.
func (Unchecked) Forwarding() bool { return false }

// AuthorizeRead allows the read, or sends a token caller's to etcd.
func (Unchecked) AuthorizeRead(ctx context.Context, _, _ []byte, _ bool) error {
	if hasToken(ctx) {
		return ErrAskEtcd
	}
	return nil
}

// AuthorizeWatch allows the watch.
func (Unchecked) AuthorizeWatch(context.Context, []byte, []byte) error { return nil }

// RelayWatch relays a token caller's stream.
func (Unchecked) RelayWatch(ctx context.Context) bool { return hasToken(ctx) }

// hasToken reports whether the caller sent a token, which etcd checks.
func hasToken(ctx context.Context) bool {
	_, _, present := bearerTokenOf(ctx)
	return present
}
