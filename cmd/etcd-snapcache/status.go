package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/urfave/cli/v2"

	"go.etcd.io/etcd/client/pkg/v3/transport"

	"github.com/etcd-snapcache/etcd-snapcache/internal/proxystatus"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

func statusCommand() *cli.Command {
	return &cli.Command{
		Name:  "status",
		Usage: "print the status of running proxies, as `etcdctl endpoint status` prints etcd members'",
		Description: "status reads each proxy's own status document, /proxy/status, on its client port or on\n" +
			"its --metrics-addr, and prints, one proxy a row: the upstream etcd and its\n" +
			"release; the cache's revision, its lag behind etcd, etcd's compaction revision, the oldest\n" +
			"retained revision and how many are retained; history memory against --max-history-bytes;\n" +
			"the share of Range requests served from the cache since the proxy started, and every\n" +
			"(source, reason) share; the cache's watchers and watch streams; readiness and the checks\n" +
			"that fail; and the mode: serving (from the cache), loading (the cache is being loaded or\n" +
			"reloaded), forwarding (etcd has auth on and the proxy has no identity of its own: every\n" +
			"request goes to etcd), or fallback (a consistency check failed: reads and watches go to\n" +
			"etcd).\n\n" +
			"An endpoint is the proxy's client URL or its --metrics-addr URL, http or https; without a\n" +
			"scheme, https when a TLS flag is given, else http. An endpoint that does not answer is\n" +
			"reported (the ERRORS column, the error field) and status exits 1 after printing the rest.\n\n" +
			"Examples:\n\n" +
			"   # the local proxy (127.0.0.1:23790), as a table\n" +
			"   etcd-snapcache status\n\n" +
			"   # three proxies' metrics ports\n" +
			"   etcd-snapcache status --endpoints=http://10.0.0.1:9379,http://10.0.0.2:9379,http://10.0.0.3:9379\n\n" +
			"   # a proxy serving TLS with client certificates, as JSON\n" +
			"   etcd-snapcache status -w json --endpoints=https://127.0.0.1:23790 \\\n" +
			"      --cacert=ca.crt --cert=client.crt --key=client.key\n\n" +
			"   # the mode of each proxy\n" +
			"   etcd-snapcache status -w json --endpoints=... | jq -r '.[] | .endpoint + \" \" + .mode'",
		Flags: []cli.Flag{
			&cli.StringSliceFlag{Name: "endpoints", Value: cli.NewStringSlice(server.DefaultConfig().ListenAddr),
				Usage: "the proxies' client or --metrics-addr URLs, comma-separated"},
			&cli.StringFlag{Name: "write-out", Aliases: []string{"w"}, Value: "table", Usage: "output format: table or json"},
			&cli.DurationFlag{Name: "dial-timeout", Value: 2 * time.Second, Usage: "timeout of each connection"},
			&cli.DurationFlag{Name: "command-timeout", Value: 5 * time.Second, Usage: "timeout of each endpoint's answers"},
			&cli.StringFlag{Name: "cacert", Usage: "verify the proxies' certificates with this CA bundle"},
			&cli.StringFlag{Name: "cert", Usage: "client certificate, for proxies that require one"},
			&cli.StringFlag{Name: "key", Usage: "client key"},
			&cli.BoolFlag{Name: "insecure-skip-tls-verify", Usage: "skip verifying the proxies' certificates (testing only)"},
		},
		Action: status,
	}
}

