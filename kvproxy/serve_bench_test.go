package kvproxy

import (
	"bufio"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/internal/memlimit"
	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// BenchmarkServeRange measures Range served from the store over a real
// gRPC connection (loopback, plaintext), as the proxy serves it, to 4
// clients at once in another process, which only count the bytes they
// receive: the benchmark's allocations and CPU profile are the server's.
// 10k keys of 1 KiB (and of 128 B) are loaded at R, then 2000 single-key
// updates follow; the whole keyspace is read (linearizable) at R, a page
// of 500 at R, the whole keyspace at the head, and one key at the head.
// "written" applies the keys one revision each rather than loading them,
// as a proxy that followed their writes holds them (each an entry while
// history retains its event, a piece of its own); "churned" rewrites every
// key after the load and compacts (each a bare encoding of its own, a
// piece of its own if large enough). "limit=auto" runs under the automatic
// soft memory limit the
// server sets (internal/memlimit), "limit=off" without one. Beside ns/op
// (4 reads at a time), it reports the server's CPU per read, user and
// system (cpu-ms/op), and its collections per read (GCs/op).
func BenchmarkServeRange(b *testing.B) {
	for _, data := range []struct {
		name           string
		value, updates int
		written, churn bool
	}{
		{"value=1024", 1024, 2000, false, false},
		{"value=1024/written", 1024, 2000, true, false},
		{"value=128", 128, 2000, false, false},
		{"value=128/churned", 128, 0, false, true},
	} {
		env := newServeBenchEnv(b, 10_000, data.value, data.updates, data.written, data.churn)
		for _, limit := range []string{"off", "auto"} {
			for _, tc := range []struct {
				name string
				r    *pb.RangeRequest
			}{
				{"all", &pb.RangeRequest{Key: []byte("key/"), RangeEnd: []byte("key0"), Revision: env.rev}},
				{"limit=500", &pb.RangeRequest{Key: []byte("key/"), RangeEnd: []byte("key0"), Revision: env.rev, Limit: 500}},
				{"head", &pb.RangeRequest{Key: []byte("key/"), RangeEnd: []byte("key0")}},
				{"get", &pb.RangeRequest{Key: []byte("key/00004242")}},
			} {
				if data.churn && tc.r.Revision != 0 {
					continue // compacted
				}
				b.Run(fmt.Sprintf("%s/%s/limit=%s", data.name, tc.name, limit), func(b *testing.B) {
					if limit == "auto" {
						defer env.autoLimit()()
					}
					env.run(b, tc.r, 4)
				})
			}
		}
		env.close(b)
	}
}

// serveBenchEnv is BenchmarkServeRange's store and server.
type serveBenchEnv struct {
	store  *revtree.Store
	srv    *Server
	gs     *grpc.Server
	served chan error // Serve's return
	conn   *grpc.ClientConn
	addr   string
	rev    int64 // R: the load's
}

func newServeBenchEnv(b *testing.B, keys, valueSize, updates int, written, churn bool) *serveBenchEnv {
	b.Helper()
	store := revtree.New(0)
	rng := rand.New(rand.NewPCG(1, 2))
	value := func() []byte {
		v := make([]byte, valueSize)
		for i := range v {
			v[i] = byte('a' + rng.IntN(26))
		}
		return v
	}
	kvs := make([]*mvccpb.KeyValue, keys)
	for i := range kvs {
		kvs[i] = &mvccpb.KeyValue{Key: fmt.Appendf(nil, "key/%08d", i), Value: value(), CreateRevision: int64(i + 1), ModRevision: int64(i + 1), Version: 1}
	}
	rev := int64(keys)
	if written {
		store.Reset(0, nil, 0)
		for i, kv := range kvs {
			if _, err := store.Apply(int64(i+1), []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}); err != nil {
				b.Fatal(err)
			}
		}
	} else {
		store.Reset(rev, kvs, 0)
	}
	put := func(j int) {
		k := kvs[j]
		kv := &mvccpb.KeyValue{Key: k.Key, Value: value(), CreateRevision: k.CreateRevision, ModRevision: store.Rev() + 1, Version: k.Version + 1}
		if _, err := store.Apply(store.Rev()+1, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}); err != nil {
			b.Fatal(err)
		}
		kvs[j] = kv
	}
	for range updates {
		put(rng.IntN(keys))
	}
	if churn {
		for j := range keys {
			put(j)
		}
		store.Compact(store.Rev())
	}
	follower := &fakeFollower{serving: true, version: "3.7.3", store: store}
	srv := New(Config{
		Store:              store,
		Follower:           follower,
		Upstream:           &fakeKV{},
		FreshnessTimeout:   DefaultFreshnessTimeout,
		MaxForwardedReads:  DefaultMaxForwardedReads,
		MaxCachedReadBytes: DefaultMaxCachedReadBytes,
		Gate:               gate.Unchecked{},
	})
	gs := grpc.NewServer(wirecodec.ServerOption())
	Register(gs, srv)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(countingCodec{}), grpc.MaxCallRecvMsgSize(math.MaxInt32)))
	if err != nil {
		b.Fatal(err)
	}
	return &serveBenchEnv{store: store, srv: srv, gs: gs, served: served, conn: conn, addr: lis.Addr().String(), rev: rev}
}

