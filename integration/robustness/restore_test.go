package robustness

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/tests/v3/robustness/client"
	"go.etcd.io/etcd/tests/v3/robustness/model"
	"go.etcd.io/etcd/tests/v3/robustness/report"
	"go.etcd.io/etcd/tests/v3/robustness/traffic"
	"go.etcd.io/etcd/tests/v3/robustness/validate"
	"go.etcd.io/raft/v3/raftpb"

	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// The restore fault: at faultAt, a snapshot of etcd (Maintenance.Snapshot);
// lostFor later, with the traffic still running, the proxy's upstream is
// cut, etcd is stopped and replaced by one restored from the snapshot
// (etcdutl snapshot restore --bump-revision=restoreBump --mark-compacted)
// at the same URLs, and the relay reaches it. Every write etcd acknowledged
// after the snapshot is lost.
const (
	lostFor     = time.Second
	restoreBump = 10_000
)

// TestRobustnessRestore runs traffic through the proxy while etcd is
// restored from an older snapshot (the restoreEtcd fault), which loses
// acknowledged writes: no single history of etcd explains such a run, and
// the framework's model (one etcd whose acknowledged writes stay) cannot
// validate it whole. It is validated as the two histories it is made of
// (validateRestore):
//
//   - the old history: every answer from etcd before the restore, with its
//     own WAL, exactly as TestRobustness validates a run;
//   - the new history: every answer from the restored etcd, with the
//     requests in the snapshot (the old WAL up to the snapshot's consistent
//     index) before them and the restored etcd's WAL after them, the
//     revisions of the bump moved down so that the framework's model, which
//     counts revisions one write at a time, can follow them;
//
// and every answer belongs to one of the two: no read, and no watch, mixes
// them. Every watch open across the restore must end as compacted, and
// after the traffic the proxy must answer every revision as the restored
// etcd does (compareAfterRestore).
func TestRobustnessRestore(t *testing.T) {
	withRequestTimeout(t)
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			testRobustness(t, sc.traffic, restoreEtcd, options{})
		})
	}
}

// restoreRecord is what the restore fault did. Times are since the
// traffic's base time.
type restoreRecord struct {
	// watchClient is the client of the watches open across the restore.
	watchClient int
	// snapshotDone is when the snapshot was saved; consistentIndex is its
	// raft index: the snapshot holds the WAL's entries up to it.
	snapshotDone    time.Duration
	consistentIndex uint64
	// cut is when the proxy's upstream was cut (and etcd then stopped); up
	// when the relay reached the restored etcd.
	cut, up time.Duration
	// detected is when the proxy was seen to count the change of history
	// (etcd_snapcache_timeline_changes_total); 0 if it never was.
	detected time.Duration
	// The restored etcd as it started, read directly before the proxy
	// reached it: its revision (the snapshot's plus restoreBump), keys and
	// leases.
	restoredHead   int64
	restoredKVs    []*mvccpb.KeyValue
	restoredLeases []int64
}

// snapRev is the snapshot's revision.
func (rr *restoreRecord) snapRev() int64 { return rr.restoredHead - restoreBump }

