// Package storedkv is how revtree holds its key-values in memory: the
// stored KeyValues (entries), their bare encodings, the versions of a key
// that point at either, the arrays of versions, and the slabs a load packs
// bare encodings into. It is the one place that knows their layout: every
// unsafe use of revtree's representation is here, and the store calls
// only this package's API.
//
// # Why
//
// A KeyValue the store keeps is never changed and is read by every
// snapshot that holds it, so its protobuf encoding is made once, when it
// is applied, and a Range response is its header followed by those
// encodings: marshalling the key-values was most of a large read's CPU.
// The encoding costs no memory of its own: the KeyValue's Key and Value
// are slices of it. A key whose only version no retained event holds
// keeps its encoding alone (bare), without the 120-byte KeyValue struct,
// which is most of what a key costs beside its value: a read makes a
// KeyValue of it for the moment it answers (KVMaker). A load packs its
// bare encodings one after the other into slabs (Packer), rather than
// rounding each up to its size class: 1.05x the data for the keyspace.
//
// # Forms
//
// A key-value is stored in one of two forms:
//
//   - an entry (Entry, made by New): the KeyValue struct, whose Key and
//     Value are slices of its encoding, and the encoding's length. A put
//     event's Kv, and the PrevKv of the event after it, are entries,
//     which the key's version shares while the event is retained;
//   - a bare encoding: the bytes tag, length (a varint), encoding, where
//     the tag is RangeKVTag, in an allocation of its own or packed in a
//     slab. A bare encoding is referred to by the address of its length.
//
// A Version is one state of a key at a revision: an entry, a bare
// encoding (alone or packed), or nothing for a delete.
//
// # Invariants
//
//  1. Every *mvccpb.KeyValue the store gives out for a put (a read's, an
//     event's Kv and PrevKv) is the kv field of an Entry, the struct's
//     first field, made by New, Decode or a KVMaker: EntryKV and Encoding
//     convert a *KeyValue to its Entry by address. Delete events keep the
//     tombstone they came with, which is no Entry.
//  2. An encoding, an entry's or a bare one, is the bytes proto.Marshal
//     gives for its KeyValue, and is preceded in memory by RangeKVTag and
//     its length: from the tag on, a stored key-value's bytes are its kvs
//     field in a RangeResponse as they are (Field), and an entry becomes
//     bare without a copy (Version.Bared). An entry's Key starts
//     1+len(varint(len(Key))) bytes after the start of its encoding.
//     Entries with no key, unknown fields or over 2 GiB have no
//     encoding (encLen 0) and are never bare.
//  3. Stored bytes are never written again: a copy is what moves
//     (Version.Unpacked, when a slab is evacuated). Readers may keep
//     slices of them, and pieces of a response point into them, for as
//     long as they like.
//  4. A slab's last byte is never written: a packed encoding always ends
//     inside its slab, so one that starts where another ends is in the
//     same slab (Join).
//  5. A SlabSet's live bytes are the sum of PackedBytes of the packed
//     versions the writer's index holds in its slabs, each slab's too:
//     Packer counts what it packs, Release what the index lets go.
//  6. A VersionArray's published slots never change: the writer fills the
//     slot past the count, then publishes the count (Publish), so that
//     readers, who never lock, see whole versions only.
//  7. A version's revision is at least 1 and below 2^62: a bare one is
//     tagged -(rev<<1 | packed), so that the sign tells an entry from a
//     bare encoding without a field of its own (a Version is 16 bytes).
//     etcd's revisions start at 1.
//
// Sizes (EntryBytes, Version.Bytes, VersionArrayBytes, SlabSet.Dead) are
// the heap each form takes, rounded to the allocator's size classes
// (allocsize): revtree's memory estimates are made of them.
package storedkv
