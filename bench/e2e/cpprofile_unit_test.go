package e2e

import (
	"testing"
	"time"
)

func TestClassifyTraces(t *testing.T) {
	out := `File: etcd
Type: cpu
Duration: 20s, Total samples = 100ms ( 0.5%)
-----------+-------------------------------------------------------
      30ms   go.etcd.io/bbolt.(*Cursor).seek
             go.etcd.io/etcd/server/v3/storage/mvcc.(*store).Range
             go.etcd.io/etcd/server/v3/etcdserver.(*EtcdServer).Range
             go.etcd.io/etcd/server/v3/etcdserver/api/v3rpc.(*kvServer).Range
             google.golang.org/grpc.(*Server).handleStream
-----------+-------------------------------------------------------
      20ms   go.etcd.io/etcd/server/v3/storage/mvcc.(*watchableStore).notify
             go.etcd.io/etcd/server/v3/storage/mvcc.(*watchableStoreTxnWrite).End
             go.etcd.io/etcd/server/v3/etcdserver.(*EtcdServer).applyAll
-----------+-------------------------------------------------------
      10ms   go.etcd.io/bbolt.(*Tx).Commit
             go.etcd.io/etcd/server/v3/storage/backend.(*batchTx).commit
-----------+-------------------------------------------------------
      1.5ms  golang.org/x/net/http2.(*Framer).ReadFrame
             google.golang.org/grpc/internal/transport.(*http2Server).HandleStreams
-----------+-------------------------------------------------------
      10ms   runtime.gcBgMarkWorker
-----------+-------------------------------------------------------
      28.5ms runtime.futex
-----------+-------------------------------------------------------
`
	by, total := classifyTraces(out)
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	want := map[string]time.Duration{"range": ms(30), "watch": ms(20), "apply": ms(10), "grpc": ms(1.5), "gc": ms(10), "other": ms(28.5), "grpc-send": 0}
	if total != ms(100) {
		t.Errorf("total %v, want 100ms", total)
	}
	for k, v := range want {
		if by[k] != v {
			t.Errorf("%s: %v, want %v (all: %v)", k, by[k], v, by)
		}
	}
}