// injectRestore is the restore fault, called at faultAt with the traffic
// running. The watches it opens, and its watch on the proxy's metrics,
// run in watches until watchCtx ends.
func injectRestore(ctx, watchCtx context.Context, watches *sync.WaitGroup, lg *zap.Logger, en *env, endpoints []string, clientSet *client.ClientSet, rec *recording, phase func(time.Duration) bool) error {
	rr := &restoreRecord{}
	rec.restore = rr
	since := func() time.Duration { return time.Since(clientSet.BaseTime()) }

	// Watches open across the restore, through the proxy, recorded with
	// the traffic (and validated with the old history): the whole
	// keyspace, each traffic's keys, and a key without events, from the
	// head (the traffic compacts: an older revision may be compacted
	// already).
	wc, err := clientSet.NewClient(endpoints)
	if err != nil {
		return err
	}
	rr.watchClient = wc.ID
	for _, w := range []struct {
		key              string
		rev              int64
		prefix, progress bool
	}{
		{"", 0, true, true},
		{"key", 0, true, false},
		{"/registry/", 0, true, true},
		{"tombstone", 0, false, true},
	} {
		ch := wc.Watch(watchCtx, w.key, w.rev, w.prefix, w.progress, true)
		watches.Add(1)
		go func() {
			defer watches.Done()
			for range ch {
			}
		}()
	}

	if err := saveSnapshot(ctx, en.etcdConfig.ClientURL, en.snapshotPath); err != nil {
		return err
	}
	rr.snapshotDone = since()
	if rr.consistentIndex, err = snapshotConsistentIndex(en.snapshotPath); err != nil {
		return err
	}
	lg.Info("Saved etcd's snapshot", zap.Uint64("consistent-index", rr.consistentIndex))
	if !phase(lostFor) {
		return ctx.Err()
	}

	// The proxy loses etcd first: embed.Etcd.Close would otherwise wait
	// out the proxy's streams (see faultAt). Its new connections wait in
	// the relay for the restored etcd.
	rr.cut = since()
	rec.faultStart = rr.cut
	rec.connsCut = en.relay.Cut()
	if rec.etcdClose, err = en.restoreEtcd(en.snapshotPath, restoreBump); err != nil {
		return err
	}
	if rr.restoredHead, rr.restoredKVs, rr.restoredLeases, err = readEtcd(ctx, en.etcdConfig.ClientURL); err != nil {
		return err
	}
	held := en.relay.Restore()
	rr.up = since()
	lg.Info("Restored etcd", zap.Int64("snapshot-revision", rr.snapRev()), zap.Int64("restored-revision", rr.restoredHead),
		zap.Duration("close", rec.etcdClose), zap.Int("held-connections", held))

	watches.Add(1)
	go func() {
		defer watches.Done()
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			if n, err := timelineChanges(en.proxy); err == nil && n > 0 {
				rr.detected = since()
				return
			}
			select {
			case <-watchCtx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return nil
}

// restoreEtcd closes etcd, restores the snapshot at snap into
// en.restoredDir with the revision bumped by bump and marked compacted (as
// etcdutl snapshot restore --bump-revision --mark-compacted), and starts
// etcd on it with the same URLs. It returns how long the close took.
func (en *env) restoreEtcd(snap string, bump uint64) (closing time.Duration, err error) {
	en.mu.Lock()
	defer en.mu.Unlock()
	if en.stopped || en.etcd == nil {
		return 0, errors.New("etcd is not running")
	}
	start := time.Now()
	en.etcd.Close()
	en.etcd = nil
	closing = time.Since(start)
	name := "etcd-snapcache-embedded" // server.StartEmbedded's member name
	if err := snapshot.NewV3(zap.NewNop()).Restore(snapshot.RestoreConfig{
		SnapshotPath:        snap,
		Name:                name,
		OutputDataDir:       en.restoredDir,
		PeerURLs:            []string{en.etcdConfig.PeerURL},
		InitialCluster:      name + "=" + en.etcdConfig.PeerURL,
		InitialClusterToken: embed.NewConfig().InitialClusterToken,
		RevisionBump:        bump,
		MarkCompacted:       true,
	}); err != nil {
		return closing, fmt.Errorf("restoring etcd's snapshot: %w", err)
	}
	cfg := en.etcdConfig
	cfg.Dir = en.restoredDir
	e, err := server.StartEmbedded(cfg)
	if err != nil {
		return closing, fmt.Errorf("starting the restored etcd: %w", err)
	}
	en.etcdConfig, en.etcd = cfg, e
	return closing, nil
}

// directClient is a client of etcd itself, not of the proxy.
func directClient(url string) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{Endpoints: []string{url}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
}

// saveSnapshot saves etcd's snapshot (Maintenance.Snapshot) into path.
func saveSnapshot(ctx context.Context, url, path string) error {
	cli, err := directClient(url)
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	rc, err := cli.Snapshot(ctx)
	if err != nil {
		return fmt.Errorf("etcd's snapshot: %w", err)
	}
	defer rc.Close()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, rc); err != nil {
		f.Close()
		return fmt.Errorf("etcd's snapshot: %w", err)
	}
	return f.Close()
}

// snapshotConsistentIndex reads the raft index a snapshot holds every
// entry up to: the consistent index in its meta bucket.
func snapshotConsistentIndex(path string) (uint64, error) {
	db, err := bolt.Open(path, 0o400, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		return 0, err
	}
	defer db.Close()
	var ci uint64
	err = db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("meta"))
		if b == nil {
			return errors.New("the snapshot has no meta bucket")
		}
		v := b.Get([]byte("consistent_index"))
		if len(v) != 8 {
			return fmt.Errorf("the snapshot's consistent index is %x", v)
		}
		ci = binary.BigEndian.Uint64(v)
		return nil
	})
	return ci, err
}

