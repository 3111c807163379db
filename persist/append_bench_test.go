package persist

import (
	"fmt"
	"strings"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// BenchmarkAppend: one interval's write of the copy of a store of 100,000
// keys of 1 KiB, after 20 single-key puts to existing keys (a quiet
// cluster's second), fsync included. The metric per-put is its cost per
// revision written.
func BenchmarkAppend(b *testing.B) {
	const keys, perFlush = 100_000, 20
	st := revtree.New(0)
	kvs := make([]*mvccpb.KeyValue, keys)
	value := []byte(strings.Repeat("v", 1024))
	name := func(i int) []byte { return fmt.Appendf(nil, "/registry/pods/ns-%03d/pod-%07d", i%100, i) }
	for i := range kvs {
		kvs[i] = &mvccpb.KeyValue{Key: name(i), Value: value, CreateRevision: int64(i + 2), ModRevision: int64(i + 2), Version: 1}
	}
	rev := int64(keys + 1)
	st.Reset(rev, kvs, 0)
	src := newServingSource(7)
	p := New(Config{Dir: b.TempDir(), Store: st})
	defer p.close()
	if err := p.Flush(src); err != nil {
		b.Fatal(err)
	}
	versions := make([]int64, keys)
	put := func(i int) {
		rev++
		versions[i]++
		kv := &mvccpb.KeyValue{Key: name(i), Value: value, CreateRevision: int64(i + 2), ModRevision: rev, Version: versions[i] + 1}
		if _, err := st.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: kv}}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		b.StopTimer()
		for range perFlush {
			put(n * 7919 % keys)
			n++
		}
		b.StartTimer()
		if err := p.Flush(src); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/perFlush, "ns/put")
}
