package robustness

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	gocmp "github.com/google/go-cmp/cmp"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/tests/v3/robustness/client"
	"go.etcd.io/etcd/tests/v3/robustness/identity"
	"go.etcd.io/etcd/tests/v3/robustness/model"
	"go.etcd.io/etcd/tests/v3/robustness/report"
	"go.etcd.io/etcd/tests/v3/robustness/traffic"
	"go.etcd.io/etcd/tests/v3/robustness/validate"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// The shape of a run: traffic for faultAt, then a fault (see fault); once
// the fault is over and the proxy reaches etcd again, traffic for
// afterFault. A restart of etcd lasts under a second: embed.Etcd.Close
// sends GOAWAY and waits (up to its request timeout, 5s + 2 election
// timeouts) for the open streams, and the proxy ends its own upstream
// streams at the GOAWAY (internal/drain) rather than hold the restart for
// that long; the proxy then reconnects within gRPC's connection backoff
// (at most a second, server/upstream.go).
const (
	faultAt    = 2 * time.Second
	afterFault = 2 * time.Second
	// faultFor is the length of the partition. While it lasts, writes
	// fail or time out with an outcome unknown to the client, and each
	// such write widens the linearization search: the Kubernetes
	// compactor's identical compact_rev_key Txns above all, which the
	// WAL cannot tell apart. A partition that holds new connections
	// (rather than refusing them, which would add gRPC's reconnect
	// backoff of a second or more) keeps their number small.
	faultFor = 500 * time.Millisecond
	// etcdMinRequestTimeout is the least that etcd's graceful stop waits
	// for open streams (embed: 5 s plus two election timeouts).
	etcdMinRequestTimeout = 5 * time.Second
	// runTimeout bounds the recording (not the validation).
	runTimeout = 2 * time.Minute
	// validationTimeout is porcupine's budget for the linearization check:
	// etcd's own robustness suite gives it 5 minutes. A restart fault
	// leaves many writes of unknown outcome, whose linearization took
	// over a minute on 2 cores in some runs.
	validationTimeout = 5 * time.Minute
)

// profile is a scaled-down traffic.KeyValueMedium/WatchDefault/
// CompactionDefault: sized for 2 cores under the race detector. Every
// client, "member" and "cluster" alike, talks to the proxy alone.
var profile = traffic.Profile{
	KeyValue: &traffic.KeyValue{
		MinimalQPS:                     50,
		MaximalQPS:                     150,
		BurstableQPS:                   150,
		MemberClientCount:              4,
		ClusterClientCount:             2,
		MaxNonUniqueRequestConcurrency: 3,
	},
	Watch: &traffic.Watch{
		MemberClientCount:   2,
		ClusterClientCount:  1,
		RevisionOffsetRange: traffic.Range{Min: -100, Max: 100},
	},
	Compaction: &traffic.CompactionDefault,
}

// fault is what goes wrong during the recording.
type fault int

const (
	// cutUpstream partitions the proxy from etcd for faultFor: the relay
	// closes the proxy's upstream connections and holds new ones.
	cutUpstream fault = iota
	// restartEtcd closes etcd (gracefully, as on SIGTERM: embed.Etcd.Close)
	// and starts it again on the same data directory and URLs; the proxy
	// reconnects to the same address by itself, through the relay.
	restartEtcd
	// restoreEtcd snapshots etcd, lets acknowledged writes follow, then
	// replaces etcd by one restored from the snapshot (with
	// --bump-revision --mark-compacted) at the same URLs: writes are lost,
	// and the run is validated as two histories (restore_test.go).
	restoreEtcd
)

func (f fault) String() string {
	switch f {
	case cutUpstream:
		return "CutUpstream"
	case restartEtcd:
		return "RestartEtcd"
	case restoreEtcd:
		return "RestoreEtcd"
	}
	return fmt.Sprintf("fault(%d)", int(f))
}

// scenarios are the framework's traffics every test runs: Kubernetes-shaped
// (kube-apiserver's reads, writes and watches) and etcd-shaped (puts,
// deletes and leases).
var scenarios = []struct {
	name    string
	traffic traffic.Traffic
}{
	{"Kubernetes", traffic.Kubernetes},
	{"EtcdPutDeleteLease", traffic.EtcdPutDeleteLease},
}

