package tlsmux_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"

	"go.etcd.io/etcd/client/pkg/v3/transport"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/internal/tlsmux"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// muxed is a mux on a TLS listener requiring client certificates, with a
// gRPC health server on its gRPC connections that records the common name
// of each caller's verified certificate, and an HTTP handler on the rest
// that answers the protocol and the caller's common name.
type muxed struct {
	addr string
	pki  *testsupport.PKI
	cns  chan string // gRPC callers' common names
}

func startMux(t *testing.T) *muxed {
	m, _ := startMuxed(t)
	return m
}

// startMuxed is startMux, and the mux itself.
func startMuxed(t *testing.T) (*muxed, *tlsmux.Mux) {
	t.Helper()
	dir := t.TempDir()
	pki := testsupport.NewPKI(t)
	info := transport.TLSInfo{CertFile: filepath.Join(dir, "s.crt"), KeyFile: filepath.Join(dir, "s.key"), TrustedCAFile: filepath.Join(dir, "ca.crt"), ClientCertAuth: true}
	pki.WriteCA(t, info.TrustedCAFile)
	pki.WritePair(t, "server", testsupport.Server, info.CertFile, info.KeyFile)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tlsl, err := transport.NewTLSListener(l, &info)
	if err != nil {
		t.Fatal(err)
	}
	m := &muxed{addr: l.Addr().String(), pki: pki, cns: make(chan string, 16)}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cn := "-"
		if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 {
			cn = r.TLS.VerifiedChains[0][0].Subject.CommonName
		}
		io.WriteString(w, r.Proto+" "+cn)
	})
	hs := &http.Server{Handler: handler}
	h2 := &http2.Server{}
	if err := http2.ConfigureServer(hs, h2); err != nil {
		t.Fatal(err)
	}
	mux := tlsmux.New(tlsl, func(c *tlsmux.Conn) {
		h2.ServeConn(c, &http2.ServeConnOpts{BaseConfig: hs, Handler: handler})
	}, zaptest.NewLogger(t))
	gs := grpc.NewServer(grpc.Creds(tlsmux.Credentials()), grpc.UnaryInterceptor(
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			cn := "-"
			if p, ok := peer.FromContext(ctx); ok {
				if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.VerifiedChains) > 0 {
					cn = ti.State.VerifiedChains[0][0].Subject.CommonName
				}
			}
			m.cns <- cn
			return h(ctx, req)
		}))
	healthpb.RegisterHealthServer(gs, health.NewServer())
	done := make(chan struct{}, 3)
	for _, serve := range []func() error{
		mux.Serve,
		func() error { return gs.Serve(mux.GRPC()) },
		func() error { return hs.Serve(mux.HTTP1()) },
	} {
		go func() {
			defer func() { done <- struct{}{} }()
			serve()
		}()
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		hs.Shutdown(ctx)
		gs.Stop()
		mux.Close()
		for range 3 {
			<-done
		}
	})
	return m, mux
}

