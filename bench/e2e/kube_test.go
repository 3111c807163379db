package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
)

var (
	kubeObjects = flag.Int("snapcache.e2e.kube-objects", 2000, "ConfigMaps of BenchmarkKubeList")
	kubeValue   = flag.Int("snapcache.e2e.kube-value", 1024, "bytes of data of each ConfigMap")
	kubeClients = flag.Int("snapcache.e2e.kube-clients", 4, "concurrent LIST clients of BenchmarkKubeList")
	kubePage    = flag.Int("snapcache.e2e.kube-page", 500, "limit of BenchmarkKubeList/paginated")
)

// kubeAPIServerBinary is $KUBE_APISERVER_BIN, else the kube-apiserver that
// tools/build.sh builds; "" if there is none.
func kubeAPIServerBinary() string {
	return lookupBinary("KUBE_APISERVER_BIN", "../../.tools/bin/kube-apiserver")
}

// kubeProcess is an unmodified kube-apiserver run as a process.
type kubeProcess struct {
	*child
	base  string // https://127.0.0.1:port
	token string
	hc    *http.Client
}

// startKube starts kube-apiserver with its storage at etcdServers (and the
// other --etcd-* flags in etcdArgs), without its watch cache (every read
// goes to its storage), and waits until it is ready.
func startKube(b *testing.B, name, bin, etcdServers string, etcdArgs ...string) *kubeProcess {
	b.Helper()
	dir := b.TempDir()
	args, port, token := testsupport.KubeAPIServerSetup(b, dir)
	args = append(append(args, "--etcd-servers="+etcdServers, "--watch-cache=false"), etcdArgs...)
	k := &kubeProcess{base: fmt.Sprintf("https://127.0.0.1:%d", port), token: token}
	k.child = startChild(b, name, dir, bin, args)
	k.hc = testsupport.KubeClient(b, dir, port, token, 5*time.Minute, k.alive)
	return k
}

// do sends one request (body, if not nil, as JSON) and returns the
// response's body, or an error unless it answers want.
func (k *kubeProcess) do(ctx context.Context, method, path string, body any, want int) ([]byte, error) {
	var rd io.Reader
	if body != nil {
		bs, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(bs)
	}
	req, err := http.NewRequestWithContext(ctx, method, k.base+path, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+k.token)
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := k.hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != want {
		return nil, fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(out))
	}
	return out, nil
}

const kubeNS = "bench"

// list LISTs the namespace's ConfigMaps, in pages of limit (0: one
// request), and returns how many it read.
func (k *kubeProcess) list(ctx context.Context, limit int) (int, error) {
	n := 0
	cont := ""
	for {
		q := url.Values{}
		if limit > 0 {
			q.Set("limit", fmt.Sprint(limit))
		}
		if cont != "" {
			q.Set("continue", cont)
		}
		path := "/api/v1/namespaces/" + kubeNS + "/configmaps"
		if len(q) > 0 {
			path += "?" + q.Encode()
		}
		body, err := k.do(ctx, "GET", path, nil, http.StatusOK)
		if err != nil {
			return n, err
		}
		var l struct {
			Metadata struct {
				Continue string `json:"continue"`
			} `json:"metadata"`
			Items []json.RawMessage `json:"items"`
		}
		if err := json.Unmarshal(body, &l); err != nil {
			return n, err
		}
		n += len(l.Items)
		if cont = l.Metadata.Continue; cont == "" {
			return n, nil
		}
	}
}

// BenchmarkKubeList: two unmodified kube-apiservers with --watch-cache=false,
// one with etcd as its storage, the other with the proxy (in front of the
// same etcd); -snapcache.e2e.kube-objects ConfigMaps in one namespace,
// LISTed by -snapcache.e2e.kube-clients concurrent clients (one HTTP/2
// connection per kube-apiserver, JSON). An op is a whole LIST: "full" (one
// request, no limit: a consistent read of etcd) and "paginated" (limit
// -snapcache.e2e.kube-page, following continue tokens). Beside the usual
// values, each round reports etcd-cpu-ms and kube-cpu-ms: the CPU time
// etcd and the kube-apiserver spent per LIST (from /proc/<pid>/stat).
// Skipped without a kube-apiserver binary (`make tools-kube`). With
// -snapcache.e2e.tls, every hop is mTLS, kube-apiserver's to etcd or the
// proxy too; with -snapcache.e2e.auth, every hop is mTLS and etcd has auth
// on, as in clusters that enable etcd's RBAC (newKubeEnv).
func BenchmarkKubeList(b *testing.B) {
	bin := kubeAPIServerBinary()
	if bin == "" {
		b.Skip("no kube-apiserver binary: build it with `make tools-kube` (tools/build.sh kube), or set $KUBE_APISERVER_BIN")
	}
	start := time.Now()
	env, kubeTLS := newKubeEnv(b)
	kubes := map[*side]*kubeProcess{
		env.etcdS:  startKube(b, "kube-apiserver-etcd", bin, env.etcd.endpoint, kubeTLS...),
		env.proxyS: startKube(b, "kube-apiserver-proxy", bin, env.proxy.endpoint, kubeTLS...),
	}
	writer := kubes[env.etcdS]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := writer.do(ctx, "POST", "/api/v1/namespaces", map[string]any{
		"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": kubeNS},
	}, http.StatusCreated); err != nil {
		b.Fatal(err)
	}
	value := string(bytes.Repeat([]byte("x"), *kubeValue))
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	next := make(chan int)
	for range 8 {
		wg.Go(func() {
			for i := range next {
				if _, err := writer.do(ctx, "POST", "/api/v1/namespaces/"+kubeNS+"/configmaps", map[string]any{
					"apiVersion": "v1", "kind": "ConfigMap",
					"metadata": map[string]any{"name": fmt.Sprintf("cm-%05d", i)},
					"data":     map[string]string{"v": value},
				}, http.StatusCreated); err != nil {
					errs <- err
					cancel()
					return
				}
			}
		})
	}
