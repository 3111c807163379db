package main

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// The annotations the load writes: stampKey holds the wall time (Unix
// nanoseconds) of the write that set it, so that an informer measures how
// late it learns of it; barrierKey holds a barrier's token.
const (
	stampKey   = "bench.snapcache.io/stamp"
	barrierKey = "bench.snapcache.io/barrier"
	padKey     = "bench.snapcache.io/pad"
)

// nodeLeaseNS is where kubelets keep their heartbeat Leases; kube-apiserver
// creates it.
const nodeLeaseNS = "kube-node-lease"

// barrierName names the barrier object of each kind (a Node "cp-barrier",
// the others "cp-barrier" in the first namespace, or kube-node-lease for the
// Lease).
const barrierName = "cp-barrier"

// layout is the cluster the load creates and works on: which objects exist
// and where. It is a function of the flags alone, so that populate and run
// (separate processes) agree on it.
type layout struct {
	namespaces, nodes, pods, configmaps int
}

// newLayout splits objects into nodes Nodes, nodes Leases, and the rest
// half Pods, half ConfigMaps, in namespaces namespaces (0: one per 1,000
// objects, at least 10).
func newLayout(objects, nodes, namespaces int) layout {
	if namespaces <= 0 {
		namespaces = max(10, objects/1000)
	}
	rest := max(objects-2*nodes, 2)
	return layout{namespaces: namespaces, nodes: nodes, pods: rest / 2, configmaps: rest - rest/2}
}

func (l layout) objects() int { return 2*l.nodes + l.pods + l.configmaps }

// interleave maps i in [0, pods+configmaps) to a Pod (isPod) or a
// ConfigMap, and its index k: Pods and ConfigMaps alternate, so that a
// populate cut short leaves both kinds.
func (l layout) interleave(i int) (isPod bool, k int) {
	m := min(l.pods, l.configmaps)
	if i < 2*m {
		return i%2 == 0, i / 2
	}
	return l.pods > l.configmaps, i - m
}

func nsName(i int) string   { return fmt.Sprintf("cp-%03d", i) }
func nodeName(i int) string { return fmt.Sprintf("node-%04d", i) }
func podName(i int) string  { return fmt.Sprintf("pod-%06d", i) }
func cmName(i int) string   { return fmt.Sprintf("cm-%06d", i) }

func (l layout) podNS(i int) string { return nsName(i % l.namespaces) }
func (l layout) cmNS(i int) string  { return nsName(i % l.namespaces) }

// podAdded is about what kube-apiserver adds to the load's pods as it
// stores them (defaults, the service account token's volume, tolerations,
// managedFields): a pod is padded to its size less this.
const podAdded = 1800

// objectSize is the size, in bytes, that object i of a kind is padded to:
// spread evenly over 1–4 KiB (Nodes, whose status alone is 2 KiB, over
// 2–4 KiB), the same in every run.
func objectSize(kind string, i int) int {
	h := fnv.New32a()
	fmt.Fprintf(h, "%s/%d", kind, i)
	if kind == "node" {
		return 2048 + int(h.Sum32()%2048)
	}
	return 1024 + int(h.Sum32()%3072)
}

// filler is n bytes of text, different per seed.
func filler(seed, n int) string {
	if n <= 0 {
		return ""
	}
	b := make([]byte, n)
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = 'a' + byte(x%26)
	}
	return string(b)
}

// padTo pads obj's pad annotation so that obj's JSON is about size bytes
// (kube-apiserver then stores it as protobuf, with its defaults and
// managedFields).
func padTo(obj any, meta *metav1.ObjectMeta, size, seed int) {
	b, _ := json.Marshal(obj)
	if n := size - len(b) - len(padKey) - 6; n > 0 {
		if meta.Annotations == nil {
			meta.Annotations = map[string]string{}
		}
		meta.Annotations[padKey] = filler(seed, n)
	}
}

func stampNow() string { return strconv.FormatInt(time.Now().UnixNano(), 10) }

func uid(s string) types.UID {
	h := fnv.New64a()
	h.Write([]byte(s))
	v := h.Sum64()
	return types.UID(fmt.Sprintf("%08x-%04x-%04x-%04x-%012x", uint32(v), uint16(v>>32), uint16(v>>48), uint16(v>>8), v&0xffffffffffff))
}

