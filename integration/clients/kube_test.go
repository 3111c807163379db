package clients

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

// TestKubeAPIServer runs an unmodified kube-apiserver (built from the
// released k8s.io/kubernetes by tools/build.sh) with the proxy as its only
// etcd server, once with the watch cache off (every read goes to the proxy)
// and once with it on (the release's defaults, every default feature gate
// on). Through kube-apiserver's HTTPS API it proves:
//
//   - create, update (and a conflicting update), delete of ConfigMaps;
//   - read-your-writes: a GET and a LIST right after each create see it;
//   - an exact-resourceVersion LIST at an older revision, whole and paged;
//   - a paginated LIST (limit=2) while writes happen between its pages (and
//     another client keeps writing in another namespace): every page at the
//     first page's resourceVersion, and the items exactly the objects at
//     that revision;
//   - a WATCH from an old resourceVersion delivering exactly the later
//     changes;
//   - after a compaction, a LIST at a compacted resourceVersion, and a
//     continue token from before it, answer 410 Gone (and, without the watch
//     cache, so does a WATCH from there);
//   - /readyz stays green throughout.
//
// The expected objects and events come from the etcd behind the proxy,
// asked directly with etcdctl (keys and mod revisions at a revision, and
// its watch history), and the expected data from the test's own writes.
// Finally kube-apiserver's log must not mention "Too large resource
// version", watch-cache timeouts, relists, broken watches or auth
// refusals, its metrics must show no consistent-read fallback and one
// initialization per watch cache, and the proxy's metrics must show reads
// answered from its cache.
//
// The same scenario runs, with the watch cache off and on, in two
// variants of kube-apiserver's storage (kubeStorage): plaintext without
// auth (plainStorage), and, as in clusters that enable etcd's RBAC, auth
// on over mTLS, kube-apiserver being the user its client certificate's
// common name names (etcdAuthStorage; subtests etcd-auth,...).
func TestKubeAPIServer(t *testing.T) {
	bins := kubeBins{
		kube: kubeAPIServerBin(t),
		etcd: etcdBin(t),
		ctl:  etcdctlBin(t),
		px:   snapcacheBin(t),
	}
	for _, v := range []struct {
		name    string // prefix of the subtests' names
		storage func(*testing.T, kubeBins) kubeStorage
	}{
		{"", plainStorage},
		{"etcd-auth,", etcdAuthStorage},
	} {
		for _, watchCache := range []bool{false, true} {
			t.Run(fmt.Sprintf("%swatch-cache=%v", v.name, watchCache), func(t *testing.T) {
				k := startKube(t, bins, v.storage(t, bins), watchCache)
				k.scenario()
			})
		}
	}
}

type kubeBins struct{ kube, etcd, ctl, px string }

// kubeStorage is kube-apiserver's storage, as a variant of the suite sets
// it up: an etcd and the proxy in front of it, kube-apiserver's flags to
// reach the proxy, and etcdctl's flags to reach each as an administrator.
type kubeStorage struct {
	etcd     *etcdProc
	proxy    *proxyProc
	kubeArgs []string // --etcd-servers and the other --etcd-* flags
	// etcdctl's global flags (--endpoints, and TLS and --user as needed)
	// for etcd itself and for the proxy.
	etcdCtl, proxyCtl []string
	// tolerated are kube-apiserver log lines that the variant provokes by
	// design, which the log scan allows any number of times.
	tolerated []string
	// check, if not nil, is the variant's own check at the end of the
	// scenario, before the log scan.
	check func(*kubeEnv)
}

// plainStorage is etcd and the proxy in plaintext, without auth.
func plainStorage(t *testing.T, _ kubeBins) kubeStorage {
	e := startEtcd(t, "etcd")
	px := startProxy(t, "proxy", e.addr)
	return kubeStorage{
		etcd: e, proxy: px,
		kubeArgs: []string{"--etcd-servers=" + px.url},
		etcdCtl:  []string{"--endpoints=" + e.addr},
		proxyCtl: []string{"--endpoints=" + px.addr},
	}
}

type kubeEnv struct {
	t          *testing.T
	watchCache bool
	ctl        string
	etcd       *etcdProc
	proxy      *proxyProc
	// etcdctl's global flags for etcd and for the proxy (kubeStorage).
	etcdCtl, proxyCtl []string
	kube              *process
	base              string // https://127.0.0.1:PORT
	token             string
	hc                *http.Client
	ns                string

	// values[name][resourceVersion] is the data ("v") the test wrote.
	values map[string]map[int64]string
	writes int

	readyz *readyzMonitor
	// initsAtReady is apiserver_watch_cache_initializations_total per
	// series when kube-apiserver became ready.
	initsAtReady map[string]float64
	// allowedLog counts log lines the test itself provokes (e.g. its own
	// watch from a compacted revision), by the pattern they match.
	allowedLog map[string]int
	// tolerated and check are the variant's (kubeStorage).
	tolerated []string
	check     func(*kubeEnv)
	// revKeyWrites counts the test's puts of compact_rev_key.
	revKeyWrites int
	// logAtReady is the length of kube-apiserver's log when it became
	// ready: the lines before are its startup's.
	logAtReady int
}

