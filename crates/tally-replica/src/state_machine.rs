//! A range group's state machine: every shard image of the range, with its dedup
//! records, in one tree of the node's [`KvStore`], and its snapshots.
//!
//! # Layout of the state tree
//!
//! * `s` + shard key → [`StoredShard`] (sequence, image, seal);
//! * `d` + shard key + event id → `DedupRecord`;
//! * `~applied` → the last applied log id, `~membership` → the last membership.
//!
//! A shard key is the counter name, `0xff` (never in a name), the generation and
//! the index big-endian. Every `apply` call writes the shards it changed, then the
//! apply position, so a restart never loses an entry whose position is stored. An
//! `apply` that changes dedup records writes everything in ONE atomic batch (an
//! image and its records are stored together or not at all). One that changes only
//! images writes them one key at a time, in order, the position last
//! ([`KvTree::write_in_order`], which spares sled a batch's two log writes): a crash
//! keeps a prefix, at worst some newer images with an older position, and
//! re-applying those entries changes nothing (the apply rule below). It is not
//! flushed: the log is, and openraft re-applies from it what a crash took back.
//!
//! # The apply rule
//!
//! An image replaces the shard's stored one only if its sequence is higher; its
//! dedup changes are applied with it, or not at all. Entries carry absolute state,
//! never deltas, so replaying an entry, or an older image after a newer one, leaves
//! the state as it was.
//!
//! # Snapshots
//!
//! A snapshot is the whole [`RangeState`]: a replica with an empty disk catches up
//! by installing it. It is stored (and flushed) in the tree `<prefix>snap` before
//! it is reported, because openraft purges the log behind it.

// openraft's `StorageError` is large and its storage traits return it.
#![allow(clippy::result_large_err)]

use crate::log_store::{read_err, write_err};
use crate::storage::{KvStore, KvTree, KvWrite};
use crate::types::{
    Batch, BatchReport, Entry, LogId, RangeConfig, ShardEntry, SnapshotMeta, StorageError, StoredMembership,
    StoredShard,
};
use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, ErrorSubject, OptionalSend, RaftSnapshotBuilder, Snapshot};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tally_core::dedup::DedupRecord;
use tally_core::name::CounterName;
use tally_core::ranges::RangeId;
use tally_core::ShardId;

const PREFIX_SHARD: u8 = b's';
const PREFIX_DEDUP: u8 = b'd';
const KEY_APPLIED: &[u8] = b"~applied";
const KEY_MEMBERSHIP: &[u8] = b"~membership";
const KEY_SNAPSHOT: &[u8] = b"current";
const NAME_END: u8 = 0xff;

/// Every shard of a range: what a snapshot carries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeState {
    /// The shards' images.
    pub shards: BTreeMap<ShardId, StoredShard>,
    /// The shards' dedup records, by event id.
    pub dedup: BTreeMap<ShardId, BTreeMap<String, DedupRecord>>,
}

/// Whether an image of sequence `seq` replaces a stored one of sequence `stored`.
fn newer(stored: Option<u64>, seq: u64) -> bool {
    #[cfg(feature = "planted-bugs")]
    if tally_core::planted::active(tally_core::planted::Bug::TwoLeadersAck) {
        return true;
    }
    stored.is_none_or(|s| s < seq)
}

impl RangeState {
    /// Applies one image by the rule of the module docs; true if it replaced the
    /// stored one.
    pub fn apply(&mut self, entry: &ShardEntry) -> bool {
        if !newer(self.shards.get(&entry.shard).map(|s| s.seq), entry.seq) {
            return false;
        }
        self.shards.insert(
            entry.shard.clone(),
            StoredShard { seq: entry.seq, image: entry.write.image.clone(), sealed: entry.sealed },
        );
        let records = self.dedup.entry(entry.shard.clone()).or_default();
        if entry.clear {
            records.clear();
        }
        for id in &entry.write.dedup_remove {
            records.remove(id);
        }
        for (id, r) in &entry.write.dedup_put {
            records.insert(id.clone(), *r);
        }
        if records.is_empty() {
            self.dedup.remove(&entry.shard);
        }
        true
    }
}

