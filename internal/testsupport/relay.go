package testsupport

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
)

// Relay is a TCP relay on loopback to a target address whose connections a
// test can cut, to break a connection the way a network failure does: Cut
// closes every relayed connection, and until Restore the relay either
// refuses new connections (it accepts and closes them at once: the dial
// fails fast, as against a closed port) or, with HoldWhileCut, holds them
// unanswered, as if their packets were dropped, and Restore then relays
// them, so that the client's reconnection completes as soon as the
// partition heals instead of after its reconnect backoff.
//
// A test can also hold traffic up without breaking any connection, the way
// a congested link delays it: after Stall no byte is relayed in either
// direction, and Flow relays what waited, in order. A stream through it (a
// watch, say) stays open and falls behind, instead of breaking and being
// resumed as through a cut.
//
// The relay stops, and waits for every goroutine it started, when the test
// ends.
type Relay struct {
	tb     testing.TB
	lis    net.Listener
	target string
	hold   bool // set before the accept goroutine starts

	mu     sync.Mutex
	cut    bool
	closed bool
	conns  map[net.Conn]struct{} // relayed, both sides
	held   []net.Conn            // accepted during a cut, with hold
	wg     sync.WaitGroup

	// gate is held for reading by a pipe while it writes, and for writing
	// from Stall until Flow: once Stall returns, nothing is written.
	gate sync.RWMutex
	// stallMu serialises Stall and Flow; it is taken before gate.
	stallMu sync.Mutex
	stalled bool // guarded by stallMu: gate is held for writing
}

// A RelayOption configures NewRelay.
type RelayOption func(*Relay)

// HoldWhileCut makes a cut relay hold new connections until Restore
// instead of refusing them.
func HoldWhileCut() RelayOption { return func(r *Relay) { r.hold = true } }

// NewRelay starts a relay on a free loopback port to target.
func NewRelay(tb testing.TB, target string, opts ...RelayOption) *Relay {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	r := &Relay{tb: tb, lis: lis, target: target, conns: map[net.Conn]struct{}{}}
	for _, o := range opts {
		o(r)
	}
	r.wg.Add(1)
	go r.accept()
	tb.Cleanup(r.close)
	return r
}

// Addr is the relay's host:port.
func (r *Relay) Addr() string { return r.lis.Addr().String() }

func (r *Relay) accept() {
	defer r.wg.Done()
	for {
		down, err := r.lis.Accept()
		if err != nil {
			return
		}
		r.mu.Lock()
		switch {
		case r.closed, r.cut && !r.hold:
			down.Close()
		case r.cut:
			r.held = append(r.held, down)
		default:
			r.connectLocked(down)
		}
		r.mu.Unlock()
	}
}

// connectLocked relays down to the target.
func (r *Relay) connectLocked(down net.Conn) {
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

func (r *Relay) pipe(dst, src net.Conn) {
	defer r.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			r.gate.RLock()
			_, werr := dst.Write(buf[:n])
			r.gate.RUnlock()
			if werr != nil {
				err = werr
			}
		}
		if err != nil {
			if !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.EOF) {
				r.tb.Logf("relay: %v", err)
			}
			break
		}
	}
	dst.Close()
	src.Close()
	r.mu.Lock()
	delete(r.conns, dst)
	delete(r.conns, src)
	r.mu.Unlock()
}

// Cut closes every relayed connection and refuses or holds new ones until
// Restore. It returns how many relayed connections it closed.
func (r *Relay) Cut() int {
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

// Stall holds every byte up until Flow. It returns once nothing more is
// written on any relayed connection.
func (r *Relay) Stall() {
	r.stallMu.Lock()
	defer r.stallMu.Unlock()
	if !r.stalled {
		r.gate.Lock()
		r.stalled = true
	}
}

// Flow relays again, starting with what waited.
func (r *Relay) Flow() {
	r.stallMu.Lock()
	defer r.stallMu.Unlock()
	if r.stalled {
		r.stalled = false
		r.gate.Unlock()
	}
}

// Conns returns how many connections the relay relays.
func (r *Relay) Conns() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.conns) / 2
}

// Restore relays the held connections to the target, and new ones again.
// It returns how many connections were held.
func (r *Relay) Restore() int {
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
func (r *Relay) close() {
	r.lis.Close()
	r.mu.Lock()
	r.closed = true
	for _, c := range r.held {
		c.Close()
	}
	r.held = nil
	r.mu.Unlock()
	r.Cut() // a write blocked on a stalled gate fails
	r.Flow()
	r.wg.Wait()
}