func startKube(t *testing.T, bins kubeBins, st kubeStorage, watchCache bool) *kubeEnv {
	e, px := st.etcd, st.proxy
	dir := t.TempDir()
	args, port, token := testsupport.KubeAPIServerSetup(t, dir)
	args = append(append(args, st.kubeArgs...),
		fmt.Sprintf("--watch-cache=%v", watchCache),
		"--v=2", // reflector and cacher messages the log scan looks for
	)
	start := time.Now()
	kp := startProcess(t, "kube-apiserver", bins.kube, args)
	k := &kubeEnv{
		t: t, watchCache: watchCache, ctl: bins.ctl, etcd: e, proxy: px, kube: kp,
		etcdCtl: st.etcdCtl, proxyCtl: st.proxyCtl, tolerated: st.tolerated, check: st.check,
		base:   fmt.Sprintf("https://127.0.0.1:%d", port),
		token:  token,
		ns:     "snapcache-e2e",
		values: map[string]map[int64]string{},
	}

	k.waitServing(filepath.Join(dir, "certs"), "kube-apiserver /readyz", px.process, e.process)
	t.Logf("kube-apiserver (watch cache %v) ready in %v", watchCache, time.Since(start).Round(100*time.Millisecond))
	k.logAtReady = len(k.kube.log())
	k.readyz = startReadyzMonitor(k)
	k.initsAtReady = k.metrics()["apiserver_watch_cache_initializations_total"]
	k.allowedLog = map[string]int{}
	return k
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// try sends one request; body, if not nil, is sent as JSON.
func (k *kubeEnv) try(method, path string, body any) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, nil, err
		}
		rd = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, k.base+path, rd)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Authorization", "Bearer "+k.token)
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := k.hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// do is try, failing the test on a transport error or an unexpected status.
func (k *kubeEnv) do(method, path string, body any, want int, into any) []byte {
	k.t.Helper()
	code, b, err := k.try(method, path, body)
	if err != nil {
		k.t.Fatalf("%s %s: %v", method, path, err)
	}
	if code != want {
		k.t.Fatalf("%s %s: status %d, want %d: %s", method, path, code, want, b)
	}
	if into != nil {
		if err := json.Unmarshal(b, into); err != nil {
			k.t.Fatalf("%s %s: decoding %s: %v", method, path, b, err)
		}
	}
	return b
}

type objectMeta struct {
	Name            string `json:"name"`
	Namespace       string `json:"namespace,omitempty"`
	ResourceVersion string `json:"resourceVersion,omitempty"`
}

type configMap struct {
	APIVersion string            `json:"apiVersion,omitempty"`
	Kind       string            `json:"kind,omitempty"`
	Metadata   objectMeta        `json:"metadata"`
	Data       map[string]string `json:"data,omitempty"`
}

type configMapList struct {
	Metadata struct {
		ResourceVersion    string `json:"resourceVersion"`
		Continue           string `json:"continue"`
		RemainingItemCount *int64 `json:"remainingItemCount"`
	} `json:"metadata"`
	Items []configMap `json:"items"`
}

type apiStatus struct {
	Kind    string `json:"kind"`
	Code    int    `json:"code"`
	Reason  string `json:"reason"`
	Message string `json:"message"`
}

func rvOf(t testing.TB, s string) int64 {
	t.Helper()
	rv, err := strconv.ParseInt(s, 10, 64)
	if err != nil || rv <= 0 {
		t.Fatalf("bad resourceVersion %q", s)
	}
	return rv
}

func (k *kubeEnv) cmPath(name string) string {
	p := "/api/v1/namespaces/" + k.ns + "/configmaps"
	if name != "" {
		p += "/" + name
	}
	return p
}

// create creates a ConfigMap and checks read-your-writes: a GET and a
// consistent LIST right after it see it at its resourceVersion.
func (k *kubeEnv) create(name string) int64 {
	k.t.Helper()
	k.writes++
	v := fmt.Sprintf("w%d", k.writes)
	var got configMap
	k.do("POST", k.cmPath(""), configMap{APIVersion: "v1", Kind: "ConfigMap", Metadata: objectMeta{Name: name}, Data: map[string]string{"v": v}}, http.StatusCreated, &got)
	rv := k.record(got, v)

	var g configMap
	k.do("GET", k.cmPath(name), nil, http.StatusOK, &g)
	if g.Metadata.ResourceVersion != got.Metadata.ResourceVersion || g.Data["v"] != v {
		k.t.Fatalf("read-your-writes: GET %s right after its create (rv %d, v %s) returned rv %s, v %s", name, rv, v, g.Metadata.ResourceVersion, g.Data["v"])
	}
	var l configMapList
	k.do("GET", k.cmPath(""), nil, http.StatusOK, &l)
	if rvOf(k.t, l.Metadata.ResourceVersion) < rv {
		k.t.Fatalf("read-your-writes: LIST right after creating %s at %d is at %s", name, rv, l.Metadata.ResourceVersion)
	}
	found := false
	for _, it := range l.Items {
		if it.Metadata.Name == name {
			found = it.Metadata.ResourceVersion == got.Metadata.ResourceVersion && it.Data["v"] == v
		}
	}
	if !found {
		k.t.Fatalf("read-your-writes: LIST at %s right after creating %s at %d does not hold it", l.Metadata.ResourceVersion, name, rv)
	}
	return rv
}

func (k *kubeEnv) record(cm configMap, v string) int64 {
	rv := rvOf(k.t, cm.Metadata.ResourceVersion)
	if cm.Data["v"] != v {
		k.t.Fatalf("%s: wrote v=%s, the response has %q", cm.Metadata.Name, v, cm.Data["v"])
	}
	if k.values[cm.Metadata.Name] == nil {
		k.values[cm.Metadata.Name] = map[int64]string{}
	}
	k.values[cm.Metadata.Name][rv] = v
	return rv
}

