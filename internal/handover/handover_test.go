package handover

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// modeEnv tells the test binary, started again by Start, what to be.
const modeEnv = "HANDOVER_TEST_CHILD"

// TestMain runs the test binary as the new process when Start started it:
// "ready" serves one line on the inherited listener after saying it is
// ready; "fail" exits before it is ready; "silent" never says it is.
func TestMain(m *testing.M) {
	if mode, ok := os.LookupEnv(modeEnv); ok {
		os.Exit(child(mode))
	}
	goleak.VerifyTestMain(m)
}

func child(mode string) int {
	in, err := Inherited()
	if err != nil || in == nil {
		fmt.Fprintln(os.Stderr, "no handover:", err)
		return 2
	}
	switch mode {
	case "fail":
		return 1
	case "silent":
		// Until killed: the parent's wait for readiness is the test.
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM)
		<-stop
		return 0
	}
	l, err := in.Listener("client")
	if err != nil || l == nil {
		fmt.Fprintln(os.Stderr, "no listener:", err)
		return 2
	}
	if err := in.Ready(); err != nil {
		return 2
	}
	c, err := l.Accept()
	if err != nil {
		return 2
	}
	defer c.Close()
	fmt.Fprintf(c, "served by %d\n", os.Getpid())
	return 0
}

// listen returns a loopback listener and a copy of its socket to hand over.
func listen(t *testing.T) (net.Listener, *os.File) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	f, err := ListenerFile(l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return l, f
}

// TestHandOverListener: the new process inherits the listening socket and
// serves a connection made to the old one's address once it is ready,
// while the old one has stopped accepting.
func TestHandOverListener(t *testing.T) {
	l, f := listen(t)
	c, err := Start(map[string]*os.File{"client": f}, modeEnv+"=ready")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	// The old process stops accepting: only the new one does.
	l.Close()
	conn, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("served by %d\n", c.Pid()); line != want {
		t.Fatalf("got %q, want %q", line, want)
	}
	<-c.Exited()
	if c.Err() != nil {
		t.Fatalf("the new process: %v", c.Err())
	}
}

// TestHandOverFails: a new process that exits, or is not ready in time,
// is reported, and the old one's listener still accepts.
func TestHandOverFails(t *testing.T) {
	for _, mode := range []string{"fail", "silent"} {
		t.Run(mode, func(t *testing.T) {
			l, f := listen(t)
			c, err := Start(map[string]*os.File{"client": f}, modeEnv+"="+mode)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			err = c.WaitReady(ctx)
			if err == nil {
				t.Fatal("a new process that never became ready was taken as ready")
			}
			if !strings.Contains(err.Error(), "before it was ready") && !strings.Contains(err.Error(), "not ready in time") {
				t.Fatalf("unexpected error: %v", err)
			}
			select {
			case <-c.Exited():
			default:
				t.Fatal("the failed new process still runs")
			}
			accepted := make(chan error, 1)
			go func() {
				conn, err := l.Accept()
				if err == nil {
					conn.Close()
				}
				accepted <- err
			}()
			conn, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			conn.Close()
			if err := <-accepted; err != nil {
				t.Fatalf("the old process's listener after a failed handover: %v", err)
			}
		})
	}
}

// TestNotInherited: a process started otherwise has no handover.
func TestNotInherited(t *testing.T) {
	in, err := Inherited()
	if in != nil || err != nil {
		t.Fatalf("Inherited() = %v, %v in a process no handover started", in, err)
	}
}
