package clients

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport/otlpsink"
)

// TestKubeAPIServerTraceThroughTheProxy: an unmodified kube-apiserver
// (watch cache on, as released), tracing every request into the test's
// receiver, with the proxy (--enable-distributed-tracing, rate 0,
// parent-based) as its etcd, and etcd tracing too: one trace follows a
// kube request from kube-apiserver through the proxy to etcd.
//
// Requests are sent as the admin (system:masters), whose W3C trace context
// kube-apiserver continues rather than starting a new root, each with a
// traceparent of a new sampled trace: a GET of a ConfigMap (a linearizable
// Range), a consistent LIST of its namespace (its etcd call, the current
// revision, is a linearizable Range too), and a PUT of it (a Txn). In each
// request's trace:
//
//   - kube-apiserver's span of its etcd call (otelgrpc's CLIENT span) is
//     the parent of the proxy's SERVER span of the same call;
//   - what the proxy forwards (the PUT's Txn) goes on: the proxy's CLIENT
//     span of its call to etcd is its server span's child, and etcd's
//     server span that call's child;
//   - a read the proxy answers from its cache (snapcache.source "cache")
//     has no span of etcd, says why (snapcache.reason) and how long the
//     proof that the cache was fresh took (snapcache.freshness_wait,
//     seconds); its span links to that proof: a span
//     "snapcache.freshness_proof" of the proxy, INTERNAL, in a trace of its
//     own, whose child is the proxy's Range to etcd, whose child is etcd's
//     span of it.
func TestKubeAPIServerTraceThroughTheProxy(t *testing.T) {
	bins := kubeBins{kube: kubeAPIServerBin(t), etcd: etcdBin(t), ctl: etcdctlBin(t), px: snapcacheBin(t)}
	// etcd, the proxy and kube-apiserver export their spans in batches
	// every 5 s by default (the OTel SDK's batch span processor); every
	// 100 ms here. The processes inherit the test's environment.
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "100")

	sink, etcd := startTracingEtcd(t)
	px := startProxy(t, "proxy", etcd.url,
		"--enable-distributed-tracing",
		"--distributed-tracing-address="+sink.Addr())
	tracingConfig := filepath.Join(t.TempDir(), "tracing.yaml")
	writeFile(t, tracingConfig, fmt.Sprintf(`apiVersion: apiserver.config.k8s.io/v1
kind: TracingConfiguration
endpoint: %s
samplingRatePerMillion: 1000000
`, sink.Addr()))
	k := startKube(t, bins, kubeStorage{
		etcd: etcd, proxy: px,
		kubeArgs: []string{"--etcd-servers=" + px.url, "--tracing-config-file=" + tracingConfig},
		etcdCtl:  []string{"--endpoints=" + etcd.addr},
		proxyCtl: []string{"--endpoints=" + px.addr},
	}, true)

	k.do("POST", "/api/v1/namespaces", map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": k.ns}}, http.StatusCreated, nil)
	const name = "traced"
	var created configMap
	k.do("POST", k.cmPath(""), configMap{APIVersion: "v1", Kind: "ConfigMap", Metadata: objectMeta{Name: name}, Data: map[string]string{"v": "w1"}}, http.StatusCreated, &created)

	const rangeRPC, txnRPC = "etcdserverpb.KV/Range", "etcdserverpb.KV/Txn"
	calls := make([]*kubeTracedCall, 0, 3)

	// (1) GET of the ConfigMap: no resourceVersion, so from etcd (the
	// proxy) rather than kube-apiserver's watch cache.
	var got configMap
	get := k.tracedDo("GET", "GET "+name, rangeRPC, k.cmPath(name), nil, http.StatusOK, &got)
	if got.Metadata.ResourceVersion != created.Metadata.ResourceVersion || got.Data["v"] != "w1" {
		t.Fatalf("GET %s right after its create (rv %s): rv %s, v %q", name, created.Metadata.ResourceVersion, got.Metadata.ResourceVersion, got.Data["v"])
	}
	calls = append(calls, get)

	// (2) A consistent LIST (no resourceVersion): from the watch cache,
	// once it has the current revision, which kube-apiserver reads from
	// etcd (the proxy).
	var l configMapList
	calls = append(calls, k.tracedDo("GET", "consistent LIST", rangeRPC, k.cmPath(""), nil, http.StatusOK, &l))
	if !slices.ContainsFunc(l.Items, func(cm configMap) bool { return cm.Metadata.Name == name }) || rvOf(t, l.Metadata.ResourceVersion) < rvOf(t, created.Metadata.ResourceVersion) {
		t.Fatalf("consistent LIST after creating %s at %s: at %s, %d items %v", name, created.Metadata.ResourceVersion, l.Metadata.ResourceVersion, len(l.Items), l.Items)
	}

	// (3) A PUT of it, at its resourceVersion: a Txn, forwarded to etcd.
	got.Data = map[string]string{"v": "w2"}
	var updated configMap
	calls = append(calls, k.tracedDo("PUT", "PUT "+name, txnRPC, k.cmPath(name), got, http.StatusOK, &updated))
	if updated.Data["v"] != "w2" || rvOf(t, updated.Metadata.ResourceVersion) <= rvOf(t, got.Metadata.ResourceVersion) {
		t.Fatalf("PUT %s: rv %s, v %q after rv %s", name, updated.Metadata.ResourceVersion, updated.Data["v"], got.Metadata.ResourceVersion)
	}

	// Every span of each request's trace, from kube-apiserver to etcd.
	waitUntil(t, 60*time.Second, "each request's spans from kube-apiserver through the proxy to etcd", func() (bool, error) {
		for _, c := range calls {
			if err := c.resolve(sink); err != nil {
				return false, err
			}
		}
		return true, nil
	}, k.kube, px.process, etcd.process)

	// The PUT was forwarded; the reads were answered from the cache.
	for _, c := range calls {
		for i, h := range c.hops {
			src := h.proxyServer.Attrs["snapcache.source"].GetStringValue()
			t.Logf("%s: kube-apiserver's %s (span %s) -> the proxy's (span %s, source %q, reason %q)%s", c.what, c.rpc, h.apiserver.SpanID, h.proxyServer.SpanID,
				src, h.proxyServer.Attrs["snapcache.reason"].GetStringValue(), h.forwardedString())
			switch {
			case c.rpc == txnRPC && h.proxyClient == nil:
				t.Errorf("%s: the proxy's span %d of the Txn has no call to etcd", c.what, i)
			case c.rpc == rangeRPC && src != "cache":
				t.Errorf("%s: the proxy answered the Range from %q, want its cache", c.what, src)
			}
		}
	}

	// A read from the cache: no span of etcd for it (etcd's spans of the
	// reads, had there been any, were exported before the PUT's, which are
	// in), and the proxy's span says why and how long its proof took.
	for _, c := range calls {
		for _, h := range c.cached() {
			for _, sp := range c.spans {
				if sp.Service == "etcd" && sp.Name == c.rpc {
					t.Errorf("%s: a read the proxy answered from its cache has etcd's span %s %s (parent %s) in its trace", c.what, sp.Name, sp.Kind, sp.ParentID)
				}
			}
			if why := h.proxyServer.Attrs["snapcache.reason"].GetStringValue(); why == "" {
				t.Errorf("%s: the proxy's span of a read from its cache has no snapcache.reason: %v", c.what, attrNames(h.proxyServer))
			}
			wait, ok := h.proxyServer.Attrs["snapcache.freshness_wait"].GetValue().(*commonpb.AnyValue_DoubleValue)
			if !ok || wait.DoubleValue < 0 || wait.DoubleValue > 60 {
				t.Errorf("%s: the proxy's span of a read from its cache has snapcache.freshness_wait %v, want a double, in seconds (attributes %v)", c.what, h.proxyServer.Attrs["snapcache.freshness_wait"], attrNames(h.proxyServer))
			} else {
				t.Logf("%s: freshness_wait %.6fs", c.what, wait.DoubleValue)
			}
		}
	}

	// Its link to the proof that the cache was fresh, and the proof's own
	// trace: its quorum read, and etcd's span of it.
	type linked struct {
		c *kubeTracedCall
		h kubeTraceHop
	}
	var withLinks []linked
	for _, c := range calls {
		for _, h := range c.cached() {
			if len(h.proxyServer.Links) == 0 {
				t.Errorf("%s: the proxy's span of a read from its cache has no link (to a %s span)", c.what, kubeTraceProofSpan)
				continue
			}
			withLinks = append(withLinks, linked{c, h})
		}
	}
	if len(withLinks) > 0 {
		waitUntil(t, 30*time.Second, "the freshness proofs the cached reads' spans link to, with their quorum reads", func() (bool, error) {
			for _, l := range withLinks {
				l.c.proofs = nil
			}
			for _, l := range withLinks {
				if err := l.c.checkProof(sink, l.h); err != nil {
					return false, err
				}
			}
			return true, nil
		}, px.process, etcd.process)
		for _, c := range calls {
			if len(c.proofs) > 0 {
				t.Logf("%s: %s", c.what, strings.Join(c.proofs, "; "))
			}
		}
	}

	k.readyz.stopAndCheck(t)
}

