//! An in-memory store with the durability semantics of the sled one, for tests and
//! deterministic simulation.

use crate::{DedupRecord, ShardImage, ShardWrite, Store, StoreError};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Bound;
use std::sync::Arc;
use tally_core::ids::ShardId;

/// An in-memory [`Store`] that can lose exactly what a real crash may lose.
///
/// It keeps two states: the *durable* one (what survived the last successful
/// [`Store::flush`]) and the *applied* one (durable plus every later mutation, in
/// order, as recorded in a log of operations). Reads see the applied state, like sled's
/// reads see unflushed writes. [`MemStore::crash`] throws away a suffix of the log,
/// which is what sled's log-structured storage may lose in a power cut.
///
/// Everything is deterministic: ordered maps only, no clock, no randomness, so a
/// simulation replays identically from its seed. Clones share one store (the handles
/// are `Arc`s), so a simulated node can be "restarted" with the same handle after
/// [`MemStore::crash`].
///
/// Faults are injected per instance ([`MemStore::fail_next_commits`],
/// [`MemStore::fail_next_flushes`]) because `fail` failpoints are process-global and
/// cannot target one node of an in-process cluster.
#[derive(Clone, Default)]
pub struct MemStore {
    inner: Arc<Mutex<Inner>>,
    /// The node incarnation this handle belongs to; [`MemStore::restart`] starts a new
    /// one and every handle of an older incarnation is closed for good.
    incarnation: u64,
}

/// Counts of what a [`MemStore`] has done since it was created, for tests and
/// benchmarks that check batching (e.g. "one flush served many increments").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Successful [`Store::commit`] calls.
    pub commits: u64,
    /// Successful [`Store::flush`] calls.
    pub flushes: u64,
    /// Commits refused by [`MemStore::fail_next_commits`].
    pub failed_commits: u64,
    /// Flushes refused by [`MemStore::fail_next_flushes`].
    pub failed_flushes: u64,
    /// Calls of [`MemStore::crash`].
    pub crashes: u64,
    /// Unflushed operations lost by crashes, in total.
    pub ops_lost: u64,
}

#[derive(Default)]
struct Inner {
    /// What survived the last successful flush (or crash recovery).
    durable: State,
    /// `durable` with every operation of `log` applied; what reads see.
    applied: State,
    /// Mutations since the last flush, in the order they completed.
    log: Vec<Op>,
    /// Set by [`MemStore::close`]; every operation fails until the next crash/restart.
    closed: bool,
    /// The current incarnation; handles of other incarnations are closed.
    incarnation: u64,
    /// How many of the next commits fail.
    fail_commits: u64,
    /// How many of the next flushes fail.
    fail_flushes: u64,
    stats: MemStats,
}

impl Inner {
    fn check_open(&self, incarnation: u64) -> Result<(), StoreError> {
        if self.closed || self.incarnation != incarnation {
            Err(StoreError::Closed)
        } else {
            Ok(())
        }
    }

    /// Applies `op` to the applied state and logs it as unflushed.
    fn record(&mut self, op: Op) {
        self.applied.apply(&op);
        self.log.push(op);
    }
}

/// One mutation, as remembered until it is flushed.
#[derive(Debug, Clone)]
enum Op {
    Commit(ShardId, ShardWrite),
    DeleteShard(ShardId),
    MetaPut(Vec<u8>, Vec<u8>),
    MetaDelete(Vec<u8>),
    /// Several metadata changes, applied (and lost) together: deletes, then puts.
    MetaBatch(Vec<(Vec<u8>, Vec<u8>)>, Vec<Vec<u8>>),
}

/// The persisted content of one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ShardState {
    image: ShardImage,
    dedup: BTreeMap<String, DedupRecord>,
}

