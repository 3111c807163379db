package robustness

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
)

// relay is a TCP relay on loopback between the proxy and etcd (adapted
// from the integration package's relay, which is in another module). Cut
// partitions the proxy from etcd the way a network failure does: every
// relayed connection is closed, and new connections are accepted but get
// no answer, as if their packets were dropped, until Restore connects
// them to etcd. The proxy's reconnection therefore completes as soon as
// the partition heals, instead of after gRPC's reconnect backoff.
type relay struct {
	tb     testing.TB
	lis    net.Listener
	target string

	mu     sync.Mutex
	cut    bool
	closed bool
	conns  map[net.Conn]struct{} // relayed, both sides
	held   []net.Conn            // accepted during a cut
	wg     sync.WaitGroup
}

func newRelay(tb testing.TB, target string) *relay {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	r := &relay{tb: tb, lis: lis, target: target, conns: map[net.Conn]struct{}{}}
	r.wg.Add(1)
	go r.accept()
	tb.Cleanup(r.close)
	return r
}

func (r *relay) addr() string { return r.lis.Addr().String() }

func (r *relay) accept() {
	defer r.wg.Done()
	for {
		down, err := r.lis.Accept()
		if err != nil {
			return
		}
		r.mu.Lock()
		switch {
		case r.closed:
			down.Close()
		case r.cut:
			r.held = append(r.held, down)
		default:
			r.connectLocked(down)
		}
		r.mu.Unlock()
	}
}

// connectLocked relays down to etcd.
func (r *relay) connectLocked(down net.Conn) {
	up, err := net.Dial("tcp", r.target)
	if err != nil {
		down.Close()
		return
	}
	r.conns[down], r.conns[up] = struct{}{}, struct{}{}
	r.wg.Add(2)
	go r.pipe(down, up)
	go r.pipe(up, down)
}

func (r *relay) pipe(dst, src net.Conn) {
	defer r.wg.Done()
	_, err := io.Copy(dst, src)
	if err != nil && !errors.Is(err, net.ErrClosed) {
		r.tb.Logf("relay: %v", err)
	}
	dst.Close()
	src.Close()
	r.mu.Lock()
	delete(r.conns, dst)
	delete(r.conns, src)
	r.mu.Unlock()
}

// Cut closes every relayed connection and holds new ones until Restore.
// It returns how many relayed connections it closed.
func (r *relay) Cut() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut = true
	n := len(r.conns) / 2
	for c := range r.conns {
		c.Close()
		delete(r.conns, c)
	}
	return n
}

// Conns returns how many connections the relay relays.
func (r *relay) Conns() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.conns) / 2
}

// Restore connects the held connections to etcd and relays new ones
// again. It returns how many connections were held.
func (r *relay) Restore() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut = false
	held := r.held
	r.held = nil
	for _, c := range held {
		r.connectLocked(c)
	}
	return len(held)
}

// close stops the relay and waits for its goroutines.
func (r *relay) close() {
	r.lis.Close()
	r.mu.Lock()
	r.closed = true
	for _, c := range r.held {
		c.Close()
	}
	r.held = nil
	r.mu.Unlock()
	r.Cut()
	r.wg.Wait()
}
