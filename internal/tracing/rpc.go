package tracing

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// rpcTracer runs otelgrpc's stats handlers from interceptors, and only for
// the RPCs that may be sampled: a served RPC whose caller sent a sampled
// trace context, or none while traces begun at the proxy are sampled
// (serverMaySample); a call to etcd made in a sampled span. Installed as
// stats handlers, as etcd installs them, they would make gRPC build its
// per-RPC stats events (the headers and trailers copied, the payloads
// described) for every RPC, sampled or not: about 25 allocations a cached
// Get with tracing on at rate 0, where nothing is recorded. The RPCs it
// skips cost one check, and keep their caller's trace context, which
// package server forwards, as with tracing off. The spans are otelgrpc's:
// their names, attributes, status and the trace context written to etcd.
type rpcTracer struct {
	server, client  stats.Handler
	serverMaySample func(ctx context.Context) bool
}

func (r rpcTracer) unaryServer(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !r.serverMaySample(ctx) {
		return handler(ctx, req)
	}
	ctx, end := r.serve(ctx, info.FullMethod)
	resp, err := handler(ctx, req)
	end(err)
	return resp, err
}

func (r rpcTracer) streamServer(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if !r.serverMaySample(ss.Context()) {
		return handler(srv, ss)
	}
	ctx, end := r.serve(ss.Context(), info.FullMethod)
	err := handler(srv, tracedServerStream{ss, ctx})
	end(err)
	return err
}

// serve begins the server span of a served RPC; end ends it with the
// RPC's error.
func (r rpcTracer) serve(ctx context.Context, method string) (_ context.Context, end func(error)) {
	begin := time.Now()
	ctx = r.server.TagRPC(ctx, &stats.RPCTagInfo{FullMethodName: method})
	if p, ok := peer.FromContext(ctx); ok && p.LocalAddr != nil {
		r.server.HandleRPC(ctx, &stats.InHeader{FullMethod: method, LocalAddr: p.LocalAddr, RemoteAddr: p.Addr})
	}
	return ctx, func(err error) {
		r.server.HandleRPC(ctx, &stats.End{BeginTime: begin, EndTime: time.Now(), Error: err})
	}
}

// tracedServerStream is a served stream whose context carries its span.
type tracedServerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s tracedServerStream) Context() context.Context { return s.ctx }

func (r rpcTracer) unaryClient(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if !inSampledSpan(ctx) {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	ctx, end := r.call(ctx, method)
	var p peer.Peer
	err := invoker(ctx, method, req, reply, cc, append(opts[:len(opts):len(opts)], grpc.Peer(&p))...)
	end(&p, err)
	return err
}

func (r rpcTracer) streamClient(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if !inSampledSpan(ctx) {
		return streamer(ctx, desc, cc, method, opts...)
	}
	ctx, end := r.call(ctx, method)
	cs, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		end(nil, err)
		return nil, err
	}
	ts := &tracedClientStream{ClientStream: cs, oneAnswer: !desc.ServerStreams}
	var once sync.Once
	ts.end = func(err error) {
		once.Do(func() {
			p, _ := peer.FromContext(cs.Context())
			end(p, err)
		})
	}
	// A stream its caller abandons (its context canceled) may never be
	// read to its end. (AfterFunc runs at once, on its own goroutine, if
	// ctx is done already: ts.end is set before.)
	ts.stop = context.AfterFunc(ctx, func() { ts.end(status.FromContextError(ctx.Err()).Err()) })
	return ts, nil
}

// call begins the client span of a call to etcd, writing its trace context
// to the call's metadata; end ends it with the call's peer and error.
func (r rpcTracer) call(ctx context.Context, method string) (_ context.Context, end func(*peer.Peer, error)) {
	begin := time.Now()
	ctx = r.client.TagRPC(ctx, &stats.RPCTagInfo{FullMethodName: method})
	return ctx, func(p *peer.Peer, err error) {
		if p != nil && p.Addr != nil {
			r.client.HandleRPC(ctx, &stats.OutHeader{Client: true, FullMethod: method, RemoteAddr: p.Addr})
		}
		r.client.HandleRPC(ctx, &stats.End{Client: true, BeginTime: begin, EndTime: time.Now(), Error: err})
	}
}

// tracedClientStream ends its call's span when the stream ends: with the
// error its reader gets, at its end, or once it answered when it answers
// once.
type tracedClientStream struct {
	grpc.ClientStream
	oneAnswer bool
	end       func(error) // ends the span, once
	stop      func() bool // stops the span's end at the context's
}

func (s *tracedClientStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	switch {
	case errors.Is(err, io.EOF):
		s.finish(nil)
	case err != nil:
		s.finish(err)
	case s.oneAnswer:
		s.finish(nil)
	}
	return err
}

func (s *tracedClientStream) finish(err error) {
	s.stop()
	s.end(err)
}
