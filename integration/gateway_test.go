package integration

// Differential tests of etcd's HTTP/JSON gateway (grpc-gateway, /v3/...):
// the same HTTP requests go to etcd's client port and to the proxy's, and
// the answers must be the same: status code, headers (Date and
// Content-Length aside) and body byte for byte. What may differ is taken
// out by name, case by case (gwNorm): a value each side picks on its own
// (a lease id etcd chooses, an auth token), and, for a write made once on
// each side, the revision (the proxy's write comes one revision after
// etcd's, and the expected answer is etcd's with that revision, and the
// key written, substituted). protojson puts a space after a separator or
// not depending on a hash of the binary, so etcd's body also matches in
// its compact form, which is the proxy's (see gwDiff).

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"go.uber.org/zap/zaptest"
	"google.golang.org/protobuf/encoding/protojson"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/internal/testsupport"
	"github.com/etcd-snapcache/etcd-snapcache/server"
	"github.com/etcd-snapcache/etcd-snapcache/server/servertest"
)

// gwHTTP is the gateway tests' HTTP client: a connection per request, so
// that no idle connection outlives a test, and a redirect is returned, not
// followed, so that it is compared.
var gwHTTP = &http.Client{
	Transport:     &http.Transport{DisableKeepAlives: true},
	CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

// gwReq is one HTTP request to a gateway.
type gwReq struct {
	method string // POST if empty
	path   string
	body   string
	token  string            // the Authorization header, if not empty
	header map[string]string // more request headers
}

// gwAnswer is what the client sees of the answer.
type gwAnswer struct {
	status int
	header http.Header
	body   []byte
}

func (a gwAnswer) String() string {
	var keys []string
	for k := range a.header {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "%d", a.status)
	for _, k := range keys {
		fmt.Fprintf(&b, "\n    %s: %q", k, a.header[k])
	}
	fmt.Fprintf(&b, "\n    body: %q", a.body)
	return b.String()
}

// gwDo sends r to the gateway at addr.
func gwDo(t testing.TB, addr string, r gwReq) gwAnswer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, cmp.Or(r.method, http.MethodPost), "http://"+addr+r.path, strings.NewReader(r.body))
	if err != nil {
		t.Fatal(err)
	}
	if r.token != "" {
		req.Header.Set("Authorization", r.token)
	}
	for k, v := range r.header {
		req.Header.Set(k, v)
	}
	resp, err := gwHTTP.Do(req)
	if err != nil {
		t.Fatalf("%s %s%s: %v", req.Method, addr, r.path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s%s: reading the body: %v", req.Method, addr, r.path, err)
	}
	return gwAnswer{status: resp.StatusCode, header: resp.Header, body: body}
}

// gwNorm says what of a pair of answers legitimately differs.
type gwNorm struct {
	// mask are JSON string fields whose values each side picks on its
	// own (a lease id, a token): in both bodies, the value becomes
	// "<field>".
	mask []string
	// maskRe are replaced by "<masked>" in both bodies.
	maskRe []*regexp.Regexp
	// subst are old, new pairs: etcd's body with each old replaced by new
	// is the proxy's expected one (the revision and key of a write made
	// once on each side). Each old must be in etcd's body.
	subst []string
}

// gwIgnoredHeaders differ between any two answers (Date) or follow from
// the bodies, which are compared (Content-Length).
var gwIgnoredHeaders = []string{"Date", "Content-Length"}

func (n gwNorm) apply(b []byte, etcd bool) ([]byte, error) {
	for _, f := range n.mask {
		re := regexp.MustCompile(`"` + regexp.QuoteMeta(f) + `":\s*"[^"]*"`)
		b = re.ReplaceAll(b, []byte(`"`+f+`":"<`+f+`>"`))
	}
	for _, re := range n.maskRe {
		b = re.ReplaceAll(b, []byte("<masked>"))
	}
	if etcd {
		for i := 0; i+1 < len(n.subst); i += 2 {
			if !bytes.Contains(b, []byte(n.subst[i])) {
				return nil, fmt.Errorf("TEST EXPECTATION: %q is not in etcd's answer %q", n.subst[i], b)
			}
			b = bytes.ReplaceAll(b, []byte(n.subst[i]), []byte(n.subst[i+1]))
		}
	}
	return b, nil
}

// gwDiff returns "" when the proxy's answer p is etcd's d, after n, else a
// description of the difference. A JSON body of etcd's is taken in its
// compact form: protojson adds a space after separators in some binaries
// and not in others (this test's etcd may have them), and the proxy's
// must be compact whatever the binary, as is the answer of an etcd built
// without them.
func gwDiff(d, p gwAnswer, n gwNorm) string {
	var diffs []string
	if d.status != p.status {
		diffs = append(diffs, fmt.Sprintf("status %d, the proxy's %d", d.status, p.status))
	}
	keys := map[string]bool{}
	for k := range d.header {
		keys[k] = true
	}
	for k := range p.header {
		keys[k] = true
	}
	for k := range keys {
		if !slices.Contains(gwIgnoredHeaders, k) && !slices.Equal(d.header[k], p.header[k]) {
			diffs = append(diffs, fmt.Sprintf("header %s: %q, the proxy's %q", k, d.header[k], p.header[k]))
		}
	}
	slices.Sort(diffs)
	dBody := d.body
	var compact bytes.Buffer
	if json.Compact(&compact, d.body) == nil {
		dBody = compact.Bytes()
	}
	pb, err := n.apply(p.body, false)
	if err != nil {
		return err.Error()
	}
	db, err := n.apply(dBody, true)
	if err != nil {
		return err.Error()
	}
	if !bytes.Equal(db, pb) {
		diffs = append(diffs, fmt.Sprintf("body (normalised):\n    etcd:  %s\n    proxy: %s", db, pb))
	}
	if len(diffs) == 0 {
		return ""
	}
	return strings.Join(diffs, "\n  ")
}

// gwPair is etcd's gateway and the proxy's.
type gwPair struct{ etcd, proxy string }

// same sends d to etcd and p to the proxy and reports a difference of
// their answers (gwDiff) as an error of t; it returns both answers.
func (g gwPair) same(t testing.TB, what string, d, p gwReq, n gwNorm) (gwAnswer, gwAnswer) {
	t.Helper()
	da, pa := gwDo(t, g.etcd, d), gwDo(t, g.proxy, p)
	if diff := gwDiff(da, pa, n); diff != "" {
		t.Errorf("%s: etcd and the proxy answer differently\n  etcd's request:  %s %s %q (token %q)\n  proxy's request: %s %s %q (token %q)\n  %s\n  etcd:  %s\n  proxy: %s",
			what, cmp.Or(d.method, "POST"), d.path, d.body, d.token, cmp.Or(p.method, "POST"), p.path, p.body, p.token, diff, da, pa)
	}
	return da, pa
}

