// Package drain ends the proxy's own long-lived upstream streams as soon as
// the connection they run on stops being ready, or its member stops
// answering, so that they resume on another connection at once; and it
// keeps calls off a member that stops answering.
//
// A member that stops gracefully (SIGTERM, a rolling restart or upgrade)
// sends GOAWAY and then waits, up to its request timeout (5 s plus two
// election timeouts), for every open stream to end before it stops. A
// stream that stays holds the member's restart for that long, and follows a
// member that is leaving. gRPC learns of the GOAWAY at once (the subchannel
// goes idle) but keeps the streams already open on the draining transport.
// The proxy's upstream watch, progress ticker and lease keepalive streams
// resume by themselves from where they were, so for them, and only for
// them, the connection's first step out of READY ends the stream.
//
// A member that is hung (SIGSTOP, a stalled disk holding its storage
// locks) or whose network path stalls keeps its connection READY: gRPC
// notices only when keepalive gives up (--dial-keepalive-time plus its
// timeout, 50 s by default). So while a subchannel is READY, a probe sends
// Maintenance.Status on it alone every ProbeInterval, with ProbeTimeout to
// answer. Any answer (an error from etcd too) makes the subchannel
// responsive; no answer in time makes it unresponsive, which
//
//   - makes the picker skip it while another READY responsive subchannel
//     exists (with none, it picks as round_robin does: the member may still
//     answer, and refusing would fail every call);
//   - ends the streams opened with a context from Context that run on it,
//     with a cause wrapping ErrUnresponsive that names the member, whenever
//     another READY responsive subchannel exists (they move there).
//
// Its next answer makes it responsive again. A member that hangs is avoided
// within ProbeInterval+ProbeTimeout (4 s) of its last answer.
//
// A Status answer also says whether the member leads, and its release:
// calls with a context from ToLeader (proposals: writes, lease grants) go
// to the leader while it answers, so that a follower that hangs holds none
// of them; and MixedReleases says when the members run different releases
// (a rolling upgrade or downgrade).
//
// Status is answered by the member itself, without raft: it reads raft's
// in-memory state, and the storage version under the backend's read lock.
// That lock is held by each backend commit (for its fsync) and by a
// defragmentation (for all of it), which hold up the member's reads too: a
// member in a defragmentation longer than ProbeTimeout is avoided until it
// ends (one transition each way, not a flap), as its reads would wait.
//
// It is a balancer wrapped around grpc-go's round_robin (the policy
// clientv3 picks): it watches each subchannel's state and health, and
// records, for each stream opened with a context from Context, the
// subchannel it was picked on.
package drain

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/balancer"
	"google.golang.org/grpc/balancer/roundrobin"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/resolver"
)

// Name is the balancer's registered name.
const Name = "etcd_snapcache_drain_round_robin"

func init() { balancer.Register(builder{}) }

// DialOptions make a connection use the balancer. clientv3's resolver
// names round_robin in the service config it sends, so the connection
// ignores the resolver's service config and uses this one by default.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithDisableServiceConfig(),
		grpc.WithDefaultServiceConfig(fmt.Sprintf(`{"loadBalancingPolicy": %q}`, Name)),
	}
}

// ErrDraining is the cause of a context from Context canceled because the
// connection its stream runs on left READY.
var ErrDraining = errors.New("the connection to the etcd member is going away")

// ErrUnresponsive is the cause of a context from Context canceled because
// the member its stream runs on did not answer a probe within ProbeTimeout
// while another member did.
var ErrUnresponsive = errors.New("the etcd member does not answer")

// Context returns a context for one upstream stream (and its retries). Once
// the stream is picked on a subchannel of a connection dialed with
// DialOptions, that subchannel leaving READY cancels the context with a
// cause that wraps ErrDraining, and its member becoming unresponsive while
// another answers cancels it with a cause that wraps ErrUnresponsive.
// Without such a connection it is a plain cancelable context. cancel
// releases it, as context.WithCancel's does.
func Context(parent context.Context) (ctx context.Context, cancel context.CancelFunc) {
	ctx, cancelCause := context.WithCancelCause(parent)
	s := &stream{cancel: cancelCause}
	return context.WithValue(ctx, streamKey{}, s), func() { cancelCause(context.Canceled) }
}

type streamKey struct{}

// Moved reports whether ctx, a context from Context, was canceled by
// drain: its member went away (ErrDraining) or stopped answering
// (ErrUnresponsive), so a call made with it may be made again elsewhere.
func Moved(ctx context.Context) bool {
	cause := context.Cause(ctx)
	return errors.Is(cause, ErrDraining) || errors.Is(cause, ErrUnresponsive)
}

type avoidKey struct{}

