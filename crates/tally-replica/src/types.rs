//! What a range group replicates: batches of absolute shard images.

use serde::{Deserialize, Serialize};
use std::fmt;
use tally_core::ranges::RangeId;
use tally_core::shard::ShardWrite;
use tally_core::ShardId;

openraft::declare_raft_types!(
    /// The openraft type configuration of a range group: `u64` replica ids (one per
    /// store incarnation of a node), [`ReplicaNode`] naming the node, snapshots
    /// streamed from and into the store in frames ([`crate::snapshot`]).
    pub RangeConfig:
        D = Batch,
        R = BatchReport,
        NodeId = ReplicaId,
        Node = ReplicaNode,
        SnapshotData = crate::snapshot::RangeSnapshot,
        AsyncRuntime = tally_raft_kit::SeededRuntime,
);

/// A replica's raft id: chosen when a node's store is created and kept for the
/// life of that store, so a node that comes back with an empty disk is a *new*
/// replica that must be added (as a learner first), never the old voter.
pub type ReplicaId = u64;

/// A running range group.
pub type Raft = openraft::Raft<RangeConfig>;
/// A log entry of a range group.
pub type Entry = openraft::Entry<RangeConfig>;
/// A log id of a range group.
pub type LogId = openraft::LogId<ReplicaId>;
/// A membership as stored with the log id that introduced it.
pub type StoredMembership = openraft::StoredMembership<ReplicaId, ReplicaNode>;
/// A snapshot's metadata.
pub type SnapshotMeta = openraft::SnapshotMeta<ReplicaId, ReplicaNode>;
/// A storage error as openraft expects it.
pub type StorageError = openraft::StorageError<ReplicaId>;

/// Bytes of keys and values per snapshot frame (one `install_snapshot` call): a
/// frame is read, sent, staged and acknowledged before the next, so this bounds
/// what a snapshot holds in memory on either side, and one lost frame costs one
/// resend of this much.
pub const SNAPSHOT_CHUNK_BYTES: u64 = 1 << 20;

/// Most shard images one entry carries: one group commit's worth.
pub const BATCH_IMAGES_MAX: usize = 1_024;
/// Most dedup record changes (puts plus removals) one image carries: a bound on
/// garbage, above any write the engine makes (a dedup sweep page, up to
/// `dedup_sweep_records_max` expired ids, 10,000 by default; a hand-off page of
/// `HANDOFF_RECORDS_MAX`, 4,096). What an entry may carry is bounded by its bytes
/// (`GroupsConfig::entry_bytes_max`), and a write past either bound is refused alone,
/// never with the other writes of its cycle.
pub const IMAGE_RECORDS_MAX: usize = 1 << 16;
const _: () = assert!(IMAGE_RECORDS_MAX >= tally_core::handoff_machine::HANDOFF_RECORDS_MAX);

/// The node a replica runs on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaNode {
    /// The node's stable name.
    pub node: String,
}

impl fmt::Display for ReplicaNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.node)
    }
}

/// The absolute state of one shard after one of its commits: the image the shard
/// commit wrote (value and sketches, never a delta), the dedup records that commit
/// put and removed (each an absolute per-key value), whether the shard is sealed,
/// and the shard's commit sequence. Applying it twice, or after a newer image of
/// the same shard, changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The shard.
    pub shard: ShardId,
    /// The shard's commit sequence, increasing with every commit of its writer.
    pub seq: u64,
    /// The image and the dedup records it changes (`tally_core::shard::ShardWrite`).
    pub write: ShardWrite,
    /// Whether a resharding sealed the shard.
    pub sealed: bool,
    /// Whether every dedup record the shard held goes before this image's are put
    /// (the shard was deleted: its image is then the empty one).
    pub clear: bool,
}

/// The payload of one log entry: shard images of one range, from one group commit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The range the images belong to (checked on apply).
    pub range: RangeId,
    /// The images, at most [`BATCH_IMAGES_MAX`].
    pub images: Vec<ShardEntry>,
}

/// What applying one entry did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchReport {
    /// Images that replaced an older one (or were the first of their shard).
    pub applied: u32,
    /// Images ignored because the shard already held the same or a newer sequence.
    pub stale: u32,
    /// Images refused because the entry named another range than the group's.
    pub misrouted: u32,
    /// The positions, in the batch, of the images that were not applied (stale or
    /// misrouted): their writers' commits failed.
    pub refused: Vec<u32>,
}

/// One shard as a range holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredShard {
    /// The sequence of the image held.
    pub seq: u64,
    /// The image.
    pub image: tally_core::shard::ShardImage,
    /// Whether the shard is sealed.
    pub sealed: bool,
}
