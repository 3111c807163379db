package main

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// populateResult is what populate prints.
type populateResult struct {
	Objects int      `json:"objects"`
	Secs    float64  `json:"secs"`
	Errors  int64    `json:"errors"`
	Samples []string `json:"error_samples,omitempty"`
}

// populate creates the layout through the kube-apiservers, concurrency
// creates at a time spread over them: the namespaces and their default
// ServiceAccounts (which the ServiceAccount admission of pods needs), the
// Nodes and their Leases, the Pods and ConfigMaps, and the barrier objects.
// An object that exists already counts as created; other errors are
// retried a few times.
func populate(ctx context.Context, cl *cluster, lay layout, concurrency int) populateResult {
	start := time.Now()
	var clients []*kubernetes.Clientset
	for i := range max(concurrency/4, len(cl.hosts)) {
		cs, err := cl.clientset(i, "populate")
		if err != nil {
			return populateResult{Errors: 1, Samples: []string{err.Error()}}
		}
		clients = append(clients, cs)
	}
	var created, failed atomic.Int64
	var mu sync.Mutex
	var samples []string
	create := func(cs *kubernetes.Clientset, what string, fn func(ctx context.Context, cs *kubernetes.Clientset) error) {
		var err error
		for attempt := range 8 {
			if attempt > 0 {
				time.Sleep(time.Duration(100<<min(attempt, 4)) * time.Millisecond)
			}
			octx, cancel := context.WithTimeout(ctx, opTimeout)
			err = fn(octx, cs)
			cancel()
			if err == nil || apierrors.IsAlreadyExists(err) {
				created.Add(1)
				return
			}
			if ctx.Err() != nil {
				break
			}
		}
		failed.Add(1)
		mu.Lock()
		if len(samples) < 10 {
			samples = append(samples, what+": "+err.Error())
		}
		mu.Unlock()
	}
	// step creates n objects, concurrency at a time.
	step := func(name string, n int, fn func(i int) (string, func(ctx context.Context, cs *kubernetes.Clientset) error)) {
		t0 := time.Now()
		next := make(chan int)
		var wg sync.WaitGroup
		for w := range concurrency {
			cs := clients[w%len(clients)]
			wg.Go(func() {
				for i := range next {
					what, fn := fn(i)
					create(cs, what, fn)
				}
			})
		}
		last := time.Now()
		for i := range n {
			if ctx.Err() != nil {
				break
			}
			next <- i
			if time.Since(last) > 10*time.Second {
				last = time.Now()
				fmt.Fprintf(os.Stderr, "populate: %s %d/%d (%.0f/s)\n", name, i, n, float64(i)/time.Since(t0).Seconds())
			}
		}
		close(next)
		wg.Wait()
		fmt.Fprintf(os.Stderr, "populate: %d %s in %v\n", n, name, time.Since(t0).Round(time.Millisecond))
	}

	step("namespaces", lay.namespaces, func(i int) (string, func(context.Context, *kubernetes.Clientset) error) {
		return "namespace", func(ctx context.Context, cs *kubernetes.Clientset) error {
			_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsName(i)}}, metav1.CreateOptions{})
			return err
		}
	})
	step("serviceaccounts", lay.namespaces, func(i int) (string, func(context.Context, *kubernetes.Clientset) error) {
		return "serviceaccount", func(ctx context.Context, cs *kubernetes.Clientset) error {
			_, err := cs.CoreV1().ServiceAccounts(nsName(i)).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
			return err
		}
	})
	// Node -1 and its Lease are the barrier objects.
	step("nodes", lay.nodes+1, func(i int) (string, func(context.Context, *kubernetes.Clientset) error) {
		return "node", func(ctx context.Context, cs *kubernetes.Clientset) error {
			_, err := cs.CoreV1().Nodes().Create(ctx, lay.node(i-1), metav1.CreateOptions{})
			return err
		}
	})
	step("leases", lay.nodes+1, func(i int) (string, func(context.Context, *kubernetes.Clientset) error) {
		return "lease", func(ctx context.Context, cs *kubernetes.Clientset) error {
			_, err := cs.CoordinationV1().Leases(nodeLeaseNS).Create(ctx, lay.lease(i-1), metav1.CreateOptions{})
			return err
		}
	})
	// Pods and ConfigMaps interleaved, the barriers first.
	both := lay.pods + lay.configmaps + 2
	step("pods and configmaps", both, func(i int) (string, func(context.Context, *kubernetes.Clientset) error) {
		switch {
		case i == 0:
			return "pod", func(ctx context.Context, cs *kubernetes.Clientset) error {
				_, err := cs.CoreV1().Pods(nsName(0)).Create(ctx, lay.pod(0, barrierName, nsName(0)), metav1.CreateOptions{})
				return err
			}
		case i == 1:
			return "configmap", func(ctx context.Context, cs *kubernetes.Clientset) error {
				_, err := cs.CoreV1().ConfigMaps(nsName(0)).Create(ctx, lay.configMap(0, barrierName, nsName(0)), metav1.CreateOptions{})
				return err
			}
		}
		isPod, k := lay.interleave(i - 2)
		if isPod {
			return "pod", func(ctx context.Context, cs *kubernetes.Clientset) error {
				_, err := cs.CoreV1().Pods(lay.podNS(k)).Create(ctx, lay.pod(k, podName(k), lay.podNS(k)), metav1.CreateOptions{})
				return err
			}
		}
		return "configmap", func(ctx context.Context, cs *kubernetes.Clientset) error {
			_, err := cs.CoreV1().ConfigMaps(lay.cmNS(k)).Create(ctx, lay.configMap(k, cmName(k), lay.cmNS(k)), metav1.CreateOptions{})
			return err
		}
	})
	return populateResult{
		Objects: int(created.Load()),
		Secs:    time.Since(start).Seconds(),
		Errors:  failed.Load(),
		Samples: samples,
	}
}
