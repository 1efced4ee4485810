//! A range group's state machine: every shard image of the range, with its dedup
//! records, in one tree of the node's [`KvStore`] (on disk in production, behind
//! sled's bounded page cache), and its snapshots. Nothing per shard or per event
//! id is held in memory: an apply reads the stored sequence of each shard it
//! touches, a read of a shard reads its image, a dedup lookup reads one record.
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
//! An image that clears its shard's records (a deletion) first stores what the
//! call applied before it, then removes the records a page at a time, then goes
//! on: a crash in between leaves fewer records under the older image, and the
//! replay clears the rest.
//!
//! # The apply rule
//!
//! An image replaces the shard's stored one only if its sequence is higher; its
//! dedup changes are applied with it, or not at all. Entries carry absolute state,
//! never deltas, so replaying an entry, or an older image after a newer one, leaves
//! the state as it was. Both are asserted, in production too: the applied log id
//! only grows, and no stored sequence ever goes down.
//!
//! # Snapshots
//!
//! Building a snapshot stores only its meta (the applied log id and membership),
//! after a flush that makes the state tree durable up to it: the log behind it
//! may then be purged. Its data is the live state tree, streamed when a replica
//! needs it ([`crate::snapshot`]: a fuzzy snapshot that the log after its log id
//! makes exact). A received snapshot is staged in the next *generation* of the
//! state tree (`<prefix>sm`, then `<prefix>sm.1`, …) and installed by pointing the
//! range at it (`active` in `<prefix>snap`, written with the snapshot's meta in one
//! batch after the staged tree was flushed), then dropping the old tree: a crash
//! leaves either the old state or the new one, and a tree left over by a crash is
//! dropped when the range opens again.

// openraft's `StorageError` is large and its storage traits return it.
#![allow(clippy::result_large_err)]

use crate::log_store::{read_err, write_err};
use crate::snapshot::{RangeSnapshot, Side, SnapshotSink, SnapshotSource, PREFIX_DEDUP, PREFIX_SHARD};
use crate::storage::{prefix_bound, KvError, KvStore, KvTree, KvWrite};
use crate::types::{
    Batch, BatchReport, Entry, LogId, RangeConfig, ShardEntry, SnapshotMeta, StorageError, StoredMembership,
    StoredShard,
};
use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, ErrorSubject, OptionalSend, RaftSnapshotBuilder, Snapshot};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tally_core::dedup::DedupRecord;
use tally_core::name::CounterName;
use tally_core::ranges::RangeId;
use tally_core::ShardId;

const KEY_APPLIED: &[u8] = b"~applied";
const KEY_MEMBERSHIP: &[u8] = b"~membership";
/// In the snapshot tree: the meta of the last snapshot built or installed.
const KEY_META: &[u8] = b"meta";
/// In the snapshot tree: the generation of the state tree in use.
const KEY_ACTIVE: &[u8] = b"active";
/// In the snapshot tree, written by releases that stored a snapshot as one value
/// (its meta, then the whole state): read once for its meta, then removed.
const KEY_LEGACY_SNAPSHOT: &[u8] = b"current";
const NAME_END: u8 = 0xff;

/// Most dedup records removed in one write when an image clears its shard.
pub const CLEAR_PAGE_RECORDS_MAX: usize = 4_096;

/// Every shard of a range, as one value: what [`Shared::state`] copies out for
/// tests and tools (never the serving path, which reads the tree).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeState {
    /// The shards' images.
    pub shards: BTreeMap<ShardId, StoredShard>,
    /// The shards' dedup records, by event id.
    pub dedup: BTreeMap<ShardId, BTreeMap<String, DedupRecord>>,
}

/// Whether an image of sequence `seq` replaces a stored one of sequence `stored`.
fn newer(stored: Option<u64>, seq: u64) -> bool {
    if planted_overwrite() {
        return true;
    }
    stored.is_none_or(|s| s < seq)
}

