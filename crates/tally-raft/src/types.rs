//! What travels through the replicated log: the openraft type configuration, the
//! commands ([`Request`]) and what applying them answered ([`Response`]).
//!
//! `tally_core::meta::MetaEffect` and `MetaError` have no serde derives (and
//! `SpecError` holds `&'static str`s, which cannot be deserialized), so the applied
//! result carries serializable mirrors of them: [`Effect`] and [`Rejection`].

use crate::store_id::StoreId;
use serde::{Deserialize, Serialize};
use std::io::Cursor;
use tally_core::meta::{CounterMeta, MetaCommand, MetaEffect, MetaError, SealedGeneration};
use tally_core::name::CounterName;
use tally_core::spec::{AutoShards, SpecError};

/// Largest accepted request body, in bytes. A snapshot chunk is at most
/// `SNAPSHOT_CHUNK_BYTES` of data, which JSON encodes as up to 4 bytes per byte.
pub const RAFT_BODY_BYTES_MAX: usize = 16 << 20;

openraft::declare_raft_types!(
    /// The openraft type configuration of Tally's metadata group: `u64` node ids,
    /// [`openraft::BasicNode`] whose `addr` is the node's raft RPC address
    /// (`127.0.0.1:port`), snapshots held in memory as bytes, and tokio as the
    /// runtime with a random generator a simulation seeds
    /// ([`tally_raft_kit::SeededRuntime`]).
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = tally_raft_kit::SeededRuntime,
);

/// A raft node id. Stable for the life of a node's disk.
pub type NodeId = u64;

/// A running openraft node of the metadata group.
pub type Raft = openraft::Raft<TypeConfig>;

/// A replicated log entry of the metadata group.
pub type Entry = openraft::Entry<TypeConfig>;

/// A log id (term, leader, index) of the metadata group.
pub type LogId = openraft::LogId<NodeId>;

/// A membership of the metadata group as stored with the log id that introduced it.
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;

/// A snapshot's metadata in the metadata group.
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, openraft::BasicNode>;

/// A storage error as openraft expects it.
pub type StorageError = openraft::StorageError<NodeId>;

