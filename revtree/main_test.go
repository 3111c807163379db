package revtree_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine a test starts must be gone when the tests end, etcd's
// mvcc store (the differential test's oracle) included.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