// TestGRPCNativeWithIdentity: a gRPC client reaches the gRPC server on its
// own transport, whose handlers see its verified certificate, also after
// its connection stayed idle before the first call.
func TestGRPCNativeWithIdentity(t *testing.T) {
	m := startMux(t)
	conn, err := grpc.NewClient(m.addr, grpc.WithTransportCredentials(credentials.NewTLS(m.pki.ClientTLS(t, "alice"))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.Connect()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Ready means the server's preface arrived before any request.
	for s := conn.GetState(); s.String() != "READY"; s = conn.GetState() {
		if !conn.WaitForStateChange(ctx, s) {
			t.Fatalf("connection never ready: %v", s)
		}
	}
	for range 3 {
		if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
		if cn := <-m.cns; cn != "alice" {
			t.Fatalf("the handler saw %q, want alice", cn)
		}
	}
}

// TestHTTPBothVersions: HTTP/1.1 and HTTP/2 requests on the same port
// reach the HTTP handler with the caller's verified certificate.
func TestHTTPBothVersions(t *testing.T) {
	m := startMux(t)
	for _, tc := range []struct {
		name, want string
		h2         bool
	}{{"HTTP/1.1", "HTTP/1.1 bob", false}, {"HTTP/2", "HTTP/2.0 bob", true}} {
		t.Run(tc.name, func(t *testing.T) {
			tr := &http.Transport{TLSClientConfig: m.pki.ClientTLS(t, "bob"), ForceAttemptHTTP2: tc.h2}
			if !tc.h2 {
				tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
			}
			defer tr.CloseIdleConnections()
			cli := &http.Client{Transport: tr, Timeout: 10 * time.Second}
			for range 2 {
				resp, err := cli.Get("https://" + m.addr + "/metrics")
				if err != nil {
					t.Fatal(err)
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || string(b) != tc.want {
					t.Fatalf("answer %q, %v; want %q", b, err, tc.want)
				}
			}
		})
	}
}

// TestPingBeforeRequest: a client whose keepalive pings before its first
// request is gRPC's, and the gRPC server answers the ping.
func TestPingBeforeRequest(t *testing.T) {
	m := startMux(t)
	fr := m.dialH2(t, "carol")
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	data := [8]byte{1, 2, 3, 4, 5, 6, 7, 8}
	if err := fr.WritePing(false, data); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				if err := fr.WriteSettingsAck(); err != nil {
					t.Fatal(err)
				}
			}
		case *http2.PingFrame:
			if f.IsAck() && f.Data == data {
				return
			}
		}
	}
}

// TestSettingsNeverChangePriorities: an HTTP/2 client that sends its
// request at once, as curl does, gets its answer, and no SETTINGS frame of
// the server changes SETTINGS_NO_RFC7540_PRIORITIES from the first one's,
// which RFC 9218 forbids (curl's nghttp2 ends the connection).
func TestSettingsNeverChangePriorities(t *testing.T) {
	m := startMux(t)
	fr := m.dialH2(t, "dave")
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range [][2]string{{":method", "GET"}, {":path", "/metrics"}, {":scheme", "https"}, {":authority", m.addr}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	first, noPriorities := true, uint32(0)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
			v, ok := f.Value(http2.SettingNoRFC7540Priorities)
			switch {
			case first:
				first, noPriorities = false, v
			case ok && v != noPriorities:
				t.Fatalf("SETTINGS_NO_RFC7540_PRIORITIES changed from %d to %d", noPriorities, v)
			}
			if err := fr.WriteSettingsAck(); err != nil {
				t.Fatal(err)
			}
		case *http2.GoAwayFrame:
			t.Fatalf("GOAWAY %v", f.ErrCode)
		case *http2.MetaHeadersFrame:
			if s := f.PseudoValue("status"); s != "200" {
				t.Fatalf("status %q", s)
			}
			return
		}
	}
}

// TestStoppingGRPCSendsNoPreface: once the gRPC server stopped accepting
// (GracefulStop closed its listener while the port still accepts), an
// HTTP/2 connection is closed before the server preface, so that a gRPC
// client never sends a request on it (which it could not retry safely)
// and connects again.
func TestStoppingGRPCSendsNoPreface(t *testing.T) {
	m, mux := startMuxed(t)
	mux.GRPC().Close()
	c, err := tls.Dial("tcp", m.addr, withALPN(m.pki.ClientTLS(t, "erin"), "h2"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, http2.ClientPreface)
	if b, err := io.ReadAll(c); len(b) != 0 {
		t.Fatalf("read %d bytes (%v) from a stopping server, want none", len(b), err)
	}
}

// dialH2 connects to the mux as the client cn, negotiating HTTP/2, sends
// the client preface, and returns a framer of the connection, closed when
// the test ends.
func (m *muxed) dialH2(t *testing.T, cn string) *http2.Framer {
	t.Helper()
	c, err := tls.Dial("tcp", m.addr, withALPN(m.pki.ClientTLS(t, cn), "h2"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	return http2.NewFramer(c, c)
}

func withALPN(cfg *tls.Config, protos ...string) *tls.Config {
	cfg = cfg.Clone()
	cfg.NextProtos = protos
	return cfg
}
