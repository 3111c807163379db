package server

import (
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/tlsmux"
	"github.com/soheilhy/cmux"
	"golang.org/x/net/http2"
	"google.golang.org/grpc"

	"go.etcd.io/etcd/client/pkg/v3/transport"
)

// servingTLS returns the TLS the client port serves, or nil for none: the
// configured certificate, else with AutoTLS a self-signed one kept under
// <DataDir>/fixtures/proxy, as grpc-proxy keeps it. A trusted CA makes the
// proxy require and verify client certificates.
func (s *Server) servingTLS() (*transport.TLSInfo, error) {
	info := s.cfg.ServerTLS
	if info.CertFile == "" && info.KeyFile == "" && info.TrustedCAFile == "" {
		if !s.cfg.AutoTLS {
			return nil, nil // a CRL without serving TLS is ignored, as grpc-proxy ignores it
		}
		dir := filepath.Join(s.cfg.DataDir, "fixtures", "proxy")
		auto, err := transport.SelfCert(s.lg, dir, []string{"https://" + s.cfg.ListenAddr}, s.cfg.SelfSignedCertValidity)
		if err != nil {
			return nil, fmt.Errorf("--auto-tls: %w", err)
		}
		auto.CipherSuites, auto.MinVersion, auto.MaxVersion, auto.CRLFile = info.CipherSuites, info.MinVersion, info.MaxVersion, info.CRLFile
		info = auto
	}
	info.ClientCertAuth = info.TrustedCAFile != ""
	if info.CRLFile != "" {
		if _, err := os.Stat(info.CRLFile); err != nil {
			return nil, fmt.Errorf("--client-crl-file: %w", err)
		}
	}
	if _, err := info.ServerConfig(); err != nil {
		return nil, fmt.Errorf("serving TLS: %w", err)
	}
	return &info, nil
}

// listen binds the client port and --metrics-addr, or takes the sockets a
// handover passed on; these accept nothing until the proxy is ready.
func (s *Server) listen() error {
	s.acceptsOpen = make(chan struct{})
	in := s.cfg.Inherited
	if in.Client != nil {
		s.clientRaw, s.metricsRaw = in.Client, in.Metrics
		s.clientLis = holdAccepts(in.Client, s.acceptsOpen)
		if s.cfg.MetricsAddr == "" || in.Metrics == nil {
			if in.Metrics != nil {
				in.Metrics.Close()
				s.metricsRaw = nil
			}
			if s.cfg.MetricsAddr != "" {
				return fmt.Errorf("--metrics-addr %s: the process handing over did not serve it", s.cfg.MetricsAddr)
			}
			return nil
		}
		l, err := wrapMetrics(s.cfg.MetricsAddr, holdAccepts(in.Metrics, s.acceptsOpen), s.tls)
		s.metricsLis = l
		return err
	}
	close(s.acceptsOpen)
	var err error
	if s.clientRaw, err = net.Listen("tcp", s.cfg.ListenAddr); err != nil {
		return fmt.Errorf("--listen-addr %s: %w", s.cfg.ListenAddr, err)
	}
	s.clientLis = s.clientRaw
	if s.cfg.MetricsAddr != "" {
		host, _, err := metricsScheme(s.cfg.MetricsAddr, s.tls)
		if err != nil {
			return err
		}
		if s.metricsRaw, err = net.Listen("tcp", host); err != nil {
			return fmt.Errorf("--metrics-addr %q: %w", s.cfg.MetricsAddr, err)
		}
		if s.metricsLis, err = wrapMetrics(s.cfg.MetricsAddr, s.metricsRaw, s.tls); err != nil {
			return err
		}
	}
	return nil
}

// firstReadiness lets the listeners accept if they were handed over, and
// calls OnReady: the proxy is ready for the first time.
func (s *Server) firstReadiness() {
	select {
	case <-s.acceptsOpen:
	default:
		close(s.acceptsOpen)
		s.lg.Info("accepting on the sockets handed over; the old process drains")
	}
	if s.cfg.OnReady != nil {
		s.cfg.OnReady()
	}
}

// wrapMetrics serves --metrics-addr on l, with the serving TLS if its
// scheme is https.
func wrapMetrics(addr string, l net.Listener, tlsInfo *transport.TLSInfo) (net.Listener, error) {
	_, scheme, err := metricsScheme(addr, tlsInfo)
	if err != nil {
		return nil, err
	}
	if scheme == "http" {
		return l, nil
	}
	tl, err := transport.NewTLSListener(l, tlsInfo)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %q: %w", addr, err)
	}
	return tl, nil
}

// metricsScheme parses --metrics-addr: a URL, http:// or https:// (served
// with the serving TLS), as grpc-proxy takes it, or a plain host:port
// served over HTTP.
func metricsScheme(addr string, tlsInfo *transport.TLSInfo) (host, scheme string, err error) {
	scheme, host = "http", addr
	if strings.Contains(addr, "://") {
		u, err := url.Parse(addr)
		if err != nil {
			return "", "", fmt.Errorf("--metrics-addr %q: %w", addr, err)
		}
		scheme, host = u.Scheme, u.Host
	}
	switch {
	case scheme != "http" && scheme != "https":
		return "", "", fmt.Errorf("--metrics-addr %q: scheme %q, want http or https", addr, scheme)
	case scheme == "https" && tlsInfo == nil:
		return "", "", fmt.Errorf("--metrics-addr %q: https needs serving TLS (--cert-file and --key-file, or --auto-tls)", addr)
	}
	return host, scheme, nil
}

