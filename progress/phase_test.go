package progress

import "testing"

var phases = []Phase{PhaseLoading, PhaseServing, PhaseReloading, PhaseStopped}

// lifecycleAt returns a lifecycle in p, reached by the diagram's edges.
func lifecycleAt(t *testing.T, p Phase) *lifecycle {
	t.Helper()
	l := newLifecycle()
	l.mu.Lock()
	defer l.mu.Unlock()
	path := map[Phase][]Phase{
		PhaseLoading:   nil,
		PhaseServing:   {PhaseServing},
		PhaseReloading: {PhaseServing, PhaseReloading},
		PhaseStopped:   {PhaseStopped},
	}[p]
	for _, to := range path {
		if !l.move(to) {
			t.Fatalf("the path to %v refused %v", p, to)
		}
	}
	return l
}

// TestPhaseMoves: move takes exactly the diagram's edges and refuses every
// other move, leaving the phase as it was.
func TestPhaseMoves(t *testing.T) {
	edges := map[[2]Phase]bool{
		{PhaseLoading, PhaseServing}:   true,
		{PhaseServing, PhaseReloading}: true,
		{PhaseReloading, PhaseServing}: true,
		{PhaseLoading, PhaseStopped}:   true,
		{PhaseServing, PhaseStopped}:   true,
		{PhaseReloading, PhaseStopped}: true,
	}
	for _, from := range phases {
		for _, to := range phases {
			l := lifecycleAt(t, from)
			l.mu.Lock()
			moved := l.move(to)
			l.mu.Unlock()
			want := edges[[2]Phase{from, to}]
			if moved != want {
				t.Errorf("%v → %v: moved %v, want %v", from, to, moved, want)
			}
			wantPhase := from
			if want {
				wantPhase = to
			}
			if got := l.load(); got != wantPhase {
				t.Errorf("%v → %v: phase %v, want %v", from, to, got, wantPhase)
			}
		}
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestLifecycle walks the follower's events through the phases: a load
// that replays history serves once the store catches up, a reload stops
// serving until its load ends, and Stopped is final. Ready closes on the
// first catch-up only.
func TestLifecycle(t *testing.T) {
	l := newLifecycle()
	expect := func(step string, p Phase, ready bool) {
		t.Helper()
		if got := l.load(); got != p {
			t.Errorf("%s: phase %v, want %v", step, got, p)
		}
		if got := isClosed(l.ready); got != ready {
			t.Errorf("%s: ready closed %v, want %v", step, got, ready)
		}
	}
	expect("new", PhaseLoading, false)
	l.reloading()
	expect("a reload before any load", PhaseLoading, false)
	if l.loaded(5, 10) {
		t.Error("a load below its target made the store ready")
	}
	expect("loaded at 5, to reach 10", PhaseLoading, false)
	if l.advanced(9) {
		t.Error("revision 9 made the store ready")
	}
	expect("advanced to 9", PhaseLoading, false)
	if !l.advanced(10) {
		t.Error("revision 10 did not make the store ready")
	}
	expect("advanced to 10", PhaseServing, true)
	if l.advanced(11) {
		t.Error("a serving store became ready again")
	}
	l.reloading()
	expect("reloading", PhaseReloading, true)
	l.reloading()
	expect("reloading again", PhaseReloading, true)
	if l.loaded(20, 20) {
		t.Error("a reload made the store ready again")
	}
	expect("reloaded", PhaseServing, true)
	l.stop()
	expect("stopped", PhaseStopped, true)
	l.reloading()
	l.loaded(30, 30)
	l.advanced(31)
	expect("events after the stop", PhaseStopped, true)
}

// TestLifecycleReloadWhileCatchingUp: a reload that begins before the first
// load caught up (another timeline found meanwhile) voids its target: the
// store it was for is dropped, and the next load decides.
func TestLifecycleReloadWhileCatchingUp(t *testing.T) {
	l := newLifecycle()
	l.loaded(5, 10)
	l.reloading()
	if l.advanced(10) || l.load() != PhaseLoading || isClosed(l.ready) {
		t.Fatalf("the store served the target of a load a reload voided: %v", l.load())
	}
	if !l.loaded(12, 12) || l.load() != PhaseServing {
		t.Fatalf("the reload's load did not serve: %v", l.load())
	}
}

// TestLifecycleStopBeforeReady: stopping before the first catch-up leaves
// Ready open.
func TestLifecycleStopBeforeReady(t *testing.T) {
	l := newLifecycle()
	l.loaded(5, 10)
	l.stop()
	if l.load() != PhaseStopped || isClosed(l.ready) {
		t.Fatalf("phase %v, ready closed %v; want stopped, open", l.load(), isClosed(l.ready))
	}
	if l.advanced(10) {
		t.Fatal("a stopped follower became ready")
	}
}