// both is same with one request for both.
func (g gwPair) both(t testing.TB, what string, r gwReq) (gwAnswer, gwAnswer) {
	t.Helper()
	return g.same(t, what, r, r, gwNorm{})
}

// jsonField returns the string field name of a JSON object.
func jsonField(t testing.TB, body []byte, name string) string {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("answer %q: %v", body, err)
	}
	s, ok := m[name].(string)
	if !ok {
		t.Fatalf("answer %q has no string field %q", body, name)
	}
	return s
}

// headerRevision returns the header revision of a JSON answer.
func headerRevision(t testing.TB, body []byte) int64 {
	t.Helper()
	var m struct {
		Header struct {
			Revision string `json:"revision"`
		} `json:"header"`
	}
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("answer %q: %v", body, err)
	}
	rev, err := strconv.ParseInt(m.Header.Revision, 10, 64)
	if err != nil {
		t.Fatalf("answer %q: header revision: %v", body, err)
	}
	return rev
}

// gwWatchMsg is what the tests read of a JSON watch message.
type gwWatchMsg struct {
	Result struct {
		Created  bool `json:"created"`
		Canceled bool `json:"canceled"`
		Events   []struct {
			Kv struct {
				ModRevision string `json:"mod_revision"`
			} `json:"kv"`
		} `json:"events"`
	} `json:"result"`
}

// gwReadWatch reads messages with next until done holds of those read.
func gwReadWatch(t testing.TB, who string, next func() []byte, done func([]gwWatchMsg) bool) [][]byte {
	t.Helper()
	var raw [][]byte
	var msgs []gwWatchMsg
	for !done(msgs) {
		b := next()
		var m gwWatchMsg
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatalf("%s's watch message %q: %v (before it: %q)", who, b, err, raw)
		}
		raw, msgs = append(raw, b), append(msgs, m)
	}
	return raw
}

// messages is done after n messages.
func messages(n int) func([]gwWatchMsg) bool {
	return func(ms []gwWatchMsg) bool { return len(ms) >= n }
}

// eventsThrough is done once an event of revision rev or later came.
func eventsThrough(rev int64) func([]gwWatchMsg) bool {
	return func(ms []gwWatchMsg) bool {
		for _, m := range ms {
			for _, ev := range m.Result.Events {
				if r, _ := strconv.ParseInt(ev.Kv.ModRevision, 10, 64); r >= rev {
					return true
				}
			}
		}
		return false
	}
}

// canceled is done once a canceled message came.
func canceled(ms []gwWatchMsg) bool {
	return slices.ContainsFunc(ms, func(m gwWatchMsg) bool { return m.Result.Canceled })
}

// countEvents returns the events in raw messages.
func countEvents(t testing.TB, raw [][]byte) int {
	t.Helper()
	n := 0
	for _, b := range raw {
		var m gwWatchMsg
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		n += len(m.Result.Events)
	}
	return n
}

// sameMessages reports as an error of t any difference between etcd's
// watch messages and the proxy's, compared byte for byte.
func sameMessages(t testing.TB, what string, d, p [][]byte) {
	t.Helper()
	if slices.EqualFunc(d, p, bytes.Equal) {
		t.Logf("%s: %d identical messages, %d events", what, len(d), countEvents(t, d))
		return
	}
	var b strings.Builder
	for _, side := range []struct {
		name string
		msgs [][]byte
	}{{"etcd", d}, {"proxy", p}} {
		fmt.Fprintf(&b, "\n  %s's %d messages:", side.name, len(side.msgs))
		for _, m := range side.msgs {
			fmt.Fprintf(&b, "\n    %s", m)
		}
	}
	t.Errorf("%s: etcd's watch messages and the proxy's differ:%s", what, b.String())
}

// gwWatch is a JSON watch over HTTP: a POST of /v3/watch, whose body is
// the watch requests and whose answer streams the messages, a line each.
type gwWatch struct {
	t      testing.TB
	who    string
	resp   *http.Response
	lines  *bufio.Reader
	cancel context.CancelFunc
}

// openGWWatch posts body to addr's /v3/watch (token as the Authorization
// header if not empty); the stream ends with the test, or waitTimeout
// after it started.
func openGWWatch(t testing.TB, who, addr, body, token string) *gwWatch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/v3/watch", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", token)
	}
	resp, err := gwHTTP.Do(req)
	if err != nil {
		cancel()
		t.Fatalf("%s's watch: %v", who, err)
	}
	w := &gwWatch{t: t, who: who, resp: resp, lines: bufio.NewReader(resp.Body), cancel: cancel}
	t.Cleanup(w.close)
	return w
}

// next returns the next message.
func (w *gwWatch) next() []byte {
	w.t.Helper()
	line, err := w.lines.ReadBytes('\n')
	if err != nil {
		w.t.Fatalf("%s's watch: reading the next message: %v (read %q)", w.who, err, line)
	}
	return bytes.TrimSuffix(line, []byte("\n"))
}

// answer is the stream's status and headers.
func (w *gwWatch) answer() gwAnswer {
	return gwAnswer{status: w.resp.StatusCode, header: w.resp.Header}
}

func (w *gwWatch) close() {
	w.cancel()
	w.resp.Body.Close()
}

// gwSocket is a JSON watch over a websocket (etcd's wsproxy): each
// message sent is a watch request, each received a watch message.
type gwSocket struct {
	t    testing.TB
	who  string
	conn *websocket.Conn
	resp *http.Response
}

func dialGWSocket(t testing.TB, who, addr string) *gwSocket {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	conn, resp, err := websocket.DefaultDialer.DialContext(ctx, "ws://"+addr+"/v3/watch", nil)
	if err != nil {
		t.Fatalf("%s's websocket: %v (answer %v)", who, err, resp)
	}
	t.Cleanup(func() { conn.Close() })
	return &gwSocket{t: t, who: who, conn: conn, resp: resp}
}

func (s *gwSocket) send(msg string) {
	s.t.Helper()
	if err := s.conn.WriteMessage(websocket.TextMessage, []byte(msg)); err != nil {
		s.t.Fatalf("%s's websocket: sending %s: %v", s.who, msg, err)
	}
}

func (s *gwSocket) next() []byte {
	s.t.Helper()
	if err := s.conn.SetReadDeadline(time.Now().Add(waitTimeout)); err != nil {
		s.t.Fatal(err)
	}
	_, b, err := s.conn.ReadMessage()
	if err != nil {
		s.t.Fatalf("%s's websocket: reading the next message: %v", s.who, err)
	}
	return b
}

// gwCase is a named request.
type gwCase struct {
	name string
	req  gwReq
}

// rangeReq is a POST of body to /v3/kv/range.
func rangeReq(body string) gwReq { return gwReq{path: "/v3/kv/range", body: body} }