/// The applied state and its position.
#[derive(Debug, Clone, Default)]
pub struct Applied {
    /// The range's shards.
    pub state: RangeState,
    /// The last log entry applied.
    pub last_applied: Option<LogId>,
    /// The last membership applied.
    pub membership: StoredMembership,
}

/// What the state machine shares with readers.
#[derive(Default)]
pub struct Shared {
    applied: RwLock<Applied>,
    snapshots_installed: AtomicU64,
    snapshot_bytes_installed: AtomicU64,
    log_bytes_caught_up: AtomicU64,
}

impl Shared {
    /// A copy of one shard's image and dedup records, as applied here.
    pub fn shard(&self, shard: &ShardId) -> Option<(StoredShard, BTreeMap<String, DedupRecord>)> {
        let a = self.applied.read();
        let s = a.state.shards.get(shard)?.clone();
        Some((s, a.state.dedup.get(shard).cloned().unwrap_or_default()))
    }

    /// Applies `f` to one shard's dedup records, under the read lock.
    pub fn with_dedup<T>(
        &self,
        shard: &ShardId,
        f: impl FnOnce(Option<&BTreeMap<String, DedupRecord>>) -> T,
    ) -> T {
        f(self.applied.read().state.dedup.get(shard))
    }

    /// The ids of every shard held.
    pub fn shard_ids(&self) -> Vec<ShardId> {
        self.applied.read().state.shards.keys().cloned().collect()
    }

    /// A copy of the whole applied state.
    pub fn state(&self) -> RangeState {
        self.applied.read().state.clone()
    }

    /// The last applied log id.
    pub fn last_applied(&self) -> Option<LogId> {
        self.applied.read().last_applied
    }

    /// How many snapshots this replica installed since it started.
    pub fn snapshots_installed(&self) -> u64 {
        self.snapshots_installed.load(Ordering::Relaxed)
    }

    /// Encoded bytes of the snapshots this replica installed since it started.
    pub fn snapshot_bytes_installed(&self) -> u64 {
        self.snapshot_bytes_installed.load(Ordering::Relaxed)
    }

    /// Encoded bytes of the log entries this replica received as a learner since it
    /// started: catch-up through the log rather than by snapshot.
    pub fn log_bytes_caught_up(&self) -> u64 {
        self.log_bytes_caught_up.load(Ordering::Relaxed)
    }

    pub(crate) fn count_log_bytes_caught_up(&self, bytes: u64) {
        self.log_bytes_caught_up.fetch_add(bytes, Ordering::Relaxed);
    }
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// The state machine of one group. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct StateMachine {
    range: RangeId,
    kv: Arc<dyn KvStore>,
    tree: Arc<dyn KvTree>,
    snapshots: Arc<dyn KvTree>,
    shared: Arc<Shared>,
    seq: Arc<AtomicU64>,
}

/// The key of a shard's image (`prefix` = [`PREFIX_SHARD`]) or the prefix of its
/// dedup records ([`PREFIX_DEDUP`]).
fn shard_key(prefix: u8, shard: &ShardId) -> Vec<u8> {
    let name = shard.counter.as_str().as_bytes();
    let mut key = Vec::with_capacity(1 + name.len() + 7);
    key.push(prefix);
    key.extend_from_slice(name);
    key.push(NAME_END);
    // The generation's word: the replica class rides in its top bits.
    key.extend_from_slice(&shard.generation_word().to_be_bytes());
    key.extend_from_slice(&shard.index.to_be_bytes());
    key
}

