package testsupport

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Every goroutine a helper starts must be gone when its test ends.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echoServer answers every line it reads with the same line, until the
// test ends.
func echoServer(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				io.Copy(c, c)
				c.Close()
			}()
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return lis.Addr().String()
}

// echo sends line on c and returns what comes back.
func echo(c net.Conn, line string) (string, error) {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintln(c, line); err != nil {
		return "", err
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSuffix(got, "\n"), err
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestRelayRefusesWhileCut: the relay relays; Cut closes the relayed
// connection and new ones are closed at once; after Restore it relays
// again.
func TestRelayRefusesWhileCut(t *testing.T) {
	r := NewRelay(t, echoServer(t))
	c := dial(t, r.Addr())
	if got, err := echo(c, "one"); err != nil || got != "one" {
		t.Fatalf("through the relay: %q, %v", got, err)
	}
	if n := r.Conns(); n != 1 {
		t.Fatalf("Conns = %d, want 1", n)
	}
	if n := r.Cut(); n != 1 {
		t.Fatalf("Cut closed %d connections, want 1", n)
	}
	if _, err := echo(c, "two"); err == nil {
		t.Fatal("a cut connection still echoes")
	}
	if _, err := echo(dial(t, r.Addr()), "three"); err == nil {
		t.Fatal("a connection made during the cut echoes")
	}
	if n := r.Restore(); n != 0 {
		t.Fatalf("Restore relayed %d held connections, want 0", n)
	}
	if got, err := echo(dial(t, r.Addr()), "four"); err != nil || got != "four" {
		t.Fatalf("after Restore: %q, %v", got, err)
	}
}

// TestRelayHoldsWhileCut: with HoldWhileCut a connection made during the
// cut is answered once the cut is restored.
func TestRelayHoldsWhileCut(t *testing.T) {
	r := NewRelay(t, echoServer(t), HoldWhileCut())
	r.Cut()
	c := dial(t, r.Addr())
	WaitFor(t, 10*time.Second, "the connection to be held", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.held) == 1
	})
	if n := r.Conns(); n != 0 {
		t.Fatalf("Conns = %d during the cut, want 0", n)
	}
	if n := r.Restore(); n != 1 {
		t.Fatalf("Restore relayed %d held connections, want 1", n)
	}
	if got, err := echo(c, "held"); err != nil || got != "held" {
		t.Fatalf("held connection after Restore: %q, %v", got, err)
	}
}

func TestFreePortsDiffer(t *testing.T) {
	ports := FreePorts(t, 5)
	seen := map[int]bool{}
	for _, p := range ports {
		if p == 0 || seen[p] {
			t.Fatalf("ports %v: zero or repeated", ports)
		}
		seen[p] = true
	}
	if _, _, err := net.SplitHostPort(FreeAddr(t)); err != nil {
		t.Fatal(err)
	}
}

// fatalTB records the first Fatalf and ends the goroutine, as testing.T's
// does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// poll runs Poll on its own goroutine and returns its failure, if any.
func poll(t *testing.T, timeout time.Duration, cond func() (bool, error)) string {
	tb := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Poll(tb, timeout, time.Millisecond, "the condition", cond)
	}()
	<-done
	return tb.msg
}

func TestPoll(t *testing.T) {
	calls := 0
	if msg := poll(t, 10*time.Second, func() (bool, error) { calls++; return calls == 3, nil }); msg != "" || calls != 3 {
		t.Fatalf("a condition true on its third check: %d checks, failure %q", calls, msg)
	}
	msg := poll(t, 20*time.Millisecond, func() (bool, error) { return false, errors.New("not yet") })
	if want := "waiting for the condition: not done after 20ms (last error: not yet)"; msg != want {
		t.Fatalf("a condition never true: %q, want %q", msg, want)
	}
}