// kubeTraceProofSpan names the proxy's span of a freshness proof.
const kubeTraceProofSpan = "snapcache.freshness_proof"

// kubeTracedCall is one request sent to kube-apiserver in a trace of its
// own, and what of that trace the test found.
type kubeTracedCall struct {
	what              string
	rpc               string // kube-apiserver's etcd call the test follows
	traceID, parentID string // the trace, and the test's span (hex)

	spans  []otlpsink.Span // the trace's spans, when resolve last succeeded
	hops   []kubeTraceHop  // one for each kube-apiserver call of rpc
	proofs []string        // the proofs checkProof found, described
}

// kubeTraceHop is one of kube-apiserver's etcd calls: its span, the
// proxy's server span of it, and, if the proxy forwarded it, the proxy's
// call to etcd and etcd's span of that.
type kubeTraceHop struct {
	apiserver, proxyServer otlpsink.Span
	proxyClient, etcd      *otlpsink.Span // nil when answered from the cache
}

func (h kubeTraceHop) forwardedString() string {
	if h.proxyClient == nil {
		return ""
	}
	return fmt.Sprintf(" -> the proxy's call to etcd (span %s) -> etcd's (span %s)", h.proxyClient.SpanID, h.etcd.SpanID)
}

// cached returns the hops the proxy answered from its cache.
func (c *kubeTracedCall) cached() []kubeTraceHop {
	var out []kubeTraceHop
	for _, h := range c.hops {
		if h.proxyServer.Attrs["snapcache.source"].GetStringValue() == "cache" {
			out = append(out, h)
		}
	}
	return out
}

