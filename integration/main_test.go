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
// Lock starts on it outlive etcd. So does a watch stream that client opens
// for a Lock or an Observe whose caller gave up before the watch was sent:
// clientv3 then keeps the stream with no watcher on it until the client
// closes (its run loop, the in-process server's sendLoop, and the context
// watcher of its never-done valCtx). The proxy itself never uses clientv3's
// lessor or watcher: it forwards leases and watches through raw gRPC stubs,
// and a test client's leaked watcher would also leave its gRPC transport
// goroutines, which are not ignored.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/server/v3/proxy/grpcproxy/adapter.newPipeStream.func1"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/server/v3/proxy/grpcproxy/adapter.(*chanStream).RecvMsg"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/client/v3.(*lessor).deadlineLoop"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/client/v3.(*lessor).sendKeepAliveLoop"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/client/v3.(*watchGRPCStream).run"),
		goleak.IgnoreTopFunction("go.etcd.io/etcd/server/v3/etcdserver/api/v3rpc.(*serverWatchStream).sendLoop"),
		goleak.IgnoreTopFunction("context.(*cancelCtx).propagateCancel.func2"),
	)
}
