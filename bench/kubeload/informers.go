package main

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// informer is one client's informer of one resource: a client-go shared
// informer (a reflector: LIST then WATCH, with bookmarks, resuming from its
// last resourceVersion, relisting when it must), whose handler measures how
// late each write's event reaches it.
type informer struct {
	resource   string
	barrierKey string // namespace/name of the resource's barrier object
	inf        cache.SharedIndexInformer
	barrier    atomic.Value // string: the barrier token last seen
}

// resources are the informers' resources: pods, nodes and configmaps (as
// kube-scheduler, kube-controller-manager and operators watch them), and
// the kubelets' leases (as the node lifecycle controller does).
var resources = []struct {
	name       string
	example    runtime.Object
	barrierKey string
	list       func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (runtime.Object, error)
	watch      func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (watch.Interface, error)
}{
	{"pods", &corev1.Pod{}, nsName(0) + "/" + barrierName,
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return cs.CoreV1().Pods("").List(ctx, o)
			}
		},
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (watch.Interface, error) {
			return cs.CoreV1().Pods("").Watch
		}},
	{"nodes", &corev1.Node{}, barrierName,
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return cs.CoreV1().Nodes().List(ctx, o)
			}
		},
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (watch.Interface, error) {
			return cs.CoreV1().Nodes().Watch
		}},
	{"configmaps", &corev1.ConfigMap{}, nsName(0) + "/" + barrierName,
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return cs.CoreV1().ConfigMaps("").List(ctx, o)
			}
		},
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (watch.Interface, error) {
			return cs.CoreV1().ConfigMaps("").Watch
		}},
	{"leases", &coordinationv1.Lease{}, nodeLeaseNS + "/" + barrierName,
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return cs.CoordinationV1().Leases("").List(ctx, o)
			}
		},
		func(cs *kubernetes.Clientset) func(context.Context, metav1.ListOptions) (watch.Interface, error) {
			return cs.CoordinationV1().Leases("").Watch
		}},
}

// startInformers starts perServer client processes' worth of informers
// per kube-apiserver (each client on a connection of its own, homed on its
// kube-apiserver), one informer per resource each, until ctx ends.
func startInformers(ctx context.Context, cl *cluster, st *stats, perServer int) ([]*informer, error) {
	var infs []*informer
	for home := range cl.hosts {
		for k := range perServer {
			cs, err := cl.clientset(home, fmt.Sprintf("informers-%d-%d", home, k))
			if err != nil {
				return nil, err
			}
			for _, r := range resources {
				in := &informer{resource: r.name, barrierKey: r.barrierKey}
				in.barrier.Store("")
				list, watchFn := r.list(cs), r.watch(cs)
				lw := &cache.ListWatch{
					ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
						st.lists.Add(1)
						l, err := list(ctx, o)
						if err == nil {
							slim(l)
						}
						return l, err
					},
					WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
						st.watches.Add(1)
						return watchFn(ctx, o)
					},
				}
				in.inf = cache.NewSharedIndexInformer(lw, r.example, 0, cache.Indexers{})
				if err := in.inf.SetTransform(strip); err != nil {
					return nil, err
				}
				if err := in.inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, rf *cache.Reflector, err error) {
					st.watchErrors.Add(1)
					st.sample(fmt.Sprintf("informer %s (client %d-%d): %v", r.name, home, k, err))
					cache.DefaultWatchErrorHandler(ctx, rf, err)
				}); err != nil {
					return nil, err
				}
				if _, err := in.inf.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
					AddFunc: func(obj any, initial bool) {
						if initial {
							in.seen(obj, nil, nil)
						} else {
							in.seen(obj, nil, st)
						}
					},
					UpdateFunc: func(old, obj any) {
						in.ordered(old, obj, st)
						in.seen(obj, old, st)
					},
				}); err != nil {
					return nil, err
				}
				go in.inf.RunWithContext(ctx)
				infs = append(infs, in)
			}
		}
	}
	return infs, nil
}

