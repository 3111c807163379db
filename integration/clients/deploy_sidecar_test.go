package clients

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// podSpec is the part of deploy/kube-apiserver.yaml the test reads.
type podSpec struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name      string `yaml:"name"`
		Namespace string `yaml:"namespace"`
	} `yaml:"metadata"`
	Spec struct {
		HostNetwork    bool        `yaml:"hostNetwork"`
		InitContainers []container `yaml:"initContainers"`
		Containers     []container `yaml:"containers"`
		Volumes        []struct {
			Name     string `yaml:"name"`
			HostPath *struct {
				Path string `yaml:"path"`
			} `yaml:"hostPath"`
		} `yaml:"volumes"`
	} `yaml:"spec"`
}

type container struct {
	Name          string   `yaml:"name"`
	Image         string   `yaml:"image"`
	Command       []string `yaml:"command"`
	Args          []string `yaml:"args"`
	RestartPolicy string   `yaml:"restartPolicy"`
	StartupProbe  *struct {
		HTTPGet *struct {
			Host string `yaml:"host"`
			Path string `yaml:"path"`
			Port int    `yaml:"port"`
		} `yaml:"httpGet"`
	} `yaml:"startupProbe"`
	SecurityContext *struct {
		RunAsNonRoot *bool `yaml:"runAsNonRoot"`
		RunAsUser    *int  `yaml:"runAsUser"`
	} `yaml:"securityContext"`
	VolumeMounts []struct {
		Name      string `yaml:"name"`
		MountPath string `yaml:"mountPath"`
		ReadOnly  bool   `yaml:"readOnly"`
	} `yaml:"volumeMounts"`
}

// argv is the container's command line.
func (c container) argv() []string { return append(append([]string(nil), c.Command...), c.Args...) }

// flagValue returns the value of --name=value in args, and whether it is there
// exactly once.
func flagValue(args []string, name string) (string, bool) {
	var v string
	n := 0
	for _, a := range args {
		if rest, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			v = rest
			n++
		}
	}
	return v, n == 1
}

// setFlag replaces the value of --name in args.
func setFlag(args []string, name, value string) []string {
	out := append([]string(nil), args...)
	for i, a := range out {
		if strings.HasPrefix(a, "--"+name+"=") {
			out[i] = "--" + name + "=" + value
		}
	}
	return out
}

