package watchproxy

import (
	"context"
	"fmt"
	"testing"

	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/internal/wirecodec"
	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// discardStream encodes what is sent, with the server's codec, and drops
// it: the send loop's cost without a transport.
type discardStream struct {
	pb.Watch_WatchServer
	ctx   context.Context
	codec encoding.CodecV2
}

func (d *discardStream) Context() context.Context       { return d.ctx }
func (d *discardStream) Send(r *pb.WatchResponse) error { return d.SendMsg(r) }
func (d *discardStream) SendMsg(m any) error {
	data, err := d.codec.Marshal(m)
	data.Free()
	return err
}

// BenchmarkSendEvents: the send loop's cost of one event, with a 1 KiB
// value and a 1 KiB prev_kv, to each of 100 prefix watchers of a stream:
// "legacy" marshals a response per watcher (proto codec), "encoded" sends
// the revision's shared encoding (wirecodec). Reported per event sent.
func BenchmarkSendEvents(b *testing.B) {
	const watchers = 100
	for _, legacy := range []bool{true, false} {
		name := "encoded"
		if legacy {
			name = "legacy"
		}
		b.Run(name, func(b *testing.B) {
			store := revtree.New(0)
			store.Reset(1, []*mvccpb.KeyValue{{Key: []byte("/p/k"), Value: make([]byte, 1024), CreateRevision: 1, ModRevision: 1, Version: 1}}, 0)
			srv := New(testConfig(store, newFakeFollower(store)))
			defer srv.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			st := newStream(srv, &discardStream{ctx: ctx, codec: wirecodec.Codec()}, nil)
			defer st.cancel()
			for range watchers {
				if err := st.create(&pb.WatchCreateRequest{Key: []byte("/p/"), RangeEnd: []byte("/p0"), PrevKv: true}); err != nil {
					b.Fatal(err)
				}
			}
			prev := &mvccpb.KeyValue{Key: []byte("/p/k"), Value: make([]byte, 1024), CreateRevision: 1, ModRevision: 1, Version: 1}
			for i := range b.N {
				rev := int64(i) + 2
				kv := &mvccpb.KeyValue{Key: []byte("/p/k"), Value: []byte(fmt.Sprintf("%01024d", i)), CreateRevision: 1, ModRevision: rev, Version: rev}
				if _, err := store.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv, PrevKv: proto.Clone(prev).(*mvccpb.KeyValue)}}); err != nil {
					b.Fatal(err)
				}
				prev = kv
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				rev := int64(i) + 2
				batches, _, err := store.EventsFrom(rev, rev, 1)
				if err != nil {
					b.Fatal(err)
				}
				encs := make([]*revEvents, len(batches))
				for _, w := range st.watchers {
					if legacy {
						w.nextRev = rev + 1
						err = st.sendWatcherEvents(w, w.matching(nil, batches[0].Events, 0), rev)
					} else {
						err = st.sendEvents(w, batches, encs, rev)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				st.headerField = nil // a pass per revision
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*watchers), "ns/event")
		})
	}
}
