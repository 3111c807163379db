package wirecodec

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var watchResponseType = (&pb.WatchResponse{}).ProtoReflect().Type()

func sampleResponse() *pb.WatchResponse {
	return &pb.WatchResponse{
		Header:  &pb.ResponseHeader{ClusterId: 1, MemberId: 2, Revision: 42, RaftTerm: 3},
		WatchId: 7,
		Events: []*mvccpb.Event{
			{Kv: &mvccpb.KeyValue{Key: []byte("a"), Value: []byte("1"), ModRevision: 42}},
			{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte("b"), ModRevision: 42}, PrevKv: &mvccpb.KeyValue{Key: []byte("b"), Value: []byte("0")}},
		},
	}
}

// encodedInPieces is m's encoding cut into three pieces.
func encodedInPieces(t *testing.T, m proto.Message) ([]byte, *Encoded) {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	third := len(b) / 3
	return b, NewEncoded(m.ProtoReflect().Type(), []mem.Buffer{Piece(b[:third]), Piece(b[third : 2*third]), Piece(b[2*third:])})
}

// TestCodecSendsEncodedAsIs: an Encoded is marshaled to its pieces, the
// same bytes on every send, even after gRPC freed the previous send's
// buffers.
func TestCodecSendsEncodedAsIs(t *testing.T) {
	want, e := encodedInPieces(t, sampleResponse())
	c := Codec()
	for range 3 {
		data, err := c.Marshal(e)
		if err != nil {
			t.Fatal(err)
		}
		if got := data.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("marshaled %x, want %x", got, want)
		}
		data.Free() // as gRPC does once the message is written
	}
	if e.Len() != len(want) || !bytes.Equal(e.Bytes(), want) {
		t.Fatalf("Len %d, Bytes %x; want %d, %x", e.Len(), e.Bytes(), len(want), want)
	}

	// More pieces than held inline.
	var pieces []mem.Buffer
	for _, b := range want {
		pieces = append(pieces, Piece([]byte{b}))
	}
	if got := NewEncoded(watchResponseType, pieces).Bytes(); !bytes.Equal(got, want) {
		t.Fatalf("one piece a byte gives %x, want %x", got, want)
	}
}

// TestCodecFallsBackToProto: every other message is gRPC's proto codec's,
// both ways.
func TestCodecFallsBackToProto(t *testing.T) {
	c, std := Codec(), encoding.GetCodecV2(grpcproto.Name)
	if c.Name() != std.Name() {
		t.Fatalf("name %q, want %q", c.Name(), std.Name())
	}
	for _, m := range []proto.Message{
		sampleResponse(),
		&pb.RangeResponse{Header: &pb.ResponseHeader{Revision: 5}, Kvs: []*mvccpb.KeyValue{{Key: []byte("k"), Value: bytes.Repeat([]byte("v"), 100_000)}}, Count: 1},
		&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{Key: []byte("k"), PrevKv: true}}},
	} {
		got, err := c.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		want, err := std.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Materialize(), want.Materialize()) {
			t.Fatalf("%T: marshaled unlike gRPC's proto codec", m)
		}
		back := m.ProtoReflect().New().Interface()
		if err := c.Unmarshal(got, back); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(back, m) {
			t.Fatalf("%T: unmarshaled %v, want %v", m, back, m)
		}
		got.Free()
		want.Free()
	}
	if _, err := c.Marshal("not a message"); err == nil {
		t.Fatal("marshaled a string")
	}
}

// TestEncodedIsItsMessage: what inspects a payload sees the message an
// Encoded stands for: protojson (the payload logger), and proto.Marshal
// (gRPC's proto codec on a server without this one), which gives the same
// bytes back.
func TestEncodedIsItsMessage(t *testing.T) {
	m := sampleResponse()
	want, e := encodedInPieces(t, m)
	if !proto.Equal(e, m) {
		t.Fatalf("decoded %v, want %v", e.ProtoReflect().Interface(), m)
	}
	if e.ProtoReflect() != e.ProtoReflect() {
		t.Fatal("decoded twice: gRPC's proto codec sizes and marshals the same message")
	}
	j1, err := protojson.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	j2, _ := protojson.Marshal(m)
	if !bytes.Equal(j1, j2) {
		t.Fatalf("protojson %s, want %s", j1, j2)
	}
	data, err := encoding.GetCodecV2(grpcproto.Name).Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	if got := data.Materialize(); !bytes.Equal(got, want) {
		t.Fatalf("gRPC's proto codec marshaled %x, want %x", got, want)
	}
}

