//! The replicated state machine, persisted in sled, and its snapshots.
//!
//! # Layout
//!
//! * tree [`SM_TREE`] holds the whole state, one key per item, and the apply
//!   position — all in ONE tree, so that every `apply` call commits the items it
//!   changed together with `last_applied` and the last membership in one atomic
//!   `apply_batch`. A restart therefore never re-applies an entry whose effect is
//!   already stored, nor loses an effect whose entry counts as applied.
//!   * `c/<name>` → `CounterMeta`, `t/<name>` → tombstone generations,
//!     `a/<name>` → the auto bounds of a counter whose shard count follows contention,
//!   * `members` → `(members, placement_epoch, previous, handoff)`, `requests` → applied-request count,
//!   * `stores` → every raft node's store record (raft id → incarnation, data lost),
//!   * `p/<proposer>` → the answers of the proposer's latest proposals (the
//!     proposal book, [`crate::state::Proposer`]),
//!   * `applied` → `Option<LogId>`, `membership` → `StoredMembership`.
//! * tree [`SNAPSHOT_TREE`]: `current` → the last built or installed snapshot (its
//!   meta and the encoded [`MetaState`]), `seq` → a counter that makes snapshot ids
//!   unique.
//!
//! Values are encoded by `tally_core::codec`. `apply` does not flush: sled recovers a
//! prefix of its writes, so after a crash the state is that of some earlier apply
//! with its own `last_applied`, and openraft re-applies the rest from the (flushed)
//! log. Snapshots are flushed before they are reported built or installed, because
//! openraft purges the log behind them.
//!
//! A copy of the state lives in memory ([`Shared`]) so the data plane reads it
//! without touching sled; it is updated under a write lock together with the sled
//! batch (and reloaded from sled if the batch fails).

// openraft's `StorageError` is large (224 bytes) and its storage traits return it;
// the helpers here return the same type rather than boxing and unboxing it.
#![allow(clippy::result_large_err)]

use crate::state::{MetaState, Touched};
use crate::types::{
    Entry, LogId, MetaChange, NodeId, Response, SnapshotMeta, StorageError, StoredMembership, TypeConfig,
};
use openraft::storage::RaftStateMachine;
use openraft::{
    EntryPayload, ErrorSubject, ErrorVerb, OptionalSend, RaftSnapshotBuilder, Snapshot, StorageIOError,
};
use serde::{Deserialize, Serialize};
use std::io::Cursor;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tally_core::meta::CounterMeta;
use tally_core::name::CounterName;
use tokio::sync::broadcast;

/// Name of the sled tree holding the state machine.
pub const SM_TREE: &str = "raft_sm";
/// Name of the sled tree holding the current snapshot.
pub const SNAPSHOT_TREE: &str = "raft_snapshot";

/// How many unread changes a subscriber may fall behind before it sees
/// `RecvError::Lagged` (and must refresh everything).
pub const CHANGES_BUFFERED_MAX: usize = 4096;

const KEY_APPLIED: &[u8] = b"applied";
const KEY_MEMBERSHIP: &[u8] = b"membership";
const KEY_MEMBERS: &[u8] = b"members";
const KEY_REQUESTS: &[u8] = b"requests";
const KEY_STORES: &[u8] = b"stores";
const KEY_CLASSES: &[u8] = b"classes";
const KEY_FORMATIONS: &[u8] = b"formations";
pub(crate) const PREFIX_COUNTER: &[u8] = b"c/";
const PREFIX_TOMBSTONE: &[u8] = b"t/";
const PREFIX_AUTO: &[u8] = b"a/";
/// `n/<prefix>` → the namespace of that prefix.
const PREFIX_NAMESPACE: &[u8] = b"n/";
/// `p/<proposer, 16 bytes big-endian>` → that proposer's entry in the proposal book
/// ([`BookEntry`]; format 9 kept the whole [`crate::state::Proposer`] there, answers
/// and all, and rewrote it at every proposal).
pub(crate) const PREFIX_PROPOSER: &[u8] = b"p/";
/// `q/<proposer, 16 bytes><number, 8 bytes>`, both big-endian → one answer of the
/// proposal book, so a proposal writes its own answer and not its proposer's book.
pub(crate) const PREFIX_ANSWER: &[u8] = b"q/";