// proxyStatus is one proxy's status: an element of `status -w json`.
// Fields are only ever added.
type proxyStatus struct {
	Endpoint string `json:"endpoint"`
	// Error is why the endpoint did not answer; the other fields are then
	// unset.
	Error string `json:"error,omitempty"`

	UpstreamEndpoints []string `json:"upstream_endpoints"`
	// UpstreamVersion is etcd's release, "" while the proxy does not know
	// it (not read yet, or refused: etcd 3.6 refuses non-admins with auth
	// on).
	UpstreamVersion        string `json:"upstream_version"`
	UpstreamClusterID      string `json:"upstream_cluster_id"`
	UpstreamWatchConnected bool   `json:"upstream_watch_connected"`

	// Mode is serving, loading, forwarding or fallback; ModeReason says
	// why for forwarding and fallback.
	Mode       string `json:"mode"`
	ModeReason string `json:"mode_reason,omitempty"`
	Ready      bool   `json:"ready"`
	// FailingChecks are /readyz's failing checks.
	FailingChecks []readyCheck `json:"failing_checks"`

	Revision          int64 `json:"revision"`
	RevisionLag       int64 `json:"revision_lag"`
	CompactRevision   int64 `json:"compact_revision"`
	OldestRevision    int64 `json:"oldest_revision"`
	RetainedRevisions int64 `json:"retained_revisions"`
	HistoryBytes      int64 `json:"history_bytes"`
	// MaxHistoryBytes is the budget of HistoryBytes; 0: unbounded.
	MaxHistoryBytes int64 `json:"max_history_bytes"`

	// Reads are the Range requests since the proxy started, CacheHitRatio
	// the share of them served from the cache, ReadsByReason each
	// (source, reason) with its share, most first.
	Reads         int64        `json:"reads"`
	CacheHitRatio float64      `json:"cache_hit_ratio"`
	ReadsByReason []readReason `json:"reads_by_reason"`

	Watchers     int64 `json:"watchers"`
	WatchStreams int64 `json:"watch_streams"`

	// StartTime is when the proxy process started, which the counts
	// above are since; unset where the process metrics are not exported.
	StartTime *time.Time `json:"start_time,omitempty"`
}

// readyCheck is a failing readiness check, as /proxy/status gives it.
type readyCheck = proxystatus.Check

type readReason struct {
	Source string  `json:"source"` // cache, forwarded, rejected
	Reason string  `json:"reason"`
	Count  int64   `json:"count"`
	Ratio  float64 `json:"ratio"`
}

func status(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("status takes no arguments, got %q", c.Args().Slice())
	}
	format := c.String("write-out")
	if format != "table" && format != "json" {
		return fmt.Errorf("--write-out %q: want table or json", format)
	}
	info := transport.TLSInfo{CertFile: c.String("cert"), KeyFile: c.String("key"), TrustedCAFile: c.String("cacert")}
	if (info.CertFile == "") != (info.KeyFile == "") {
		return errors.New("--cert and --key go together")
	}
	secure := !info.Empty() || info.TrustedCAFile != "" || c.Bool("insecure-skip-tls-verify")
	var endpoints []string
	for _, ep := range c.StringSlice("endpoints") {
		u, err := statusURL(ep, secure)
		if err != nil {
			return fmt.Errorf("--endpoints: %w", err)
		}
		endpoints = append(endpoints, u)
	}
	if len(endpoints) == 0 {
		return errors.New("--endpoints: no endpoint")
	}
	tlsCfg, err := server.ClientTLSConfig(info, c.Bool("insecure-skip-tls-verify"))
	if err != nil {
		return fmt.Errorf("TLS: %w", err)
	}
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: c.Duration("dial-timeout")}).DialContext,
		TLSClientConfig:     tlsCfg,
		TLSHandshakeTimeout: c.Duration("dial-timeout"),
		DisableKeepAlives:   true, // one request an endpoint: nothing left open after
	}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}

	statuses := make([]proxyStatus, len(endpoints))
	var wg sync.WaitGroup
	for i, ep := range endpoints {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(c.Context, c.Duration("command-timeout"))
			defer cancel()
			st, err := fetchStatus(ctx, hc, ep)
			if err != nil {
				st = proxyStatus{Error: err.Error()}
			}
			st.Endpoint = ep
			statuses[i] = st
		})
	}
	wg.Wait()

	switch format {
	case "json":
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		if err := enc.Encode(statuses); err != nil {
			return err
		}
	default:
		writeStatusTable(c.App.Writer, statuses)
	}
	var failed []string
	for _, st := range statuses {
		if st.Error != "" {
			failed = append(failed, fmt.Sprintf("%s: %s", st.Endpoint, st.Error))
		}
	}
	if len(failed) > 0 {
		return cli.Exit(fmt.Sprintf("failed to get the status of %d of %d endpoints: %s", len(failed), len(statuses), strings.Join(failed, "; ")), 1)
	}
	return nil
}

