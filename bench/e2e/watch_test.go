package e2e

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

var (
	watchers     = flag.Int("snapcache.e2e.watchers", 5000, "prefix watchers (with prev_kv) of BenchmarkWatchFanout")
	watchConns   = flag.Int("snapcache.e2e.watch-conns", 50, "connections the watchers are spread over, one watch stream each")
	watchPuts    = flag.Int("snapcache.e2e.watch-puts", 200, "puts of a BenchmarkWatchFanout round, each delivered to every watcher")
	watchKeys    = flag.Int("snapcache.e2e.watch-keys", 100, "keys the puts update (written once before, so every event has a prev_kv)")
	watchValue   = flag.Int("snapcache.e2e.watch-value", 256, "value size of BenchmarkWatchFanout's puts")
	watchTimeout = flag.Duration("snapcache.e2e.watch-timeout", 3*time.Minute, "most time a round's events may take to arrive")
)

const watchPrefix = "/registry/configmaps/bench/"

// BenchmarkWatchFanout: -snapcache.e2e.watchers watchers of one prefix,
// with prev_kv, spread over -snapcache.e2e.watch-conns connections (one
// watch stream each, as clientv3 multiplexes a client's watchers), then
// -snapcache.e2e.watch-puts puts of existing keys under the prefix, one
// after another through the same side (to etcd, or through the proxy that
// forwards them). An op is an event delivered to a watcher; each round
// reports events/s (all events, from the first put's start to the last
// event's receipt) and the delivery latency of the events, from their
// put's start to their receipt (p50-ms, p99-ms). Every round opens new
// streams and watchers (not measured) and closes them after.
func BenchmarkWatchFanout(b *testing.B) {
	env := newPairEnv(b)
	w := newWriter(env.loader, *watchValue, 16)
	head := w.put(b, *watchKeys, watchKey)
	env.waitProxy(b, head, 0)
	// The watch connections of each side, kept across rounds.
	conns := map[*side][]*clientv3.Client{}
	for _, s := range []*side{env.etcdS, env.proxyS} {
		user, password := "", ""
		if env.auth {
			user, password = benchUser, benchPassword
		}
		for range *watchConns {
			conns[s] = append(conns[s], dial(b, s.endpoint, s.env.tls, user, password))
		}
	}
	b.Logf("setup: %d watchers on %d connections, %d puts of %d keys x %d B per round: %d events; auth %v, transport %s",
		*watchers, *watchConns, *watchPuts, *watchKeys, *watchValue, *watchers**watchPuts, env.auth, transportName(env.tls != nil))
	compareSides(b, env, "event", func(b *testing.B, s *side, m *meter, warm bool) roundOut {
		if warm {
			return roundOut{}
		}
		return watchRound(b, s, conns[s], m)
	})
}

func watchKey(i int) []byte { return fmt.Appendf(nil, "%scm-%05d", watchPrefix, i) }

