package clients

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
)

// TestHungMember: one member of a three-member etcd cluster stops
// answering (SIGSTOP, as a frozen host or a stalled disk would leave it)
// while clients write, read linearizably and watch through the proxy. The
// proxy stops sending the member anything within a few seconds, long
// before gRPC keepalive would notice (50 s), moves its upstream watch to
// another member without reloading the cache, stays ready, and no read
// fails. Once the member answers again it is used again.
//
// watch-member hangs the member the proxy's upstream watch runs on; leader
// hangs etcd's leader, which costs the cluster an election too.
func TestHungMember(t *testing.T) {
	for _, which := range []string{"watch-member", "leader"} {
		t.Run(which, func(t *testing.T) {
			c := startEtcdCluster(t, 3)
			px := startProxy(t, "proxy", c.endpoints())
			cli, err := clientv3.New(clientv3.Config{Endpoints: []string{px.addr}, DialTimeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer cli.Close()

			var victim *etcdProc
			switch which {
			case "watch-member":
				var st proxystatus.Status
				waitUntil(t, 10*time.Second, "the upstream watch's member", func() (bool, error) {
					st = px.status(t)
					return st.UpstreamWatchMember != "", nil
				}, px.process)
				victim = c.member(t, st.UpstreamWatchMember)
			case "leader":
				victim = c.leader(t)
			}
			leader := victim == c.leader(t)
			t.Logf("hanging %s (%s), the leader: %v", victim.name, victim.addr, leader)

			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			watch := cli.Watch(ctx, "k/", clientv3.WithPrefix())
			ld := startHungLoad(ctx, cli, px)
			ld.waitPuts(t, 10)

			resume := victim.hang(t)
			hungAt := time.Now()
			waitUntil(t, 15*time.Second, victim.name+" avoided and the upstream watch moved off it", func() (bool, error) {
				st := px.status(t)
				if !slices.Equal(st.UnresponsiveMembers, []string{victim.addr}) {
					return false, fmt.Errorf("unresponsive members %v", st.UnresponsiveMembers)
				}
				if st.UpstreamWatchMember == "" || st.UpstreamWatchMember == victim.addr {
					return false, fmt.Errorf("upstream watch on %q", st.UpstreamWatchMember)
				}
				return true, nil
			}, px.process)
			t.Logf("%s avoided %v after it hung", victim.name, time.Since(hungAt).Round(100*time.Millisecond))
			// Writes and fresh reads go on while it hangs.
			ld.waitPuts(t, ld.puts()+20)

			resume()
			waitUntil(t, 15*time.Second, victim.name+" used again", func() (bool, error) {
				st := px.status(t)
				return len(st.UnresponsiveMembers) == 0, fmt.Errorf("unresponsive members %v", st.UnresponsiveMembers)
			}, px.process)
			ld.waitPuts(t, ld.puts()+10)
			acked, res := ld.stop()

			t.Logf("%d puts acknowledged, %d failed; %d linearizable reads, %d failed, slowest %v; /readyz polled %d times",
				len(acked), len(res.putErrs), res.reads, len(res.readErrs), res.slowestRead, res.readyPolls)
			if len(res.readErrs) > 0 {
				t.Errorf("reads through the proxy failed: %v", res.readErrs)
			}
			if !leader && len(res.putErrs) > 0 {
				// A write waits out the election when the leader hangs,
				// as it would on etcd directly; with a follower hung the
				// cluster has its leader throughout.
				t.Errorf("writes through the proxy failed with a follower hung: %v", res.putErrs)
			}
			if len(res.notReady) > 0 {
				t.Errorf("/readyz failed while a quorum answered: %v", res.notReady)
			}
			if v, err := px.metric("loads_total"); err != nil || v != 1 {
				t.Errorf("loads_total = %v (%v), want 1: the upstream watch must resume, not reload", v, err)
			}
			if reloads, err := px.metricLines("reloads_total"); err != nil || len(reloads) > 0 {
				t.Errorf("reloads: %v (%v), want none: the upstream watch must resume, not reload", reloads, err)
			}
			checkWatched(t, watch, acked)
			if lines, err := px.metricLines("range_requests_total"); err == nil {
				t.Logf("the proxy's Range requests by source and reason: %v", lines)
			}
		})
	}
}

// leader returns the member that is etcd's leader now.
func (c *etcdCluster) leader(t testing.TB) *etcdProc {
	t.Helper()
	var leader *etcdProc
	waitUntil(t, 10*time.Second, "a leader", func() (bool, error) {
		for _, m := range c.members {
			st, err := m.status()
			if err != nil {
				return false, err
			}
			if st.Leader != 0 && st.Leader == st.Header.MemberId {
				leader = m
				return true, nil
			}
		}
		return false, errors.New("no member is the leader")
	})
	return leader
}

// status reads the proxy's /proxy/status.
func (px *proxyProc) status(t testing.TB) proxystatus.Status {
	t.Helper()
	resp, err := px.hc.Get(px.own + proxystatus.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st proxystatus.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("%s: %v", proxystatus.Path, err)
	}
	return st
}

// hungLoad writes keys k/<n> one after another through the proxy, reads
// k/ linearizably after each write, and polls the proxy's /readyz, until
// stopped (each at most hungLoadOps times).
type hungLoad struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	acked  []int64 // guarded by mu; revisions of the acknowledged puts
	res    hungLoadResult
	putted chan struct{} // signaled (non-blocking) after each acknowledged put
}

type hungLoadResult struct {
	putErrs, readErrs, notReady []error
	reads, readyPolls           int
	slowestRead                 time.Duration
}

const hungLoadOps = 5000

func startHungLoad(parent context.Context, cli *clientv3.Client, px *proxyProc) *hungLoad {
	ctx, cancel := context.WithCancel(parent)
	ld := &hungLoad{cancel: cancel, putted: make(chan struct{}, 1)}
	ld.wg.Add(2)
	go func() {
		defer ld.wg.Done()
		for i := 0; i < hungLoadOps && ctx.Err() == nil; i++ {
			// Each call gets more than an election and a member's request
			// timeout, as kube-apiserver's do.
			cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
			resp, err := cli.Put(cctx, fmt.Sprintf("k/%d", i), "v")
			ccancel()
			ld.mu.Lock()
			switch {
			case ctx.Err() != nil:
			case err != nil:
				ld.res.putErrs = append(ld.res.putErrs, fmt.Errorf("put k/%d: %w", i, err))
			default:
				ld.acked = append(ld.acked, resp.Header.Revision)
			}
			ld.mu.Unlock()
			select {
			case ld.putted <- struct{}{}:
			default:
			}
			start := time.Now()
			cctx, ccancel = context.WithTimeout(ctx, 30*time.Second)
			_, err = cli.Get(cctx, "k/", clientv3.WithPrefix(), clientv3.WithCountOnly())
			ccancel()
			ld.mu.Lock()
			if ctx.Err() == nil {
				ld.res.reads++
				ld.res.slowestRead = max(ld.res.slowestRead, time.Since(start))
				if err != nil {
					ld.res.readErrs = append(ld.res.readErrs, err)
				}
			}
			ld.mu.Unlock()
		}
	}()
	go func() {
		defer ld.wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for range hungLoadOps {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			_, err := httpGetOK(px.hc, px.own+"/readyz")
			ld.mu.Lock()
			ld.res.readyPolls++
			if err != nil && ctx.Err() == nil {
				ld.res.notReady = append(ld.res.notReady, err)
			}
			ld.mu.Unlock()
		}
	}()
	return ld
}

func (ld *hungLoad) puts() int {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return len(ld.acked)
}

// waitPuts waits until n puts were acknowledged.
func (ld *hungLoad) waitPuts(t testing.TB, n int) {
	t.Helper()
	deadline := time.NewTimer(60 * time.Second)
	defer deadline.Stop()
	for ld.puts() < n {
		select {
		case <-ld.putted:
		case <-deadline.C:
			ld.mu.Lock()
			defer ld.mu.Unlock()
			t.Fatalf("%d puts acknowledged in 60s, want %d; errors: %v", len(ld.acked), n, ld.res.putErrs)
		}
	}
}

// stop ends the load and returns the acknowledged puts' revisions and
// what was counted.
func (ld *hungLoad) stop() ([]int64, hungLoadResult) {
	ld.cancel()
	ld.wg.Wait()
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return slices.Clone(ld.acked), ld.res
}

// checkWatched reads the watch until it has seen every acknowledged put's
// revision, and fails on a revision out of order or missing.
func checkWatched(t *testing.T, watch clientv3.WatchChan, acked []int64) {
	t.Helper()
	if len(acked) == 0 {
		return
	}
	want := acked[len(acked)-1]
	seen := map[int64]bool{}
	var last int64
	timeout := time.NewTimer(30 * time.Second)
	defer timeout.Stop()
	for last < want {
		select {
		case resp, ok := <-watch:
			if !ok || resp.Err() != nil {
				t.Fatalf("watch ended at revision %d (want %d): %v", last, want, resp.Err())
			}
			for _, ev := range resp.Events {
				if ev.Kv.ModRevision <= last {
					t.Fatalf("watch event at revision %d after %d", ev.Kv.ModRevision, last)
				}
				last = ev.Kv.ModRevision
				seen[last] = true
			}
		case <-timeout.C:
			t.Fatalf("watch at revision %d after 30s, want %d", last, want)
		}
	}
	for _, r := range acked {
		if !seen[r] {
			t.Errorf("the watch missed the put at revision %d", r)
		}
	}
}
