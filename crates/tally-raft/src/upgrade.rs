//! Upgrading a raft database of format 1 to 9 to today's format, in place.
//!
//! Format 1's log entries, counter records and snapshot hold counter specs and spec
//! patches of format 1's layout (`tally_core::format::v1`), format 2's those of
//! format 2 (`tally_core::format::v3`: format 3 added windows), format 3's those of
//! format 3 (`tally_core::format::v4`: format 4 added bounds), and formats 4 and 5
//! those of format 5 (`tally_core::format::v5`: format 6 added window limits), and
//! format 6's those of format 6 (`tally_core::format::v6`: format 7 added counters'
//! own replica counts). Format 7's snapshot state has no proposal book (format 8
//! added it, and the request that carries a proposal's identity). Formats 7 and 8
//! hold counter metadata of their layout (`tally_core::format::v8`: format 9 added
//! a counter's expiry) in their counter records, their snapshots and, in format 8,
//! the answers their proposal book keeps; their snapshot state has no namespaces
//! (format 9 added them, and the requests that set them, after the others, so their
//! log entries decode as today's). Formats 8 and 9 keep each proposer's whole
//! proposal book in one record; format 10 keeps its answers in records of their
//! own, and its entries may create many counters at once (added last, so format 9's
//! entries decode as they are).
//! Format 4's snapshot state has no auto bounds either (format 5 added them, and two
//! requests its entries may hold, `RequestAuto`). An upgrade decodes each with the
//! frozen types, converts it and writes it back, together with the new format
//! marker, in one sled transaction: a crash leaves the database either all of the
//! old format or all today's.