/// The shard of a key made by [`shard_key`], and what follows it.
fn parse_key(key: &[u8]) -> Option<(ShardId, &[u8])> {
    let body = key.get(1..)?;
    let end = body.iter().position(|b| *b == NAME_END)?;
    let name = CounterName::new(std::str::from_utf8(&body[..end]).ok()?).ok()?;
    let rest = body.get(end + 1..)?;
    let word = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
    let index = u16::from_be_bytes(rest.get(4..6)?.try_into().ok()?);
    Some((ShardId::from_word(name, word, index), &rest[6..]))
}

/// The environment variable that lowers [`value_bytes_max`] in a test build of a
/// node: a process test then reproduces a range past the limit with little data.
pub const VALUE_BYTES_MAX_ENV: &str = "TALLY_TEST_REPLICA_VALUE_BYTES_MAX";

/// Largest value, in bytes, the state machine decodes from its store:
/// [`tally_core::codec::DECODE_BYTES_MAX`], or less if [`VALUE_BYTES_MAX_ENV`]
/// says so when the process starts (it never raises the limit).
pub fn value_bytes_max() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        let lowered = std::env::var(VALUE_BYTES_MAX_ENV).ok().and_then(|v| v.trim().parse::<usize>().ok());
        lowered.map_or(tally_core::codec::DECODE_BYTES_MAX, |l| l.min(tally_core::codec::DECODE_BYTES_MAX))
    })
}

/// Decodes a value the state machine stored, refusing one over [`value_bytes_max`].
fn decode_value<T: serde::de::DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
) -> Result<T, tally_core::codec::DecodeError> {
    let max = value_bytes_max();
    if bytes.len() > max {
        let reason = format!("LimitExceeded: {} bytes, at most {max}", bytes.len());
        return Err(tally_core::codec::DecodeError { what, reason });
    }
    tally_core::codec::decode(what, bytes)
}

fn decode<T: serde::de::DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, StorageError> {
    decode_value(what, bytes).map_err(|e| read_err(ErrorSubject::StateMachine, e))
}

#[derive(Debug, thiserror::Error)]
#[error("undecodable key in a range state machine: {0:?}")]
struct BadKey(Vec<u8>);

fn load(tree: &dyn KvTree) -> Result<Applied, StorageError> {
    let mut applied = Applied::default();
    let all = tree
        .scan(std::ops::Bound::Unbounded, std::ops::Bound::Unbounded)
        .map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
    for (key, value) in all {
        match key.as_slice() {
            KEY_APPLIED => applied.last_applied = decode("last applied log id", &value)?,
            KEY_MEMBERSHIP => applied.membership = decode("range membership", &value)?,
            k => {
                let bad = || read_err(ErrorSubject::StateMachine, BadKey(k.to_vec()));
                let (shard, rest) = parse_key(k).ok_or_else(bad)?;
                match k[0] {
                    PREFIX_SHARD if rest.is_empty() => {
                        applied.state.shards.insert(shard, decode("stored shard", &value)?);
                    }
                    PREFIX_DEDUP => {
                        let id = std::str::from_utf8(rest).map_err(|_| bad())?.to_owned();
                        applied
                            .state
                            .dedup
                            .entry(shard)
                            .or_default()
                            .insert(id, decode("dedup record", &value)?);
                    }
                    _ => return Err(bad()),
                }
            }
        }
    }
    Ok(applied)
}

fn dedup_key(shard: &ShardId, id: &str) -> Vec<u8> {
    let mut key = shard_key(PREFIX_DEDUP, shard);
    key.extend_from_slice(id.as_bytes());
    key
}

