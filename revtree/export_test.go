package revtree

// SetMinFlatKVsForTest sets the fewest key-values of a read without a
// limit that the flattened-range cache keeps, so that tests with small
// keyspaces read through it too. Call it before the store is read.
func (s *Store) SetMinFlatKVsForTest(n int) { s.flat.minKVs = n }
