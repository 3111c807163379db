// Package tlsmux splits the connections of a TLS listener between grpc-go's
// own HTTP/2 transport and an HTTP server, so that gRPC over TLS is served
// natively while HTTP (/metrics, /readyz, etcd's JSON gateway) stays on the
// same port, and every handler still sees the caller's verified
// certificate.
//
// etcd, and the proxy before this package, hand gRPC requests over TLS to
// grpc.Server.ServeHTTP behind net/http's HTTP/2 server, which grpc-go
// documents as slower than its own transport. A connection is classified
// once, after its TLS handshake:
//
//   - without HTTP/2 negotiated (ALPN), it is HTTP/1: the *tls.Conn goes
//     to the HTTP server as it is (HTTP1);
//   - with HTTP/2, the first request decides. The mux sends the server's
//     connection preface (a SETTINGS frame, which gRPC clients wait for
//     before their first request) and reads the client's frames up to
//     its first HEADERS, whose content-type says gRPC or not, or its
//     first PING, which only a gRPC client's keepalive sends before a
//     request. A gRPC connection goes to the gRPC server (GRPC, with
//     Credentials), any other to an HTTP/2 server of the HTTP handler
//     (New's serveHTTP2). Either reads the frames read so far again; the
//     HTTP/2 server without the client's acknowledgement of the mux's
//     SETTINGS, which it did not send (grpc-go ignores it).
//
// A connection carries requests of one kind. A client that sends a gRPC
// request on a connection whose first request was not one is still
// served, by the HTTP handler's route to grpc.Server.ServeHTTP.
package tlsmux

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"

	"go.uber.org/zap"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/credentials"
)

// Conn is a classified connection: the TLS connection, with the bytes the
// mux read replayed first (its client preface and frames up to the first
// request, less the SETTINGS acknowledgement the mux consumed).
type Conn struct {
	*tls.Conn
	r io.Reader
}

func (c *Conn) Read(p []byte) (int, error) { return c.r.Read(p) }

// ConnectionState is the finished handshake's state, which x/net/http2
// reads for Request.TLS and Credentials for peer.AuthInfo.
func (c *Conn) ConnectionState() tls.ConnectionState { return c.Conn.ConnectionState() }

// Mux accepts from a listener of handshaken *tls.Conn (etcd's
// transport.NewTLSListener, which also checks the CRL) and classifies each
// connection on a goroutine of its own.
type Mux struct {
	l  net.Listener
	lg *zap.Logger

	grpc, http1 *chanListener
	// http2 serves an HTTP/2 connection that is not gRPC's; it returns
	// when the connection ends.
	http2 func(*Conn)

	wg sync.WaitGroup // classifying and HTTP/2 goroutines

	mu sync.Mutex
	// Guarded by mu.
	pending map[net.Conn]struct{} // being classified
	closed  bool
}

// New returns a mux of l's connections; serveHTTP2 serves a classified
// HTTP/2 connection that is not gRPC's, until it ends.
func New(l net.Listener, serveHTTP2 func(*Conn), lg *zap.Logger) *Mux {
	return &Mux{
		l: l, lg: lg, http2: serveHTTP2,
		grpc:    newChanListener(l.Addr()),
		http1:   newChanListener(l.Addr()),
		pending: map[net.Conn]struct{}{},
	}
}

// GRPC is the listener of gRPC connections, for grpc.Server.Serve with
// Credentials.
func (m *Mux) GRPC() net.Listener { return m.grpc }

// HTTP1 is the listener of HTTP/1 connections, *tls.Conn as accepted, for
// http.Server.Serve.
func (m *Mux) HTTP1() net.Listener { return m.http1 }

// Serve accepts until the listener is closed (Close), and returns its
// error.
func (m *Mux) Serve() error {
	for {
		c, err := m.l.Accept()
		if err != nil {
			return err
		}
		tc, ok := c.(*tls.Conn)
		if !ok {
			c.Close()
			return fmt.Errorf("tlsmux: accepted a %T, want a *tls.Conn", c)
		}
		if !m.track(tc) {
			tc.Close()
			return net.ErrClosed
		}
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			m.classify(tc)
		}()
	}
}

