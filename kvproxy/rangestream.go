package kvproxy

import (
	"bytes"
	"errors"
	"io"
	"math"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/internal/kvcheck"
	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// Chunking constants of etcd's RangeStream (server/etcdserver/v3_server.go).
const (
	initialStreamChunkLimit = 10
	// streamChunkTargetBytes is etcd's default --max-request-bytes, which
	// etcd uses as the target chunk size.
	streamChunkTargetBytes = 1.5 * 1024 * 1024
)

// RangeStream serves etcd 3.7's chunked Range from the store when Range
// would be, chunking exactly as etcd does; otherwise it relays etcd's stream.
func (s *Server) RangeStream(r *pb.RangeRequest, stream grpc.ServerStreamingServer[pb.RangeStreamResponse]) error {
	ctx := stream.Context()
	if err := s.checkLeader(ctx); err != nil {
		return err
	}
	if err := checkRangeStreamRequest(r); err != nil {
		return err
	}
	// A refusal comes first: a relay below must not run for a caller etcd
	// would refuse (it would run with the proxy's connection).
	if err := s.gate.AuthorizeRead(ctx, r.Key, r.RangeEnd, !r.Serializable); err != nil && !errors.Is(err, gate.ErrAskEtcd) {
		s.observe(ctx, sourceRejected, reasonAuth)
		return err
	}
	rules := s.rules()
	var rt route
	switch {
	case !rules.known:
		rt = forwarded(reasonVersionUnknown)
	case !rules.rangeStream:
		// Before 3.7 etcd has no RangeStream; let it say so.
		rt = forwarded(reasonRangeStream)
	default:
		rt = s.route(ctx, r, rules)
	}
	if rt.action != serveFromCache {
		release, err := s.settle(ctx, rt)
		if err != nil {
			return err
		}
		defer release()
		if r.Serializable {
			// The answer's revision comes with its last chunk, after
			// the others were relayed: too late to ask again if a
			// lagging member answered below what the proxy served
			// (forwardRange). A linearizable read never is below it,
			// and is a valid answer to a serializable one.
			r = proto.Clone(r).(*pb.RangeRequest)
			r.Serializable = false
		}
		return s.relayRangeStream(r, stream)
	}
	return s.rangeStreamFromView(rt, r, rules.opts, stream)
}

// rangeStreamFromView serves a RangeStream from the route's view, chunking
// as etcd does. Each chunk holds room under the bound of cached read bytes
// while it is built and sent. The request is counted once its first chunk
// is admitted, or refused.
func (s *Server) rangeStreamFromView(rt route, req *pb.RangeRequest, opts revtree.RangeOptions, stream grpc.ServerStreamingServer[pb.RangeStreamResponse]) error {
	view := rt.view
	r := proto.Clone(req).(*pb.RangeRequest)
	if r.CountOnly {
		s.observe(stream.Context(), sourceCache, rt.reason)
		resp := view.Range(r, opts)
		out := &pb.RangeResponse{Header: &pb.ResponseHeader{Revision: resp.Header.Revision}, Count: resp.Count}
		s.follower.FillHeader(out.Header)
		return stream.Send(&pb.RangeStreamResponse{RangeResponse: out})
	}
	ctx := stream.Context()
	totalLimit := r.Limit
	if totalLimit == 0 {
		totalLimit = math.MaxInt64
	}
	r.Limit = min(int64(initialStreamChunkLimit), totalLimit)
	var count int64
	for first := true; ; first = false {
		held, err := s.admitCached(ctx, view, r, opts)
		switch {
		case first && err != nil:
			s.observe(ctx, sourceRejected, reasonMemory)
			return err
		case first:
			s.observe(ctx, sourceCache, rt.reason)
		case err != nil:
			return err
		}
		chunk := view.Result(r, opts)
		size := chunk.Size()
		if held, err = s.fitCached(ctx, held, size, chunk.Len()); err != nil {
			return err
		}
		count += int64(chunk.Len())
		var nextKey []byte
		more := chunk.More
		if more {
			nextKey = append(bytes.Clone(chunk.LastKey()), 0)
		}
		// A chunk holds key-values only; the last one, the header and
		// the count and more of the whole range.
		chunk.Header, chunk.More, chunk.Count = nil, false, 0
		done := !more || count == totalLimit
		if done {
			chunk.Header = &pb.ResponseHeader{Revision: view.StoreRev}
			s.follower.FillHeader(chunk.Header)
			chunk.More = more
			chunk.Count = count
			if more {
				rest := view.Range(&pb.RangeRequest{Key: nextKey, RangeEnd: r.RangeEnd, CountOnly: true}, opts)
				chunk.Count += rest.Count
			}
		}
		err = s.sendChunk(stream, chunk)
		s.releaseCached(held)
		if err != nil || done {
			return err
		}
		r.Key = nextKey
		r.Limit = min(adjustChunkLimit(r.Limit, size, streamChunkTargetBytes), totalLimit-count)
	}
}

// sendChunk sends a chunk of the range: its range_response field's tag
// and length, then the chunk in pieces of the store's bytes (see
// rangeMessage). Its own bytes are not pooled (wirecodec.NewEncodedOnce):
// a stream's interceptors see a message after SendMsg, when gRPC may have
// written it already (the payload logger decodes it then).
func (s *Server) sendChunk(stream grpc.ServerStream, chunk *revtree.Result) error {
	field := protowire.AppendTag(nil, rangeStreamResponseField, protowire.BytesType)
	field = protowire.AppendVarint(field, uint64(chunk.Size()))
	pieces, err := chunk.AppendPieces([][]byte{field}, nil)
	if err != nil {
		return status.Errorf(codes.Internal, "etcd-snapcache: encoding a range stream response: %v", err)
	}
	return stream.SendMsg(wirecodec.NewEncodedSlices(rangeStreamResponseType, pieces))
}

// rangeStreamResponseField is RangeStreamResponse's range_response.
const rangeStreamResponseField = 1

var rangeStreamResponseType = (&pb.RangeStreamResponse{}).ProtoReflect().Type()

// adjustChunkLimit is etcd's: double or halve the chunk outside [0.5x, 2x]
// of the target size, never below 1.
func adjustChunkLimit(lastLimit int64, lastSize, targetSize int) int64 {
	switch {
	case lastSize < targetSize/2:
		lastLimit *= 2
	case lastSize > targetSize*2:
		lastLimit /= 2
	}
	return max(lastLimit, 1)
}

// relayRangeStream relays etcd's answer to r, chunk for chunk.
func (s *Server) relayRangeStream(r *pb.RangeRequest, stream grpc.ServerStreamingServer[pb.RangeStreamResponse]) error {
	up, err := s.upstream.RangeStream(stream.Context(), r)
	if err != nil {
		return err
	}
	for {
		resp, err := up.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
}

// checkRangeStreamRequest is etcd's validation of a RangeStream request:
// Range's, then no custom order and no revision filters.
func checkRangeStreamRequest(r *pb.RangeRequest) error {
	if err := kvcheck.Range(r); err != nil {
		return err
	}
	if !revtree.KeyOrdered(r) {
		return status.Errorf(codes.Unimplemented, "RangeStream does not support custom sort orders")
	}
	if revtree.HasRevisionFilters(r) {
		return status.Errorf(codes.Unimplemented, "RangeStream does not support revision filters")
	}
	return nil
}
