package progress

// Phase is where the follower is in its life, as kube-apiserver's cacher
// draws its ready state (storage/cacher/ready.go):
//
//	Loading ──► Serving ◄──► Reloading
//	   │           │             │
//	   └───────────┴─────────────┴──► Stopped
//
// Only Serving answers for etcd.
type Phase int

const (
	// PhaseLoading: the first load has not yet caught up with etcd.
	PhaseLoading Phase = iota
	// PhaseServing: the store answers for etcd.
	PhaseServing
	// PhaseReloading: the store is being loaded again, after a watch that
	// could not resume, an inconsistency, or another history.
	PhaseReloading
	// PhaseStopped: Run has returned.
	PhaseStopped
)

func (p Phase) String() string {
	switch p {
	case PhaseLoading:
		return "loading"
	case PhaseServing:
		return "serving"
	case PhaseReloading:
		return "reloading"
	case PhaseStopped:
		return "stopped"
	}
	return "unknown"
}

// Phase returns the follower's phase.
func (f *Follower) Phase() Phase {
	switch {
	case f.stopped.Load():
		return PhaseStopped
	case !f.IsReady():
		return PhaseLoading
	case f.loading.Load():
		return PhaseReloading
	}
	return PhaseServing
}
