package main

import (
	"encoding/xml"
	"slices"
	"strings"
	"testing"
)

const sample = `goos: linux
SUMMARY BenchmarkLinearizableGet-2: proxy/etcd 0.85x reads/s (per round 0.82 0.89)
SUMMARY   etcd :    24000.1 reads/s (rounds 24000.0 24000.2)  cpu 80.0 µs/read
SUMMARY BenchmarkWatchFanout (auth on): proxy/etcd 2.07x events/s (per round 2.01 2.10 2.38)
BenchmarkWatchFanout 1 1000 ns/op
`

func TestParse(t *testing.T) {
	got, err := parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("%d results, want 2: %+v", len(got), got)
	}
	if got[0].name != "LinearizableGet" || got[0].unit != "reads" || got[0].ratio != 0.85 || !slices.Equal(got[0].rounds, []float64{0.82, 0.89}) {
		t.Fatalf("first: %+v", got[0])
	}
	if got[1].name != "WatchFanout (auth on)" || got[1].ratio != 2.07 || len(got[1].rounds) != 3 {
		t.Fatalf("second: %+v", got[1])
	}
}

// TestDrawIsSVG: the chart is well-formed XML with a bar and a dot per
// round for each result.
func TestDrawIsSVG(t *testing.T) {
	results, err := parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	draw(&b, "a <title>", results)
	dec := xml.NewDecoder(strings.NewReader(b.String()))
	counts := map[string]int{}
	for {
		tok, err := dec.Token()
		if err != nil {
			break
		}
		if se, ok := tok.(xml.StartElement); ok {
			counts[se.Name.Local]++
		}
	}
	if counts["svg"] != 1 || counts["rect"] != 3 || counts["circle"] != 5 {
		t.Fatalf("elements %v: want one svg, a background and two bars, five dots\n%s", counts, b.String())
	}
}