// TestDeploySidecar runs deploy/kube-apiserver.yaml: the static pod in
// which etcd-snapcache fronts the cluster's etcd over mTLS and
// kube-apiserver uses it as its etcd (--etcd-servers=https://127.0.0.1:<the
// proxy's port>).
//
//   - The manifest is read: the proxy is a native sidecar (an init
//     container with restartPolicy Always and a startup probe on its
//     /readyz, so kube-apiserver starts once the cache is loaded), non-root,
//     and listens where kube-apiserver's --etcd-servers points; every file
//     either reads is mounted; every flag exists in its binary's --help.
//   - A PKI laid out as kubeadm's (/etc/kubernetes/pki, moved into a test
//     directory) is generated: the etcd CA, etcd's serving certificate,
//     kube-apiserver's etcd client certificate, the proxy's serving and
//     client certificates. A real etcd serves with client-certificate auth.
//   - The proxy runs with the manifest's command line as written, but for
//     the paths (moved into the test directory), ports (free ones) and
//     --endpoints (the test's etcd); its startup probe must pass.
//   - A real kube-apiserver runs with the manifest's --etcd-* flags
//     (rewritten the same way) and the test's own serving setup, and must
//     become ready: it reaches etcd through the proxy over mTLS. Its reads
//     must be answered from the proxy's cache.
//   - The whole manifest is then created through that kube-apiserver as
//     the mirror pod a kubelet would create from it, with a server-side dry
//     run (dryRun=All) and strict field validation: 201 Created.
func TestDeploySidecar(t *testing.T) {
	raw := readDeploy(t, "kube-apiserver.yaml")
	var pod podSpec
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&pod); err != nil {
		t.Fatalf("kube-apiserver.yaml: %v", err)
	}
	bins := kubeBins{kube: kubeAPIServerBin(t), etcd: etcdBin(t), ctl: etcdctlBin(t), px: snapcacheBin(t)}

	// --- The manifest's shape.
	if pod.APIVersion != "v1" || pod.Kind != "Pod" || pod.Metadata.Namespace != "kube-system" || !pod.Spec.HostNetwork {
		t.Fatalf("want a v1 Pod in kube-system on the host network, got %s %s in %q (hostNetwork %v)", pod.APIVersion, pod.Kind, pod.Metadata.Namespace, pod.Spec.HostNetwork)
	}
	var proxyC, kubeC *container
	for i, c := range pod.Spec.InitContainers {
		if argv := c.argv(); len(argv) >= 2 && filepath.Base(argv[0]) == "etcd-snapcache" && argv[1] == "serve" {
			proxyC = &pod.Spec.InitContainers[i]
		}
	}
	for i, c := range pod.Spec.Containers {
		if argv := c.argv(); len(argv) >= 1 && argv[0] == "kube-apiserver" {
			kubeC = &pod.Spec.Containers[i]
		}
		if argv := c.argv(); len(argv) >= 1 && filepath.Base(argv[0]) == "etcd-snapcache" {
			t.Errorf("container %s runs the proxy as a regular container: make it a native sidecar (an init container with restartPolicy Always), so it starts before kube-apiserver", c.Name)
		}
	}
	if proxyC == nil || kubeC == nil {
		t.Fatalf("want an init container running etcd-snapcache serve and a container running kube-apiserver")
	}
	if proxyC.RestartPolicy != "Always" {
		t.Errorf("the proxy's init container: restartPolicy %q, want Always (a native sidecar)", proxyC.RestartPolicy)
	}
	if sc := proxyC.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 {
		t.Errorf("the proxy should run as non-root (runAsNonRoot, a non-zero runAsUser)")
	}
	pxArgs := proxyC.argv()[2:]
	kubeArgs := kubeC.argv()[1:]
	checkFlags(t, "the proxy's command", pxArgs, serveFlags(t, bins.px))
	kubeHelp, err := exec.Command(bins.kube, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("kube-apiserver --help: %v\n%s", err, kubeHelp)
	}
	checkFlags(t, "kube-apiserver's command", kubeArgs, helpFlags(string(kubeHelp)))
	// The flags left commented out (tracing) exist too, in one command
	// or the other.
	known := helpFlags(string(kubeHelp))
	maps.Copy(known, serveFlags(t, bins.px))
	checkFlags(t, "the commented-out flags", commentedFlags(raw), known)

	// kube-apiserver -> https://127.0.0.1:P -> the proxy's --listen-addr.
	servers, _ := flagValue(kubeArgs, "etcd-servers")
	su, err := url.Parse(servers)
	if err != nil || su.Scheme != "https" || su.Hostname() != "127.0.0.1" || su.Port() == "" || su.Path != "" || strings.Contains(servers, ",") {
		t.Fatalf("kube-apiserver --etcd-servers=%s: want one https://127.0.0.1:<port>", servers)
	}
	listen, ok := flagValue(pxArgs, "listen-addr")
	if !ok || listen != "127.0.0.1:"+su.Port() {
		t.Fatalf("the proxy's --listen-addr=%s; kube-apiserver's --etcd-servers=%s wants 127.0.0.1:%s", listen, servers, su.Port())
	}
	if adv, _ := flagValue(pxArgs, "advertise-client-url"); adv != servers {
		t.Errorf("the proxy's --advertise-client-url=%s, want %s (what kube-apiserver dials)", adv, servers)
	}
	// mTLS on both sides of the proxy.
	for _, f := range []string{"cert-file", "key-file", "trusted-ca-file", "cacert", "cert", "key", "endpoints", "metrics-addr"} {
		if v, ok := flagValue(pxArgs, f); !ok || v == "" {
			t.Errorf("the proxy's command: want --%s exactly once", f)
		}
	}
	for _, f := range []string{"etcd-cafile", "etcd-certfile", "etcd-keyfile"} {
		if v, ok := flagValue(kubeArgs, f); !ok || v == "" {
			t.Errorf("kube-apiserver's command: want --%s exactly once", f)
		}
	}
	for ep := range strings.SplitSeq(mustFlag(t, pxArgs, "endpoints"), ",") {
		if !strings.HasPrefix(ep, "https://") {
			t.Errorf("the proxy's --endpoints: %s is not https", ep)
		}
	}
	// Its startup probe is its /readyz on --metrics-addr.
	metricsAddr := mustFlag(t, pxArgs, "metrics-addr")
	metricsAddr = strings.TrimPrefix(metricsAddr, "http://")
	probe := proxyC.StartupProbe
	if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != "/readyz" || net.JoinHostPort(probe.HTTPGet.Host, strconv.Itoa(probe.HTTPGet.Port)) != metricsAddr {
		t.Errorf("the proxy's startupProbe should GET /readyz on --metrics-addr %s (kube-apiserver then starts with the cache loaded)", metricsAddr)
	}
	// Every file either container reads is mounted into it.
	fileFlags := map[*container][]string{
		proxyC: {"cacert", "cert", "key", "cert-file", "key-file", "trusted-ca-file"},
		kubeC:  {"etcd-cafile", "etcd-certfile", "etcd-keyfile"},
	}
	for c, flags := range fileFlags {
		args := c.argv()
		for _, f := range flags {
			p, _ := flagValue(args, f)
			mounted := false
			for _, m := range c.VolumeMounts {
				if p == m.MountPath || strings.HasPrefix(p, strings.TrimSuffix(m.MountPath, "/")+"/") {
					mounted = true
				}
			}
			if !mounted {
				t.Errorf("container %s: --%s=%s is not under any of its volumeMounts", c.Name, f, p)
			}
		}
	}
	// The cache's copy on disk: --data-dir on a writable mount, so that a
	// restart starts warm (the root filesystem is read-only).
	dataDir, _ := flagValue(pxArgs, "data-dir")
	writable := false
	for _, m := range proxyC.VolumeMounts {
		if !m.ReadOnly && (dataDir == m.MountPath || strings.HasPrefix(dataDir, strings.TrimSuffix(m.MountPath, "/")+"/")) {
			writable = true
		}
	}
	if !writable {
		t.Errorf("the proxy's --data-dir=%q is not on a writable volumeMount: its copy on disk cannot be written", dataDir)
	}
	if t.Failed() {
		t.FailNow()
	}

	// --- A kubeadm-like PKI under root (root+"/etc/kubernetes/pki/...").
	root := t.TempDir()
	moved := func(p string) string { return filepath.Join(root, p) }
	files := map[string]string{}
	for c, flags := range fileFlags {
		for _, f := range flags {
			p, _ := flagValue(c.argv(), f)
			files[c.Name+" --"+f] = p
		}
	}
	caFile := files[kubeC.Name+" --etcd-cafile"]
	for _, k := range []string{proxyC.Name + " --cacert", proxyC.Name + " --trusted-ca-file"} {
		if files[k] != caFile {
			t.Fatalf("%s=%s: the proxy should trust the etcd CA kube-apiserver trusts (%s)", k, files[k], caFile)
		}
	}
	pki := testsupport.NewPKI(t)
	pki.WriteCA(t, moved(caFile))
	etcdDir := filepath.Join(root, "etcd-server")
	pki.WritePair(t, "etcd", testsupport.Server|testsupport.Client, filepath.Join(etcdDir, "server.crt"), filepath.Join(etcdDir, "server.key"))
	pki.WritePair(t, "kube-apiserver-etcd-client", testsupport.Client, moved(files[kubeC.Name+" --etcd-certfile"]), moved(files[kubeC.Name+" --etcd-keyfile"]))
	pki.WritePair(t, "etcd-snapcache", testsupport.Server, moved(files[proxyC.Name+" --cert-file"]), moved(files[proxyC.Name+" --key-file"]))
	pki.WritePair(t, "etcd-snapcache-client", testsupport.Client, moved(files[proxyC.Name+" --cert"]), moved(files[proxyC.Name+" --key"]))

	// --- etcd with client-certificate auth.
	e := startEtcdTLS(t, "etcd", &serverTLS{
		cert: filepath.Join(etcdDir, "server.crt"), key: filepath.Join(etcdDir, "server.key"), ca: moved(caFile),
		client: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: pki.ClientTLS(t, "")}},
	}, "--client-cert-auth")
	etcdURL, ep := e.url, e.process

	// --- The proxy, with the manifest's command line.
	ports := testsupport.FreePorts(t, 2)
	listenAddr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	pxMetrics := fmt.Sprintf("127.0.0.1:%d", ports[1])
	runArgs := setFlag(pxArgs, "endpoints", etcdURL)
	runArgs = setFlag(runArgs, "listen-addr", listenAddr)
	runArgs = setFlag(runArgs, "advertise-client-url", "https://"+listenAddr)
	runArgs = setFlag(runArgs, "metrics-addr", strings.Replace(mustFlag(t, pxArgs, "metrics-addr"), metricsAddr, pxMetrics, 1))
	for _, f := range fileFlags[proxyC] {
		runArgs = setFlag(runArgs, f, moved(mustFlag(t, pxArgs, f)))
	}
	if err := os.MkdirAll(moved(dataDir), 0o700); err != nil {
		t.Fatal(err)
	}
	runArgs = setFlag(runArgs, "data-dir", moved(dataDir))
	t.Logf("proxy: %s serve %s", bins.px, strings.Join(runArgs, " "))
	pp := startProcess(t, "proxy", bins.px, append([]string{"serve"}, runArgs...))
	waitUntil(t, 30*time.Second, "the proxy's startup probe (/readyz)", func() (bool, error) {
		return httpOK("http://" + pxMetrics + probe.HTTPGet.Path)
	}, pp, ep)

	// --- kube-apiserver, with the manifest's --etcd-* flags.
	dir := t.TempDir()
	args, port, token := testsupport.KubeAPIServerSetup(t, dir)
	args = append(args, "--etcd-servers=https://"+listenAddr)
	certDir := filepath.Join(dir, "certs")
	for _, f := range fileFlags[kubeC] {
		args = append(args, "--"+f+"="+moved(mustFlag(t, kubeArgs, f)))
	}
	kp := startProcess(t, "kube-apiserver", bins.kube, args)
	k := &kubeEnv{t: t, kube: kp, base: fmt.Sprintf("https://127.0.0.1:%d", port), token: token}
	k.waitServing(certDir, "kube-apiserver /readyz (its etcd: the proxy, over mTLS)", pp, ep)

	// --- The dry run: the mirror pod a kubelet creates from the manifest.
	var obj map[string]any
	if err := yaml.Unmarshal(raw, &obj); err != nil {
		t.Fatal(err)
	}
	meta := obj["metadata"].(map[string]any)
	ann, _ := meta["annotations"].(map[string]any)
	if ann == nil {
		ann = map[string]any{}
	}
	// The kubelet names the pods it mirrors from static manifests after its
	// node, binds them to it, and marks them so: the ServiceAccount
	// admission plugin then requires that they reference no service
	// account, secret or config map.
	const node = "control-plane-1"
	meta["name"] = fmt.Sprint(meta["name"]) + "-" + node
	ann["kubernetes.io/config.mirror"] = "0123456789abcdef0123456789abcdef"
	ann["kubernetes.io/config.source"] = "file"
	meta["annotations"] = ann
	obj["spec"].(map[string]any)["nodeName"] = node
	code, body, err := k.try("POST", "/api/v1/namespaces/kube-system/pods?dryRun=All&fieldValidation=Strict", obj)
	if err != nil {
		t.Fatal(err)
	}
	if code != http.StatusCreated && code != http.StatusOK {
		t.Fatalf("server-side dry run of deploy/kube-apiserver.yaml: %d: %s", code, body)
	}
	var created struct {
		Metadata struct {
			Name string `json:"name"`
			UID  string `json:"uid"`
		} `json:"metadata"`
		Spec struct {
			InitContainers []struct {
				Name          string `json:"name"`
				RestartPolicy string `json:"restartPolicy"`
			} `json:"initContainers"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(body, &created); err != nil {
		t.Fatalf("dry-run answer: %v: %s", err, body)
	}
	if len(created.Spec.InitContainers) == 0 || created.Spec.InitContainers[0].RestartPolicy != "Always" {
		t.Errorf("the dry-run pod lost the native sidecar: %+v", created.Spec.InitContainers)
	}
	// Dry run: nothing was stored.
	if code, b, err := k.try("GET", "/api/v1/namespaces/kube-system/pods/"+created.Metadata.Name, nil); err != nil || code != http.StatusNotFound {
		t.Errorf("after a dry run, GET the pod: %d %v %s", code, err, b)
	}
	t.Logf("dry run: %d, pod %s (uid %s)", code, created.Metadata.Name, created.Metadata.UID)

	// kube-apiserver's reads went through the proxy's cache.
	names, lines, err := proxyOwnMetricLines(pxMetrics, "etcd_snapcache_range_requests_total")
	if err != nil {
		t.Fatal(err)
	}
	cached := 0.0
	for _, l := range lines {
		if _, labels, v, ok := parseMetric(l); ok && strings.Contains(labels, `source="cache"`) {
			cached += v
		}
	}
	if cached == 0 || !names["etcd_snapcache_range_requests_total"] {
		t.Errorf("no kube-apiserver read was answered from the proxy's cache:\n%s", strings.Join(lines, "\n"))
	}
	t.Logf("%v of kube-apiserver's reads answered from the cache", cached)
}

func mustFlag(t testing.TB, args []string, name string) string {
	t.Helper()
	v, ok := flagValue(args, name)
	if !ok {
		t.Fatalf("want --%s exactly once in %q", name, args)
	}
	return v
}

// proxyOwnMetricLines scrapes the proxy's own metrics (as proxyOwnMetrics)
// and returns the lines of the metric name.
func proxyOwnMetricLines(metricsAddr, name string) (map[string]bool, []string, error) {
	names, body, err := scrapeProxyOwn(metricsAddr)
	if err != nil {
		return nil, nil, err
	}
	var out []string
	for l := range strings.SplitSeq(body, "\n") {
		if strings.HasPrefix(l, name+"{") || strings.HasPrefix(l, name+" ") {
			out = append(out, l)
		}
	}
	return names, out, nil
}

// commentedFlags returns the arguments a manifest leaves commented out
// ("# - --flag=value").
func commentedFlags(manifest []byte) []string {
	var args []string
	for line := range strings.SplitSeq(string(manifest), "\n") {
		if arg, ok := strings.CutPrefix(strings.TrimSpace(line), "# - --"); ok {
			args = append(args, "--"+arg)
		}
	}
	return args
}
