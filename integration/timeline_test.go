package integration

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// timelineEnv is an etcd at fixed URLs, which a test can stop and replace
// by a restored or another etcd at the same URLs, with the proxy in front.
type timelineEnv struct {
	t                  *testing.T
	clientURL, peerURL string
	etcd               *embed.Etcd
	stopEtcd           func() // stops etcd once
	proxy              *server.Server
	proxyCfg           server.Config
}

func newTimelineEnv(t *testing.T) *timelineEnv { return newTimelineEnvWith(t, nil) }

// newTimelineEnvWith is newTimelineEnv with edit applied to the proxy's
// configuration.
func newTimelineEnvWith(t *testing.T, edit func(*server.Config)) *timelineEnv {
	env := &timelineEnv{t: t, clientURL: "http://" + testsupport.FreeAddr(t), peerURL: "http://" + testsupport.FreeAddr(t)}
	env.start(t.TempDir())
	env.proxyCfg = servertest.Config(env.clientURL, func(cfg *server.Config) {
		cfg.CompactionProbeInterval = 100 * time.Millisecond
		cfg.Logger = zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))
		if edit != nil {
			edit(cfg)
		}
	})
	env.proxy = servertest.StartProxy(t, env.proxyCfg)
	return env
}

// start starts an etcd at the environment's URLs on the data in dir.
func (env *timelineEnv) start(dir string) {
	e, err := server.StartEmbedded(server.EmbeddedConfig{Dir: dir, ClientURL: env.clientURL, PeerURL: env.peerURL})
	if err != nil {
		env.t.Fatal(err)
	}
	env.etcd, env.stopEtcd = e, sync.OnceFunc(e.Close)
	env.t.Cleanup(env.stopEtcd)
}

func (env *timelineEnv) client(ep string) *clientv3.Client {
	return callerClient(env.t, ep, "", "", nil)
}

// put writes n keys prefix0..prefix(n-1) to etcd and returns the revision.
func (env *timelineEnv) put(prefix string, n int) int64 {
	env.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli := env.client(env.clientURL)
	var rev int64
	for i := range n {
		resp, err := cli.Put(ctx, fmt.Sprintf("%s%d", prefix, i), "v")
		if err != nil {
			env.t.Fatal(err)
		}
		rev = resp.Header.Revision
	}
	return rev
}

// snapshot saves etcd's snapshot into a file.
func (env *timelineEnv) snapshot() string {
	env.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rc, err := env.client(env.clientURL).Snapshot(ctx)
	if err != nil {
		env.t.Fatal(err)
	}
	defer rc.Close()
	path := filepath.Join(env.t.TempDir(), "snapshot.db")
	f, err := os.Create(path)
	if err != nil {
		env.t.Fatal(err)
	}
	defer f.Close()
	if _, err := io.Copy(f, rc); err != nil {
		env.t.Fatal(err)
	}
	return path
}

// restore stops etcd and starts one restored from snap (etcdutl snapshot
// restore, with bump and mark-compacted when bump > 0) at the same URLs.
func (env *timelineEnv) restore(snap string, bump uint64) {
	env.t.Helper()
	env.stopEtcd()
	dir := filepath.Join(env.t.TempDir(), "restored")
	name := "etcd-snapcache-embedded" // server.StartEmbedded's member name
	if err := snapshot.NewV3(zap.NewNop()).Restore(snapshot.RestoreConfig{
		SnapshotPath:        snap,
		Name:                name,
		OutputDataDir:       dir,
		PeerURLs:            []string{env.peerURL},
		InitialCluster:      name + "=" + env.peerURL,
		InitialClusterToken: embed.NewConfig().InitialClusterToken,
		SkipHashCheck:       true,
		RevisionBump:        bump,
		MarkCompacted:       bump > 0,
	}); err != nil {
		env.t.Fatal(err)
	}
	env.start(dir)
}

// replace stops etcd and starts a new, empty cluster at the same URLs.
func (env *timelineEnv) replace() {
	env.stopEtcd()
	env.start(env.t.TempDir())
}

// sameAnswers compares linearizable and serializable reads of every key
// under prefixes through the proxy with etcd's.
func (env *timelineEnv) sameAnswers(serializable bool, prefixes ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	direct := pb.NewKVClient(env.client(env.clientURL).ActiveConnection())
	proxied := pb.NewKVClient(env.client("http://" + env.proxy.Addr()).ActiveConnection())
	for _, p := range prefixes {
		req := &pb.RangeRequest{Key: []byte(p), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(p)), Serializable: serializable}
		d, err := direct.Range(ctx, req)
		if err != nil {
			return err
		}
		got, err := proxied.Range(ctx, req)
		if err != nil {
			return fmt.Errorf("through the proxy: %w", err)
		}
		if len(got.Kvs) != len(d.Kvs) || got.Count != d.Count {
			return fmt.Errorf("%s (serializable %v): etcd has %d keys, the proxy answered %d", p, serializable, d.Count, got.Count)
		}
		for i := range d.Kvs {
			if string(d.Kvs[i].Key) != string(got.Kvs[i].Key) || d.Kvs[i].ModRevision != got.Kvs[i].ModRevision {
				return fmt.Errorf("%s: etcd %q@%d, proxy %q@%d", p, d.Kvs[i].Key, d.Kvs[i].ModRevision, got.Kvs[i].Key, got.Kvs[i].ModRevision)
			}
		}
	}
	return nil
}