/// Whether the planted bug that lets an older image overwrite a newer one is on
/// (the sequence assertions stand aside for it: the simulator must catch it).
fn planted_overwrite() -> bool {
    #[cfg(feature = "planted-bugs")]
    if tally_core::planted::active(tally_core::planted::Bug::TwoLeadersAck) {
        return true;
    }
    false
}

impl RangeState {
    /// Applies one image by the rule of the module docs; true if it replaced the
    /// stored one (the model the stored state machine is checked against).
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

/// Where the state machine stands: the last entry applied and the last
/// membership, the only state it keeps in memory.
#[derive(Debug, Clone, Default)]
pub struct Position {
    /// The last log entry applied.
    pub last_applied: Option<LogId>,
    /// The last membership applied.
    pub membership: StoredMembership,
}

/// Why the range's state could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The store failed.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A stored value did not decode.
    #[error(transparent)]
    Decode(#[from] tally_core::codec::DecodeError),
    /// A key of the state tree is not one the state machine writes.
    #[error("undecodable key in a range state machine: {0:?}")]
    BadKey(Vec<u8>),
    /// The replica installed a snapshot since this read began: its tree is gone.
    #[error("the range's state tree was replaced by an installed snapshot")]
    Replaced,
}

/// The state tree in use and its generation.
struct Active {
    generation: u64,
    tree: Arc<dyn KvTree>,
}

/// What the state machine shares with readers: the state tree in use, the
/// position, and counters.
pub struct Shared {
    active: RwLock<Active>,
    position: RwLock<Position>,
    snapshots_installed: AtomicU64,
    snapshot_bytes_installed: AtomicU64,
    log_bytes_caught_up: AtomicU64,
}

impl Shared {
    /// Runs `f` on the state tree in use (held, so no install drops it meanwhile).
    fn read<T>(&self, f: impl FnOnce(&dyn KvTree) -> Result<T, StateError>) -> Result<T, StateError> {
        f(&*self.active.read().tree)
    }

    /// Runs `f` on the state tree if it is still generation `generation`.
    pub(crate) fn read_generation<T>(
        &self,
        generation: u64,
        f: impl FnOnce(&dyn KvTree) -> T,
    ) -> Result<T, StateError> {
        let active = self.active.read();
        if active.generation != generation {
            return Err(StateError::Replaced);
        }
        Ok(f(&*active.tree))
    }

    /// One shard's image as applied here (`None`: never written).
    pub fn shard(&self, shard: &ShardId) -> Result<Option<StoredShard>, StateError> {
        self.read(|t| match t.get(&shard_key(PREFIX_SHARD, shard))? {
            Some(bytes) => Ok(Some(decode_value("stored shard", &bytes)?)),
            None => Ok(None),
        })
    }

    /// One dedup record of a shard, as applied here.
    pub fn dedup_get(&self, shard: &ShardId, event_id: &str) -> Result<Option<DedupRecord>, StateError> {
        self.read(|t| match t.get(&dedup_key(shard, event_id))? {
            Some(bytes) => Ok(Some(decode_value("dedup record", &bytes)?)),
            None => Ok(None),
        })
    }

    /// Up to `limit` dedup records of a shard in event-id order, after `after`.
    pub fn dedup_scan(
        &self,
        shard: &ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, DedupRecord)>, StateError> {
        let prefix = shard_key(PREFIX_DEDUP, shard);
        let from = after.map_or(Bound::Included(prefix.clone()), |a| Bound::Excluded(dedup_key(shard, a)));
        let page = self.read(|t| Ok(t.scan_page(from, prefix_bound(&prefix), limit, usize::MAX)?))?;
        page.into_iter()
            .map(|(k, v)| {
                let id =
                    std::str::from_utf8(&k[prefix.len()..]).map_err(|_| StateError::BadKey(k.clone()))?;
                Ok((id.to_owned(), decode_value("dedup record", &v)?))
            })
            .collect()
    }