// tracedDo sends one request to kube-apiserver, as the admin
// (system:masters: kube-apiserver continues its trace context), with a
// traceparent of a new sampled trace, failing the test on a transport error
// or an unexpected status. body, if not nil, is sent as JSON; the response
// is decoded into into, if not nil.
func (k *kubeEnv) tracedDo(method, what, rpc, path string, body any, want int, into any) *kubeTracedCall {
	t := k.t
	t.Helper()
	c := &kubeTracedCall{what: what, rpc: rpc, traceID: randomHex(t, 16), parentID: randomHex(t, 8)}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, k.base+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+k.token)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("traceparent", fmt.Sprintf("00-%s-%s-01", c.traceID, c.parentID))
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := k.hc.Do(req)
	if err != nil {
		t.Fatalf("%s: %s %s: %v", what, method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s: %s %s: %v", what, method, path, err)
	}
	if resp.StatusCode != want {
		t.Fatalf("%s: %s %s: status %d, want %d: %s", what, method, path, resp.StatusCode, want, b)
	}
	if into != nil {
		if err := json.Unmarshal(b, into); err != nil {
			t.Fatalf("%s: %s %s: decoding %s: %v", what, method, path, b, err)
		}
	}
	t.Logf("%s: %s %s in trace %s", what, method, path, c.traceID)
	return c
}