// TestRobustness records Kubernetes-shaped and etcd-shaped traffic through
// the proxy with etcd's robustness framework, with compactions, watches and
// a fault (a cut of the proxy's upstream connection, or a restart of etcd),
// and requires every validation of the framework to succeed: linearization
// of the KV history, the watch guarantees, and the historical
// (serializable) reads replayed against the requests persisted in etcd's
// WAL.
func TestRobustness(t *testing.T) {
	withRequestTimeout(t)
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			for _, f := range []fault{cutUpstream, restartEtcd} {
				t.Run(f.String(), func(t *testing.T) {
					testRobustness(t, sc.traffic, f, options{})
				})
			}
		})
	}
}

// withRequestTimeout raises the framework's per-request timeout for the
// test. Its 200ms is sized for etcd without the race detector; here a
// request that times out is a write of unknown outcome for the
// linearization check, not a finding.
func withRequestTimeout(t *testing.T) {
	requestTimeout := traffic.RequestTimeout
	traffic.RequestTimeout = time.Second
	t.Cleanup(func() { traffic.RequestTimeout = requestTimeout })
}

// env is an embedded etcd with the proxy in front of it, through a relay.
type env struct {
	dataDir string
	// snapshotPath and restoredDir are where the restore fault saves
	// etcd's snapshot and restores it; restoredDir stays empty otherwise.
	snapshotPath, restoredDir string
	// etcdConfig starts etcd, at the start and on a restart: the same
	// data directory and the same client and peer URLs.
	etcdConfig server.EmbeddedConfig
	relay      *testsupport.Relay
	proxy      *server.Server
	// With auth (setUpAuth), the traffic, the event collector and the
	// compaction traffic reach the proxy through their users' token
	// fronts; without, the endpoints are the proxy's.
	trafficFront, watchFront, compactFront             *tokenFront
	trafficEndpoints, watchEndpoints, compactEndpoints []string

	mu sync.Mutex
	// etcd is the running etcd; nil once closed and not (yet) started
	// again, so that it is closed once (embed.Etcd.Close panics when
	// called twice).
	etcd    *embed.Etcd
	stopped bool
}

func newEnv(t *testing.T, lg *zap.Logger, opts options) *env {
	t.Helper()
	en := &env{dataDir: t.TempDir(), restoredDir: t.TempDir()}
	en.snapshotPath = filepath.Join(t.TempDir(), "snapshot.db")
	// Fixed ports rather than 0, so that a restarted etcd has the same
	// configuration and listens where the relay dials.
	en.etcdConfig = server.EmbeddedConfig{
		Dir:       en.dataDir,
		ClientURL: "http://" + testsupport.FreeAddr(t),
		PeerURL:   "http://" + testsupport.FreeAddr(t),
		Logger:    lg,
	}
	e, err := server.StartEmbedded(en.etcdConfig)
	if err != nil {
		t.Fatal(err)
	}
	en.etcd = e
	t.Cleanup(en.stop)
	if opts.auth {
		setUpAuth(t, e)
	}
	// The relay holds the connections made during a cut (see faultFor).
	en.relay = testsupport.NewRelay(t, e.Clients[0].Addr().String(), testsupport.HoldWhileCut())
	cfg := servertest.Config("http://"+en.relay.Addr(), func(cfg *server.Config) {
		cfg.CompactionProbeInterval = 20 * time.Millisecond
		// The robustness scenarios run etcd with
		// e2e.WithWatchProcessNotifyInterval(100ms); the proxy serves
		// the watches, so the interval is the proxy's.
		cfg.WatchProgressNotifyInterval, cfg.FollowEtcdProgressInterval = 100*time.Millisecond, false
		if opts.maxHistoryBytes != 0 {
			cfg.MaxHistoryBytes = opts.maxHistoryBytes
		}
		cfg.Logger = lg.Named("proxy")
	})
	if opts.auth {
		cfg.User, cfg.Password = rootUser, rootPassword
	}
	en.proxy = servertest.StartProxy(t, cfg)
	en.trafficEndpoints = []string{en.proxy.Addr()}
	en.watchEndpoints = en.trafficEndpoints
	en.compactEndpoints = en.trafficEndpoints
	if opts.auth {
		en.trafficFront = newTokenFront(t, en.proxy.Addr(), trafficUser, trafficPassword)
		en.watchFront = newTokenFront(t, en.proxy.Addr(), watchUser, watchPassword)
		en.compactFront = newTokenFront(t, en.proxy.Addr(), rootUser, rootPassword)
		en.trafficEndpoints = []string{en.trafficFront.Addr()}
		en.watchEndpoints = []string{en.watchFront.Addr()}
		en.compactEndpoints = []string{en.compactFront.Addr()}
	}
	return en
}