    /// Up to `limit` ids of the shards held, in key order, after `after`.
    pub fn shard_ids(&self, after: Option<&ShardId>, limit: usize) -> Result<Vec<ShardId>, StateError> {
        let from = after
            .map_or(Bound::Included(vec![PREFIX_SHARD]), |a| Bound::Excluded(shard_key(PREFIX_SHARD, a)));
        let page =
            self.read(|t| Ok(t.scan_page(from, prefix_bound(&[PREFIX_SHARD]), limit, usize::MAX)?))?;
        page.into_iter().map(|(k, _)| parse_key(&k).map(|(id, _)| id).ok_or(StateError::BadKey(k))).collect()
    }

    /// A copy of the whole applied state: every image and record of the range in
    /// memory at once, for tests and tools only.
    pub fn state(&self) -> Result<RangeState, StateError> {
        let mut state = RangeState::default();
        let pairs = self.read(|t| Ok(t.scan(Bound::Unbounded, Bound::Unbounded)?))?;
        for (key, value) in pairs {
            if !crate::snapshot::is_shard_data(&key) {
                continue;
            }
            let (shard, rest) = parse_key(&key).ok_or_else(|| StateError::BadKey(key.clone()))?;
            if key[0] == PREFIX_SHARD {
                state.shards.insert(shard, decode_value("stored shard", &value)?);
            } else {
                let id = std::str::from_utf8(rest).map_err(|_| StateError::BadKey(key.clone()))?.to_owned();
                state.dedup.entry(shard).or_default().insert(id, decode_value("dedup record", &value)?);
            }
        }
        Ok(state)
    }