// Avoid returns a context whose calls are not picked on member (an address
// as Member returns it) while another member is READY and answers its
// probes: how a hedged call reaches a member other than the one its first
// attempt waits on. With no such other member it picks as round_robin
// does.
func Avoid(ctx context.Context, member string) context.Context {
	if member == "" {
		return ctx
	}
	return context.WithValue(ctx, avoidKey{}, member)
}

type leaderKey struct{}

// ToLeader returns a context whose calls are picked on the member that
// last said, in answer to its probe, that it is etcd's leader (at the
// highest raft term, if two say so), while that member is READY, answers
// its probes and is not avoided; otherwise they are picked as without it.
// It is for proposals (writes, lease grants): a follower only forwards
// them to the leader, so a write sent to a follower that hangs (or that is
// being defragmented) waits out its caller's deadline although the cluster
// can commit it; sent to the leader it depends on nothing the leader does
// not depend on anyway.
func ToLeader(ctx context.Context) context.Context {
	return context.WithValue(ctx, leaderKey{}, true)
}

// Member returns the address of the member the latest call made with ctx,
// a context from Context, was picked on, or "" if none was.
func Member(ctx context.Context) string {
	st, ok := ctx.Value(streamKey{}).(*stream)
	if !ok {
		return ""
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.member
}

// stream is one stream opened with a context from Context.
type stream struct {
	cancel context.CancelCauseFunc

	mu     sync.Mutex
	member string // guarded by mu; the latest pick's address
}

func (st *stream) pickedOn(addr string) {
	st.mu.Lock()
	st.member = addr
	st.mu.Unlock()
}

type builder struct{}

func (builder) Name() string { return Name }

func (builder) Build(cc balancer.ClientConn, opts balancer.BuildOptions) balancer.Balancer {
	w := newClientConn(cc)
	track(w)
	return &wrapped{Balancer: balancer.Get(roundrobin.Name).Build(w, opts), cc: w}
}

// wrapped is round_robin, whose Close also stops the probes.
type wrapped struct {
	balancer.Balancer
	cc *clientConn
}

func (b *wrapped) Close() {
	b.Balancer.Close()
	b.cc.close()
	untrack(b.cc)
}

// clientConn is what round_robin (and its pick_first children) see of the
// connection: it tracks every subchannel they create and wraps every picker
// they publish. It owns the probes: each runs while its subchannel is
// READY, and close stops them all and waits for them.
type clientConn struct {
	balancer.ClientConn

	// ctx is the probes' parent, canceled by close; probes counts them.
	ctx    context.Context
	stop   context.CancelFunc
	probes sync.WaitGroup

	mu       sync.Mutex
	subConns map[balancer.SubConn]*subConn // guarded by mu; until shut down
	closed   bool                          // guarded by mu; no probe starts once set
}

func newClientConn(cc balancer.ClientConn) *clientConn {
	ctx, stop := context.WithCancel(context.Background())
	return &clientConn{ClientConn: cc, ctx: ctx, stop: stop, subConns: map[balancer.SubConn]*subConn{}}
}

// close stops every probe and waits for them.
func (c *clientConn) close() {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.stop()
	c.probes.Wait()
}

// startProbe counts a probe about to start, unless the balancer is closed.
func (c *clientConn) startProbe() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.probes.Add(1)
	return true
}

func (c *clientConn) NewSubConn(addrs []resolver.Address, opts balancer.NewSubConnOptions) (balancer.SubConn, error) {
	sc := &subConn{state: connectivity.Idle}
	if len(addrs) > 0 {
		sc.addr = addrs[0].Addr
	}
	listener := opts.StateListener
	var created balancer.SubConn
	opts.StateListener = func(s balancer.SubConnState) {
		if sc.setState(s.ConnectivityState) {
			// A member joins or leaves the READY ones whose releases count.
			defer updateReleases()
		}
		switch s.ConnectivityState {
		case connectivity.Shutdown:
			c.mu.Lock()
			delete(c.subConns, created)
			c.mu.Unlock()
		case connectivity.Ready:
			// gRPC closes the producer, and so stops the probe, at the
			// subchannel's next state change, before telling us.
			c.mu.Lock()
			inner := created
			c.mu.Unlock()
			if inner != nil {
				inner.GetOrBuildProducer(&prober{cc: c, sc: sc})
			}
			// A new responsive subchannel: streams can leave unresponsive ones.
			c.moveOffUnresponsive()
		}
		if listener != nil {
			listener(s)
		}
	}
	inner, err := c.ClientConn.NewSubConn(addrs, opts)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	created = inner
	c.subConns[inner] = sc
	c.mu.Unlock()
	return inner, nil
}

func (c *clientConn) UpdateState(s balancer.State) {
	if s.Picker != nil {
		s.Picker = &picker{Picker: s.Picker, cc: c}
	}
	c.ClientConn.UpdateState(s)
}

