package revtree

import (
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// TestFlatRangesPaginate: interleaved kube-apiserver-style paginations of
// several ranges at several revisions, with keys_only rewriting results,
// answer exactly as the same pages computed without the cache, and the
// cache stays within its bounds.
func TestFlatRangesPaginate(t *testing.T) {
	s := New(4)
	var kvs []*mvccpb.KeyValue
	for i := 0; i < 300; i++ {
		key := fmt.Appendf(nil, "/registry/%s/%03d", []string{"pods", "nodes"}[i%2], i)
		kvs = append(kvs, &mvccpb.KeyValue{Key: key, Value: key, CreateRevision: 2, ModRevision: 2, Version: 1})
	}
	s.Reset(2, kvs, 0)
	for rev := int64(3); rev < 40; rev++ {
		key := kvs[int(rev*7)%len(kvs)].Key
		if _, err := s.Apply(rev, []*mvccpb.Event{{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: key, ModRevision: rev}}}); err != nil {
			t.Fatal(err)
		}
		kvs = append(kvs[:int(rev*7)%len(kvs)], kvs[int(rev*7)%len(kvs)+1:]...)
	}

	type list struct {
		req  *pb.RangeRequest
		done bool
	}
	var lists []*list
	for _, rev := range []int64{2, 10, 25, 39} {
		for _, prefix := range []string{"/registry/pods/", "/registry/nodes/", "/registry/"} {
			for _, keysOnly := range []bool{false, true} {
				lists = append(lists, &list{req: &pb.RangeRequest{
					Key: []byte(prefix), RangeEnd: []byte(prefix[:len(prefix)-1] + "0"),
					Revision: rev, Limit: 17, KeysOnly: keysOnly,
				}})
			}
		}
	}
	for pending := len(lists); pending > 0; {
		for _, l := range lists {
			if l.done {
				continue
			}
			got, err := s.Range(l.req, RangeOptions{})
			if err != nil {
				t.Fatal(err)
			}
			view, _ := s.View(l.req.Revision)
			view.flat = nil
			want := view.Range(l.req, RangeOptions{})
			if !proto.Equal(got, want) {
				t.Fatalf("page %v:\ncached:   %v\nuncached: %v", l.req, got, want)
			}
			if !got.More {
				l.done = true
				pending--
				continue
			}
			l.req.Key = append([]byte(string(got.Kvs[len(got.Kvs)-1].Key)), 0)
		}
	}
	s.flat.mu.Lock()
	defer s.flat.mu.Unlock()
	if len(s.flat.entries) > maxFlatRanges || s.flat.bytes > s.flat.limit {
		t.Fatalf("cache holds %d ranges, %d bytes", len(s.flat.entries), s.flat.bytes)
	}
	for _, e := range s.flat.entries {
		for _, kv := range makeKVs(e.vs) {
			if len(kv.Value) == 0 {
				t.Fatalf("keys_only rewrote a cached KeyValue %q", kv.Key)
			}
		}
	}
}

// TestFlatRangesKeepPagesOverWholeReads: unlimited reads at ever new
// revisions (LISTs at the head while etcd is written) are cached too, but
// never push out the flattened ranges of paginations in progress.
func TestFlatRangesKeepPagesOverWholeReads(t *testing.T) {
	s := New(8)
	s.flat.minKVs = 1
	var kvs []*mvccpb.KeyValue
	for i := 0; i < 100; i++ {
		key := fmt.Appendf(nil, "/registry/pods/%03d", i)
		kvs = append(kvs, &mvccpb.KeyValue{Key: key, Value: key, CreateRevision: 2, ModRevision: 2, Version: 1})
	}
	s.Reset(2, kvs, 0)
	prefix, end := []byte("/registry/pods/"), []byte("/registry/pods0")
	// maxFlatRanges paginations, each at its own revision, first pages.
	var pages []*pb.RangeRequest
	for rev := int64(3); len(pages) < maxFlatRanges; rev++ {
		if _, err := s.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("/registry/pods/000"), Value: []byte("v"), CreateRevision: 2, ModRevision: rev, Version: rev - 1}}}); err != nil {
			t.Fatal(err)
		}
		page := &pb.RangeRequest{Key: prefix, RangeEnd: end, Revision: rev, Limit: 10}
		if _, err := s.Range(page, RangeOptions{}); err != nil {
			t.Fatal(err)
		}
		pages = append(pages, page)
	}
	// Unlimited reads at the head, a new revision each.
	for rev := int64(3 + maxFlatRanges); rev < 40; rev++ {
		if _, err := s.Apply(rev, []*mvccpb.Event{{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("/registry/pods/000"), Value: []byte("v"), CreateRevision: 2, ModRevision: rev, Version: rev - 1}}}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Range(&pb.RangeRequest{Key: prefix, RangeEnd: end}, RangeOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, page := range pages {
		view, err := s.View(page.Revision)
		if err != nil {
			t.Fatal(err)
		}
		if view.flat.get(view.snap, []byte("/registry/pods/010"), end) == nil {
			t.Fatalf("the flattened range of the pagination at %d was evicted by unlimited reads", page.Revision)
		}
	}
	// With every slot taken by pages, an unlimited read's own entry is
	// the one dropped.
	view, _ := s.View(0)
	if view.flat.get(view.snap, prefix, end) != nil {
		t.Fatal("an unlimited read was cached over the pages' room")
	}
}
