package authcache

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// DefaultPollInterval is how often the mirror asks etcd for its auth
// revision: an auth change reaches cached serializable reads and new
// watches within about this long.
const DefaultPollInterval = time.Second

// Mirror follows etcd's auth state: whether auth is enabled, from
// AuthStatus (which needs no permission), and a Checker of the users, roles
// and permissions at etcd's auth revision, which needs the root role.
type Mirror struct {
	ac       pb.AuthClient
	lg       *zap.Logger
	interval time.Duration
	// enabledProbe, if set, tells cheaply whether auth is enabled, so that
	// AuthStatus, a raft proposal, is paid for only while it is.
	enabledProbe func(ctx context.Context) (bool, error)

	mu sync.Mutex
	// Guarded by mu.
	known    bool     // AuthStatus has answered at least once
	enabled  bool     // auth was enabled at the last AuthStatus
	revision uint64   // the auth revision of the last AuthStatus
	checker  *Checker // at revision; nil when it could not be read
	readErr  error    // why checker could not be read
}

// NewMirror returns a mirror that reads etcd's auth state through ac, with
// the proxy's own credentials; it does nothing until Run. enabledProbe, if
// not nil, is a cheap way to learn whether auth is enabled (a serializable
// read by an anonymous caller fails with "user name is empty" exactly
// then): while it says disabled, AuthStatus is not called.
func NewMirror(ac pb.AuthClient, enabledProbe func(ctx context.Context) (bool, error), lg *zap.Logger, interval time.Duration) *Mirror {
	if interval <= 0 {
		interval = DefaultPollInterval
	}
	return &Mirror{ac: ac, enabledProbe: enabledProbe, lg: lg, interval: interval}
}

// Run polls etcd's auth status until ctx is done, and reads the users and
// roles again whenever the auth revision moves.
func (m *Mirror) Run(ctx context.Context) {
	t := time.NewTicker(m.interval)
	defer t.Stop()
	for {
		m.poll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (m *Mirror) poll(ctx context.Context) {
	m.mu.Lock()
	known, enabled := m.known, m.enabled
	m.mu.Unlock()
	if m.enabledProbe != nil && (!known || !enabled) {
		on, err := m.enabledProbe(ctx)
		if err != nil {
			return // unknown: try again at the next poll
		}
		if !on {
			m.mu.Lock()
			m.known, m.enabled = true, false
			m.mu.Unlock()
			return
		}
	}
	st, err := m.ac.AuthStatus(ctx, &pb.AuthStatusRequest{})
	if err != nil {
		if ctx.Err() == nil {
			m.lg.Debug("reading etcd's auth status failed", zap.Error(err))
		}
		return
	}
	m.mu.Lock()
	// A failed read is tried again at every poll, but warned about once.
	wasEnabled, stale := m.enabled, !m.known || st.AuthRevision != m.revision || m.checker == nil
	m.known, m.enabled, m.revision = true, st.Enabled, st.AuthRevision
	if stale {
		m.checker = nil
	}
	m.mu.Unlock()
	if st.Enabled != wasEnabled {
		m.lg.Info("etcd auth", zap.Bool("enabled", st.Enabled), zap.Uint64("auth-revision", st.AuthRevision))
	}
	if !stale {
		return
	}
	snap, err := Fetch(ctx, m.ac)
	var c *Checker
	if err == nil {
		c, err = NewChecker(snap)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		if m.readErr == nil && ctx.Err() == nil {
			m.lg.Warn("cannot mirror etcd's users and roles (the proxy's identity needs the root role); requests that need them go to etcd or are refused", zap.Error(err))
		}
		m.readErr = err
		return
	}
	if snap.Revision >= m.revision {
		m.checker, m.readErr = c, nil
		m.enabled, m.revision = snap.Enabled, snap.Revision
	}
}

// Enabled reports whether etcd has auth enabled, as of the last poll, and
// whether any poll has answered yet.
func (m *Mirror) Enabled() (enabled, known bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.enabled, m.known
}

// Checker returns the checker of etcd's current auth revision, or nil
// while it is unknown.
func (m *Mirror) Checker() *Checker {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.checker
}