// strip keeps of an object what the handler reads (its name and the load's
// annotations), as controllers' transforms drop what they do not use: the
// informers' caches stay small however many there are.
func strip(obj any) (any, error) {
	if _, ok := obj.(*metav1.PartialObjectMetadata); ok {
		return obj, nil
	}
	m, err := meta.Accessor(obj)
	if err != nil {
		return obj, nil // a tombstone (cache.DeletedFinalStateUnknown)
	}
	ann := map[string]string{}
	for _, k := range []string{stampKey, barrierKey} {
		if v, ok := m.GetAnnotations()[k]; ok {
			ann[k] = v
		}
	}
	return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{
		Name: m.GetName(), Namespace: m.GetNamespace(), ResourceVersion: m.GetResourceVersion(), Annotations: ann,
	}}, nil
}

// slim strips a list's items, as strip does, as soon as each list (or
// page) is decoded: a reflector holds every page of a LIST until it has
// them all, and the load's informers LIST 100k objects at once after a
// restart.
func slim(list runtime.Object) {
	switch l := list.(type) {
	case *corev1.PodList:
		for i := range l.Items {
			l.Items[i].Spec, l.Items[i].Status = corev1.PodSpec{}, corev1.PodStatus{}
			slimMeta(&l.Items[i].ObjectMeta)
		}
	case *corev1.NodeList:
		for i := range l.Items {
			l.Items[i].Spec, l.Items[i].Status = corev1.NodeSpec{}, corev1.NodeStatus{}
			slimMeta(&l.Items[i].ObjectMeta)
		}
	case *corev1.ConfigMapList:
		for i := range l.Items {
			l.Items[i].Data, l.Items[i].BinaryData = nil, nil
			slimMeta(&l.Items[i].ObjectMeta)
		}
	case *coordinationv1.LeaseList:
		for i := range l.Items {
			l.Items[i].Spec = coordinationv1.LeaseSpec{}
			slimMeta(&l.Items[i].ObjectMeta)
		}
	}
}

func slimMeta(m *metav1.ObjectMeta) {
	ann := map[string]string{}
	for _, k := range []string{stampKey, barrierKey} {
		if v, ok := m.Annotations[k]; ok {
			ann[k] = v
		}
	}
	*m = metav1.ObjectMeta{Name: m.Name, Namespace: m.Namespace, ResourceVersion: m.ResourceVersion, Annotations: ann}
}

// ordered counts an update whose resourceVersion is older than the
// object's before it (out of order: etcd's revisions only grow), and one
// at the same resourceVersion (repeated: an event delivered twice, or a
// relist, whose Replace updates every object it lists again; with no
// resync, nothing else repeats one).
func (in *informer) ordered(old, obj any, st *stats) {
	om, err1 := meta.Accessor(old)
	nm, err2 := meta.Accessor(obj)
	if err1 != nil || err2 != nil {
		return
	}
	o, err1 := strconv.ParseUint(om.GetResourceVersion(), 10, 64)
	n, err2 := strconv.ParseUint(nm.GetResourceVersion(), 10, 64)
	switch {
	case err1 != nil || err2 != nil:
	case n < o:
		st.outOfOrder.Add(1)
		st.sample(fmt.Sprintf("informer %s: %s/%s updated from resourceVersion %d back to %d", in.resource, nm.GetNamespace(), nm.GetName(), o, n))
	case n == o:
		st.repeated.Add(1)
	}
}

// seen handles obj (old: its previous state, if it is an update): a stamp
// that old did not have is a write the informer now learns of, late by
// now minus the stamp (recorded in st, unless nil: the initial list's
// objects are not events).
func (in *informer) seen(obj, old any, st *stats) {
	now := time.Now()
	m, err := meta.Accessor(obj)
	if err != nil {
		return
	}
	ann := m.GetAnnotations()
	if m.GetNamespace()+"/"+m.GetName() == in.barrierKey || m.GetName() == in.barrierKey {
		in.barrier.Store(ann[barrierKey])
	}
	if st == nil {
		return
	}
	stamp := ann[stampKey]
	if stamp == "" {
		return
	}
	if old != nil {
		if om, err := meta.Accessor(old); err == nil && om.GetAnnotations()[stampKey] == stamp {
			return
		}
	}
	ns, err := strconv.ParseInt(stamp, 10, 64)
	if err != nil {
		return
	}
	st.delay(in.resource, now.Sub(time.Unix(0, ns)))
}
