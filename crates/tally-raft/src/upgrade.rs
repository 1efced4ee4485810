//! Upgrading a raft database of format 1 or 2 to today's format, in place.
//!
//! Format 1's log entries, counter records and snapshot hold counter specs and spec
//! patches of format 1's layout (`tally_core::format::v1`), format 2's those of
//! format 2 (`tally_core::format::v3`: format 3 added windows). An upgrade decodes each
//! with the frozen types, converts it and writes it back, together with the new
//! format marker, in one sled transaction: a crash leaves the database either all
//! of the old format or all today's.

use crate::log_store::LOG_TREE;
use crate::state::MetaState;
use crate::state_machine::{KEY_SNAPSHOT, PREFIX_COUNTER, SM_TREE, SNAPSHOT_TREE};
use crate::store_id::StoreId;
use crate::types::{NodeId, Request, StoreRecord, TypeConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Cursor;
use tally_core::codec::{decode, encode, DecodeError};
use tally_core::format::v1::{upgrade_counter_meta, CounterMetaV1, MetaCommandV1};
use tally_core::format::v3::{CounterMetaV3, MetaCommandV3};
use tally_core::format::Rewrite;
use tally_core::name::CounterName;

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

/// [`Request`] as formats 1 and 2 stored it: only the counter command's layout
/// (`C`) differs between them and today.
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

impl<C: Into<tally_core::meta::MetaCommand>> From<RequestOld<C>> for Request {
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

/// [`MetaState`] as format 2 stored it (inside snapshots).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct MetaStateV2 {
    counters: BTreeMap<CounterName, CounterMetaV3>,
    tombstones: BTreeMap<CounterName, Vec<(u32, u16)>>,
    members: Vec<String>,
    placement_epoch: u64,
    previous: Vec<String>,
    handoff: Vec<String>,
    stores: BTreeMap<NodeId, StoreRecord>,
    applied_requests: u64,
}

impl From<MetaStateV2> for MetaState {
    fn from(v: MetaStateV2) -> Self {
        MetaState {
            counters: v.counters.into_iter().map(|(name, meta)| (name, meta.into())).collect(),
            tombstones: v.tombstones,
            members: v.members,
            placement_epoch: v.placement_epoch,
            previous: v.previous,
            handoff: v.handoff,
            stores: v.stores,
            applied_requests: v.applied_requests,
        }
    }
}

fn upgrade_entry_v2(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let old: openraft::Entry<TypeConfigV2> = decode("format-2 raft log entry", bytes)?;
    let payload = match old.payload {
        openraft::EntryPayload::Blank => openraft::EntryPayload::Blank,
        openraft::EntryPayload::Normal(r) => openraft::EntryPayload::Normal(Request::from(r)),
        openraft::EntryPayload::Membership(m) => openraft::EntryPayload::Membership(m),
    };
    Ok(encode(&openraft::Entry::<TypeConfig> { log_id: old.log_id, payload }))
}

fn upgrade_snapshot_v2(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let old: StoredSnapshot = decode("format-2 snapshot", bytes)?;
    let state: MetaStateV2 = decode("format-2 snapshot state", &old.data)?;
    Ok(encode(&StoredSnapshot { meta: old.meta, data: encode(&MetaState::from(state)) }))
}

/// [`MetaState`] as format 1 stored it (inside snapshots).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct MetaStateV1 {
    counters: BTreeMap<CounterName, CounterMetaV1>,
    tombstones: BTreeMap<CounterName, Vec<(u32, u16)>>,
    members: Vec<String>,
    placement_epoch: u64,
    previous: Vec<String>,
    handoff: Vec<String>,
    stores: BTreeMap<NodeId, StoreRecord>,
    applied_requests: u64,
}

impl From<MetaStateV1> for MetaState {
    fn from(v: MetaStateV1) -> Self {
        MetaState {
            counters: v.counters.into_iter().map(|(name, meta)| (name, meta.into())).collect(),
            tombstones: v.tombstones,
            members: v.members,
            placement_epoch: v.placement_epoch,
            previous: v.previous,
            handoff: v.handoff,
            stores: v.stores,
            applied_requests: v.applied_requests,
        }
    }
}

/// A stored snapshot's shape (see `state_machine.rs`), with its state still encoded.
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: openraft::SnapshotMeta<NodeId, openraft::BasicNode>,
    data: Vec<u8>,
}

fn upgrade_entry(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let old: openraft::Entry<TypeConfigV1> = decode("format-1 raft log entry", bytes)?;
    let payload = match old.payload {
        openraft::EntryPayload::Blank => openraft::EntryPayload::Blank,
        openraft::EntryPayload::Normal(r) => openraft::EntryPayload::Normal(Request::from(r)),
        openraft::EntryPayload::Membership(m) => openraft::EntryPayload::Membership(m),
    };
    Ok(encode(&openraft::Entry::<TypeConfig> { log_id: old.log_id, payload }))
}