// neverOld fails the test if a linearizable read through the proxy
// answers keys under prefix, which only the old history has.
func (env *timelineEnv) neverOld(t *testing.T, prefix string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := pb.NewKVClient(env.client("http://"+env.proxy.Addr()).ActiveConnection()).Range(ctx, &pb.RangeRequest{Key: []byte(prefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(prefix)), CountOnly: true})
	if err == nil && resp.Count > 0 {
		t.Fatalf("a linearizable read through the proxy answered %d keys of the old history under %s", resp.Count, prefix)
	}
}

// watchFrom opens a watch of prefix through the proxy from rev.
func (env *timelineEnv) watchFrom(prefix string, rev int64) clientv3.WatchChan {
	ctx, cancel := context.WithCancel(context.Background())
	env.t.Cleanup(cancel)
	return env.client("http://"+env.proxy.Addr()).Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
}

// waitCompactedCancel reads wc until the proxy ends it as compacted.
func waitCompactedCancel(t *testing.T, wc clientv3.WatchChan) {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case resp, ok := <-wc:
			if !ok {
				t.Fatal("the watch ended without a compacted cancel")
			}
			if resp.CompactRevision > 0 {
				return
			}
		case <-timeout:
			t.Fatal("the watch was not ended as compacted after a change of history")
		}
	}
}

// TestTimelineRestore: etcd is restored from an older snapshot under a
// running proxy. Linearizable reads never answer from the old history,
// serializable reads follow within the compaction probe's interval, every
// watch ends as compacted, and the change is counted. Without a revision
// bump, the restored etcd's writes stay below the old revision (the head
// shows it) or carry it past the old revision (only the history check
// shows it); with --bump-revision --mark-compacted the resume is compacted.
func TestTimelineRestore(t *testing.T) {
	for _, tc := range []struct {
		name        string
		bump        uint64
		writesAfter int
	}{
		{"below the old revision", 0, 3},
		{"past the old revision", 0, 40},
		{"bump and mark compacted", 1000, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := newTimelineEnv(t)
			snapRev := env.put("/a/", 10)
			snap := env.snapshot()
			oldRev := env.put("/old/", 20)
			testsupport.WaitFor(t, waitTimeout, "the cache to reach the old head", func() bool { return env.proxy.Store().Rev() >= oldRev })
			wc := env.watchFrom("/", snapRev+1)

			env.restore(snap, tc.bump)
			env.put("/new/", tc.writesAfter)
			// Linearizable reads: never the old history, not even once.
			testsupport.Poll(t, waitTimeout, 20*time.Millisecond, "linearizable answers to match etcd's", func() (bool, error) {
				env.neverOld(t, "/old/")
				if err := env.sameAnswers(false, "/a/", "/old/", "/new/"); err != nil {
					return false, err
				}
				return true, nil
			})
			testsupport.Poll(t, waitTimeout, 20*time.Millisecond, "serializable answers to match etcd's", func() (bool, error) {
				if err := env.sameAnswers(true, "/a/", "/old/", "/new/"); err != nil {
					return false, err
				}
				return true, nil
			})
			waitCompactedCancel(t, wc)
			if n := metricSum(t, env.proxy.Registry(), "etcd_snapcache_timeline_changes_total", nil); n < 1 {
				t.Fatalf("timeline changes counted: %v", n)
			}
		})
	}
}

// TestTimelineOtherCluster: the endpoints now reach another cluster with
// a lower revision; the proxy notices (cluster id), answers as that
// cluster, and ends every watch.
func TestTimelineOtherCluster(t *testing.T) {
	env := newTimelineEnv(t)
	oldRev := env.put("/old/", 30)
	testsupport.WaitFor(t, waitTimeout, "the cache to reach the old head", func() bool { return env.proxy.Store().Rev() >= oldRev })
	wc := env.watchFrom("/", oldRev)
	env.replace()
	env.put("/new/", 5)
	testsupport.Poll(t, waitTimeout, 20*time.Millisecond, "answers to match the new cluster's", func() (bool, error) {
		if err := env.sameAnswers(false, "/old/", "/new/"); err != nil {
			return false, err
		}
		return true, nil
	})
	waitCompactedCancel(t, wc)
	if n := metricSum(t, env.proxy.Registry(), "etcd_snapcache_timeline_changes_total", nil); n < 1 {
		t.Fatalf("timeline changes counted: %v", n)
	}
}
