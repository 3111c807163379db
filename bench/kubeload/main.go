// Command kubeload is the client side of bench/e2e's BenchmarkControlPlane:
// a Kubernetes cluster's clients, with client-go, against N kube-apiservers.
// It is a module of its own, so that client-go stays out of the main
// module; the benchmark runs it as a separate process (bin/kubeload, from
// `make kubeload`).
//
//	kubeload populate -servers=... -ca=... -token=... -objects=N -nodes=M
//
// creates the cluster's objects through the kube-apiservers (Nodes and
// their Leases, Pods and ConfigMaps in namespaces; the layout is a function
// of -objects, -nodes and -namespaces) and prints one JSON line.
//
//	kubeload run -servers=... (same layout flags)
//
// runs the cluster's clients: informers (client-go shared informers of
// pods, nodes, configmaps and leases; -informers client processes per
// kube-apiserver, each on its own connection) and the writers and readers
// (kubelet heartbeats, pod and node status updates, creates and deletes,
// GETs, consistent LISTs, LISTs at a resourceVersion), each at its rate.
// Every client has a home kube-apiserver and reaches the others only when
// its home is not ready, as through a load balancer. It reads commands on
// stdin, one a line, and answers each with one JSON line on stdout:
//
//   - synced: wait until every informer has synced;
//   - barrier: write a token on a barrier object of each resource and wait
//     until every informer has seen it (every informer is caught up);
//   - pause: start no more ops of the workload (heartbeats, writes, reads;
//     those in flight go on), until resume; informers go on, and barriers
//     still write (-paused: the workload starts paused);
//   - resume: start the workload's ops again;
//   - report: what was measured since the last report (op latencies and
//     errors, informer event delays, informers' lists, watches and
//     errors), and start over;
//   - stop (or end of input): stop and exit.
//
// The informer event delay: each write stamps its object (an annotation)
// with its wall time; an informer's handler that sees a new stamp records
// now minus the stamp.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