// stop stops the proxy, then etcd, so that etcd's WAL is complete and
// closed before it is read.
func (en *env) stop() {
	en.mu.Lock()
	defer en.mu.Unlock()
	if en.stopped {
		return
	}
	en.stopped = true
	for _, f := range []*tokenFront{en.trafficFront, en.watchFront, en.compactFront} {
		if f != nil {
			f.Close()
		}
	}
	if en.proxy != nil {
		en.proxy.Stop()
	}
	if en.etcd != nil {
		en.etcd.Close()
		en.etcd = nil
	}
}

// restartEtcd closes etcd and starts it again with the same configuration,
// and returns once it serves again (StartEmbedded waits for that, up to a
// minute). It returns how long the close took.
func (en *env) restartEtcd() (closing time.Duration, err error) {
	en.mu.Lock()
	defer en.mu.Unlock()
	if en.stopped || en.etcd == nil {
		return 0, errors.New("etcd is not running")
	}
	start := time.Now()
	en.etcd.Close()
	en.etcd = nil
	closing = time.Since(start)
	e, err := server.StartEmbedded(en.etcdConfig)
	if err != nil {
		return closing, fmt.Errorf("restarting etcd: %w", err)
	}
	en.etcd = e
	return closing, nil
}

// options vary a run of testRobustness.
type options struct {
	// auth runs etcd with auth enabled (TestRobustnessAuth).
	auth bool
	// maxHistoryBytes is the proxy's history budget
	// (server.Config.MaxHistoryBytes); 0 is the default budget, which a
	// run never reaches. A budget the run passes many times over requires
	// history to have been trimmed (TestRobustnessHistoryBudget).
	maxHistoryBytes int64
}

func testRobustness(t *testing.T, tf traffic.Traffic, f fault, opts options) {
	// The framework's own logs at info; etcd's and the proxy's at warn
	// (they log every broken connection and retry during the fault).
	lg := zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel))
	quiet := zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel), zaptest.WrapOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		// clientv3 logs every failed attempt of a forwarded call.
		return dropLogger{Core: c, name: "proxy.upstream"}
	})))
	en := newEnv(t, quiet, opts)

	dataDirs := map[string]string{"etcd": en.dataDir}
	if f == restoreEtcd {
		dataDirs["etcd-restored"] = en.restoredDir
	}
	r, err := report.NewTestReport(lg, resultsDirectory(t), dataDirs,
		&report.TrafficDetail{ExpectUniqueRevision: tf.ExpectUniqueRevision()})
	if err != nil {
		t.Fatal(err)
	}
	// t.Failed() is false while panicking: save the report then too.
	panicked := true
	defer func() {
		if err := r.Finalize(t.Failed(), panicked); err != nil {
			t.Error(err)
		}
	}()

	rec := record(t, lg, en, tf, f)
	r.SetClientReports(rec.reports)
	if f == restoreEtcd {
		compareAfterRestore(t, en, rec)
	}

	// The proxy's metrics show that the proxy, not etcd, answered reads,
	// and that the fault and the compactions reached it.
	m := gatherCounters(t, en)
	en.stop()
	if opts.auth {
		t.Logf("token fronts: %v; %v; %v", en.trafficFront, en.watchFront, en.compactFront)
	}

	persisted, err := persistedRequests(t, lg, en.dataDir)
	if err != nil {
		t.Fatalf("reading etcd's WAL: %v", err)
	}
	checkCoverage(t, rec, m, persisted)
	if opts.maxHistoryBytes > 0 {
		checkTrimmed(t, m)
	}

	var result validate.RobustnessResult
	if f == restoreEtcd {
		result = validateRestore(t, lg, en, tf, rec, persisted)
	} else {
		result = validateHistory(t, lg, "", tf, rec.reports, persisted)
	}
	// LinearizationResult.Visualize draws only successful linearizations;
	// a failed one is the one worth looking at.
	r.SetVisualizer(func(lg *zap.Logger, path string) error {
		lg.Info("Saving visualization", zap.String("path", path))
		return porcupine.VisualizePath(result.Linearization.Model, result.Linearization.Info, path)
	})
	panicked = false
}

