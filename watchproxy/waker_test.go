package watchproxy

import (
	"testing"
	"time"
)

// TestStreamWakerTicksOnlyProgressStreams: the periodic tick marks the
// progress due on, and wakes, only the streams with a progress_notify
// watcher; a failed check or a new epoch wakes every stream.
func TestStreamWakerTicksOnlyProgressStreams(t *testing.T) {
	newIdle := func(progressWatchers int32) *stream {
		st := &stream{wake: make(chan struct{}, 1)}
		st.progressWatchers.Store(progressWatchers)
		return st
	}
	w := newStreamWaker(nil, neverInconsistent{}, func() time.Duration { return time.Hour }, false)
	notifying, quiet := newIdle(2), newIdle(0)
	w.join(notifying)
	w.join(quiet)
	woken := func(st *stream) bool {
		select {
		case <-st.wake:
			return true
		default:
			return false
		}
	}

	w.tick()
	if !woken(notifying) || !notifying.progressDue.Load() {
		t.Fatal("a stream with progress_notify watchers was not ticked")
	}
	if woken(quiet) || quiet.progressDue.Load() {
		t.Fatal("a stream without progress_notify watchers was woken by the tick")
	}

	w.wakeAll()
	if !woken(notifying) || !woken(quiet) {
		t.Fatal("wakeAll did not wake every stream")
	}
	w.leave(quiet)
	w.wakeAll()
	if woken(quiet) {
		t.Fatal("a stream that left was woken")
	}
}