// sameRanges compares each case, JSON Ranges all, and checks the proxy's
// Range counters: each was served where expectedSource says, the cache
// for every read it can answer. etcd must not move meanwhile.
func (g gwPair) sameRanges(t *testing.T, c *cluster, cases []gwCase) {
	t.Helper()
	compactRev, head := c.etcdCompactRev(t), c.etcdRev(t)
	want := map[string]int{}
	cache0, fwd0, rej0 := c.rangeSources(t)
	for _, rc := range cases {
		g.both(t, rc.name, rc.req)
		var req pb.RangeRequest
		if err := protojson.Unmarshal([]byte(rc.req.body), &req); err != nil {
			t.Fatalf("%s: %s is not a RangeRequest: %v", rc.name, rc.req.body, err)
		}
		want[expectedSource(&req, compactRev, head)]++
	}
	cache1, fwd1, rej1 := c.rangeSources(t)
	dc, df, dr := int(cache1-cache0), int(fwd1-fwd0), int(rej1-rej0)
	if dr != want["rejected"] || dc != want["cache"] || df != want["forwarded"] || want[""] != 0 {
		t.Errorf("the proxy served the JSON Ranges: cache=%d forwarded=%d rejected=%d; want cache=%d forwarded=%d rejected=%d",
			dc, df, dr, want["cache"], want["forwarded"], want["rejected"])
	}
	if want["cache"] == 0 {
		t.Error("TEST EXPECTATION: none of the Ranges can be served from the cache")
	}
	if c.etcdRev(t) != head {
		t.Fatal("etcd's revision moved while the Ranges were compared")
	}
}

// watchMetrics are the proxy's counters of the watches it serves.
func (c *cluster) watchMetrics(t testing.TB) (sent, catchups, relayed float64) {
	return c.proxyMetric(t, "etcd_snapcache_watch_events_sent_total", nil),
		c.proxyMetric(t, "etcd_snapcache_watch_catchups_total", nil),
		c.proxyMetric(t, "etcd_snapcache_watch_relayed_streams_total", nil)
}

// servedFromHistory checks that the proxy sent the events of its watch
// messages itself, from its history: its count of events sent grew by as
// many since sent0, and no watch was caught up from etcd or relayed to it.
func (c *cluster) servedFromHistory(t *testing.T, msgs [][]byte, sent0, catchups0, relayed0 float64) {
	t.Helper()
	events := float64(countEvents(t, msgs))
	if events == 0 {
		t.Fatal("TEST EXPECTATION: the watch got no events")
	}
	testsupport.WaitFor(t, waitTimeout, "the proxy's count of the watch events it sent", func() bool {
		sent, _, _ := c.watchMetrics(t)
		return sent-sent0 >= events
	})
	sent, catchups, relayed := c.watchMetrics(t)
	if sent-sent0 != events || catchups != catchups0 || relayed != relayed0 {
		t.Errorf("the proxy sent %v events for the %v of its JSON watch, caught %v watches up from etcd and relayed %v streams to it; want all the events from its history",
			sent-sent0, events, catchups-catchups0, relayed-relayed0)
	}
}