// validateHistory runs every validation of the framework over reports
// and the requests persisted in etcd's WAL, and fails the test for each
// that does not succeed; segment, if set, names the part of the run they
// cover.
func validateHistory(t *testing.T, lg *zap.Logger, segment string, tf traffic.Traffic, reports []report.ClientReport, persisted []model.EtcdRequest) validate.RobustnessResult {
	t.Helper()
	if segment != "" {
		segment += ": "
	}
	start := time.Now()
	result := validate.ValidateAndReturnVisualize(lg,
		validate.Config{ExpectRevisionUnique: tf.ExpectUniqueRevision()},
		reports, persisted, validationTimeout)
	t.Logf("%svalidation took %v: assumptions=%s linearization=%s watch=%s serializable=%s",
		segment, time.Since(start).Round(time.Millisecond), result.Assumptions, result.Linearization.Result,
		result.Watch, result.Serializable)
	for _, c := range []struct {
		name string
		res  validate.Result
	}{
		{"assumptions", result.Assumptions},
		{"linearization", result.Linearization.Result},
		{"watch", result.Watch},
		{"serializable", result.Serializable},
	} {
		if c.res.Status != validate.Success {
			t.Errorf("%s%s validation: want %s, got %s", segment, c.name, validate.Success, describe(c.res))
		}
	}
	if result.Linearization.Status != validate.Success {
		explainLinearization(t, reports, persisted)
	}
	return result
}

func rangeString(r *model.RangeRequest) string {
	return fmt.Sprintf("[%q, %q) revision=%d limit=%d keys_only=%v", r.Start, r.End, r.Revision, r.Limit, r.KeysOnly)
}

func describe(r validate.Result) string {
	if r.Status == validate.Unknown {
		return "not run (an earlier validation failed)"
	}
	return r.String()
}

// explainLinearization logs the reads that contradict etcd's WAL, as hints
// to why the history is not linearizable: a read whose header revision is
// below a write acknowledged before the read was sent (etcd's header is its
// head, at least every acknowledged write), or whose key-values differ from
// the WAL's replay at the revision read.
func explainLinearization(t *testing.T, reports []report.ClientReport, persisted []model.EtcdRequest) {
	t.Helper()
	replay := model.NewReplay(persisted)
	type ack struct {
		ret, rev int64
		client   int
	}
	var acks []ack
	for _, r := range reports {
		for _, op := range r.KeyValue {
			req, resp := op.Input.(model.EtcdRequest), op.Output.(model.MaybeEtcdResponse)
			if req.Type == model.Txn && resp.Error == "" && resp.Revision > 0 {
				acks = append(acks, ack{ret: op.Return, rev: resp.Revision, client: op.ClientId})
			}
		}
	}
	slices.SortFunc(acks, func(a, b ack) int { return cmp.Compare(a.ret, b.ret) })
	// best[i] is the highest revision among acks[:i+1].
	best := make([]ack, len(acks))
	for i, a := range acks {
		best[i] = a
		if i > 0 && best[i-1].rev > a.rev {
			best[i] = best[i-1]
		}
	}
	ackedBefore := func(call int64) (ack, bool) {
		i, _ := slices.BinarySearchFunc(acks, call, func(a ack, call int64) int { return cmp.Compare(a.ret, call) })
		if i == 0 {
			return ack{}, false
		}
		return best[i-1], true
	}
	const maxHints = 20
	hints := 0
	hint := func(format string, args ...any) {
		if hints < maxHints {
			t.Logf("hint: "+format, args...)
		}
		hints++
	}
	for _, r := range reports {
		for _, op := range r.KeyValue {
			req, resp := op.Input.(model.EtcdRequest), op.Output.(model.MaybeEtcdResponse)
			if req.Type != model.Range || resp.Error != "" || resp.ClientError != "" {
				continue
			}
			if a, ok := ackedBefore(op.Call); ok && resp.Revision < a.rev {
				hint("client %d: Range %s called at %v, returned at %v, has header revision %d; a write at revision %d was acknowledged to client %d at %v, before the read was called",
					op.ClientId, rangeString(req.Range), time.Duration(op.Call), time.Duration(op.Return), resp.Revision, a.rev, a.client, time.Duration(a.ret))
			}
			rev := req.Range.Revision
			if rev == 0 {
				rev = resp.Revision
			}
			state, err := replay.StateForRevision(rev)
			if err != nil {
				hint("client %d: Range %s called at %v: %v", op.ClientId, rangeString(req.Range), time.Duration(op.Call), err)
				continue
			}
			_, want := state.Step(model.EtcdRequest{Type: model.Range, Range: &model.RangeRequest{RangeOptions: req.Range.RangeOptions}})
			if diff := gocmp.Diff(want.Range, resp.Range); diff != "" {
				hint("client %d: Range %s called at %v: key-values differ from the WAL at revision %d (-want +got):\n%s",
					op.ClientId, rangeString(req.Range), time.Duration(op.Call), rev, diff)
			}
		}
	}
	t.Logf("%d hints (at most %d shown)", hints, maxHints)
}

