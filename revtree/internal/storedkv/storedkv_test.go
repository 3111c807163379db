package storedkv

import (
	"bytes"
	"encoding/binary"
	"math"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/etcd-snapcache/etcd-snapcache/revtree/internal/allocsize"
)

// checkForms checks every form the package keeps kv in against kv itself:
// the entry (New), the version of a load (Loaded), the entry's bare
// encoding (Stored), a packed one (Packer.Pack) and one copied out of its
// slab (Unpacked). Each must give back kv's fields, its encoding must be
// proto.Marshal's, preceded by RangeKVTag and its length (invariant 2),
// and its estimate must be what it holds.
func checkForms(t *testing.T, kv *mvccpb.KeyValue) {
	t.Helper()
	want, err := proto.Marshal(kv)
	if err != nil {
		t.Fatal(err)
	}
	stored := New(kv)
	if !proto.Equal(stored, kv) {
		t.Fatalf("New: %v, want %v", stored, kv)
	}
	canonical := len(kv.Key) > 0 && len(kv.ProtoReflect().GetUnknown()) == 0
	enc := Encoding(stored)
	switch {
	case len(kv.Key) == 0 && enc != nil:
		t.Fatalf("an entry with no key has an encoding %x", enc)
	case len(kv.Key) > 0 && !bytes.Equal(enc, want):
		t.Fatalf("encoding of %v:\n%x\nproto.Marshal:\n%x", kv, enc, want)
	}
	if enc != nil {
		field := protowire.AppendVarint([]byte{RangeKVTag}, uint64(len(want)))
		if f := Field(enc); !bytes.Equal(f, append(field, want...)) {
			t.Fatalf("field %x, want the tag and length before %x", f, want)
		}
	}
	if (CanonicalEncoding(stored) != nil) != canonical {
		t.Fatalf("canonical encoding %x of %v", CanonicalEncoding(stored), kv)
	}

	var m KVMaker
	var scratch Entry
	forms := map[string]Version{"entry": Put(kv.ModRevision, stored), "loaded": Loaded(kv), "stored": Stored(stored)}
	var k Packer
	if v, ok := k.Pack(kv); ok {
		forms["packed"] = v
		forms["unpacked"] = v.Unpacked()
		if !v.IsPacked() || forms["unpacked"].IsPacked() {
			t.Fatalf("packed %v, unpacked %v", v.IsPacked(), forms["unpacked"].IsPacked())
		}
		if k.Slabs()[0].Live() != v.Bytes() || v.Bytes() != int64(len(Field(v.Encoding()))) {
			t.Fatalf("the slab holds %d live bytes for a packed version of %d", k.Slabs()[0].Live(), v.Bytes())
		}
	} else if canonical && len(want) < MaxPackedBytes-8 {
		t.Fatalf("%v was not packed", kv)
	}
	for name, v := range forms {
		if !v.IsPut() || v.Rev() != kv.ModRevision {
			t.Fatalf("%s: put %v at %d, want a put at %d", name, v.IsPut(), v.Rev(), kv.ModRevision)
		}
		if v.IsBare() != (canonical && name != "entry") {
			t.Fatalf("%s: bare %v for %v", name, v.IsBare(), kv)
		}
		for how, got := range map[string]*mvccpb.KeyValue{"KV": v.KV(&m), "KVIn": v.KVIn(&scratch)} {
			if !proto.Equal(got, kv) {
				t.Fatalf("%s: %s %v, want %v", name, how, got, kv)
			}
			if e := Encoding(got); enc != nil && !bytes.Equal(e, want) {
				t.Fatalf("%s: %s's encoding %x, want %x", name, how, e, want)
			}
		}
		if !bytes.Equal(v.Key(), kv.Key) || v.KVVersion() != kv.Version {
			t.Fatalf("%s: key %q version %d, want %q %d", name, v.Key(), v.KVVersion(), kv.Key, kv.Version)
		}
		if e := v.Encoding(); !bytes.Equal(e, enc) {
			t.Fatalf("%s: encoding %x, want %x", name, e, enc)
		}
		var bytes int64
		switch {
		case v.IsPacked():
			bytes = int64(len(Field(enc)))
		case v.IsBare():
			bytes = allocsize.Bytes(len(Field(enc)))
		default:
			bytes = Bytes(v.EntryKV())
		}
		if v.Bytes() != bytes {
			t.Fatalf("%s: estimate %d, want %d", name, v.Bytes(), bytes)
		}
	}
	// An entry bares without a copy: its bare encoding is its bytes.
	if bared, ok := forms["entry"].Bared(); ok != canonical {
		t.Fatalf("Bared %v of %v", ok, kv)
	} else if ok && &bared.Encoding()[0] != &enc[0] {
		t.Fatalf("Bared copied the encoding")
	}
	// What the store gives out decodes back to itself, once copied.
	if enc != nil {
		back, err := Decode(Field(enc)[len(Field(enc))-len(enc):])
		if err != nil || !proto.Equal(back, kv) || !bytes.Equal(Encoding(back), want) {
			t.Fatalf("Decode of the encoding: %v, %v; want %v", back, err, kv)
		}
	}
}