/// A proposer's entry in the proposal book as stored, without its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BookEntry {
    /// [`crate::state::Proposer::forgotten_below`].
    pub(crate) forgotten_below: u64,
    /// [`crate::state::Proposer::heard_at`].
    pub(crate) heard_at: u64,
}

impl BookEntry {
    /// What `p`'s record holds.
    fn of(p: &crate::state::Proposer) -> Self {
        Self { forgotten_below: p.forgotten_below, heard_at: p.heard_at }
    }
}

/// The key of proposer `proposer`'s answer to its proposal `seq`.
pub(crate) fn answer_key(proposer: u128, seq: u64) -> Vec<u8> {
    [PREFIX_ANSWER, &proposer.to_be_bytes(), &seq.to_be_bytes()].concat()
}

/// The records that hold `proposer`'s entry `p` of the proposal book.
pub(crate) fn book_records(proposer: u128, p: &crate::state::Proposer) -> Vec<(Vec<u8>, Vec<u8>)> {
    let head =
        ([PREFIX_PROPOSER, &proposer.to_be_bytes()].concat(), tally_core::codec::encode(&BookEntry::of(p)));
    let answers =
        p.answered.iter().map(|(seq, r)| (answer_key(proposer, *seq), tally_core::codec::encode(r)));
    std::iter::once(head).chain(answers).collect()
}
pub(crate) const KEY_SNAPSHOT: &[u8] = b"current";
const KEY_SNAPSHOT_SEQ: &[u8] = b"seq";

/// The applied state and where it stands in the log.
#[derive(Debug, Clone, Default)]
pub struct Applied {
    /// The replicated state.
    pub state: MetaState,
    /// The last log entry applied to `state`.
    pub last_applied: Option<LogId>,
    /// The last raft membership applied.
    pub membership: StoredMembership,
}

/// What the state machine shares with readers: the applied state and the change
/// feed. Readers take the read lock only long enough to copy what they need.
pub struct Shared {
    applied: RwLock<Applied>,
    changes: broadcast::Sender<MetaChange>,
}

impl Shared {
    /// Read access to the applied state. A poisoned lock (a panic while applying)
    /// still yields the state: every write to it happens after its batch is stored.
    pub fn read(&self) -> RwLockReadGuard<'_, Applied> {
        self.applied.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Applied> {
        self.applied.write().unwrap_or_else(|e| e.into_inner())
    }

    /// A new receiver of applied changes.
    pub fn subscribe(&self) -> broadcast::Receiver<MetaChange> {
        self.changes.subscribe()
    }

    fn announce(&self, changes: Vec<MetaChange>) {
        for c in changes {
            // No subscriber is not an error.
            let _ = self.changes.send(c);
        }
    }
}

/// A stored snapshot: its meta and the encoded [`MetaState`].
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// The state machine of one node, stored in its sled database. Cheap to clone;
/// clones (the snapshot builder) share everything.
#[derive(Clone)]
pub struct SledStateMachine {
    db: sled::Db,
    tree: sled::Tree,
    snapshots: sled::Tree,
    shared: Arc<Shared>,
}

fn read_err(subject: ErrorSubject<NodeId>, e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::new(subject, ErrorVerb::Read, openraft::AnyError::new(&e)).into()
}

fn write_err(subject: ErrorSubject<NodeId>, e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::new(subject, ErrorVerb::Write, openraft::AnyError::new(&e)).into()
}

fn prefixed(prefix: &[u8], name: &CounterName) -> Vec<u8> {
    [prefix, name.as_str().as_bytes()].concat()
}

fn decode<T: serde::de::DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, StorageError> {
    tally_core::codec::decode(what, bytes).map_err(|e| read_err(ErrorSubject::StateMachine, e))
}

/// A key of the state machine tree whose length is not its prefix's.
fn bad_key(what: &'static str, key: &[u8]) -> StorageError {
    let e = tally_core::codec::DecodeError { what, reason: format!("a key of {} bytes", key.len()) };
    read_err(ErrorSubject::StateMachine, e)
}

