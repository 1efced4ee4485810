//! Shard replication: one openraft 0.9 group per range of the ring.
//!
//! [`tally_core::ranges`] cuts the ring into a bounded number of ranges and names
//! each range's replicas; this crate runs the groups. A group's log entries are
//! batches of *absolute* shard images ([`ShardEntry`]: the shard's image, the dedup
//! records its commit put and removed, its seal and its commit sequence), never
//! deltas, and applying keeps the image with the higher sequence: a replayed entry,
//! or an older image after a newer one, changes nothing.
//!
//! # Layout
//!
//! * [`storage`] — the ordered key-value storage underneath: [`SledKv`] (every group
//!   of a node in one `sled::Db` with a bounded page cache, trees
//!   `replica/<range>/{log,vote,sm…,snap}`, one shared flusher) and [`MemKv`] (same
//!   contract, with simulated crashes that keep any prefix of the unflushed writes,
//!   and failing flushes);
//! * [`log_store`] — the log and vote, flushed before an append or a vote is
//!   reported, so nothing is acknowledged that a crash can take back;
//! * [`state_machine`] — the range's shards and dedup records, on disk in the
//!   range's state tree, stored by each apply with its apply position (one atomic
//!   batch when dedup records change); reads go to the tree, one image or record
//!   at a time;
//! * [`snapshot`] — a range's snapshot as it travels: frames of the state tree's
//!   pairs read from the live tree (every image before every record; the log after
//!   the snapshot's id makes the fuzzy read exact), staged frame by frame in the
//!   next generation of the state tree on the receiver, resumable;
//! * [`network`] — [`RangeNetwork`], multiplexed by range so all groups of a node
//!   share one connection per node pair, with appends and snapshot frames bounded
//!   to one node-to-node message, and [`MemRouter`], an in-memory network with cut
//!   links, isolated and dropped replicas, lost snapshot frames;
//! * [`groups`] — [`RangeGroups`], one node's groups: open, initialize, `write`
//!   (Ok only once a quorum has the entry durably; `NotLeader` with a hint
//!   otherwise), `read_fresh` (leader read through openraft's read index),
//!   learners promoted only once caught up, removal, by joint consensus;
//! * [`store`] — [`RangeStore`], the engine's `Store` over a node's groups: the
//!   shard writes of a commit cycle become one entry per range (more if they
//!   exceed one message), applied only over the state their writer built on (see
//!   its docs); `tally-cluster` runs it, with the groups over the node-to-node
//!   sessions, when `cluster.replicas` > 1;
//! * [`runtime`] — openraft's tokio runtime with a generator of election timeouts
//!   that a simulation seeds ([`runtime::seed_thread_rng`]), from `tally-raft-kit`;
//! * [`replication`] — [`Replication`], the driver: routing to range leaders,
//!   forming groups, following membership changes, replacing emptied replicas.
//! * [`types`] — what a group replicates: [`ShardEntry`] batches of absolute shard
//!   images, and the openraft type configuration.
//!
//! # Identities
//!
//! A replica's raft id belongs to its *store*: an empty store takes a fresh id and
//! keeps it. A node that comes back with an empty disk is therefore a new replica,
//! unknown to every group: it never votes or counts towards a quorum as the voter it
//! replaced, and joins as a learner, is promoted when caught up, and the old id is
//! removed in the same joint change.
//!
//! # Limits of this version
//!
//! What a replica holds in memory does not grow with its ranges: images and
//! dedup records are read from the state tree through sled's page cache
//! ([`storage::SLED_CACHE_BYTES`]), and a snapshot, of any size, is built by
//! recording its log id and streamed a frame ([`groups::SNAPSHOT_CHUNK_BYTES`])
//! at a time. What is bounded is one message: an append carries the entries that
//! fit in [`GroupsConfig::message_bytes_max`] (by default
//! [`network::RANGE_MESSAGE_BYTES_MAX`]), and an entry may not exceed
//! [`GroupsConfig::entry_bytes_max`] (a commit cycle is cut into entries that fit;
//! a single shard write past it is refused). A snapshot is streamed while the
//! leader keeps applying, and the receiver needs the log from the snapshot's id
//! on: a stream that takes longer than the leader needs to apply
//! [`groups::SNAPSHOT_LOGS_SINCE_LAST`] entries beyond the kept log finds that log
//! purged and starts again from a newer snapshot (bench/README.md, "Scale", has
//! the times). Deleting a shard removes its records in pages of
//! [`state_machine::CLEAR_PAGE_RECORDS_MAX`] before its image, atomically only in
//! effect (a crash between pages leaves fewer records under the old image, and the
//! replay finishes the deletion).
//!
//! # Boundary of this version
//!
//! A cluster's range directory is not stored: every node computes it from the
//! initial members' directory and the current members the metadata group holds
//! ([`Replication::set_members`]), and the ranges' leaders move the groups'
//! voters to it (ARCHITECTURE.md, "Shard replication"). The number of copies is the
//! cluster's setting, unless a counter states its own (`CounterSpec::replicas`, fixed
//! at creation): counters that state the same count share the ranges of that replica
//! class ([`tally_core::ranges::replica_classes`]). The simulator runs these groups as
//! they are, over its simulated links and with openraft's generator seeded per run.

#![forbid(unsafe_code)]

pub mod groups;
pub mod log_store;
pub mod network;
pub mod replication;
pub mod runtime;
pub mod snapshot;
pub mod state_machine;
pub mod storage;
pub mod store;
pub mod types;

pub use groups::{
    GroupMembers, GroupMetrics, GroupStatus, GroupsConfig, RangeGroups, ReplicaError, ShardRead, WriteAck,
    ELECTION_TIMEOUT_MAX_MS, ELECTION_TIMEOUT_MIN_MS, FAILOVER_BOUND_MS, HEARTBEAT_MS, READ_INDEX_ATTEMPT_MS,
    REPLICA_FORMAT,
};
pub use network::{MemRouter, NetError, RangeEnvelope, RangeInbound, RangeNetwork, RangeReply, RangeRpc};
pub use replication::{Peers, Replication, ReplicationFigures, LEADER_WAIT_MS};
pub use storage::{KvStore, MemKv, SledKv};
pub use store::RangeStore;
pub use types::{Batch, BatchReport, ReplicaId, ReplicaNode, ShardEntry, StoredShard};