use crate::log_store::LOG_TREE;
use crate::state::{MetaState, Proposer};
use crate::state_machine::{
    book_records, KEY_SNAPSHOT, PREFIX_COUNTER, PREFIX_PROPOSER, SM_TREE, SNAPSHOT_TREE,
};
use crate::store_id::StoreId;
use crate::types::{
    Effect, MemberRejection, MembersView, NodeId, Rejection, Request, Response, StoreRecord, StoreRejection,
    TypeConfig,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use tally_core::codec::{decode, encode, DecodeError};
use tally_core::format::v1::{CounterMetaV1, MetaCommandV1};
use tally_core::format::v3::{CounterMetaV3, MetaCommandV3};
use tally_core::format::v4::{CounterMetaV4, MetaCommandV4};
use tally_core::format::v5::{CounterMetaV5, MetaCommandV5};
use tally_core::format::v6::{CounterMetaV6, MetaCommandV6};
use tally_core::format::v8::CounterMetaV8;
use tally_core::format::{v1, v3, v4, v5, v6, v8, Rewrite};
use tally_core::meta::{CounterMeta, MetaCommand};
use tally_core::name::CounterName;
use tally_core::spec::AutoShards;

openraft::declare_raft_types!(
    /// The type configuration of format 1's log: only its entries' payload differs.
    TypeConfigV1:
        D = RequestOld<MetaCommandV1>,
        R = crate::types::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

openraft::declare_raft_types!(
    /// The type configuration of format 2's log: only its entries' payload differs.
    TypeConfigV2:
        D = RequestOld<MetaCommandV3>,
        R = crate::types::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

openraft::declare_raft_types!(
    /// The type configuration of format 3's log: only its entries' payload differs.
    TypeConfigV3:
        D = RequestOld<MetaCommandV4>,
        R = crate::types::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

openraft::declare_raft_types!(
    /// The type configuration of format 4's log: only its entries' payload differs.
    TypeConfigV4:
        D = RequestOld<MetaCommandV5>,
        R = crate::types::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

openraft::declare_raft_types!(
    /// The type configuration of format 5's log: only its entries' payload differs.
    TypeConfigV5:
        D = RequestV5,
        R = crate::types::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

openraft::declare_raft_types!(
    /// The type configuration of format 6's log: only its entries' payload differs.
    TypeConfigV6:
        D = RequestAuto<MetaCommandV6>,
        R = crate::types::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

/// [`Request`] as formats 1 to 4 stored it: only the counter command's layout (`C`)
/// differs between them, and none had the auto requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum RequestOld<C> {
    Counter { name: CounterName, cmd: C, now_ms: u64 },
    ClearTombstone { name: CounterName },
    SetMembers { from_epoch: u64, previous: Vec<String>, members: Vec<String> },
    HandoffDone { node: String, epoch: u64 },
    RegisterStore { node: NodeId, store: StoreId },
    ReplaceStore { node: NodeId, store: StoreId },
    AcceptLoss { node: NodeId, store: StoreId },
}

impl<C: Into<MetaCommand>> From<RequestOld<C>> for Request {
    fn from(v: RequestOld<C>) -> Self {
        match v {
            RequestOld::Counter { name, cmd, now_ms } => Request::Counter { name, cmd: cmd.into(), now_ms },
            RequestOld::ClearTombstone { name } => Request::ClearTombstone { name },
            RequestOld::SetMembers { from_epoch, previous, members } => {
                Request::SetMembers { from_epoch, previous, members }
            }
            RequestOld::HandoffDone { node, epoch } => Request::HandoffDone { node, epoch },
            RequestOld::RegisterStore { node, store } => Request::RegisterStore { node, store },
            RequestOld::ReplaceStore { node, store } => Request::ReplaceStore { node, store },
            RequestOld::AcceptLoss { node, store } => Request::AcceptLoss { node, store },
        }
    }
}

/// [`Request`] as formats 5 and 6 stored it: today's requests, with their counter
/// commands (`C`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum RequestAuto<C> {
    Counter { name: CounterName, cmd: C, now_ms: u64 },
    ClearTombstone { name: CounterName },
    SetMembers { from_epoch: u64, previous: Vec<String>, members: Vec<String> },
    HandoffDone { node: String, epoch: u64 },
    RegisterStore { node: NodeId, store: StoreId },
    ReplaceStore { node: NodeId, store: StoreId },
    AcceptLoss { node: NodeId, store: StoreId },
    CounterAuto { name: CounterName, cmd: C, auto: Option<AutoShards>, now_ms: u64 },
    AutoReshard { name: CounterName, version: u64, shards: u16, now_ms: u64 },
}

/// [`Request`] as format 5 stored it.
type RequestV5 = RequestAuto<MetaCommandV5>;

impl<C: Into<MetaCommand>> From<RequestAuto<C>> for Request {
    fn from(v: RequestAuto<C>) -> Self {
        match v {
            RequestAuto::Counter { name, cmd, now_ms } => Request::Counter { name, cmd: cmd.into(), now_ms },
            RequestAuto::ClearTombstone { name } => Request::ClearTombstone { name },
            RequestAuto::SetMembers { from_epoch, previous, members } => {
                Request::SetMembers { from_epoch, previous, members }
            }
            RequestAuto::HandoffDone { node, epoch } => Request::HandoffDone { node, epoch },
            RequestAuto::RegisterStore { node, store } => Request::RegisterStore { node, store },
            RequestAuto::ReplaceStore { node, store } => Request::ReplaceStore { node, store },
            RequestAuto::AcceptLoss { node, store } => Request::AcceptLoss { node, store },
            RequestAuto::CounterAuto { name, cmd, auto, now_ms } => {
                Request::CounterAuto { name, cmd: cmd.into(), auto, now_ms }
            }
            RequestAuto::AutoReshard { name, version, shards, now_ms } => {
                Request::AutoReshard { name, version, shards, now_ms }
            }
        }
    }
}

/// [`MetaState`] as formats 1 to 4 stored it (inside snapshots): the counters'
/// layout (`M`) differs between them, and none kept auto bounds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct MetaStateOld<M> {
    counters: BTreeMap<CounterName, M>,
    tombstones: BTreeMap<CounterName, Vec<(u32, u16)>>,
    members: Vec<String>,
    placement_epoch: u64,
    previous: Vec<String>,
    handoff: Vec<String>,
    stores: BTreeMap<NodeId, StoreRecord>,
    applied_requests: u64,
}

impl<M: Into<CounterMeta>> From<MetaStateOld<M>> for MetaState {
    fn from(v: MetaStateOld<M>) -> Self {
        MetaState {
            proposals: BTreeMap::new(),
            counters: v.counters.into_iter().map(|(name, meta)| (name, meta.into())).collect(),
            tombstones: v.tombstones,
            members: v.members,
            placement_epoch: v.placement_epoch,
            previous: v.previous,
            handoff: v.handoff,
            stores: v.stores,
            applied_requests: v.applied_requests,
            auto: BTreeMap::new(),
            classes: BTreeMap::new(),
            formations: BTreeMap::new(),
            namespaces: BTreeMap::new(),
            expiring: BTreeSet::new(),
        }
    }
}

/// [`MetaState`] as formats 5 and 6 stored it (inside snapshots): today's, with
/// their counters (`M`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct MetaStateAuto<M> {
    counters: BTreeMap<CounterName, M>,
    tombstones: BTreeMap<CounterName, Vec<(u32, u16)>>,
    members: Vec<String>,
    placement_epoch: u64,
    previous: Vec<String>,
    handoff: Vec<String>,
    stores: BTreeMap<NodeId, StoreRecord>,
    applied_requests: u64,
    auto: BTreeMap<CounterName, AutoShards>,
}

/// [`MetaState`] as format 5 stored it.
type MetaStateV5 = MetaStateAuto<CounterMetaV5>;

impl<M: Into<CounterMeta>> From<MetaStateAuto<M>> for MetaState {
    fn from(v: MetaStateAuto<M>) -> Self {
        MetaState {
            proposals: BTreeMap::new(),
            counters: v.counters.into_iter().map(|(name, meta)| (name, meta.into())).collect(),
            tombstones: v.tombstones,
            members: v.members,
            placement_epoch: v.placement_epoch,
            previous: v.previous,
            handoff: v.handoff,
            stores: v.stores,
            applied_requests: v.applied_requests,
            auto: v.auto,
            classes: BTreeMap::new(),
            formations: BTreeMap::new(),
            namespaces: BTreeMap::new(),
            expiring: BTreeSet::new(),
        }
    }
}

/// [`MetaState`] as format 7 stored it (inside snapshots): format 8's without the
/// proposal book, which format 8 added.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct MetaStateV7 {
    counters: BTreeMap<CounterName, CounterMetaV8>,
    tombstones: BTreeMap<CounterName, Vec<(u32, u16)>>,
    members: Vec<String>,
    placement_epoch: u64,
    previous: Vec<String>,
    handoff: Vec<String>,
    stores: BTreeMap<NodeId, StoreRecord>,
    applied_requests: u64,
    auto: BTreeMap<CounterName, AutoShards>,
    classes: BTreeMap<u8, Vec<String>>,
    formations: BTreeMap<u32, Vec<(u64, String)>>,
}

impl From<MetaStateV7> for MetaState {
    fn from(v: MetaStateV7) -> Self {
        let mut state = MetaState {
            counters: v.counters.into_iter().map(|(name, meta)| (name, meta.into())).collect(),
            tombstones: v.tombstones,
            members: v.members,
            placement_epoch: v.placement_epoch,
            previous: v.previous,
            handoff: v.handoff,
            stores: v.stores,
            applied_requests: v.applied_requests,
            auto: v.auto,
            classes: v.classes,
            formations: v.formations,
            proposals: BTreeMap::new(),
            namespaces: BTreeMap::new(),
            expiring: BTreeSet::new(),
        };
        state.reindex();
        state
    }
}

/// [`Response`] as format 8 stored it (in the proposal book): today's, with format
/// 8's counters and without the answers format 9 added.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum ResponseV8 {
    Nothing,
    Counter(Result<(Option<CounterMetaV8>, Effect), Rejection>),
    TombstoneCleared { existed: bool },
    Members(Result<MembersView, MemberRejection>),
    Store(Result<StoreRecord, StoreRejection>),
    Formation(Vec<(u64, String)>),
    Forgotten,
}

impl From<ResponseV8> for Response {
    fn from(v: ResponseV8) -> Self {
        match v {
            ResponseV8::Nothing => Response::Nothing,
            ResponseV8::Counter(r) => {
                Response::Counter(r.map(|(meta, effect)| (meta.map(Into::into), effect)))
            }
            ResponseV8::TombstoneCleared { existed } => Response::TombstoneCleared { existed },
            ResponseV8::Members(r) => Response::Members(r),
            ResponseV8::Store(r) => Response::Store(r),
            ResponseV8::Formation(f) => Response::Formation(f),
            ResponseV8::Forgotten => Response::Forgotten,
        }
    }
}

/// [`Proposer`] as format 8 stored it, with format 8's answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ProposerV8 {
    answered: BTreeMap<u64, ResponseV8>,
    forgotten_below: u64,
    heard_at: u64,
}

