//! [`RangeStore`]: the engine's [`Store`] over a node's range groups.
//!
//! Shard data (images, dedup records, seals) lives in the range groups; metadata
//! (the local catalog, the format marker) stays in the node's own store. The
//! engine's commit path calls [`Store::commit_many`] once per cycle with every
//! shard write of the cycle: they become one raft entry per range, so one quorum
//! round and one fsync per replica serve every write of the cycle.
//!
//! # Writers and sequences
//!
//! A shard has one writer, its actor on the range's leader. Each commit carries the
//! shard's sequence: one more than the sequence of the state the writer built on
//! (what it opened, [`Store::open_shard`], or last committed), and a group applies
//! an image only over an older sequence. Since the state a writer builds on was
//! stored at some point and stored sequences only grow, an image is applied exactly
//! when nothing else was committed to the shard since its writer's state: a writer
//! left over on a deposed leader, or one that missed a commit of another node, has
//! its commit refused ([`StoreError::Unavailable`]), reloads, and can never
//! overwrite an increment another writer had acknowledged.

use crate::groups::{RangeGroups, ReplicaError, ENTRY_OVERHEAD_BYTES};
use crate::types::{ShardEntry, StoredShard, BATCH_IMAGES_MAX, IMAGE_RECORDS_MAX};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use tally_core::dedup::DedupRecord;
use tally_core::handoff_machine::shard_of_seal_marker;
use tally_core::ranges::RangeId;
use tally_core::shard::{ShardImage, ShardWrite};
use tally_core::ShardId;
use tally_store::{Store, StoreError, StoreFuture, Upgrade};

/// The engine's store on a node that replicates its shards.
pub struct RangeStore {
    groups: Arc<RangeGroups>,
    local: Arc<dyn Store>,
    runtime: tokio::runtime::Handle,
    /// The sequence each shard's writer builds on, set when it opens the shard and
    /// by each of its commits; removed when a commit fails (the writer reloads).
    writers: Mutex<HashMap<ShardId, u64>>,
}

fn unavailable(op: &'static str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable { op, reason: e.to_string() }
}

impl RangeStore {
    /// Shard data through `groups`, metadata in `local`; raft calls run on
    /// `runtime` (the store's methods are called from blocking threads).
    pub fn new(groups: Arc<RangeGroups>, local: Arc<dyn Store>, runtime: tokio::runtime::Handle) -> Self {
        Self { groups, local, runtime, writers: Mutex::new(HashMap::new()) }
    }

    fn range(&self, id: &ShardId) -> RangeId {
        self.groups.layout().range_of_shard(id)
    }

