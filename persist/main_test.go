package persist

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine a test starts (Run, the restore's decoders) must be gone
// when the tests end.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