// statusURL is the base URL of an --endpoints entry: host:port, or an
// http(s) URL, of the proxy's client port or --metrics-addr.
func statusURL(ep string, secure bool) (string, error) {
	ep = strings.TrimSpace(ep)
	if ep == "" {
		return "", errors.New("an empty endpoint")
	}
	if !strings.Contains(ep, "://") {
		scheme := "http://"
		if secure {
			scheme = "https://"
		}
		ep = scheme + ep
	}
	u, err := url.Parse(ep)
	if err != nil {
		return "", err
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", fmt.Errorf("%q: scheme %q, want http or https", ep, u.Scheme)
	}
	if u.Host == "" {
		return "", fmt.Errorf("%q: no host", ep)
	}
	return strings.TrimSuffix(u.String(), "/"), nil
}

// fetchStatus reads one proxy's /proxy/status.
func fetchStatus(ctx context.Context, hc *http.Client, base string) (proxyStatus, error) {
	const path = proxystatus.Path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
	if err != nil {
		return proxyStatus{}, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := hc.Do(req)
	// The endpoint is in the row already: the error alone, without the
	// method and URL that a *url.Error repeats.
	if ue, ok := errors.AsType[*url.Error](err); ok {
		return proxyStatus{}, fmt.Errorf("GET %s: %w", path, ue.Err)
	}
	if err != nil {
		return proxyStatus{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return proxyStatus{}, fmt.Errorf("GET %s: %s (not an etcd-snapcache endpoint, or one older than this command?)", path, resp.Status)
	}
	var doc proxystatus.Status
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&doc); err != nil {
		return proxyStatus{}, fmt.Errorf("GET %s: %w", path, err)
	}
	if doc.Mode == "" {
		return proxyStatus{}, fmt.Errorf("GET %s: no mode: not an etcd-snapcache endpoint", path)
	}
	return statusOf(doc), nil
}

// statusOf is a proxy's row of status, from its status document.
func statusOf(doc proxystatus.Status) proxyStatus {
	st := proxyStatus{
		UpstreamEndpoints:      doc.UpstreamEndpoints,
		UpstreamVersion:        doc.UpstreamVersion,
		UpstreamClusterID:      doc.UpstreamClusterID,
		UpstreamWatchConnected: doc.UpstreamWatchConnected,
		Mode:                   doc.Mode.Shown(),
		ModeReason:             doc.Mode.Reason(),
		Ready:                  doc.Ready,
		FailingChecks:          doc.FailingChecks,
		Revision:               doc.Revision,
		RevisionLag:            doc.RevisionLag,
		CompactRevision:        doc.CompactRevision,
		OldestRevision:         doc.OldestRevision,
		RetainedRevisions:      doc.RetainedRevisions,
		HistoryBytes:           doc.HistoryBytes,
		MaxHistoryBytes:        doc.MaxHistoryBytes,
		ReadsByReason:          []readReason{},
		Watchers:               doc.Watchers,
		WatchStreams:           doc.WatchStreams,
		StartTime:              doc.StartTime,
	}
	if st.UpstreamEndpoints == nil {
		st.UpstreamEndpoints = []string{}
	}
	if st.FailingChecks == nil {
		st.FailingChecks = []readyCheck{}
	}
	var hits int64
	for _, r := range doc.RangeRequests {
		if r.Count <= 0 {
			continue
		}
		st.ReadsByReason = append(st.ReadsByReason, readReason{Source: string(r.Source), Reason: r.Reason, Count: r.Count})
		st.Reads += r.Count
		if r.Source == proxystatus.SourceCache {
			hits += r.Count
		}
	}
	if st.Reads > 0 {
		st.CacheHitRatio = float64(hits) / float64(st.Reads)
		for i := range st.ReadsByReason {
			st.ReadsByReason[i].Ratio = float64(st.ReadsByReason[i].Count) / float64(st.Reads)
		}
	}
	slices.SortFunc(st.ReadsByReason, func(a, b readReason) int {
		if a.Count != b.Count {
			return int(min(max(b.Count-a.Count, -1), 1))
		}
		return strings.Compare(a.Source+"/"+a.Reason, b.Source+"/"+b.Reason)
	})
	return st
}

var statusHeader = []string{
	"ENDPOINT", "UPSTREAM", "UPSTREAM VERSION", "MODE", "READY",
	"REVISION", "LAG", "COMPACT REV", "OLDEST REV", "RETAINED", "HISTORY / BUDGET",
	"CACHE HITS", "READS BY REASON", "WATCHERS", "STREAMS", "ERRORS",
}

// statusRow is a proxy's row of the table; a cell of several lines is a
// list, one item a line.
func statusRow(st proxyStatus) []string {
	if st.Error != "" {
		row := make([]string, len(statusHeader))
		for i := range row {
			row[i] = "-"
		}
		row[0], row[len(row)-1] = st.Endpoint, st.Error
		return row
	}
	mode := st.Mode
	if st.ModeReason != "" {
		mode += " (" + st.ModeReason + ")"
	}
	version := st.UpstreamVersion
	if version == "" {
		version = "unknown"
	}
	budget := "unbounded"
	if st.MaxHistoryBytes > 0 {
		budget = fmt.Sprintf("%s (%.1f%%)", formatBytes(st.MaxHistoryBytes), 100*float64(st.HistoryBytes)/float64(st.MaxHistoryBytes))
	}
	hits := "no reads yet"
	var reasons []string
	if st.Reads > 0 {
		hits = fmt.Sprintf("%s of %d", percent(st.CacheHitRatio), st.Reads)
		for _, r := range st.ReadsByReason {
			reasons = append(reasons, fmt.Sprintf("%s %s/%s", percent(r.Ratio), r.Source, r.Reason))
		}
	}
	var errs []string
	for _, c := range st.FailingChecks {
		errs = append(errs, c.Name+": "+c.Reason)
	}
	return []string{
		st.Endpoint,
		strings.Join(st.UpstreamEndpoints, "\n"),
		version,
		mode,
		strconv.FormatBool(st.Ready),
		strconv.FormatInt(st.Revision, 10),
		strconv.FormatInt(st.RevisionLag, 10),
		strconv.FormatInt(st.CompactRevision, 10),
		strconv.FormatInt(st.OldestRevision, 10),
		strconv.FormatInt(st.RetainedRevisions, 10),
		formatBytes(st.HistoryBytes) + " / " + budget,
		hits,
		strings.Join(reasons, "\n"),
		strconv.FormatInt(st.Watchers, 10),
		strconv.FormatInt(st.WatchStreams, 10),
		strings.Join(errs, "\n"),
	}
}

func percent(r float64) string { return strconv.FormatFloat(100*r, 'f', 1, 64) + "%" }

// formatBytes is n in binary units, as etcd's tables print sizes.
func formatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, i := float64(n), -1
	for v >= unit && i < 5 {
		v /= unit
		i++
	}
	return strconv.FormatFloat(v, 'f', 1, 64) + " " + []string{"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}[i]
}

func writeStatusTable(w io.Writer, statuses []proxyStatus) {
	rows := make([][]string, len(statuses))
	for i, st := range statuses {
		rows[i] = statusRow(st)
	}
	writeTable(w, statusHeader, rows)
}

// writeTable writes a table as etcdctl's -w table does: bordered, the
// header and one-line cells centered. A cell of several lines is a list,
// left-aligned, and makes its row as tall.
func writeTable(w io.Writer, header []string, rows [][]string) {
	widths := make([]int, len(header))
	for i, h := range header {
		widths[i] = utf8.RuneCountInString(h)
	}
	for _, r := range rows {
		for i, cell := range r {
			for line := range strings.SplitSeq(cell, "\n") {
				widths[i] = max(widths[i], utf8.RuneCountInString(line))
			}
		}
	}
	var b strings.Builder
	rule := func() {
		for _, wd := range widths {
			b.WriteString("+" + strings.Repeat("-", wd+2))
		}
		b.WriteString("+\n")
	}
	line := func(cells []string) {
		lines := make([][]string, len(cells))
		height := 1
		for i, cell := range cells {
			lines[i] = strings.Split(cell, "\n")
			height = max(height, len(lines[i]))
		}
		for l := range height {
			for i, cl := range lines {
				text := ""
				if l < len(cl) {
					text = cl[l]
				}
				pad := widths[i] - utf8.RuneCountInString(text)
				left := pad / 2
				if len(cl) > 1 {
					left = 0
				}
				b.WriteString("| " + strings.Repeat(" ", left) + text + strings.Repeat(" ", pad-left) + " ")
			}
			b.WriteString("|\n")
		}
	}
	// Rows of several lines are told apart by a rule between each.
	tall := slices.ContainsFunc(rows, func(r []string) bool {
		return slices.ContainsFunc(r, func(cell string) bool { return strings.Contains(cell, "\n") })
	})
	rule()
	line(header)
	rule()
	for i, r := range rows {
		if tall && i > 0 {
			rule()
		}
		line(r)
	}
	rule()
	io.WriteString(w, b.String())
}