fn upgrade_snapshot(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let old: StoredSnapshot = decode("format-1 snapshot", bytes)?;
    let state: MetaStateV1 = decode("format-1 snapshot state", &old.data)?;
    Ok(encode(&StoredSnapshot { meta: old.meta, data: encode(&MetaState::from(state)) }))
}

/// Why an upgrade failed; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// sled failed.
    #[error("upgrading the raft store: {0}")]
    Sled(#[from] sled::Error),
    /// A record is not of format 1.
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

/// Rewrites every format-1 record of `db` in today's format and writes `marker`
/// under `marker_key` in `marker_tree`, all in one transaction; returns how many
/// records it rewrote.
pub(crate) fn from_v1(
    db: &sled::Db,
    marker_tree: &sled::Tree,
    marker_key: &[u8],
    marker: &[u8],
) -> Result<u64, UpgradeError> {
    let rewrites =
        Rewrites { entry: &upgrade_entry, counter: &upgrade_counter_meta, snapshot: &upgrade_snapshot };
    from_old(db, marker_tree, (marker_key, marker), rewrites)
}

/// Rewrites every format-2 record of `db` in today's format, as [`from_v1`] does.
pub(crate) fn from_v2(
    db: &sled::Db,
    marker_tree: &sled::Tree,
    marker_key: &[u8],
    marker: &[u8],
) -> Result<u64, UpgradeError> {
    let rewrites = Rewrites {
        entry: &upgrade_entry_v2,
        counter: &tally_core::format::v3::upgrade_counter_meta,
        snapshot: &upgrade_snapshot_v2,
    };
    from_old(db, marker_tree, (marker_key, marker), rewrites)
}

/// The rewrites of one older format's records.
struct Rewrites<'a> {
    entry: Rewrite<'a>,
    counter: Rewrite<'a>,
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
    use tally_core::meta::{CounterMeta, Layout, MetaCommand};
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

    #[test]
    fn a_format_two_database_upgrades_with_no_windows() {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let name = CounterName::new("c").unwrap();
        let layout = Layout { generation: 1, shards: 6, base: 2, sealed: vec![], resharding: None };
        let meta = CounterMetaV3 { spec: spec_v3(), layout: layout.clone(), created_at_ms: 3, version: 4 };
        let put = MetaCommandV3::Put(SpecPatchV3 { distinct: Some(true), ..Default::default() });
        let entry = openraft::Entry::<TypeConfigV2> {
            log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), 7),
            payload: openraft::EntryPayload::Normal(RequestOld::Counter {
                name: name.clone(),
                cmd: put,
                now_ms: 9,
            }),
        };
        let log = db.open_tree(LOG_TREE).unwrap();
        log.insert(7u64.to_be_bytes(), encode(&entry)).unwrap();
        let sm = db.open_tree(SM_TREE).unwrap();
        sm.insert([PREFIX_COUNTER, b"c"].concat(), encode(&meta)).unwrap();
        let state = MetaStateV2 { counters: [(name.clone(), meta)].into(), ..Default::default() };
        let snapshot = StoredSnapshot {
            meta: openraft::SnapshotMeta {
                last_log_id: None,
                last_membership: openraft::StoredMembership::default(),
                snapshot_id: "s".into(),
            },
            data: encode(&state),
        };
        db.open_tree(SNAPSHOT_TREE).unwrap().insert(KEY_SNAPSHOT, encode(&snapshot)).unwrap();
        let marker_tree = db.open_tree("identity").unwrap();
        assert_eq!(from_v2(&db, &marker_tree, b"format", b"3").unwrap(), 3);
        assert_eq!(marker_tree.get(b"format").unwrap().as_deref(), Some(&b"3"[..]));

        let up: openraft::Entry<TypeConfig> =
            decode("entry", &log.get(7u64.to_be_bytes()).unwrap().unwrap()).unwrap();
        let openraft::EntryPayload::Normal(Request::Counter { cmd: MetaCommand::Put(p), now_ms: 9, .. }) =
            up.payload
        else {
            panic!("a counter put stays one")
        };
        assert_eq!((p.distinct, p.windows), (Some(true), None));
        let up: CounterMeta =
            decode("meta", &sm.get([PREFIX_COUNTER, b"c"].concat()).unwrap().unwrap()).unwrap();
        assert_eq!((up.spec.shards, up.spec.windows, up.layout), (6, WindowSet::NONE, layout));
        let snap: StoredSnapshot =
            decode("snapshot", &db.open_tree(SNAPSHOT_TREE).unwrap().get(KEY_SNAPSHOT).unwrap().unwrap())
                .unwrap();
        let state: MetaState = decode("state", &snap.data).unwrap();
        assert_eq!(state.counters[&name].spec.windows, WindowSet::NONE);
        // Today's records are not format 2's: a second upgrade refuses them, changing nothing.
        assert!(from_v2(&db, &marker_tree, b"format", b"3").is_err());
    }
}