/// Everything a store holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct State {
    shards: BTreeMap<ShardId, ShardState>,
    meta: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl State {
    /// Applies one mutation with the same semantics as [`crate::SledStore`]: a commit's
    /// removes come before its puts, and a later put of one id wins.
    fn apply(&mut self, op: &Op) {
        match op {
            Op::Commit(id, write) => {
                let shard = self.shards.entry(id.clone()).or_default();
                shard.image = write.image.clone();
                for event_id in &write.dedup_remove {
                    shard.dedup.remove(event_id);
                }
                for (event_id, record) in &write.dedup_put {
                    shard.dedup.insert(event_id.clone(), *record);
                }
            }
            Op::DeleteShard(id) => {
                self.shards.remove(id);
            }
            Op::MetaPut(key, value) => {
                self.meta.insert(key.clone(), value.clone());
            }
            Op::MetaDelete(key) => {
                self.meta.remove(key);
            }
            Op::MetaBatch(puts, deletes) => {
                for key in deletes {
                    self.meta.remove(key);
                }
                for (key, value) in puts {
                    self.meta.insert(key.clone(), value.clone());
                }
            }
        }
    }
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Simulates a power loss followed by a restart of the node that owns this store.
    ///
    /// The store comes back holding its durable state plus the first `keep_unflushed`
    /// operations that completed after the last successful flush, in order; the later
    /// ones are lost. That is prefix durability, what sled's log guarantees. What came
    /// back is durable from then on (it was recovered from disk). `keep_unflushed = 0`
    /// is the worst case; `usize::MAX` keeps everything, which models a clean shutdown
    /// (sled flushes when the database is dropped).
    ///
    /// A store closed with [`MemStore::close`] is open again afterwards, and pending
    /// injected faults are cleared (they belonged to the old process). Every clone of
    /// this handle sees the restarted store.
    pub fn crash(&self, keep_unflushed: usize) {
        let mut inner = self.inner.lock();
        let keep = keep_unflushed.min(inner.log.len());
        let log = std::mem::take(&mut inner.log);
        let mut recovered = std::mem::take(&mut inner.durable);
        for op in &log[..keep] {
            recovered.apply(op);
        }
        inner.applied = recovered.clone();
        inner.durable = recovered;
        inner.closed = false;
        inner.fail_commits = 0;
        inner.fail_flushes = 0;
        inner.stats.crashes += 1;
        inner.stats.ops_lost += (log.len() - keep) as u64;
    }

    /// Like [`MemStore::crash`], but the restarted node gets a new handle and every
    /// handle of the crashed node (its leftover tasks, in a simulation or a test) is
    /// closed for good — as a killed process can write nothing more.
    pub fn restart(&self, keep_unflushed: usize) -> MemStore {
        let incarnation = {
            let mut inner = self.inner.lock();
            inner.incarnation += 1;
            inner.incarnation
        };
        self.crash(keep_unflushed);
        MemStore { inner: self.inner.clone(), incarnation }
    }

    /// Makes every operation fail with [`StoreError::Closed`] until the next
    /// [`MemStore::crash`], nothing lost yet. A simulation calls it when a node goes
    /// down, so that tasks of the dead node still holding a handle cannot write into
    /// the store the restarted node will use, and calls `crash` when it restarts.
    pub fn close(&self) {
        self.inner.lock().closed = true;
    }

    /// True between [`MemStore::close`] and the next [`MemStore::crash`].
    pub fn is_closed(&self) -> bool {
        let inner = self.inner.lock();
        inner.closed || inner.incarnation != self.incarnation
    }

    /// How many operations (commits, shard deletions, metadata writes) completed since
    /// the last successful flush: what a crash may lose. Lets a simulation pick how
    /// many of them a crash keeps.
    pub fn unflushed_ops(&self) -> usize {
        self.inner.lock().log.len()
    }

    /// Makes the next `n` commits fail with [`StoreError::Injected`] without changing
    /// anything (replacing any count set before).
    pub fn fail_next_commits(&self, n: u64) {
        self.inner.lock().fail_commits = n;
    }

    /// Makes the next `n` flushes fail with [`StoreError::Injected`] without making
    /// anything durable (replacing any count set before). The unflushed operations stay
    /// pending; a later successful flush makes them durable.
    pub fn fail_next_flushes(&self, n: u64) {
        self.inner.lock().fail_flushes = n;
    }

    /// What the store has done so far.
    pub fn stats(&self) -> MemStats {
        self.inner.lock().stats
    }

    /// True if the durable state equals the applied one: a crash now would lose
    /// nothing. (Differs from `unflushed_ops() == 0` only when the unflushed
    /// operations happen to cancel out.)
    pub fn is_fully_durable(&self) -> bool {
        let inner = self.inner.lock();
        inner.durable == inner.applied
    }
}

impl fmt::Debug for MemStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.inner.lock();
        f.debug_struct("MemStore")
            .field("shards", &inner.applied.shards.len())
            .field("meta_entries", &inner.applied.meta.len())
            .field("unflushed_ops", &inner.log.len())
            .field("closed", &inner.closed)
            .field("stats", &inner.stats)
            .finish()
    }
}

