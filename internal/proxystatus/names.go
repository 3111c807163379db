package proxystatus

// Mode is what the proxy serves from: the mode metric's label and the
// document's mode.
type Mode string

const (
	// ModeCache: the cache answers for etcd.
	ModeCache Mode = "cache"
	// ModeLoading: the cache is being loaded or reloaded.
	ModeLoading Mode = "loading"
	// ModeForwarding: the cache is off; the proxy has no identity of its
	// own and etcd has auth enabled, so every request goes to etcd as it
	// came.
	ModeForwarding Mode = "forwarding"
	// ModeFallback: the consistency checker found the cache inconsistent;
	// reads and watches go to etcd until a check passes.
	ModeFallback Mode = "fallback"
)

// Modes are every mode, each a series of the mode metric.
var Modes = []Mode{ModeCache, ModeLoading, ModeForwarding, ModeFallback}

// Shown is the mode as `etcd-snapcache status` names it: serving for the
// cache's, which reads better in a table of proxies; the others as they
// are.
func (m Mode) Shown() string {
	if m == ModeCache {
		return "serving"
	}
	return string(m)
}

// Reason is why the proxy is in m, for the modes in which the cache does
// not answer for a reason an operator may act on; "" for the others.
func (m Mode) Reason() string {
	switch m {
	case ModeForwarding:
		return "etcd auth on, the proxy has no identity of its own"
	case ModeFallback:
		return "consistency check failed"
	}
	return ""
}

// Source is where a Range was answered from: the ranges metric's source
// label.
type Source string

const (
	SourceCache     Source = "cache"
	SourceForwarded Source = "forwarded"
	SourceRejected  Source = "rejected"
)

// Sources are every source.
var Sources = []Source{SourceCache, SourceForwarded, SourceRejected}