    /// The last applied log id.
    pub fn last_applied(&self) -> Option<LogId> {
        self.position.read().last_applied
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

/// The state machine of one group. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct StateMachine {
    range: RangeId,
    kv: Arc<dyn KvStore>,
    prefix: String,
    /// Snapshot meta and the generation of the state tree in use.
    snapshots: Arc<dyn KvTree>,
    shared: Arc<Shared>,
    seq: Arc<AtomicU64>,
    /// Bytes of pairs per frame of a snapshot read as a byte stream.
    chunk_bytes: usize,
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

/// The stored sequence of a shard image: the first field of its [`StoredShard`],
/// decoded without the image behind it.
fn stored_seq(bytes: &[u8]) -> Result<u64, StorageError> {
    tally_core::codec::decode_prefix::<u64>("stored shard sequence", bytes)
        .map(|(seq, _)| seq)
        .map_err(|e| read_err(ErrorSubject::StateMachine, e))
}

fn dedup_key(shard: &ShardId, id: &str) -> Vec<u8> {
    let mut key = shard_key(PREFIX_DEDUP, shard);
    key.extend_from_slice(id.as_bytes());
    key
}

/// The name of generation `generation` of a range's state tree.
fn state_tree(prefix: &str, generation: u64) -> String {
    match generation {
        0 => format!("{prefix}sm"),
        g => format!("{prefix}sm.{g}"),
    }
}

/// The writes that store `entry` (already judged newer, its clearing done). True
/// if they change dedup records, so must be atomic with the image.
fn stage(batch: &mut Vec<KvWrite>, entry: &ShardEntry) -> bool {
    let stored = StoredShard { seq: entry.seq, image: entry.write.image.clone(), sealed: entry.sealed };
    batch.push((shard_key(PREFIX_SHARD, &entry.shard), Some(tally_core::codec::encode(&stored))));
    for id in &entry.write.dedup_remove {
        batch.push((dedup_key(&entry.shard, id), None));
    }
    for (id, r) in &entry.write.dedup_put {
        batch.push((dedup_key(&entry.shard, id), Some(tally_core::codec::encode(r))));
    }
    !(entry.write.dedup_remove.is_empty() && entry.write.dedup_put.is_empty())
}

/// The apply position: the membership (only if `membership` changed), then the
/// last applied log id, last of all.
fn stage_position(batch: &mut Vec<KvWrite>, position: &Position, membership: bool) {
    if membership {
        batch.push((KEY_MEMBERSHIP.to_vec(), Some(tally_core::codec::encode(&position.membership))));
    }
    batch.push((KEY_APPLIED.to_vec(), Some(tally_core::codec::encode(&position.last_applied))));
}

/// The writes of one `apply` call not yet stored.
#[derive(Default)]
struct Pending {
    writes: Vec<KvWrite>,
    /// Whether they change dedup records (then they are one atomic batch).
    atomic: bool,
    /// Whether the membership changed.
    membership: bool,
}

impl Pending {
    /// Stores the writes, then `position`.
    fn store(&mut self, tree: &dyn KvTree, position: &Position) -> Result<(), KvError> {
        let mut writes = std::mem::take(&mut self.writes);
        stage_position(&mut writes, position, self.membership);
        let atomic = std::mem::take(&mut self.atomic);
        self.membership = false;
        if atomic {
            tree.apply(writes)
        } else {
            tree.write_in_order(writes)
        }
    }
}

/// Removes every dedup record of `shard`, a page at a time.
fn clear_records(tree: &dyn KvTree, shard: &ShardId) -> Result<(), KvError> {
    let prefix = shard_key(PREFIX_DEDUP, shard);
    loop {
        let page = tree.scan_page(
            Bound::Included(prefix.clone()),
            prefix_bound(&prefix),
            CLEAR_PAGE_RECORDS_MAX,
            usize::MAX,
        )?;
        if page.is_empty() {
            return Ok(());
        }
        tree.apply(page.into_iter().map(|(k, _)| (k, None)).collect())?;
    }
}

fn load_position(tree: &dyn KvTree) -> Result<Position, StorageError> {
    let get = |key| tree.get(key).map_err(|e| read_err(ErrorSubject::StateMachine, e));
    let mut position = Position::default();
    if let Some(bytes) = get(KEY_APPLIED)? {
        position.last_applied = decode("last applied log id", &bytes)?;
    }
    if let Some(bytes) = get(KEY_MEMBERSHIP)? {
        position.membership = decode("range membership", &bytes)?;
    }
    Ok(position)
}

impl StateMachine {
    /// Opens the trees `<prefix>sm…` and `<prefix>snap` of range `range`: the
    /// state tree the snapshot tree names, whose apply position it loads; a
    /// staged or replaced tree left by a crash is dropped.
    pub fn open(range: RangeId, kv: Arc<dyn KvStore>, prefix: &str) -> Result<Self, StorageError> {
        let err = |e: KvError| read_err(ErrorSubject::StateMachine, e);
        let snapshots = kv.tree(&format!("{prefix}snap")).map_err(err)?;
        if let Some(legacy) = snapshots.get(KEY_LEGACY_SNAPSHOT).map_err(err)? {
            // The meta leads the old one-value snapshot; the state tree holds the rest.
            let (meta, _) = tally_core::codec::decode_prefix::<SnapshotMeta>("range snapshot meta", &legacy)
                .map_err(|e| read_err(ErrorSubject::Snapshot(None), e))?;
            snapshots
                .apply(vec![
                    (KEY_META.to_vec(), Some(tally_core::codec::encode(&meta))),
                    (KEY_LEGACY_SNAPSHOT.to_vec(), None),
                ])
                .map_err(err)?;
        }
        let generation = match snapshots.get(KEY_ACTIVE).map_err(err)? {
            Some(bytes) => u64::from_be_bytes(
                bytes
                    .as_slice()
                    .try_into()
                    .map_err(|_| err(KvError::Sled("corrupt state tree generation".into())))?,
            ),
            None => 0,
        };
        kv.drop_tree(&state_tree(prefix, generation + 1)).map_err(err)?;
        if generation > 0 {
            kv.drop_tree(&state_tree(prefix, generation - 1)).map_err(err)?;
        }
        let tree = kv.tree(&state_tree(prefix, generation)).map_err(err)?;
        let position = load_position(&*tree)?;
        let shared = Arc::new(Shared {
            active: RwLock::new(Active { generation, tree }),
            position: RwLock::new(position),
            snapshots_installed: AtomicU64::new(0),
            snapshot_bytes_installed: AtomicU64::new(0),
            log_bytes_caught_up: AtomicU64::new(0),
        });
        Ok(Self {
            range,
            kv,
            prefix: prefix.to_owned(),
            snapshots,
            shared,
            seq: Arc::new(AtomicU64::new(0)),
            chunk_bytes: crate::types::SNAPSHOT_CHUNK_BYTES as usize,
        })
    }

    /// What readers share.
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// The meta of the last snapshot built or installed.
    fn stored_meta(&self) -> Result<Option<SnapshotMeta>, StorageError> {
        let subject = || ErrorSubject::Snapshot(None);
        match self.snapshots.get(KEY_META).map_err(|e| read_err(subject(), e))? {
            None => Ok(None),
            Some(bytes) => {
                decode_value("range snapshot meta", &bytes).map(Some).map_err(|e| read_err(subject(), e))
            }
        }
    }

    /// The snapshot of `meta` as a stream from the state tree in use.
    fn source(&self, meta: SnapshotMeta) -> Snapshot<RangeConfig> {
        let generation = self.shared.active.read().generation;
        let source = SnapshotSource::new(self.shared.clone(), generation, self.chunk_bytes);
        Snapshot { meta, snapshot: Box::new(RangeSnapshot(Side::Source(source))) }
    }

    /// Applies one entry's batch, staging its writes in `pending`; `seqs` holds
    /// the sequences this call stored or staged so far.
    fn apply_batch(
        &self,
        tree: &dyn KvTree,
        batch: &Batch,
        seqs: &mut HashMap<ShardId, u64>,
        pending: &mut Pending,
        before: &Position,
    ) -> Result<BatchReport, StorageError> {
        let mut report = BatchReport::default();
        let positions = 0..u32::try_from(batch.images.len()).unwrap_or(u32::MAX);
        if batch.range != self.range {
            report.misrouted = positions.end;
            report.refused = positions.collect();
            return Ok(report);
        }
        for (at, image) in positions.zip(&batch.images) {
            let stored = match seqs.get(&image.shard) {
                Some(seq) => Some(*seq),
                None => match tree.get(&shard_key(PREFIX_SHARD, &image.shard)) {
                    Ok(Some(bytes)) => Some(stored_seq(&bytes)?),
                    Ok(None) => None,
                    Err(e) => return Err(read_err(ErrorSubject::StateMachine, e)),
                },
            };
            if !newer(stored, image.seq) {
                report.stale += 1;
                report.refused.push(at);
                continue;
            }
            assert!(
                planted_overwrite() || stored.is_none_or(|s| s < image.seq),
                "{}: image sequence {} would replace {stored:?}",
                image.shard,
                image.seq
            );
            if image.clear {
                // What this call applied so far is stored first, so the records
                // removed are all the shard held before this image.
                let write = |e| write_err(ErrorSubject::StateMachine, e);
                pending.store(tree, before).map_err(write)?;
                clear_records(tree, &image.shard).map_err(write)?;
            }
            pending.atomic |= stage(&mut pending.writes, image);
            seqs.insert(image.shard.clone(), image.seq);
            report.applied += 1;
        }
        Ok(report)
    }
}

impl RaftSnapshotBuilder<RangeConfig> for StateMachine {
    /// Records the position applied now as the snapshot's, once the state tree is
    /// durable up to it; the data is streamed from the tree when it is sent.
    async fn build_snapshot(&mut self) -> Result<Snapshot<RangeConfig>, StorageError> {
        let Position { last_applied, membership } = self.shared.position.read().clone();
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let snapshot_id = match &last_applied {
            Some(l) => format!("{}-{}-{}-{n}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => format!("none-{n}"),
        };
        let meta = SnapshotMeta { last_log_id: last_applied, last_membership: membership, snapshot_id };
        let subject = ErrorSubject::Snapshot(Some(meta.signature()));
        self.snapshots
            .apply(vec![(KEY_META.to_vec(), Some(tally_core::codec::encode(&meta)))])
            .map_err(|e| write_err(subject.clone(), e))?;
        // One flush covers the state tree up to the position read above and the meta.
        self.kv.flush().await.map_err(|e| write_err(subject, e))?;
        Ok(self.source(meta))
    }
}

impl RaftStateMachine<RangeConfig> for StateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let p = self.shared.position.read().clone();
        Ok((p.last_applied, p.membership))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<BatchReport>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        // openraft runs apply and install one at a time: the tree stays the same.
        let tree = self.shared.active.read().tree.clone();
        let mut position = self.shared.position.read().clone();
        let mut replies = Vec::new();
        let mut pending = Pending::default();
        let mut seqs = HashMap::new();
        for entry in entries {
            assert!(
                Some(entry.log_id) > position.last_applied,
                "{}: entry {} applied after {:?}",
                self.range,
                entry.log_id,
                position.last_applied
            );
            let before = position.clone();
            position.last_applied = Some(entry.log_id);
            match entry.payload {
                EntryPayload::Blank => replies.push(BatchReport::default()),
                EntryPayload::Membership(m) => {
                    position.membership = StoredMembership::new(Some(entry.log_id), m);
                    pending.membership = true;
                    replies.push(BatchReport::default());
                }
                EntryPayload::Normal(batch) => {
                    replies.push(self.apply_batch(&*tree, &batch, &mut seqs, &mut pending, &before)?);
                }
            }
        }
        if replies.is_empty() {
            return Ok(replies);
        }
        pending.store(&*tree, &position).map_err(|e| {
            let subject = position.last_applied.map_or(ErrorSubject::StateMachine, ErrorSubject::Apply);
            write_err(subject, e)
        })?;
        let mut shared = self.shared.position.write();
        assert!(position.last_applied > shared.last_applied, "{}: the applied log id went back", self.range);
        *shared = position;
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<RangeSnapshot>, StorageError> {
        let next = self.shared.active.read().generation + 1;
        let sink = SnapshotSink::new(self.kv.clone(), state_tree(&self.prefix, next), next)
            .map_err(|e| write_err(ErrorSubject::Snapshot(None), e))?;
        Ok(Box::new(RangeSnapshot(Side::Sink(sink))))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<RangeSnapshot>,
    ) -> Result<(), StorageError> {
        let subject = ErrorSubject::Snapshot(Some(meta.signature()));
        let write = |e: KvError| write_err(subject.clone(), e);
        let Some(sink) = snapshot.into_sink() else {
            let e = std::io::Error::other("a snapshot to install must be one received");
            return Err(write_err(subject.clone(), e));
        };
        if !sink.complete {
            let e = std::io::Error::other("the snapshot's last frame was not received");
            return Err(write_err(subject.clone(), e));
        }
        let position = Position { last_applied: meta.last_log_id, membership: meta.last_membership.clone() };
        let mut writes = Vec::new();
        stage_position(&mut writes, &position, true);
        sink.tree.apply(writes).map_err(write)?;
        // The staged tree is durable before the range points at it.
        sink.kv().flush().await.map_err(write)?;
        self.snapshots
            .apply(vec![
                (KEY_ACTIVE.to_vec(), Some(sink.generation.to_be_bytes().to_vec())),
                (KEY_META.to_vec(), Some(tally_core::codec::encode(meta))),
            ])
            .map_err(write)?;
        self.kv.flush().await.map_err(write)?;
        let old = {
            let mut active = self.shared.active.write();
            let old = std::mem::replace(
                &mut *active,
                Active { generation: sink.generation, tree: sink.tree.clone() },
            );
            *self.shared.position.write() = position;
            // Dropped under the lock: no reader holds the old tree any more.
            self.kv.drop_tree(&state_tree(&self.prefix, old.generation)).map_err(write)?;
            old.generation
        };
        self.shared.snapshots_installed.fetch_add(1, Ordering::Relaxed);
        self.shared.snapshot_bytes_installed.fetch_add(sink.bytes, Ordering::Relaxed);
        tracing::info!(range = %self.range, snapshot = %meta, replaced = old, generation = sink.generation, bytes = sink.bytes, "installed range snapshot");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<RangeConfig>>, StorageError> {
        Ok(self.stored_meta()?.map(|meta| self.source(meta)))
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
            (
                reports,
                sm.shared().state().unwrap(),
                reloaded.shared().state().unwrap(),
                reloaded.shared().last_applied(),
            )
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
            // A deletion in the middle of a call: what came before it is stored,
            // then its records removed, then the rest.
            vec![
                entry(2, vec![image(2, 2, 2, &["b", "c"], &[]), plain(0, 2)]),
                entry(3, vec![plain(1, 3), cleared(2, 3, &["d"]), plain(0, 3)]),
                entry(4, vec![image(2, 4, 4, &["e"], &["d"])]),
            ],
        ];
        fn cleared(i: u16, seq: u64, put: &[&str]) -> ShardEntry {
            ShardEntry { clear: true, ..image(i, seq, 0, put, &[]) }
        }
        for later in cases {
            let kv = MemKv::new();
            let mut sm = StateMachine::open(range, Arc::new(kv.clone()), "r4/").unwrap();
            futures::executor::block_on(sm.apply(first.clone())).unwrap();
            futures::executor::block_on(kv.flush()).unwrap();
            futures::executor::block_on(sm.apply(later.clone())).unwrap();
            let (want, want_applied) = (sm.shared().state().unwrap(), sm.shared().last_applied());
            let units = kv.pending_units();
            assert!(units >= 1);
            for keep in 0..=units {
                let after = kv.clone().restart_keeping(keep);
                let mut sm = StateMachine::open(range, Arc::new(after.clone()), "r4/").unwrap();
                let applied = sm.shared().last_applied().map_or(0, |l| l.index);
                let replay: Vec<Entry> = later.iter().filter(|e| e.log_id.index > applied).cloned().collect();
                futures::executor::block_on(sm.apply(replay)).unwrap();
                assert_eq!(sm.shared().state().unwrap(), want, "kept {keep} of {units} units");
                assert_eq!(sm.shared().last_applied(), want_applied);
                let reloaded = StateMachine::open(range, Arc::new(after), "r4/").unwrap();
                assert_eq!(reloaded.shared().state().unwrap(), want, "stored after the replay");
            }
        }
    }

    /// Entries of a range's life: four shards, images whose sequences go up (and
    /// some stale ones), records put and removed, and now and then a deletion
    /// that clears a shard's records.
    fn history(range: RangeId, entries: u64) -> Vec<Entry> {
        (1..=entries)
            .map(|index| {
                let images = (0..4u16)
                    .map(|i| {
                        let seq = index * 2 + u64::from(i % 2);
                        let put = [format!("e{index}-{i}"), format!("f{index}-{i}")];
                        let gone = format!("e{}-{i}", index.saturating_sub(3));
                        let puts: Vec<&str> = put.iter().map(String::as_str).collect();
                        let mut e = image(i, seq, seq as i64, &puts, &[gone.as_str()]);
                        e.clear = index % 7 == 0 && i == 1;
                        if index % 5 == 0 && i == 2 {
                            e.seq = 1; // stale: refused
                        }
                        e
                    })
                    .collect();
                Entry {
                    log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
                    payload: EntryPayload::Normal(Batch { range, images }),
                }
            })
            .collect()
    }

    /// The state machine's stored state equals the model's after the same
    /// entries, deletions included.
    #[test]
    fn the_stored_state_is_the_models() {
        let range = RangeId(1);
        let mut sm = StateMachine::open(range, Arc::new(MemKv::new()), "r1/").unwrap();
        let mut model = RangeState::default();
        for e in history(range, 30) {
            if let EntryPayload::Normal(b) = &e.payload {
                for i in &b.images {
                    model.apply(i);
                }
            }
            futures::executor::block_on(sm.apply([e])).unwrap();
        }
        assert_eq!(sm.shared().state().unwrap(), model);
        let s = shard(3);
        let first = sm.shared().dedup_scan(&s, None, 2).unwrap();
        assert_eq!(first.len(), 2);
        let rest = sm.shared().dedup_scan(&s, Some(&first[1].0), usize::MAX).unwrap();
        let all: Vec<String> = first.iter().chain(&rest).map(|(id, _)| id.clone()).collect();
        assert_eq!(all, model.dedup[&s].keys().cloned().collect::<Vec<_>>());
        assert_eq!(sm.shared().dedup_get(&s, &all[0]).unwrap(), Some(model.dedup[&s][&all[0]]));
        assert_eq!(sm.shared().shard_ids(None, 10).unwrap().len(), 4);
    }

    /// A snapshot streamed from a tree that keeps applying entries between its
    /// frames, with a frame sent twice and the stream resumed from an earlier
    /// frame, installed as the state at its log id and followed by the log after
    /// it, ends in exactly the sender's state (the fuzzy snapshot of
    /// `crate::snapshot`), in sled as in memory.
    #[test]
    fn a_fuzzy_snapshot_followed_by_the_log_after_it_is_exact() {
        let dir = tempfile::tempdir().unwrap();
        let range = RangeId(2);
        let entries = history(range, 40);
        for kv in [Arc::new(MemKv::new()) as Arc<dyn KvStore>, Arc::new(SledKv::open(dir.path()).unwrap())] {
            let mut a = StateMachine::open(range, Arc::new(MemKv::new()), "a/").unwrap();
            futures::executor::block_on(a.apply(entries[..15].to_vec())).unwrap();
            let snapshot = futures::executor::block_on(a.build_snapshot()).unwrap();
            let meta = snapshot.meta.clone();
            let source = snapshot.snapshot.into_source().unwrap();
            let mut b = StateMachine::open(range, kv, "b/").unwrap();
            let mut sink =
                futures::executor::block_on(b.begin_receiving_snapshot()).unwrap().into_sink().unwrap();
            let (mut after, mut next, mut frames) = (None, 15, Vec::new());
            loop {
                let mut frame = source.frame(after.clone(), 48).unwrap();
                frames.push(frame.clone());
                sink.stage(frame.clone()).unwrap();
                if frames.len() == 3 {
                    sink.stage(frame.clone()).unwrap(); // its answer was lost
                }
                if frames.len() == 6 {
                    // Resumed from frame 4: a new read of what follows it.
                    frame = source.frame(frames[3].end(), 48).unwrap();
                    sink.stage(frame.clone()).unwrap();
                }
                if next < entries.len() {
                    futures::executor::block_on(a.apply([entries[next].clone()])).unwrap();
                    next += 1;
                }
                if frame.last {
                    break;
                }
                after = frame.end();
            }
            assert!(frames.len() > 10, "{} frames", frames.len());
            futures::executor::block_on(a.apply(entries[next..].to_vec())).unwrap();
            let sink = RangeSnapshot(Side::Sink(sink));
            futures::executor::block_on(b.install_snapshot(&meta, Box::new(sink))).unwrap();
            assert_eq!(b.shared().last_applied(), meta.last_log_id);
            futures::executor::block_on(b.apply(entries[15..].to_vec())).unwrap();
            assert_eq!(b.shared().state().unwrap(), a.shared().state().unwrap());
            assert_eq!(b.shared().last_applied(), a.shared().last_applied());
        }
    }
}