/// The writes that store `entry` (already judged newer); `held` is the shard's
/// records before it, removed first when the entry clears them. True if they
/// change dedup records, so must be atomic with the image.
fn stage(batch: &mut Vec<KvWrite>, entry: &ShardEntry, held: Option<&BTreeMap<String, DedupRecord>>) -> bool {
    let stored = StoredShard { seq: entry.seq, image: entry.write.image.clone(), sealed: entry.sealed };
    batch.push((shard_key(PREFIX_SHARD, &entry.shard), Some(tally_core::codec::encode(&stored))));
    let before = batch.len();
    if entry.clear {
        for id in held.into_iter().flat_map(|h| h.keys()) {
            batch.push((dedup_key(&entry.shard, id), None));
        }
    }
    for id in &entry.write.dedup_remove {
        batch.push((dedup_key(&entry.shard, id), None));
    }
    for (id, r) in &entry.write.dedup_put {
        batch.push((dedup_key(&entry.shard, id), Some(tally_core::codec::encode(r))));
    }
    batch.len() > before
}

/// The apply position: the membership (only if `membership` changed), then the
/// last applied log id, last of all.
fn stage_position(batch: &mut Vec<KvWrite>, applied: &Applied, membership: bool) {
    if membership {
        batch.push((KEY_MEMBERSHIP.to_vec(), Some(tally_core::codec::encode(&applied.membership))));
    }
    batch.push((KEY_APPLIED.to_vec(), Some(tally_core::codec::encode(&applied.last_applied))));
}

impl StateMachine {
    /// Opens the trees `<prefix>sm` and `<prefix>snap` of range `range` and loads
    /// the state.
    pub fn open(range: RangeId, kv: Arc<dyn KvStore>, prefix: &str) -> Result<Self, StorageError> {
        let tree = kv.tree(&format!("{prefix}sm")).map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
        let snapshots =
            kv.tree(&format!("{prefix}snap")).map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
        let applied = load(&*tree)?;
        let shared = Arc::new(Shared { applied: RwLock::new(applied), ..Default::default() });
        Ok(Self { range, kv, tree, snapshots, shared, seq: Arc::new(AtomicU64::new(0)) })
    }

    /// What readers share.
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    async fn save_snapshot(&self, s: &StoredSnapshot) -> Result<(), StorageError> {
        let subject = ErrorSubject::Snapshot(Some(s.meta.signature()));
        self.snapshots
            .apply(vec![(KEY_SNAPSHOT.to_vec(), Some(tally_core::codec::encode(s)))])
            .map_err(|e| write_err(subject.clone(), e))?;
        self.kv.flush().await.map_err(|e| write_err(subject, e))
    }

    /// Applies one entry's batch to `state`, staging its writes; sets `atomic` if
    /// they change dedup records.
    fn apply_batch(
        &self,
        state: &mut RangeState,
        batch: &Batch,
        writes: &mut Vec<KvWrite>,
        atomic: &mut bool,
    ) -> BatchReport {
        let mut report = BatchReport::default();
        let positions = 0..u32::try_from(batch.images.len()).unwrap_or(u32::MAX);
        if batch.range != self.range {
            report.misrouted = positions.end;
            report.refused = positions.collect();
            return report;
        }
        for (at, image) in positions.zip(&batch.images) {
            // Staged before the state changes: a clearing image removes the keys of
            // the records held until now.
            let newer = newer(state.shards.get(&image.shard).map(|s| s.seq), image.seq);
            if newer {
                *atomic |= stage(writes, image, state.dedup.get(&image.shard));
            }
            if newer && state.apply(image) {
                report.applied += 1;
            } else {
                report.stale += 1;
                report.refused.push(at);
            }
        }
        report
    }
}

impl RaftSnapshotBuilder<RangeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<RangeConfig>, StorageError> {
        let (data, last_applied, membership) = {
            let a = self.shared.applied.read();
            (tally_core::codec::encode(&a.state), a.last_applied, a.membership.clone())
        };
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let snapshot_id = match &last_applied {
            Some(l) => format!("{}-{}-{}-{n}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => format!("none-{n}"),
        };
        let meta = SnapshotMeta { last_log_id: last_applied, last_membership: membership, snapshot_id };
        let stored = StoredSnapshot { meta, data };
        self.save_snapshot(&stored).await?;
        Ok(Snapshot { meta: stored.meta, snapshot: Box::new(Cursor::new(stored.data)) })
    }
}