/// A command of the replicated metadata state machine. Everything that may differ
/// between replicas (the clock) is chosen by the proposer and carried in the entry,
/// so every replica computes the same result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Apply a metadata command to one counter through
    /// `tally_core::meta::apply_command`.
    Counter {
        /// The counter.
        name: CounterName,
        /// What to do to it.
        cmd: MetaCommand,
        /// The proposer's clock, in milliseconds since the Unix epoch; the only time
        /// the transition sees.
        now_ms: u64,
    },
    /// Forget the tombstone of a deleted counter once the data plane has deleted the
    /// shards it lists.
    ClearTombstone {
        /// The deleted counter.
        name: CounterName,
    },
    /// Replace the placement ring's members, if the placement epoch is still
    /// `from_epoch` and no hand-off is under way. Every node of `previous` must then
    /// hand off the shards it no longer owns and report [`Request::HandoffDone`].
    SetMembers {
        /// The epoch the proposer computed `members` from.
        from_epoch: u64,
        /// The members at `from_epoch` as the proposer knows them (at epoch 0 they
        /// come from the shared config, which the state machine never sees).
        previous: Vec<String>,
        /// The new members.
        members: Vec<String>,
    },
    /// `node` holds no shard it does not own at `epoch` any more.
    HandoffDone {
        /// The data-plane node.
        node: String,
        /// The placement epoch it handed off for.
        epoch: u64,
    },
    /// Raft node `node` runs on the data directory `store`. Written by every node
    /// once a leader is known; the first record for a node is kept, and a different
    /// store id for a recorded node is refused ([`StoreRejection::Replaced`]): a
    /// node with a new disk rejoins through [`Request::ReplaceStore`].
    RegisterStore {
        /// The raft node id.
        node: NodeId,
        /// Its store incarnation.
        store: StoreId,
    },
    /// Raft node `node` came back with a new data directory `store`: its earlier
    /// data is lost. Written by the leader while it re-adds the node, after removing
    /// the old incarnation from the raft membership.
    ReplaceStore {
        /// The raft node id.
        node: NodeId,
        /// The new store incarnation.
        store: StoreId,
    },
    /// The operator accepts that incarnation `store` of `node` lost its
    /// predecessor's data: its shards count again (from what they hold now).
    AcceptLoss {
        /// The raft node id.
        node: NodeId,
        /// The incarnation whose loss is accepted (an accept for an older one is
        /// refused, so it never clears a newer loss).
        store: StoreId,
    },
    /// [`Request::Counter`], also setting whether the counter's shard count follows
    /// contention: its auto bounds, or `None` to make it fixed. Both in one change.
    CounterAuto {
        /// The counter.
        name: CounterName,
        /// What to do to it.
        cmd: MetaCommand,
        /// Its auto bounds after the change (`None`: fixed).
        auto: Option<AutoShards>,
        /// The proposer's clock, in milliseconds since the Unix epoch.
        now_ms: u64,
    },
    /// Record the voters (replica id and node) the group of `range` (a range of a
    /// replica class of counters' own counts) starts with, unless a record exists:
    /// the first one stays, and every node that forms the group forms it with that
    /// one, so no two nodes start it with different voters.
    FormRange {
        /// The range ([`tally_core::ranges::RangeId`]'s number).
        range: u32,
        /// Its first voters.
        voters: Vec<(u64, String)>,
    },
    /// Reshard an auto counter to `shards`, only if it is still auto and its metadata
    /// still at `version` ([`Rejection::AutoStale`] otherwise): a node's decision made
    /// from a stale look, or crossing another's, never undoes a change.
    AutoReshard {
        /// The counter.
        name: CounterName,
        /// The metadata version the decision was made from.
        version: u64,
        /// The new shard count.
        shards: u16,
        /// The proposer's clock, in milliseconds since the Unix epoch.
        now_ms: u64,
    },
    /// `request` under the identity its proposer gave it. A proposer that resends a
    /// proposal whose outcome it does not know (a local timeout, a forwarded write
    /// whose answer was lost) resends it under the same identity: the state machine
    /// applies it once and answers every copy with the first answer
    /// ([`crate::state::MetaState`]'s proposal book). Proposals written before the
    /// book existed are the bare requests above.
    Proposal {
        /// Who proposed it, and its number among their proposals.
        id: ProposalId,
        /// What it asks.
        request: Box<Request>,
    },
    /// Declare (or replace) the namespace `prefix`: counters created implicitly
    /// under it take `spec` ([`tally_core::namespace`]). The proposer checked the
    /// spec; the state refuses a new prefix past `NAMESPACES_MAX`.
    PutNamespace {
        /// The name prefix.
        prefix: String,
        /// What counters created under it take.
        spec: tally_core::namespace::NamespaceSpec,
    },
    /// Drop the namespace `prefix` (counters created under it keep their specs).
    DeleteNamespace {
        /// The name prefix.
        prefix: String,
    },
    /// Create every counter of `names` that does not exist, in order, as
    /// [`Request::Counter`] with `MetaCommand::EnsureWith(default)` would one by one:
    /// the counters first incremented while one creation commits share the next
    /// entry. Applying it twice changes nothing the second time (each name exists
    /// then), so a proposer resends it bare, without a proposal identity.
    EnsureMany {
        /// The counters, at most [`ENSURE_MANY_MAX`].
        names: Vec<CounterName>,
        /// What a counter under no namespace takes.
        default: tally_core::namespace::NamespaceSpec,
        /// The proposer's clock, in milliseconds since the Unix epoch.
        now_ms: u64,
    },
}

/// Most counters one [`Request::EnsureMany`] creates: the engine's creation batch
/// (`tally_engine::CREATE_BATCH_MAX`), so one entry stays within a few hundred KiB.
pub const ENSURE_MANY_MAX: usize = 1024;

/// The identity of one proposal: its proposer (one run of one node's metadata
/// member: drawn at random when it starts, so no two runs share one —
/// `tally_raft_kit::random_u128`, which a seeded simulation draws again) and its
/// number among that proposer's proposals, counting from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ProposalId {
    /// The proposer.
    pub proposer: u128,
    /// The proposal's number.
    pub seq: u64,
}

