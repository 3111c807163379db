package watchproxy

import (
	"errors"
	"io"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// relay relays one client stream to one upstream stream until either ends.
// The upstream call carries the client's metadata (auth token, hasleader)
// through the client connection's interceptors.
//
// Its receive goroutine is owned by the client stream: it ends when Recv
// fails, which gRPC makes happen once the handler returns.
func relay(upstream pb.WatchClient, stream pb.Watch_WatchServer) error {
	up, err := upstream.Watch(stream.Context())
	if err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() { // ends when the client stream ends or the call's context is done
		for {
			req, err := stream.Recv()
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = up.CloseSend()
					if err == nil {
						return // half-close: keep relaying responses
					}
				}
				errc <- err
				return
			}
			if err := up.Send(req); err != nil {
				errc <- err
				return
			}
		}
	}()
	for {
		resp, err := up.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
		select {
		case err := <-errc:
			return err
		default:
		}
	}
}