impl RaftStateMachine<RangeConfig> for StateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let a = self.shared.applied.read();
        Ok((a.last_applied, a.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<BatchReport>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        let mut writes = Vec::new();
        let (mut atomic, mut membership) = (false, false);
        // Changed in place under the lock (no await while it is held); if the batch
        // cannot be stored, the state is reloaded so memory never keeps an effect
        // that was not stored.
        let mut guard = self.shared.applied.write();
        for entry in entries {
            guard.last_applied = Some(entry.log_id);
            match entry.payload {
                EntryPayload::Blank => replies.push(BatchReport::default()),
                EntryPayload::Membership(m) => {
                    guard.membership = StoredMembership::new(Some(entry.log_id), m);
                    membership = true;
                    replies.push(BatchReport::default());
                }
                EntryPayload::Normal(batch) => {
                    let report = self.apply_batch(&mut guard.state, &batch, &mut writes, &mut atomic);
                    replies.push(report);
                }
            }
        }
        if replies.is_empty() {
            return Ok(replies);
        }
        stage_position(&mut writes, &guard, membership);
        let stored = if atomic { self.tree.apply(writes) } else { self.tree.write_in_order(writes) };
        if let Err(e) = stored {
            let subject = guard.last_applied.map_or(ErrorSubject::StateMachine, ErrorSubject::Apply);
            if let Ok(stored) = load(&*self.tree) {
                *guard = stored;
            }
            return Err(write_err(subject, e));
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let bytes = data.len() as u64;
        let subject = ErrorSubject::Snapshot(Some(meta.signature()));
        let state: RangeState =
            tally_core::codec::decode("range snapshot", &data).map_err(|e| read_err(subject.clone(), e))?;
        let next =
            Applied { state, last_applied: meta.last_log_id, membership: meta.last_membership.clone() };
        // Replace the whole tree in one atomic batch: remove every key, then write
        // the snapshot's (a later write of the same key wins within a batch).
        let old = self
            .tree
            .scan(std::ops::Bound::Unbounded, std::ops::Bound::Unbounded)
            .map_err(|e| read_err(subject.clone(), e))?;
        let mut writes: Vec<KvWrite> = old.into_iter().map(|(k, _)| (k, None)).collect();
        for (shard, stored) in &next.state.shards {
            writes.push((shard_key(PREFIX_SHARD, shard), Some(tally_core::codec::encode(stored))));
        }
        for (shard, records) in &next.state.dedup {
            for (id, r) in records {
                writes.push((dedup_key(shard, id), Some(tally_core::codec::encode(r))));
            }
        }
        stage_position(&mut writes, &next, true);
        self.tree.apply(writes).map_err(|e| write_err(subject.clone(), e))?;
        self.save_snapshot(&StoredSnapshot { meta: meta.clone(), data }).await?;
        *self.shared.applied.write() = next;
        self.shared.snapshots_installed.fetch_add(1, Ordering::Relaxed);
        self.shared.snapshot_bytes_installed.fetch_add(bytes, Ordering::Relaxed);
        tracing::info!(range = %self.range, snapshot = %meta, "installed range snapshot");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<RangeConfig>>, StorageError> {
        let subject = ErrorSubject::Snapshot(None);
        match self.snapshots.get(KEY_SNAPSHOT).map_err(|e| read_err(subject.clone(), e))? {
            None => Ok(None),
            Some(bytes) => {
                let s: StoredSnapshot =
                    decode_value("range snapshot", &bytes).map_err(|e| read_err(subject, e))?;
                Ok(Some(Snapshot { meta: s.meta, snapshot: Box::new(Cursor::new(s.data)) }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{MemKv, SledKv};
    use tally_core::shard::{ShardImage, ShardWrite};

    fn shard(i: u16) -> ShardId {
        ShardId::new(CounterName::new("likes").unwrap(), 0, i)
    }

    fn image(i: u16, seq: u64, value: i64, put: &[&str], remove: &[&str]) -> ShardEntry {
        ShardEntry {
            shard: shard(i),
            seq,
            write: ShardWrite {
                image: ShardImage { value, ..Default::default() },
                dedup_put: put
                    .iter()
                    .map(|id| ((*id).to_owned(), DedupRecord { delta: value, applied_at_ms: seq }))
                    .collect(),
                dedup_remove: remove.iter().map(|id| (*id).to_owned()).collect(),
            },
            sealed: false,
            clear: false,
        }
    }

    #[test]
    fn replays_and_older_images_change_nothing() {
        let mut s = RangeState::default();
        assert!(s.apply(&image(0, 5, 50, &["e5"], &[])));
        let after5 = s.clone();
        assert!(!s.apply(&image(0, 5, 50, &["e5"], &[])), "the same image again");
        assert!(!s.apply(&image(0, 3, 30, &["e3"], &["e5"])), "an older image");
        assert_eq!(s, after5);
        assert!(s.apply(&image(0, 7, 70, &["e7"], &["e5"])));
        assert_eq!(s.shards[&shard(0)].value_and_seq(), (70, 7));
        assert_eq!(s.dedup[&shard(0)].keys().collect::<Vec<_>>(), ["e7"]);
        assert!(!s.apply(&image(0, 6, 60, &["e6"], &[])));
        assert_eq!(s.shards[&shard(0)].value_and_seq(), (70, 7));
        assert!(!s.dedup[&shard(0)].contains_key("e6"));
    }

    impl StoredShard {
        fn value_and_seq(&self) -> (i64, u64) {
            (self.image.value, self.seq)
        }
    }

    #[test]
    fn keys_round_trip_and_order_by_shard() {
        let s = ShardId::new(CounterName::new("a.b:c-d").unwrap(), 7, 300);
        let key = dedup_key(&s, "ev\u{e9}nt");
        assert_eq!(parse_key(&key), Some((s.clone(), "ev\u{e9}nt".as_bytes())));
        assert_eq!(parse_key(&shard_key(PREFIX_SHARD, &s)), Some((s.clone(), &[][..])));
        // A shard of a counter with its own replica count keeps its class, under a
        // key of its own; one of the cluster's class keys as before classes existed.
        let classed = s.clone().in_class(3);
        assert_eq!(parse_key(&shard_key(PREFIX_SHARD, &classed)), Some((classed.clone(), &[][..])));
        assert_ne!(shard_key(PREFIX_SHARD, &classed), shard_key(PREFIX_SHARD, &s));
        let mut legacy = vec![PREFIX_SHARD];
        legacy.extend_from_slice(b"a.b:c-d");
        legacy.push(NAME_END);
        legacy.extend_from_slice(&7u32.to_be_bytes());
        legacy.extend_from_slice(&300u16.to_be_bytes());
        assert_eq!(shard_key(PREFIX_SHARD, &s), legacy);
        assert_eq!(parse_key(b"s"), None);
        assert_eq!(parse_key(b"sabc"), None);
    }

    /// The same entries applied through the sled and the in-memory store leave the
    /// same state, in memory and as loaded back from each store.
    #[test]
    fn sled_and_memory_state_machines_agree() {
        let dir = tempfile::tempdir().unwrap();
        let sled_kv: Arc<dyn KvStore> = Arc::new(SledKv::new(sled::open(dir.path()).unwrap()));
        let mem_kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let range = RangeId(2);
        let mut batches = Vec::new();
        for round in 0..20u64 {
            let images = (0..4u16)
                .map(|i| {
                    // Sequences go up and down so some images are stale.
                    let seq = (round * 7 + u64::from(i) * 3) % 23;
                    let id = format!("e{round}-{i}");
                    let old = format!("e{}-{i}", round.saturating_sub(2));
                    image(i, seq, (seq as i64) * 10, &[id.as_str()], &[old.as_str()])
                })
                .collect();
            batches.push(Batch { range, images });
        }
        batches.push(Batch { range: RangeId(3), images: vec![image(9, 1, 1, &[], &[])] });
        let run = |kv: Arc<dyn KvStore>| {
            let mut sm = StateMachine::open(range, kv.clone(), "r2/").unwrap();
            let entries: Vec<Entry> = batches
                .iter()
                .enumerate()
                .map(|(i, b)| Entry {
                    log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), i as u64 + 1),
                    payload: EntryPayload::Normal(b.clone()),
                })
                .collect();
            let reports = futures::executor::block_on(sm.apply(entries)).unwrap();
            let reloaded = StateMachine::open(range, kv, "r2/").unwrap();
            (reports, sm.shared().state(), reloaded.shared().state(), reloaded.shared().last_applied())
        };
        let (a, b) = (run(sled_kv), run(mem_kv));
        assert_eq!(a, b);
        let (reports, state, reloaded, last) = a;
        assert_eq!(state, reloaded, "what was stored loads back the same");
        assert_eq!(last.map(|l| l.index), Some(batches.len() as u64));
        assert!(reports.iter().any(|r| r.stale > 0) && reports.iter().any(|r| r.applied > 0));
        assert_eq!(reports.last().unwrap().misrouted, 1);
        assert!(!state.shards.contains_key(&shard(9)));
    }

    /// An apply cut short by a crash at any point, then replayed from its entries
    /// (what openraft does after a restart), ends in the state of one that was not:
    /// for images alone (written key by key) and with dedup records (one batch).
    #[test]
    fn a_crash_at_any_point_of_an_apply_then_a_replay_ends_in_the_same_state() {
        let range = RangeId(4);
        let entry = |index: u64, images: Vec<ShardEntry>| Entry {
            log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(Batch { range, images }),
        };
        let plain = |i: u16, seq: u64| image(i, seq, seq as i64, &[], &[]);
        let first = vec![entry(1, vec![plain(0, 1), plain(1, 1), image(2, 1, 1, &["a"], &[])])];
        let cases = [
            vec![entry(2, vec![plain(0, 2), plain(1, 2)]), entry(3, vec![plain(0, 3), plain(3, 1)])],
            vec![entry(2, vec![plain(0, 2), image(2, 2, 2, &["b"], &["a"])]), entry(3, vec![plain(1, 3)])],
        ];
        for later in cases {
            let kv = MemKv::new();
            let mut sm = StateMachine::open(range, Arc::new(kv.clone()), "r4/").unwrap();
            futures::executor::block_on(sm.apply(first.clone())).unwrap();
            futures::executor::block_on(kv.flush()).unwrap();
            futures::executor::block_on(sm.apply(later.clone())).unwrap();
            let (want, want_applied) = (sm.shared().state(), sm.shared().last_applied());
            let units = kv.pending_units();
            assert!(units >= 1);
            for keep in 0..=units {
                let after = kv.clone().restart_keeping(keep);
                let mut sm = StateMachine::open(range, Arc::new(after.clone()), "r4/").unwrap();
                let applied = sm.shared().last_applied().map_or(0, |l| l.index);
                let replay: Vec<Entry> = later.iter().filter(|e| e.log_id.index > applied).cloned().collect();
                futures::executor::block_on(sm.apply(replay)).unwrap();
                assert_eq!(sm.shared().state(), want, "kept {keep} of {units} units");
                assert_eq!(sm.shared().last_applied(), want_applied);
                let reloaded = StateMachine::open(range, Arc::new(after), "r4/").unwrap();
                assert_eq!(reloaded.shared().state(), want, "stored after the replay");
            }
        }
    }
}