impl Store for MemStore {
    fn load_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        let inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        Ok(inner.applied.shards.get(id).map(|s| s.image.clone()).unwrap_or_default())
    }

    fn dedup_get(&self, id: &ShardId, event_id: &str) -> Result<Option<DedupRecord>, StoreError> {
        let inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        Ok(inner.applied.shards.get(id).and_then(|s| s.dedup.get(event_id).copied()))
    }

    fn shard_ids(&self, after: Option<&ShardId>, limit: usize) -> Result<Vec<ShardId>, StoreError> {
        let inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        let start = match after {
            Some(after) => Bound::Excluded(after),
            None => Bound::Unbounded,
        };
        Ok(inner
            .applied
            .shards
            .range::<ShardId, _>((start, Bound::Unbounded))
            .take(limit)
            .map(|(k, _)| k.clone())
            .collect())
    }

    fn dedup_scan(
        &self,
        id: &ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, DedupRecord)>, StoreError> {
        let inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        let Some(shard) = inner.applied.shards.get(id) else {
            return Ok(Vec::new());
        };
        let start = match after {
            Some(after) => Bound::Excluded(after),
            None => Bound::Unbounded,
        };
        Ok(shard
            .dedup
            .range::<str, _>((start, Bound::Unbounded))
            .take(limit)
            .map(|(k, v)| (k.clone(), *v))
            .collect())
    }

    fn commit(&self, id: &ShardId, write: &ShardWrite) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        if inner.fail_commits > 0 {
            inner.fail_commits -= 1;
            inner.stats.failed_commits += 1;
            return Err(StoreError::Injected("MemStore::commit"));
        }
        inner.record(Op::Commit(id.clone(), write.clone()));
        inner.stats.commits += 1;
        Ok(())
    }

    fn delete_shard(&self, id: &ShardId) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        inner.record(Op::DeleteShard(id.clone()));
        Ok(())
    }

    fn flush(&self) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        if inner.fail_flushes > 0 {
            inner.fail_flushes -= 1;
            inner.stats.failed_flushes += 1;
            return Err(StoreError::Injected("MemStore::flush"));
        }
        let log = std::mem::take(&mut inner.log);
        for op in &log {
            inner.durable.apply(op);
        }
        inner.stats.flushes += 1;
        Ok(())
    }

    fn meta_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        Ok(inner.applied.meta.get(key).cloned())
    }

    fn meta_put(&self, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        inner.record(Op::MetaPut(key.to_vec(), value.to_vec()));
        Ok(())
    }

    fn meta_delete(&self, key: &[u8]) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        inner.record(Op::MetaDelete(key.to_vec()));
        Ok(())
    }

    fn meta_batch(&self, puts: &[(Vec<u8>, Vec<u8>)], deletes: &[Vec<u8>]) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        inner.record(Op::MetaBatch(puts.to_vec(), deletes.to_vec()));
        Ok(())
    }

    fn meta_scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        let inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        let start = match after {
            Some(after) if after >= prefix => Bound::Excluded(after),
            _ => Bound::Included(prefix),
        };
        Ok(inner
            .applied
            .meta
            .range::<[u8], _>((start, Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    /// Shard images live here as values, not bytes, so only metadata entries are
    /// rewritten; they change in one `Op::MetaBatch`, atomic like sled's.
    fn upgrade(&self, plan: &crate::Upgrade<'_>) -> Result<u64, StoreError> {
        let mut inner = self.inner.lock();
        inner.check_open(self.incarnation)?;
        let mut puts = Vec::new();
        for (prefix, rewrite) in &plan.meta {
            let entries = inner.applied.meta.range::<[u8], _>((Bound::Included(*prefix), Bound::Unbounded));
            for (key, value) in entries.take_while(|(k, _)| k.starts_with(prefix)) {
                let upgraded = rewrite(value).map_err(|e| StoreError::Corrupt {
                    location: format!("metadata entry {:?}", String::from_utf8_lossy(key)),
                    source: e,
                })?;
                puts.push((key.clone(), upgraded));
            }
        }
        let rewritten = puts.len() as u64;
        puts.push((plan.marker.0.to_vec(), plan.marker.1.to_vec()));
        inner.record(Op::MetaBatch(puts, Vec::new()));
        Ok(rewritten)
    }

    fn size_on_disk(&self) -> Result<u64, StoreError> {
        self.inner.lock().check_open(self.incarnation)?;
        Ok(0)
    }

    fn blocks(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::name::CounterName;

    fn shard(i: u16) -> ShardId {
        ShardId::new(CounterName::new("likes").unwrap(), 0, i)
    }

    fn write(value: i64) -> ShardWrite {
        ShardWrite {
            image: ShardImage { value, sketch: None, frequency: None, windows: None, escrow: None },
            ..ShardWrite::default()
        }
    }

    #[test]
    fn crash_keeps_the_flushed_state_and_a_prefix_of_the_rest() {
        let store = MemStore::new();
        store.commit(&shard(0), &write(1)).unwrap();
        store.flush().unwrap();
        store.commit(&shard(0), &write(2)).unwrap();
        store.commit(&shard(0), &write(3)).unwrap();
        store.meta_put(b"k", b"v").unwrap();
        assert_eq!(store.unflushed_ops(), 3);
        assert_eq!(store.load_shard(&shard(0)).unwrap().value, 3);

        store.crash(1);
        assert_eq!(store.load_shard(&shard(0)).unwrap().value, 2);
        assert_eq!(store.meta_get(b"k").unwrap(), None);
        assert_eq!(store.unflushed_ops(), 0);
        assert!(store.is_fully_durable());

        // What was recovered is durable: a second crash keeps it.
        store.crash(0);
        assert_eq!(store.load_shard(&shard(0)).unwrap().value, 2);
        let stats = store.stats();
        assert_eq!((stats.commits, stats.flushes, stats.crashes, stats.ops_lost), (3, 1, 2, 2));
    }

    #[test]
    fn injected_faults_change_nothing_and_are_per_instance() {
        let a = MemStore::new();
        let b = MemStore::new();
        a.fail_next_commits(1);
        assert_eq!(a.commit(&shard(0), &write(5)), Err(StoreError::Injected("MemStore::commit")));
        assert_eq!(a.load_shard(&shard(0)).unwrap(), ShardImage::default());
        assert_eq!(a.unflushed_ops(), 0);
        b.commit(&shard(0), &write(5)).unwrap();
        a.commit(&shard(0), &write(6)).unwrap();

        a.fail_next_flushes(2);
        assert!(a.flush().is_err());
        assert!(a.flush().is_err());
        assert_eq!(a.unflushed_ops(), 1);
        a.crash(0);
        assert_eq!(a.load_shard(&shard(0)).unwrap(), ShardImage::default());
        a.commit(&shard(0), &write(7)).unwrap();
        a.flush().unwrap();
        a.crash(0);
        assert_eq!(a.load_shard(&shard(0)).unwrap().value, 7);
        assert_eq!(b.load_shard(&shard(0)).unwrap().value, 5);
        assert_eq!(a.stats().failed_flushes, 2);
    }

    #[test]
    fn a_closed_store_refuses_everything_until_restarted() {
        let store = MemStore::new();
        let zombie = store.clone();
        store.commit(&shard(0), &write(1)).unwrap();
        store.close();
        assert!(zombie.is_closed());
        assert_eq!(zombie.commit(&shard(0), &write(9)), Err(StoreError::Closed));
        assert_eq!(zombie.load_shard(&shard(0)), Err(StoreError::Closed));
        assert_eq!(zombie.flush(), Err(StoreError::Closed));
        store.crash(usize::MAX);
        assert!(!store.is_closed());
        assert_eq!(store.load_shard(&shard(0)).unwrap().value, 1);
    }

    #[test]
    fn a_restart_closes_the_crashed_nodes_handles_for_good() {
        let store = MemStore::new();
        store.commit(&shard(0), &write(1)).unwrap();
        store.flush().unwrap();
        store.commit(&shard(0), &write(2)).unwrap();
        let old = store.clone();
        let new = store.restart(0);
        assert_eq!(new.load_shard(&shard(0)).unwrap().value, 1, "the unflushed commit is lost");
        // A leftover task of the dead node can neither write nor make anything durable.
        assert_eq!(old.commit(&shard(0), &write(7)), Err(StoreError::Closed));
        assert_eq!(old.flush(), Err(StoreError::Closed));
        assert!(old.is_closed() && store.is_closed() && !new.is_closed());
        new.crash(usize::MAX);
        assert_eq!(old.flush(), Err(StoreError::Closed), "a later crash does not revive old handles");
        assert_eq!(new.load_shard(&shard(0)).unwrap().value, 1);
    }
}
