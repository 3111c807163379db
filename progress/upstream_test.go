package progress

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// fakeStatus answers Maintenance.Status with the version the test sets, or
// fails while it is empty, and counts the calls.
type fakeStatus struct {
	mu      sync.Mutex
	version string
	calls   int
	called  chan struct{} // receives after each call
}

func (f *fakeStatus) status(context.Context) (*pb.StatusResponse, error) {
	f.mu.Lock()
	v := f.version
	f.calls++
	f.mu.Unlock()
	defer func() { f.called <- struct{}{} }()
	if v == "" {
		return nil, errors.New("etcdserver: permission denied")
	}
	return &pb.StatusResponse{Header: &pb.ResponseHeader{ClusterId: 1, MemberId: 2, RaftTerm: 3, Revision: 9}, Version: v}, nil
}

func (f *fakeStatus) set(v string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.version = v
}

// TestVersionTrackerRetriesAndFollowsReconnects: a failed Status leaves the
// release unknown (never a guess) and is retried; a reconnect reads it
// again, so an upgrade under the proxy is noticed.
func TestVersionTrackerRetriesAndFollowsReconnects(t *testing.T) {
	st := &upstreamState{}
	fs := &fakeStatus{called: make(chan struct{}, 100)}
	v := &versionTracker{state: st, status: fs.status, mixed: noMixedReleases, lg: zaptest.NewLogger(t), recheck: make(chan struct{}, 1)}

	if v.refresh(context.Background()) != "" || st.getVersion() != "" {
		t.Fatalf("a failed Status left version %q, want unknown", st.getVersion())
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); v.run(ctx) }()
	defer func() { cancel(); <-done }()

	v.reconnected()
	<-fs.called // the recheck fails: unknown, retried after versionRetryMin
	fs.set("3.6.5")
	waitVersion(t, st, "3.6.5")

	fs.set("3.7.3") // upgraded under the proxy
	v.reconnected()
	waitVersion(t, st, "3.7.3")
	var h pb.ResponseHeader
	st.fill(&h)
	if h.ClusterId != 1 || h.MemberId != 2 || h.RaftTerm != 3 {
		t.Fatalf("header fields of Status not recorded: %+v", &h)
	}
}

func waitVersion(t *testing.T, st *upstreamState, want string) {
	t.Helper()
	testsupport.WaitFor(t, 10*time.Second, "version "+want, func() bool { return st.getVersion() == want })
}

// noMixedReleases is mixed for a tracker whose members always agree.
func noMixedReleases() (bool, <-chan struct{}) { return false, nil }

// fakeMembers stands for drain.MixedReleases: whether the members run
// different releases, set by the test, with a channel closed on a change.
type fakeMembers struct {
	mu      sync.Mutex
	mixed   bool
	changed chan struct{}
}

func (m *fakeMembers) get() (bool, <-chan struct{}) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mixed, m.changed
}

func (m *fakeMembers) set(mixed bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.mixed = mixed
	close(m.changed)
	m.changed = make(chan struct{})
}

// TestVersionTrackerUnknownWhileMembersDiffer: during a rolling upgrade the
// members run different releases and the release is unknown, whichever
// member answers Status; once they agree the release is read again with
// no reconnect, so the last member's upgrade is noticed.
func TestVersionTrackerUnknownWhileMembersDiffer(t *testing.T) {
	st := &upstreamState{}
	fs := &fakeStatus{called: make(chan struct{}, 100), version: "3.6.16"}
	members := &fakeMembers{changed: make(chan struct{})}
	v := &versionTracker{state: st, status: fs.status, mixed: members.get, lg: zaptest.NewLogger(t), recheck: make(chan struct{}, 1)}
	if v.refresh(context.Background()) != "3.6.16" || st.getVersion() != "3.6.16" {
		t.Fatalf("version %q, want 3.6.16", st.getVersion())
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); v.run(ctx) }()
	defer func() { cancel(); <-done }()

	v.reconnected() // the loop runs, and has taken the channel
	<-fs.called
	// A member comes back as 3.7; the member asked still runs 3.6.
	members.set(true)
	<-fs.called
	waitVersion(t, st, "")
	v.reconnected() // the watch moved: still unknown
	<-fs.called
	if got := st.getVersion(); got != "" {
		t.Fatalf("version %q while the members differ, want unknown", got)
	}
	// The last member is upgraded.
	fs.set("3.7.3")
	members.set(false)
	waitVersion(t, st, "3.7.3")
}
