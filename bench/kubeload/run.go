package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// rates are the workload's open-loop rates, in ops per second (the
// heartbeats: one per node per heartbeat period).
type rates struct {
	heartbeat                       time.Duration
	podStatus, cmUpdate, nodeUpdate float64
	podChurn, cmChurn               float64 // creates per second, and as many deletes
	get, list, listRV               float64
}

// workload is the writers and readers of the load: kubelets' heartbeats
// and pod and node status updates, object creates and deletes, GETs,
// consistent LISTs and LISTs at a resourceVersion, each at its rate.
type workload struct {
	lay     layout
	st      *stats
	writers []*kubernetes.Clientset
	sem     chan struct{} // a slot per op in flight
	ops     sync.WaitGroup
	runID   string
	seq     atomic.Int64
	paused  atomic.Bool // no op starts (the heartbeats', the writes', the reads'); barriers still write

	leases    []atomic.Pointer[coordinationv1.Lease] // each node's Lease as its kubelet last wrote it
	leaseBusy []atomic.Bool                          // a node's heartbeat is in flight

	mu        sync.Mutex
	churnPods []string // namespace/name, oldest first
	churnCMs  []string
	rvs       []seenRV // resourceVersions of recent LISTs, oldest first
}

type seenRV struct {
	at time.Time
	rv string
}

// opTimeout bounds every op of the workload.
const opTimeout = 30 * time.Second

func newWorkload(cl *cluster, lay layout, st *stats, writersPerServer, workers int, runID string) (*workload, error) {
	w := &workload{lay: lay, st: st, sem: make(chan struct{}, workers), runID: runID,
		leases: make([]atomic.Pointer[coordinationv1.Lease], lay.nodes), leaseBusy: make([]atomic.Bool, lay.nodes)}
	for home := range cl.hosts {
		for k := range writersPerServer {
			cs, err := cl.clientset(home, fmt.Sprintf("writer-%d-%d", home, k))
			if err != nil {
				return nil, err
			}
			w.writers = append(w.writers, cs)
		}
	}
	return w, nil
}

func (w *workload) client(i int) *kubernetes.Clientset { return w.writers[i%len(w.writers)] }

// start runs every op kind at its rate until ctx ends.
func (w *workload) start(ctx context.Context, r rates) {
	if r.heartbeat > 0 && w.lay.nodes > 0 {
		go w.every(ctx, float64(w.lay.nodes)/r.heartbeat.Seconds(), "heartbeat", w.heartbeat)
	}
	go w.every(ctx, r.podStatus, "pod-status", w.podStatus)
	go w.every(ctx, r.cmUpdate, "cm-update", w.cmUpdate)
	go w.every(ctx, r.nodeUpdate, "node-status", w.nodeStatus)
	go w.every(ctx, r.podChurn, "pod-create", w.podCreate)
	go w.every(ctx, r.podChurn, "pod-delete", w.podDelete)
	go w.every(ctx, r.cmChurn, "cm-create", w.cmCreate)
	go w.every(ctx, r.cmChurn, "cm-delete", w.cmDelete)
	go w.every(ctx, r.get, "get", w.get)
	go w.every(ctx, r.list, "list", w.list)
	go w.every(ctx, r.listRV, "list-rv", w.listRV)
}

// errSkip: the op had nothing to do (not counted).
var errSkip = fmt.Errorf("skip")

// every starts op rate times a second (open loop: whether or not the last
// ones have returned), each on a free worker; with none free, it is
// counted as skipped.
func (w *workload) every(ctx context.Context, rate float64, kind string, op func(ctx context.Context, i int) error) {
	if rate <= 0 {
		return
	}
	t := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if w.paused.Load() {
			continue
		}
		select {
		case w.sem <- struct{}{}:
		default:
			w.st.skipped.Add(1)
			continue
		}
		w.ops.Add(1)
		go func() {
			defer w.ops.Done()
			defer func() { <-w.sem }()
			octx, cancel := context.WithTimeout(ctx, opTimeout)
			defer cancel()
			start := time.Now()
			err := op(octx, i)
			if err == errSkip || ctx.Err() != nil {
				return
			}
			w.st.op(kind, time.Since(start), err)
		}()
	}
}

// heartbeat renews a node's Lease as its kubelet does: an update of the
// Lease it last wrote, and on a conflict (or none yet) a GET first.
func (w *workload) heartbeat(ctx context.Context, i int) error {
	n := i % w.lay.nodes
	if !w.leaseBusy[n].CompareAndSwap(false, true) {
		return errSkip
	}
	defer w.leaseBusy[n].Store(false)
	leases := w.client(n).CoordinationV1().Leases(nodeLeaseNS)
	for attempt := 0; ; attempt++ {
		l := w.leases[n].Load()
		if l == nil {
			got, err := leases.Get(ctx, nodeName(n), metav1.GetOptions{})
			if err != nil {
				return err
			}
			l = got
		}
		l = l.DeepCopy()
		now := metav1.NewMicroTime(time.Now())
		l.Spec.RenewTime = &now
		if l.Annotations == nil {
			l.Annotations = map[string]string{}
		}
		l.Annotations[stampKey] = stampNow()
		got, err := leases.Update(ctx, l, metav1.UpdateOptions{})
		if err == nil {
			w.leases[n].Store(got)
			return nil
		}
		w.leases[n].Store(nil)
		if !apierrors.IsConflict(err) || attempt > 0 {
			return err
		}
	}
}

