//! Tally's storage layer.
//!
//! One trait, [`Store`], with two implementations that promise the same semantics:
//!
//! * [`SledStore`] — the production store: one sled database per node.
//! * [`MemStore`] — an in-memory store for tests and simulation. It keeps what was
//!   made durable by [`Store::flush`] apart from what was only applied, so a simulated
//!   crash ([`MemStore::crash`]) loses exactly what a real crash may lose.
//!
//! # Layout
//!
//! * `lib.rs` — the [`Store`] trait, [`Upgrade`] (a store of an earlier format
//!   rewritten in place) and the shard types it re-exports from `tally_core`.
//! * `sled_store.rs` — [`SledStore`] and [`SledConfig`]: shard images and dedup
//!   records striped over [`SHARD_TREES`] sled trees, metadata in its own tree.
//! * `mem.rs` — [`MemStore`], with its simulated crashes and failing flushes.
//! * `error.rs` — [`StoreError`], the one error type of the layer.
//! * `examples/dedup_rss.rs` — sled alone fed dedup records, to measure its memory
//!   per record outside the engine.
//!
//! # What the store promises
//!
//! * **Atomic shard commits.** [`Store::commit`] writes a shard's new value, its sketch
//!   and its new dedup records, and removes the dedup records it names, all or nothing,
//!   across crashes too. The shard actor is the only writer of its shard, so the value
//!   it writes is the old value plus the batch's sum, computed in the actor: no client
//!   ever reads, modifies and writes.
//! * **Read-your-commits.** Reads see every completed commit, flushed or not.
//! * **Group commit.** [`Store::flush`] makes every commit that completed before the call
//!   durable with one fsync; concurrent callers share it.
//! * **Prefix durability.** After a crash, the store holds every commit that completed
//!   before the last successful flush, plus possibly some later commits in commit order.
//!
//! Values and records are encoded by [`tally_core::codec`].

#![forbid(unsafe_code)]

mod error;
mod mem;
mod sled_store;

pub use error::StoreError;
pub use mem::{MemStats, MemStore};
pub use sled_store::{SledConfig, SledStore, IMAGE_CARRIED_RECORDS_MAX, SHARD_TREES};

use tally_core::ids::ShardId;

pub use tally_core::format::Rewrite;

/// What [`Store::upgrade`] rewrites.
pub struct Upgrade<'a> {
    /// The rewrite of every shard image's stored value, if their layout changed: the
    /// encoded image, which from store format 7 on may be followed by the records it
    /// carries (see [`IMAGE_CARRIED_RECORDS_MAX`]).
    pub shard_image: Option<Rewrite<'a>>,
    /// The rewrite of every metadata entry whose key starts with the prefix.
    pub meta: Vec<(&'a [u8], Rewrite<'a>)>,
    /// The metadata entry (the format marker) written in the same atomic step.
    pub marker: (&'a [u8], &'a [u8]),
}

pub use tally_core::dedup::DedupRecord;
pub use tally_core::shard::{ShardImage, ShardWrite};

