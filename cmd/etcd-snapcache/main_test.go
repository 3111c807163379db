package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
	"go.uber.org/goleak"
)

// Every goroutine a test starts, an embedded etcd's and the proxy's
// included, must be gone when the tests end.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// run runs the CLI in-process and returns its output and error; exit codes
// are returned, not acted on.
func run(args ...string) (string, error) {
	var out bytes.Buffer
	app := newApp()
	app.Writer = &out
	app.ExitErrHandler = func(*cli.Context, error) {}
	err := app.Run(append([]string{"etcd-snapcache"}, args...))
	return out.String(), err
}

func TestVersion(t *testing.T) {
	out, err := run("version")
	if err != nil || !strings.Contains(out, "etcd-snapcache version:") || !strings.Contains(out, "etcd API version: 3.7") {
		t.Fatalf("version: %q, %v", out, err)
	}
}

func TestServeRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"serve", "--log-level", "loud"},
		{"serve", "--consistent-read-fallback", "maybe"},
	} {
		if _, err := run(args...); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}