// newHTTPServer returns an HTTP server of h with etcd's settings: client
// errors are not logged, and HTTP/2 streams are not capped below
// --max-concurrent-streams.
func (s *Server) newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Minute,
		ErrorLog:          log.New(io.Discard, "", 0),
		// net/http replaces a limit above math.MaxInt32 with its default.
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: int(min(s.maxConcurrentStreams(), math.MaxInt32))},
	}
}

// servePorts serves the gRPC server and the HTTP endpoints (with etcd's
// JSON gateway if enabled) on the client port, and the HTTP endpoints on
// --metrics-addr. /proxy/health and the gateway reach the proxy through
// its own API, on a client of the client port (self).
func (s *Server) servePorts() error {
	var err error
	if s.self, err = s.dialSelf(); err != nil {
		return err
	}
	endpoints, err := s.newHTTPEndpoints()
	if err != nil {
		return err
	}
	var clientMux http.Handler = newHTTPMux(endpoints, s.cfg.EnablePprof)
	if s.cfg.EnableGRPCGateway {
		if s.gateway, err = s.newGateway(); err != nil {
			return err
		}
		clientMux = s.gateway.wrap(clientMux)
	}
	if err := s.serveClientPort(s.grpcServer, clientMux); err != nil {
		return err
	}
	if s.metricsLis != nil {
		s.metricsHTTP = s.newHTTPServer(newHTTPMux(endpoints, false))
		s.serve("metrics", func() error { return s.metricsHTTP.Serve(s.metricsLis) })
	}
	return nil
}

// serveClientPort serves gRPC and HTTP on the client listener, as etcd
// serves its client port. Without TLS, cmux sends HTTP/2 connections to the
// gRPC server and HTTP/1 ones to the HTTP server. With TLS, etcd's TLS
// listener terminates TLS (checking the CRL) and internal/tlsmux sends
// gRPC connections to grpc-go's own transport, with credentials that put
// the caller's verified certificate in peer.AuthInfo as etcd's handlers
// see it, and the rest to the HTTP server: HTTP/1 as they are, HTTP/2 to
// an HTTP/2 server of the same handler, which hands a gRPC request on such
// a connection to the gRPC server through ServeHTTP, as etcd does.
//
// Two muxes, because the two cases split on different facts. In plaintext
// an HTTP/2 connection is gRPC (HTTP clients speak HTTP/1 without TLS, as
// etcd assumes), which cmux sees in the connection's preface. Over TLS
// every HTTPS client may negotiate HTTP/2, so only the first request's
// content type tells gRPC apart, read after the handshake, which cmux
// cannot do on a listener that terminates TLS with etcd's CRL checks.
func (s *Server) serveClientPort(gs *grpc.Server, mux http.Handler) error {
	if s.tls == nil {
		m := cmux.New(s.clientLis)
		grpcl := m.Match(cmux.HTTP2())
		httpl := m.Match(cmux.HTTP1())
		s.clientHTTP = s.newHTTPServer(mux)
		s.serve("gRPC", func() error { return gs.Serve(grpcl) })
		s.serve("HTTP", func() error { return s.clientHTTP.Serve(httpl) })
		s.serve("the client port", m.Serve)
		return nil
	}
	tlsl, err := transport.NewTLSListener(s.clientLis, s.tls)
	if err != nil {
		return fmt.Errorf("serving TLS: %w", err)
	}
	tlsCfg, err := s.tls.ServerConfig()
	if err != nil {
		return fmt.Errorf("serving TLS: %w", err)
	}
	s.clientHTTP = s.newHTTPServer(grpcHandlerFunc(gs, mux))
	s.clientHTTP.TLSConfig = tlsCfg
	h2 := &http2.Server{MaxConcurrentStreams: s.maxConcurrentStreams()}
	if err := http2.ConfigureServer(s.clientHTTP, h2); err != nil {
		return fmt.Errorf("serving HTTP/2 over TLS: %w", err)
	}
	s.tlsMux = tlsmux.New(tlsl, func(c *tlsmux.Conn) {
		h2.ServeConn(c, &http2.ServeConnOpts{BaseConfig: s.clientHTTP, Handler: s.clientHTTP.Handler})
	}, s.lg.Named("tls"))
	s.serve("gRPC over TLS", func() error { return gs.Serve(s.tlsMux.GRPC()) })
	s.serve("HTTP over TLS", func() error { return s.clientHTTP.Serve(s.tlsMux.HTTP1()) })
	s.serve("the client port", s.tlsMux.Serve)
	return nil
}

// grpcHandlerFunc is etcd's: gRPC requests to the gRPC server, the rest to
// other.
func grpcHandlerFunc(gs *grpc.Server, other http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if isGRPC(r) {
			gs.ServeHTTP(w, r)
			return
		}
		other.ServeHTTP(w, r)
	})
}

// serve runs fn on a goroutine the server owns, reporting an error that is
// not the end of serving on Err.
func (s *Server) serve(what string, fn func() error) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		err := fn()
		if err == nil || s.stopping.Load() || errors.Is(err, http.ErrServerClosed) || errors.Is(err, net.ErrClosed) || errors.Is(err, cmux.ErrListenerClosed) || errors.Is(err, cmux.ErrServerClosed) {
			return
		}
		select {
		case s.errc <- fmt.Errorf("serving %s: %w", what, err):
		default:
		}
	}()
}
