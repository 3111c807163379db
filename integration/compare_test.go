package integration

// Helpers shared by the differential suites: send one request to etcd and to
// the proxy, compare the whole answer, and read the proxy's metrics.

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// rpcTimeout bounds every single RPC of the differential suites.
const rpcTimeout = 10 * time.Second

// sameOutcome compares the answers of etcd (d) and the proxy (p) to req: on
// success the whole responses must be proto.Equal (header included); on
// failure the gRPC code and message must be identical. It returns "" when
// they agree, else a readable report of the request and both answers.
func sameOutcome(req proto.Message, dResp proto.Message, dErr error, pResp proto.Message, pErr error) string {
	switch {
	case dErr == nil && pErr == nil:
		if proto.Equal(dResp, pResp) {
			return ""
		}
	case dErr != nil && pErr != nil:
		ds, ps := status.Convert(dErr), status.Convert(pErr)
		if ds.Code() == ps.Code() && ds.Message() == ps.Message() {
			return ""
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "proxy and etcd disagree\nrequest (%T):\n  %s\n", req, fmtMsg(req))
	fmt.Fprintf(&b, "etcd:  %s\n", fmtOutcome(dResp, dErr))
	fmt.Fprintf(&b, "proxy: %s\n", fmtOutcome(pResp, pErr))
	return b.String()
}

func fmtOutcome(resp proto.Message, err error) string {
	if err != nil {
		s := status.Convert(err)
		return fmt.Sprintf("error code=%s message=%q", s.Code(), s.Message())
	}
	return fmtMsg(resp)
}

func fmtMsg(m proto.Message) string {
	if m == nil {
		return "<nil>"
	}
	s := prototext.MarshalOptions{Multiline: false}.Format(m)
	if len(s) > 4000 {
		s = s[:4000] + "…(truncated)"
	}
	return s
}

// compareRange sends req to etcd and to the proxy through the raw KV clients
// and reports any difference (see sameOutcome). It also returns etcd's answer.
func (c *cluster) compareRange(tb testing.TB, req *pb.RangeRequest) (string, *pb.RangeResponse, error) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	dResp, dErr := c.directKV.Range(ctx, req)
	pResp, pErr := c.proxyKV.Range(ctx, req)
	return sameOutcome(req, dResp, dErr, pResp, pErr), dResp, dErr
}

// mustSameRange fails the test when etcd and the proxy answer req differently.
func (c *cluster) mustSameRange(tb testing.TB, req *pb.RangeRequest) (*pb.RangeResponse, error) {
	tb.Helper()
	diff, resp, err := c.compareRange(tb, req)
	if diff != "" {
		tb.Fatal(diff)
	}
	return resp, err
}

// metricSum returns the sum of the counters or gauges called name in reg
// whose labels include every pair in labels (nil matches all).
func metricSum(tb testing.TB, g interface {
	Gather() ([]*dto.MetricFamily, error)
}, name string, labels map[string]string) float64 {
	tb.Helper()
	mfs, err := g.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue metrics
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// proxyMetric is metricSum over the current proxy's registry.
func (c *cluster) proxyMetric(tb testing.TB, name string, labels map[string]string) float64 {
	tb.Helper()
	return metricSum(tb, c.proxy.Registry(), name, labels)
}

// rangeSources returns the proxy's Range counters by source.
func (c *cluster) rangeSources(tb testing.TB) (cache, forwarded, rejected float64) {
	tb.Helper()
	const n = "etcd_snapcache_range_requests_total"
	return c.proxyMetric(tb, n, map[string]string{"source": "cache"}),
		c.proxyMetric(tb, n, map[string]string{"source": "forwarded"}),
		c.proxyMetric(tb, n, map[string]string{"source": "rejected"})
}

// rawConn dials addr with plain grpc-go and no client-side message limits, so
// that oversized requests reach the server and are judged there.
func rawConn(tb testing.TB, addr string) *grpc.ClientConn {
	tb.Helper()
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30), grpc.MaxCallRecvMsgSize(1<<30)))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	return conn
}
