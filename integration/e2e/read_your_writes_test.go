//go:build cluster_proxy

package e2e

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/tests/v3/framework/e2e"
)

// TestSerializableReadAfterWriteAtStart is not one of etcd's tests. It
// isolates what etcd's ctl tests (putTest and its kin: a put, then `etcdctl
// get --consistency s` on the same one-member cluster) rely on: a
// serializable read sent through the proxy after a write acknowledged
// through it returns the write. It does so right after the cluster (and so
// the proxy) starts, when the window is widest, on several fresh clusters.
func TestSerializableReadAfterWriteAtStart(t *testing.T) {
	e2e.BeforeTest(t)
	for i := range 5 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			epc, err := e2e.NewEtcdProcessCluster(t.Context(), t, e2e.WithClusterSize(1))
			require.NoError(t, err)
			defer epc.Close()
			c := newClient(t, epc.EndpointsGRPC(), e2e.ClientConfig{})
			put, err := c.Put(t.Context(), "foo", "bar")
			require.NoError(t, err)
			get, err := c.Get(t.Context(), "foo", clientv3.WithSerializable())
			require.NoError(t, err)
			require.Lenf(t, get.Kvs, 1, "serializable Get after a Put acknowledged at revision %d: "+
				"header revision %d, no key", put.Header.Revision, get.Header.Revision)
			require.Equal(t, "bar", string(get.Kvs[0].Value))
		})
	}
}