/// What the metadata group knows of one raft node's data directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreRecord {
    /// The incarnation the node runs on.
    pub store: StoreId,
    /// Whether it replaced an incarnation whose data is lost, and the operator has
    /// not accepted the loss yet: reads of its shards must say they are missing.
    pub data_lost: bool,
}

/// Why a store command was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum StoreRejection {
    /// The node is recorded with another store: it lost its disk and must rejoin as
    /// a new incarnation.
    #[error("node {node} is recorded with store {recorded}, not {got}: it must rejoin as a new incarnation")]
    Replaced {
        /// The raft node id.
        node: NodeId,
        /// The recorded store.
        recorded: StoreId,
        /// The store named.
        got: StoreId,
    },
    /// No store is recorded for the node.
    #[error("no store is recorded for node {node}")]
    Unknown {
        /// The raft node id.
        node: NodeId,
    },
}

/// What applying one log entry answered. Domain refusals are part of the applied
/// result (every replica refuses the same way), never a raft error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// The entry was not a [`Request`] (a leader's blank entry or a raft membership
    /// change); nothing application-visible happened.
    Nothing,
    /// The answer to [`Request::Counter`]: the counter's metadata after the command
    /// (`None` if it does not exist) and what happened, or why it was refused.
    Counter(CounterAnswer),
    /// The answer to [`Request::ClearTombstone`].
    TombstoneCleared {
        /// Whether there was a tombstone to clear (false on a retried request).
        existed: bool,
    },
    /// The answer to [`Request::SetMembers`] and [`Request::HandoffDone`].
    Members(Result<MembersView, MemberRejection>),
    /// The answer to the store commands: the node's record after the command.
    Store(Result<StoreRecord, StoreRejection>),
    /// The answer to [`Request::FormRange`]: the voters the range's group starts
    /// with, as first recorded.
    Formation(Vec<(u64, String)>),
    /// A [`Request::Proposal`] resent after its proposer's book forgot it (more
    /// than [`crate::state::PROPOSALS_REMEMBERED_MAX`] later proposals of the same
    /// proposer were applied meanwhile): it may or may not have been applied before,
    /// and it was not applied now.
    Forgotten,
    /// The answer to the namespace requests: whether the prefix was declared before,
    /// or why the request was refused.
    Namespace(Result<bool, String>),
    /// The answer to [`Request::EnsureMany`]: per name, in order, what
    /// [`Response::Counter`] would have answered.
    Ensured(Vec<CounterAnswer>),
}

/// What applying a command to one counter answered: its metadata after the command
/// (`None` if it does not exist) and what happened, or why it was refused.
pub type CounterAnswer = Result<(Option<CounterMeta>, Effect), Rejection>;

impl Response {
    /// The counter result, if this answers a [`Request::Counter`], converted back to
    /// tally-core's effect type.
    pub fn into_counter_result(self) -> Option<Result<(Option<CounterMeta>, MetaEffect), Rejection>> {
        match self {
            Response::Counter(r) => Some(r.map(|(meta, effect)| (meta, effect.into()))),
            _ => None,
        }
    }
}

/// The data plane's view of membership after a change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MembersView {
    /// Member node ids, sorted.
    pub members: Vec<String>,
    /// Bumped by every change of `members`; placement caches compare it.
    pub placement_epoch: u64,
    /// The members before the last change, while a hand-off is under way.
    pub previous: Vec<String>,
    /// Nodes of `previous` that have not finished handing off yet; empty once the
    /// change has settled.
    pub handoff: Vec<String>,
    /// Whether the command changed anything (false when adding a present node or
    /// removing an absent one, e.g. on a retried request).
    pub changed: bool,
}