    /// Runs `f` to completion from a synchronous method: on a blocking thread
    /// directly, from a worker of a multi-threaded runtime by handing the worker's
    /// other tasks on first. The engine calls the `_async` operations (this store
    /// [`waits`](Store::waits)), so this serves other callers only; on a
    /// current-thread runtime, which nothing may block, it answers an error.
    fn wait<T, F: Future<Output = Result<T, StoreError>>>(
        &self,
        op: &'static str,
        f: F,
    ) -> Result<T, StoreError> {
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread => {
                Err(unavailable(op, "a replicated write cannot block a current-thread runtime"))
            }
            Ok(_) => tokio::task::block_in_place(|| self.runtime.block_on(f)),
            Err(_) => self.runtime.block_on(f),
        }
    }

    /// The shard's image as its range holds it here: its dedup records stay in
    /// the store, read one by one ([`Store::dedup_get`]) or a page at a time.
    fn stored(&self, op: &'static str, id: &ShardId) -> Result<Option<StoredShard>, StoreError> {
        self.groups.shard(self.range(id), id).map_err(|e| unavailable(op, e))
    }

    /// Replicates one entry that is not a writer's commit (a seal, an unseal, a
    /// deletion), built on the stored state.
    async fn write_one(&self, op: &'static str, entry: ShardEntry) -> Result<(), StoreError> {
        let range = self.range(&entry.shard);
        let ack = self.groups.write(range, vec![entry]).await.map_err(|e| unavailable(op, e))?;
        if ack.report.refused.is_empty() {
            Ok(())
        } else {
            Err(unavailable(op, "the shard changed since this node read it; retry"))
        }
    }

    /// The entries of one commit cycle, one batch per range (split at
    /// [`BATCH_IMAGES_MAX`] images and at the groups' entry bound
    /// ([`crate::GroupsConfig::entry_bytes_max`]) bytes, so that every
    /// entry fits in one message between nodes), with the position of every
    /// image's write; writes that cannot be sent are answered at once.
    #[allow(clippy::type_complexity)]
    fn plan(
        &self,
        writes: &[(ShardId, ShardWrite)],
    ) -> (Vec<Result<(), StoreError>>, Vec<(RangeId, Vec<usize>, Vec<ShardEntry>)>) {
        let mut results: Vec<Result<(), StoreError>> = vec![Ok(()); writes.len()];
        let mut batches: Vec<(RangeId, Vec<usize>, Vec<ShardEntry>)> = Vec::new();
        // The batch of each range being filled, and its bytes so far.
        let mut open: HashMap<RangeId, (usize, usize)> = HashMap::new();
        let entry_bytes_max = self.groups.config().entry_bytes_max();
        for (at, (id, write)) in writes.iter().enumerate() {
            let Some(base) = self.base(id) else {
                results[at] = Err(unavailable("commit", "the shard's writer must reload it first"));
                continue;
            };
            let sealed = match self.stored("commit", id) {
                Ok(s) => s.is_some_and(|s| s.sealed),
                Err(e) => {
                    results[at] = Err(e);
                    continue;
                }
            };
            let range = self.range(id);
            let entry =
                ShardEntry { shard: id.clone(), seq: base + 1, write: write.clone(), sealed, clear: false };
            let records = write.dedup_put.len() + write.dedup_remove.len();
            if records > IMAGE_RECORDS_MAX {
                let e = format!("{records} dedup changes in one write; at most {IMAGE_RECORDS_MAX}");
                results[at] = Err(unavailable("commit", e));
                continue;
            }
            let bytes = tally_core::codec::encoded_len(&entry);
            if bytes + ENTRY_OVERHEAD_BYTES > entry_bytes_max {
                let e = ReplicaError::TooLarge { range, bytes, bytes_max: entry_bytes_max };
                results[at] = Err(unavailable("commit", e));
                continue;
            }
            let slot = match open.get(&range) {
                Some(&(i, held))
                    if batches[i].2.len() < BATCH_IMAGES_MAX && held + bytes <= entry_bytes_max =>
                {
                    open.insert(range, (i, held + bytes));
                    i
                }
                _ => {
                    batches.push((range, Vec::new(), Vec::new()));
                    open.insert(range, (batches.len() - 1, ENTRY_OVERHEAD_BYTES + bytes));
                    batches.len() - 1
                }
            };
            batches[slot].1.push(at);
            batches[slot].2.push(entry);
        }
        (results, batches)
    }

    /// Answers each write of the cycle from its range's answer, and moves each
    /// writer's base to what it committed (or forgets it: the writer reloads).
    fn settle(
        &self,
        batches: &[(RangeId, Vec<usize>, Vec<ShardEntry>)],
        answers: Vec<Result<crate::groups::WriteAck, crate::groups::ReplicaError>>,
        results: &mut [Result<(), StoreError>],
    ) {
        let mut writers = self.writers.lock();
        for ((_, positions, entries), answer) in batches.iter().zip(answers) {
            match answer {
                Ok(ack) => {
                    for (i, (&at, entry)) in positions.iter().zip(entries).enumerate() {
                        let refused = ack.report.refused.contains(&u32::try_from(i).unwrap_or(u32::MAX));
                        if refused {
                            writers.remove(&entry.shard);
                            results[at] = Err(unavailable(
                                "commit",
                                "another writer committed to the shard since this one loaded it",
                            ));
                        } else {
                            writers.insert(entry.shard.clone(), entry.seq);
                        }
                    }
                }
                Err(e) => {
                    for (&at, entry) in positions.iter().zip(entries) {
                        writers.remove(&entry.shard);
                        results[at] = Err(unavailable("commit", &e));
                    }
                }
            }
        }
    }

    /// The sequence the shard's writer builds on, if it opened the shard.
    fn base(&self, id: &ShardId) -> Option<u64> {
        self.writers.lock().get(id).copied()
    }
}

