package server

import (
	"context"
	"hash/fnv"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/etcd-snapcache/etcd-snapcache/gate"
	"github.com/etcd-snapcache/etcd-snapcache/internal/drain"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// forwardedMetadata are the request metadata etcd acts on: the caller's
// credentials (gate.TokenKeys), its demand for a leader, and its W3C trace
// context and baggage (traceContextKeys). They travel with every forwarded
// call.
var forwardedMetadata = append(slices.Clone(gate.TokenKeys), append([]string{rpctypes.MetadataRequireLeaderKey}, traceContextKeys...)...)

// traceContextKeys are the metadata of the W3C trace context and baggage,
// as otelgrpc's propagators (kube-apiserver's etcd client, etcd's server)
// write and read them: with them, etcd's spans of a forwarded call join
// its caller's trace, as they do when the caller reaches etcd directly.
var traceContextKeys = []string{"traceparent", "tracestate", "baggage"}

// withCallerMetadata copies the caller's forwarded metadata from an incoming
// server context to the outgoing context of an upstream call.
func withCallerMetadata(ctx context.Context) context.Context {
	in, ok := metadata.FromIncomingContext(ctx)
	if !ok {
		return ctx
	}
	out, _ := metadata.FromOutgoingContext(ctx)
	out = out.Copy()
	copied := false
	for _, k := range forwardedMetadata {
		if v := in.Get(k); len(v) > 0 {
			out.Set(k, v...)
			copied = true
		}
	}
	if !copied {
		return ctx
	}
	return metadata.NewOutgoingContext(ctx, out)
}

// atLeader are the unary methods etcd answers at its leader: raft
// proposals (writes, compaction, lease grants and revokes, alarms,
// downgrades, member changes; the Auth service's methods are all
// proposals), and the calls a follower forwards to its leader or refuses
// (lease lookups, MoveLeader). They go to the leader directly
// (drain.ToLeader), so that a follower that hangs or is being
// defragmented does not hold a call its leader can answer.
var atLeader = map[string]bool{
	"/etcdserverpb.KV/Put":                 true,
	"/etcdserverpb.KV/DeleteRange":         true,
	"/etcdserverpb.KV/Txn":                 true,
	"/etcdserverpb.KV/Compact":             true,
	"/etcdserverpb.Lease/LeaseGrant":       true,
	"/etcdserverpb.Lease/LeaseRevoke":      true,
	"/etcdserverpb.Lease/LeaseTimeToLive":  true,
	"/etcdserverpb.Lease/LeaseLeases":      true,
	"/etcdserverpb.Cluster/MemberAdd":      true,
	"/etcdserverpb.Cluster/MemberRemove":   true,
	"/etcdserverpb.Cluster/MemberUpdate":   true,
	"/etcdserverpb.Cluster/MemberPromote":  true,
	"/etcdserverpb.Maintenance/Alarm":      true,
	"/etcdserverpb.Maintenance/Downgrade":  true,
	"/etcdserverpb.Maintenance/MoveLeader": true,
}

func answeredAtLeader(method string) bool {
	return atLeader[method] || strings.HasPrefix(method, "/etcdserverpb.Auth/")
}

func forwardUnaryMetadata(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if answeredAtLeader(method) {
		ctx = drain.ToLeader(ctx)
	}
	return invoker(withCallerMetadata(ctx), method, req, reply, cc, opts...)
}

func forwardStreamMetadata(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return streamer(withCallerMetadata(ctx), desc, cc, method, opts...)
}

// lender sends a call marked asProxy (a request this proxy checked for a
// certificate caller) on the connection of the proxy's own identity
// (--user) instead of the forwarding one, whose interceptors it is. Without
// --user there is none: the forwarding connection is that identity, its
// client certificate's.
type lender struct{ own *grpc.ClientConn }

func (l *lender) unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if gate.IsAsProxy(ctx) {
		return l.own.Invoke(ctx, method, req, reply, opts...)
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

func (l *lender) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if gate.IsAsProxy(ctx) {
		return l.own.NewStream(ctx, desc, method, opts...)
	}
	return streamer(ctx, desc, cc, method, opts...)
}

// clusterServer forwards the Cluster service, except MemberList, which
// follows grpc-proxy: with an advertised client URL, it names the proxy as
// the only member, so that clients that sync their endpoints from the
// member list keep talking to the proxy; with none (an explicitly empty
// --advertise-client-url), it is forwarded, as member management tooling
// expects.
type clusterServer struct {
	pb.UnsafeClusterServer
	upstream pb.ClusterClient
	self     *pb.Member // nil: MemberList is forwarded
}

var _ pb.ClusterServer = (*clusterServer)(nil)

func newClusterServer(upstream pb.ClusterClient, name string, clientURLs []string) *clusterServer {
	c := &clusterServer{upstream: upstream}
	if len(clientURLs) > 0 {
		h := fnv.New64a()
		h.Write([]byte(strings.Join(clientURLs, ",")))
		c.self = &pb.Member{ID: h.Sum64(), Name: name, ClientURLs: clientURLs}
	}
	return c
}

func (c *clusterServer) MemberList(ctx context.Context, r *pb.MemberListRequest) (*pb.MemberListResponse, error) {
	resp, err := c.upstream.MemberList(ctx, r)
	if err != nil || c.self == nil {
		return resp, err
	}
	resp.Members = []*pb.Member{c.self}
	return resp, nil
}

func (c *clusterServer) MemberAdd(ctx context.Context, r *pb.MemberAddRequest) (*pb.MemberAddResponse, error) {
	return c.upstream.MemberAdd(ctx, r)
}

func (c *clusterServer) MemberRemove(ctx context.Context, r *pb.MemberRemoveRequest) (*pb.MemberRemoveResponse, error) {
	return c.upstream.MemberRemove(ctx, r)
}

func (c *clusterServer) MemberUpdate(ctx context.Context, r *pb.MemberUpdateRequest) (*pb.MemberUpdateResponse, error) {
	return c.upstream.MemberUpdate(ctx, r)
}

func (c *clusterServer) MemberPromote(ctx context.Context, r *pb.MemberPromoteRequest) (*pb.MemberPromoteResponse, error) {
	return c.upstream.MemberPromote(ctx, r)
}