// podStatus patches a pod's status as its kubelet does (a strategic merge
// patch of pods/status).
func (w *workload) podStatus(ctx context.Context, i int) error {
	p := rand.IntN(w.lay.pods)
	ready := "True"
	if i%5 == 0 {
		ready = "False"
	}
	now := time.Now().UTC().Format(time.RFC3339)
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}},"status":{"phase":"Running","hostIP":"10.0.%d.%d","podIP":"10.%d.%d.%d","startTime":%q,"conditions":[{"type":"Ready","status":%q,"lastTransitionTime":%q},{"type":"ContainersReady","status":%q,"lastTransitionTime":%q}]}}`,
		stampKey, stampNow(), p%w.lay.nodes/250, 2+p%w.lay.nodes%250, 64+p/65536%64, p/256%256, p%256, now, ready, now, ready, now)
	_, err := w.client(p).CoreV1().Pods(w.lay.podNS(p)).Patch(ctx, podName(p), types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
	return err
}

// cmUpdate changes a ConfigMap (a merge patch, as kubectl apply and
// operators send).
func (w *workload) cmUpdate(ctx context.Context, i int) error {
	c := rand.IntN(w.lay.configmaps)
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}},"data":{"generation":"%d"}}`, stampKey, stampNow(), i)
	_, err := w.client(c).CoreV1().ConfigMaps(w.lay.cmNS(c)).Patch(ctx, cmName(c), types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

// nodeStatus patches a node's status as its kubelet does every few
// minutes (its conditions' heartbeat times).
func (w *workload) nodeStatus(ctx context.Context, i int) error {
	n := rand.IntN(w.lay.nodes)
	now := time.Now().UTC().Format(time.RFC3339)
	var conds []string
	for _, t := range []string{"MemoryPressure", "DiskPressure", "PIDPressure"} {
		conds = append(conds, fmt.Sprintf(`{"type":%q,"status":"False","lastHeartbeatTime":%q}`, t, now))
	}
	conds = append(conds, fmt.Sprintf(`{"type":"Ready","status":"True","lastHeartbeatTime":%q}`, now))
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}},"status":{"conditions":[%s,%s,%s,%s]}}`, stampKey, stampNow(), conds[0], conds[1], conds[2], conds[3])
	_, err := w.client(n).CoreV1().Nodes().Patch(ctx, nodeName(n), types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
	return err
}

func (w *workload) churnName(kind string) (int, string, string) {
	seq := int(w.seq.Add(1))
	i := rand.IntN(1 << 20)
	return i, nsName(i % w.lay.namespaces), fmt.Sprintf("churn-%s-%s-%07d", kind, w.runID, seq)
}

// churnLive is how many created objects of a kind the deletes leave.
const churnLive = 50

func (w *workload) podCreate(ctx context.Context, _ int) error {
	i, ns, name := w.churnName("pod")
	if _, err := w.client(i).CoreV1().Pods(ns).Create(ctx, w.lay.pod(i, name, ns), metav1.CreateOptions{}); err != nil {
		return err
	}
	w.mu.Lock()
	w.churnPods = append(w.churnPods, ns+"/"+name)
	w.mu.Unlock()
	return nil
}

func (w *workload) cmCreate(ctx context.Context, _ int) error {
	i, ns, name := w.churnName("cm")
	if _, err := w.client(i).CoreV1().ConfigMaps(ns).Create(ctx, w.lay.configMap(i, name, ns), metav1.CreateOptions{}); err != nil {
		return err
	}
	w.mu.Lock()
	w.churnCMs = append(w.churnCMs, ns+"/"+name)
	w.mu.Unlock()
	return nil
}

// pop takes the oldest of q's names, if q holds more than churnLive.
func (w *workload) pop(q *[]string) (ns, name string, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(*q) <= churnLive {
		return "", "", false
	}
	s := (*q)[0]
	*q = (*q)[1:]
	for i := range len(s) {
		if s[i] == '/' {
			return s[:i], s[i+1:], true
		}
	}
	return "", "", false
}

// podDelete deletes a pod as it goes in a cluster: a graceful delete (the
// pod is bound to a node: it gets a deletionTimestamp), and the kubelet's
// final delete with grace period 0 two seconds later.
func (w *workload) podDelete(ctx context.Context, i int) error {
	ns, name, ok := w.pop(&w.churnPods)
	if !ok {
		return errSkip
	}
	pods := w.client(i).CoreV1().Pods(ns)
	if err := pods.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return err
	}
	w.ops.Add(1)
	time.AfterFunc(2*time.Second, func() {
		defer w.ops.Done()
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		defer cancel()
		zero := int64(0)
		start := time.Now()
		err := pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
		if apierrors.IsNotFound(err) {
			err = nil
		}
		w.st.op("pod-delete-final", time.Since(start), err)
	})
	return nil
}

func (w *workload) cmDelete(ctx context.Context, i int) error {
	ns, name, ok := w.pop(&w.churnCMs)
	if !ok {
		return errSkip
	}
	return w.client(i).CoreV1().ConfigMaps(ns).Delete(ctx, name, metav1.DeleteOptions{})
}

// get reads a pod or a ConfigMap by name (no resourceVersion: a
// consistent read, from etcd).
func (w *workload) get(ctx context.Context, i int) error {
	if i%2 == 0 {
		p := rand.IntN(w.lay.pods)
		_, err := w.client(i).CoreV1().Pods(w.lay.podNS(p)).Get(ctx, podName(p), metav1.GetOptions{})
		return err
	}
	c := rand.IntN(w.lay.configmaps)
	_, err := w.client(i).CoreV1().ConfigMaps(w.lay.cmNS(c)).Get(ctx, cmName(c), metav1.GetOptions{})
	return err
}

// listNS lists a namespace's pods (even i) or ConfigMaps in pages of 500,
// at rv (with resourceVersionMatch=Exact) or consistently (rv ""), and
// returns the list's resourceVersion.
func (w *workload) listNS(ctx context.Context, i int, rv string) (string, error) {
	ns := nsName(rand.IntN(w.lay.namespaces))
	opts := metav1.ListOptions{Limit: 500, ResourceVersion: rv}
	if rv != "" {
		opts.ResourceVersionMatch = metav1.ResourceVersionMatchExact
	}
	listRV := ""
	for {
		var m metav1.ListMeta
		if i%2 == 0 {
			l, err := w.client(i).CoreV1().Pods(ns).List(ctx, opts)
			if err != nil {
				return "", err
			}
			m = l.ListMeta
		} else {
			l, err := w.client(i).CoreV1().ConfigMaps(ns).List(ctx, opts)
			if err != nil {
				return "", err
			}
			m = l.ListMeta
		}
		if listRV == "" {
			listRV = m.ResourceVersion
		}
		if m.Continue == "" {
			return listRV, nil
		}
		opts.Continue, opts.ResourceVersion, opts.ResourceVersionMatch = m.Continue, "", ""
	}
}

// rvWindow is how far back the LISTs at a resourceVersion go.
const rvWindow = time.Minute

// list is a consistent LIST of a namespace; its resourceVersion joins
// those the LISTs at a resourceVersion pick from.
func (w *workload) list(ctx context.Context, i int) error {
	rv, err := w.listNS(ctx, i, "")
	if err != nil {
		return err
	}
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	w.rvs = append(w.rvs, seenRV{now, rv})
	for len(w.rvs) > 0 && now.Sub(w.rvs[0].at) > rvWindow {
		w.rvs = w.rvs[1:]
	}
	return nil
}

// listRV LISTs a namespace at the exact resourceVersion of a LIST of the
// last minute.
func (w *workload) listRV(ctx context.Context, i int) error {
	w.mu.Lock()
	if len(w.rvs) == 0 {
		w.mu.Unlock()
		return errSkip
	}
	rv := w.rvs[rand.IntN(len(w.rvs))].rv
	w.mu.Unlock()
	_, err := w.listNS(ctx, i, rv)
	return err
}

// barrier writes token on every barrier object and waits until every
// informer has seen it: once it returns, every informer has caught up
// with the writes before it.
func (w *workload) barrier(ctx context.Context, infs []*informer, token string) error {
	patch := []byte(fmt.Sprintf(`{"metadata":{"annotations":{%q:%q,%q:%q}}}`, barrierKey, token, stampKey, stampNow()))
	cs := w.writers[0]
	writes := []func() error{
		func() error {
			_, err := cs.CoreV1().Pods(nsName(0)).Patch(ctx, barrierName, types.MergePatchType, patch, metav1.PatchOptions{})
			return err
		},
		func() error {
			_, err := cs.CoreV1().ConfigMaps(nsName(0)).Patch(ctx, barrierName, types.MergePatchType, patch, metav1.PatchOptions{})
			return err
		},
		func() error {
			_, err := cs.CoreV1().Nodes().Patch(ctx, barrierName, types.MergePatchType, patch, metav1.PatchOptions{})
			return err
		},
		func() error {
			_, err := cs.CoordinationV1().Leases(nodeLeaseNS).Patch(ctx, barrierName, types.MergePatchType, patch, metav1.PatchOptions{})
			return err
		},
	}
	for _, write := range writes {
		for {
			err := write()
			if err == nil {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("writing the barrier: %w", err)
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	for {
		behind := 0
		for _, in := range infs {
			if in.barrier.Load().(string) != token {
				behind++
			}
		}
		if behind == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d informers did not see the barrier", behind, len(infs))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// reply is a command's answer, one JSON line on stdout.
type reply struct {
	Cmd    string  `json:"cmd"`
	OK     bool    `json:"ok"`
	Secs   float64 `json:"secs"`
	Error  string  `json:"error,omitempty"`
	Report *report `json:"report,omitempty"`
}

func (r reply) String() string {
	b, _ := json.Marshal(r)
	return string(b)
}