// resolve finds the call's spans in the sink: kube-apiserver's HTTP server
// span, the test's span's child; each of kube-apiserver's CLIENT spans of
// c.rpc, the parent of a SERVER span of the proxy; and for each the proxy
// did not answer from its cache, the proxy's CLIENT span, the server span's
// child, and etcd's SERVER span, that one's child. An error says what is
// missing (yet).
func (c *kubeTracedCall) resolve(sink *otlpsink.Sink) error {
	const server, client = tracepb.Span_SPAN_KIND_SERVER, tracepb.Span_SPAN_KIND_CLIENT
	spans := sink.Spans(c.traceID)
	if _, ok := kubeTraceChild(spans, "apiserver", "", server, c.parentID); !ok {
		return fmt.Errorf("%s: no server span of kube-apiserver, the test's span's child, in its trace %s: %s", c.what, c.traceID, kubeTraceSummary(spans))
	}
	var hops []kubeTraceHop
	for _, api := range kubeTraceAll(spans, "apiserver", c.rpc, client) {
		ps, ok := kubeTraceChild(spans, "etcd-snapcache", c.rpc, server, api.SpanID)
		if !ok {
			return fmt.Errorf("%s: no server span of the proxy, the child of kube-apiserver's %s (span %s): %s", c.what, c.rpc, api.SpanID, kubeTraceSummary(spans))
		}
		h := kubeTraceHop{apiserver: api, proxyServer: ps}
		if ps.Attrs["snapcache.source"].GetStringValue() != "cache" {
			pc, ok := kubeTraceChild(spans, "etcd-snapcache", c.rpc, client, ps.SpanID)
			if !ok {
				return fmt.Errorf("%s: the proxy's %s (span %s, source %q) has no CLIENT child, its call to etcd: %s", c.what, c.rpc, ps.SpanID, ps.Attrs["snapcache.source"].GetStringValue(), kubeTraceSummary(spans))
			}
			es, ok := kubeTraceChild(spans, "etcd", c.rpc, server, pc.SpanID)
			if !ok {
				return fmt.Errorf("%s: no server span of etcd, the child of the proxy's call %s (span %s): %s", c.what, c.rpc, pc.SpanID, kubeTraceSummary(spans))
			}
			h.proxyClient, h.etcd = &pc, &es
		}
		hops = append(hops, h)
	}
	if len(hops) == 0 {
		return fmt.Errorf("%s: no CLIENT span %s of kube-apiserver in its trace %s: %s", c.what, c.rpc, c.traceID, kubeTraceSummary(spans))
	}
	c.spans, c.hops = spans, hops
	return nil
}