/// Why a membership command was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum MemberRejection {
    /// The node id is empty, too long or uses bytes outside `[A-Za-z0-9._:-]`.
    #[error("invalid node id: {reason}")]
    InvalidNode {
        /// The validator's explanation.
        reason: String,
    },
    /// The members changed since the proposer looked.
    #[error("membership changed meanwhile (placement epoch {current}, proposed from {got}); retry")]
    StaleEpoch {
        /// The current epoch.
        current: u64,
        /// The epoch the proposal was computed from.
        got: u64,
    },
    /// The previous change is still moving shards.
    #[error("shards are still moving after the last membership change (waiting for {waiting:?})")]
    HandoffUnderWay {
        /// Nodes that have not finished handing off.
        waiting: Vec<String>,
    },
    /// Counters are being resharded: their sealed shards must not move meanwhile.
    #[error("{count} counters are being resharded; change the membership once they are done")]
    ReshardingUnderWay {
        /// How many.
        count: usize,
    },
    /// A membership must keep at least one node.
    #[error("the cluster must keep at least one member")]
    NoMembers,
    /// The ring would grow past its node limit.
    #[error("the cluster already has {count} members; the limit is {max}")]
    TooManyMembers {
        /// Current member count.
        count: usize,
        /// The limit.
        max: usize,
    },
}

/// Serializable mirror of `tally_core::meta::MetaEffect`: what a counter command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Effect {
    /// The counter was created.
    Created,
    /// The counter changed.
    Updated,
    /// Nothing changed.
    Unchanged,
    /// Sealed generations left; their shards' data may be deleted.
    Pruned(Vec<SealedGeneration>),
    /// The counter was deleted; every listed `(generation, shards)` may be deleted.
    /// The same list is kept as the counter's tombstone.
    Deleted(Vec<(u32, u16)>),
    /// The counter did not exist.
    Missing,
}

impl From<MetaEffect> for Effect {
    fn from(e: MetaEffect) -> Self {
        match e {
            MetaEffect::Created => Effect::Created,
            MetaEffect::Updated => Effect::Updated,
            MetaEffect::Unchanged => Effect::Unchanged,
            MetaEffect::Pruned(g) => Effect::Pruned(g),
            MetaEffect::Deleted(g) => Effect::Deleted(g),
            MetaEffect::Missing => Effect::Missing,
        }
    }
}

impl From<Effect> for MetaEffect {
    fn from(e: Effect) -> Self {
        match e {
            Effect::Created => MetaEffect::Created,
            Effect::Updated => MetaEffect::Updated,
            Effect::Unchanged => MetaEffect::Unchanged,
            Effect::Pruned(g) => MetaEffect::Pruned(g),
            Effect::Deleted(g) => MetaEffect::Deleted(g),
            Effect::Missing => MetaEffect::Missing,
        }
    }
}

/// Serializable mirror of `tally_core::meta::MetaError`: why a counter command was
/// refused. The messages match tally-core's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Rejection {
    /// A spec field outside its range (`SpecError::OutOfRange`).
    #[error("{field} must be between {min} and {max} (got {got})")]
    OutOfRange {
        /// The field.
        field: String,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
        /// What was given.
        got: u64,
    },
    /// A textual spec field with an unknown word (`SpecError::UnknownWord`).
    #[error("{field} must be one of {expected:?} (got {found:?})")]
    UnknownWord {
        /// The field.
        field: String,
        /// What was given.
        found: String,
        /// The accepted words.
        expected: Vec<String>,
    },
    /// A frequency option out of its bounds, a change of a fixed one, or bounds that
    /// are inverted, exclude the new counter's 0, lack `sync`, or would change
    /// (`SpecError::Frequency`, `FrequencyFixed`, `BoundsInverted`, `BoundsExcludeZero`,
    /// `BoundedNeedsSync`, `BoundsFixed`), or a window limit that names a window not
    /// kept, comes with bounds, or would change (`LimitWindowNotKept`,
    /// `LimitWithBounds`, `LimitFixed`), a replica count that would change
    /// (`ReplicasFixed`) or of two (`TwoCopies`), or a resharding past the last
    /// generation (`GenerationsExhausted`), with core's message.
    #[error("{message}")]
    Frequency {
        /// tally-core's message.
        message: String,
    },
    /// A second resharding was asked for while one is in progress.
    #[error("counter is being resharded to {target} shards; retry when it completes")]
    Resharding {
        /// The shard count being moved to.
        target: u16,
    },
    /// Too many sealed generations are still inside their dedup window.
    #[error("counter was resharded {count} times within its dedup window; retry later")]
    TooManyGenerations {
        /// How many are sealed.
        count: usize,
    },
    /// A completion named a generation that is not the one being sealed (for
    /// example a `CompleteReshard` applied a second time).
    #[error("generation {got} is not being resharded (current generation {current})")]
    StaleGeneration {
        /// The counter's current generation.
        current: u32,
        /// The generation named.
        got: u32,
    },
    /// An auto resharding decided from metadata `version`, found at `found` (or not
    /// auto, or gone).
    #[error("auto resharding decided at version {version} is stale (now {found:?})")]
    AutoStale {
        /// The version the decision was made from.
        version: u64,
        /// The counter's version now, if it exists and is auto.
        found: Option<u64>,
    },
    /// The counter expired: it must be reclaimed before it is created anew.
    #[error("the counter expired at {expires_at_ms} ms since the Unix epoch")]
    Expired {
        /// Its deadline.
        expires_at_ms: u64,
    },
}