// TestGatewayDifferential proves that etcd's JSON gateway served by the
// proxy answers as etcd's own, byte for byte, without auth: every Range
// form (single key, prefix, from key, whole keyspace, limit with more and
// count, keys_only, count_only, serializable, past, head and future
// revisions, each sort order and target, the revision filters, /v3beta/),
// all of them served where the cache can serve them (its Range counters
// say so); bad requests (not JSON, unknown fields, an empty body, bad
// values, a GET, unknown and unclean paths, an OPTIONS preflight and CORS);
// the other services' paths (auth status, alarms, leases, maintenance
// status, member list); a JSON watch over HTTP and one over a websocket
// from a past revision with prev_kv, with a live event, progress and
// cancel requests, served from the proxy's history (its watch counters say
// so); puts, txns, deletes, lease grants and revokes and compactions, each
// once on each side; and after a compaction, a Range and a watch of a
// compacted revision.
func TestGatewayDifferential(t *testing.T) {
	c := newCluster(t, clusterOptions{clientURL: "http://" + testsupport.FreeAddr(t)})
	g := gwPair{etcd: c.etcdAddr, proxy: c.proxyAddr}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// History, straight to etcd: single and multi-key revisions, updates,
	// deletes, a leased key and a key that is not UTF-8.
	w := etcdWriter{t, c.direct}
	lease, err := c.direct.Grant(ctx, 3600)
	if err != nil {
		t.Fatal(err)
	}
	first := w.put("a", "1")
	bFirst := w.put("b/1", "x")
	w.txn(clientv3.OpPut("b/2", "y"), clientv3.OpPut("b/10", "z"))
	w.put("c", "3")
	w.put("foo", "bar")
	w.put("foo/x", "fx", clientv3.WithLease(lease.ID))
	w.put("\xff\x00", "binary key")
	past := w.put("a", "2")
	w.put("b/2", "y2")
	w.del("c")
	w.put("d", "4")
	bLast := w.del("b/10")
	head := w.put("e", "5")
	c.waitSynced(t)
	if hs := c.proxy.Store().HistoryStart(); hs > first {
		t.Fatalf("TEST EXPECTATION: the proxy's history starts at %d, after the history written from %d", hs, first)
	}

	all := fmt.Sprintf(`"key":%q,"range_end":%q`, b64("\x00"), b64("\x00"))
	prefixB := fmt.Sprintf(`"key":%q,"range_end":%q`, b64("b/"), b64("b0"))
	rangeForms := []gwCase{
		{"single key", rangeReq(fmt.Sprintf(`{"key":%q}`, b64("a")))},
		{"single key, serializable", rangeReq(fmt.Sprintf(`{"key":%q,"serializable":true}`, b64("a")))},
		{"absent key", rangeReq(fmt.Sprintf(`{"key":%q}`, b64("nope")))},
		{"deleted key", rangeReq(fmt.Sprintf(`{"key":%q}`, b64("c")))},
		{"prefix", rangeReq(`{` + prefixB + `}`)},
		{"from key", rangeReq(fmt.Sprintf(`{"key":%q,"range_end":%q}`, b64("b"), b64("\x00")))},
		{"whole keyspace", rangeReq(`{` + all + `}`)},
		{"[key, end)", rangeReq(fmt.Sprintf(`{"key":%q,"range_end":%q}`, b64("b/10"), b64("d")))},
		{"key that is not UTF-8", rangeReq(fmt.Sprintf(`{"key":%q}`, b64("\xff\x00")))},
		{"leased key", rangeReq(fmt.Sprintf(`{"key":%q}`, b64("foo/x")))},
		{"limit: more and count", rangeReq(`{` + all + `,"limit":"2"}`)},
		{"limit as a JSON number", rangeReq(`{` + all + `,"limit":3}`)},
		{"limit beyond the keys", rangeReq(`{` + all + `,"limit":"100"}`)},
		{"keys only", rangeReq(`{` + prefixB + `,"keys_only":true}`)},
		{"count only", rangeReq(`{` + all + `,"count_only":true}`)},
		{"count only, serializable, limit", rangeReq(`{` + all + `,"count_only":true,"serializable":true,"limit":"1"}`)},
		{"serializable prefix", rangeReq(`{` + prefixB + `,"serializable":true}`)},
		{"past revision", rangeReq(fmt.Sprintf(`{%s,"revision":"%d"}`, all, past))},
		{"past revision, serializable single key", rangeReq(fmt.Sprintf(`{"key":%q,"revision":"%d","serializable":true}`, b64("b/2"), past))},
		{"past revision as a JSON number, deleted since", rangeReq(fmt.Sprintf(`{"key":%q,"revision":%d}`, b64("c"), past))},
		{"revision 1", rangeReq(`{` + all + `,"revision":"1"}`)},
		{"head revision", rangeReq(fmt.Sprintf(`{%s,"revision":"%d"}`, all, head))},
		{"future revision", rangeReq(fmt.Sprintf(`{%s,"revision":"%d"}`, all, head+5))},
		{"future revision, serializable", rangeReq(fmt.Sprintf(`{%s,"revision":"%d","serializable":true}`, all, head+5))},
		{"sort by key, descending", rangeReq(`{` + all + `,"sort_order":"DESCEND"}`)},
		{"sort by key, ascending", rangeReq(`{` + all + `,"sort_order":"ASCEND","sort_target":"KEY"}`)},
		{"sort by mod revision, descending, limit", rangeReq(`{` + all + `,"sort_order":"DESCEND","sort_target":"MOD","limit":"3"}`)},
		{"sort by create revision", rangeReq(`{` + all + `,"sort_order":"ASCEND","sort_target":"CREATE"}`)},
		{"sort by version, descending", rangeReq(`{` + all + `,"sort_order":"DESCEND","sort_target":"VERSION"}`)},
		{"sort by value, keys only", rangeReq(`{` + all + `,"sort_target":"VALUE","keys_only":true}`)},
		{"sort as numeric enums", rangeReq(`{` + all + `,"sort_order":2,"sort_target":4}`)},
		{"sort at a past revision, limit", rangeReq(fmt.Sprintf(`{%s,"revision":"%d","sort_order":"DESCEND","sort_target":"MOD","limit":"2"}`, all, past))},
		{"mod revision window", rangeReq(fmt.Sprintf(`{%s,"min_mod_revision":"%d","max_mod_revision":"%d"}`, all, bFirst+1, past))},
		{"create revision window", rangeReq(fmt.Sprintf(`{%s,"min_create_revision":"%d","max_create_revision":"%d"}`, all, bFirst, past-1))},
		{"revision filters with a limit", rangeReq(fmt.Sprintf(`{%s,"min_mod_revision":"%d","limit":"1"}`, all, past))},
		{"/v3beta/ path", gwReq{path: "/v3beta/kv/range", body: `{` + prefixB + `}`}},
	}
	t.Run("ranges", func(t *testing.T) { g.sameRanges(t, c, rangeForms) })

	t.Run("bad input", func(t *testing.T) {
		for _, bc := range []gwCase{
			{"not JSON", rangeReq("not json")},
			{"an unknown field", rangeReq(`{"key":"Zm9v","nope":1}`)},
			{"an unknown object field", rangeReq(`{"key":"Zm9v","nope":{"a":[1,2]}}`)},
			{"an empty body", rangeReq("")},
			{"JSON null", rangeReq("null")},
			{"a JSON array", rangeReq("[]")},
			{"trailing garbage", rangeReq(`{"key":"Zm9v"} trailing`)},
			{"truncated JSON", rangeReq(`{"key":"Zm9v"`)},
			{"bad base64", rangeReq(`{"key":"%%%"}`)},
			{"a number for bytes", rangeReq(`{"key":5}`)},
			{"an unknown enum name", rangeReq(`{"key":"Zm9v","sort_order":"SIDEWAYS"}`)},
			{"an int64 out of range", rangeReq(`{"key":"Zm9v","limit":"99999999999999999999"}`)},
			{"a string for a bool", rangeReq(`{"key":"Zm9v","serializable":"yes"}`)},
			{"a negative revision", rangeReq(`{"key":"Zm9v","revision":"-1"}`)},
			{"a put without a key", gwReq{path: "/v3/kv/put", body: `{"value":"dg=="}`}},
			{"a GET of /v3/kv/range", gwReq{method: http.MethodGet, path: "/v3/kv/range"}},
			{"a PUT of /v3/kv/range", gwReq{method: http.MethodPut, path: "/v3/kv/range", body: `{"key":"Zm9v"}`}},
			{"an unknown path", gwReq{path: "/v3/kv/nope", body: `{}`}},
			{"an unknown service", gwReq{path: "/v3/nope", body: `{}`}},
			{"/v3 without its slash", gwReq{method: http.MethodGet, path: "/v3"}},
			{"an unclean path", gwReq{path: "/v3/kv//range", body: `{"key":"Zm9v"}`}},
			{"an OPTIONS preflight", gwReq{method: http.MethodOptions, path: "/v3/kv/range", header: map[string]string{
				"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}}},
			{"a POST with an Origin", gwReq{path: "/v3/kv/range", body: `{"key":"Zm9v"}`, header: map[string]string{"Origin": "http://example.com"}}},
			{"a text/plain body", gwReq{path: "/v3/kv/range", body: `{"key":"Zm9v"}`, header: map[string]string{"Content-Type": "text/plain"}}},
		} {
			g.both(t, bc.name, bc.req)
		}
	})

	t.Run("services", func(t *testing.T) {
		for _, sc := range []gwCase{
			{"auth status", gwReq{path: "/v3/auth/status", body: `{}`}},
			{"alarm list", gwReq{path: "/v3/maintenance/alarm", body: `{"action":"GET"}`}},
			{"leases", gwReq{path: "/v3/lease/leases", body: `{}`}},
			{"lease time to live of an unknown lease", gwReq{path: "/v3/lease/timetolive", body: `{"ID":"12345"}`}},
		} {
			g.both(t, sc.name, sc.req)
		}
		// The member list names the proxy, as grpc-proxy's with an
		// advertised URL (TestMemberListForwardedWithoutAdvertiseURL
		// covers etcd's own): the rest of the answer is etcd's.
		members := gwNorm{maskRe: []*regexp.Regexp{regexp.MustCompile(`"members":\[.*\]`)}}
		for _, body := range []string{`{}`, `{"linearizable":true}`} {
			d, p := g.same(t, "member list "+body, gwReq{path: "/v3/cluster/member/list", body: body}, gwReq{path: "/v3/cluster/member/list", body: body}, members)
			var dl, pl struct {
				Members []struct {
					ClientURLs []string `json:"clientURLs"`
				} `json:"members"`
			}
			if err := json.Unmarshal(d.body, &dl); err != nil || len(dl.Members) != 1 {
				t.Errorf("etcd's member list %s: %s (%v), want its one member", body, d.body, err)
			}
			if err := json.Unmarshal(p.body, &pl); err != nil || len(pl.Members) != 1 || !slices.Equal(pl.Members[0].ClientURLs, []string{"http://" + c.proxyAddr}) {
				t.Errorf("the proxy's member list %s: %s (%v), want the one member http://%s", body, p.body, err, c.proxyAddr)
			}
		}
		// The status holds etcd's database size and raft indexes, which
		// move on their own: compared when etcd's answer held still
		// across the proxy's.
		status := gwReq{path: "/v3/maintenance/status", body: `{}`}
		testsupport.Poll(t, waitTimeout, 20*time.Millisecond, "etcd's status to hold still across the proxy's", func() (bool, error) {
			d1, p, d2 := gwDo(t, g.etcd, status), gwDo(t, g.proxy, status), gwDo(t, g.etcd, status)
			var compact bytes.Buffer
			if err := json.Compact(&compact, d2.body); err != nil {
				t.Fatalf("etcd's status %q: %v", d2.body, err)
			}
			d2.body = compact.Bytes()
			if gwDiff(d1, d2, gwNorm{}) != "" {
				return false, fmt.Errorf("etcd's status moved: %s, then %s", d1.body, d2.body)
			}
			if diff := gwDiff(d1, p, gwNorm{}); diff != "" {
				t.Fatalf("maintenance status: etcd and the proxy answer differently\n  %s\n  etcd:  %s\n  proxy: %s", diff, d1, p)
			}
			return true, nil
		})
	})

	// A watch from a past revision with prev_kv over HTTP: the created
	// message, the history in etcd's messages, then a live event.
	t.Run("watch", func(t *testing.T) {
		c.waitSynced(t)
		sent0, catchups0, relayed0 := c.watchMetrics(t)
		body := fmt.Sprintf(`{"create_request":{%s,"start_revision":"%d","prev_kv":true}}`, prefixB, bFirst)
		d, p := openGWWatch(t, "etcd", g.etcd, body, ""), openGWWatch(t, "proxy", g.proxy, body, "")
		if diff := gwDiff(d.answer(), p.answer(), gwNorm{}); diff != "" {
			t.Errorf("the watch's answer: %s", diff)
		}
		dm, pm := gwReadWatch(t, "etcd", d.next, eventsThrough(bLast)), gwReadWatch(t, "proxy", p.next, eventsThrough(bLast))
		sameMessages(t, "a watch from a past revision with prev_kv", dm, pm)
		live := w.put("b/3", "live")
		dl, pl := gwReadWatch(t, "etcd", d.next, eventsThrough(live)), gwReadWatch(t, "proxy", p.next, eventsThrough(live))
		sameMessages(t, "a live event", dl, pl)
		c.servedFromHistory(t, append(pm, pl...), sent0, catchups0, relayed0)
	})

	// The same over a websocket, where the stream's requests go one at a
	// time: create requests, a progress request, a live event, a cancel.
	t.Run("websocket watch", func(t *testing.T) {
		c.waitSynced(t)
		sent0, catchups0, relayed0 := c.watchMetrics(t)
		d, p := dialGWSocket(t, "etcd", g.etcd), dialGWSocket(t, "proxy", g.proxy)
		// The handshake's answer: Sec-WebSocket-Accept follows from the
		// client's random key.
		handshake := func(s *gwSocket) gwAnswer {
			h := s.resp.Header.Clone()
			h.Del("Sec-Websocket-Accept")
			return gwAnswer{status: s.resp.StatusCode, header: h}
		}
		if diff := gwDiff(handshake(d), handshake(p), gwNorm{}); diff != "" {
			t.Errorf("the websocket handshake: %s", diff)
		}
		var proxyMsgs [][]byte
		step := func(what, send string, done func([]gwWatchMsg) bool) {
			t.Helper()
			if send != "" {
				d.send(send)
				p.send(send)
			}
			dm, pm := gwReadWatch(t, "etcd", d.next, done), gwReadWatch(t, "proxy", p.next, done)
			sameMessages(t, what, dm, pm)
			proxyMsgs = append(proxyMsgs, pm...)
		}
		step("create from a past revision with prev_kv",
			fmt.Sprintf(`{"create_request":{%s,"start_revision":"%d","prev_kv":true}}`, prefixB, bFirst), eventsThrough(bLast))
		step("create from now", fmt.Sprintf(`{"create_request":{"key":%q}}`, b64("a")), messages(1))
		step("progress request", `{"progress_request":{}}`, messages(1))
		live := w.put("b/4", "websocket")
		step("a live event", "", eventsThrough(live))
		step("cancel", `{"cancel_request":{"watch_id":"0"}}`, messages(1))
		step("create with a filter, a fragment flag and an id",
			fmt.Sprintf(`{"create_request":{"key":%q,"start_revision":"%d","filters":["NOPUT"],"fragment":true,"watch_id":"7"}}`, b64("c"), first), messages(2))
		c.servedFromHistory(t, proxyMsgs, sent0, catchups0, relayed0)
	})

	t.Run("writes", func(t *testing.T) {
		// Each mirrored write has its own pair of keys, made in one
		// revision, so that their revisions and versions are the same.
		var setup []clientv3.Op
		for _, k := range []string{"put/%s", "iv/%s", "txn/%s", "tdel/%s", "del/%s/1", "del/%s/2"} {
			for _, side := range []string{"e", "p"} {
				setup = append(setup, clientv3.OpPut(fmt.Sprintf(k, side), "old"))
			}
		}
		w.txn(setup...)
		c.waitSynced(t)
		// mirrored writes body("e") to etcd, then body("p") through the
		// proxy: the proxy's answer must be etcd's with the next revision
		// and the proxy's keys (keys: formats of the keys in the answer).
		mirrored := func(what, path string, body func(side string) string, keys ...string) {
			t.Helper()
			before := c.etcdRev(t)
			d, _ := g.same(t, what, gwReq{path: path, body: body("e")}, gwReq{path: path, body: body("p")}, gwNorm{
				subst: append([]string{fmt.Sprintf(`"%d"`, before+1), fmt.Sprintf(`"%d"`, before+2)}, substKeys(keys)...),
			})
			if rev := headerRevision(t, d.body); rev != before+1 {
				t.Errorf("%s: etcd's write is at revision %d after %d", what, rev, before)
			}
		}
		mirrored("put", "/v3/kv/put", func(s string) string {
			return fmt.Sprintf(`{"key":%q,"value":%q}`, b64("new/"+s), b64("v"))
		})
		mirrored("put with prev_kv", "/v3/kv/put", func(s string) string {
			return fmt.Sprintf(`{"key":%q,"value":%q,"prev_kv":true}`, b64("put/"+s), b64("new"))
		}, "put/%s")
		mirrored("put with a lease", "/v3/kv/put", func(s string) string {
			return fmt.Sprintf(`{"key":%q,"value":%q,"lease":"%d"}`, b64("leased/"+s), b64("v"), lease.ID)
		})
		mirrored("put with ignore_value and prev_kv", "/v3/kv/put", func(s string) string {
			return fmt.Sprintf(`{"key":%q,"ignore_value":true,"prev_kv":true}`, b64("iv/"+s))
		}, "iv/%s")
		mirrored("txn, succeeded", "/v3/kv/txn", func(s string) string {
			k := b64("txn/" + s)
			return fmt.Sprintf(`{"compare":[{"key":%q,"target":"VALUE","result":"EQUAL","value":%q},{"key":%q,"target":"VERSION","version":"1"}],`+
				`"success":[{"request_put":{"key":%q,"value":%q,"prev_kv":true}},{"request_range":{"key":%q}},{"request_delete_range":{"key":%q,"prev_kv":true}}],`+
				`"failure":[{"request_range":{"key":%q}}]}`, k, b64("old"), k, k, b64("new"), k, b64("tdel/"+s), k)
		}, "txn/%s", "tdel/%s")
		mirrored("delete of a prefix with prev_kv", "/v3/kv/deleterange", func(s string) string {
			return fmt.Sprintf(`{"key":%q,"range_end":%q,"prev_kv":true}`, b64("del/"+s+"/"), b64("del/"+s+"0"))
		}, "del/%s/1", "del/%s/2")
		for _, wc := range []gwCase{
			{"txn, failed", gwReq{path: "/v3/kv/txn", body: fmt.Sprintf(`{"compare":[{"key":%q,"target":"MOD","result":"LESS","mod_revision":"1"}],`+
				`"success":[{"request_put":{"key":%q,"value":%q}}],"failure":[{"request_range":{"key":%q,"range_end":%q}}]}`,
				b64("a"), b64("a"), b64("never"), b64("b/"), b64("b0"))}},
			{"txn, nested", gwReq{path: "/v3/kv/txn", body: fmt.Sprintf(`{"success":[{"request_txn":{"compare":[{"key":%q,"target":"CREATE","result":"GREATER","create_revision":"0"}],`+
				`"success":[{"request_range":{"key":%q,"count_only":true}}]}}]}`, b64("a"), b64("a"))}},
			{"txn with a key put twice", gwReq{path: "/v3/kv/txn", body: fmt.Sprintf(`{"success":[{"request_put":{"key":%q}},{"request_put":{"key":%q}}]}`, b64("x"), b64("x"))}},
			{"delete of an absent key", gwReq{path: "/v3/kv/deleterange", body: fmt.Sprintf(`{"key":%q}`, b64("absent"))}},
			{"put with an unknown lease", gwReq{path: "/v3/kv/put", body: fmt.Sprintf(`{"key":%q,"lease":"12345"}`, b64("x"))}},
			{"put with ignore_value of an absent key", gwReq{path: "/v3/kv/put", body: fmt.Sprintf(`{"key":%q,"ignore_value":true}`, b64("absent"))}},
		} {
			g.both(t, wc.name, wc.req)
		}

		// Leases: ids etcd picks are masked; ids the caller picks are
		// etcd's one, the proxy's the next.
		grant := gwReq{path: "/v3/lease/grant", body: `{"TTL":"600"}`}
		d, p := g.same(t, "lease grant", grant, grant, gwNorm{mask: []string{"ID"}})
		dID, pID := jsonField(t, d.body, "ID"), jsonField(t, p.body, "ID")
		g.same(t, "lease revoke", gwReq{path: "/v3/lease/revoke", body: `{"ID":"` + dID + `"}`}, gwReq{path: "/v3/lease/revoke", body: `{"ID":"` + pID + `"}`}, gwNorm{})
		const etcdLease, proxyLease = 0x1001, 0x1002
		g.same(t, "lease grant with an id",
			gwReq{path: "/v3/lease/grant", body: fmt.Sprintf(`{"ID":"%d","TTL":"600"}`, etcdLease)},
			gwReq{path: "/v3/lease/grant", body: fmt.Sprintf(`{"ID":"%d","TTL":"600"}`, proxyLease)},
			gwNorm{subst: []string{fmt.Sprintf(`"ID":"%d"`, etcdLease), fmt.Sprintf(`"ID":"%d"`, proxyLease)}})
		g.both(t, "lease grant of an existing id", gwReq{path: "/v3/lease/grant", body: fmt.Sprintf(`{"ID":"%d","TTL":"600"}`, etcdLease)})
		ids := map[string]int{"e": etcdLease, "p": proxyLease}
		mirrored("put with the granted lease", "/v3/kv/put", func(s string) string {
			return fmt.Sprintf(`{"key":%q,"lease":"%d"}`, b64("lk/"+s), ids[s])
		})
		mirrored("lease revoke, deleting a key", "/v3/lease/revoke", func(s string) string {
			return fmt.Sprintf(`{"ID":"%d"}`, ids[s])
		})
		g.both(t, "lease revoke of an unknown lease", gwReq{path: "/v3/lease/revoke", body: fmt.Sprintf(`{"ID":"%d"}`, etcdLease)})
		g.both(t, "leases", gwReq{path: "/v3/lease/leases", body: `{}`})
		c.waitSynced(t)
		g.sameRanges(t, c, []gwCase{
			{"the writes", rangeReq(`{` + all + `}`)},
			{"the writes, serializable", rangeReq(`{` + all + `,"serializable":true}`)},
		})
	})

	t.Run("compaction", func(t *testing.T) {
		head := c.etcdRev(t)
		compaction := func(rev int64) gwReq {
			return gwReq{path: "/v3/kv/compaction", body: fmt.Sprintf(`{"revision":"%d","physical":true}`, rev)}
		}
		g.same(t, "compaction, etcd's then the proxy's", compaction(past), compaction(past+1), gwNorm{})
		g.both(t, "compaction of a compacted revision", compaction(past))
		g.both(t, "compaction of a future revision", compaction(head+100))
		c.waitSynced(t)
		g.sameRanges(t, c, []gwCase{
			{"compacted revision", rangeReq(fmt.Sprintf(`{%s,"revision":"%d"}`, all, past))},
			{"compacted revision, serializable", rangeReq(fmt.Sprintf(`{%s,"revision":"%d","serializable":true}`, all, past))},
			{"the compaction revision", rangeReq(fmt.Sprintf(`{%s,"revision":"%d"}`, all, past+1))},
			{"after the compaction", rangeReq(`{` + all + `}`)},
		})
		body := fmt.Sprintf(`{"create_request":{%s,"start_revision":"%d","prev_kv":true}}`, prefixB, bFirst)
		d, p := openGWWatch(t, "etcd", g.etcd, body, ""), openGWWatch(t, "proxy", g.proxy, body, "")
		sameMessages(t, "a watch from a compacted revision",
			gwReadWatch(t, "etcd", d.next, canceled), gwReadWatch(t, "proxy", p.next, canceled))
	})
}

// substKeys are the subst pairs of a mirrored write's keys: each a format
// with one %s, "e" in etcd's write and "p" in the proxy's; in the answers,
// the keys are base64 JSON strings.
func substKeys(keys []string) []string {
	var out []string
	for _, k := range keys {
		out = append(out, `"`+b64(fmt.Sprintf(k, "e"))+`"`, `"`+b64(fmt.Sprintf(k, "p"))+`"`)
	}
	return out
}

// TestGatewayAuth proves that with auth enabled in etcd, the JSON gateway
// through the proxy behaves as etcd's, as it does for gRPC callers: the
// Authorization header is the caller's token. Compared with etcd: root's
// and a limited user's (alice's) authentication, a wrong password and an
// unknown user; with each token a permitted and a refused Range (root may
// read everything: its refusal is of a future revision), alice's token
// issued through the proxy sent to etcd and the other way, the auth
// service's reads, a write and a refused one; a request without a token
// and one with a bad token; JSON watches with alice's token (permitted
// from a past revision with prev_kv, and refused), with none and with a
// bad one. alice's permitted JSON Ranges, with the token issued through
// the proxy, are served from the cache.
func TestGatewayAuth(t *testing.T) {
	// startAuthProxy's set-up, with etcd's client port given (see
	// clusterOptions.clientURL).
	etcdAddr := testsupport.FreeAddr(t)
	servertest.StartEtcd(t, server.EmbeddedConfig{ClientURL: "http://" + etcdAddr})
	setUpAuth(t, callerClient(t, "http://"+etcdAddr, "", "", nil))
	p := servertest.StartProxy(t, servertest.Config("http://"+etcdAddr, func(cfg *server.Config) {
		cfg.User, cfg.Password = "root", "rootpw"
		cfg.Logger = zaptest.NewLogger(t)
	}))
	root := callerClient(t, "http://"+etcdAddr, "root", "rootpw", nil)
	g := gwPair{etcd: etcdAddr, proxy: p.Addr()}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	first, err := root.Put(ctx, "/alice/y", "y")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := root.Put(ctx, "/alice/z", "z"); err != nil {
		t.Fatal(err)
	}
	last, err := root.Put(ctx, "/alice/y", "y2")
	if err != nil {
		t.Fatal(err)
	}
	head := last.Header.Revision
	testsupport.WaitFor(t, waitTimeout, "the cache to reach etcd's revision", func() bool { return p.Store().Rev() >= head })

	authenticate := gwReq{path: "/v3/auth/authenticate"}
	tokens := map[string][2]string{} // user: etcd's token, the proxy's
	for _, u := range []struct{ name, password string }{{"root", "rootpw"}, {"alice", "alicepw"}} {
		r := authenticate
		r.body = fmt.Sprintf(`{"name":%q,"password":%q}`, u.name, u.password)
		d, p := g.same(t, "authenticate "+u.name, r, r, gwNorm{mask: []string{"token"}})
		if d.status != http.StatusOK || p.status != http.StatusOK {
			t.Fatalf("authenticate %s: etcd %s, proxy %s", u.name, d, p)
		}
		tokens[u.name] = [2]string{jsonField(t, d.body, "token"), jsonField(t, p.body, "token")}
	}
	for _, bc := range []gwCase{
		{"authenticate with a wrong password", gwReq{path: authenticate.path, body: `{"name":"alice","password":"nope"}`}},
		{"authenticate an unknown user", gwReq{path: authenticate.path, body: `{"name":"bob","password":"bobpw"}`}},
		{"authenticate without a name", gwReq{path: authenticate.path, body: `{}`}},
	} {
		g.both(t, bc.name, bc.req)
	}

	// as sends r with user's tokens: etcd's to etcd, the proxy's to the
	// proxy; "" is no token, "bad" a token etcd never issued, "swapped"
	// alice's, the one issued through the proxy sent to etcd and etcd's
	// through the proxy (both are etcd's tokens).
	as := func(user, what string, r gwReq, n gwNorm) (gwAnswer, gwAnswer) {
		t.Helper()
		d, p := r, r
		switch user {
		case "":
		case "bad":
			d.token, p.token = "bad.token", "bad.token"
		case "swapped":
			d.token, p.token = tokens["alice"][1], tokens["alice"][0]
		default:
			d.token, p.token = tokens[user][0], tokens[user][1]
		}
		return g.same(t, fmt.Sprintf("%s (token: %s)", what, cmp.Or(user, "none")), d, p, n)
	}
	secret := fmt.Sprintf(`{"key":%q}`, b64("/secret"))
	aliceX := fmt.Sprintf(`{"key":%q}`, b64("/alice/x"))
	alicePrefix := fmt.Sprintf(`"key":%q,"range_end":%q`, b64("/alice/"), b64("/alice0"))
	everything := fmt.Sprintf(`{"key":%q,"range_end":%q}`, b64("\x00"), b64("\x00"))
	for _, cc := range []struct {
		user string
		gwCase
	}{
		{"root", gwCase{"a permitted range", rangeReq(secret)}},
		{"root", gwCase{"a permitted range of everything, serializable", rangeReq(`{"key":"AA==","range_end":"AA==","serializable":true}`)}},
		{"root", gwCase{"a refused range: a future revision", rangeReq(fmt.Sprintf(`{"key":%q,"revision":"%d"}`, b64("/secret"), head+100))}},
		{"root", gwCase{"the user list", gwReq{path: "/v3/auth/user/list", body: `{}`}}},
		{"root", gwCase{"a role", gwReq{path: "/v3/auth/role/get", body: `{"role":"alice"}`}}},
		{"root", gwCase{"the auth status", gwReq{path: "/v3/auth/status", body: `{}`}}},
		{"alice", gwCase{"a permitted range", rangeReq(aliceX)}},
		{"alice", gwCase{"a permitted range, serializable", rangeReq(fmt.Sprintf(`{"key":%q,"serializable":true}`, b64("/alice/x")))}},
		{"alice", gwCase{"a permitted prefix at a past revision", rangeReq(fmt.Sprintf(`{%s,"revision":"%d"}`, alicePrefix, first.Header.Revision))}},
		{"alice", gwCase{"a refused range", rangeReq(secret)}},
		{"alice", gwCase{"a refused range, serializable", rangeReq(fmt.Sprintf(`{"key":%q,"serializable":true}`, b64("/secret")))}},
		{"alice", gwCase{"a refused range of everything", rangeReq(everything)}},
		{"alice", gwCase{"a refused write", gwReq{path: "/v3/kv/put", body: fmt.Sprintf(`{"key":%q,"value":%q}`, b64("/secret"), b64("stolen"))}}},
		{"alice", gwCase{"a refused txn", gwReq{path: "/v3/kv/txn", body: fmt.Sprintf(`{"success":[{"request_range":{"key":%q}}]}`, b64("/secret"))}}},
		{"alice", gwCase{"the user list, refused", gwReq{path: "/v3/auth/user/list", body: `{}`}}},
		{"alice", gwCase{"her own user", gwReq{path: "/v3/auth/user/get", body: `{"name":"alice"}`}}},
		{"alice", gwCase{"her role", gwReq{path: "/v3/auth/role/get", body: `{"role":"alice"}`}}},
		{"alice", gwCase{"the auth status", gwReq{path: "/v3/auth/status", body: `{}`}}},
		{"swapped", gwCase{"a permitted range", rangeReq(aliceX)}},
		{"swapped", gwCase{"a refused range", rangeReq(secret)}},
		{"", gwCase{"a range", rangeReq(aliceX)}},
		{"", gwCase{"a range, serializable", rangeReq(fmt.Sprintf(`{"key":%q,"serializable":true}`, b64("/alice/x")))}},
		{"", gwCase{"a write", gwReq{path: "/v3/kv/put", body: fmt.Sprintf(`{"key":%q}`, b64("/alice/anon"))}}},
		{"", gwCase{"the user list", gwReq{path: "/v3/auth/user/list", body: `{}`}}},
		{"bad", gwCase{"a range", rangeReq(aliceX)}},
		{"bad", gwCase{"a range, serializable", rangeReq(fmt.Sprintf(`{"key":%q,"serializable":true}`, b64("/alice/x")))}},
		{"bad", gwCase{"a write", gwReq{path: "/v3/kv/put", body: fmt.Sprintf(`{"key":%q}`, b64("/alice/bad"))}}},
	} {
		as(cc.user, cc.name, cc.req, gwNorm{})
	}

	// alice's write, once on each side.
	before := headRevision(t, root)
	d, _ := as("alice", "a permitted write", gwReq{path: "/v3/kv/put", body: fmt.Sprintf(`{"key":%q,"value":%q,"prev_kv":true}`, b64("/alice/y"), b64("w"))}, gwNorm{
		subst: []string{
			fmt.Sprintf(`"%d"`, before+1), fmt.Sprintf(`"%d"`, before+2),
			// The proxy's put finds etcd's as the previous value.
			fmt.Sprintf(`"prev_kv":{"key":%q,"create_revision":"%d","mod_revision":"%d","version":"2","value":%q}`,
				b64("/alice/y"), first.Header.Revision, head, b64("y2")),
			fmt.Sprintf(`"prev_kv":{"key":%q,"create_revision":"%d","mod_revision":"%d","version":"3","value":%q}`,
				b64("/alice/y"), first.Header.Revision, before+1, b64("w")),
		},
	})
	if rev := headerRevision(t, d.body); rev != before+1 {
		t.Errorf("alice's write is at revision %d after %d", rev, before)
	}
	head = before + 2
	testsupport.WaitFor(t, waitTimeout, "the cache to reach etcd's revision", func() bool { return p.Store().Rev() >= head })

	// JSON watches: etcd's token to etcd, the proxy's through the proxy.
	watch := func(user, what, body string, done func([]gwWatchMsg) bool) {
		t.Helper()
		dTok, pTok := "", ""
		switch user {
		case "":
		case "bad":
			dTok, pTok = "bad.token", "bad.token"
		default:
			dTok, pTok = tokens[user][0], tokens[user][1]
		}
		d, p := openGWWatch(t, "etcd", g.etcd, body, dTok), openGWWatch(t, "proxy", g.proxy, body, pTok)
		if diff := gwDiff(d.answer(), p.answer(), gwNorm{}); diff != "" {
			t.Errorf("%s (token: %s): the watch's answer: %s", what, cmp.Or(user, "none"), diff)
		}
		sameMessages(t, fmt.Sprintf("%s (token: %s)", what, cmp.Or(user, "none")),
			gwReadWatch(t, "etcd", d.next, done), gwReadWatch(t, "proxy", p.next, done))
		d.close()
		p.close()
	}
	watch("alice", "a permitted watch from a past revision with prev_kv",
		fmt.Sprintf(`{"create_request":{%s,"start_revision":"%d","prev_kv":true}}`, alicePrefix, first.Header.Revision), eventsThrough(head))
	watchSecret := fmt.Sprintf(`{"create_request":{"key":%q,"start_revision":"1"}}`, b64("/secret"))
	watch("alice", "a refused watch", watchSecret, messages(1))
	watch("", "a watch", watchSecret, messages(1))
	watch("bad", "a watch", watchSecret, messages(1))

	// alice's permitted reads, with the token issued through the proxy,
	// come from the cache. The proxy checks a token with etcd every few
	// seconds, so a read may go to etcd once in a while: three tries.
	allowed := []string{
		aliceX,
		fmt.Sprintf(`{"key":%q,"serializable":true}`, b64("/alice/x")),
		`{` + alicePrefix + `,"serializable":true}`,
		fmt.Sprintf(`{%s,"revision":"%d"}`, alicePrefix, first.Header.Revision),
		fmt.Sprintf(`{%s,"count_only":true,"serializable":true}`, alicePrefix),
	}
	var failure string
	for range 3 {
		before := rangeCounts(t, p)
		for _, body := range allowed {
			as("alice", "a permitted range", rangeReq(body), gwNorm{})
		}
		after := rangeCounts(t, p)
		var cached float64
		var elsewhere []string
		for k, v := range after {
			if dv := v - before[k]; dv > 0 && strings.HasPrefix(k, "cache/") {
				cached += dv
			} else if dv > 0 {
				elsewhere = append(elsewhere, fmt.Sprintf("%v %s", dv, k))
			}
		}
		if cached == float64(len(allowed)) && len(elsewhere) == 0 {
			failure = ""
			break
		}
		slices.Sort(elsewhere)
		failure = fmt.Sprintf("of alice's %d permitted JSON Ranges, %v were served from the cache; the others: %v", len(allowed), cached, elsewhere)
	}
	if failure != "" {
		t.Error(failure)
	}
}

// headRevision is etcd's current revision, read with cli.
func headRevision(t testing.TB, cli *clientv3.Client) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	resp, err := cli.Get(ctx, "\x00", clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}
