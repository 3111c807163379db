// Package drain ends the proxy's own long-lived upstream streams as soon as
// the connection they run on stops being ready, so that they resume on
// another connection at once.
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
// It is a balancer wrapped around grpc-go's round_robin (the policy
// clientv3 picks): it watches each subchannel's state and records, for each
// stream opened with a context from Context, the subchannel it was picked
// on.
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

// Context returns a context for one upstream stream (and its retries). Once
// the stream is picked on a connection of a connection dialed with
// DialOptions, that connection leaving READY cancels the context with a
// cause that wraps ErrDraining. Without such a connection it is a plain
// cancelable context. cancel releases it, as context.WithCancel's does.
func Context(parent context.Context) (ctx context.Context, cancel context.CancelFunc) {
	ctx, cancelCause := context.WithCancelCause(parent)
	s := &stream{cancel: cancelCause}
	return context.WithValue(ctx, streamKey{}, s), func() { cancelCause(context.Canceled) }
}

type streamKey struct{}

// stream is one stream opened with a context from Context.
type stream struct {
	cancel context.CancelCauseFunc
}

type builder struct{}

func (builder) Name() string { return Name }

func (builder) Build(cc balancer.ClientConn, opts balancer.BuildOptions) balancer.Balancer {
	w := &clientConn{ClientConn: cc, subConns: map[balancer.SubConn]*subConn{}}
	return balancer.Get(roundrobin.Name).Build(w, opts)
}

// clientConn is what round_robin (and its pick_first children) see of the
// connection: it tracks every subchannel they create and wraps every picker
// they publish.
type clientConn struct {
	balancer.ClientConn

	mu       sync.Mutex
	subConns map[balancer.SubConn]*subConn // guarded by mu; until shut down
}

func (c *clientConn) NewSubConn(addrs []resolver.Address, opts balancer.NewSubConnOptions) (balancer.SubConn, error) {
	sc := &subConn{state: connectivity.Idle}
	if len(addrs) > 0 {
		sc.addr = addrs[0].Addr
	}
	listener := opts.StateListener
	var created balancer.SubConn
	opts.StateListener = func(s balancer.SubConnState) {
		sc.setState(s.ConnectivityState)
		if s.ConnectivityState == connectivity.Shutdown {
			c.mu.Lock()
			delete(c.subConns, created)
			c.mu.Unlock()
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

// picker records the subchannel each stream from Context is picked on.
type picker struct {
	balancer.Picker
	cc *clientConn
}

func (p *picker) Pick(info balancer.PickInfo) (balancer.PickResult, error) {
	res, err := p.Picker.Pick(info)
	if err != nil {
		return res, err
	}
	st, ok := info.Ctx.Value(streamKey{}).(*stream)
	if !ok {
		return res, nil
	}
	sc := p.cc.tracked(res.SubConn)
	if sc == nil {
		return res, nil
	}
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
	return res, nil
}

// pick is one call picked on a subchannel with a context from Context.
type pick struct{ stream *stream }

// subConn is one subchannel's state and the calls with a context from
// Context picked on it while it was ready.
type subConn struct {
	addr string

	mu    sync.Mutex
	state connectivity.State // guarded by mu
	picks map[*pick]struct{} // guarded by mu
}

func (sc *subConn) setState(s connectivity.State) {
	sc.mu.Lock()
	was := sc.state
	sc.state = s
	var ended map[*pick]struct{}
	if was == connectivity.Ready && s != connectivity.Ready {
		ended, sc.picks = sc.picks, nil
	}
	sc.mu.Unlock()
	for pk := range ended {
		pk.stream.cancel(fmt.Errorf("%w: %s is %s", ErrDraining, sc.addr, s))
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

func (sc *subConn) remove(pk *pick) {
	sc.mu.Lock()
	delete(sc.picks, pk)
	sc.mu.Unlock()
}
