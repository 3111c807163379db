package kvproxy

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestForwardedReadsAreBounded: with every forwarding slot taken, a read
// waits for one up to its deadline, instead of adding to etcd's load, and
// then fails as etcd fails a request past its deadline (DeadlineExceeded);
// without a deadline it waits up to the queue bound, then fails with
// Unavailable. A freed slot is taken at once.
func TestForwardedReadsAreBounded(t *testing.T) {
	s := &Server{forwards: make(chan struct{}, 2), queueWait: 20 * time.Millisecond}
	release1, err := s.acquireForward(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	release2, err := s.acquireForward(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := s.acquireForward(ctx); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("third read with both slots taken past its deadline: %v, want DeadlineExceeded", err)
	}
	if _, err := s.acquireForward(context.Background()); !errors.Is(err, errOverload) {
		t.Fatalf("third read with both slots taken, no deadline: %v, want %v", err, errOverload)
	}
	got := make(chan error, 1)
	go func() {
		release, err := s.acquireForward(context.Background())
		if err == nil {
			release()
		}
		got <- err
	}()
	release1()
	if err := <-got; err != nil {
		t.Fatalf("read after a slot was freed: %v", err)
	}
	release2()
}

// TestIsSmall: what is delegated to etcd while the cache loads.
func TestIsSmall(t *testing.T) {
	for _, tc := range []struct {
		r    *pb.RangeRequest
		want bool
	}{
		{&pb.RangeRequest{Key: []byte("k")}, true},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Limit: 1}, true},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Limit: smallReadLimit}, true},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), CountOnly: true}, true},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Limit: smallReadLimit + 1}, false},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z")}, false},
		{&pb.RangeRequest{Key: []byte("a"), RangeEnd: []byte("z"), Limit: -1}, false},
	} {
		if got := isSmall(tc.r); got != tc.want {
			t.Errorf("isSmall(%v) = %v, want %v", tc.r, got, tc.want)
		}
	}
}

// TestReleaseRules: etcd 3.7 drops the lease from keys-only results and
// serves RangeStream, 3.6 does neither; an unknown release is known to be
// unknown, so that the reads that depend on it go to etcd.
func TestReleaseRules(t *testing.T) {
	for _, tc := range []struct {
		version                             string
		known, rangeStream, keysOnlyNoLease bool
	}{
		{"3.7.3", true, true, true},
		{"3.7.0", true, true, true},
		{"v3.7.1", true, true, true},
		{"3.8.0-alpha.0", true, true, true},
		{"3.6.16", true, false, false},
		{"3.5.21", true, false, false},
		{"", false, false, false},
		{"not-a-version", false, false, false},
	} {
		got := rulesFor(tc.version)
		if got.known != tc.known || got.rangeStream != tc.rangeStream || got.opts.KeysOnlyWithoutLease != tc.keysOnlyNoLease {
			t.Errorf("rulesFor(%q) = %+v, want known %v, rangeStream %v, KeysOnlyWithoutLease %v",
				tc.version, got, tc.known, tc.rangeStream, tc.keysOnlyNoLease)
		}
	}
	var c releaseCache
	if c.get("").known || !c.get("3.6.1").known || c.get("3.6.1").rangeStream || !c.get("3.7.3").rangeStream || c.get("").known {
		t.Error("releaseCache does not follow the version it is asked about")
	}
}