impl Store for RangeStore {
    fn load_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        Ok(self.stored("load_shard", id)?.map(|s| s.image).unwrap_or_default())
    }

    fn open_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        let stored = self.stored("open_shard", id)?.unwrap_or_default();
        self.writers.lock().insert(id.clone(), stored.seq);
        Ok(stored.image)
    }

    fn dedup_get(&self, id: &ShardId, event_id: &str) -> Result<Option<DedupRecord>, StoreError> {
        self.groups.dedup_get(self.range(id), id, event_id).map_err(|e| unavailable("dedup_get", e))
    }

    fn dedup_scan(
        &self,
        id: &ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, DedupRecord)>, StoreError> {
        self.groups.dedup_scan(self.range(id), id, after, limit).map_err(|e| unavailable("dedup_scan", e))
    }

    /// The shards of the ranges this node leads: range by range in range order,
    /// each range's in its store's key order (a page resumes in the range of the
    /// last id it returned).
    fn shard_ids(&self, after: Option<&ShardId>, limit: usize) -> Result<Vec<ShardId>, StoreError> {
        let from = after.map(|a| self.range(a));
        let mut ids = Vec::new();
        for range in self.groups.ranges() {
            if ids.len() >= limit || from.is_some_and(|f| range < f) || !self.groups.leads(range) {
                continue;
            }
            let resume = after.filter(|_| from == Some(range));
            let page = self.groups.shard_ids(range, resume, limit - ids.len());
            ids.extend(page.map_err(|e| unavailable("shard_ids", e))?);
        }
        Ok(ids)
    }

    fn commit(&self, id: &ShardId, write: &ShardWrite) -> Result<(), StoreError> {
        self.commit_many(&[(id.clone(), write.clone())]).pop().unwrap_or(Err(StoreError::Closed))
    }

    fn commit_many(&self, writes: &[(ShardId, ShardWrite)]) -> Vec<Result<(), StoreError>> {
        let all = |r: Result<Vec<Result<(), StoreError>>, StoreError>| match r {
            Ok(results) => results,
            Err(e) => writes.iter().map(|_| Err(e.clone())).collect(),
        };
        all(self.wait("commit", async { Ok(self.commit_many_async(writes).await) }))
    }

    fn commit_many_async<'a>(
        &'a self,
        writes: &'a [(ShardId, ShardWrite)],
    ) -> StoreFuture<'a, Vec<Result<(), StoreError>>> {
        Box::pin(async move {
            let (mut results, batches) = self.plan(writes);
            #[cfg(feature = "planted-bugs")]
            if tally_core::planted::active(tally_core::planted::Bug::AckBeforeQuorumDurable) {
                // Planted: every write is answered once handed to its group.
                let mut writers = self.writers.lock();
                for (range, _, entries) in batches {
                    for e in &entries {
                        writers.insert(e.shard.clone(), e.seq);
                    }
                    let groups = self.groups.clone();
                    tokio::spawn(async move { groups.write(range, entries).await });
                }
                return results;
            }
            let groups = &self.groups;
            let sent = batches.iter().map(|(range, _, entries)| groups.write(*range, entries.clone()));
            let answers = futures::future::join_all(sent).await;
            self.settle(&batches, answers, &mut results);
            results
        })
    }

    fn delete_shard(&self, id: &ShardId) -> Result<(), StoreError> {
        self.wait("delete_shard", self.delete_shard_async(id))
    }

    fn delete_shard_async<'a>(&'a self, id: &'a ShardId) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.writers.lock().remove(id);
            let Some(stored) = self.stored("delete_shard", id)? else { return Ok(()) };
            let entry = ShardEntry {
                shard: id.clone(),
                seq: stored.seq + 1,
                write: ShardWrite::default(),
                sealed: false,
                clear: true,
            };
            self.write_one("delete_shard", entry).await
        })
    }

    fn flush(&self) -> Result<(), StoreError> {
        // Shard data is durable on a quorum once committed; the local store holds
        // the metadata.
        self.local.flush()
    }

    fn flush_async(&self) -> StoreFuture<'_, Result<(), StoreError>> {
        let local = self.local.clone();
        Box::pin(async move {
            if !local.blocks() {
                return local.flush();
            }
            tokio::task::spawn_blocking(move || local.flush()).await.unwrap_or(Err(StoreError::Closed))
        })
    }

    fn meta_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        match shard_of_seal_marker(key) {
            Some(id) => Ok(self.stored("meta_get", &id)?.filter(|s| s.sealed).map(|_| Vec::new())),
            None => self.local.meta_get(key),
        }
    }

    fn meta_put(&self, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        match shard_of_seal_marker(key) {
            Some(_) => self.wait("seal", self.meta_put_async(key, value)),
            None => self.local.meta_put(key, value),
        }
    }

    /// A seal marker seals the shard in its group, on the state its writer holds
    /// (refused if the writer did not build on the stored state).
    fn meta_put_async<'a>(
        &'a self,
        key: &'a [u8],
        value: &'a [u8],
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let Some(id) = shard_of_seal_marker(key) else { return self.local.meta_put(key, value) };
            let stored = self.stored("seal", &id)?.unwrap_or_default();
            if stored.sealed {
                return Ok(());
            }
            // The writer seals with the image it holds, and that image goes into the
            // next generation's base: a writer that did not build on the stored state
            // (it missed another's commit) would seal one image and count another.
            if self.base(&id) != Some(stored.seq) {
                self.writers.lock().remove(&id);
                return Err(unavailable("seal", "the shard changed since its writer loaded it; reload"));
            }
            let write = ShardWrite { image: stored.image, ..ShardWrite::default() };
            let entry =
                ShardEntry { shard: id.clone(), seq: stored.seq + 1, write, sealed: true, clear: false };
            let result = self.write_one("seal", entry).await;
            let mut writers = self.writers.lock();
            match &result {
                Ok(()) => writers.insert(id, stored.seq + 1),
                Err(_) => writers.remove(&id),
            };
            result
        })
    }

    fn meta_delete(&self, key: &[u8]) -> Result<(), StoreError> {
        match shard_of_seal_marker(key) {
            Some(_) => self.wait("unseal", self.meta_delete_async(key)),
            None => self.local.meta_delete(key),
        }
    }

    fn meta_delete_async<'a>(&'a self, key: &'a [u8]) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let Some(id) = shard_of_seal_marker(key) else { return self.local.meta_delete(key) };
            let Some(stored) = self.stored("unseal", &id)?.filter(|s| s.sealed) else { return Ok(()) };
            self.writers.lock().remove(&id);
            let write = ShardWrite { image: stored.image, ..ShardWrite::default() };
            let entry = ShardEntry { shard: id, seq: stored.seq + 1, write, sealed: false, clear: false };
            self.write_one("unseal", entry).await
        })
    }

    fn meta_batch(&self, puts: &[(Vec<u8>, Vec<u8>)], deletes: &[Vec<u8>]) -> Result<(), StoreError> {
        let seals = puts.iter().map(|(k, _)| k).chain(deletes).any(|k| shard_of_seal_marker(k).is_some());
        if seals {
            return Err(StoreError::Io {
                op: "meta_batch",
                message: "seal markers of replicated shards change one at a time".into(),
            });
        }
        self.local.meta_batch(puts, deletes)
    }

    fn meta_scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        self.local.meta_scan(prefix, after, limit)
    }

    fn upgrade(&self, plan: &Upgrade<'_>) -> Result<u64, StoreError> {
        self.local.upgrade(plan)
    }

    fn size_on_disk(&self) -> Result<u64, StoreError> {
        self.local.size_on_disk()
    }

    fn blocks(&self) -> bool {
        self.local.blocks()
    }

    fn waits(&self) -> bool {
        true
    }

    /// A commit returns once a quorum of its range group holds it.
    fn durable_on_commit(&self) -> bool {
        true
    }
}
