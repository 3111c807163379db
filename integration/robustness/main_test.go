package robustness

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine a run starts, its embedded etcd's, proxy's and traffic
// clients' included, must be gone when the tests end.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
