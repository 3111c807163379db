package integration

import (
	"context"
	clientv3 "go.etcd.io/etcd/client/v3"
	"testing"
)

func TestProxyServesPutGet(t *testing.T) {
	c := newCluster(t, clusterOptions{})
	ctx := context.Background()
	put, err := c.viaProxy.Put(ctx, "a", "1")
	if err != nil {
		t.Fatal(err)
	}
	c.waitSynced(t)
	got, err := c.viaProxy.Get(ctx, "a", clientv3WithRev(put.Header.Revision))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "1" {
		t.Fatalf("got %v", got.Kvs)
	}
}

var clientv3WithRev = clientv3.WithRev