impl From<MetaError> for Rejection {
    fn from(e: MetaError) -> Self {
        match e {
            MetaError::Spec(SpecError::OutOfRange { field, min, max, got }) => {
                Rejection::OutOfRange { field: field.to_owned(), min, max, got }
            }
            MetaError::Spec(SpecError::UnknownWord { field, found, expected }) => Rejection::UnknownWord {
                field: field.to_owned(),
                found,
                expected: expected.iter().map(|w| (*w).to_owned()).collect(),
            },
            MetaError::Spec(
                e @ (SpecError::Frequency(_)
                | SpecError::FrequencyFixed { .. }
                | SpecError::BoundsInverted { .. }
                | SpecError::BoundedNeedsSync
                | SpecError::BoundsExcludeZero { .. }
                | SpecError::BoundsFixed { .. }
                | SpecError::BoundedAuto
                | SpecError::LimitWindowNotKept { .. }
                | SpecError::LimitWithBounds
                | SpecError::LimitFixed { .. }
                | SpecError::ReplicasFixed { .. }
                | SpecError::Unreplicated { .. }
                | SpecError::TwoCopies
                | SpecError::GenerationsExhausted { .. }),
            ) => Rejection::Frequency { message: e.to_string() },
            // Auto bounds are resolved by the engine before any command is proposed,
            // and a window set is checked when it is built, so no metadata command
            // raises these; should one, its message travels in the variant that
            // carries core's text (the answer's layout stays).
            MetaError::Spec(
                e @ (SpecError::AutoAndFixed | SpecError::BoundsWithoutAuto | SpecError::Window(_)),
            ) => Rejection::Frequency { message: e.to_string() },
            MetaError::Resharding { target } => Rejection::Resharding { target },
            MetaError::TooManyGenerations { count } => Rejection::TooManyGenerations { count },
            MetaError::StaleGeneration { current, got } => Rejection::StaleGeneration { current, got },
            MetaError::Expired { expires_at_ms } => Rejection::Expired { expires_at_ms },
        }
    }
}

/// One change the state machine applied, announced to subscribers so the data plane
/// can refresh its caches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaChange {
    /// The counter's metadata changed (created, updated or deleted — a deleted
    /// counter also has a tombstone now).
    Counter(CounterName),
    /// The counter's tombstone was cleared.
    TombstoneCleared(CounterName),
    /// Data-plane membership, or the progress of its hand-off, changed.
    Members(MembersView),
    /// A raft node's store record changed.
    Store(NodeId),
    /// A snapshot replaced the whole state: anything may have changed, refresh
    /// everything.
    Reset,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::spec::SpecPatch;

    #[test]
    fn rejections_mirror_core_errors_with_the_same_message() {
        let cmd = MetaCommand::Put(SpecPatch { shards: Some(0), ..Default::default() });
        let err = tally_core::meta::apply_command(None, &cmd, 1).unwrap_err();
        let mirrored = Rejection::from(err.clone());
        assert_eq!(mirrored.to_string(), err.to_string());
        let json = serde_json::to_string(&mirrored).unwrap();
        assert_eq!(serde_json::from_str::<Rejection>(&json).unwrap(), mirrored);
    }

    #[test]
    fn effects_round_trip_through_the_mirror() {
        for e in [MetaEffect::Created, MetaEffect::Deleted(vec![(0, 8)]), MetaEffect::Missing] {
            assert_eq!(MetaEffect::from(Effect::from(e.clone())), e);
        }
    }
}
