package drain

import (
	"context"
	"errors"
	"strings"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/balancer"
)

// ProbeInterval is how often a READY subchannel's member is asked for its
// Status. A probe costs the member a few atomic reads and one read lock.
const ProbeInterval = time.Second

// ProbeTimeout is how long a member has to answer a probe. It is well under
// keepalive's 50 s, so that a hung member is avoided within
// ProbeInterval+ProbeTimeout (4 s) of its last answer, and well above the
// second a slow fsync may hold the member's backend (etcd warns of a slow
// fdatasync at 1 s), so that a member with a slow disk is not flapped.
const ProbeTimeout = 3 * time.Second

// prober is the producer that probes one subchannel for one READY period:
// gRPC builds it on the subchannel (so its calls go on that subchannel's
// transport alone, past the picker and the connection's interceptors) and
// closes it at the subchannel's next state change or shutdown. Its
// goroutine is the clientConn's: the balancer's Close stops it too, and
// waits for it.
//
// gRPC's own client-side health checking (a grpc.health.v1 Watch stream per
// subchannel) cannot see a hung member: the stream stays open with its last
// status, SERVING, when nothing more comes. And an endpoint it finds
// unhealthy leaves round_robin's picker altogether, which fails every call
// when all are.
type prober struct {
	cc *clientConn
	sc *subConn
}

func (p *prober) Build(cci any) (balancer.Producer, func()) {
	conn, ok := cci.(grpc.ClientConnInterface)
	if !ok || !p.cc.startProbe() {
		return p, func() {}
	}
	ctx, cancel := context.WithCancel(p.cc.ctx)
	done := make(chan struct{})
	go func() {
		defer p.cc.probes.Done()
		defer close(done)
		p.run(ctx, pb.NewMaintenanceClient(conn))
	}()
	return p, func() {
		cancel()
		<-done
	}
}

// run probes at once, to learn whether the member leads, then every
// ProbeInterval until ctx ends. The probes of every subchannel of the
// process tick together, on whole multiples of ProbeInterval: an idle
// proxy then wakes once a second for all its members rather than once per
// member.
func (p *prober) run(ctx context.Context, m pb.MaintenanceClient) {
	next := time.NewTimer(0)
	defer next.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-next.C:
			next.Reset(untilNextTick(now))
		}
		answered := probe(ctx, m, p.sc.addr)
		if ctx.Err() != nil {
			return
		}
		if p.sc.setResponsive(answered) {
			if !answered {
				unresponsiveTotal.WithLabelValues(p.sc.addr).Inc()
			}
			p.cc.moveOffUnresponsive()
		}
	}
}

// probe reports whether the member answered a Status request within
// ProbeTimeout, and records in statuses whether it said it leads, and its
// release. Any answer counts, an error from etcd too (a refused auth
// token, say): it proves the member and the path to it work. A transport
// that fails ends the READY period, and so the probe.
//
// The request carries the connection's token, as every call on it does:
// with auth on, etcd checks it (Status needs an authenticated user, no
// permission). So a probe keeps the proxy's own simple token from expiring
// idle, as its other calls do, and costs one signature check with JWT. A
// connection without a user (the forwarding one without --user) is refused
// with "user name is empty", which etcd does not log. A token etcd no
// longer knows (etcd restarted) makes etcd log "invalid auth token" for
// each probe until clientv3 authenticates again, which it does when a call
// of that connection that reaches the member is refused for it (the
// compaction probe's reads, every second, are spread over the members).
// Meanwhile the member counts as answering, and its leadership and
// release are unknown.
func probe(ctx context.Context, m pb.MaintenanceClient, addr string) bool {
	pctx, cancel := context.WithTimeout(ctx, ProbeTimeout)
	defer cancel()
	st, err := m.Status(pctx, &pb.StatusRequest{})
	if err != nil {
		return !errors.Is(pctx.Err(), context.DeadlineExceeded)
	}
	ms := memberStatus{release: majorMinor(st.Version), term: st.RaftTerm}
	if st.Header != nil {
		ms.leader = st.Leader != 0 && st.Leader == st.Header.MemberId
	}
	noteStatus(addr, ms)
	return true
}

// untilNextTick is how long from now to the next whole multiple of
// ProbeInterval, at least half an interval away.
func untilNextTick(now time.Time) time.Duration {
	d := now.Truncate(ProbeInterval).Add(ProbeInterval).Sub(now)
	if d < ProbeInterval/2 {
		d += ProbeInterval
	}
	return d
}

// majorMinor is version's "major.minor" ("3.7" of "3.7.3"), or "" if it
// has no minor.
func majorMinor(version string) string {
	major, rest, ok := strings.Cut(version, ".")
	if !ok {
		return ""
	}
	minor, _, _ := strings.Cut(rest, ".")
	return major + "." + minor
}
