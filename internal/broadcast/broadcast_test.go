package broadcast

import (
	"sync"
	"testing"
)

// TestSignalWakesEveryWaiter: every channel taken before a Notify is closed
// by it, and one taken after waits for the next.
func TestSignalWakesEveryWaiter(t *testing.T) {
	var s Signal
	var wg sync.WaitGroup
	chans := make([]<-chan struct{}, 8)
	for i := range chans {
		chans[i] = s.Wait()
	}
	for _, ch := range chans {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-ch
		}()
	}
	s.Notify()
	wg.Wait()
	next := s.Wait()
	select {
	case <-next:
		t.Fatal("a channel taken after Notify is already closed")
	default:
	}
	s.Notify()
	<-next
}