/// Reads a state machine tree back into memory.
fn load(tree: &sled::Tree) -> Result<Applied, StorageError> {
    let mut applied = Applied::default();
    for item in tree.iter() {
        let (key, value) = item.map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
        let name_at = |prefix: &[u8]| -> Result<CounterName, StorageError> {
            let s = std::str::from_utf8(&key[prefix.len()..])
                .map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
            CounterName::new(s).map_err(|e| read_err(ErrorSubject::StateMachine, e))
        };
        match &*key {
            KEY_APPLIED => applied.last_applied = decode("last applied log id", &value)?,
            KEY_MEMBERSHIP => applied.membership = decode("raft membership", &value)?,
            KEY_MEMBERS => {
                (
                    applied.state.members,
                    applied.state.placement_epoch,
                    applied.state.previous,
                    applied.state.handoff,
                ) = decode("members", &value)?;
            }
            KEY_REQUESTS => applied.state.applied_requests = decode("applied request count", &value)?,
            KEY_STORES => applied.state.stores = decode("store records", &value)?,
            KEY_CLASSES => applied.state.classes = decode("replica classes", &value)?,
            KEY_FORMATIONS => applied.state.formations = decode("range formations", &value)?,
            k if k.starts_with(PREFIX_COUNTER) => {
                let meta: CounterMeta = decode("counter meta", &value)?;
                applied.state.counters.insert(name_at(PREFIX_COUNTER)?, meta);
            }
            k if k.starts_with(PREFIX_TOMBSTONE) => {
                let generations: Vec<(u32, u16)> = decode("tombstone", &value)?;
                applied.state.tombstones.insert(name_at(PREFIX_TOMBSTONE)?, generations);
            }
            k if k.starts_with(PREFIX_AUTO) => {
                applied.state.auto.insert(name_at(PREFIX_AUTO)?, decode("auto shard bounds", &value)?);
            }
            k if k.starts_with(PREFIX_NAMESPACE) => {
                let prefix = std::str::from_utf8(&k[PREFIX_NAMESPACE.len()..])
                    .map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
                applied.state.namespaces.insert(prefix.to_owned(), decode("namespace", &value)?);
            }
            k if k.starts_with(PREFIX_PROPOSER) => {
                let raw = <[u8; 16]>::try_from(&k[PREFIX_PROPOSER.len()..])
                    .map_err(|_| bad_key("proposer key", k))?;
                let entry: BookEntry = decode("proposer", &value)?;
                let p = applied.state.proposals.entry(u128::from_be_bytes(raw)).or_default();
                (p.forgotten_below, p.heard_at) = (entry.forgotten_below, entry.heard_at);
            }
            k if k.starts_with(PREFIX_ANSWER) => {
                let raw =
                    <[u8; 24]>::try_from(&k[PREFIX_ANSWER.len()..]).map_err(|_| bad_key("answer key", k))?;
                let (proposer, seq) = raw.split_at(16);
                let proposer = u128::from_be_bytes(proposer.try_into().expect("16 bytes"));
                let seq = u64::from_be_bytes(seq.try_into().expect("8 bytes"));
                let answer = decode("proposal answer", &value)?;
                applied.state.proposals.entry(proposer).or_default().answered.insert(seq, answer);
            }
            other => {
                tracing::warn!(key = ?String::from_utf8_lossy(other), "unknown key in raft state machine")
            }
        }
    }
    applied.state.reindex();
    Ok(applied)
}