// Close closes the listener, the connections being classified and the
// classified listeners, and waits for the goroutines of the mux, the
// HTTP/2 connections' included: close those first (their server's
// shutdown), or they are waited for.
func (m *Mux) Close() error {
	m.mu.Lock()
	m.closed = true
	for c := range m.pending {
		c.Close()
	}
	m.mu.Unlock()
	err := m.l.Close()
	m.grpc.Close()
	m.http1.Close()
	m.wg.Wait()
	return err
}

func (m *Mux) track(c net.Conn) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false
	}
	m.pending[c] = struct{}{}
	return true
}

func (m *Mux) untrack(c net.Conn) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.pending, c)
}

func (m *Mux) classify(tc *tls.Conn) {
	defer m.untrack(tc)
	if tc.ConnectionState().NegotiatedProtocol != http2.NextProtoTLS {
		m.handOff(m.http1, tc)
		return
	}
	if m.grpc.isClosed() {
		// The gRPC server is stopping (GracefulStop closed its
		// listener): closed before the server preface, the connection
		// never becomes ready, so a client sends nothing on it and
		// tries again elsewhere or later, as against a closed port.
		tc.Close()
		return
	}
	c, isGRPC, err := peek(tc)
	if err != nil {
		if !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.EOF) {
			m.lg.Debug("closing an HTTP/2 connection before its first request", zap.Stringer("remote", tc.RemoteAddr()), zap.Error(err))
		}
		tc.Close()
		return
	}
	if isGRPC {
		if !m.grpc.put(c) {
			// Stopped since the preface was sent: a GOAWAY whose last
			// stream is 0 tells the client that no request it sent was
			// processed, so that it retries each (grpc-go does so
			// transparently), where a bare close would fail them.
			goAwayUnprocessed(tc)
			tc.Close()
		}
		return
	}
	// Still tracked while served, so that Close ends it.
	m.http2(c)
}

func (m *Mux) handOff(l *chanListener, c net.Conn) {
	if !l.put(c) {
		c.Close()
	}
}

// goAwayUnprocessed writes a GOAWAY frame with last stream 0 and no error:
// no stream of the connection was or will be processed.
func goAwayUnprocessed(c net.Conn) {
	fr := http2.NewFramer(c, nil)
	fr.WriteGoAway(0, http2.ErrCodeNo, nil)
}

// prefaceSettings is the server's connection preface, a SETTINGS frame of
// SETTINGS_NO_RFC7540_PRIORITIES = 1 alone: a value that may not change
// after the first SETTINGS (RFC 9218; curl's nghttp2 ends the connection
// if it does), which x/net's server sends and grpc-go's, which ignores
// RFC 7540 priorities too, leaves as it is.
var prefaceSettings = []byte{0, 0, 6, byte(http2.FrameSettings), 0, 0, 0, 0, 0, 0, byte(http2.SettingNoRFC7540Priorities), 0, 0, 0, 1}

// peek reads tc's client preface and frames up to its first HEADERS or
// PING, after sending the server's preface, and returns the connection
// with what it read replayed, and whether it is gRPC's.
func peek(tc *tls.Conn) (*Conn, bool, error) {
	if _, err := tc.Write(prefaceSettings); err != nil {
		return nil, false, fmt.Errorf("sending the server preface: %w", err)
	}
	var seen bytes.Buffer
	br := bufio.NewReader(io.TeeReader(tc, &seen))
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(br, preface); err != nil {
		return nil, false, err
	}
	if string(preface) != http2.ClientPreface {
		return nil, false, errors.New("not an HTTP/2 client preface")
	}
	fr := http2.NewFramer(io.Discard, br)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	isGRPC := false
read:
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return nil, false, err
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			isGRPC = strings.HasPrefix(f.PseudoValue("method"), "POST") &&
				strings.HasPrefix(contentType(f), "application/grpc")
			break read
		case *http2.PingFrame:
			isGRPC = true
			break read
		}
	}
	// seen is every byte read from tc: what the framer consumed and what
	// br holds beyond it.
	var replay io.Reader = io.MultiReader(bytes.NewReader(seen.Bytes()), tc)
	if !isGRPC {
		// grpc-go's server ignores an acknowledgement it did not ask
		// for, so its connections are read as they come.
		replay = newDropSettingsAck(replay)
	}
	return &Conn{Conn: tc, r: replay}, isGRPC, nil
}

