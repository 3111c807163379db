package testsupport

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// TestRelayStallHoldsBytesUntilFlow: the relay relays; while stalled, a
// line sent does not come back, and the connection stays open; after Flow
// it comes back, and the relay relays on.
func TestRelayStallHoldsBytesUntilFlow(t *testing.T) {
	r := NewRelay(t, echoServer(t))
	c := dial(t, r.Addr())
	rd := bufio.NewReader(c)
	line := func() (string, error) {
		got, err := rd.ReadString('\n')
		return strings.TrimSuffix(got, "\n"), err
	}
	fmt.Fprintln(c, "one")
	if got, err := line(); err != nil || got != "one" {
		t.Fatalf("through the relay: %q, %v", got, err)
	}

	r.Stall()
	fmt.Fprintln(c, "two")
	// Only an absence can be checked here: nothing within a while.
	c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if got, err := line(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("while stalled: %q, %v, want nothing", got, err)
	}
	c.SetReadDeadline(time.Time{})
	r.Flow()
	if got, err := line(); err != nil || got != "two" {
		t.Fatalf("after Flow: %q, %v", got, err)
	}
	fmt.Fprintln(c, "three")
	if got, err := line(); err != nil || got != "three" {
		t.Fatalf("after Flow: %q, %v", got, err)
	}
}
