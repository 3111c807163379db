package integration

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine a test starts, its embedded etcd's and proxy's included,
// must be gone when the tests end.
//
// One exception, etcd's own: its Lock and Election services run on an
// in-process client (etcdserver/api/v3client, over grpcproxy/adapter) that
// embed.Etcd.Close never closes, so the lease keepalive loops a Campaign or
// Lock starts on it outlive etcd. The proxy itself never uses clientv3's
// lessor: it forwards leases through raw gRPC stubs.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/server/v3/proxy/grpcproxy/adapter.newPipeStream.func1"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/server/v3/proxy/grpcproxy/adapter.(*chanStream).RecvMsg"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/client/v3.(*lessor).deadlineLoop"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/client/v3.(*lessor).sendKeepAliveLoop"),
	)
}