// readEtcd reads etcd's revision, every key and every lease.
func readEtcd(ctx context.Context, url string) (rev int64, kvs []*mvccpb.KeyValue, leases []int64, err error) {
	cli, err := directClient(url)
	if err != nil {
		return 0, nil, nil, err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, "", clientv3.WithPrefix())
	if err != nil {
		return 0, nil, nil, fmt.Errorf("reading the restored etcd: %w", err)
	}
	ls, err := cli.Leases(ctx)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("reading the restored etcd's leases: %w", err)
	}
	for _, l := range ls.Leases {
		leases = append(leases, int64(l.ID))
	}
	slices.Sort(leases)
	return resp.Header.Revision, resp.Kvs, leases, nil
}

// timelineChanges is etcd_snapcache_timeline_changes_total, over its signs.
func timelineChanges(s *server.Server) (float64, error) {
	mfs, err := s.Registry().Gather()
	if err != nil {
		return 0, err
	}
	n := 0.0
	for _, mf := range mfs {
		if mf.GetName() == "etcd_snapcache_timeline_changes_total" {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n, nil
}

// persistedUpTo returns the requests persisted in the WAL of dataDir up to
// the raft index index.
func persistedUpTo(t *testing.T, lg *zap.Logger, dataDir string, index uint64) ([]model.EtcdRequest, error) {
	state, ents, err := report.ReadWAL(lg, dataDir)
	if err != nil {
		return nil, err
	}
	var kept []*raftpb.Entry
	for _, e := range ents {
		if e.GetIndex() <= index {
			kept = append(kept, e)
		}
	}
	commit := min(state.GetCommit(), index)
	return persistedFromEntries(t, lg, &raftpb.HardState{Term: new(state.GetTerm()), Vote: new(state.GetVote()), Commit: &commit}, kept)
}

// lastRevision is the revision a replay ends at.
func lastRevision(r *model.EtcdReplay) int64 {
	rev := int64(1)
	for {
		if _, err := r.StateForRevision(rev + 1); err != nil {
			return rev
		}
		rev++
	}
}

// validateRestore validates a run of the restore fault as two histories.
//
// What the framework's model cannot do: it is one etcd, whose state only
// ever moves forward from an empty keyspace, and whose acknowledged writes
// stay. After the restore, etcd's state is the snapshot's, and every write
// acknowledged after the snapshot is gone; the reads after the restore
// contradict the writes acknowledged before it, so the run as a whole is
// (rightly) not linearizable. Nor can a validation start from a given
// state: validate.ValidateAndReturnVisualize takes only the reports and the
// persisted requests, and builds its model (whose states are unexported)
// from an empty etcd; the framework's failpoints all keep etcd's history
// (crashes, partitions, member changes), and its "persisted requests" only
// settle the outcome of writes the client saw fail.
//
// What it can: each answer through the proxy comes from one of two etcd
// histories, told apart by its revision (the bump puts every revision of
// the restored etcd above every revision of the old one):
//
//   - the old one, validated as any run: its answers (and the writes whose
//     outcome the client does not know, called before the restored etcd
//     was reachable) with the old etcd's WAL.
//   - the new one, which is the old one up to the snapshot, then the
//     restored etcd's: its answers (and the writes of unknown outcome that
//     may have reached the restored etcd) after synthetic operations that
//     replay the old WAL up to the snapshot's consistent index, with the
//     old WAL's requests up to there followed by the restored etcd's WAL.
//     The bump is taken out (relabel): a revision from the bump on moves
//     down by it, so that the restored etcd's first write follows the
//     snapshot's revision; the bump's compaction becomes a compaction at
//     the snapshot's revision; a revision of the lost history named in a
//     request, compacted in the restored etcd, stays compacted. The map
//     is one to one on every revision the restored etcd can report, and
//     keeps their order, so the model's verdicts are those the restored
//     etcd's own history would get; an answer carrying a revision of the
//     lost history, which the restored etcd cannot report, fails.
//
// The reports are not changed: the report saved for a failed run is the
// whole run as recorded.
func validateRestore(t *testing.T, lg *zap.Logger, en *env, tf traffic.Traffic, rec *recording, persistedOld []model.EtcdRequest) validate.RobustnessResult {
	t.Helper()
	rr := rec.restore
	snapRev := rr.snapRev()

	// The snapshot's history: the old WAL up to its consistent index.
	inSnapshot, err := persistedUpTo(t, lg, en.dataDir, rr.consistentIndex)
	if err != nil {
		t.Fatalf("reading etcd's WAL up to the snapshot: %v", err)
	}
	oldHead := lastRevision(model.NewReplay(persistedOld))
	if oldHead >= rr.restoredHead || snapRev < 2 {
		t.Fatalf("the old history ends at %d, the snapshot is at %d: the bump of %d does not set them apart", oldHead, snapRev, restoreBump)
	}
	persistedNew, err := report.PersistedRequests(lg, []string{en.restoredDir})
	if err != nil {
		t.Fatalf("reading the restored etcd's WAL: %v", err)
	}

	old, restored, st, problems := splitAtRestore(rec, snapRev, oldHead)
	t.Logf("restore: snapshot at revision %d (raft index %d) saved at %v; upstream cut at %v; the restored etcd (revision %d) reached at %v; the proxy counted the change at %v",
		snapRev, rr.consistentIndex, rr.snapshotDone.Round(time.Millisecond), rr.cut.Round(time.Millisecond), rr.restoredHead,
		rr.up.Round(time.Millisecond), rr.detected.Round(time.Millisecond))
	t.Logf("restore: the old history ends at %d: %d writes acknowledged after the snapshot were lost; %d answers from the old history, %d from the restored etcd; %d answers from the old history to calls after the restored etcd was reachable (reads from the cache before the proxy noticed); %d writes of unknown outcome in both histories, %d answers of unknown origin; %d watches from the old history, %d from the restored etcd, %d with no events",
		oldHead, st.lost, st.old, st.restored, st.oldAfterUp, st.unknownBoth, st.ambiguous, st.oldWatches, st.restoredWatches, st.emptyWatches)
	for _, p := range problems {
		t.Error(p)
	}
	if st.lost == 0 {
		t.Errorf("no acknowledged write was lost: the restore did not change the history")
	}
	if st.restored == 0 {
		t.Errorf("no answer from the restored etcd")
	}
	if rr.detected == 0 {
		t.Errorf("the proxy did not count a change of etcd's history (etcd_snapcache_timeline_changes_total)")
	}
	checkWatchesEnded(t, rec)

	resultOld := validateHistory(t, lg, "old history", tf, old, persistedOld)

	// The new history: the snapshot's requests, one client's operations
	// each answered as the model answers them, after the read that found
	// etcd empty and before every operation of the new history; then the
	// bump's compaction; then the restored etcd's.
	l := &relabel{snap: snapRev, bump: restoreBump}
	compaction := model.EtcdRequest{Type: model.Compact, Compact: &model.CompactRequest{Revision: snapRev}}
	empty, ok := emptyRead(rec.reports)
	if !ok {
		t.Fatal("no read found etcd empty")
	}
	synthetic := report.ClientReport{ClientID: -1}
	stream := 0
	for _, r := range rec.reports {
		for _, op := range r.KeyValue {
			stream = max(stream, op.ClientId+1)
		}
	}
	empty.ClientId = stream
	synthetic.KeyValue = append(synthetic.KeyValue, empty)
	// The replay's first state is an empty etcd with the snapshot's keys.
	state, _ := model.NewReplay(inSnapshot).StateForRevision(1)
	at := empty.Return
	for i, req := range append(slices.Clone(inSnapshot), compaction) {
		if i == len(inSnapshot) {
			// The snapshot's requests must leave the restored etcd's
			// revision, keys and leases (the replay's states stop at the
			// last write: lease grants after it count too).
			if err := sameState(state, snapRev, rr); err != nil {
				t.Fatalf("the WAL up to the snapshot's consistent index %d does not replay to the restored etcd: %v", rr.consistentIndex, err)
			}
		}
		var resp model.MaybeEtcdResponse
		state, resp = state.Step(req)
		synthetic.KeyValue = append(synthetic.KeyValue, porcupine.Operation{ClientId: stream, Input: req, Output: resp, Call: at + 1, Return: at + 2})
		at += 2
	}
	newReports := []report.ClientReport{synthetic}
	for _, r := range restored {
		nr := report.ClientReport{ClientID: r.ClientID}
		for _, op := range r.KeyValue {
			if op.Call <= at {
				t.Fatalf("an operation of the new history called at %v, before the snapshot's requests replayed at %v", time.Duration(op.Call), time.Duration(at))
			}
			op.Input = l.request(op.Input.(model.EtcdRequest))
			op.Output = l.response(op.Output.(model.MaybeEtcdResponse))
			nr.KeyValue = append(nr.KeyValue, op)
		}
		for _, w := range r.Watch {
			nr.Watch = append(nr.Watch, l.watch(w))
		}
		newReports = append(newReports, nr)
	}
	persistedRestored := slices.Concat(inSnapshot, []model.EtcdRequest{compaction})
	for _, req := range persistedNew {
		persistedRestored = append(persistedRestored, l.request(req))
	}
	for _, p := range l.problems {
		t.Errorf("an answer of the restored etcd's history: %s", p)
	}
	t.Logf("new history: %d requests in the snapshot, %d in the restored etcd's WAL", len(inSnapshot), len(persistedNew))
	resultNew := validateHistory(t, lg, "new history", tf, newReports, persistedRestored)
	if resultOld.Linearization.Status != validate.Success {
		return resultOld
	}
	return resultNew
}

// sameState compares a model's state with the restored etcd's revision
// (without the bump, rev), keys (values, mod revisions, versions, leases)
// and leases.
func sameState(state model.EtcdState, rev int64, rr *restoreRecord) error {
	if state.Revision != rev {
		return fmt.Errorf("the WAL ends at revision %d, the restored etcd at %d (%d with the bump)", state.Revision, rev, rr.restoredHead)
	}
	type kv struct {
		key   string
		value model.ValueRevision
		lease int64
	}
	var want, got []kv
	keys, values, leases := state.KeysValueLeases()
	for i := range keys {
		want = append(want, kv{keys[i], values[i], leases[i]})
	}
	for _, k := range rr.restoredKVs {
		got = append(got, kv{string(k.Key), model.ValueRevision{Value: model.ToValueOrHash(string(k.Value)), ModRevision: k.ModRevision, Version: k.Version}, k.Lease})
	}
	if !slices.Equal(want, got) {
		return fmt.Errorf("keys: the WAL has %v, the restored etcd %v", want, got)
	}
	if !slices.Equal(state.Leases, rr.restoredLeases) {
		return fmt.Errorf("leases: the WAL has %v, the restored etcd %v", state.Leases, rr.restoredLeases)
	}
	return nil
}

// emptyRead returns the read that found etcd empty (revision 1).
func emptyRead(reports []report.ClientReport) (porcupine.Operation, bool) {
	for _, r := range reports {
		for _, op := range r.KeyValue {
			req, resp := op.Input.(model.EtcdRequest), op.Output.(model.MaybeEtcdResponse)
			if req.IsRead() && resp.Error == "" && resp.Revision == 1 {
				return op, true
			}
		}
	}
	return porcupine.Operation{}, false
}

// splitStats counts what splitAtRestore did.
type splitStats struct {
	old, restored int
	// lost counts the revisions of writes acknowledged in the old history
	// after the snapshot.
	lost int
	// oldAfterUp counts the answers from the old history to calls made
	// once the restored etcd was reachable.
	oldAfterUp int
	// unknownBoth counts the writes of unknown outcome that may have
	// taken effect in either history; ambiguous, the answers without a
	// revision (compactions) that either etcd may have given, which both
	// histories take as of unknown outcome.
	unknownBoth, ambiguous                    int
	oldWatches, restoredWatches, emptyWatches int
}

// splitAtRestore splits the reports of a restore run into the old
// history's and the new one's, and returns what no etcd could have
// answered.
//
// An answer with a revision (a header, a watch event or progress
// notification) is the old history's up to oldHead, the restored etcd's
// from its first revision (snapRev + restoreBump), and a problem between.
// A watch is one history's whole. Without a revision:
//
//   - a failed request (of unknown outcome, if a write) belongs to the old
//     history if called before the restored etcd was reachable, and to the
//     new one if called after the snapshot was saved: it may have reached
//     either etcd, or neither, and each history's WAL decides (the
//     framework's patching drops a write that is not in it). Called before
//     the snapshot was saved, it is in the snapshot if it took effect, and
//     the snapshot's requests stand for it in the new history; and it
//     cannot reach the restored etcd, which is reachable more than
//     lostFor later, past its timeout.
//   - an answer (a compaction's) returned before the restored etcd was
//     reachable is the old history's, one called after it the new one's;
//     one under way then could be either etcd's, and goes to both as of
//     unknown outcome.
func splitAtRestore(rec *recording, snapRev, oldHead int64) (old, restored []report.ClientReport, st splitStats, problems []string) {
	rr := rec.restore
	first := snapRev + restoreBump
	lost := map[int64]bool{}
	problem := func(format string, args ...any) {
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	for _, r := range rec.reports {
		o := report.ClientReport{ClientID: r.ClientID}
		n := report.ClientReport{ClientID: r.ClientID}
		for _, op := range r.KeyValue {
			req, resp := op.Input.(model.EtcdRequest), op.Output.(model.MaybeEtcdResponse)
			rev := int64(0)
			if resp.Error == "" && resp.Revision > 0 {
				rev = resp.Revision
			}
			switch {
			case rev > 0 && rev <= oldHead:
				o.KeyValue = append(o.KeyValue, op)
				st.old++
				if rev > snapRev && wrote(req, resp) && !lost[rev] {
					lost[rev] = true
					st.lost++
				}
				if req.Type == model.Range && req.Range.Revision == 0 && op.Call >= int64(rr.cut) {
					problem("client %d: a linearizable read %s called at %v, after etcd stopped at %v, was answered from the old history (revision %d)",
						op.ClientId, rangeString(req.Range), time.Duration(op.Call), rr.cut, rev)
				}
				if op.Call >= int64(rr.up) {
					st.oldAfterUp++
					if rr.detected > 0 && op.Call > int64(rr.detected) {
						problem("client %d: %v called at %v, after the proxy counted the change of history at %v, was answered from the old history (revision %d)",
							op.ClientId, req.Type, time.Duration(op.Call), rr.detected, rev)
					}
				}
			case rev >= first:
				n.KeyValue = append(n.KeyValue, op)
				st.restored++
			case rev > 0:
				problem("client %d: %v called at %v answered with revision %d, of neither history (the old one ends at %d, the restored etcd starts at %d)",
					op.ClientId, req.Type, time.Duration(op.Call), rev, oldHead, first)
			case resp.Error != "":
				inOld, inNew := op.Call < int64(rr.up), op.Call > int64(rr.snapshotDone)
				if inOld {
					o.KeyValue = append(o.KeyValue, op)
				}
				if inNew {
					n.KeyValue = append(n.KeyValue, op)
				}
				if inOld && inNew && !req.IsRead() {
					st.unknownBoth++
				}
			case op.Return < int64(rr.up):
				o.KeyValue = append(o.KeyValue, op)
				st.old++
			case op.Call >= int64(rr.up):
				n.KeyValue = append(n.KeyValue, op)
				st.restored++
			default:
				op.Output = model.MaybeEtcdResponse{Error: "answered across the restore, by either etcd"}
				o.KeyValue = append(o.KeyValue, op)
				n.KeyValue = append(n.KeyValue, op)
				st.ambiguous++
			}
		}
		for _, w := range r.Watch {
			lo, hi := int64(0), int64(0)
			for _, resp := range w.Responses {
				if resp.Error != "" {
					continue
				}
				revs := []int64{resp.Revision}
				for _, e := range resp.Events {
					revs = append(revs, e.Revision)
				}
				for _, rev := range revs {
					if lo == 0 || rev < lo {
						lo = rev
					}
					hi = max(hi, rev)
				}
			}
			switch {
			case hi == 0:
				st.emptyWatches++
			case hi <= oldHead:
				o.Watch = append(o.Watch, w)
				st.oldWatches++
			case lo >= first:
				n.Watch = append(n.Watch, w)
				st.restoredWatches++
			default:
				problem("client %d: a watch of %q from revision %d got revisions %d to %d: it mixes the old history (up to %d) with the restored etcd's (from %d)",
					r.ClientID, w.Request.Key, w.Request.Revision, lo, hi, oldHead, first)
			}
		}
		old = append(old, o)
		restored = append(restored, n)
	}
	return old, restored, st, problems
}

// wrote tells whether a successful transaction wrote.
func wrote(req model.EtcdRequest, resp model.MaybeEtcdResponse) bool {
	if req.Type != model.Txn || resp.Txn == nil {
		return false
	}
	ops := req.Txn.OperationsOnSuccess
	if resp.Txn.Failure {
		ops = req.Txn.OperationsOnFailure
	}
	return slices.ContainsFunc(ops, func(op model.EtcdOperation) bool { return op.Type != model.RangeOperation })
}

// checkWatchesEnded requires every watch open across the restore to end
// with a compacted cancel once the restored etcd was reachable: the
// fault's own watches, and each event collector's watch that got answers
// before the upstream was cut (the collector then watches again from the
// compaction revision it was given).
func checkWatchesEnded(t *testing.T, rec *recording) {
	t.Helper()
	rr := rec.restore
	for _, r := range rec.reports {
		var across []model.WatchOperation
		switch {
		case r.ClientID == rr.watchClient:
			across = r.Watch
		case slices.Contains(rec.collectors, r.ClientID):
			for i := len(r.Watch) - 1; i >= 0; i-- {
				if w := r.Watch[i]; len(w.Responses) > 0 && w.Responses[0].Time < rr.cut {
					across = append(across, w)
					break
				}
			}
			if len(across) == 0 {
				t.Errorf("client %d: no event collector's watch was open before the restore", r.ClientID)
			}
		}
		for _, w := range across {
			var last *model.WatchResponse
			if len(w.Responses) > 0 {
				last = &w.Responses[len(w.Responses)-1]
			}
			switch {
			case last == nil || !strings.Contains(last.Error, "compacted"):
				t.Errorf("client %d: the watch of %q from revision %d, open across the restore, did not end as compacted (%d responses, last %+v)",
					r.ClientID, w.Request.Key, w.Request.Revision, len(w.Responses), last)
			case last.Time < rr.up:
				t.Errorf("client %d: the watch of %q from revision %d ended as compacted at %v, before the restored etcd was reachable at %v",
					r.ClientID, w.Request.Key, w.Request.Revision, last.Time, rr.up)
			}
		}
	}
}

// relabel takes the bump out of the restored etcd's revisions: those from
// snap+bump on move down by bump, those up to snap (the snapshot's keys')
// stay. Revisions between, those of the lost history (and of none), are
// compacted in the restored etcd: named in a request, they become a
// revision compacted in the model too (at), or one no key has (cmp);
// reported in an answer, they are a problem.
type relabel struct {
	snap, bump int64
	problems   []string
}

// at maps a revision a read, a watch or a compaction names: 0 (the head)
// and below stay.
func (l *relabel) at(rev int64) int64 {
	switch {
	case rev >= l.snap+l.bump:
		return rev - l.bump
	case rev <= 0:
		return rev
	default:
		return min(rev, l.snap-1)
	}
}

// cmp maps the mod revision a transaction compares a key's with.
func (l *relabel) cmp(rev int64) int64 {
	switch {
	case rev >= l.snap+l.bump:
		return rev - l.bump
	case rev <= l.snap:
		return rev
	default:
		return -1
	}
}

// seen maps a revision an answer reports.
func (l *relabel) seen(rev int64, what string) int64 {
	switch {
	case rev >= l.snap+l.bump:
		return rev - l.bump
	case rev <= l.snap:
		return rev
	default:
		if len(l.problems) < 20 {
			l.problems = append(l.problems, fmt.Sprintf("%s has revision %d, of the lost history (the snapshot is at %d, the restored etcd starts at %d)", what, rev, l.snap, l.snap+l.bump))
		}
		return rev
	}
}

func (l *relabel) request(r model.EtcdRequest) model.EtcdRequest {
	switch {
	case r.Range != nil:
		rg := *r.Range
		rg.Revision = l.at(rg.Revision)
		r.Range = &rg
	case r.Txn != nil:
		txn := *r.Txn
		txn.Conditions = slices.Clone(txn.Conditions)
		for i := range txn.Conditions {
			txn.Conditions[i].ExpectedRevision = l.cmp(txn.Conditions[i].ExpectedRevision)
		}
		r.Txn = &txn
	case r.Compact != nil:
		c := *r.Compact
		c.Revision = l.at(c.Revision)
		r.Compact = &c
	}
	return r
}

func (l *relabel) response(r model.MaybeEtcdResponse) model.MaybeEtcdResponse {
	r.PersistedRevision = l.seen(r.PersistedRevision, "a persisted response")
	r.Revision = l.seen(r.Revision, "a response header")
	if r.Range != nil {
		rg := l.kvs(*r.Range)
		r.Range = &rg
	}
	if r.Txn != nil {
		txn := *r.Txn
		txn.Results = slices.Clone(txn.Results)
		for i := range txn.Results {
			txn.Results[i].RangeResponse = l.kvs(txn.Results[i].RangeResponse)
		}
		r.Txn = &txn
	}
	return r
}

func (l *relabel) kvs(r model.RangeResponse) model.RangeResponse {
	r.KVs = slices.Clone(r.KVs)
	for i := range r.KVs {
		r.KVs[i].ModRevision = l.seen(r.KVs[i].ModRevision, fmt.Sprintf("key %q", r.KVs[i].Key))
	}
	return r
}

func (l *relabel) watch(w model.WatchOperation) model.WatchOperation {
	if w.Request.Revision == l.snap+l.bump {
		// A watch from the restored etcd's first revision gets the
		// events after it: the bump made that revision, which has no
		// event of its own, where its counterpart in the model, the
		// snapshot's revision, has the snapshot's last write.
		w.Request.Revision = l.snap + 1
	} else {
		w.Request.Revision = l.at(w.Request.Revision)
	}
	w.Responses = slices.Clone(w.Responses)
	for i := range w.Responses {
		resp := &w.Responses[i]
		if resp.Error != "" {
			resp.Revision = l.at(resp.Revision)
			continue
		}
		resp.Revision = l.seen(resp.Revision, "a watch response header")
		resp.Events = slices.Clone(resp.Events)
		for j := range resp.Events {
			e := &resp.Events[j]
			e.Revision = l.seen(e.Revision, fmt.Sprintf("a watch event of %q", e.Key))
			if e.PrevValue != nil {
				prev := *e.PrevValue
				prev.ModRevision = l.seen(prev.ModRevision, fmt.Sprintf("the previous value in a watch event of %q", e.Key))
				e.PrevValue = &prev
			}
		}
	}
	return w
}

// compareAfterRestore compares the proxy's answers with the restored
// etcd's once the traffic is over: at every revision of the old history
// from the snapshot's on (the lost writes'), both must refuse the read as
// compacted; at the head and at every revision of the restored etcd, the
// same keys, linearizable and serializable.
func compareAfterRestore(t *testing.T, en *env, rec *recording) {
	t.Helper()
	rr := rec.restore
	if rr == nil || rr.restoredHead == 0 {
		t.Fatal("the restore did not happen")
	}
	var lostHead int64
	for _, r := range rec.reports {
		for _, op := range r.KeyValue {
			if resp := op.Output.(model.MaybeEtcdResponse); resp.Error == "" && resp.Revision < rr.restoredHead {
				lostHead = max(lostHead, resp.Revision)
			}
		}
	}
	direct, err := directClient(en.etcdConfig.ClientURL)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	proxied, err := clientv3.New(clientv3.Config{Endpoints: []string{en.proxy.Addr()}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer proxied.Close()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	head, err := direct.Get(ctx, "tombstone")
	if err != nil {
		t.Fatal(err)
	}
	compared, compacted, problems := 0, 0, 0
	fail := func(format string, args ...any) {
		if problems < 20 {
			t.Errorf(format, args...)
		}
		problems++
	}
	for _, rev := range slices.Concat([]int64{0}, seq(rr.snapRev(), lostHead), seq(rr.restoredHead, head.Header.Revision)) {
		for _, serializable := range []bool{false, true} {
			opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithRev(rev)}
			if serializable {
				opts = append(opts, clientv3.WithSerializable())
			}
			want, werr := direct.Get(ctx, "", opts...)
			got, gerr := proxied.Get(ctx, "", opts...)
			switch {
			case rev > 0 && rev < rr.restoredHead && !isCompacted(werr):
				t.Fatalf("etcd answered a read at revision %d, before its first (%d), with %v", rev, rr.restoredHead, werr)
			case isCompacted(werr) && isCompacted(gerr):
				compacted++
			case werr != nil || gerr != nil:
				fail("a read at revision %d (serializable %v): etcd answered %v, the proxy %v", rev, serializable, werr, gerr)
			default:
				if err := sameRange(want, got); err != nil {
					fail("a read at revision %d (serializable %v): %v", rev, serializable, err)
				}
				compared++
			}
		}
	}
	t.Logf("after the restore: %d reads through the proxy answered as etcd does, %d refused as compacted by both (revisions %d to %d, lost, and those etcd compacted since); %d differ",
		compared, compacted, rr.snapRev(), lostHead, problems)
}

func seq(from, to int64) []int64 {
	var s []int64
	for r := from; r <= to; r++ {
		s = append(s, r)
	}
	return s
}

func isCompacted(err error) bool {
	return err != nil && strings.Contains(err.Error(), "required revision has been compacted")
}

// sameRange compares two answers to a Range: header revision, count, and
// every key with its value, revisions, version and lease.
func sameRange(want, got *clientv3.GetResponse) error {
	if want.Header.Revision != got.Header.Revision || want.Count != got.Count || want.More != got.More || len(want.Kvs) != len(got.Kvs) {
		return fmt.Errorf("etcd: revision %d, %d keys (count %d); proxy: revision %d, %d keys (count %d)",
			want.Header.Revision, len(want.Kvs), want.Count, got.Header.Revision, len(got.Kvs), got.Count)
	}
	for i, w := range want.Kvs {
		g := got.Kvs[i]
		if string(w.Key) != string(g.Key) || string(w.Value) != string(g.Value) || w.CreateRevision != g.CreateRevision ||
			w.ModRevision != g.ModRevision || w.Version != g.Version || w.Lease != g.Lease {
			return fmt.Errorf("etcd has %q@%d (created %d, version %d, lease %x), the proxy %q@%d (created %d, version %d, lease %x)",
				w.Key, w.ModRevision, w.CreateRevision, w.Version, w.Lease, g.Key, g.ModRevision, g.CreateRevision, g.Version, g.Lease)
		}
	}
	return nil
}