// watchRound runs one round of BenchmarkWatchFanout on s.
func watchRound(b *testing.B, s *side, conns []*clientv3.Client, m *meter) roundOut {
	b.Helper()
	nw, np := *watchers, *watchPuts
	want := int64(nw) * int64(np)
	ctx, cancel := context.WithTimeout(context.Background(), *watchTimeout+time.Minute)
	defer cancel()

	var (
		base     = time.Now()
		putStart = make([]atomic.Int64, np) // ns since base
		created  atomic.Int64
		allIn    = make(chan struct{}) // every watcher created
		events   atomic.Int64
		allDone  = make(chan struct{}) // every event received
		lastRecv atomic.Int64          // ns since base
		mu       sync.Mutex
		lats     []time.Duration // guarded by mu
		wg       sync.WaitGroup
	)
	first := &firstError{cancel: cancel}
	fail, errOf := first.fail, first.get
	streamCtx, closeStreams := context.WithCancel(ctx)
	defer func() {
		closeStreams()
		wg.Wait()
	}()
	waitCreated := time.Now()
	perConn := make([]int, len(conns))
	for i := range nw {
		perConn[i%len(conns)]++
	}
	for c, cli := range conns {
		if perConn[c] == 0 {
			continue
		}
		stream, err := pb.NewWatchClient(cli.ActiveConnection()).Watch(streamCtx)
		if err != nil {
			b.Fatalf("%s: opening a watch stream: %v", s.name, err)
		}
		n := perConn[c]
		wg.Go(func() {
			local := make([]time.Duration, 0, n*np)
			defer func() {
				mu.Lock()
				lats = append(lats, local...)
				mu.Unlock()
			}()
			got := 0
			for {
				resp, err := stream.Recv()
				if err != nil {
					if streamCtx.Err() == nil {
						fail(fmt.Errorf("watch stream: %w", err))
					}
					return
				}
				now := time.Since(base)
				if resp.Created && created.Add(1) == int64(nw) {
					close(allIn)
				}
				if resp.Canceled {
					fail(fmt.Errorf("watch %d canceled: %s", resp.WatchId, resp.CancelReason))
					return
				}
				for _, ev := range resp.Events {
					if ev.PrevKv == nil || len(ev.Kv.Value) < 8 {
						fail(fmt.Errorf("event of %q without prev_kv or with a short value", ev.Kv.Key))
						return
					}
					i := binary.BigEndian.Uint64(ev.Kv.Value)
					if i >= uint64(np) {
						fail(fmt.Errorf("event of put %d, want < %d", i, np))
						return
					}
					local = append(local, now-time.Duration(putStart[i].Load()))
				}
				if k := len(resp.Events); k > 0 {
					got += k
					if got > n*np {
						fail(fmt.Errorf("a stream of %d watchers received %d events, want %d", n, got, n*np))
						return
					}
					lastRecv.Store(int64(now))
					if events.Add(int64(k)) == want {
						close(allDone)
					}
				}
			}
		})
		for range n {
			if err := stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{
				Key: []byte(watchPrefix), RangeEnd: []byte(clientv3.GetPrefixRangeEnd(watchPrefix)), PrevKv: true,
			}}}); err != nil {
				b.Fatalf("%s: creating a watcher: %v", s.name, err)
			}
		}
	}
	select {
	case <-allIn:
	case <-ctx.Done():
		b.Fatalf("%s: %d of %d watchers created: %v", s.name, created.Load(), nw, errOf())
	case <-time.After(*watchTimeout):
		b.Fatalf("%s: %d of %d watchers created after %v", s.name, created.Load(), nw, *watchTimeout)
	}
	createSecs := time.Since(waitCreated).Seconds()

	m.start()
	value := make([]byte, *watchValue)
	for i := range value {
		value[i] = 'a' + byte(i%26)
	}
	kv := s.kvs[0]
	begin := time.Since(base)
	for i := range np {
		binary.BigEndian.PutUint64(value, uint64(i))
		putStart[i].Store(int64(time.Since(base)))
		if _, err := kv.Put(ctx, &pb.PutRequest{Key: watchKey(i % *watchKeys), Value: value}); err != nil {
			b.Fatalf("%s: put: %v", s.name, err)
		}
	}
	putSecs := (time.Since(base) - begin).Seconds()
	select {
	case <-allDone:
	case <-ctx.Done():
		b.Fatalf("%s: %d of %d events received: %v", s.name, events.Load(), want, errOf())
	case <-time.After(*watchTimeout):
		b.Fatalf("%s: %d of %d events received after %v", s.name, events.Load(), want, *watchTimeout)
	}
	secs := (time.Duration(lastRecv.Load()) - begin).Seconds()
	m.stop()
	closeStreams()
	wg.Wait()
	if err := errOf(); err != nil {
		b.Fatalf("%s: %v", s.name, err)
	}
	if int64(len(lats)) != want {
		b.Fatalf("%s: %d latencies, want %d", s.name, len(lats), want)
	}
	slices.Sort(lats)
	q := func(p float64) float64 {
		return float64(lats[min(int(p*float64(len(lats))), len(lats)-1)]) / float64(time.Millisecond)
	}
	return roundOut{ops: float64(want), secs: secs, extra: map[string]float64{
		"p50-ms":   q(0.50),
		"p99-ms":   q(0.99),
		"max-ms":   q(1),
		"puts/s":   float64(np) / putSecs,
		"create-s": createSecs,
	}}
}
