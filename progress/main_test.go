package progress

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine a Follower or a head probe starts ends when its owner
// stops it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