func (env *serveBenchEnv) close(b *testing.B) {
	env.conn.Close()
	env.gs.Stop()
	if err := <-env.served; err != nil {
		b.Error(err)
	}
}

// autoLimit sets the automatic memory limit, as the server keeps it, until
// the function it returns is called.
func (env *serveBenchEnv) autoLimit() func() {
	t := &memlimit.Tracker{
		Policy: memlimit.Policy{FollowLive: true},
		Live: func() int64 {
			return env.store.ApproxBytes() + env.srv.CachedReadBytes()
		},
		Set: func(l int64) { debug.SetMemoryLimit(l) },
	}
	found := debug.SetMemoryLimit(-1)
	t.Start()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		t.Run(ctx)
	}()
	return func() {
		cancel()
		<-done
		debug.SetMemoryLimit(found)
	}
}

// run reads r b.N times from clients goroutines of a child process (the
// test binary again, serveBenchClient), so that the benchmark's
// allocations and CPU profile are the server's alone.
func (env *serveBenchEnv) run(b *testing.B, r *pb.RangeRequest, clients int) {
	req, err := proto.Marshal(r)
	if err != nil {
		b.Fatal(err)
	}
	var resp rawResponse
	if err := env.conn.Invoke(context.Background(), pb.KV_Range_FullMethodName, r, &resp); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(resp.n))
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(),
		"SERVE_BENCH_ADDR="+env.addr,
		"SERVE_BENCH_REQ="+hex.EncodeToString(req),
		"SERVE_BENCH_OPS="+strconv.Itoa(b.N),
		"SERVE_BENCH_CLIENTS="+strconv.Itoa(clients))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	// The child connects and reads once, then waits for a line on stdin.
	ready := make([]byte, 1)
	if _, err := io.ReadFull(stdout, ready); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	cpu := processCPU()
	b.ResetTimer()
	if _, err := stdin.Write([]byte("\n")); err != nil {
		b.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, stdout); err != nil {
		b.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	cpu = processCPU() - cpu
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(cpu.Microseconds())/1000/float64(b.N), "cpu-ms/op")
	b.ReportMetric(float64(after.NumGC-before.NumGC)/float64(b.N), "GCs/op")
}

// processCPU is the CPU time the process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// serveBenchClient is BenchmarkServeRange's client process, which
// TestMain runs instead of the tests when SERVE_BENCH_ADDR is set.
func serveBenchClient(addr string) error {
	reqBytes, _ := hex.DecodeString(os.Getenv("SERVE_BENCH_REQ"))
	r := &pb.RangeRequest{}
	if err := proto.Unmarshal(reqBytes, r); err != nil {
		return err
	}
	ops, _ := strconv.Atoi(os.Getenv("SERVE_BENCH_OPS"))
	clients, _ := strconv.Atoi(os.Getenv("SERVE_BENCH_CLIENTS"))
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(countingCodec{}), grpc.MaxCallRecvMsgSize(math.MaxInt32)))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx := context.Background()
	var resp rawResponse
	if err := conn.Invoke(ctx, pb.KV_Range_FullMethodName, r, &resp); err != nil {
		return err
	}
	if _, err := os.Stdout.Write([]byte("r")); err != nil {
		return err
	}
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return err
	}
	var wg sync.WaitGroup
	var next atomic.Int64
	var failed atomic.Pointer[error]
	for range clients {
		wg.Go(func() {
			var resp rawResponse
			for next.Add(1) <= int64(ops) {
				if err := conn.Invoke(ctx, pb.KV_Range_FullMethodName, r, &resp); err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := failed.Load(); err != nil {
		return *err
	}
	return nil
}

// rawResponse is a response the client does not decode.
type rawResponse struct{ n int }

// countingCodec marshals requests as protobuf and counts the bytes of
// responses (rawResponse) without decoding them.
type countingCodec struct{}

func (countingCodec) Marshal(v any) (mem.BufferSlice, error) {
	return encoding.GetCodecV2(grpcproto.Name).Marshal(v)
}

func (countingCodec) Unmarshal(data mem.BufferSlice, v any) error {
	v.(*rawResponse).n = data.Len()
	return nil
}

func (countingCodec) Name() string { return grpcproto.Name }
