package persist

import (
	"context"
	"fmt"
	"os"
	"runtime/debug"
	"strings"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
)

// servingSource is a Source that serves cluster from the start.
type servingSource struct {
	ready   chan struct{}
	cluster uint64
}

func newServingSource(cluster uint64) *servingSource {
	s := &servingSource{ready: make(chan struct{}), cluster: cluster}
	close(s.ready)
	return s
}

func (s *servingSource) Ready() <-chan struct{} { return s.ready }
func (s *servingSource) Serving() bool          { return true }
func (s *servingSource) ClusterID() uint64      { return s.cluster }

// BenchmarkRestore: restoring a store of 100,000 keys of 1 KiB from its
// copy on disk (the file in the page cache, as after a restart).
func BenchmarkRestore(b *testing.B) {
	const keys = 100_000
	dir := b.TempDir()
	st := revtree.New(0)
	kvs := make([]*mvccpb.KeyValue, keys)
	value := []byte(strings.Repeat("v", 1024))
	for i := range kvs {
		kvs[i] = &mvccpb.KeyValue{Key: []byte(fmt.Sprintf("/registry/pods/ns-%03d/pod-%07d", i%100, i)), Value: value, CreateRevision: int64(i + 2), ModRevision: int64(i + 2), Version: 1}
	}
	st.Reset(keys+1, kvs, 0)
	src := newServingSource(7)
	p := New(Config{Dir: dir, Store: st})
	if err := p.Flush(src); err != nil {
		b.Fatal(err)
	}
	p.close()
	if os.Getenv("NOGC") != "" {
		defer debug.SetGCPercent(debug.SetGCPercent(-1))
	}
	b.ResetTimer()
	b.ReportAllocs()
	for range b.N {
		fresh := revtree.New(0)
		r := New(Config{Dir: dir, Store: fresh})
		if _, ok := r.Open(context.Background()); !ok {
			b.Fatal("no copy")
		}
		if err := r.Restore(context.Background()); err != nil {
			b.Fatal(err)
		}
		r.close()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/keys, "ns/key")
}
