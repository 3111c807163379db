// Command chart draws the proxy/etcd ratios of a `make bench-e2e` run as
// an SVG bar chart: one bar per benchmark (the ratio of the totals), with
// each alternating round's ratio as a dot and etcd itself at 1x. It reads
// the run's output, whose SUMMARY lines it parses, on standard input:
//
//	make bench-e2e BENCH='Linearizable|Watch|Paginated|Historical' | tee bench.out
//	go run ./bench/chart -title 'etcd-snapcache / etcd' < bench.out > docs/performance.svg
package main

import (
	"bufio"
	"flag"
	"fmt"
	"html"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
)

// result is one benchmark's SUMMARY ratio line.
type result struct {
	name   string    // the benchmark, without "Benchmark", and "(auth on)" if so
	unit   string    // what the ratio counts, per second
	ratio  float64   // of the totals
	rounds []float64 // per round
}

// summaryRE matches `SUMMARY BenchmarkX-2 (auth on): proxy/etcd 2.07x events/s (per round 2.01 2.10)`.
var summaryRE = regexp.MustCompile(`^SUMMARY (Benchmark\S+?)(?:-\d+)?( \(auth on\))?: proxy/etcd ([0-9.]+)x (\S+)/s \(per round ([0-9. ]*)\)`)

// parse returns the ratio lines of a bench-e2e output, in order.
func parse(r io.Reader) ([]result, error) {
	var out []result
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		m := summaryRE.FindStringSubmatch(strings.TrimSpace(sc.Text()))
		if m == nil {
			continue
		}
		ratio, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", sc.Text(), err)
		}
		res := result{name: strings.TrimPrefix(m[1], "Benchmark") + m[2], unit: m[4], ratio: ratio}
		for _, f := range strings.Fields(m[5]) {
			v, err := strconv.ParseFloat(f, 64)
			if err != nil {
				return nil, fmt.Errorf("%q: %w", sc.Text(), err)
			}
			res.rounds = append(res.rounds, v)
		}
		out = append(out, res)
	}
	return out, sc.Err()
}

// Layout, in SVG user units.
const (
	rowHeight = 34
	labelW    = 300
	plotW     = 420
	top       = 44
	bottom    = 40
)

// draw writes the chart of results.
func draw(w io.Writer, title string, results []result) {
	maxX := 1.0
	for _, r := range results {
		maxX = max(maxX, r.ratio)
		for _, v := range r.rounds {
			maxX = max(maxX, v)
		}
	}
	maxX = float64(int(maxX) + 1)
	x := func(v float64) float64 { return labelW + v/maxX*plotW }
	height := top + rowHeight*len(results) + bottom
	width := labelW + plotW + 130
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="13">`+"\n", width, height, width, height)
	fmt.Fprintf(w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(w, `<text x="%d" y="24" font-size="15" font-weight="bold">%s</text>`+"\n", 10, html.EscapeString(title))
	for i := 0; i <= int(maxX); i++ {
		fmt.Fprintf(w, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", x(float64(i)), top-6, x(float64(i)), height-bottom+4)
		fmt.Fprintf(w, `<text x="%.1f" y="%d" text-anchor="middle" fill="#555">%dx</text>`+"\n", x(float64(i)), height-bottom+20, i)
	}
	for i, r := range results {
		y := top + i*rowHeight
		fmt.Fprintf(w, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", labelW-10, y+rowHeight/2+4, html.EscapeString(r.name))
		color := "#2b7bb9"
		if r.ratio < 1 {
			color = "#c0504d"
		}
		fmt.Fprintf(w, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", labelW, y+6, x(r.ratio)-labelW, rowHeight-12, color)
		for _, v := range r.rounds {
			fmt.Fprintf(w, `<circle cx="%.1f" cy="%d" r="3" fill="black" fill-opacity="0.6"/>`+"\n", x(v), y+rowHeight/2)
		}
		// The label goes past the bar and every dot.
		right := r.ratio
		for _, v := range r.rounds {
			right = max(right, v)
		}
		fmt.Fprintf(w, `<text x="%.1f" y="%d">%.2fx %s/s</text>`+"\n", x(right)+8, y+rowHeight/2+4, r.ratio, html.EscapeString(r.unit))
	}
	fmt.Fprintf(w, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="black" stroke-dasharray="4 3"/>`+"\n", x(1), top-6, x(1), height-bottom+4)
	fmt.Fprintf(w, `<text x="%.1f" y="%d" font-size="11" fill="#555">etcd</text>`+"\n", x(1)+3, top-8)
	fmt.Fprintln(w, `</svg>`)
}

func main() {
	title := flag.String("title", "etcd-snapcache throughput against etcd (make bench-e2e; dots: rounds)", "the chart's title")
	flag.Parse()
	results, err := parse(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chart:", err)
		os.Exit(1)
	}
	if len(results) == 0 {
		fmt.Fprintln(os.Stderr, "chart: no SUMMARY ratio lines on standard input (the output of make bench-e2e)")
		os.Exit(1)
	}
	draw(os.Stdout, *title, results)
}