// watchService sends each request's client its pre-encoded responses and
// one plain response.
type watchService struct {
	pb.UnimplementedWatchServer
	encoded []*Encoded
	plain   *pb.WatchResponse
}

func (s *watchService) Watch(gs pb.Watch_WatchServer) error {
	for {
		if _, err := gs.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		for _, e := range s.encoded {
			if err := gs.SendMsg(e); err != nil {
				return err
			}
		}
		if err := gs.Send(s.plain); err != nil {
			return err
		}
	}
}

// payloadLog records the payloads the logging interceptor reports, in
// JSON as server/grpc.go logs them.
type payloadLog struct {
	mu   sync.Mutex
	sent [][]byte
}

func (l *payloadLog) PostCall(error, time.Duration)               {}
func (l *payloadLog) PostMsgReceive(any, error, time.Duration)    {}
func (l *payloadLog) PostMsgSend(p any, _ error, _ time.Duration) { l.record(p) }

func (l *payloadLog) record(p any) {
	m, ok := p.(proto.Message)
	if !ok {
		return
	}
	b, _ := protojson.Marshal(m)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sent = append(l.sent, b)
}

// countingStream counts the messages sent, as the server's grpc_server_*
// metrics do: every SendMsg, whatever the message.
type countingStream struct {
	grpc.ServerStream
	sent *atomic.Int64
}

func (c countingStream) SendMsg(m any) error {
	err := c.ServerStream.SendMsg(m)
	c.sent.Add(1)
	return err
}

// TestServerSendsEncodedThroughInterceptors: a gRPC server with the codec
// and interceptors like the proxy's (message counting, payload logging)
// sends a pre-encoded response, of pieces or of slices, or sent once with
// its own bytes pooled, as the client expects it, counts it, and logs it
// as the message it stands for; the pool has its buffers back once the
// responses are written.
func TestServerSendsEncodedThroughInterceptors(t *testing.T) {
	encodedMsg := sampleResponse()
	b, e := encodedInPieces(t, encodedMsg)
	half := len(b) / 2
	fromSlices := NewEncodedSlices(watchResponseType, [][]byte{b[:half], b[half:]})
	plain := &pb.WatchResponse{Header: &pb.ResponseHeader{Revision: 43}, WatchId: -1}

	var sent atomic.Int64
	count := func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		return handler(srv, countingStream{ServerStream: ss, sent: &sent})
	}
	log := &payloadLog{}
	gs := grpc.NewServer(ServerOption(),
		grpc.ChainStreamInterceptor(count, interceptors.StreamServerInterceptor(interceptors.CommonReportableFunc(func(ctx context.Context, c interceptors.CallMeta) (interceptors.Reporter, context.Context) {
			return log, ctx
		}))))
	pb.RegisterWatchServer(gs, &watchService{encoded: []*Encoded{e, fromSlices}, plain: plain})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	defer func() {
		gs.Stop()
		if err := <-served; err != nil {
			t.Error(err)
		}
	}()

	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ws, err := pb.NewWatchClient(conn).Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const rounds = 3
	for range rounds {
		if err := ws.Send(&pb.WatchRequest{}); err != nil {
			t.Fatal(err)
		}
		for _, want := range []*pb.WatchResponse{encodedMsg, encodedMsg, plain} {
			got, err := ws.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, want) {
				t.Fatalf("received %v, want %v", got, want)
			}
		}
	}
	if err := ws.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := ws.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("the stream ended with %v, want EOF", err)
	}

	if got := sent.Load(); got != 3*rounds {
		t.Fatalf("counted %d messages sent, want %d", got, 3*rounds)
	}
	wantLog, _ := protojson.Marshal(encodedMsg)
	log.mu.Lock()
	defer log.mu.Unlock()
	if len(log.sent) != 3*rounds || !bytes.Equal(log.sent[0], wantLog) || !bytes.Equal(log.sent[1], wantLog) {
		t.Fatalf("logged %d payloads, the first %s; want %d, the first two %s", len(log.sent), log.sent[0], 3*rounds, wantLog)
	}
}

