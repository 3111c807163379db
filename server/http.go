package server

import (
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/pkg/v3/debugutil"
	"go.etcd.io/etcd/server/v3/proxy/grpcproxy"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
)

// Paths of the HTTP endpoints, on the client port and on --metrics-addr.
const (
	pathMetrics      = "/metrics"       // the upstream's metrics, relayed (grpc-proxy)
	pathHealth       = "/health"        // the upstream's health (grpc-proxy)
	pathProxyMetrics = "/proxy/metrics" // the proxy's own metrics (grpc-proxy)
	pathProxyHealth  = "/proxy/health"  // a Get and a Watch through the proxy (grpc-proxy)
	pathProxyStatus  = proxystatus.Path // the proxy's status, one JSON document
	pathLivez        = "/livez"         // Kubernetes-style liveness
	pathReadyz       = "/readyz"        // Kubernetes-style readiness
)

// httpEndpoints is what the HTTP endpoints read of the running proxy.
type httpEndpoints struct {
	lg       *zap.Logger
	gatherer prometheus.Gatherer
	// upstream is the proxy's client of etcd, and upstreamHTTP the HTTP
	// client that fetches etcd's /metrics.
	upstream     *clientv3.Client
	upstreamHTTP *http.Client
	upstreamEPs  []string
	// self is a client of the proxy's own gRPC API, for /proxy/health.
	self *clientv3.Client
	// status is the proxy's status document, for /proxy/status.
	status func() proxystatus.Status
	probes *probes
}

// newHTTPMux serves grpc-proxy's HTTP endpoints with grpc-proxy's meanings
// (etcd's own handlers where etcd exports them), the proxy's status
// document, Kubernetes-style /livez and /readyz, and /debug/pprof/ when
// pprof is set.
func newHTTPMux(e httpEndpoints, pprof bool) *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("/", http.NotFound)
	grpcproxy.HandleMetrics(mux, e.upstreamHTTP, e.upstreamEPs)
	grpcproxy.HandleHealth(e.lg, mux, e.upstream)
	mux.Handle(pathProxyMetrics, promhttp.HandlerFor(e.gatherer, promhttp.HandlerOpts{}))
	grpcproxy.HandleProxyHealth(e.lg, mux, e.self)
	mux.Handle(pathProxyStatus, statusHandler(e.status))
	e.probes.install(mux)
	if pprof {
		for p, h := range debugutil.PProfHandlers() {
			mux.Handle(p, h)
		}
	}
	return mux
}

// probeCheck is one named check of /livez or /readyz: nil while it passes.
type probeCheck struct {
	name  string
	check func() error
	// note, if set, says more of a passing check: what is off, and why.
	note func() string
}

// probes are the Kubernetes-style health probes: /livez and /readyz answer
// "ok" while every check passes, list each check with ?verbose, skip
// checks named in ?exclude=, and serve each check alone at
// /readyz/<name>. A failing probe answers 503 Service Unavailable with the
// list, so that load balancers stop sending clients.
type probes struct {
	livez, readyz []probeCheck
}

func (p *probes) install(mux *http.ServeMux) {
	for path, checks := range map[string][]probeCheck{pathLivez: p.livez, pathReadyz: p.readyz} {
		name := strings.TrimPrefix(path, "/")
		mux.Handle(path, probeHandler(name, checks))
		for _, c := range checks {
			mux.Handle(path+"/"+c.name, probeHandler(name, []probeCheck{c}))
		}
	}
}

func probeHandler(probe string, checks []probeCheck) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		_, verbose := q["verbose"]
		excluded := q["exclude"]
		var report strings.Builder
		failed := false
		for _, c := range checks {
			if slices.Contains(excluded, c.name) {
				fmt.Fprintf(&report, "[+]%s excluded: ok\n", c.name)
				continue
			}
			if err := c.check(); err != nil {
				failed = true
				fmt.Fprintf(&report, "[-]%s failed: %v\n", c.name, err)
				continue
			}
			if c.note != nil {
				if n := c.note(); n != "" {
					fmt.Fprintf(&report, "[+]%s ok: %s\n", c.name, n)
					continue
				}
			}
			fmt.Fprintf(&report, "[+]%s ok\n", c.name)
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if failed {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, "%s%s check failed\n", report.String(), probe)
			return
		}
		if verbose {
			fmt.Fprintf(w, "%s%s check passed\n", report.String(), probe)
			return
		}
		fmt.Fprint(w, "ok")
	})
}
