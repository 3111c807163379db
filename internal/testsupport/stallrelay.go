package testsupport

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
)

// StallRelay is a TCP relay on loopback to a target address whose traffic a
// test can hold up without breaking any connection, the way a congested
// link delays it: while stalled, no byte is relayed in either direction;
// Flow relays what waited, in order. A stream through it (a watch, say)
// stays open and falls behind, instead of breaking and being resumed as
// through a cut Relay.
//
// The relay stops, and waits for every goroutine it started, when the test
// ends.
type StallRelay struct {
	tb     testing.TB
	lis    net.Listener
	target string

	// gate is held for reading by a pipe while it writes, and for writing
	// by Stall until Flow: once Stall returns, nothing is written.
	gate sync.RWMutex
	// stallMu serialises Stall and Flow; it is taken before gate.
	stallMu sync.Mutex
	stalled bool // guarded by stallMu: gate is held for writing

	mu sync.Mutex
	// Guarded by mu.
	closed bool
	conns  map[net.Conn]struct{} // relayed, both sides

	wg sync.WaitGroup
}

// NewStallRelay starts a relay on a free loopback port to target.
func NewStallRelay(tb testing.TB, target string) *StallRelay {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	r := &StallRelay{tb: tb, lis: lis, target: target, conns: map[net.Conn]struct{}{}}
	r.wg.Add(1)
	go r.accept()
	tb.Cleanup(r.close)
	return r
}

// Addr is the relay's host:port.
func (r *StallRelay) Addr() string { return r.lis.Addr().String() }

func (r *StallRelay) accept() {
	defer r.wg.Done()
	for {
		down, err := r.lis.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", r.target)
		r.mu.Lock()
		if err != nil || r.closed {
			down.Close()
			if up != nil {
				up.Close()
			}
			r.mu.Unlock()
			continue
		}
		r.conns[down], r.conns[up] = struct{}{}, struct{}{}
		r.wg.Add(2)
		go r.pipe(down, up)
		go r.pipe(up, down)
		r.mu.Unlock()
	}
}

func (r *StallRelay) pipe(dst, src net.Conn) {
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
				r.tb.Logf("stall relay: %v", err)
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

// Stall holds every byte up until Flow. It returns once nothing more is
// written on any relayed connection.
func (r *StallRelay) Stall() {
	r.stallMu.Lock()
	defer r.stallMu.Unlock()
	if !r.stalled {
		r.gate.Lock()
		r.stalled = true
	}
}

// Flow relays again, starting with what waited.
func (r *StallRelay) Flow() {
	r.stallMu.Lock()
	defer r.stallMu.Unlock()
	if r.stalled {
		r.stalled = false
		r.gate.Unlock()
	}
}

// close stops the relay and waits for its goroutines.
func (r *StallRelay) close() {
	r.lis.Close()
	r.mu.Lock()
	r.closed = true
	for c := range r.conns {
		c.Close() // a write blocked while holding the gate fails
	}
	r.mu.Unlock()
	r.Flow()
	r.wg.Wait()
}