// update replaces name's data, with its current resourceVersion as the
// precondition.
func (k *kubeEnv) update(name string) int64 {
	k.t.Helper()
	var cur configMap
	k.do("GET", k.cmPath(name), nil, http.StatusOK, &cur)
	k.writes++
	v := fmt.Sprintf("w%d", k.writes)
	cur.Data = map[string]string{"v": v}
	var got configMap
	k.do("PUT", k.cmPath(name), cur, http.StatusOK, &got)
	rv := k.record(got, v)
	if rv <= rvOf(k.t, cur.Metadata.ResourceVersion) {
		k.t.Fatalf("update of %s: resourceVersion %d not after %s", name, rv, cur.Metadata.ResourceVersion)
	}
	return rv
}

func (k *kubeEnv) remove(name string) {
	k.t.Helper()
	k.do("DELETE", k.cmPath(name), nil, http.StatusOK, nil)
	k.do("GET", k.cmPath(name), nil, http.StatusNotFound, nil)
}

// head returns the resourceVersion of a consistent LIST of the namespace.
func (k *kubeEnv) head() int64 {
	k.t.Helper()
	var l configMapList
	k.do("GET", k.cmPath("")+"?limit=1", nil, http.StatusOK, &l)
	return rvOf(k.t, l.Metadata.ResourceVersion)
}

