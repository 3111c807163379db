package progress

import "go.uber.org/zap"

// unloadForLoad drops the store's keyspace and history before a reload
// reads the keyspace again, so that the old store is garbage before the
// new one is built: a reload then needs the memory of one store, not two.
// Nothing serves from the store meanwhile: reads go to etcd or are refused
// while loading, and watchers wait for the load (revtree.ErrNotLoaded),
// then catch up from etcd if they are older than its history. The
// store's revision and compaction revision stay. A first load finds
// nothing to drop.
func (f *Follower) unloadForLoad() {
	if !f.store.Loaded() {
		return
	}
	f.lg.Info("dropping the cache's keyspace and history before reloading",
		zap.Int64("store-revision", f.store.Rev()),
		zap.Int64("approx-bytes", f.store.ApproxBytes()))
	f.store.Unload()
}
