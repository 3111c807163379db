package gate

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
)

// The attributes a checked request's span gets (with
// --enable-distributed-tracing): where its permission answer came from.
const (
	// attrAuth is one of the authSource values.
	attrAuth = attribute.Key("snapcache.auth")
	// attrAuthRevision is the auth revision the request was checked at.
	attrAuthRevision = attribute.Key("snapcache.auth_revision")
)

// Where a request's permission answer came from.
const (
	authFromDisabled = "disabled" // auth is off: etcd allows everything
	authFromMirror   = "mirror"   // the mirror of etcd's auth store, as last polled
	authFromProof    = "proven"   // the mirror at an auth revision a shared AuthStatus proved after the request arrived
	authFromEtcd     = "etcd"     // only etcd can judge the caller: the request goes to etcd with its credentials
	authUnknown      = "unknown"  // the auth state could not be had: the request is refused
)

// traceAuth says on the span of ctx, if it records, where authFor's
// answer came from.
func traceAuth(ctx context.Context, chk *authcache.Checker, proven bool, err error) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	switch {
	case errors.Is(err, ErrAskEtcd):
		span.SetAttributes(attrAuth.String(authFromEtcd))
	case err != nil && chk == nil:
		span.SetAttributes(attrAuth.String(authUnknown))
	case chk == nil:
		span.SetAttributes(attrAuth.String(authFromDisabled))
	case proven:
		span.SetAttributes(attrAuth.String(authFromProof), attrAuthRevision.Int64(int64(chk.Revision())))
	default:
		span.SetAttributes(attrAuth.String(authFromMirror), attrAuthRevision.Int64(int64(chk.Revision())))
	}
}