// TestEncodedSlices: a message made of slices encodes as their
// concatenation, any number of times, each piece a slice itself (not a
// copy), and costs two allocations however many pieces it has: the
// Encoded and its slots.
func TestEncodedSlices(t *testing.T) {
	m := sampleResponse()
	want, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 3, inlinePieces, inlinePieces + 1, len(want)} {
		var b [][]byte
		for i := range n {
			b = append(b, want[i*len(want)/n:(i+1)*len(want)/n])
		}
		e := NewEncodedSlices(watchResponseType, b)
		if e.Len() != len(want) || !bytes.Equal(e.Bytes(), want) || !proto.Equal(e, m) {
			t.Fatalf("%d slices: encoded %x, want %x", n, e.Bytes(), want)
		}
		for range 3 {
			data, err := Codec().Marshal(e)
			if err != nil || !bytes.Equal(data.Materialize(), want) {
				t.Fatalf("%d slices: codec: %v", n, err)
			}
			for i, piece := range data {
				if unsafe.SliceData(piece.ReadOnlyData()) != unsafe.SliceData(b[i]) {
					t.Fatalf("%d slices: piece %d is a copy", n, i)
				}
			}
			data.Free() // what gRPC does once it has written it
		}
	}
	b := make([][]byte, 100)
	for i := range b {
		b[i] = want
	}
	if allocs := testing.AllocsPerRun(10, func() { NewEncodedSlices(watchResponseType, b) }); allocs > 2 {
		t.Fatalf("%v allocations for 100 slices; want 2", allocs)
	}
}

// recordingPool is a pool whose buffers the test follows.
type recordingPool struct {
	mem.BufferPool
	mu  sync.Mutex
	got map[*[]byte]bool // handed out and not given back
	put int              // given back
}

func (p *recordingPool) Get(n int) *[]byte {
	buf := p.BufferPool.Get(n)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.got[buf] = true
	return buf
}

func (p *recordingPool) Put(buf *[]byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.got[buf] {
		panic("a buffer the pool did not hand out, or given back twice")
	}
	delete(p.got, buf)
	p.put++
	p.BufferPool.Put(buf)
}

// outstanding is how many buffers are handed out and not given back.
func (p *recordingPool) outstanding() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.got)
}

// recordOwnBuffers makes ownBuffers a recordingPool until the test ends.
func recordOwnBuffers(t *testing.T) *recordingPool {
	p := &recordingPool{BufferPool: ownBuffers, got: map[*[]byte]bool{}}
	old := ownBuffers
	ownBuffers = p
	t.Cleanup(func() { ownBuffers = old })
	return p
}

