package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// TestRequireLeader: when the upstream member loses its leader, a watch
// stream with hasleader metadata (kube-apiserver's) ends with Unavailable
// "etcdserver: no leader", new ones and reads requiring a leader are refused
// the same way, as etcd does; streams without the metadata stay. A
// three-member cluster loses its leader when two members stop.
func TestRequireLeader(t *testing.T) {
	members := startCluster(t, 3)
	p := servertest.StartProxy(t, servertest.Config("http://"+members[0].e.Clients[0].Addr().String(), func(cfg *server.Config) {
		cfg.Logger = zaptest.NewLogger(t)
	}))
	cli := newClient(t, p.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	open := func(ctx context.Context) pb.Watch_WatchClient {
		ws, err := pb.NewWatchClient(cli.ActiveConnection()).Watch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// A refused stream may end before the create is sent (io.EOF);
		// Recv then says why.
		if err := ws.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{Key: []byte("k")}}}); err != nil && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		return ws
	}
	leader := open(clientv3.WithRequireLeader(ctx))
	plain := open(ctx)
	for _, ws := range []pb.Watch_WatchClient{leader, plain} {
		if resp, err := ws.Recv(); err != nil || !resp.Created {
			t.Fatalf("create: %v, %v", resp, err)
		}
	}

	members[1].stop()
	members[2].stop()
	if _, err := leader.Recv(); !sameStatus(err, rpctypes.ErrGRPCNoLeader) || status.Code(err) != codes.Unavailable {
		t.Fatalf("hasleader watch after the leader was lost: %v, want %v", err, rpctypes.ErrGRPCNoLeader)
	}
	if _, err := open(clientv3.WithRequireLeader(ctx)).Recv(); !sameStatus(err, rpctypes.ErrGRPCNoLeader) {
		t.Fatalf("new hasleader watch without a leader: %v", err)
	}
	kv := pb.NewKVClient(cli.ActiveConnection())
	if _, err := kv.Range(clientv3.WithRequireLeader(ctx), &pb.RangeRequest{Key: []byte("k"), Serializable: true}); !sameStatus(err, rpctypes.ErrGRPCNoLeader) {
		t.Fatalf("hasleader read without a leader: %v", err)
	}
	// Without the metadata, a serializable read is still served.
	if _, err := kv.Range(ctx, &pb.RangeRequest{Key: []byte("k"), Serializable: true}); err != nil {
		t.Fatalf("serializable read without hasleader: %v", err)
	}
	plain.CloseSend()
}

func sameStatus(err, want error) bool {
	return status.Code(err) == status.Code(want) && status.Convert(err).Message() == status.Convert(want).Message()
}

// member is an embedded etcd that can be stopped before the test ends
// (embed.Etcd.Close must not be called twice).
type member struct {
	e    *embed.Etcd
	once sync.Once
}

func (m *member) stop() { m.once.Do(m.e.Close) }

// startCluster starts an n-member etcd cluster in this process with short
// election timeouts.
func startCluster(t *testing.T, n int) []*member {
	t.Helper()
	cfgs := make([]*embed.Config, n)
	var initial string
	for i := range cfgs {
		cfg := embed.NewConfig()
		cfg.Name = fmt.Sprintf("m%d", i)
		cfg.Dir = t.TempDir()
		curl, _ := url.Parse("http://" + testsupport.FreeAddr(t))
		purl, _ := url.Parse("http://" + testsupport.FreeAddr(t))
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*curl}, []url.URL{*curl}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*purl}, []url.URL{*purl}
		cfg.TickMs, cfg.ElectionMs = 20, 200
		cfg.LogLevel = "error"
		if initial != "" {
			initial += ","
		}
		initial += cfg.Name + "=" + purl.String()
		cfgs[i] = cfg
	}
	members := make([]*member, n)
	for i, cfg := range cfgs {
		cfg.InitialCluster = initial
		e, err := embed.StartEtcd(cfg)
		if err != nil {
			t.Fatal(err)
		}
		m := &member{e: e}
		t.Cleanup(m.stop)
		members[i] = m
	}
	for _, m := range members {
		select {
		case <-m.e.Server.ReadyNotify():
		case <-time.After(time.Minute):
			t.Fatal("cluster not ready")
		}
	}
	return members
}
