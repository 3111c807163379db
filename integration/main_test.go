package integration

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine a test starts, its embedded etcd's and proxy's included,
// must be gone when the tests end.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