func (c *clientConn) tracked(sc balancer.SubConn) *subConn {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.subConns[sc]
}

// picker skips unresponsive subchannels while a responsive one is READY,
// and records the subchannel each stream from Context is picked on.
type picker struct {
	balancer.Picker
	cc *clientConn
}

func (p *picker) Pick(info balancer.PickInfo) (balancer.PickResult, error) {
	res, sc, err := p.pickResponsive(info)
	if err != nil {
		return res, err
	}
	st, ok := info.Ctx.Value(streamKey{}).(*stream)
	if !ok || sc == nil {
		return res, nil
	}
	st.pickedOn(sc.addr)
	// A context may carry more than one call (a stream's retries, or a
	// unary call made for the stream): each pick is recorded on its own.
	pk := &pick{stream: st}
	sc.add(pk)
	done := res.Done
	res.Done = func(di balancer.DoneInfo) {
		sc.remove(pk)
		if done != nil {
			done(di)
		}
	}
	if !sc.isResponsive() && p.cc.anyResponsive("") {
		// It became unresponsive since it was picked (or since
		// moveOffUnresponsive looked).
		sc.end(pk, sc.unresponsive())
	}
	return res, nil
}

// errSkipped is the DoneInfo error of a pick the picker did not use.
var errSkipped = errors.New("drain: pick skipped for a member that answers, or is not avoided")

// pickResponsive picks as round_robin does, and picks again while a
// better subchannel is READY: for a call from ToLeader, the leader's (see
// leader); else one that answers its probes and is not to the member the
// call's context avoids; else one that answers its probes. round_robin's
// picker takes its READY subchannels in turn, so as many picks as there
// are subchannels reach every one; if none is better the first pick
// stands, or the first that answers and is not avoided, if one did.
func (p *picker) pickResponsive(info balancer.PickInfo) (balancer.PickResult, *subConn, error) {
	res, err := p.Picker.Pick(info)
	if err != nil {
		return res, nil, err
	}
	sc := p.cc.tracked(res.SubConn)
	if sc == nil {
		return res, sc, nil
	}
	avoid, _ := info.Ctx.Value(avoidKey{}).(string)
	usable := func(sc *subConn) bool { return sc.isResponsive() && sc.addr != avoid }
	want := usable
	if info.Ctx.Value(leaderKey{}) != nil {
		if leader := p.cc.leader(avoid); leader != "" {
			want = func(sc *subConn) bool { return sc.addr == leader && sc.isResponsive() }
		}
	}
	switch {
	case want(sc):
		return res, sc, nil
	case p.cc.anyResponsive(avoid):
	case !sc.isResponsive() && p.cc.anyResponsive(""):
		// Only the avoided member answers: better it than a hung one.
		want, usable = (*subConn).isResponsive, (*subConn).isResponsive
	default:
		return res, sc, nil
	}
	var fallback *balancer.PickResult
	var fallbackSC *subConn
	for range p.cc.count() {
		again, err := p.Picker.Pick(info)
		if err != nil {
			break
		}
		asc := p.cc.tracked(again.SubConn)
		switch {
		case asc != nil && want(asc):
			if fallback != nil && fallback.Done != nil {
				fallback.Done(balancer.DoneInfo{Err: errSkipped})
			}
			if res.Done != nil {
				res.Done(balancer.DoneInfo{Err: errSkipped})
			}
			return again, asc, nil
		case asc != nil && fallback == nil && usable(asc) && !usable(sc):
			// Better than the first pick, if the wanted one is not
			// in this picker (round_robin has not seen it READY yet).
			fallback, fallbackSC = &again, asc
		default:
			if again.Done != nil {
				again.Done(balancer.DoneInfo{Err: errSkipped})
			}
		}
	}
	if fallback != nil {
		if res.Done != nil {
			res.Done(balancer.DoneInfo{Err: errSkipped})
		}
		return *fallback, fallbackSC, nil
	}
	return res, sc, nil
}

func (c *clientConn) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.subConns)
}

func (c *clientConn) all() []*subConn {
	c.mu.Lock()
	defer c.mu.Unlock()
	all := make([]*subConn, 0, len(c.subConns))
	for _, sc := range c.subConns {
		all = append(all, sc)
	}
	return all
}

// anyResponsive reports whether a subchannel to a member other than
// except ("": any) is READY and responsive.
func (c *clientConn) anyResponsive(except string) bool {
	for _, sc := range c.all() {
		if sc.addr != except && sc.readyAndResponsive() {
			return true
		}
	}
	return false
}

// leader returns the address of the member other than except whose
// subchannel is READY and responsive and whose latest status says it leads
// at the highest raft term among such claims, or "" if none does. The
// highest term wins so that proposals move to a newly elected leader at
// its first probe, while the old one, hung, still looks responsive.
func (c *clientConn) leader(except string) string {
	best, term := "", uint64(0)
	for _, sc := range c.all() {
		if sc.addr == except || !sc.readyAndResponsive() {
			continue
		}
		if st, ok := statusOf(sc.addr); ok && st.leader && (best == "" || st.term > term) {
			best, term = sc.addr, st.term
		}
	}
	return best
}

