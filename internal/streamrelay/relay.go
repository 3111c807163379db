// Package streamrelay relays one bidirectional gRPC client stream to one
// upstream stream: the proxy's way of letting etcd answer a stream itself.
package streamrelay

import (
	"errors"
	"io"
)

// Upstream is the client side of an upstream bidirectional stream.
type Upstream[Req, Resp any] interface {
	Send(*Req) error
	Recv() (*Resp, error)
	CloseSend() error
}

// Downstream is the server side of a client's bidirectional stream.
type Downstream[Req, Resp any] interface {
	Recv() (*Req, error)
	Send(*Resp) error
}

// Relay relays down to up until either ends: requests up, responses down.
// A client's half-close is passed on, and responses keep flowing until
// etcd ends the stream. The upstream stream must run under the client
// stream's context, so that it ends with it.
//
// Its receive goroutine is owned by the client stream: it ends when Recv
// fails, which gRPC makes happen once the handler returns.
func Relay[Req, Resp any](up Upstream[Req, Resp], down Downstream[Req, Resp]) error {
	errc := make(chan error, 1)
	go func() {
		for {
			req, err := down.Recv()
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
		if err := down.Send(resp); err != nil {
			return err
		}
		select {
		case err := <-errc:
			return err
		default:
		}
	}
}