/// Adds the current value of `item` (or its removal) to `batch`.
fn stage(batch: &mut sled::Batch, state: &MetaState, item: &Touched) {
    match item {
        Touched::Counter(name) => match state.counters.get(name) {
            Some(meta) => batch.insert(prefixed(PREFIX_COUNTER, name), tally_core::codec::encode(meta)),
            None => batch.remove(prefixed(PREFIX_COUNTER, name)),
        },
        Touched::Tombstone(name) => match state.tombstones.get(name) {
            Some(g) => batch.insert(prefixed(PREFIX_TOMBSTONE, name), tally_core::codec::encode(g)),
            None => batch.remove(prefixed(PREFIX_TOMBSTONE, name)),
        },
        Touched::Members => {
            let members = (&state.members, state.placement_epoch, &state.previous, &state.handoff);
            batch.insert(KEY_MEMBERS, tally_core::codec::encode(&members))
        }
        Touched::Stores => batch.insert(KEY_STORES, tally_core::codec::encode(&state.stores)),
        Touched::Classes => batch.insert(KEY_CLASSES, tally_core::codec::encode(&state.classes)),
        Touched::Formations => batch.insert(KEY_FORMATIONS, tally_core::codec::encode(&state.formations)),
        Touched::Auto(name) => match state.auto.get(name) {
            Some(b) => batch.insert(prefixed(PREFIX_AUTO, name), tally_core::codec::encode(b)),
            None => batch.remove(prefixed(PREFIX_AUTO, name)),
        },
        Touched::Namespace(prefix) => {
            let key = [PREFIX_NAMESPACE, prefix.as_bytes()].concat();
            match state.namespaces.get(prefix) {
                Some(spec) => batch.insert(key, tally_core::codec::encode(spec)),
                None => batch.remove(key),
            }
        }
        Touched::Proposer(key) => {
            let k = [PREFIX_PROPOSER, &key.to_be_bytes()].concat();
            match state.proposals.get(key) {
                Some(p) => batch.insert(k, tally_core::codec::encode(&BookEntry::of(p))),
                None => batch.remove(k),
            }
        }
        Touched::Answer(key, seq) => match state.proposals.get(key).and_then(|p| p.answered.get(seq)) {
            Some(r) => batch.insert(answer_key(*key, *seq), tally_core::codec::encode(r)),
            None => batch.remove(answer_key(*key, *seq)),
        },
    }
}

/// Adds every item of `applied` to `batch` (used to replace the whole state).
fn stage_all(batch: &mut sled::Batch, applied: &Applied) {
    let s = &applied.state;
    for name in s.counters.keys() {
        stage(batch, s, &Touched::Counter(name.clone()));
    }
    for name in s.tombstones.keys() {
        stage(batch, s, &Touched::Tombstone(name.clone()));
    }
    for name in s.auto.keys() {
        stage(batch, s, &Touched::Auto(name.clone()));
    }
    for prefix in s.namespaces.keys() {
        stage(batch, s, &Touched::Namespace(prefix.clone()));
    }
    for (key, p) in &s.proposals {
        for (k, v) in book_records(*key, p) {
            batch.insert(k, v);
        }
    }
    stage(batch, s, &Touched::Members);
    stage(batch, s, &Touched::Stores);
    stage(batch, s, &Touched::Classes);
    stage(batch, s, &Touched::Formations);
    stage_position(batch, applied);
}

/// Adds the apply position (and the request count) to `batch`.
fn stage_position(batch: &mut sled::Batch, applied: &Applied) {
    batch.insert(KEY_APPLIED, tally_core::codec::encode(&applied.last_applied));
    batch.insert(KEY_MEMBERSHIP, tally_core::codec::encode(&applied.membership));
    batch.insert(KEY_REQUESTS, tally_core::codec::encode(&applied.state.applied_requests));
}

impl SledStateMachine {
    /// Opens (creating if absent) the state machine trees of `db` and loads the
    /// state into memory.
    pub fn open(db: &sled::Db) -> Result<Self, StorageError> {
        let tree = db.open_tree(SM_TREE).map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
        let snapshots = db.open_tree(SNAPSHOT_TREE).map_err(|e| read_err(ErrorSubject::StateMachine, e))?;
        let applied = load(&tree)?;
        let (changes, _) = broadcast::channel(CHANGES_BUFFERED_MAX);
        Ok(Self {
            db: db.clone(),
            tree,
            snapshots,
            shared: Arc::new(Shared { applied: RwLock::new(applied), changes }),
        })
    }

    /// The state shared with readers.
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    fn read_snapshot(&self) -> Result<Option<StoredSnapshot>, StorageError> {
        let subject = ErrorSubject::Snapshot(None);
        match self.snapshots.get(KEY_SNAPSHOT).map_err(|e| read_err(subject.clone(), e))? {
            None => Ok(None),
            Some(bytes) => {
                tally_core::codec::decode("snapshot", &bytes).map(Some).map_err(|e| read_err(subject, e))
            }
        }
    }

