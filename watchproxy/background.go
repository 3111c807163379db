package watchproxy

import "sync"

// background is one goroutine of the server's (the notifier's scans, the
// stream waker), started with the first stream, so that a server that
// never serves a watch runs none, and stopped by close, which waits for
// it.
type background struct {
	startOnce sync.Once
	stop      chan struct{} // closed by close: run returns

	mu   sync.Mutex
	done chan struct{} // closed when run returns; nil until started; guarded by mu
}

func newBackground() background { return background{stop: make(chan struct{})} }

// start runs setup, then run on a goroutine, the first time only, and
// never after close.
func (b *background) start(setup, run func()) {
	b.startOnce.Do(func() {
		setup()
		done := make(chan struct{})
		b.mu.Lock()
		b.done = done
		b.mu.Unlock()
		go func() {
			defer close(done)
			run()
		}()
	})
}

// close stops the goroutine and waits for it.
func (b *background) close() {
	b.startOnce.Do(func() {}) // never start after close
	close(b.stop)
	b.mu.Lock()
	done := b.done
	b.mu.Unlock()
	if done != nil {
		<-done
	}
}
