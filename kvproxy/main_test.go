package kvproxy

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if addr := os.Getenv("SERVE_BENCH_ADDR"); addr != "" {
		// BenchmarkServeRange's client process: the test binary again.
		if err := serveBenchClient(addr); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}