// checkProof checks the link of h's proxy span (a read from the cache) to
// the proof that the cache was fresh: a span kubeTraceProofSpan of the
// proxy, INTERNAL, in a trace other than the read's, with a CLIENT child
// etcdserverpb.KV/Range of the proxy, whose child is etcd's SERVER span of
// it. An error says what is missing (yet).
func (c *kubeTracedCall) checkProof(sink *otlpsink.Sink, h kubeTraceHop) error {
	const rangeRPC = "etcdserverpb.KV/Range"
	var seen []string
	for _, link := range h.proxyServer.Links {
		traceID, spanID := hex.EncodeToString(link.GetTraceId()), hex.EncodeToString(link.GetSpanId())
		spans := sink.Spans(traceID)
		var proof *otlpsink.Span
		for i, sp := range spans {
			if sp.SpanID == spanID {
				proof = &spans[i]
			}
		}
		if proof == nil {
			seen = append(seen, fmt.Sprintf("%s/%s (not received)", traceID, spanID))
			continue
		}
		seen = append(seen, fmt.Sprintf("%s/%s %s %s %s", traceID, spanID, proof.Service, proof.Name, proof.Kind))
		if proof.Name != kubeTraceProofSpan {
			continue
		}
		if proof.Service != "etcd-snapcache" || proof.Kind != tracepb.Span_SPAN_KIND_INTERNAL {
			return fmt.Errorf("%s: the linked %s span is %s's, %s; want the proxy's (etcd-snapcache), INTERNAL", c.what, kubeTraceProofSpan, proof.Service, proof.Kind)
		}
		if proof.TraceID == c.traceID {
			return fmt.Errorf("%s: the linked %s span is in the read's own trace %s, want a trace of its own", c.what, kubeTraceProofSpan, c.traceID)
		}
		read, ok := kubeTraceChild(spans, "etcd-snapcache", rangeRPC, tracepb.Span_SPAN_KIND_CLIENT, proof.SpanID)
		if !ok {
			return fmt.Errorf("%s: the proof (span %s, trace %s) has no CLIENT child %s of the proxy: %s", c.what, proof.SpanID, traceID, rangeRPC, kubeTraceSummary(spans))
		}
		es, ok := kubeTraceChild(spans, "etcd", rangeRPC, tracepb.Span_SPAN_KIND_SERVER, read.SpanID)
		if !ok {
			return fmt.Errorf("%s: the proof's quorum read (span %s, trace %s) has no child span of etcd: %s", c.what, read.SpanID, traceID, kubeTraceSummary(spans))
		}
		c.proofs = append(c.proofs, fmt.Sprintf("the proxy's span %s links to %s (span %s, trace %s) -> the proxy's %s (span %s) -> etcd's (span %s)",
			h.proxyServer.SpanID, kubeTraceProofSpan, proof.SpanID, traceID, rangeRPC, read.SpanID, es.SpanID))
		return nil
	}
	return fmt.Errorf("%s: the proxy's span %s of a read from its cache links to no %s span; its links: %v", c.what, h.proxyServer.SpanID, kubeTraceProofSpan, seen)
}

// kubeTraceAll returns the spans of service named name (any, if "") of
// kind.
func kubeTraceAll(spans []otlpsink.Span, service, name string, kind tracepb.Span_SpanKind) []otlpsink.Span {
	var out []otlpsink.Span
	for _, sp := range spans {
		if sp.Service == service && (name == "" || sp.Name == name) && sp.Kind == kind {
			out = append(out, sp)
		}
	}
	return out
}

// kubeTraceChild returns the span of service named name (any, if "") of
// kind whose parent is parentID.
func kubeTraceChild(spans []otlpsink.Span, service, name string, kind tracepb.Span_SpanKind, parentID string) (otlpsink.Span, bool) {
	for _, sp := range kubeTraceAll(spans, service, name, kind) {
		if sp.ParentID == parentID {
			return sp, true
		}
	}
	return otlpsink.Span{}, false
}

// kubeTraceSummary lists a trace's spans, one "service name kind span<-parent"
// each, for failure messages.
func kubeTraceSummary(spans []otlpsink.Span) string {
	if len(spans) == 0 {
		return "no spans received"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d spans:", len(spans))
	for _, sp := range spans {
		fmt.Fprintf(&b, "\n    %s %q %s %s<-%s", sp.Service, sp.Name, strings.TrimPrefix(sp.Kind.String(), "SPAN_KIND_"), sp.SpanID, sp.ParentID)
	}
	return b.String()
}

// attrNames lists a span's attributes' keys, for failure messages.
func attrNames(sp otlpsink.Span) []string {
	var out []string
	for k := range sp.Attrs {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
