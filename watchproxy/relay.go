package watchproxy

import (
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/streamrelay"
)

// relay lets etcd serve one client stream. The upstream call carries the
// client's metadata (auth token, hasleader) through the client
// connection's interceptors.
func relay(upstream pb.WatchClient, stream pb.Watch_WatchServer) error {
	up, err := upstream.Watch(stream.Context())
	if err != nil {
		return err
	}
	return streamrelay.Relay[pb.WatchRequest, pb.WatchResponse](up, stream)
}