// recording is what a run recorded.
type recording struct {
	reports              []report.ClientReport
	start, end           time.Duration // of the traffic, since the base time
	fault                fault
	faultStart, faultEnd time.Duration
	// connsCut is how many relayed connections the fault closed: the relay
	// closed them (cutUpstream), or etcd did as it shut down (restartEtcd).
	connsCut int
	// etcdClose is how long etcd took to close (restartEtcd).
	etcdClose time.Duration
	// reconnected is when a read through the proxy reached etcd after the
	// fault.
	reconnected time.Duration
	maxRevision int64
	// collectors are the clients of the watches that collect every event.
	collectors []int
	// restore is what the restore fault did (restoreEtcd).
	restore *restoreRecord
}

// record drives the traffic through the proxy, as the framework's
// runScenario and traffic.SimulateTraffic do (they take an
// e2e.EtcdProcessCluster; the functions they call take endpoints), and
// collects every event with whole-keyspace watches through the proxy.
func record(t *testing.T, lg *zap.Logger, en *env, tf traffic.Traffic, f fault) *recording {
	endpoints := en.trafficEndpoints
	ctx, cancel := context.WithTimeout(t.Context(), runTimeout)
	defer cancel()

	baseTime := time.Now()
	ids := identity.NewIDProvider()
	trafficSet := client.NewSet(ids, baseTime)
	defer trafficSet.Close()
	watchSet := client.NewSet(ids, baseTime)
	defer watchSet.Close()

	// The model requires an empty etcd at the start, shown by a read at
	// revision 1 in the history.
	if err := checkEmptyDatabaseAtStart(ctx, endpoints, trafficSet); err != nil {
		t.Fatal(err)
	}

	rec := &recording{fault: f}
	maxRevisionChan := make(chan int64, 1)
	var g errgroup.Group
	g.Go(func() error {
		defer close(maxRevisionChan)
		err := simulateTraffic(ctx, lg, en, endpoints, tf, trafficSet, rec)
		if err != nil {
			cancel()
			return err
		}
		maxRevisionChan <- rec.maxRevision
		return nil
	})
	g.Go(func() error {
		return client.CollectClusterWatchEvents(ctx, client.CollectClusterWatchEventsParam{
			Lg:              lg,
			Endpoints:       en.watchEndpoints,
			MaxRevisionChan: maxRevisionChan,
			ClientSet:       watchSet,
		})
	})
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	rec.reports = slices.Concat(trafficSet.Reports(), watchSet.Reports())
	for _, r := range watchSet.Reports() {
		rec.collectors = append(rec.collectors, r.ClientID)
	}

	kv := traffic.CalculateStats(rec.reports, rec.start, rec.end)
	before := traffic.CalculateStats(rec.reports, rec.start, rec.faultStart)
	during := traffic.CalculateStats(rec.reports, rec.faultStart, rec.faultEnd)
	after := traffic.CalculateStats(rec.reports, rec.faultEnd, rec.end)
	w := traffic.CalculateWatchStats(rec.reports, rec.start, rec.end)
	recovered := "never"
	if at, ok := firstWriteAfter(rec.reports, rec.faultEnd); ok {
		recovered = fmt.Sprintf("%v after the end of the fault", (at - rec.faultEnd).Round(time.Millisecond))
	}
	closing := ""
	if rec.fault == restartEtcd || rec.fault == restoreEtcd {
		closing = fmt.Sprintf(" (etcd took %v to close)", rec.etcdClose.Round(time.Millisecond))
	}
	t.Logf("%v from %v to %v%s: %d upstream connections cut; the proxy reached etcd %v after the end of the fault; first write acknowledged %s; %d writes failed (outcome unknown to the client)",
		rec.fault, rec.faultStart.Round(time.Millisecond), rec.faultEnd.Round(time.Millisecond), closing,
		rec.connsCut, (rec.reconnected - rec.faultEnd).Round(time.Millisecond), recovered, failedWrites(rec.reports))
	t.Logf("traffic over %v: %d successes, %d failures, %.1f qps; before the fault %.1f qps, during %d/%d failed, after %.1f qps",
		kv.Period.Round(time.Millisecond), kv.Successes, kv.Failures, kv.QPS(), before.QPS(),
		during.Failures, during.Successes+during.Failures, after.QPS())
	t.Logf("watch: %d requests, %d events, %d progress notifications; max revision %d",
		w.Requests, w.Events, w.ProgressNotifies, rec.maxRevision)
	if kv.Successes == 0 || after.Successes == 0 {
		t.Fatalf("no successful traffic (after the fault: %d)", after.Successes)
	}
	// etcd's graceful stop waits up to its request timeout (5 s at least)
	// for the streams open on it: only a stream that stayed open past the
	// GOAWAY holds it that long, and none of these clients' streams is
	// relayed, so that one would be the proxy's own.
	if rec.fault == restartEtcd && rec.etcdClose >= etcdMinRequestTimeout {
		t.Errorf("etcd took %v to close: a stream of the proxy's stayed open on it past its GOAWAY", rec.etcdClose)
	}
	// As traffic.SimulateTraffic: too little traffic makes a pass weak.
	if before.QPS() < profile.KeyValue.MinimalQPS {
		t.Errorf("requiring minimal %.0f qps before the fault for the results to be reliable, got %.1f qps", profile.KeyValue.MinimalQPS, before.QPS())
	}
	return rec
}