// keyValueOf makes a KeyValue of fuzzed fields.
func keyValueOf(key, value []byte, create, mod, version, lease int64, unknown bool) *mvccpb.KeyValue {
	kv := &mvccpb.KeyValue{Key: key, Value: value, CreateRevision: create, ModRevision: mod, Version: version, Lease: lease}
	if unknown {
		// A field a newer etcd could add: kept, and encoded last.
		kv.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 7))
	}
	return kv
}

// FuzzKeyValueForms: every form a KeyValue is stored in gives it back,
// with proto.Marshal's encoding (checkForms).
func FuzzKeyValueForms(f *testing.F) {
	f.Add([]byte("/registry/pods/a"), []byte("v"), int64(2), int64(5), int64(3), int64(0), false)
	f.Add([]byte("k"), []byte{}, int64(1), int64(1), int64(1), int64(7), false)
	f.Add([]byte("k"), bytes.Repeat([]byte{'v'}, 5000), int64(127), int64(128), int64(1), int64(0), false)
	f.Add([]byte("u"), []byte("v"), int64(1), int64(2), int64(1), int64(0), true)
	f.Add([]byte{}, []byte("v"), int64(0), int64(3), int64(0), int64(0), false)
	f.Add([]byte{0}, []byte(nil), int64(-1), int64(math.MaxInt64>>1), int64(math.MaxInt64), int64(-1), false)
	f.Fuzz(func(t *testing.T, key, value []byte, create, mod, version, lease int64, unknown bool) {
		mod = 1 + mod&(1<<62-2) // a revision (invariant 7)
		checkForms(t, keyValueOf(key, value, create, mod, version, lease, unknown))
	})
}

// FuzzDecode: Decode takes any bytes proto.Unmarshal takes as a
// KeyValue with a key, to the store's copy of it, whose encoding is
// proto.Marshal's of it; and nothing else.
func FuzzDecode(f *testing.F) {
	for _, kv := range []*mvccpb.KeyValue{
		{Key: []byte("a"), Value: []byte("v"), CreateRevision: 1, ModRevision: 2, Version: 1},
		{Key: []byte("a"), Lease: 9},
	} {
		enc, _ := proto.Marshal(kv)
		f.Add(enc)
	}
	f.Add([]byte{0x0a, 0x01, 'a', 0x10, 0x00})       // a default value written
	f.Add([]byte{0x10, 0x01, 0x0a, 0x01, 'a'})       // fields out of order
	f.Add([]byte{0x0a, 0x01, 'a', 0x10, 0x81, 0x00}) // a varint longer than it needs
	f.Add([]byte{0x0a, 0x01, 'a', 0xb8, 0x06, 0x07}) // an unknown field
	f.Add([]byte{0x0a, 0x00})                        // no key
	f.Add([]byte{0x0a, 0x05, 'a'})                   // cut short
	f.Fuzz(func(t *testing.T, enc []byte) {
		kv, err := Decode(enc)
		var want mvccpb.KeyValue
		if perr := proto.Unmarshal(enc, &want); perr != nil || len(want.Key) == 0 {
			if err == nil {
				t.Fatalf("Decode(%x) = %v; proto.Unmarshal: %v", enc, kv, perr)
			}
			return
		}
		if err != nil || !proto.Equal(kv, &want) {
			t.Fatalf("Decode(%x) = %v, %v; want %v", enc, kv, err, &want)
		}
		if kv.ModRevision >= 1 && kv.ModRevision < 1<<62 { // a revision (invariant 7)
			checkForms(t, kv)
		}
	})
}

// FuzzVersionTags: a version's revision and kind survive its tagging, for
// every revision a store keeps.
func FuzzVersionTags(f *testing.F) {
	for _, rev := range []int64{1, 2, 1 << 31, 1<<62 - 1} {
		f.Add(rev)
	}
	f.Fuzz(func(t *testing.T, rev int64) {
		rev = 1 + rev&(1<<62-2) // a revision (invariant 7)
		e := New(&mvccpb.KeyValue{Key: []byte("k"), ModRevision: rev})
		bare := entryOf(e).bare()
		for name, c := range map[string]struct {
			v                 Version
			put, bare, packed bool
		}{
			"delete": {Delete(rev), false, false, false},
			"put":    {Put(rev, e), true, false, false},
			"bare":   {bareVersion(rev, bare), true, true, false},
			"packed": {packedVersion(rev, bare), true, true, true},
		} {
			v := c.v
			if v.Rev() != rev || v.IsPut() != c.put || v.IsBare() != c.bare || v.IsPacked() != c.packed {
				t.Fatalf("%s at %d: rev %d put %v bare %v packed %v", name, rev, v.Rev(), v.IsPut(), v.IsBare(), v.IsPacked())
			}
		}
	})
}