    async fn save_snapshot(&self, snapshot: &StoredSnapshot) -> Result<(), StorageError> {
        let subject = ErrorSubject::Snapshot(Some(snapshot.meta.signature()));
        self.snapshots
            .insert(KEY_SNAPSHOT, tally_core::codec::encode(snapshot))
            .map_err(|e| write_err(subject.clone(), e))?;
        crate::log_store::flush(&self.db).await.map_err(|e| write_err(subject, e))?;
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for SledStateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let (data, last_applied, membership) = {
            let applied = self.shared.read();
            (tally_core::codec::encode(&applied.state), applied.last_applied, applied.membership.clone())
        };
        let seq = self
            .snapshots
            .update_and_fetch(KEY_SNAPSHOT_SEQ, |old| {
                let n = old.and_then(|b| <[u8; 8]>::try_from(b).ok()).map_or(0, u64::from_be_bytes);
                Some((n + 1).to_be_bytes().to_vec())
            })
            .map_err(|e| write_err(ErrorSubject::Snapshot(None), e))?
            .and_then(|b| <[u8; 8]>::try_from(&*b).ok())
            .map_or(0, u64::from_be_bytes);
        let snapshot_id = match &last_applied {
            Some(l) => format!("{}-{}-{}-{seq}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => format!("none-{seq}"),
        };
        let meta = SnapshotMeta { last_log_id: last_applied, last_membership: membership, snapshot_id };
        let stored = StoredSnapshot { meta, data };
        self.save_snapshot(&stored).await?;
        tracing::info!(snapshot = %stored.meta, bytes = stored.data.len(), "built raft snapshot");
        Ok(Snapshot { meta: stored.meta, snapshot: Box::new(Cursor::new(stored.data)) })
    }
}

impl RaftStateMachine<TypeConfig> for SledStateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let applied = self.shared.read();
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        let mut changes = Vec::new();
        let mut touched = Vec::new();
        // Mutate in place under the write lock (no await below, so the guard never
        // crosses a suspension point); if the batch cannot be stored, the state is
        // reloaded from sled so memory never keeps an effect that was not stored.
        let mut guard = self.shared.write();
        let next = &mut *guard;
        for entry in entries {
            next.last_applied = Some(entry.log_id);
            match entry.payload {
                EntryPayload::Blank => replies.push(Response::Nothing),
                EntryPayload::Membership(m) => {
                    next.membership = StoredMembership::new(Some(entry.log_id), m);
                    replies.push(Response::Nothing);
                }
                EntryPayload::Normal(req) => {
                    let (reply, t, c) = next.state.apply(&req);
                    touched.extend(t);
                    changes.extend(c);
                    replies.push(reply);
                }
            }
        }
        if replies.is_empty() {
            return Ok(replies);
        }
        touched.sort();
        touched.dedup();
        let mut batch = sled::Batch::default();
        for item in &touched {
            stage(&mut batch, &next.state, item);
        }
        stage_position(&mut batch, next);
        if let Err(e) = self.tree.apply_batch(batch) {
            let subject = next.last_applied.map_or(ErrorSubject::StateMachine, ErrorSubject::Apply);
            if let Ok(stored) = load(&self.tree) {
                *guard = stored;
            }
            return Err(write_err(subject, e));
        }
        drop(guard);
        self.shared.announce(changes);
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
        let subject = ErrorSubject::Snapshot(Some(meta.signature()));
        let mut state: MetaState =
            tally_core::codec::decode("snapshot", &data).map_err(|e| read_err(subject.clone(), e))?;
        state.reindex();
        let next =
            Applied { state, last_applied: meta.last_log_id, membership: meta.last_membership.clone() };
        // Replace the whole tree in one atomic batch: remove every key, then write
        // the snapshot's items (a later insert of the same key wins within a batch).
        let mut batch = sled::Batch::default();
        for key in self.tree.iter().keys() {
            batch.remove(key.map_err(|e| read_err(subject.clone(), e))?);
        }
        stage_all(&mut batch, &next);
        self.tree.apply_batch(batch).map_err(|e| write_err(subject.clone(), e))?;
        self.save_snapshot(&StoredSnapshot { meta: meta.clone(), data }).await?;
        *self.shared.write() = next;
        self.shared.announce(vec![MetaChange::Reset]);
        tracing::info!(snapshot = %meta, "installed raft snapshot");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        Ok(self.read_snapshot()?.map(|s| Snapshot { meta: s.meta, snapshot: Box::new(Cursor::new(s.data)) }))
    }
}