impl From<ProposerV8> for Proposer {
    fn from(v: ProposerV8) -> Self {
        Proposer {
            answered: v.answered.into_iter().map(|(seq, r)| (seq, r.into())).collect(),
            forgotten_below: v.forgotten_below,
            heard_at: v.heard_at,
        }
    }
}

/// [`MetaState`] as format 8 stored it (inside snapshots): today's without the
/// namespaces, with format 8's counters and proposal book.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct MetaStateV8 {
    counters: BTreeMap<CounterName, CounterMetaV8>,
    tombstones: BTreeMap<CounterName, Vec<(u32, u16)>>,
    members: Vec<String>,
    placement_epoch: u64,
    previous: Vec<String>,
    handoff: Vec<String>,
    stores: BTreeMap<NodeId, StoreRecord>,
    applied_requests: u64,
    auto: BTreeMap<CounterName, AutoShards>,
    classes: BTreeMap<u8, Vec<String>>,
    formations: BTreeMap<u32, Vec<(u64, String)>>,
    proposals: BTreeMap<u128, ProposerV8>,
}

impl From<MetaStateV8> for MetaState {
    fn from(v: MetaStateV8) -> Self {
        let mut state = MetaState {
            counters: v.counters.into_iter().map(|(name, meta)| (name, meta.into())).collect(),
            tombstones: v.tombstones,
            members: v.members,
            placement_epoch: v.placement_epoch,
            previous: v.previous,
            handoff: v.handoff,
            stores: v.stores,
            applied_requests: v.applied_requests,
            auto: v.auto,
            classes: v.classes,
            formations: v.formations,
            proposals: v.proposals.into_iter().map(|(key, p)| (key, p.into())).collect(),
            namespaces: BTreeMap::new(),
            expiring: BTreeSet::new(),
        };
        state.reindex();
        state
    }
}

/// A stored snapshot's shape (see `state_machine.rs`), with its state still encoded.
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: openraft::SnapshotMeta<NodeId, openraft::BasicNode>,
    data: Vec<u8>,
}