// moveOffUnresponsive ends the streams from Context on unresponsive
// subchannels if a responsive one is READY for them to move to. It runs
// whenever a subchannel becomes READY or changes responsiveness.
func (c *clientConn) moveOffUnresponsive() {
	if !c.anyResponsive("") {
		return
	}
	for _, sc := range c.all() {
		sc.endIfUnresponsive()
	}
}

// pick is one call picked on a subchannel with a context from Context.
type pick struct{ stream *stream }

// subConn is one subchannel's state and the calls with a context from
// Context picked on it while it was ready.
type subConn struct {
	addr string

	mu           sync.Mutex
	state        connectivity.State // guarded by mu
	unresponding bool               // guarded by mu; set by the probe while READY
	picks        map[*pick]struct{} // guarded by mu
}

// setState records s, and reports whether the subchannel became or stopped
// being READY.
func (sc *subConn) setState(s connectivity.State) bool {
	sc.mu.Lock()
	was := sc.state
	sc.state = s
	// Each READY period starts responsive: the member just completed the
	// HTTP/2 handshake.
	sc.unresponding = false
	var ended map[*pick]struct{}
	if was == connectivity.Ready && s != connectivity.Ready {
		ended, sc.picks = sc.picks, nil
	}
	sc.mu.Unlock()
	for pk := range ended {
		pk.stream.cancel(fmt.Errorf("%w: %s is %s", ErrDraining, sc.addr, s))
	}
	return (was == connectivity.Ready) != (s == connectivity.Ready)
}

// setResponsive records a probe's outcome, and reports whether it changed
// the subchannel's responsiveness.
func (sc *subConn) setResponsive(ok bool) bool {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.state != connectivity.Ready || sc.unresponding == !ok {
		return false
	}
	sc.unresponding = !ok
	return true
}

// memberStatus is what a member's latest answer to a probe said.
type memberStatus struct {
	leader  bool   // it is etcd's leader
	term    uint64 // its raft term
	release string // its release's major.minor ("3.7")
}

// statuses holds, per member address, its latest answer to a probe on any
// connection of the process, while some connection is READY to it (a
// member that comes back may run another release, or no longer lead). It
// is process-wide because etcd refuses Status on a connection without a
// user while auth is on (the forwarding one without --user): that
// connection's proposals go where the proxy's own connection's probes
// found the leader.
var statuses sync.Map // member address → memberStatus

func statusOf(addr string) (memberStatus, bool) {
	st, ok := statuses.Load(addr)
	if !ok {
		return memberStatus{}, false
	}
	return st.(memberStatus), true
}

// noteStatus records a member's answer.
func noteStatus(addr string, st memberStatus) {
	old, loaded := statuses.Swap(addr, st)
	if !loaded || old.(memberStatus).release != st.release {
		updateReleases()
	}
}

func (sc *subConn) isResponsive() bool {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	return !sc.unresponding
}

func (sc *subConn) readyAndResponsive() bool {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	return sc.state == connectivity.Ready && !sc.unresponding
}

func (sc *subConn) unresponsive() error {
	return fmt.Errorf("%w: %s did not answer within %v", ErrUnresponsive, sc.addr, ProbeTimeout)
}

// endIfUnresponsive ends the streams on sc if it is READY and unresponsive.
func (sc *subConn) endIfUnresponsive() {
	sc.mu.Lock()
	var ended map[*pick]struct{}
	if sc.state == connectivity.Ready && sc.unresponding {
		ended, sc.picks = sc.picks, nil
	}
	sc.mu.Unlock()
	for pk := range ended {
		pk.stream.cancel(sc.unresponsive())
	}
}

// add records pk, or ends its stream at once if the subchannel left READY
// since the pick.
func (sc *subConn) add(pk *pick) {
	sc.mu.Lock()
	if sc.state != connectivity.Ready {
		state := sc.state
		sc.mu.Unlock()
		pk.stream.cancel(fmt.Errorf("%w: %s is %s", ErrDraining, sc.addr, state))
		return
	}
	if sc.picks == nil {
		sc.picks = map[*pick]struct{}{}
	}
	sc.picks[pk] = struct{}{}
	sc.mu.Unlock()
}

// end forgets pk and ends its stream with cause.
func (sc *subConn) end(pk *pick, cause error) {
	sc.remove(pk)
	pk.stream.cancel(cause)
}

func (sc *subConn) remove(pk *pick) {
	sc.mu.Lock()
	delete(sc.picks, pk)
	sc.mu.Unlock()
}