feed:
	for i := range *kubeObjects {
		select {
		case next <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatalf("creating ConfigMaps: %v", err)
	}
	env.waitProxy(b, env.head(b), 0)
	for s, k := range kubes {
		if n, err := k.list(ctx, 0); err != nil || n != *kubeObjects {
			b.Fatalf("%s's kube-apiserver lists %d ConfigMaps (%v), want %d", s.name, n, err, *kubeObjects)
		}
	}
	b.Logf("setup: 2 kube-apiservers (--watch-cache=false), %d ConfigMaps of %d B, auth %v, transport %s; took %v",
		*kubeObjects, *kubeValue, env.auth, transportName(env.tls != nil), time.Since(start).Round(time.Millisecond))

	for _, tc := range []struct {
		name  string
		limit int
	}{{"full", 0}, {"paginated", *kubePage}} {
		b.Run(tc.name, func(b *testing.B) {
			compareSides(b, env, "op", func(b *testing.B, s *side, m *meter, warm bool) roundOut {
				k := kubes[s]
				etcd0, kube0 := processCPU(b, env.etcd.pid()), processCPU(b, k.pid())
				out := closedLoop(b, s, m, warm, *kubeClients, func(ctx context.Context, _ pb.KVClient) error {
					n, err := k.list(ctx, tc.limit)
					if err == nil && n != *kubeObjects {
						err = fmt.Errorf("listed %d ConfigMaps, want %d", n, *kubeObjects)
					}
					return err
				})
				if !warm {
					ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / out.ops }
					out.extra = map[string]float64{
						"etcd-cpu-ms": ms(processCPU(b, env.etcd.pid()) - etcd0),
						"kube-cpu-ms": ms(processCPU(b, k.pid()) - kube0),
					}
				}
				return out
			})
		})
	}
}

// newKubeEnv is BenchmarkKubeList's pair (startPair) and kube-apiserver's
// --etcd-* flags for it. With -snapcache.e2e.tls alone, kube-apiserver
// presents a certificate that names no user. With -snapcache.e2e.auth it
// runs as clusters that enable etcd's RBAC: kube-apiserver authenticates by
// client certificate only (it sends no password), so every hop is mTLS,
// with -snapcache.e2e.tls or without; etcd has a kube-apiserver user (no
// password) whose role reads and writes /registry/ and reads
// compact_rev_key (what it needs: integration/clients'
// kubeAPIServerPerms), and kube-apiserver's certificate names it (CN
// kube-apiserver); the proxy, --client-cert-auth as etcd, takes it for
// that user, and is root (--user) for its own load and watch.
func newKubeEnv(b *testing.B) (*pairEnv, []string) {
	b.Helper()
	if !*cmpAuth {
		env := newPairEnv(b)
		if env.pki == nil {
			return env, nil
		}
		return env, env.pki.kubeEtcd("anonymous")
	}
	env := startPair(b, true, true, func(ctx context.Context, admin *clientv3.Client) error {
		if _, err := admin.RoleAdd(ctx, "kube-apiserver"); err != nil {
			return err
		}
		if _, err := admin.RoleGrantPermission(ctx, "kube-apiserver", "/registry/", clientv3.GetPrefixRangeEnd("/registry/"), clientv3.PermissionType(clientv3.PermReadWrite)); err != nil {
			return err
		}
		if _, err := admin.RoleGrantPermission(ctx, "kube-apiserver", "compact_rev_key", "", clientv3.PermissionType(clientv3.PermRead)); err != nil {
			return err
		}
		if _, err := admin.UserAddWithOptions(ctx, "kube-apiserver", "", &clientv3.UserAddOptions{NoPassword: true}); err != nil {
			return err
		}
		_, err := admin.UserGrantRole(ctx, "kube-apiserver", "kube-apiserver")
		return err
	})
	return env, env.pki.kubeEtcd("kube-apiserver")
}