func main() {
	if len(os.Args) < 2 || (os.Args[1] != "populate" && os.Args[1] != "run") {
		fmt.Fprintln(os.Stderr, "usage: kubeload populate|run -servers=https://127.0.0.1:PORT,... -ca=FILE -token=TOKEN [flags]")
		os.Exit(2)
	}
	cmd := os.Args[1]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	servers := fs.String("servers", "", "the kube-apiservers, comma-separated (https://127.0.0.1:PORT)")
	ca := fs.String("ca", "", "a PEM bundle of the CAs of every kube-apiserver's serving certificate")
	token := fs.String("token", "", "a bearer token every kube-apiserver accepts")
	objects := fs.Int("objects", 100000, "objects in the cluster: Nodes, as many Leases, the rest half Pods, half ConfigMaps")
	nodes := fs.Int("nodes", 500, "Nodes (and their Leases)")
	namespaces := fs.Int("namespaces", 0, "namespaces of the Pods and ConfigMaps (0: one per 1,000 objects, at least 10)")

	concurrency := fs.Int("concurrency", 48, "populate: creates in flight")

	informers := fs.Int("informers", 2, "run: informer clients per kube-apiserver (each informs on pods, nodes, configmaps and leases)")
	writers := fs.Int("writers", 2, "run: writer and reader clients per kube-apiserver")
	workers := fs.Int("workers", 64, "run: most ops in flight (an op due with none free is skipped)")
	runID := fs.String("run-id", "r", "run: a name for the objects this run creates, unique per run")
	watchList := fs.Bool("watch-list", false, "run: informers use watch-list (client-go's WatchListClient) instead of LIST then WATCH")
	waitTimeout := fs.Duration("wait-timeout", 10*time.Minute, "run: bound of the synced and barrier commands")
	scale := fs.Float64("rate-scale", 1, "run: multiplies every rate but the heartbeats")
	heartbeat := fs.Duration("heartbeat", 10*time.Second, "run: each node's Lease renewal period (0: none)")
	podStatus := fs.Float64("pod-status-rate", 25, "run: pod status updates per second")
	cmUpdate := fs.Float64("cm-update-rate", 10, "run: ConfigMap updates per second")
	nodeUpdate := fs.Float64("node-status-rate", 2, "run: node status updates per second")
	podChurn := fs.Float64("pod-churn-rate", 5, "run: pod creates per second, and as many deletes")
	cmChurn := fs.Float64("cm-churn-rate", 5, "run: ConfigMap creates per second, and as many deletes")
	get := fs.Float64("get-rate", 20, "run: GETs per second")
	list := fs.Float64("list-rate", 5, "run: consistent LISTs of a namespace per second")
	listRV := fs.Float64("list-rv-rate", 5, "run: LISTs of a namespace at a resourceVersion of the last minute per second")
	paused := fs.Bool("paused", false, "run: the workload starts paused (until a resume command)")
	fs.Parse(os.Args[2:])

	cl, err := newCluster(*servers, *ca, *token)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubeload:", err)
		os.Exit(2)
	}
	lay := newLayout(*objects, *nodes, *namespaces)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := cl.checkHealth(ctx, 500*time.Millisecond); err != nil {
		fmt.Fprintln(os.Stderr, "kubeload:", err)
		os.Exit(1)
	}
	out := json.NewEncoder(os.Stdout)

	if cmd == "populate" {
		res := populate(ctx, cl, lay, *concurrency)
		out.Encode(res)
		if res.Errors > 0 {
			os.Exit(1)
		}
		return
	}

	// Read on first use by client-go's reflectors.
	os.Setenv("KUBE_FEATURE_WatchListClient", strconv.FormatBool(*watchList))
	st := newStats()
	infs, err := startInformers(ctx, cl, st, *informers)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubeload:", err)
		os.Exit(1)
	}
	w, err := newWorkload(cl, lay, st, *writers, *workers, *runID)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubeload:", err)
		os.Exit(1)
	}
	s := *scale
	w.paused.Store(*paused)
	w.start(ctx, rates{
		heartbeat: *heartbeat,
		podStatus: s * *podStatus, cmUpdate: s * *cmUpdate, nodeUpdate: s * *nodeUpdate,
		podChurn: s * *podChurn, cmChurn: s * *cmChurn,
		get: s * *get, list: s * *list, listRV: s * *listRV,
	})

	last := time.Now()
	in := bufio.NewScanner(os.Stdin)
	barriers := 0
	for in.Scan() {
		c := strings.TrimSpace(in.Text())
		start := time.Now()
		r := reply{Cmd: c, OK: true}
		switch c {
		case "synced":
			wctx, wcancel := context.WithTimeout(ctx, *waitTimeout)
			for !allSynced(infs) && wctx.Err() == nil {
				time.Sleep(20 * time.Millisecond)
			}
			if !allSynced(infs) {
				r.OK, r.Error = false, "informers not synced"
			}
			wcancel()
		case "barrier":
			barriers++
			wctx, wcancel := context.WithTimeout(ctx, *waitTimeout)
			if err := w.barrier(wctx, infs, fmt.Sprintf("%s-%d-%d", *runID, barriers, start.UnixNano())); err != nil {
				r.OK, r.Error = false, err.Error()
			}
			wcancel()
		case "pause":
			w.paused.Store(true)
		case "resume":
			w.paused.Store(false)
		case "report":
			rep := st.take(start.Sub(last).Seconds())
			last = start
			r.Report = &rep
		case "stop":
		case "":
			continue
		default:
			r.OK, r.Error = false, "unknown command"
		}
		r.Secs = time.Since(start).Seconds()
		out.Encode(r)
		if c == "stop" {
			break
		}
	}
	cancel()
	done := make(chan struct{})
	go func() { w.ops.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(opTimeout + 5*time.Second):
	}
}

func allSynced(infs []*informer) bool {
	for _, in := range infs {
		if !in.inf.HasSynced() {
			return false
		}
	}
	return true
}