// etcdAt returns, from the etcd behind the proxy (asked directly), the
// namespace's ConfigMaps at rev: name -> mod revision.
func (k *kubeEnv) etcdAt(rev int64) map[string]int64 {
	k.t.Helper()
	prefix := "/registry/configmaps/" + k.ns + "/"
	out := k.etcdctl(k.etcdCtl, "get", prefix, "--prefix", "--keys-only", "--rev="+itoa(rev), "-w", "json")
	var r struct {
		Kvs []struct {
			Key         []byte `json:"key"`
			ModRevision int64  `json:"mod_revision"`
		} `json:"kvs"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		k.t.Fatalf("etcdctl get at %d: %v: %s", rev, err, out)
	}
	m := map[string]int64{}
	for _, kv := range r.Kvs {
		m[strings.TrimPrefix(string(kv.Key), prefix)] = kv.ModRevision
	}
	return m
}

// etcdctl runs etcdctl with the global flags of etcd or of the proxy
// (k.etcdCtl, k.proxyCtl) and args, and returns its output.
func (k *kubeEnv) etcdctl(global []string, args ...string) string {
	k.t.Helper()
	return runEtcdctl(k.t, k.ctl, global, args...)
}

func runEtcdctl(t testing.TB, ctl string, global []string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, ctl, append(append([]string(nil), global...), args...)...)
	cmd.Env = ctlEnv()
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	if err := cmd.Run(); err != nil {
		t.Fatalf("etcdctl %s: %v\n%s%s", strings.Join(args, " "), err, o.String(), e.String())
	}
	return o.String()
}

// checkItems compares a LIST's items with etcd's keys and mod revisions at
// rev, and their data with what the test wrote at those revisions.
func (k *kubeEnv) checkItems(what string, rev int64, items []configMap) {
	k.t.Helper()
	want := k.etcdAt(rev)
	got := map[string]int64{}
	var order []string
	for _, it := range items {
		name := it.Metadata.Name
		if _, dup := got[name]; dup {
			k.t.Errorf("%s: %s listed twice", what, name)
		}
		rv := rvOf(k.t, it.Metadata.ResourceVersion)
		got[name] = rv
		order = append(order, name)
		if wv, ok := k.values[name][rv]; !ok || wv != it.Data["v"] {
			k.t.Errorf("%s: %s at %d has v=%q; the test wrote %q at that resourceVersion", what, name, rv, it.Data["v"], wv)
		}
	}
	if !sort.StringsAreSorted(order) {
		k.t.Errorf("%s: items not in key order: %v", what, order)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		k.t.Fatalf("%s at %d: items (name:resourceVersion)\n  got  %v\n  etcd %v", what, rev, got, want)
	}
}

// list pages through a LIST with query q, checking that every page is at
// the first page's resourceVersion (or at wantRV if not 0), with the right
// remainingItemCount; between pages it calls between (if not nil). It
// returns the resourceVersion and the items.
func (k *kubeEnv) list(what, q string, limit int, wantRV int64, between func(page int)) (int64, []configMap) {
	k.t.Helper()
	var items []configMap
	var rv int64
	cont := ""
	for page := 1; ; page++ {
		if page > 1000 {
			k.t.Fatalf("%s: more than 1000 pages", what)
		}
		query := url.Values{}
		if q != "" {
			parsed, err := url.ParseQuery(q)
			if err != nil {
				k.t.Fatal(err)
			}
			query = parsed
		}
		if limit > 0 {
			query.Set("limit", strconv.Itoa(limit))
		}
		if cont != "" {
			// A continue page carries no resourceVersion of its own.
			query.Del("resourceVersion")
			query.Del("resourceVersionMatch")
			query.Set("continue", cont)
		}
		var l configMapList
		k.do("GET", k.cmPath("")+"?"+query.Encode(), nil, http.StatusOK, &l)
		prv := rvOf(k.t, l.Metadata.ResourceVersion)
		if page == 1 {
			rv = prv
			if wantRV != 0 && rv != wantRV {
				k.t.Fatalf("%s: LIST at %d answered at resourceVersion %d", what, wantRV, rv)
			}
		} else if prv != rv {
			k.t.Fatalf("%s: page %d is at resourceVersion %d, page 1 at %d", what, page, prv, rv)
		}
		if limit > 0 && len(l.Items) > limit {
			k.t.Fatalf("%s: page %d has %d items, limit %d", what, page, len(l.Items), limit)
		}
		items = append(items, l.Items...)
		if l.Metadata.Continue == "" {
			if l.Metadata.RemainingItemCount != nil {
				k.t.Fatalf("%s: last page has remainingItemCount %d", what, *l.Metadata.RemainingItemCount)
			}
			return rv, items
		}
		if len(l.Items) == 0 {
			k.t.Fatalf("%s: page %d is empty but has a continue token", what, page)
		}
		if l.Metadata.RemainingItemCount != nil {
			total := len(k.etcdAt(rv))
			if want := int64(total - len(items)); *l.Metadata.RemainingItemCount != want {
				k.t.Errorf("%s: page %d: remainingItemCount %d, want %d", what, page, *l.Metadata.RemainingItemCount, want)
			}
		}
		cont = l.Metadata.Continue
		if between != nil {
			between(page)
		}
	}
}

// kubeWatch is a WATCH request's event stream.
type kubeWatch struct {
	cancel context.CancelFunc
	body   io.ReadCloser
	events chan watchEvent
	err    error // set before events is closed
}

type watchEvent struct {
	Type   string          `json:"type"`
	Object json.RawMessage `json:"object"`
}

func (k *kubeEnv) watch(query string) (*kubeWatch, int, []byte) {
	k.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "GET", k.base+k.cmPath("")+"?watch=true&"+query, nil)
	if err != nil {
		cancel()
		k.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+k.token)
	req.Header.Set("Accept", "application/json")
	resp, err := k.hc.Do(req)
	if err != nil {
		cancel()
		k.t.Fatalf("watch %s: %v", query, err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		return nil, resp.StatusCode, b
	}
	w := &kubeWatch{cancel: cancel, body: resp.Body, events: make(chan watchEvent, 1024)}
	go func() {
		defer close(w.events)
		dec := json.NewDecoder(bufio.NewReader(resp.Body))
		for {
			var ev watchEvent
			if err := dec.Decode(&ev); err != nil {
				w.err = err
				return
			}
			w.events <- ev
		}
	}()
	k.t.Cleanup(w.stop)
	return w, http.StatusOK, nil
}

func (w *kubeWatch) stop() {
	w.cancel()
	w.body.Close()
}

func (w *kubeWatch) next(t testing.TB, deadline time.Time) watchEvent {
	t.Helper()
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case ev, ok := <-w.events:
		if !ok {
			t.Fatalf("watch ended: %v", w.err)
		}
		return ev
	case <-timer.C:
		t.Fatalf("no watch event in time")
	}
	panic("unreachable")
}

// change is one change of a ConfigMap, as kube-apiserver's watch reports it
// (ADDED, MODIFIED, DELETED) and as etcd's history has it.
type change struct {
	Type string
	Name string
	RV   int64
}

func (c change) String() string { return fmt.Sprintf("%s %s@%d", c.Type, c.Name, c.RV) }

// watchUntil reads kube watch events up to the ADDED of sentinel.
func (k *kubeEnv) watchUntil(w *kubeWatch, sentinel string) []change {
	k.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var got []change
	for len(got) < 10000 {
		ev := w.next(k.t, deadline)
		if ev.Type == "ERROR" || ev.Type == "BOOKMARK" {
			k.t.Fatalf("unexpected %s event: %s (after %v)", ev.Type, ev.Object, got)
		}
		var cm configMap
		if err := json.Unmarshal(ev.Object, &cm); err != nil {
			k.t.Fatalf("watch event %s: %v", ev.Object, err)
		}
		c := change{ev.Type, cm.Metadata.Name, rvOf(k.t, cm.Metadata.ResourceVersion)}
		if ev.Type != "DELETED" {
			if wv, ok := k.values[c.Name][c.RV]; !ok || wv != cm.Data["v"] {
				k.t.Errorf("watch: %v has v=%q; the test wrote %q", c, cm.Data["v"], wv)
			}
		}
		got = append(got, c)
		if c.Type == "ADDED" && c.Name == sentinel {
			return got
		}
	}
	k.t.Fatalf("watch: no sentinel %s", sentinel)
	return nil
}

// etcdChanges returns the namespace's ConfigMap changes in etcd (asked
// directly) from revision from, up to the creation of sentinel.
func (k *kubeEnv) etcdChanges(from int64, sentinel string) []change {
	k.t.Helper()
	prefix := "/registry/configmaps/" + k.ns + "/"
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, k.ctl, append(append([]string(nil), k.etcdCtl...), "watch", "--prefix", prefix, "--rev="+itoa(from), "-w", "json")...)
	cmd.Env = ctlEnv()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		k.t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		k.t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	lr := newLineReader(stdout)
	deadline := time.Now().Add(60 * time.Second)
	var got []change
	for {
		l, err := lr.next(deadline)
		if err != nil {
			k.t.Fatalf("etcdctl watch from %d: %v (after %v); stderr: %s", from, err, got, stderr.String())
		}
		var r struct {
			Events []struct {
				Type int `json:"type"`
				Kv   struct {
					Key            []byte `json:"key"`
					CreateRevision int64  `json:"create_revision"`
					ModRevision    int64  `json:"mod_revision"`
				} `json:"kv"`
			}
		}
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			k.t.Fatalf("etcdctl watch: %q: %v", l, err)
		}
		for _, ev := range r.Events {
			c := change{Name: strings.TrimPrefix(string(ev.Kv.Key), prefix), RV: ev.Kv.ModRevision}
			switch {
			case ev.Type == 1:
				c.Type = "DELETED"
			case ev.Kv.CreateRevision == ev.Kv.ModRevision:
				c.Type = "ADDED"
			default:
				c.Type = "MODIFIED"
			}
			got = append(got, c)
			if c.Type == "ADDED" && c.Name == sentinel {
				return got
			}
		}
	}
}

// status decodes a Status answer.
func decodeStatus(b []byte) apiStatus {
	var s apiStatus
	_ = json.Unmarshal(b, &s)
	return s
}

func (k *kubeEnv) scenario() {
	t := k.t
	k.do("POST", "/api/v1/namespaces", map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": k.ns}}, http.StatusCreated, nil)

	// Creates, each read back at once (read-your-writes).
	for i := range 20 {
		k.create(fmt.Sprintf("cm-%02d", i))
	}
	rvOld := k.head()
	k.checkItems("consistent LIST after the creates", rvOld, k.listAll(""))

	// Updates, a conflicting update, deletes.
	for i := range 5 {
		k.update(fmt.Sprintf("cm-%02d", i))
	}
	var cm configMap
	k.do("GET", k.cmPath("cm-01"), nil, http.StatusOK, &cm)
	stale := cm
	stale.Metadata.ResourceVersion = itoa(rvOld)
	stale.Data = map[string]string{"v": "stale"}
	if st := decodeStatus(k.do("PUT", k.cmPath("cm-01"), stale, http.StatusConflict, nil)); st.Reason != "Conflict" {
		t.Errorf("update with a stale resourceVersion: %+v", st)
	}
	for i := 5; i < 8; i++ {
		k.remove(fmt.Sprintf("cm-%02d", i))
	}
	rvMid := k.head()

	// Exact-resourceVersion LISTs at older revisions, whole and paged.
	for _, rv := range []int64{rvOld, rvMid} {
		q := "resourceVersion=" + itoa(rv) + "&resourceVersionMatch=Exact"
		got, items := k.list("exact LIST", q, 0, rv, nil)
		k.checkItems("exact LIST", got, items)
		got, items = k.list("paged exact LIST", q, 3, rv, nil)
		k.checkItems("paged exact LIST", got, items)
	}

	// From here on, another client keeps writing in another namespace, so
	// that the revision moves while the proxy serves pages and watches.
	bg := k.startBackgroundWriter()

	// A paginated LIST (limit=2) with writes between its pages: a create,
	// an update and a delete, in turn.
	extra, victim := 0, 8
	rvP, items := k.list("paginated LIST", "", 2, 0, func(page int) {
		switch page % 3 {
		case 0:
			k.create(fmt.Sprintf("cm-new-%02d", extra))
			extra++
		case 1:
			k.update(fmt.Sprintf("cm-%02d", page%5))
		case 2:
			k.remove(fmt.Sprintf("cm-%02d", victim))
			victim++
		}
	})
	if rvP < rvMid {
		t.Fatalf("paginated LIST at %d, before %d", rvP, rvMid)
	}
	if k.head() <= rvP {
		t.Fatalf("no write happened while paginating at %d", rvP)
	}
	k.checkItems("paginated LIST during writes", rvP, items)
	t.Logf("paginated LIST: %d items at %d, in pages of 2 with writes between them; head now %d", len(items), rvP, k.head())

	// A WATCH from an old resourceVersion: exactly the changes after it, as
	// etcd's history has them, up to a sentinel written now.
	w, code, body := k.watch("resourceVersion=" + itoa(rvOld))
	if code != http.StatusOK {
		t.Fatalf("watch from %d: %d %s", rvOld, code, body)
	}
	k.create("zz-sentinel-1")
	got := k.watchUntil(w, "zz-sentinel-1")
	want := k.etcdChanges(rvOld+1, "zz-sentinel-1")
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("WATCH from %d:\n  got  %v\n  etcd %v", rvOld, got, want)
	}
	// The same watch goes on with live changes.
	k.update("cm-17")
	k.remove("cm-18")
	k.create("zz-sentinel-2")
	live := k.watchUntil(w, "zz-sentinel-2")
	if wantLive := k.etcdChanges(got[len(got)-1].RV+1, "zz-sentinel-2"); fmt.Sprint(live) != fmt.Sprint(wantLive) {
		t.Fatalf("WATCH (live) after %v:\n  got  %v\n  etcd %v", got[len(got)-1], live, wantLive)
	}
	w.stop()
	t.Logf("WATCH from %d: %d changes, then %d live ones, as in etcd", rvOld, len(got), len(live))

	// Compaction. A paginated LIST is begun before it; its continue token,
	// a LIST at a revision below it and (without the watch cache) a WATCH
	// from there then get 410 Gone.
	var first configMapList
	k.do("GET", k.cmPath("")+"?limit=2", nil, http.StatusOK, &first)
	if first.Metadata.Continue == "" {
		t.Fatal("no continue token")
	}
	k.update("cm-19")
	rvC := k.head()
	k.compact(rvC)
	k.expectGone("LIST at a compacted resourceVersion", k.cmPath("")+"?resourceVersion="+itoa(rvOld)+"&resourceVersionMatch=Exact")
	k.expectGone("continue token from before the compaction", k.cmPath("")+"?limit=2&continue="+url.QueryEscape(first.Metadata.Continue))
	if !k.watchCache {
		// With the watch cache, a watch is served from the cache's own
		// history, which an etcd compaction does not shorten.
		// kube-apiserver logs the compacted watch it relays once.
		k.allowedLog["watch chan error: etcdserver: mvcc: required revision has been compacted"]++
		w, code, body := k.watch("resourceVersion=" + itoa(rvOld))
		if code == http.StatusOK {
			ev := w.next(t, time.Now().Add(30*time.Second))
			w.stop()
			st := decodeStatus(ev.Object)
			if ev.Type != "ERROR" || st.Code != http.StatusGone {
				t.Fatalf("WATCH from compacted %d: %s %s, want an ERROR 410", rvOld, ev.Type, ev.Object)
			}
		} else if code != http.StatusGone {
			t.Fatalf("WATCH from compacted %d: %d %s", rvOld, code, body)
		}
	}
	bg.stop(t)

	// The compaction revision itself is still readable.
	gotC, itemsC := k.list("exact LIST at the compaction revision", "resourceVersion="+itoa(rvC)+"&resourceVersionMatch=Exact", 2, rvC, nil)
	k.checkItems("exact LIST at the compaction revision", gotC, itemsC)
	// And everything goes on.
	k.create("cm-after-compaction")
	k.checkItems("consistent LIST after the compaction", k.head(), k.listAll(""))

	k.readyz.stopAndCheck(t)
	k.checkMetrics()
	k.checkProxyMetrics()
	if k.check != nil {
		k.check(k)
	}
	k.scanLog()
}

// backgroundWriter updates one ConfigMap in its own namespace, every 20ms,
// until stopped.
type backgroundWriter struct {
	stopc  chan struct{}
	done   chan struct{}
	writes int
	errs   []string
}

func (k *kubeEnv) startBackgroundWriter() *backgroundWriter {
	k.t.Helper()
	ns := k.ns + "-bg"
	k.do("POST", "/api/v1/namespaces", map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": ns}}, http.StatusCreated, nil)
	path := "/api/v1/namespaces/" + ns + "/configmaps"
	k.do("POST", path, configMap{APIVersion: "v1", Kind: "ConfigMap", Metadata: objectMeta{Name: "bg"}}, http.StatusCreated, nil)
	b := &backgroundWriter{stopc: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(b.done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; i < 100000; i++ {
			// A merge patch: no read, no conflict.
			patch := map[string]any{"data": map[string]string{"i": strconv.Itoa(i)}}
			code, body, err := k.tryPatch(path+"/bg", patch)
			if err != nil || code != http.StatusOK {
				b.errs = append(b.errs, fmt.Sprintf("%d %v %s", code, err, lastLines(string(body), 1)))
			} else {
				b.writes++
			}
			select {
			case <-b.stopc:
				return
			case <-tick.C:
			}
		}
	}()
	k.t.Cleanup(func() {
		select {
		case <-b.stopc:
		default:
			close(b.stopc)
		}
		<-b.done
	})
	return b
}

func (b *backgroundWriter) stop(t testing.TB) {
	t.Helper()
	close(b.stopc)
	<-b.done
	if len(b.errs) > 0 {
		t.Errorf("background writes failed %d times, e.g. %s", len(b.errs), b.errs[0])
	}
	t.Logf("background writer: %d updates in another namespace meanwhile", b.writes)
}

func (k *kubeEnv) tryPatch(path string, patch any) (int, []byte, error) {
	b, err := json.Marshal(patch)
	if err != nil {
		return 0, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "PATCH", k.base+path, bytes.NewReader(b))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Authorization", "Bearer "+k.token)
	req.Header.Set("Content-Type", "application/merge-patch+json")
	resp, err := k.hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

func (k *kubeEnv) listAll(q string) []configMap {
	k.t.Helper()
	_, items := k.list("LIST", q, 0, 0, nil)
	return items
}

// compact compacts etcd at rev. With the watch cache off, it is done on
// etcd directly (the proxy learns it from its probe); with it on, it is
// done through the proxy as kube-apiserver's own compactor does it: first
// compact_rev_key, which kube-apiserver watches to drop its cache's
// snapshots below it, then the compaction.
func (k *kubeEnv) compact(rev int64) {
	k.t.Helper()
	if k.watchCache {
		k.etcdctl(k.proxyCtl, "put", "compact_rev_key", itoa(rev))
		k.revKeyWrites++
		k.etcdctl(k.proxyCtl, "compact", itoa(rev))
	} else {
		k.etcdctl(k.etcdCtl, "compact", itoa(rev))
	}
	k.proxy.waitCompactRevision(k.t, rev)
}

// expectGone waits for path to answer 410 Gone: kube-apiserver learns of a
// compaction within its own polling period (15s with the watch cache).
func (k *kubeEnv) expectGone(what, path string) {
	k.t.Helper()
	var last string
	waitUntil(k.t, 60*time.Second, what+" to answer 410 Gone", func() (bool, error) {
		code, b, err := k.try("GET", path, nil)
		if err != nil {
			return false, err
		}
		last = fmt.Sprintf("%d %s", code, lastLines(string(b), 1))
		if code == http.StatusGone {
			if st := decodeStatus(b); st.Code != http.StatusGone || st.Reason != "Expired" {
				return false, fmt.Errorf("410 with status %+v", st)
			}
			return true, nil
		}
		if code != http.StatusOK {
			return false, fmt.Errorf("%s", last)
		}
		return false, fmt.Errorf("still %s", last)
	}, k.kube)
	k.t.Logf("%s: 410 Gone", what)
}

// readyzMonitor polls /readyz until stopped and records every failure.
type readyzMonitor struct {
	stop     chan struct{}
	done     chan struct{}
	mu       sync.Mutex
	checks   int
	failures []string
}

func startReadyzMonitor(k *kubeEnv) *readyzMonitor {
	m := &readyzMonitor{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(m.done)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			code, b, err := k.try("GET", "/readyz?verbose", nil)
			m.mu.Lock()
			m.checks++
			if err != nil || code != http.StatusOK {
				m.failures = append(m.failures, fmt.Sprintf("%s: %d %v %s", time.Now().Format("15:04:05.000"), code, err, lastLines(string(b), 8)))
			}
			m.mu.Unlock()
			select {
			case <-m.stop:
				return
			case <-tick.C:
			}
		}
	}()
	k.t.Cleanup(func() {
		select {
		case <-m.stop:
		default:
			close(m.stop)
		}
		<-m.done
	})
	return m
}

func (m *readyzMonitor) stopAndCheck(t testing.TB) {
	t.Helper()
	close(m.stop)
	<-m.done
	if len(m.failures) > 0 {
		t.Errorf("/readyz failed %d times out of %d:\n%s", len(m.failures), m.checks, strings.Join(m.failures, "\n"))
	} else {
		t.Logf("/readyz green in all %d checks", m.checks)
	}
}

// checkProxyMetrics logs how the proxy answered kube-apiserver's reads. At
// least some must have come from its cache, and none may have been forwarded
// to etcd because the cache could not prove itself fresh, was inconsistent,
// or was overloaded, or for auth; the proxy must not have reloaded. The
// metrics are read where the variant's proxy serves them (on its client
// port, over mTLS, when it serves TLS).
func (k *kubeEnv) checkProxyMetrics() {
	k.t.Helper()
	lines, err := k.proxy.metricLines("")
	if err != nil {
		k.t.Fatalf("proxy metrics: %v", err)
	}
	var shown []string
	cached := 0.0
	for _, l := range lines {
		name, labels, v, ok := parseMetric(l)
		if !ok || v == 0 {
			continue
		}
		switch name {
		case "etcd_snapcache_range_requests_total":
			if strings.Contains(labels, `source="cache"`) {
				cached += v
			}
			for _, bad := range []string{"fresh_timeout", "fresh_error", "inconsistent", "overload"} {
				if strings.Contains(labels, `reason="`+bad+`"`) {
					k.t.Errorf("the proxy forwarded or refused reads: %s", l)
				}
			}
			// kube-apiserver sends no token: its reads, checked on the
			// proxy's auth mirror when etcd's auth is on, are neither
			// refused nor sent to etcd for a permission check.
			if strings.Contains(labels, `reason="auth"`) {
				k.t.Errorf("the proxy refused or forwarded kube-apiserver's reads for auth: %s", l)
			}
		case "etcd_snapcache_reloads_total", "etcd_snapcache_consistency_fallback":
			k.t.Errorf("the proxy's cache was reloaded or bypassed: %s", l)
		case "etcd_snapcache_watchers", "etcd_snapcache_watch_streams", "etcd_snapcache_watch_events_sent_total",
			"etcd_snapcache_compactions_observed_total", "etcd_snapcache_upstream_progress_requests_total",
			"etcd_snapcache_watch_compacted_total", "etcd_snapcache_watch_catchups_total":
		default:
			continue
		}
		shown = append(shown, l)
	}
	k.t.Logf("proxy metrics:\n%s", strings.Join(shown, "\n"))
	if cached == 0 {
		k.t.Errorf("no read was answered from the proxy's cache")
	}
}

// metrics returns kube-apiserver's metrics: name -> series (labels) -> value.
func (k *kubeEnv) metrics() map[string]map[string]float64 {
	k.t.Helper()
	b := k.do("GET", "/metrics", nil, http.StatusOK, nil)
	m := map[string]map[string]float64{}
	for l := range strings.SplitSeq(string(b), "\n") {
		name, labels, value, ok := parseMetric(l)
		if !ok {
			continue
		}
		if m[name] == nil {
			m[name] = map[string]float64{}
		}
		m[name][labels] = value
	}
	return m
}

// checkMetrics reads kube-apiserver's metrics: no watch cache may have been
// initialized again (a relist) since kube-apiserver became ready, and no
// consistent read from the watch cache may have failed or fallen back to
// etcd.
func (k *kubeEnv) checkMetrics() {
	k.t.Helper()
	m := k.metrics()
	caches := 0
	for series, v := range m["apiserver_watch_cache_initializations_total"] {
		caches++
		if before, ok := k.initsAtReady[series]; (ok && v != before) || (!ok && v > 1) {
			k.t.Errorf("watch cache relisted during the test: apiserver_watch_cache_initializations_total%s went from %v to %v", series, before, v)
		}
	}
	for series, v := range m["apiserver_watch_cache_initialization_errors_total"] {
		if v != 0 {
			k.t.Errorf("apiserver_watch_cache_initialization_errors_total%s %v", series, v)
		}
	}
	reads := 0.0
	for series, v := range m["apiserver_watch_cache_consistent_read_total"] {
		if v == 0 {
			continue
		}
		reads += v
		if !strings.Contains(series, `fallback="false"`) || !strings.Contains(series, `success="true"`) {
			k.t.Errorf("consistent reads from the watch cache failed or fell back to etcd: apiserver_watch_cache_consistent_read_total%s %v", series, v)
		}
	}
	for _, name := range []string{"apiserver_terminated_watchers_total", "apiserver_watch_cache_terminated_watchers_total"} {
		for series, v := range m[name] {
			if v != 0 {
				k.t.Errorf("watchers closed for unresponsiveness: %s%s %v", name, series, v)
			}
		}
	}
	k.t.Logf("kube-apiserver metrics: %d watch cache series, none reinitialized; %v consistent reads served by the watch cache, none fell back", caches, reads)
	if k.watchCache && (caches == 0 || reads == 0) {
		k.t.Errorf("with the watch cache on, expected watch caches (%d) and consistent reads from them (%v)", caches, reads)
	}
}

var metricRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$`)

func parseMetric(l string) (name, labels string, value float64, ok bool) {
	m := metricRE.FindStringSubmatch(l)
	if m == nil {
		return "", "", 0, false
	}
	v, err := strconv.ParseFloat(m[3], 64)
	if err != nil {
		return "", "", 0, false
	}
	return m[1], m[2], v, true
}

// badLogRE matches kube-apiserver log lines that show the watch cache or
// the storage layer misbehaving: a read waiting for a revision the cache
// never reached ("Too large resource version", a watch-cache timeout), a
// relist (the cacher's reflector restarting), a broken or failed watch, an
// event without the previous value, or a request etcd's auth refused.
var badLogRE = regexp.MustCompile(strings.Join([]string{
	`Too large resource version`,
	`[Tt]imeout.*(resource version|watch cache|cacher)`,
	`(watch cache|cacher).*[Tt]imeout`,
	`timed out waiting for.*(cache|resource version)`,
	`Terminating all watchers from cacher`,
	`unexpected ListAndWatch error`,
	`reinitializing`,
	`watch chan error`,
	`watch ended with`,
	`Watch failed`,
	`Failed to watch`,
	`failed to list`,
	`Watch closed with unexpected EOF`,
	`failed to sync with latest state`,
	`failed to prepare current and previous objects`,
	`Forcing .* watcher close due to unresponsiveness`,
	`event bookmark expired`,
	`required revision is a future revision`,
	// etcd's (or the proxy's) refusals of kube-apiserver's identity.
	`etcdserver: (permission denied|user name is empty|invalid auth token|revision of auth store is old)`,
}, "|"))

// startupSyncCanceled is logged when kube-apiserver, starting with the
// watch cache on, replaces the generic serviceaccounts storage it has just
// created (pkg/registry/core/rest/storage_core.go: "don't leak go
// routines"): Destroy cancels that storage's cacher and closes its etcd
// client, and the cacher's initial list, if still running, ends with its
// own context's error. A race inside kube-apiserver, whatever its etcd;
// tolerated in the startup's lines only. (An error from etcd or the proxy
// would read "rpc error: code = ...".)
const startupSyncCanceled = "failed to sync with latest state: context canceled"

func (k *kubeEnv) scanLog() {
	k.t.Helper()
	log := k.kube.log()
	var bad []string
	seen := map[string]int{}
	offset := 0
	for l := range strings.SplitSeq(log, "\n") {
		startup := offset < k.logAtReady
		offset += len(l) + 1
		if !badLogRE.MatchString(l) {
			continue
		}
		if startup && strings.Contains(l, startupSyncCanceled) {
			seen["startup: "+startupSyncCanceled]++
			continue
		}
		allowed := false
		for pattern, n := range k.allowedLog {
			if strings.Contains(l, pattern) && seen[pattern] < n {
				seen[pattern]++
				allowed = true
				break
			}
		}
		for _, pattern := range k.tolerated {
			if !allowed && strings.Contains(l, pattern) {
				seen[pattern]++
				allowed = true
			}
		}
		if !allowed {
			bad = append(bad, l)
		}
	}
	if len(bad) > 0 {
		if len(bad) > 40 {
			bad = append(bad[:40], fmt.Sprintf("... and %d more", len(bad)-40))
		}
		k.t.Errorf("kube-apiserver's log has %d lines showing watch-cache or storage trouble:\n%s", len(bad), strings.Join(bad, "\n"))
	} else {
		k.t.Logf("kube-apiserver's log (%d lines) is clean (but for what the test provokes: %v)", strings.Count(log, "\n"), seen)
	}
}

// waitServing waits until kube-apiserver serves: its serving certificate,
// self-signed under its own CA, is complete in certDir (it writes it there
// before it serves), and /readyz answers 200. k.hc trusts that certificate
// from then on. others are watched too: their exit fails the wait early.
func (k *kubeEnv) waitServing(certDir, what string, others ...*process) {
	t := k.t
	t.Helper()
	certFile := filepath.Join(certDir, "apiserver.crt")
	pool := x509.NewCertPool()
	waitUntil(t, 120*time.Second, "kube-apiserver's serving certificate", func() (bool, error) {
		b, err := os.ReadFile(certFile)
		return err == nil && pool.AppendCertsFromPEM(b), err
	}, k.kube)
	k.hc = &http.Client{Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"},
	}}
	waitUntil(t, 240*time.Second, what, func() (bool, error) {
		code, body, err := k.try("GET", "/readyz", nil)
		if err != nil {
			return false, err
		}
		if code != http.StatusOK {
			return false, fmt.Errorf("%d: %s", code, lastLines(string(body), 5))
		}
		return true, nil
	}, append([]*process{k.kube}, others...)...)
}