// simulateTraffic is traffic.SimulateTraffic without the cluster: KV, watch
// and compaction traffic through the proxy, the fault, then the final
// successful write the validation requires.
func simulateTraffic(ctx context.Context, lg *zap.Logger, en *env, endpoints []string, tf traffic.Traffic, clientSet *client.ClientSet, rec *recording) error {
	limiter := rate.NewLimiter(rate.Limit(profile.KeyValue.MaximalQPS), profile.KeyValue.BurstableQPS)
	finish := make(chan struct{})
	keyStore := traffic.NewKeyStore(10, "key")
	kubernetesStorage := traffic.NewKubernetesStorage()
	var wg sync.WaitGroup
	stop := func() {
		close(finish)
		wg.Wait()
	}

	lg.Info("Start traffic")
	rec.start = time.Since(clientSet.BaseTime())
	err := traffic.SimulateKeyValueTraffic(ctx, &wg, profile.KeyValue, endpoints, clientSet, tf, traffic.RunTrafficLoopParam{
		QPSLimiter:                         limiter,
		IDs:                                clientSet.IdentityProvider(),
		LeaseIDStorage:                     identity.NewLeaseIDStorage(),
		NonUniqueRequestConcurrencyLimiter: traffic.NewConcurrencyLimiter(profile.KeyValue.MaxNonUniqueRequestConcurrency),
		KeyStore:                           keyStore,
		Storage:                            kubernetesStorage,
		Finish:                             finish,
	})
	if err != nil {
		stop()
		return err
	}
	err = traffic.SimulateWatchTraffic(ctx, &wg, profile.Watch, endpoints, clientSet, tf, traffic.RunWatchLoopParam{
		Config:     *profile.Watch,
		QPSLimiter: limiter,
		KeyStore:   keyStore,
		Storage:    kubernetesStorage,
		Finish:     finish,
		Logger:     lg,
	})
	if err != nil {
		stop()
		return err
	}
	err = traffic.SimulateCompactionTraffic(ctx, &wg, profile.Compaction, en.compactEndpoints, clientSet, tf, traffic.RunCompactLoopParam{
		Period: profile.Compaction.Period,
		Finish: finish,
	})
	if err != nil {
		stop()
		return err
	}

	// The fault: a partition between the proxy and etcd, or a restart of
	// etcd. The proxy loses its upstream watch, forwarded requests and
	// quorum reads, then gets them back. The timers bound the phases of
	// the traffic; nothing waits on them for synchronisation.
	phase := func(d time.Duration) bool {
		tm := time.NewTimer(d)
		defer tm.Stop()
		select {
		case <-tm.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
	ok := phase(faultAt)
	rec.faultStart = time.Since(clientSet.BaseTime())
	switch rec.fault {
	case cutUpstream:
		rec.connsCut = en.relay.Cut()
		lg.Info("Cut the proxy's upstream connections", zap.Int("connections", rec.connsCut))
		ok = ok && phase(faultFor)
		held := en.relay.Restore()
		lg.Info("Restored the proxy's upstream", zap.Int("held-connections", held))
	case restartEtcd:
		// Every relayed connection open now ends with etcd.
		rec.connsCut = en.relay.Conns()
		lg.Info("Restarting etcd", zap.Int("connections", rec.connsCut))
		var err error
		rec.etcdClose, err = en.restartEtcd()
		if err != nil {
			stop()
			return err
		}
		lg.Info("Restarted etcd", zap.Duration("close", rec.etcdClose))
	case restoreEtcd:
		// The fault's watches end with the restore; stop ends them
		// otherwise.
		var watches sync.WaitGroup
		watchCtx, cancelWatches := context.WithCancel(ctx)
		stop = func() {
			close(finish)
			wg.Wait()
			cancelWatches()
			watches.Wait()
		}
		if err := injectRestore(ctx, watchCtx, &watches, lg, en, endpoints, clientSet, rec, phase); err != nil {
			stop()
			return err
		}
		ok = ok && ctx.Err() == nil
	}
	rec.faultEnd = time.Since(clientSet.BaseTime())
	// Traffic goes on while a read that does not enter the history waits
	// for the proxy to reach etcd again.
	if err := waitUpstream(ctx, endpoints); err != nil {
		stop()
		return err
	}
	rec.reconnected = time.Since(clientSet.BaseTime())
	ok = ok && phase(afterFault)
	stop()
	rec.end = time.Since(clientSet.BaseTime())
	lg.Info("Finished traffic")
	if !ok {
		return fmt.Errorf("traffic interrupted: %w", ctx.Err())
	}

	// The last operation must succeed. Wait, with a read that does not
	// enter the history (clientv3 retries it while the proxy answers
	// Unavailable), until the proxy reaches etcd again.
	if err := waitUpstream(ctx, endpoints); err != nil {
		return err
	}
	cc, err := clientSet.NewClient(endpoints)
	if err != nil {
		return err
	}
	defer cc.Close()
	if _, err := cc.Put(ctx, "tombstone", "true"); err != nil {
		return fmt.Errorf("last operation failed, validation requires it to succeed: %w", err)
	}
	rec.maxRevision = report.OperationsMaxRevision(clientSet.Reports())
	return nil
}

// firstWriteAfter returns when the first write called after t was
// acknowledged.
func firstWriteAfter(reports []report.ClientReport, t time.Duration) (time.Duration, bool) {
	first, ok := int64(0), false
	for _, r := range reports {
		for _, op := range r.KeyValue {
			req, resp := op.Input.(model.EtcdRequest), op.Output.(model.MaybeEtcdResponse)
			if req.Type == model.Txn && resp.Error == "" && op.Call > int64(t) && (!ok || op.Return < first) {
				first, ok = op.Return, true
			}
		}
	}
	return time.Duration(first), ok
}

// failedWrites counts the writes whose outcome the client does not know.
func failedWrites(reports []report.ClientReport) int {
	n := 0
	for _, r := range reports {
		for _, op := range r.KeyValue {
			req, resp := op.Input.(model.EtcdRequest), op.Output.(model.MaybeEtcdResponse)
			if !req.IsRead() && resp.Error != "" {
				n++
			}
		}
	}
	return n
}

// checkEmptyDatabaseAtStart is traffic.CheckEmptyDatabaseAtStart, which
// retries forever, bounded by ctx: a recorded read must find etcd at
// revision 1.
func checkEmptyDatabaseAtStart(ctx context.Context, endpoints []string, cs *client.ClientSet) error {
	c, err := cs.NewClient(endpoints)
	if err != nil {
		return err
	}
	defer c.Close()
	for {
		rctx, cancel := context.WithTimeout(ctx, traffic.RequestTimeout)
		resp, err := c.Get(rctx, "key")
		cancel()
		switch {
		case err == nil && resp.Header.Revision != 1:
			return fmt.Errorf("%w: revision %d", validate.ErrNotEmptyDatabase, resp.Header.Revision)
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return fmt.Errorf("checking that etcd is empty: %w", err)
		}
	}
}

// waitUpstream returns once a linearizable read through the proxy (which
// the proxy forwards to etcd) succeeds. With auth, endpoints are the
// traffic's token front, which renews the token a restart of etcd
// invalidated.
func waitUpstream(ctx context.Context, endpoints []string) error {
	c, err := clientv3.New(clientv3.Config{Endpoints: endpoints, Logger: zap.NewNop()})
	if err != nil {
		return err
	}
	defer c.Close()
	for {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := c.Get(rctx, "tombstone")
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("the proxy did not reach etcd again: %w", errors.Join(err, ctx.Err()))
		}
	}
}

// counters are the proxy's counters, summed by name and label set.
type counters map[string]float64

func gatherCounters(t *testing.T, en *env) counters {
	t.Helper()
	mfs, err := en.proxy.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	m := counters{}
	for _, mf := range mfs {
		if mf.GetType() != dto.MetricType_COUNTER {
			continue
		}
		for _, metric := range mf.GetMetric() {
			v := metric.GetCounter().GetValue()
			m[mf.GetName()] += v
			for _, l := range metric.GetLabel() {
				m[mf.GetName()+"{"+l.GetName()+"="+l.GetValue()+"}"] += v
			}
		}
	}
	return m
}

// checkCoverage fails a run that would pass validation vacuously: the
// proxy must have answered reads from memory, mirrored compactions, and
// felt the fault; the history must hold historical reads, watch events and
// persisted compactions. The proxy may relay the watch streams of token
// callers to etcd whole (docs/auth.md): relayed streams then stand for the
// watch events the proxy sends.
func checkCoverage(t *testing.T, rec *recording, m counters, persisted []model.EtcdRequest) {
	t.Helper()
	var historical, watchEvents int
	for _, r := range rec.reports {
		for _, op := range r.KeyValue {
			req := op.Input.(model.EtcdRequest)
			resp := op.Output.(model.MaybeEtcdResponse)
			if req.Type == model.Range && req.Range.Revision != 0 && resp.Error == "" {
				historical++
			}
		}
		watchEvents += r.WatchEventCount()
	}
	var compactions int
	for _, req := range persisted {
		if req.Type == model.Compact {
			compactions++
		}
	}
	const (
		cacheRanges = "etcd_snapcache_range_requests_total{source=cache}"
		restarts    = "etcd_snapcache_upstream_watch_restarts_total"
		reloads     = "etcd_snapcache_reloads_total"
		mirrored    = "etcd_snapcache_compactions_observed_total"
		sent        = "etcd_snapcache_watch_events_sent_total"
		relayed     = "etcd_snapcache_watch_relayed_streams_total"
	)
	t.Logf("history: %d successful historical reads, %d watch events; WAL: %d requests, %d compactions",
		historical, watchEvents, len(persisted), compactions)
	t.Logf("proxy: %v ranges from the cache, %v forwarded, %v compactions mirrored, %v watch events sent, %v watch streams relayed, %v upstream watch restarts, %v reloads",
		m[cacheRanges], m["etcd_snapcache_range_requests_total{source=forwarded}"], m[mirrored], m[sent], m[relayed], m[restarts], m[reloads])
	var keys []string
	for k := range m {
		if strings.HasPrefix(k, "etcd_snapcache_") && strings.Contains(k, "{") {
			keys = append(keys, fmt.Sprintf("%s=%v", k, m[k]))
		}
	}
	slices.Sort(keys)
	t.Logf("proxy counters: %s", strings.Join(keys, " "))

	if historical == 0 || watchEvents == 0 || compactions == 0 {
		t.Errorf("the history does not exercise the proxy: %d historical reads, %d watch events, %d compactions", historical, watchEvents, compactions)
	}
	if m[cacheRanges] == 0 || m[mirrored] == 0 || m[sent]+m[relayed] == 0 {
		t.Errorf("the proxy served nothing itself: %v cache ranges, %v compactions mirrored, %v watch events sent, %v watch streams relayed", m[cacheRanges], m[mirrored], m[sent], m[relayed])
	}
	if rec.connsCut == 0 || m[restarts]+m[reloads] == 0 {
		t.Errorf("the fault (%v) did not reach the proxy: %d connections cut, %v upstream watch restarts, %v reloads", rec.fault, rec.connsCut, m[restarts], m[reloads])
	}
}

// resultsDirectory is where a failed run's report goes: $RESULTS_DIR, or
// the temporary directory, then the test name and a timestamp.
func resultsDirectory(t *testing.T) string {
	dir, ok := os.LookupEnv("RESULTS_DIR")
	if !ok {
		dir = filepath.Join(os.TempDir(), "etcd-snapcache-robustness")
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, strings.ReplaceAll(t.Name(), "/", "_"), fmt.Sprint(time.Now().UnixNano()))
}

// dropLogger drops the entries of one named logger (and its children).
type dropLogger struct {
	zapcore.Core
	name string
}

func (d dropLogger) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if e.LoggerName == d.name || strings.HasPrefix(e.LoggerName, d.name+".") {
		return ce
	}
	return d.Core.Check(e, ce)
}

func (d dropLogger) With(fields []zapcore.Field) zapcore.Core {
	return dropLogger{Core: d.Core.With(fields), name: d.name}
}
