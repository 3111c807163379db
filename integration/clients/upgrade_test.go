package clients

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestRollingUpgrade: a three-member etcd 3.6 cluster is upgraded to 3.7
// one member at a time, then downgraded back to 3.6 by etcd's procedure
// (downgrade validate and enable, every member's storage version down to
// 3.6, then member by member), while clients write, read linearizably and
// watch through the proxy. The proxy follows throughout: it stays ready,
// its upstream watch resumes on another member at each restart without
// reloading the cache, no read fails, the watch misses nothing, and the
// release it reports is the cluster's: unknown while the members run
// different releases (each answers by its own), the new one once they
// agree. A keys-only read, whose answer differs between the releases
// (3.6 gives a key's lease, 3.7 reads the index and does not), gets
// through the proxy what one of the members gives while they differ, and
// what all of them give once they agree.
func TestRollingUpgrade(t *testing.T) {
	etcd36, etcd37, ctl := etcd36Bin(t), etcdBin(t), etcdctlBin(t)
	c := startEtcdClusterOf(t, etcd36, 3)
	px := startProxy(t, "proxy", c.endpoints())
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{px.addr}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	watch := cli.Watch(ctx, "k/", clientv3.WithPrefix())
	lease, err := cli.Grant(ctx, 3600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, leasedKey, "v", clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	ld := startHungLoad(ctx, cli, px)
	ld.waitPuts(t, 10)

	proxyReports := func(prefix string) {
		t.Helper()
		waitUntil(t, 30*time.Second, "the proxy to report etcd "+prefix+"*", func() (bool, error) {
			v := px.status(t).UpstreamVersion
			return strings.HasPrefix(v, prefix), fmt.Errorf("upstream_version %q", v)
		}, px.process)
	}
	rolling := func(bin, release string) {
		t.Helper()
		for i := range c.members {
			c.restart(t, i, bin)
			if i < len(c.members)-1 {
				// The member asked for Status may run either release;
				// the proxy must not answer by one of them.
				waitUntil(t, 10*time.Second, "the release unknown while the members differ", func() (bool, error) {
					v := px.status(t).UpstreamVersion
					return v == "", fmt.Errorf("upstream_version %q", v)
				}, px.process)
				checkKeysOnly(t, cli, c, fmt.Sprintf("m%d on %s", i, release), true)
			}
			ld.waitPuts(t, ld.puts()+10)
			t.Logf("m%d restarted as %s", i, release)
		}
	}

	proxyReports("3.6.")
	checkKeysOnly(t, cli, c, "3.6", false)
	rolling(etcd37, "3.7")
	waitClusterVersion(t, c, "3.7.0")
	proxyReports("3.7.")
	checkKeysOnly(t, cli, c, "3.7", false)

	// etcd's downgrade procedure: validate and enable, wait until every
	// member's storage is at 3.6, then replace the binaries one by one.
	global := []string{"--endpoints=" + c.endpoints()}
	t.Logf("downgrade validate: %s", strings.TrimSpace(runEtcdctl(t, ctl, global, "downgrade", "validate", "3.6")))
	t.Logf("downgrade enable: %s", strings.TrimSpace(runEtcdctl(t, ctl, global, "downgrade", "enable", "3.6")))
	waitMembers(t, c, "every member's storage version at 3.6", func(st *clientv3.StatusResponse) error {
		if st.StorageVersion != "3.6.0" {
			return fmt.Errorf("storage version %q", st.StorageVersion)
		}
		return nil
	})
	rolling(etcd36, "3.6")
	// etcd lowered the cluster version at enable; the downgrade is done
	// once the leader has seen every member on 3.6.
	waitMembers(t, c, "the downgrade done", func(st *clientv3.StatusResponse) error {
		if st.DowngradeInfo != nil && st.DowngradeInfo.Enabled {
			return fmt.Errorf("downgrade to %s still enabled", st.DowngradeInfo.TargetVersion)
		}
		return nil
	})
	waitClusterVersion(t, c, "3.6.0")
	proxyReports("3.6.")
	checkKeysOnly(t, cli, c, "3.6 again", false)

	acked, res := ld.stop()
	t.Logf("%d puts acknowledged, %d failed; %d linearizable reads, %d failed, slowest %v; /readyz polled %d times",
		len(acked), len(res.putErrs), res.reads, len(res.readErrs), res.slowestRead, res.readyPolls)
	if len(res.readErrs) > 0 {
		t.Errorf("reads through the proxy failed: %v", res.readErrs)
	}
	// Writes are etcd's to answer: a leader that stops, and a downgrade
	// while each member rewrites its storage, can fail one in flight with
	// a timeout or a leader change, direct as through the proxy. Any other
	// failure is the proxy's.
	for _, err := range res.putErrs {
		switch {
		case errors.Is(err, rpctypes.ErrTimeout), errors.Is(err, rpctypes.ErrLeaderChanged),
			errors.Is(err, rpctypes.ErrStopped), errors.Is(err, rpctypes.ErrTimeoutDueToLeaderFail):
			t.Logf("a write failed as etcd fails it: %v", err)
		default:
			t.Errorf("a write through the proxy failed: %v", err)
		}
	}
	if len(res.notReady) > 0 {
		t.Errorf("/readyz failed while a quorum answered: %v", res.notReady)
	}
	if v, err := px.metric("loads_total"); err != nil || v != 1 {
		t.Errorf("loads_total = %v (%v), want 1: the upstream watch must resume, not reload", v, err)
	}
	if reloads, err := px.metricLines("reloads_total"); err != nil || len(reloads) > 0 {
		t.Errorf("reloads: %v (%v), want none", reloads, err)
	}
	checkWatched(t, watch, acked)
}

// leasedKey is TestRollingUpgrade's key with a lease.
const leasedKey = "leased/k"

// checkKeysOnly reads leasedKey keys-only through the proxy,
// linearizably and serializably, and from each member alone. Each of the
// proxy's answers must be one member's; with mixed false, the members
// must agree.
func checkKeysOnly(t *testing.T, cli *clientv3.Client, c *etcdCluster, stage string, mixed bool) {
	t.Helper()
	var members []*clientv3.GetResponse
	for _, m := range c.members {
		resp, err := m.get(leasedKey, clientv3.WithKeysOnly())
		if err != nil {
			t.Fatalf("%s: keys-only read from %s: %v", stage, m.name, err)
		}
		members = append(members, resp)
	}
	var leases []string
	for i, m := range members {
		for _, kv := range m.Kvs {
			leases = append(leases, fmt.Sprintf("m%d %x", i, kv.Lease))
		}
	}
	t.Logf("%s: keys-only, each member's lease: %s", stage, strings.Join(leases, ", "))
	sameKvs := func(a, b *clientv3.GetResponse) bool {
		return slices.EqualFunc(a.Kvs, b.Kvs, func(x, y *mvccpb.KeyValue) bool { return proto.Equal(x, y) })
	}
	if !mixed {
		for i, resp := range members[1:] {
			if !sameKvs(resp, members[0]) {
				t.Fatalf("%s: members answer a keys-only read differently: m0 %v, m%d %v", stage, members[0].Kvs, i+1, resp.Kvs)
			}
		}
	}
	for _, opts := range [][]clientv3.OpOption{{clientv3.WithKeysOnly()}, {clientv3.WithKeysOnly(), clientv3.WithSerializable()}} {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		resp, err := cli.Get(ctx, leasedKey, opts...)
		cancel()
		if err != nil {
			t.Fatalf("%s: keys-only read through the proxy: %v", stage, err)
		}
		if !slices.ContainsFunc(members, func(m *clientv3.GetResponse) bool { return sameKvs(resp, m) }) {
			var each []string
			for i, m := range members {
				each = append(each, fmt.Sprintf("m%d %v", i, m.Kvs))
			}
			t.Fatalf("%s: keys-only read through the proxy (%d options) gave %v, no member's answer: %s", stage, len(opts), resp.Kvs, strings.Join(each, "; "))
		}
	}
}

// waitMembers waits until every member's Status passes check.
func waitMembers(t testing.TB, c *etcdCluster, what string, check func(*clientv3.StatusResponse) error) {
	t.Helper()
	waitUntil(t, 60*time.Second, what, func() (bool, error) {
		for _, m := range c.members {
			st, err := m.status()
			if err != nil {
				return false, err
			}
			if err := check(st); err != nil {
				return false, fmt.Errorf("%s: %w", m.name, err)
			}
		}
		return true, nil
	})
}

// waitClusterVersion waits until every member reports the cluster version
// want (etcd's /version): the leader raises it once every member runs a
// release that allows it, and lowers it when a downgrade is enabled.
func waitClusterVersion(t testing.TB, c *etcdCluster, want string) {
	t.Helper()
	waitUntil(t, 60*time.Second, "cluster version "+want, func() (bool, error) {
		for _, m := range c.members {
			resp, err := plainHTTP.Get(m.url + "/version")
			if err != nil {
				return false, err
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var v struct {
				Cluster string `json:"etcdcluster"`
			}
			if err := json.Unmarshal(body, &v); err != nil {
				return false, fmt.Errorf("%s/version: %w", m.url, err)
			}
			if v.Cluster != want {
				return false, fmt.Errorf("%s: cluster version %q", m.name, v.Cluster)
			}
		}
		return true, nil
	})
}
