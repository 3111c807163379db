package kvproxy

import (
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/metadata"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// laggingEtcd answers as a cluster whose member behind the proxy's
// connection lags: serializable reads at lagRev (or future-revision above
// it), linearizable ones at headRev.
func laggingEtcd(lagRev, headRev int64) func(r *pb.RangeRequest) (*pb.RangeResponse, error) {
	return func(r *pb.RangeRequest) (*pb.RangeResponse, error) {
		if !r.Serializable {
			return &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: headRev}}, nil
		}
		if r.Revision > lagRev {
			return nil, rpctypes.ErrGRPCFutureRev
		}
		return &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: lagRev}}, nil
	}
}

// TestForwardedSerializableNeverGoesBack: a serializable read forwarded to
// etcd that a lagging member answers below a revision the proxy has
// already served (etcd's highest reported revision) is asked again as a
// linearizable read, whose answer is not below it, as one etcd member
// never answers below what it answered before. Answers at or above it, and
// linearizable reads, are etcd's as they come.
func TestForwardedSerializableNeverGoesBack(t *testing.T) {
	token := metadata.NewIncomingContext(t.Context(), metadata.Pairs(rpctypes.TokenFieldNameGRPC, "token"))
	for _, tc := range []struct {
		name     string
		headSeen int64
		req      *pb.RangeRequest
		wantRev  int64
		retried  bool
	}{
		{"lagging answer below what was served", 1000, serializable("a", 0), 1005, true},
		{"lagging answer at a revision served", 1000, serializable("a", 900), 1005, true},
		{"future revision for a revision seen", 1000, serializable("a", 950), 1005, true},
		{"answer at what was served", 990, serializable("a", 0), 990, false},
		{"future revision for a revision not seen", 990, serializable("a", 995), 0, false},
		{"linearizable read", 1000, key("a"), 1005, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newRouteEnv(t)
			e.follower.headSeen = tc.headSeen
			e.upstream.answer = laggingEtcd(990, 1005)
			s := New(e.cfg)
			resp, err := s.Range(token, tc.req)
			switch {
			case tc.wantRev == 0:
				if !errors.Is(err, rpctypes.ErrGRPCFutureRev) {
					t.Fatalf("Range: %v, %v; want etcd's future revision", resp, err)
				}
			case err != nil || resp.Header.Revision != tc.wantRev:
				t.Fatalf("Range: %v, %v; want an answer at %d", resp, err, tc.wantRev)
			}
			want := 1
			if tc.retried {
				want = 2
			}
			if len(e.upstream.requests) != want {
				t.Fatalf("etcd asked %d times, want %d", len(e.upstream.requests), want)
			}
			if tc.retried && e.upstream.requests[1].Serializable {
				t.Fatal("asked again as a serializable read")
			}
			if got := metricValue(t, e.reg, "etcd_snapcache_range_went_back_total"); got != float64(want-1) {
				t.Fatalf("went_back = %v, want %d", got, want-1)
			}
		})
	}
}

// TestRelayedSerializableRangeStreamIsLinearizable: a serializable
// RangeStream that etcd answers is relayed as a linearizable one, since
// its revision comes with its last chunk, after the others were sent.
func TestRelayedSerializableRangeStreamIsLinearizable(t *testing.T) {
	e := newRouteEnv(t)
	e.follower.headSeen = 1000
	s := New(e.cfg)
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(rpctypes.TokenFieldNameGRPC, "token"))
	req := serializable("a", 0)
	if err := s.RangeStream(req, &fakeRangeStreamServer{ctx: ctx}); err != nil {
		t.Fatal(err)
	}
	if len(e.upstream.requests) != 1 || e.upstream.requests[0].Serializable {
		t.Fatalf("etcd was asked %v, want one linearizable RangeStream", e.upstream.requests)
	}
	if !req.Serializable {
		t.Fatal("the caller's request was changed")
	}
}

// metricValue reads an unlabelled counter or gauge from reg (0 if absent).
func metricValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name || len(mf.GetMetric()) == 0 {
			continue
		}
		m := mf.GetMetric()[0]
		if m.GetCounter() != nil {
			return m.GetCounter().GetValue()
		}
		return m.GetGauge().GetValue()
	}
	return 0
}

// TestHistoricalReadNeverBelowHeadSeen: a serializable read at a revision
// carries the store's revision in its header, so it too waits until the
// store is no lower than any revision etcd has reported to the proxy, or
// goes to etcd: an etcd member's answers never go back in time, at a
// revision or at the head.
func TestHistoricalReadNeverBelowHeadSeen(t *testing.T) {
	e := newRouteEnv(t)
	e.follower.headSeen = 14 // acknowledged, not yet applied
	s := New(e.cfg)
	rt := s.route(t.Context(), serializable("a", 11), rulesFor("3.7.3"))
	if rt.action != forward || rt.reason != reasonAhead {
		t.Fatalf("store at 13, etcd reported 14, read at 11: %v %s, want forwarded (ahead)", rt.action, rt.reason)
	}
	applyPut(t, e.store, 14, "a", 5)
	rt = s.route(t.Context(), serializable("a", 11), rulesFor("3.7.3"))
	if rt.action != serveFromCache || rt.reason != reasonHistorical || rt.view.Rev != 11 || rt.view.StoreRev != 14 {
		t.Fatalf("store at 14: %v %s at %d/%d, want served at 11 with header 14", rt.action, rt.reason, rt.view.Rev, rt.view.StoreRev)
	}
}