func contentType(f *http2.MetaHeadersFrame) string {
	for _, hf := range f.RegularFields() {
		if hf.Name == "content-type" {
			return hf.Value
		}
	}
	return ""
}

// dropSettingsAck reads an HTTP/2 client's byte stream without the first
// SETTINGS frame with the ACK flag: the acknowledgement of the mux's
// preface, which the server the connection goes to never sent (x/net's
// server treats an unexpected one as a protocol error). The client
// acknowledges the settings it receives in order, and the mux's came
// first. After it, the stream is passed as it is.
type dropSettingsAck struct {
	br        *bufio.Reader
	preface   bool   // the client preface was passed on
	dropped   bool   // the acknowledgement was dropped
	pending   []byte // bytes to pass on before reading more
	frameLeft int    // bytes of the current frame's payload to pass on
	buf       [len(http2.ClientPreface)]byte
}

func newDropSettingsAck(r io.Reader) *dropSettingsAck {
	return &dropSettingsAck{br: bufio.NewReader(r)}
}

func (d *dropSettingsAck) Read(p []byte) (int, error) {
	for {
		switch {
		case len(p) == 0:
			return 0, nil
		case len(d.pending) > 0:
			n := copy(p, d.pending)
			d.pending = d.pending[n:]
			return n, nil
		case d.dropped:
			return d.br.Read(p)
		case d.frameLeft > 0:
			n, err := d.br.Read(p[:min(len(p), d.frameLeft)])
			d.frameLeft -= n
			return n, err
		case !d.preface:
			if _, err := io.ReadFull(d.br, d.buf[:]); err != nil {
				return 0, err
			}
			d.preface, d.pending = true, d.buf[:]
		default:
			hdr := d.buf[:9]
			if _, err := io.ReadFull(d.br, hdr); err != nil {
				return 0, err
			}
			length := int(hdr[0])<<16 | int(hdr[1])<<8 | int(hdr[2])
			if http2.FrameType(hdr[3]) == http2.FrameSettings && http2.Flags(hdr[4]).Has(http2.FlagSettingsAck) {
				d.dropped = true
				d.frameLeft = 0
				if length != 0 {
					return 0, errors.New("tlsmux: a SETTINGS acknowledgement with a payload")
				}
				continue
			}
			d.pending, d.frameLeft = hdr, length
		}
	}
}

// chanListener is a net.Listener of the connections put to it.
type chanListener struct {
	addr net.Addr
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

func newChanListener(addr net.Addr) *chanListener {
	return &chanListener{addr: addr, ch: make(chan net.Conn), done: make(chan struct{})}
}

// put hands c to Accept; false once the listener is closed.
func (l *chanListener) put(c net.Conn) bool {
	select {
	case l.ch <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// isClosed reports whether Close was called.
func (l *chanListener) isClosed() bool {
	select {
	case <-l.done:
		return true
	default:
		return false
	}
}

func (l *chanListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *chanListener) Addr() net.Addr { return l.addr }

// Credentials are the gRPC server's transport credentials for the mux's
// gRPC connections: the TLS handshake is done, and its state, the caller's
// verified certificate included, is the peer's AuthInfo, as grpc-go's TLS
// credentials make it.
func Credentials() credentials.TransportCredentials { return handshaken{} }

type handshaken struct{}

func (handshaken) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("tlsmux: server credentials only")
}

func (handshaken) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	mc, ok := c.(*Conn)
	if !ok {
		return nil, nil, fmt.Errorf("tlsmux: a %T, not a classified connection", c)
	}
	return mc, credentials.TLSInfo{
		State:          mc.ConnectionState(),
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
	}, nil
}

func (handshaken) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls"}
}

func (h handshaken) Clone() credentials.TransportCredentials { return h }

func (handshaken) OverrideServerName(string) error { return nil }