/// A storage backend. Implementations are cheap to share (`Arc<dyn Store>`) and are
/// called from many threads; every method except [`Store::flush`] is quick.
pub trait Store: Send + Sync + 'static {
    /// The shard's current state; a shard never written reads as zero with no sketch.
    fn load_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError>;

    /// The shard's current state, read by the shard's writer (its actor) when it
    /// starts or reloads after a failed commit. Every commit of the shard builds on
    /// the state its writer last opened or committed; a replicated store remembers
    /// it here and refuses a commit that would build on anything older.
    fn open_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        self.load_shard(id)
    }

    /// The dedup record for `event_id` in this shard, if one was committed.
    fn dedup_get(&self, id: &ShardId, event_id: &str) -> Result<Option<DedupRecord>, StoreError>;

    /// Up to `limit` of this shard's dedup records in event-id order, starting after
    /// `after` (exclusive) when given. Used for expiry sweeps.
    fn dedup_scan(
        &self,
        id: &ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, DedupRecord)>, StoreError>;

    /// Up to `limit` ids of shards this store holds, starting after `after`
    /// (exclusive) when given. The order is the store's own but stable, so paging
    /// with the last id returned visits every shard once.
    fn shard_ids(&self, after: Option<&ShardId>, limit: usize) -> Result<Vec<ShardId>, StoreError>;

    /// Applies `write` to the shard atomically (all or nothing, across crashes too).
    fn commit(&self, id: &ShardId, write: &ShardWrite) -> Result<(), StoreError>;

    /// Applies several shards' writes in order, each atomically; one result per write.
    /// A store may group them into fewer atomic batches, never splitting a write: the
    /// commit path hands over every write of a cycle at once.
    fn commit_many(&self, writes: &[(ShardId, ShardWrite)]) -> Vec<Result<(), StoreError>> {
        writes.iter().map(|(id, write)| self.commit(id, write)).collect()
    }

    /// Removes the shard's value, sketch and every dedup record, atomically.
    fn delete_shard(&self, id: &ShardId) -> Result<(), StoreError>;

    /// Makes every commit that completed before this call durable. Blocks for one
    /// fsync; call it from a blocking context.
    fn flush(&self) -> Result<(), StoreError>;

    /// Reads a metadata entry (counter specs and layouts of the local catalog, node
    /// identity). Metadata lives apart from shard data.
    fn meta_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;

    /// Writes a metadata entry. Like commits, it is durable after the next flush.
    fn meta_put(&self, key: &[u8], value: &[u8]) -> Result<(), StoreError>;

    /// Removes a metadata entry.
    fn meta_delete(&self, key: &[u8]) -> Result<(), StoreError>;

    /// Writes `puts` and removes `deletes` as one atomic change (all or nothing,
    /// across crashes too): metadata entries that must agree change together.
    /// Durable after the next flush.
    fn meta_batch(&self, puts: &[(Vec<u8>, Vec<u8>)], deletes: &[Vec<u8>]) -> Result<(), StoreError>;

    /// Writes `puts` in order, each entry atomic on its own: a crash keeps a prefix of
    /// them, and a failure may leave the ones before it written. For entries that
    /// stand alone, such as the catalog entries of new counters. Durable after the
    /// next flush. By default one atomic batch, which promises more.
    fn meta_put_each(&self, puts: &[(Vec<u8>, Vec<u8>)]) -> Result<(), StoreError> {
        self.meta_batch(puts, &[])
    }

    /// Up to `limit` metadata entries whose keys start with `prefix`, in key order,
    /// starting after `after` (exclusive) when given.
    // The signature is part of the fixed trait; a type alias would only hide the shape.
    #[allow(clippy::type_complexity)]
    fn meta_scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError>;

    /// Rewrites, as one atomic step (all or nothing, across crashes too), every record
    /// that `plan` names, and writes its marker; returns how many records it rewrote.
    /// Run while nothing else uses the store (at open). A record that the rewrite
    /// cannot read fails the whole upgrade and changes nothing.
    fn upgrade(&self, plan: &Upgrade<'_>) -> Result<u64, StoreError>;

    /// Bytes the store occupies on disk (0 for the in-memory store).
    fn size_on_disk(&self) -> Result<u64, StoreError>;

    /// Whether calls may block the thread (disk I/O, locks held across an fsync).
    /// Callers then keep them off async workers; a store that never blocks is called
    /// inline, which keeps a simulation on one thread and deterministic.
    fn blocks(&self) -> bool {
        true
    }

    /// Whether shard writes, seals and deletions wait on other nodes (a store that
    /// replicates them). The engine then awaits the `_async` operations below on its
    /// runtime instead of calling the synchronous ones, so no thread is held while a
    /// quorum answers and a simulation of such a store stays on one thread.
    fn waits(&self) -> bool {
        false
    }

    /// Whether a commit that returned Ok is durable already (a replicated store: a
    /// quorum holds it). The engine's reads then make nothing durable themselves, so
    /// they never wait behind the commit path.
    fn durable_on_commit(&self) -> bool {
        false
    }

    /// [`Store::commit_many`], for a store that [`waits`](Store::waits).
    fn commit_many_async<'a>(
        &'a self,
        writes: &'a [(ShardId, ShardWrite)],
    ) -> StoreFuture<'a, Vec<Result<(), StoreError>>> {
        Box::pin(std::future::ready(self.commit_many(writes)))
    }

    /// [`Store::flush`], for a store that [`waits`](Store::waits).
    fn flush_async(&self) -> StoreFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(self.flush()))
    }

    /// [`Store::delete_shard`], for a store that [`waits`](Store::waits).
    fn delete_shard_async<'a>(&'a self, id: &'a ShardId) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(std::future::ready(self.delete_shard(id)))
    }

    /// [`Store::meta_put`], for a store that [`waits`](Store::waits) (a seal marker
    /// is a replicated write there).
    fn meta_put_async<'a>(
        &'a self,
        key: &'a [u8],
        value: &'a [u8],
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(std::future::ready(self.meta_put(key, value)))
    }

    /// [`Store::meta_delete`], for a store that [`waits`](Store::waits).
    fn meta_delete_async<'a>(&'a self, key: &'a [u8]) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(std::future::ready(self.meta_delete(key)))
    }
}

/// What the `_async` operations of a [`Store`] answer with.
pub type StoreFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
