package main

import (
	"encoding/json"
	"testing"
)

func TestLayoutInterleaveCoversEveryObjectOnce(t *testing.T) {
	for _, objects := range []int{5000, 100000, 100001} {
		lay := newLayout(objects, 500, 0)
		if got := lay.objects(); got != max(objects, 1002) {
			t.Errorf("%d objects: layout holds %d", objects, got)
		}
		pods, cms := map[int]bool{}, map[int]bool{}
		for i := range lay.pods + lay.configmaps {
			isPod, k := lay.interleave(i)
			m, n := cms, lay.configmaps
			if isPod {
				m, n = pods, lay.pods
			}
			if k < 0 || k >= n || m[k] {
				t.Fatalf("%d objects: interleave(%d) = %v, %d: out of range or twice", objects, i, isPod, k)
			}
			m[k] = true
		}
		if len(pods) != lay.pods || len(cms) != lay.configmaps {
			t.Errorf("%d objects: %d pods and %d configmaps, want %d and %d", objects, len(pods), len(cms), lay.pods, lay.configmaps)
		}
	}
}

func TestObjectsArePaddedToTheirSize(t *testing.T) {
	lay := newLayout(100000, 500, 0)
	for i := range 200 {
		for kind, obj := range map[string]any{
			"pod":       lay.pod(i, podName(i), lay.podNS(i)),
			"configmap": lay.configMap(i, cmName(i), lay.cmNS(i)),
			"node":      lay.node(i),
		} {
			b, err := json.Marshal(obj)
			if err != nil {
				t.Fatal(err)
			}
			want := objectSize(kind, i)
			if kind == "pod" {
				want = max(want-podAdded, 1150)
			}
			if len(b) < want-200 || len(b) > want+200 || len(b) > 4096+64 {
				t.Errorf("%s %d: %d bytes of JSON, want about %d", kind, i, len(b), want)
			}
		}
	}
	if b, _ := json.Marshal(lay.node(-1)); len(b) > 2200 {
		t.Errorf("the barrier node is %d bytes", len(b))
	}
}