/// A log entry of an older format (type configuration `T`, whose payload converts
/// to today's request), as today's bytes.
fn upgrade_entry<T>(what: &'static str, bytes: &[u8]) -> Result<Vec<u8>, DecodeError>
where
    T: openraft::RaftTypeConfig<NodeId = NodeId, Node = openraft::BasicNode>,
    T::D: Into<Request>,
    openraft::Entry<T>: DeserializeOwned,
{
    let old: openraft::Entry<T> = decode(what, bytes)?;
    let payload = match old.payload {
        openraft::EntryPayload::Blank => openraft::EntryPayload::Blank,
        openraft::EntryPayload::Normal(r) => openraft::EntryPayload::Normal(r.into()),
        openraft::EntryPayload::Membership(m) => openraft::EntryPayload::Membership(m),
    };
    Ok(encode(&openraft::Entry::<TypeConfig> { log_id: old.log_id, payload }))
}

/// A stored snapshot of an older format whose state is an `S`, as today's bytes;
/// `what` names the snapshot and its state in errors.
fn upgrade_snapshot<S>(what: (&'static str, &'static str), bytes: &[u8]) -> Result<Vec<u8>, DecodeError>
where
    S: DeserializeOwned + Into<MetaState>,
{
    let old: StoredSnapshot = decode(what.0, bytes)?;
    let state: S = decode(what.1, &old.data)?;
    Ok(encode(&StoredSnapshot { meta: old.meta, data: encode(&state.into()) }))
}

/// A record kept as it is: the proposal book's records of formats before 8, which
/// had none.
fn unchanged(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    Ok(bytes.to_vec())
}

fn upgrade_entry_v1(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfigV1>("format-1 raft log entry", bytes)
}

fn upgrade_snapshot_v1(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateOld<CounterMetaV1>>(("format-1 snapshot", "format-1 snapshot state"), bytes)
}

fn upgrade_entry_v2(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfigV2>("format-2 raft log entry", bytes)
}

fn upgrade_snapshot_v2(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateOld<CounterMetaV3>>(("format-2 snapshot", "format-2 snapshot state"), bytes)
}

fn upgrade_entry_v3(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfigV3>("format-3 raft log entry", bytes)
}

fn upgrade_snapshot_v3(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateOld<CounterMetaV4>>(("format-3 snapshot", "format-3 snapshot state"), bytes)
}

fn upgrade_entry_v4(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfigV4>("format-4 raft log entry", bytes)
}

fn upgrade_snapshot_v4(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateOld<CounterMetaV5>>(("format-4 snapshot", "format-4 snapshot state"), bytes)
}

fn upgrade_entry_v5(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfigV5>("format-5 raft log entry", bytes)
}

fn upgrade_snapshot_v5(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateV5>(("format-5 snapshot", "format-5 snapshot state"), bytes)
}

fn upgrade_entry_v6(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfigV6>("format-6 raft log entry", bytes)
}

fn upgrade_snapshot_v6(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateAuto<CounterMetaV6>>(("format-6 snapshot", "format-6 snapshot state"), bytes)
}

/// A format-7 log entry, checked to decode as today's (formats 8 and 9 only added
/// requests after the others), as today's bytes.
fn upgrade_entry_v7(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfig>("format-7 raft log entry", bytes)
}

/// A format-8 log entry, checked to decode as today's, as today's bytes.
fn upgrade_entry_v8(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfig>("format-8 raft log entry", bytes)
}

/// A format-9 log entry, checked to decode as today's (format 10 only added a
/// request after the others), as today's bytes.
fn upgrade_entry_v9(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_entry::<TypeConfig>("format-9 raft log entry", bytes)
}

/// A format-8 record of the proposal book, as format 9's bytes.
fn upgrade_proposer_v8(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let old: ProposerV8 = decode("format-8 proposer", bytes)?;
    Ok(encode(&Proposer::from(old)))
}

fn upgrade_snapshot_v8(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateV8>(("format-8 snapshot", "format-8 snapshot state"), bytes)
}

fn upgrade_snapshot_v7(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade_snapshot::<MetaStateV7>(("format-7 snapshot", "format-7 snapshot state"), bytes)
}

/// Why an upgrade failed; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// sled failed.
    #[error("upgrading the raft store: {0}")]
    Sled(#[from] sled::Error),
    /// A record is not of the format the database is marked with.
    #[error("upgrading the raft store: {key} in {tree}: {source}")]
    Corrupt {
        /// The tree.
        tree: &'static str,
        /// The record's key, printed.
        key: String,
        /// Why it does not decode.
        source: DecodeError,
    },
}

/// A record to write back: the index of its tree, its key and its new value.
type Rewritten = (usize, Vec<u8>, Vec<u8>);

/// Adds to `out` the rewrite by `f` of every record of `tree` whose key `select`s.
fn rewrite(
    out: &mut Vec<Rewritten>,
    (index, tree, name): (usize, &sled::Tree, &'static str),
    select: &dyn Fn(&[u8]) -> bool,
    f: Rewrite<'_>,
) -> Result<(), UpgradeError> {
    for item in tree.iter() {
        let (key, value) = item?;
        if !select(&key) {
            continue;
        }
        let upgraded = f(&value).map_err(|source| UpgradeError::Corrupt {
            tree: name,
            key: String::from_utf8_lossy(&key).into_owned(),
            source,
        })?;
        out.push((index, key.to_vec(), upgraded));
    }
    Ok(())
}

/// Rewrites every record of `db`, of raft store format `found` (1 to the one
/// before today's), in today's format and writes `marker` under `marker_key` in
/// `marker_tree`, all in one transaction; returns how many records it rewrote.
/// Format 2's records are of format 3's layout, formats 4 and 5 of format 5's, 7
/// and 8 hold counters of format 8's, and format 10 only split the proposal book.
pub(crate) fn from(
    found: u32,
    db: &sled::Db,
    marker_tree: &sled::Tree,
    marker_key: &[u8],
    marker: &[u8],
) -> Result<u64, UpgradeError> {
    let rewrites = match found {
        1 => Rewrites {
            entry: &upgrade_entry_v1,
            counter: &v1::upgrade_counter_meta,
            proposer: &unchanged,
            snapshot: &upgrade_snapshot_v1,
        },
        2 => Rewrites {
            entry: &upgrade_entry_v2,
            counter: &v3::upgrade_counter_meta,
            proposer: &unchanged,
            snapshot: &upgrade_snapshot_v2,
        },
        3 => Rewrites {
            entry: &upgrade_entry_v3,
            counter: &v4::upgrade_counter_meta,
            proposer: &unchanged,
            snapshot: &upgrade_snapshot_v3,
        },
        4 => Rewrites {
            entry: &upgrade_entry_v4,
            counter: &v5::upgrade_counter_meta,
            proposer: &unchanged,
            snapshot: &upgrade_snapshot_v4,
        },
        5 => Rewrites {
            entry: &upgrade_entry_v5,
            counter: &v5::upgrade_counter_meta,
            proposer: &unchanged,
            snapshot: &upgrade_snapshot_v5,
        },
        6 => Rewrites {
            entry: &upgrade_entry_v6,
            counter: &v6::upgrade_counter_meta,
            proposer: &unchanged,
            snapshot: &upgrade_snapshot_v6,
        },
        7 => Rewrites {
            entry: &upgrade_entry_v7,
            counter: &v8::upgrade_counter_meta,
            proposer: &unchanged,
            snapshot: &upgrade_snapshot_v7,
        },
        8 => Rewrites {
            entry: &upgrade_entry_v8,
            counter: &v8::upgrade_counter_meta,
            proposer: &upgrade_proposer_v8,
            snapshot: &upgrade_snapshot_v8,
        },
        9 => Rewrites {
            entry: &upgrade_entry_v9,
            counter: &unchanged,
            proposer: &unchanged,
            snapshot: &unchanged,
        },
        other => unreachable!("no upgrade from raft store format {other}"),
    };
    from_old(db, marker_tree, (marker_key, marker), rewrites)
}

/// Adds to `out` the proposal book of `sm` in today's layout: each proposer's
/// record (of the old format, which `f` rewrites into format 9's whole
/// [`Proposer`]) becomes its entry and one record per answer.
fn split_book(out: &mut Vec<Rewritten>, sm: &sled::Tree, f: Rewrite<'_>) -> Result<(), UpgradeError> {
    for item in sm.scan_prefix(PREFIX_PROPOSER) {
        let (key, value) = item?;
        let corrupt = |source| UpgradeError::Corrupt {
            tree: SM_TREE,
            key: String::from_utf8_lossy(&key).into_owned(),
            source,
        };
        let whole: Proposer = f(&value).and_then(|b| decode("format-9 proposer", &b)).map_err(corrupt)?;
        let raw = <[u8; 16]>::try_from(&key[PREFIX_PROPOSER.len()..]).map_err(|_| {
            corrupt(DecodeError { what: "proposer key", reason: format!("a key of {} bytes", key.len()) })
        })?;
        for (k, v) in book_records(u128::from_be_bytes(raw), &whole) {
            out.push((1, k, v));
        }
    }
    Ok(())
}

/// The rewrites of one older format's records.
struct Rewrites<'a> {
    entry: Rewrite<'a>,
    counter: Rewrite<'a>,
    /// The proposal book's records (format 8 on).
    proposer: Rewrite<'a>,
    snapshot: Rewrite<'a>,
}

fn from_old(
    db: &sled::Db,
    marker_tree: &sled::Tree,
    (marker_key, marker): (&[u8], &[u8]),
    f: Rewrites<'_>,
) -> Result<u64, UpgradeError> {
    use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
    let log = db.open_tree(LOG_TREE)?;
    let sm = db.open_tree(SM_TREE)?;
    let snapshots = db.open_tree(SNAPSHOT_TREE)?;
    // (tree index, key, new value); trees are [log, sm, snapshots, marker_tree].
    let mut records = Vec::new();
    rewrite(&mut records, (0, &log, LOG_TREE), &|_| true, f.entry)?;
    let counters = |k: &[u8]| k.starts_with(PREFIX_COUNTER);
    rewrite(&mut records, (1, &sm, SM_TREE), &counters, f.counter)?;
    split_book(&mut records, &sm, f.proposer)?;
    let snapshot = |k: &[u8]| k == KEY_SNAPSHOT;
    rewrite(&mut records, (2, &snapshots, SNAPSHOT_TREE), &snapshot, f.snapshot)?;
    let trees = [&log, &sm, &snapshots, marker_tree];
    trees
        .as_slice()
        .transaction(|txs| {
            for (tree, key, value) in &records {
                txs[*tree].insert(key.as_slice(), value.as_slice())?;
            }
            txs[3].insert(marker_key, marker)?;
            Ok::<_, ConflictableTransactionError<()>>(())
        })
        .map_err(|e| match e {
            TransactionError::Storage(e) => UpgradeError::Sled(e),
            TransactionError::Abort(()) => UpgradeError::Sled(sled::Error::Unsupported("aborted".into())),
        })?;
    db.flush()?;
    Ok(records.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::format::v3::{CounterSpecV3, SpecPatchV3};
    use tally_core::format::v4::{CounterSpecV4, SpecPatchV4};
    use tally_core::format::v5::{CounterSpecV5, SpecPatchV5};
    use tally_core::frequency::FrequencySpec;
    use tally_core::meta::Layout;
    use tally_core::spec::{Durability, RouterPolicy};
    use tally_core::window::WindowSet;

    fn spec_v3() -> CounterSpecV3 {
        CounterSpecV3 {
            shards: 6,
            durability: Durability::Sync,
            flush_ms: 20,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: true,
            dedup_window_s: 60,
            frequency: None,
        }
    }

    fn spec_v4() -> CounterSpecV4 {
        CounterSpecV4 {
            shards: 6,
            durability: Durability::Sync,
            flush_ms: 20,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: true,
            dedup_window_s: 60,
            frequency: Some(FrequencySpec { epsilon: 0.01, delta: 0.001 }),
            windows: WindowSet::parse(&["1m", "1h"]).unwrap(),
        }
    }

    fn layout() -> Layout {
        Layout { generation: 1, shards: 6, base: 2, sealed: vec![], resharding: None }
    }

    fn name() -> CounterName {
        CounterName::new("c").unwrap()
    }

    fn state_of<M>(meta: M) -> MetaStateOld<M> {
        MetaStateOld {
            counters: [(name(), meta)].into(),
            tombstones: BTreeMap::new(),
            members: vec!["node1".into()],
            placement_epoch: 1,
            previous: vec![],
            handoff: vec![],
            stores: BTreeMap::new(),
            applied_requests: 5,
        }
    }

    /// A database of an older format (type configuration `T`) holding one log entry
    /// (`request`), a counter's record `meta` and a snapshot of `state`.
    fn database_of<T, M, S>(request: T::D, meta: &M, state: &S) -> sled::Db
    where
        T: openraft::RaftTypeConfig<NodeId = NodeId, Node = openraft::BasicNode>,
        openraft::Entry<T>: Serialize,
        M: Serialize,
        S: Serialize,
    {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let entry = openraft::Entry::<T> {
            log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), 7),
            payload: openraft::EntryPayload::Normal(request),
        };
        db.open_tree(LOG_TREE).unwrap().insert(7u64.to_be_bytes(), encode(&entry)).unwrap();
        db.open_tree(SM_TREE).unwrap().insert([PREFIX_COUNTER, b"c"].concat(), encode(meta)).unwrap();
        let snapshot = StoredSnapshot {
            meta: openraft::SnapshotMeta {
                last_log_id: None,
                last_membership: openraft::StoredMembership::default(),
                snapshot_id: "s".into(),
            },
            data: encode(state),
        };
        db.open_tree(SNAPSHOT_TREE).unwrap().insert(KEY_SNAPSHOT, encode(&snapshot)).unwrap();
        db
    }

    /// A database of a format before 5 holding one log entry (a counter put with
    /// `cmd`), the counter's record `meta` and a snapshot of it.
    fn old_database<T, C, M>(cmd: C, meta: M) -> sled::Db
    where
        T: openraft::RaftTypeConfig<D = RequestOld<C>, NodeId = NodeId, Node = openraft::BasicNode>,
        openraft::Entry<T>: Serialize,
        M: Serialize + Clone,
    {
        let request = RequestOld::Counter { name: name(), cmd, now_ms: 9 };
        database_of::<T, _, _>(request, &meta, &state_of(meta.clone()))
    }

    /// The upgraded database's log entry, counter record and snapshot state.
    fn read_all(db: &sled::Db) -> (Request, CounterMeta, MetaState) {
        let log = db.open_tree(LOG_TREE).unwrap();
        let up: openraft::Entry<TypeConfig> =
            decode("entry", &log.get(7u64.to_be_bytes()).unwrap().unwrap()).unwrap();
        let openraft::EntryPayload::Normal(request) = up.payload else { panic!("a request stays one") };
        let sm = db.open_tree(SM_TREE).unwrap();
        let meta: CounterMeta =
            decode("meta", &sm.get([PREFIX_COUNTER, b"c"].concat()).unwrap().unwrap()).unwrap();
        let snap: StoredSnapshot =
            decode("snapshot", &db.open_tree(SNAPSHOT_TREE).unwrap().get(KEY_SNAPSHOT).unwrap().unwrap())
                .unwrap();
        let state: MetaState = decode("state", &snap.data).unwrap();
        (request, meta, state)
    }

    /// The upgraded database's entry's spec patch, counter record and snapshot state.
    fn read_back(db: &sled::Db) -> (tally_core::spec::SpecPatch, CounterMeta, MetaState) {
        let (request, meta, state) = read_all(db);
        let Request::Counter { cmd: MetaCommand::Put(p), now_ms: 9, .. } = request else {
            panic!("a counter put stays one")
        };
        (p, meta, state)
    }

    #[test]
    fn a_format_two_database_upgrades_with_no_windows() {
        let meta = CounterMetaV3 { spec: spec_v3(), layout: layout(), created_at_ms: 3, version: 4 };
        let put = MetaCommandV3::Put(SpecPatchV3 { distinct: Some(true), ..Default::default() });
        let db = old_database::<TypeConfigV2, _, _>(put, meta);
        let marker_tree = db.open_tree("identity").unwrap();
        assert_eq!(from(2, &db, &marker_tree, b"format", b"4").unwrap(), 3);
        assert_eq!(marker_tree.get(b"format").unwrap().as_deref(), Some(&b"4"[..]));

        let (p, up, state) = read_back(&db);
        assert_eq!((p.distinct, p.windows, p.min, p.max), (Some(true), None, None, None));
        assert_eq!(
            (up.spec.shards, up.spec.windows, up.spec.min, &up.layout),
            (6, WindowSet::NONE, None, &layout())
        );
        assert_eq!(state.counters[&name()], up);
        assert_eq!((state.members, state.applied_requests), (vec!["node1".to_string()], 5));
        // Today's records are not format 2's: a second upgrade refuses them, changing nothing.
        assert!(from(2, &db, &marker_tree, b"format", b"4").is_err());
    }

    #[test]
    fn a_format_three_database_upgrades_with_its_windows_and_no_bounds() {
        let meta = CounterMetaV4 { spec: spec_v4(), layout: layout(), created_at_ms: 3, version: 4 };
        let windows = Some(WindowSet::parse(&["1d"]).unwrap());
        let put = MetaCommandV4::Put(SpecPatchV4 { distinct: Some(true), windows, ..Default::default() });
        let db = old_database::<TypeConfigV3, _, _>(put, meta);
        let marker_tree = db.open_tree("identity").unwrap();
        assert_eq!(from(3, &db, &marker_tree, b"format", b"4").unwrap(), 3);
        assert_eq!(marker_tree.get(b"format").unwrap().as_deref(), Some(&b"4"[..]));

        let (p, up, state) = read_back(&db);
        assert_eq!((p.distinct, p.windows, p.min, p.max), (Some(true), windows, None, None));
        let want = spec_v4();
        assert_eq!((up.spec.windows, up.spec.frequency), (want.windows, want.frequency));
        assert_eq!((up.spec.shards, up.spec.min, up.spec.max, &up.layout), (6, None, None, &layout()));
        assert_eq!((up.created_at_ms, up.version), (3, 4));
        assert_eq!(state.counters[&name()], up);
        assert_eq!((state.members, state.applied_requests), (vec!["node1".to_string()], 5));
        // Today's records are not format 3's, nor format 2's format 3's.
        assert!(from(3, &db, &marker_tree, b"format", b"4").is_err());
        let meta = CounterMetaV3 { spec: spec_v3(), layout: layout(), created_at_ms: 3, version: 4 };
        let db = old_database::<TypeConfigV2, _, _>(MetaCommandV3::Ensure, meta);
        let marker_tree = db.open_tree("identity").unwrap();
        assert!(from(3, &db, &marker_tree, b"format", b"4").is_err());
        assert_eq!(marker_tree.get(b"format").unwrap(), None, "nothing written");
    }

    fn spec_v5() -> CounterSpecV5 {
        CounterSpecV5 {
            shards: 6,
            durability: Durability::Sync,
            flush_ms: 20,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: false,
            dedup_window_s: 60,
            frequency: None,
            windows: WindowSet::parse(&["1m"]).unwrap(),
            min: Some(0),
            max: Some(100),
        }
    }

    #[test]
    fn a_format_four_database_upgrades_with_its_bounds_and_no_limit() {
        let meta = CounterMetaV5 { spec: spec_v5(), layout: layout(), created_at_ms: 3, version: 4 };
        let put = MetaCommandV5::Put(SpecPatchV5 { min: Some(-1), max: Some(1), ..Default::default() });
        let db = old_database::<TypeConfigV4, _, _>(put, meta);
        let marker_tree = db.open_tree("identity").unwrap();
        assert_eq!(from(4, &db, &marker_tree, b"format", b"6").unwrap(), 3);
        assert_eq!(marker_tree.get(b"format").unwrap().as_deref(), Some(&b"6"[..]));

        let (p, up, state) = read_back(&db);
        assert_eq!((p.min, p.max, p.limit), (Some(-1), Some(1), None));
        assert_eq!((up.spec.min, up.spec.max, up.spec.limit), (Some(0), Some(100), None));
        assert_eq!((up.spec.windows, &up.layout, up.version), (spec_v5().windows, &layout(), 4));
        assert_eq!(state.counters[&name()], up);
        assert!(state.auto.is_empty());
        assert_eq!((state.members, state.applied_requests), (vec!["node1".to_string()], 5));
        // Today's records are not format 4's, nor format 3's.
        assert!(from(4, &db, &marker_tree, b"format", b"6").is_err());
        let meta = CounterMetaV4 { spec: spec_v4(), layout: layout(), created_at_ms: 3, version: 4 };
        let db = old_database::<TypeConfigV3, _, _>(MetaCommandV4::Put(SpecPatchV4::default()), meta);
        let marker_tree = db.open_tree("identity").unwrap();
        assert!(from(4, &db, &marker_tree, b"format", b"6").is_err());
        assert_eq!(marker_tree.get(b"format").unwrap(), None, "nothing written");
    }

    #[test]
    fn a_format_five_database_upgrades_with_its_auto_bounds_and_no_limit() {
        let bounds = AutoShards { min_shards: 2, max_shards: 8 };
        let meta = CounterMetaV5 { spec: spec_v5(), layout: layout(), created_at_ms: 3, version: 4 };
        let state = MetaStateV5 {
            counters: [(name(), meta.clone())].into(),
            tombstones: BTreeMap::new(),
            members: vec!["node1".into()],
            placement_epoch: 1,
            previous: vec![],
            handoff: vec![],
            stores: BTreeMap::new(),
            applied_requests: 5,
            auto: [(name(), bounds)].into(),
        };
        let windows = Some(WindowSet::parse(&["1h"]).unwrap());
        let cmd = MetaCommandV5::Put(SpecPatchV5 { shards: Some(2), windows, ..Default::default() });
        let request = RequestV5::CounterAuto { name: name(), cmd, auto: Some(bounds), now_ms: 9 };
        let db = database_of::<TypeConfigV5, _, _>(request, &meta, &state);
        let marker_tree = db.open_tree("identity").unwrap();
        assert_eq!(from(5, &db, &marker_tree, b"format", b"6").unwrap(), 3);
        assert_eq!(marker_tree.get(b"format").unwrap().as_deref(), Some(&b"6"[..]));

        let (request, up, state) = read_all(&db);
        let Request::CounterAuto { cmd: MetaCommand::Put(p), auto: Some(b), now_ms: 9, .. } = request else {
            panic!("an auto counter put stays one: {request:?}")
        };
        assert_eq!((p.shards, p.windows, p.limit, b), (Some(2), windows, None, bounds));
        assert_eq!((up.spec.min, up.spec.max, up.spec.limit), (Some(0), Some(100), None));
        assert_eq!((&up.layout, up.created_at_ms, up.version), (&layout(), 3, 4));
        assert_eq!(state.counters[&name()], up);
        assert_eq!(state.auto, BTreeMap::from([(name(), bounds)]), "auto bounds kept");
        assert_eq!((state.members, state.applied_requests), (vec!["node1".to_string()], 5));
        // Today's records are not format 5's, nor format 4's (its snapshot has no auto
        // bounds).
        assert!(from(5, &db, &marker_tree, b"format", b"6").is_err());
        let db = old_database::<TypeConfigV4, _, _>(MetaCommandV5::Ensure, meta);
        let marker_tree = db.open_tree("identity").unwrap();
        assert!(from(5, &db, &marker_tree, b"format", b"6").is_err());
        assert_eq!(marker_tree.get(b"format").unwrap(), None, "nothing written");
    }

    #[test]
    fn a_format_six_database_upgrades_with_its_limit_and_the_clusters_replicas() {
        use tally_core::format::v6::{CounterSpecV6, SpecPatchV6};
        use tally_core::spec::WindowLimit;
        let limit = Some(WindowLimit::parse("1m", 50).unwrap());
        let spec = CounterSpecV6 {
            shards: 6,
            durability: Durability::Sync,
            flush_ms: 20,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: false,
            dedup_window_s: 60,
            frequency: None,
            windows: WindowSet::parse(&["1m"]).unwrap(),
            min: None,
            max: None,
            limit,
        };
        let bounds = AutoShards { min_shards: 2, max_shards: 8 };
        let meta = CounterMetaV6 { spec, layout: layout(), created_at_ms: 3, version: 4 };
        let state = MetaStateAuto {
            counters: [(name(), meta.clone())].into(),
            tombstones: [(name(), vec![(0, 4)])].into(),
            members: vec!["node1".into()],
            placement_epoch: 1,
            previous: vec![],
            handoff: vec![],
            stores: BTreeMap::new(),
            applied_requests: 5,
            auto: [(name(), bounds)].into(),
        };
        let cmd = MetaCommandV6::Put(SpecPatchV6 { limit, ..Default::default() });
        let request = RequestAuto::Counter { name: name(), cmd, now_ms: 9 };
        let db = database_of::<TypeConfigV6, _, _>(request, &meta, &state);
        let marker_tree = db.open_tree("identity").unwrap();
        assert_eq!(from(6, &db, &marker_tree, b"format", b"7").unwrap(), 3);
        assert_eq!(marker_tree.get(b"format").unwrap().as_deref(), Some(&b"7"[..]));

        let (request, up, state) = read_all(&db);
        let Request::Counter { cmd: MetaCommand::Put(p), now_ms: 9, .. } = request else {
            panic!("a put stays one: {request:?}")
        };
        assert_eq!((p.limit, p.replicas), (limit, None));
        assert_eq!((up.spec.limit, up.spec.replicas), (limit, None));
        assert_eq!((&up.layout, up.created_at_ms, up.version), (&layout(), 3, 4));
        assert_eq!(state.counters[&name()], up);
        assert_eq!(state.auto, BTreeMap::from([(name(), bounds)]), "auto bounds kept");
        assert_eq!(state.tombstones[&name()], vec![(0, 4)], "a tombstone's words are its generations");
        // Today's records are not format 6's, nor format 5's.
        assert!(from(6, &db, &marker_tree, b"format", b"7").is_err());
        let meta5 = CounterMetaV5 { spec: spec_v5(), layout: layout(), created_at_ms: 3, version: 4 };
        let db = old_database::<TypeConfigV4, _, _>(MetaCommandV5::Ensure, meta5);
        let marker_tree = db.open_tree("identity").unwrap();
        assert!(from(6, &db, &marker_tree, b"format", b"7").is_err());
        assert_eq!(marker_tree.get(b"format").unwrap(), None, "nothing written");
    }

    #[test]
    fn a_format_seven_database_upgrades_without_deadlines_or_namespaces() {
        let spec = tally_core::spec::CounterSpec { replicas: Some(3), ..Default::default() };
        let meta = CounterMetaV8 { spec, layout: layout(), created_at_ms: 3, version: 4 };
        let state = MetaStateV7 {
            counters: [(name(), meta.clone())].into(),
            tombstones: BTreeMap::new(),
            members: vec!["node1".into()],
            placement_epoch: 1,
            previous: vec![],
            handoff: vec![],
            stores: BTreeMap::new(),
            applied_requests: 5,
            auto: BTreeMap::new(),
            classes: [(3, vec!["node1".to_owned()])].into(),
            formations: [(7, vec![(1, "node1".to_owned())])].into(),
        };
        let request = Request::Counter { name: name(), cmd: MetaCommand::Ensure, now_ms: 9 };
        let db = database_of::<TypeConfig, _, _>(request.clone(), &meta, &state);
        let marker_tree = db.open_tree("identity").unwrap();
        assert_eq!(from(7, &db, &marker_tree, b"format", b"8").unwrap(), 3);
        assert_eq!(marker_tree.get(b"format").unwrap().as_deref(), Some(&b"8"[..]));
        let (up_request, up, up_state) = read_all(&db);
        assert_eq!(up_request, request, "format 7's entries are today's");
        assert_eq!((up.spec, &up.layout, up.version, up.expires_at_ms), (spec, &layout(), 4, None));
        assert_eq!(up_state.counters[&name()], up);
        assert_eq!((up_state.classes, up_state.formations), (state.classes, state.formations));
        assert!(up_state.namespaces.is_empty());
        // Today's records are not format 7's.
        assert!(from(7, &db, &marker_tree, b"format", b"8").is_err());
    }
}
