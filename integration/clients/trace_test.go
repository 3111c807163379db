package clients

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	clientv3 "go.etcd.io/etcd/client/v3"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport/otlpsink"
)

// TestTraceContextForwarded: a call carrying a W3C trace context, as
// kube-apiserver's etcd client sends it (traceparent), reaches etcd with it
// through the proxy as it does directly: etcd, tracing with every sampled
// parent followed (its sampling rate 0 is parent-based), records its span
// of the call in the caller's trace. With tracing off the proxy forwards
// the context untouched, and etcd's span is the child of the caller's;
// with tracing on, of the proxy's call, the child of the proxy's span of
// the caller's call. So too for a lease keepalive stream, and for a call
// to the proxy's JSON gateway with the trace context in HTTP headers
// (etcd's own gateway drops it).
func TestTraceContextForwarded(t *testing.T) {
	sink, etcd := startTracingEtcd(t)
	px := startProxy(t, "proxy", etcd.url)
	tracedPx := startProxy(t, "traced", etcd.url, "--enable-distributed-tracing", "--distributed-tracing-address="+sink.Addr())

	calls := []struct {
		span string // etcd's span of the call
		call func(ctx context.Context, cli *clientv3.Client) error
	}{
		{"etcdserverpb.KV/Put", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.Put(ctx, "traced", "v")
			return err
		}},
		{"etcdserverpb.KV/Txn", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.Version("traced"), ">", 0)).Then(clientv3.OpPut("traced", "w")).Commit()
			return err
		}},
		{"etcdserverpb.Lease/LeaseGrant", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.Grant(ctx, 60)
			return err
		}},
		{"etcdserverpb.Cluster/MemberList", func(ctx context.Context, cli *clientv3.Client) error {
			_, err := cli.MemberList(ctx)
			return err
		}},
		// A keepalive stream: the proxy relays one in a sampled trace
		// rather than coalescing it onto its shared upstream stream.
		{"etcdserverpb.Lease/LeaseKeepAlive", func(ctx context.Context, cli *clientv3.Client) error {
			lease, err := cli.Grant(ctx, 60)
			if err != nil {
				return err
			}
			_, err = cli.KeepAliveOnce(ctx, lease.ID)
			return err
		}},
	}
	type sent struct {
		side, span, traceID, parentID string
		viaProxySpans                 bool // the proxy traces: etcd's span hangs below its spans
	}
	var all []sent
	for _, side := range []struct{ name, addr string }{{"direct", etcd.addr}, {"proxy", px.addr}, {"traced proxy", tracedPx.addr}} {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{side.addr}, DialTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer cli.Close()
		for _, c := range calls {
			ctx, traceID, parentID := traced(t, true)
			s := sent{side.name, c.span, traceID, parentID, side.addr == tracedPx.addr}
			if err := c.call(ctx, cli); err != nil {
				t.Fatalf("%s: %s: %v", side.name, c.span, err)
			}
			all = append(all, s)
		}
	}
	for _, side := range []struct{ name, addr string }{{"proxy's gateway", px.addr}, {"traced proxy's gateway", tracedPx.addr}} {
		traceID, parentID := randomHex(t, 16), randomHex(t, 8)
		req, err := http.NewRequest(http.MethodPost, "http://"+side.addr+"/v3/kv/put", strings.NewReader(`{"key":"dHJhY2Vk","value":"Z3c="}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("traceparent", "00-"+traceID+"-"+parentID+"-01")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", side.name, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: put: %s %s", side.name, resp.Status, body)
		}
		all = append(all, sent{side.name, "etcdserverpb.KV/Put", traceID, parentID, side.addr == tracedPx.addr})
	}
	// etcd exports in batches, every 5 s.
	waitUntil(t, 30*time.Second, "etcd's span of each call in the caller's trace", func() (bool, error) {
		for _, s := range all {
			var names []string
			found := false
			spans := sink.Spans(s.traceID)
			byID := map[string]otlpsink.Span{}
			for _, sp := range spans {
				byID[sp.SpanID] = sp
			}
			for _, sp := range spans {
				if sp.Service == "etcd" && sp.Name == s.span {
					want := s.parentID
					if s.viaProxySpans {
						// etcd's span < the proxy's call < the proxy's span < the caller's.
						call := byID[sp.ParentID]
						served := byID[call.ParentID]
						if call.Service != "etcd-snapcache" || call.Kind != tracepb.Span_SPAN_KIND_CLIENT ||
							served.Service != "etcd-snapcache" || served.Kind != tracepb.Span_SPAN_KIND_SERVER {
							return false, fmt.Errorf("%s: etcd's %s span's parent %+v and its parent %+v: want the proxy's call and its span of the caller's call", s.side, s.span, call, served)
						}
						sp = served
					}
					if sp.ParentID != want {
						return false, fmt.Errorf("%s: the %s span has parent %q, want the caller's %q", s.side, s.span, sp.ParentID, want)
					}
					found = true
				}
				names = append(names, sp.Service+" "+sp.Name)
			}
			if !found {
				return false, fmt.Errorf("%s: no etcd %s span in the caller's trace; its spans: %v", s.side, s.span, names)
			}
		}
		return true, nil
	}, etcd.process)
}

// startTracingEtcd starts a test trace receiver and an etcd that traces
// into it (--enable-distributed-tracing, service "etcd", at sampling
// rate 0: it follows its callers' sampled trace contexts).
func startTracingEtcd(t *testing.T) (*otlpsink.Sink, *etcdProc) {
	sink := otlpsink.Start(t)
	etcd := startEtcd(t, "etcd",
		"--enable-distributed-tracing",
		"--distributed-tracing-address="+sink.Addr(),
		"--distributed-tracing-service-name=etcd")
	return sink, etcd
}

// traced returns the test's context with a traceparent of a new trace, as
// kube-apiserver's etcd client sends it, sampled or not, and the trace's
// id and the caller's span id in hex.
func traced(t *testing.T, sampled bool) (ctx context.Context, traceID, parentID string) {
	traceID, parentID = randomHex(t, 16), randomHex(t, 8)
	flags := "00"
	if sampled {
		flags = "01"
	}
	return metadata.AppendToOutgoingContext(t.Context(), "traceparent", fmt.Sprintf("00-%s-%s-%s", traceID, parentID, flags)), traceID, parentID
}

// randomHex returns n random bytes in hex: a trace id (16) or span id (8).
func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// TestTracingThroughTheProxy: with --enable-distributed-tracing (rate 0,
// parent-based), a caller's sampled trace goes through the proxy: the
// proxy's server span of a Put is the caller's span's child, its call to
// etcd the server span's child, and etcd's span that call's child. A
// linearizable read answered from the cache has the proxy's span and no
// etcd span (the proof that the cache is fresh is the proxy's own call,
// which begins no trace). A caller's unsampled trace records nothing.
func TestTracingThroughTheProxy(t *testing.T) {
	sink, etcd := startTracingEtcd(t)
	px := startProxy(t, "proxy", etcd.url,
		"--enable-distributed-tracing",
		"--distributed-tracing-address="+sink.Addr())
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{px.addr}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()

	// First, so that it is exported before the others if it is at all.
	ctx, unsampled, _ := traced(t, false)
	if _, err := cli.Put(ctx, "traced", "v0"); err != nil {
		t.Fatal(err)
	}
	ctx, putTrace, putParent := traced(t, true)
	if _, err := cli.Put(ctx, "traced", "v1"); err != nil {
		t.Fatal(err)
	}
	ctx, getTrace, getParent := traced(t, true)
	if resp, err := cli.Get(ctx, "traced"); err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v1" {
		t.Fatalf("linearizable Get through the proxy: %v, %v", resp, err)
	}

	// A watch through the proxy, created and canceled: the stream's span
	// ends with the stream, when the client closes.
	wcli, err := clientv3.New(clientv3.Config{Endpoints: []string{px.addr}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, watchTrace, _ := traced(t, true)
	wctx, cancelWatch := context.WithCancel(ctx)
	wch := wcli.Watch(wctx, "traced", clientv3.WithCreatedNotify())
	if resp := <-wch; !resp.Created {
		t.Fatalf("watch through the proxy: %+v", resp)
	}
	cancelWatch()
	wcli.Close()

	find := func(spans []otlpsink.Span, service, name string, kind tracepb.Span_SpanKind) (otlpsink.Span, bool) {
		for _, sp := range spans {
			if sp.Service == service && sp.Name == name && sp.Kind == kind {
				return sp, true
			}
		}
		return otlpsink.Span{}, false
	}
	const server, client = tracepb.Span_SPAN_KIND_SERVER, tracepb.Span_SPAN_KIND_CLIENT
	waitUntil(t, 30*time.Second, "the Put's and the Get's spans", func() (bool, error) {
		put := sink.Spans(putTrace)
		proxyServer, ok := find(put, "etcd-snapcache", "etcdserverpb.KV/Put", server)
		if !ok {
			return false, fmt.Errorf("no proxy server span in the Put's trace: %v", put)
		}
		if proxyServer.ParentID != putParent {
			return false, fmt.Errorf("the proxy's server span has parent %q, want the caller's %q", proxyServer.ParentID, putParent)
		}
		proxyClient, ok := find(put, "etcd-snapcache", "etcdserverpb.KV/Put", client)
		if !ok || proxyClient.ParentID != proxyServer.SpanID {
			return false, fmt.Errorf("the proxy's call to etcd: %+v (found %v), want the server span's child", proxyClient, ok)
		}
		etcdSpan, ok := find(put, "etcd", "etcdserverpb.KV/Put", server)
		if !ok || etcdSpan.ParentID != proxyClient.SpanID {
			return false, fmt.Errorf("etcd's span: %+v (found %v), want the proxy's call's child", etcdSpan, ok)
		}
		get := sink.Spans(getTrace)
		proxyGet, ok := find(get, "etcd-snapcache", "etcdserverpb.KV/Range", server)
		if !ok || proxyGet.ParentID != getParent {
			return false, fmt.Errorf("the proxy's span of the Get: %+v (found %v), want the caller's span's child", proxyGet, ok)
		}
		if src, why := proxyGet.Attrs["snapcache.source"].GetStringValue(), proxyGet.Attrs["snapcache.reason"].GetStringValue(); src != "cache" || why != "linearizable" {
			t.Fatalf("the Get's span says it was answered by %q (%q), want the cache (linearizable)", src, why)
		}
		watch, ok := find(sink.Spans(watchTrace), "etcd-snapcache", "etcdserverpb.Watch/Watch", server)
		if !ok {
			return false, fmt.Errorf("no span of the watch stream yet")
		}
		var events []string
		for _, ev := range watch.Events {
			events = append(events, ev.GetName())
		}
		if !slices.Contains(events, "watch created") {
			t.Fatalf("the watch stream's span has events %v, want a watch created", events)
		}
		return true, nil
	}, px.process, etcd.process)
	for _, sp := range sink.Spans(getTrace) {
		if sp.Service != "etcd-snapcache" || sp.Kind != server {
			t.Errorf("a read from the cache has a span %s %s (%v) beside the proxy's", sp.Service, sp.Name, sp.Kind)
		}
	}
	if spans := sink.Spans(unsampled); len(spans) > 0 {
		t.Errorf("a caller's unsampled trace recorded %d spans: %v", len(spans), spans)
	}
}