// onceMessage is NewEncodedOnce of m's encoding: its first and last
// thirds copied into own, the middle one a slice of memory of its own.
func onceMessage(t *testing.T, m proto.Message) ([]byte, *Encoded) {
	t.Helper()
	want, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	third := len(want) / 3
	e, err := NewEncodedOnce(m.ProtoReflect().Type(), len(want)-third, func(own []byte) ([][]byte, error) {
		own = append(own, want[:third]...)
		head := own[:third:third]
		own = append(own, want[2*third:]...)
		return [][]byte{head, want[third : 2*third], own[third:]}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return want, e
}

// bigResponse is a watch response of more than the pooling threshold.
func bigResponse() *pb.WatchResponse {
	r := sampleResponse()
	r.Events[0].Kv.Value = bytes.Repeat([]byte("v"), 10_000)
	return r
}

// TestEncodedOnce: a message of own bytes and other slices encodes as
// their concatenation; own, from the pool, goes back to it once gRPC has
// freed the message's pieces, not before; a fill that fails gives it back
// at once; a small one is not pooled.
func TestEncodedOnce(t *testing.T) {
	pool := recordOwnBuffers(t)
	want, e := onceMessage(t, bigResponse())
	if e.Len() != len(want) || !bytes.Equal(e.Bytes(), want) || !proto.Equal(e, bigResponse()) {
		t.Fatalf("encoded %d bytes, want %d", e.Len(), len(want))
	}
	data, err := Codec().Marshal(e)
	if err != nil || !bytes.Equal(data.Materialize(), want) {
		t.Fatalf("codec: %v", err)
	}
	if pool.outstanding() != 1 {
		t.Fatalf("%d own buffers out before the message was freed; want 1", pool.outstanding())
	}
	data.Ref() // as the transport does while it writes
	data.Free()
	if pool.outstanding() != 1 {
		t.Fatal("own went back to the pool while the transport still held the message")
	}
	data.Free()
	if pool.outstanding() != 0 || pool.put != 1 {
		t.Fatalf("%d own buffers out, %d given back, once the message was freed; want 0 and 1", pool.outstanding(), pool.put)
	}

	boom := errors.New("boom")
	if _, err := NewEncodedOnce(watchResponseType, 5000, func([]byte) ([][]byte, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Fatalf("fill's error: %v", err)
	}
	if pool.outstanding() != 0 || pool.put != 2 {
		t.Fatalf("a failed fill left %d own buffers out", pool.outstanding())
	}
	want, e = onceMessage(t, sampleResponse())
	if !bytes.Equal(e.Bytes(), want) || pool.outstanding() != 0 {
		t.Fatalf("small: encoded %x, %d own buffers out", e.Bytes(), pool.outstanding())
	}
}

// TestServerSendsEncodedOnceUnary: a unary call's response sent once with
// its own bytes pooled reaches the client whole, is logged by a unary
// interceptor (before gRPC writes it) as the message it stands for, and
// gives its buffer back to the pool once written.
func TestServerSendsEncodedOnceUnary(t *testing.T) {
	pool := recordOwnBuffers(t)
	msg := &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: 9}, Kvs: []*mvccpb.KeyValue{{Key: []byte("k"), Value: bytes.Repeat([]byte("v"), 5000)}}, Count: 1}
	log := &payloadLog{}
	gs := grpc.NewServer(ServerOption(), grpc.ChainUnaryInterceptor(interceptors.UnaryServerInterceptor(interceptors.CommonReportableFunc(func(ctx context.Context, c interceptors.CallMeta) (interceptors.Reporter, context.Context) {
		return log, ctx
	}))))
	desc := grpc.ServiceDesc{
		ServiceName: "etcdserverpb.KV",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Range", Handler: func(_ any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			if err := dec(new(pb.RangeRequest)); err != nil {
				return nil, err
			}
			handler := func(context.Context, any) (any, error) {
				_, e := onceMessage(t, msg)
				return e, nil
			}
			return interceptor(ctx, nil, &grpc.UnaryServerInfo{FullMethod: pb.KV_Range_FullMethodName}, handler)
		}}},
	}
	gs.RegisterService(&desc, struct{}{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const calls = 3
	for range calls {
		got, err := pb.NewKVClient(conn).Range(ctx, &pb.RangeRequest{Key: []byte("k")})
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(got, msg) {
			t.Fatalf("received %v, want %v", got, msg)
		}
	}
	conn.Close()
	gs.Stop()
	if err := <-served; err != nil {
		t.Error(err)
	}
	wantLog, _ := protojson.Marshal(msg)
	log.mu.Lock()
	defer log.mu.Unlock()
	if len(log.sent) != calls || !bytes.Equal(log.sent[0], wantLog) {
		t.Fatalf("logged %d payloads, the first %s; want %d, %s", len(log.sent), log.sent[0], calls, wantLog)
	}
	if pool.outstanding() != 0 || pool.put != calls {
		t.Fatalf("%d own buffers out, %d given back, after %d calls", pool.outstanding(), pool.put, calls)
	}
}