// pod is pod i of the layout (or a churn pod, name set): bound to a node,
// owned by a ReplicaSet, with two containers, as a Deployment's pods are.
func (l layout) pod(i int, name, ns string) *corev1.Pod {
	app := fmt.Sprintf("app-%03d", i%200)
	hash := fmt.Sprintf("%08x", uint32(i%200)*2654435761)[:8]
	tru := true
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:      name,
			Namespace: ns,
			Labels:    map[string]string{"app": app, "pod-template-hash": hash, "tier": "backend"},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "apps/v1", Kind: "ReplicaSet", Name: app + "-" + hash,
				UID: uid(ns + "/" + app), Controller: &tru, BlockOwnerDeletion: &tru,
			}},
		},
		Spec: corev1.PodSpec{
			NodeName: nodeName(i % l.nodes),
			Containers: []corev1.Container{{
				Name:  "app",
				Image: "registry.example.com/team/" + app + ":v1.2.3",
				Args:  []string{"--port=8080", "--log-level=info"},
				Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
				Env: []corev1.EnvVar{
					{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
					{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}},
					{Name: "CONFIG", Value: "/etc/app/config.yaml"},
				},
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
					Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
				},
				ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/readyz", Port: intstr.FromInt32(8080)}}, PeriodSeconds: 10},
			}, {
				Name:  "sidecar",
				Image: "registry.example.com/infra/proxy:v0.9.1",
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("32Mi")},
				},
			}},
		},
	}
	p.Annotations = map[string]string{stampKey: stampNow()}
	// kube-apiserver adds about 1.8 KiB to a pod: defaults (tolerations,
	// the service account token's volume, ...) and managedFields.
	padTo(p, &p.ObjectMeta, objectSize("pod", i)-podAdded, i)
	return p
}

// configMap is ConfigMap i of the layout (or a churn one, name set).
func (l layout) configMap(i int, name, ns string) *corev1.ConfigMap {
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: ns,
			Labels:      map[string]string{"app": fmt.Sprintf("app-%03d", i%200)},
			Annotations: map[string]string{stampKey: stampNow()},
		},
	}
	b, _ := json.Marshal(cm)
	cm.Data = map[string]string{"config.yaml": filler(i, objectSize("configmap", i)-len(b)-24)}
	return cm
}

// node is Node i, as a kubelet registers it.
func (l layout) node(i int) *corev1.Node {
	name := nodeName(i)
	if i < 0 {
		name, i = barrierName, 0
	}
	q := resource.MustParse
	res := corev1.ResourceList{
		corev1.ResourceCPU: q("16"), corev1.ResourceMemory: q("65843872Ki"), corev1.ResourcePods: q("110"),
		corev1.ResourceEphemeralStorage: q("101430960Ki"), "hugepages-2Mi": q("0"), "hugepages-1Gi": q("0"),
	}
	now := metav1.Now()
	cond := func(t corev1.NodeConditionType, s corev1.ConditionStatus, reason, msg string) corev1.NodeCondition {
		return corev1.NodeCondition{Type: t, Status: s, LastHeartbeatTime: now, LastTransitionTime: now, Reason: reason, Message: msg}
	}
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: name,
			Labels: map[string]string{
				"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
				"node.kubernetes.io/instance-type": "n2-standard-16",
				"topology.kubernetes.io/region":    "region-1", "topology.kubernetes.io/zone": fmt.Sprintf("region-1%c", 'a'+i%3),
			},
			Annotations: map[string]string{stampKey: stampNow(), "node.alpha.kubernetes.io/ttl": "0"},
		},
		Spec: corev1.NodeSpec{PodCIDR: fmt.Sprintf("10.%d.%d.0/24", 64+i/256%64, i%256), ProviderID: "bench://" + name},
		Status: corev1.NodeStatus{
			Capacity: res, Allocatable: res,
			Conditions: []corev1.NodeCondition{
				cond(corev1.NodeMemoryPressure, corev1.ConditionFalse, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
				cond(corev1.NodeDiskPressure, corev1.ConditionFalse, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
				cond(corev1.NodePIDPressure, corev1.ConditionFalse, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
				cond(corev1.NodeReady, corev1.ConditionTrue, "KubeletReady", "kubelet is posting ready status"),
			},
			Addresses: []corev1.NodeAddress{
				{Type: corev1.NodeInternalIP, Address: fmt.Sprintf("10.0.%d.%d", i/250, 2+i%250)},
				{Type: corev1.NodeHostName, Address: name},
			},
			DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: 10250}},
			NodeInfo: corev1.NodeSystemInfo{
				MachineID: string(uid("m" + name)), SystemUUID: string(uid("s" + name)), BootID: string(uid("b" + name)),
				KernelVersion: "6.8.0-1019", OSImage: "Ubuntu 24.04.1 LTS", ContainerRuntimeVersion: "containerd://2.0.2",
				KubeletVersion: "v1.37.1", OperatingSystem: "linux", Architecture: "amd64",
			},
		},
	}
	// The images on the node make up the rest of its size, as they do.
	size := objectSize("node", i)
	if name == barrierName {
		size = 0
	}
	for k := 0; ; k++ {
		b, _ := json.Marshal(n)
		if len(b) > size-120 {
			break
		}
		n.Status.Images = append(n.Status.Images, corev1.ContainerImage{
			Names:     []string{fmt.Sprintf("registry.example.com/team/app-%03d@sha256:%s", k, filler(i*31+k, 64))},
			SizeBytes: int64(10_000_000 + k*1_000_003),
		})
	}
	return n
}

// lease is Node i's heartbeat Lease, as its kubelet creates it.
func (l layout) lease(i int) *coordinationv1.Lease {
	name := nodeName(i)
	if i < 0 {
		name = barrierName
	}
	holder, dur := name, int32(40)
	now := metav1.NewMicroTime(time.Now())
	return &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: nodeLeaseNS, Annotations: map[string]string{stampKey: stampNow()}},
		Spec:       coordinationv1.LeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: &dur, RenewTime: &now},
	}
}