// FuzzSlabAccounting: a load's slabs count, in live bytes, exactly the
// packed versions the index holds (invariant 5); releasing a version
// counts it out and hands its slab to evacuation once under half full;
// evacuation (Each, Same, Unpacked) finds every encoding still held, and
// Forget leaves the set's counts those of the slabs left. No packed
// encoding reaches a slab's last byte (invariant 4).
func FuzzSlabAccounting(f *testing.F) {
	f.Add([]byte{10, 200, 3, 0, 255, 40, 7, 7, 7, 1}, uint64(0x5555))
	f.Add(bytes.Repeat([]byte{255, 254}, 200), uint64(0xffff_ffff))
	f.Add(bytes.Repeat([]byte{1}, 300), uint64(0))
	f.Fuzz(func(t *testing.T, sizes []byte, release uint64) {
		var k Packer
		var vs []Version
		for i, size := range sizes {
			kv := &mvccpb.KeyValue{Key: binary.BigEndian.AppendUint32([]byte("k"), uint32(i)), ModRevision: int64(i + 1), Version: 1}
			kv.Value = bytes.Repeat([]byte{'v'}, int(size)*int(size)/16) // up to 4 KiB: some not packed
			v, ok := k.Pack(kv)
			if !ok {
				if len(Field(Encoding(New(kv)))) <= MaxPackedBytes {
					t.Fatalf("a field of %d bytes was not packed", len(Field(Encoding(New(kv)))))
				}
				continue
			}
			if !proto.Equal(v.KV(&KVMaker{}), kv) {
				t.Fatalf("packed %v, want %v", v.KV(&KVMaker{}), kv)
			}
			vs = append(vs, v)
		}
		var packerBytes int64
		for _, sl := range k.Slabs() {
			packerBytes += slabAllocBytes(sl.Cap()) + slabStructBytes
			if len(sl.buf) >= sl.Cap() {
				t.Fatalf("a slab of %d bytes written to its last byte", sl.Cap())
			}
		}
		if k.Bytes() != packerBytes {
			t.Fatalf("the packer counts %d bytes, its slabs take %d", k.Bytes(), packerBytes)
		}
		set := NewSlabSet(k.Slabs())
		check := func(when string, held []Version) {
			t.Helper()
			var live, size int64
			perSlab := map[*Slab]int64{}
			for _, v := range held {
				sl := set.Find(v.Encoding())
				if sl == nil {
					t.Fatalf("%s: a held version in no slab", when)
				}
				perSlab[sl] += v.Bytes()
				live += v.Bytes()
			}
			for _, sl := range set.Slabs() {
				if sl.Live() != perSlab[sl] {
					t.Fatalf("%s: a slab counts %d live bytes, holds %d", when, sl.Live(), perSlab[sl])
				}
				size += slabAllocBytes(sl.Cap())
			}
			if set.Live() != live || set.Dead() != size-live+int64(len(set.Slabs()))*slabStructBytes {
				t.Fatalf("%s: live %d dead %d; the slabs hold %d of %d", when, set.Live(), set.Dead(), live, size)
			}
		}
		check("loaded", vs)
		// Release some; evacuate the slabs Release hands back.
		var held []Version
		evacuate := map[*Slab]bool{}
		for i, v := range vs {
			if release>>(i%64)&1 == 0 {
				held = append(held, v)
				continue
			}
			sl := set.Find(v.Encoding())
			if got := set.Release(v); got != nil != (2*sl.Live() < int64(sl.Cap())) || got != nil && got != sl {
				t.Fatalf("Release gave %p for a slab of %d live bytes of %d", got, sl.Live(), sl.Cap())
			}
			if 2*sl.Live() < int64(sl.Cap()) {
				evacuate[sl] = true
			}
		}
		check("released", held)
		for sl := range evacuate {
			moved := 0
			sl.Each(func(at Version, key []byte) {
				for i, v := range held {
					if !v.Same(at) {
						continue
					}
					if !bytes.Equal(v.Key(), key) {
						t.Fatalf("Each gave key %q for %q", key, v.Key())
					}
					u := v.Unpacked()
					if u.IsPacked() || u.Rev() != v.Rev() || !bytes.Equal(u.Encoding(), v.Encoding()) || set.Find(u.Encoding()) != nil {
						t.Fatalf("unpacked %v at %d, want a copy at %d", u.IsPacked(), u.Rev(), v.Rev())
					}
					held[i] = u
					moved++
				}
			})
			if int64(moved) != 0 && sl.Live() == 0 {
				t.Fatalf("moved %d encodings of a slab holding none", moved)
			}
			set.Forget(sl)
		}
		var packed []Version
		for _, v := range held {
			if v.IsPacked() {
				packed = append(packed, v)
			}
		}
		check("evacuated", packed)
	})
}
