//! [`RangeGroups`]: the range groups one node replicates, behind one facade.

use crate::log_store::LogStore;
use crate::network::{
    GroupNetworkFactory, NetError, RangeEnvelope, RangeInbound, RangeNetwork, RangeReply, RangeRpc,
};
use crate::network::{APPEND_OVERHEAD_BYTES, RANGE_MESSAGE_BYTES_MAX};
use crate::state_machine::{Shared, StateError, StateMachine};
use crate::storage::{KvError, KvStore, KvTree};
use crate::types::{
    Batch, BatchReport, LogId, Raft, RangeConfig, ReplicaId, ReplicaNode, ShardEntry, StoredShard,
};
use crate::types::{BATCH_IMAGES_MAX, IMAGE_RECORDS_MAX};
use futures::future::BoxFuture;
use openraft::entry::RaftEntry;
use openraft::error::{CheckIsLeaderError, ClientWriteError, ForwardToLeader, InitializeError, RaftError};
use openraft::Membership;
use parking_lot::RwLock;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;
use tally_core::dedup::DedupRecord;
use tally_core::ranges::{RangeId, RangeLayout};
use tally_core::ShardId;

/// Leader heartbeat interval, in milliseconds.
pub const HEARTBEAT_MS: u64 = 100;
/// Shortest election timeout, in milliseconds (five heartbeats: a lost heartbeat
/// or two does not start an election).
pub const ELECTION_TIMEOUT_MIN_MS: u64 = 500;
/// Longest election timeout, in milliseconds. openraft also uses it as the leader
/// lease: a follower that heard from a leader neither votes for another candidate
/// nor stands itself until the lease has run out.
pub const ELECTION_TIMEOUT_MAX_MS: u64 = 900;
/// Bound on a failover, from the leader's death to a new leader: the survivors'
/// lease runs out (at most [`ELECTION_TIMEOUT_MAX_MS`] after the last heartbeat),
/// then an election timeout (at most as long again), and one split vote costs a
/// further timeout; a heartbeat interval covers the rounds of messages.
pub const FAILOVER_BOUND_MS: u64 = 3 * ELECTION_TIMEOUT_MAX_MS + HEARTBEAT_MS;
const _: () = assert!(FAILOVER_BOUND_MS <= 3_000, "failover must stay within 3 s");
/// How long a write waits for its quorum before answering `Timeout` (outcome
/// unknown), in milliseconds; covers a failover.
pub const WRITE_TIMEOUT_MS: u64 = 5_000;
/// How long a fresh read waits for its leader check, in milliseconds.
pub const READ_TIMEOUT_MS: u64 = 3_000;
/// How long one attempt at a leader check (a round of heartbeats answered by a
/// quorum) may take before it is tried again, within [`READ_TIMEOUT_MS`]: a round
/// whose messages a passing partition lost never completes, and a new round after
/// it heals answers within a round trip.
pub const READ_INDEX_ATTEMPT_MS: u64 = 4 * HEARTBEAT_MS;
/// Pause between attempts at a leader check that found no quorum.
const READ_INDEX_RETRY_MS: u64 = HEARTBEAT_MS / 2;
const _: () = assert!(READ_INDEX_ATTEMPT_MS < READ_TIMEOUT_MS);
/// How long a learner may take to catch up before the wait gives up, in
/// milliseconds.
pub const CATCH_UP_TIMEOUT_MS: u64 = 30_000;
/// Entries applied since the last snapshot that trigger a new one.
pub const SNAPSHOT_LOGS_SINCE_LAST: u64 = 5_000;
/// Entries kept in the log behind a snapshot (followers a little behind catch up
/// from the log instead of a snapshot).
pub const LOGS_KEPT_BEHIND_SNAPSHOT: u64 = 1_000;
/// Longest time one snapshot chunk may take, in milliseconds.
pub const INSTALL_SNAPSHOT_TIMEOUT_MS: u64 = 10_000;
pub use crate::types::SNAPSHOT_CHUNK_BYTES;
/// Most log entries purged at once behind a snapshot (openraft's default): the
/// log is purged only once this many can go.
pub const PURGE_BATCH_ENTRIES_MAX: u64 = 256;

/// Entries purged at once for groups that snapshot every `since_last` entries: a
/// quarter of that, at most [`PURGE_BATCH_ENTRIES_MAX`], so that groups that
/// snapshot often (tests, simulations) purge their log too.
fn purge_batch_entries(since_last: u64) -> u64 {
    (since_last / 4).clamp(1, PURGE_BATCH_ENTRIES_MAX)
}

/// Most groups one node runs: every range of the largest layout, in every replica
/// class.
pub const GROUPS_PER_NODE_MAX: usize =
    tally_core::ranges::RANGES_MAX as usize * (1 + tally_core::ranges::REPLICAS_MAX as usize);
/// Polling interval of waits on a group's progress, in milliseconds.
const POLL_MS: u64 = 10;

const KEY_REPLICA_ID: &[u8] = b"replica_id";
const KEY_FORMAT: &[u8] = b"format";
/// The number of ranges the store's data is cut into.
const KEY_RANGES: &[u8] = b"ranges";
const IDENTITY_TREE: &str = "replica/identity";

/// The layout of what the range groups store (log entries, applied shard images,
/// snapshots), written beside the replica id. 1: the first release with range groups,
/// whose stores carry no format mark (its shard images had no window buckets).
/// 2: shard images with window buckets. 3: shard images with the escrow ledger of a
/// bounded counter's shard.
pub const REPLICA_FORMAT: u32 = 3;

/// The tunables of a node's groups; [`GroupsConfig::default`] holds the constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupsConfig {
    /// Leader heartbeat interval, in milliseconds.
    pub heartbeat_ms: u64,
    /// Shortest election timeout, in milliseconds.
    pub election_timeout_min_ms: u64,
    /// Longest election timeout, in milliseconds.
    pub election_timeout_max_ms: u64,
    /// Entries since the last snapshot that trigger a new one.
    pub snapshot_logs_since_last: u64,
    /// Entries kept behind a snapshot.
    pub logs_kept: u64,
    /// Write timeout, in milliseconds.
    pub write_timeout_ms: u64,
    /// Fresh-read timeout, in milliseconds.
    pub read_timeout_ms: u64,
    /// Bytes of pairs per snapshot frame (tests and simulations use small ones,
    /// so that a snapshot takes many frames).
    pub snapshot_chunk_bytes: u64,
    /// Largest encoded append to another replica, in bytes:
    /// [`GroupsConfig::MESSAGE_BYTES_MIN`]`..=`[`RANGE_MESSAGE_BYTES_MAX`], the
    /// default. Appends carry the entries that fit, and an entry may not exceed
    /// [`GroupsConfig::entry_bytes_max`] (snapshot frames are bounded by
    /// `snapshot_chunk_bytes`). Simulations set it small, so that a lagging
    /// replica's appends reach it.
    pub message_bytes_max: usize,
}

impl GroupsConfig {
    /// Smallest accepted [`GroupsConfig::message_bytes_max`].
    pub const MESSAGE_BYTES_MIN: usize = 4 * APPEND_OVERHEAD_BYTES;

    /// Largest encoded log entry a group takes: an append of it alone fits in one
    /// message, so every entry can reach every replica (a commit cycle's batches
    /// are cut to it).
    pub fn entry_bytes_max(&self) -> usize {
        self.message_bytes_max - APPEND_OVERHEAD_BYTES
    }

    /// Refuses settings no group can run on (what openraft checks itself is
    /// checked when a group starts).
    fn check(&self) -> Result<(), ReplicaError> {
        if !(Self::MESSAGE_BYTES_MIN..=RANGE_MESSAGE_BYTES_MAX).contains(&self.message_bytes_max) {
            return Err(ReplicaError::Invalid(format!(
                "message_bytes_max {} is outside {}..={RANGE_MESSAGE_BYTES_MAX}",
                self.message_bytes_max,
                Self::MESSAGE_BYTES_MIN
            )));
        }
        Ok(())
    }
}

impl Default for GroupsConfig {
    fn default() -> Self {
        Self {
            heartbeat_ms: HEARTBEAT_MS,
            election_timeout_min_ms: ELECTION_TIMEOUT_MIN_MS,
            election_timeout_max_ms: ELECTION_TIMEOUT_MAX_MS,
            snapshot_logs_since_last: SNAPSHOT_LOGS_SINCE_LAST,
            logs_kept: LOGS_KEPT_BEHIND_SNAPSHOT,
            write_timeout_ms: WRITE_TIMEOUT_MS,
            read_timeout_ms: READ_TIMEOUT_MS,
            snapshot_chunk_bytes: SNAPSHOT_CHUNK_BYTES,
            message_bytes_max: RANGE_MESSAGE_BYTES_MAX,
        }
    }
}

/// Why a group operation failed. Every variant is an answer, never a crash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplicaError {
    /// This replica does not lead the range; `leader` is the leader it knows of.
    #[error("not the leader of {range} (leader: {leader:?} on {leader_node:?})")]
    NotLeader {
        /// The range.
        range: RangeId,
        /// The leader's replica id, if known.
        leader: Option<ReplicaId>,
        /// The leader's node, if known.
        leader_node: Option<String>,
    },
    /// This node runs no group for the range.
    #[error("{0} is not open on this node")]
    NoSuchRange(RangeId),
    /// No quorum answered in time: the outcome of a write is unknown.
    #[error("{range}: no quorum within {ms} ms")]
    Timeout {
        /// The range.
        range: RangeId,
        /// The timeout.
        ms: u64,
    },
    /// The learner has not caught up with the leader yet.
    #[error("{range}: replica {replica} has {matched:?}, the leader has applied {needed:?}")]
    NotCaughtUp {
        /// The range.
        range: RangeId,
        /// The learner.
        replica: ReplicaId,
        /// The last log index it holds.
        matched: Option<u64>,
        /// The last index the leader applied.
        needed: Option<u64>,
    },
    /// A write outside the bounds or the range.
    #[error("invalid write: {0}")]
    Invalid(String),
    /// The entry would be larger than one message between nodes may carry
    /// ([`GroupsConfig::entry_bytes_max`]): it could never reach a follower.
    #[error("{range}: an entry of {bytes} bytes; at most {bytes_max}")]
    TooLarge {
        /// The range.
        range: RangeId,
        /// The entry's encoded size.
        bytes: usize,
        /// The most an entry may be.
        bytes_max: usize,
    },
    /// The node would run more groups than [`GROUPS_PER_NODE_MAX`].
    #[error("this node runs {0} groups already")]
    TooManyGroups(usize),
    /// The store failed.
    #[error("storage: {0}")]
    Storage(String),
    /// The store belongs to another replica than the one named.
    #[error("this store is replica {stored}, not {asked}")]
    OtherReplica {
        /// The id in the store.
        stored: ReplicaId,
        /// The id asked for.
        asked: ReplicaId,
    },
    /// The store's data is cut into other ranges than this node's config asks for.
    #[error(
        "the range data here is cut into {stored} ranges and the config asks for {configured}: \
         cluster.ranges_per_node must stay what the cluster first started with"
    )]
    Layout {
        /// Ranges of the stored data.
        stored: u32,
        /// Ranges of the layout asked for.
        configured: u32,
    },
    /// The store was written in a layout this release cannot read.
    #[error("range data in format {found}, this release reads format {known}: {reason}")]
    Format {
        /// The store's format.
        found: u32,
        /// The format this release reads and writes.
        known: u32,
        /// What to do about it.
        reason: &'static str,
    },
    /// Raft refused for another reason (a membership change in progress, a stopped
    /// group, an invalid configuration).
    #[error("raft: {0}")]
    Raft(String),
}

impl From<KvError> for ReplicaError {
    fn from(e: KvError) -> Self {
        ReplicaError::Storage(e.to_string())
    }
}

impl From<StateError> for ReplicaError {
    fn from(e: StateError) -> Self {
        ReplicaError::Storage(e.to_string())
    }
}

/// A write that a quorum holds durably.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteAck {
    /// The entry's log id.
    pub log_id: LogId,
    /// What applying it did.
    pub report: BatchReport,
}

/// A shard as a leader read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardRead {
    /// The shard's image (`None`: the range holds nothing for it). Its dedup
    /// records stay in the store: [`RangeGroups::dedup_get`] reads one.
    pub shard: Option<StoredShard>,
    /// The leader's log position the read reflects.
    pub read_at: Option<LogId>,
}

/// The voters and learners of a group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupMembers {
    /// Replicas that count towards quorums (both sides during a joint change).
    pub voters: BTreeSet<ReplicaId>,
    /// Replicas that receive the log but do not count.
    pub learners: BTreeSet<ReplicaId>,
    /// Whether a joint (two-configuration) change is in progress.
    pub joint: bool,
    /// The voters the configuration moves to: the second half of a joint change,
    /// else `voters`.
    pub target: BTreeSet<ReplicaId>,
}

/// openraft's metrics of one range group.
pub type GroupMetrics = openraft::RaftMetrics<ReplicaId, ReplicaNode>;

/// What a replica knows of its range's group ([`RangeGroups::status`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupStatus {
    /// This node's replica id.
    pub replica: ReplicaId,
    /// The leader it knows of.
    pub leader: Option<ReplicaId>,
    /// That leader's node, if the membership names it.
    pub leader_node: Option<String>,
    /// The raft term it is in.
    pub term: u64,
    /// The voters (both sides during a joint change), with their nodes.
    pub voters: BTreeMap<ReplicaId, String>,
    /// The learners, with their nodes.
    pub learners: BTreeMap<ReplicaId, String>,
    /// Whether a joint (two-configuration) change is in progress.
    pub joint: bool,
    /// The last index of its log.
    pub last_log_index: Option<u64>,
    /// The last index it applied.
    pub last_applied: Option<u64>,
    /// On the leader only: the last index each replica is known to hold.
    pub matched: Option<BTreeMap<ReplicaId, Option<u64>>>,
    /// Why this replica's group stopped on its own (a fatal storage error, or a
    /// panic of its core), if it did: it takes no part in its group until the
    /// node restarts.
    pub stopped: Option<String>,
}

#[derive(Clone)]
struct Group {
    raft: Raft,
    shared: Arc<Shared>,
    reads: Arc<ReadRounds>,
}

/// The read-index rounds of one group: one leadership confirmation at a time,
/// shared by every read that arrived before it began. openraft 0.9 confirms each
/// `ensure_linearizable` call with a heartbeat round of its own, so a few thousand
/// fresh reads at once sent a few thousand rounds to every follower, which timed
/// out and cost the group its leader. A read that arrives while a round runs waits
/// for the next one (the running one may have taken its commit position before
/// the read arrived), which then answers every read queued behind it.
#[derive(Default)]
struct ReadRounds {
    /// Held while a round runs; reads that arrive meanwhile queue on it.
    running: tokio::sync::Mutex<()>,
    /// How many rounds began.
    begun: AtomicU64,
    /// The latest round to finish: its number (counting from 1) and its answer.
    last: parking_lot::Mutex<Option<(u64, ReadIndex)>>,
}

/// A read-index round's answer: the position reads may be served from.
type ReadIndex = Result<Option<LogId>, ReplicaError>;

impl Group {
    /// The fatal error that stopped this group's core, if one did.
    fn stopped(&self) -> Option<String> {
        self.raft.metrics().borrow().running_state.as_ref().err().map(|fatal| fatal.to_string())
    }

    /// Whether replica `id` is a voter of this group, as its metrics know it.
    fn is_voter(&self, id: ReplicaId) -> bool {
        self.raft.metrics().borrow().membership_config.membership().voter_ids().any(|v| v == id)
    }
}

/// The range groups of one node, sharing one store and one network.
pub struct RangeGroups {
    id: ReplicaId,
    node: ReplicaNode,
    kv: Arc<dyn KvStore>,
    net: Arc<dyn RangeNetwork>,
    config: GroupsConfig,
    layout: RangeLayout,
    groups: RwLock<BTreeMap<RangeId, Group>>,
    /// The node of every replica id this node saw leading a group: names a leader
    /// that its group's membership no longer lists.
    seen: RwLock<BTreeMap<ReplicaId, String>>,
    /// Held while a group is being opened, so two opens of one range never start
    /// two rafts over the same trees.
    opening: tokio::sync::Mutex<()>,
}

/// Bytes a log entry adds around its images (log id, payload tag, range).
pub const ENTRY_OVERHEAD_BYTES: usize = 64;

/// The encoded size of a log entry carrying `images`, at most (images counted
/// one by one, without encoding the entry).
pub fn batch_bytes(images: &[ShardEntry]) -> usize {
    ENTRY_OVERHEAD_BYTES + images.iter().map(tally_core::codec::encoded_len).sum::<usize>()
}

/// Where a range's trees live in the node's store.
fn range_prefix(range: RangeId) -> String {
    format!("replica/{}/", range.0)
}

/// Whether a group, as `metrics` show it, knows a uniform membership (no change
/// under way) that does not list `replica`: `Some(true)` once it applied that
/// membership, `Some(false)` while it did not, `None` while the group lists the
/// replica (or knows no membership yet).
fn removal(metrics: &GroupMetrics, replica: ReplicaId) -> Option<bool> {
    let config = &metrics.membership_config;
    let m = config.membership();
    let listed = m.voter_ids().chain(m.learner_ids()).any(|id| id == replica);
    let uniform = m.get_joint_config().len() == 1;
    let voters = m.voter_ids().next().is_some();
    let applied = metrics.last_applied.as_ref().map(|l| l.index) >= config.log_id().as_ref().map(|l| l.index);
    (voters && uniform && !listed).then_some(applied)
}

fn leader_of(range: RangeId, f: &ForwardToLeader<ReplicaId, ReplicaNode>) -> ReplicaError {
    ReplicaError::NotLeader {
        range,
        leader: f.leader_id,
        leader_node: f.leader_node.as_ref().map(|n| n.node.clone()),
    }
}

fn fatal<E: std::fmt::Display>(e: E) -> ReplicaError {
    ReplicaError::Raft(e.to_string())
}

/// A stored big-endian `u32`, or why not.
fn be_u32(bytes: &[u8], what: &str) -> Result<u32, ReplicaError> {
    let bytes = bytes.try_into().map_err(|_| ReplicaError::Storage(format!("corrupt {what}")))?;
    Ok(u32::from_be_bytes(bytes))
}

fn be_u64(bytes: &[u8], what: &str) -> Result<u64, ReplicaError> {
    let bytes = bytes.try_into().map_err(|_| ReplicaError::Storage(format!("corrupt {what}")))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Refuses a store this release cannot read: one of a later format, or one of an
/// earlier format — the first (a replica id without a format mark), whose shard
/// images predate window buckets, or format 2, whose images predate the escrow
/// ledger. Stored images are not upgraded in place. An empty store is fine: it takes
/// the current format.
fn check_format(identity: &dyn KvTree) -> Result<(), ReplicaError> {
    let found = match (identity.get(KEY_FORMAT)?, identity.get(KEY_REPLICA_ID)?) {
        (None, None) => return Ok(()),
        (None, Some(_)) => 1,
        (Some(bytes), _) => be_u32(&bytes, "range data format")?,
    };
    let reason = match found {
        REPLICA_FORMAT => return Ok(()),
        f if f > REPLICA_FORMAT => "it was written by a later release; run that release",
        _ => {
            "it was written by an earlier release; start this node with an empty data directory \
             (it rejoins as a new incarnation) only while the other replicas of its ranges run this \
             format and hold the data"
        }
    };
    Err(ReplicaError::Format { found, known: REPLICA_FORMAT, reason })
}

impl RangeGroups {
    /// The replica id `kv` names, if it holds one: `None` for a store that never held
    /// a group (new, or emptied).
    pub fn stored_replica_id(kv: &dyn KvStore) -> Result<Option<ReplicaId>, ReplicaError> {
        let identity = kv.tree(IDENTITY_TREE)?;
        identity.get(KEY_REPLICA_ID)?.map(|b| be_u64(&b, "replica id")).transpose()
    }

    /// Opens the node's groups on `kv`. A store that names a replica id keeps it;
    /// an empty store takes `fresh_id`, which must never have been used by any
    /// store in the cluster (a node that lost its disk comes back as a new replica).
    pub async fn open(
        node: &str,
        fresh_id: ReplicaId,
        kv: Arc<dyn KvStore>,
        net: Arc<dyn RangeNetwork>,
        layout: RangeLayout,
        config: GroupsConfig,
    ) -> Result<Arc<Self>, ReplicaError> {
        config.check()?;
        let identity = kv.tree(IDENTITY_TREE)?;
        check_format(identity.as_ref())?;
        let id = match identity.get(KEY_REPLICA_ID)? {
            Some(bytes) => be_u64(&bytes, "replica id")?,
            None => {
                identity.apply(vec![
                    (KEY_FORMAT.to_vec(), Some(REPLICA_FORMAT.to_be_bytes().to_vec())),
                    (KEY_REPLICA_ID.to_vec(), Some(fresh_id.to_be_bytes().to_vec())),
                    (KEY_RANGES.to_vec(), Some(layout.count().to_be_bytes().to_vec())),
                ])?;
                kv.flush().await?;
                fresh_id
            }
        };
        match identity.get(KEY_RANGES)? {
            Some(bytes) => {
                let stored = be_u32(&bytes, "range count")?;
                if stored != layout.count() {
                    return Err(ReplicaError::Layout { stored, configured: layout.count() });
                }
            }
            // Written before stores named their layout, which was always the default
            // one: recorded now.
            None => {
                identity.apply(vec![(KEY_RANGES.to_vec(), Some(layout.count().to_be_bytes().to_vec()))])?;
                kv.flush().await?;
            }
        }
        let node = ReplicaNode { node: node.to_owned() };
        Ok(Arc::new(Self {
            id,
            node,
            kv,
            net,
            config,
            layout,
            groups: RwLock::new(BTreeMap::new()),
            seen: RwLock::new(BTreeMap::new()),
            opening: tokio::sync::Mutex::new(()),
        }))
    }

    /// This node's replica id (its store's).
    pub fn replica_id(&self) -> ReplicaId {
        self.id
    }

    /// This node's raft node record.
    pub fn node(&self) -> &ReplicaNode {
        &self.node
    }

    fn openraft_config(&self, range: RangeId) -> Result<Arc<openraft::Config>, ReplicaError> {
        let c = &self.config;
        let config = openraft::Config {
            // Names the group in openraft's log lines (`cluster=range7`).
            cluster_name: range.to_string(),
            heartbeat_interval: c.heartbeat_ms,
            election_timeout_min: c.election_timeout_min_ms,
            election_timeout_max: c.election_timeout_max_ms,
            install_snapshot_timeout: INSTALL_SNAPSHOT_TIMEOUT_MS,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(c.snapshot_logs_since_last),
            max_in_snapshot_log_to_keep: c.logs_kept,
            purge_batch_size: purge_batch_entries(c.snapshot_logs_since_last),
            snapshot_max_chunk_size: c.snapshot_chunk_bytes,
            ..Default::default()
        };
        Ok(Arc::new(config.validate().map_err(fatal)?))
    }

    /// Starts the group of `range` from what the store holds (an empty, not yet
    /// initialized group if nothing: it waits to be initialized or added).
    pub async fn open_range(&self, range: RangeId) -> Result<(), ReplicaError> {
        if self.layout.span(range).is_none() {
            return Err(ReplicaError::Invalid(format!("{range} is outside the layout")));
        }
        let _opening = self.opening.lock().await;
        {
            let groups = self.groups.read();
            if groups.contains_key(&range) {
                return Ok(());
            }
            if groups.len() >= GROUPS_PER_NODE_MAX {
                return Err(ReplicaError::TooManyGroups(groups.len()));
            }
        }
        let prefix = range_prefix(range);
        let log = LogStore::open(self.kv.clone(), &prefix)?;
        let sm = StateMachine::open(range, self.kv.clone(), &prefix).map_err(fatal)?;
        let shared = sm.shared();
        let network = GroupNetworkFactory {
            me: self.id,
            range,
            net: self.net.clone(),
            message_bytes_max: self.config.message_bytes_max,
        };
        let raft = Raft::new(self.id, self.openraft_config(range)?, network, log, sm).await.map_err(fatal)?;
        let reads = Arc::default();
        self.groups.write().entry(range).or_insert(Group { raft, shared, reads });
        Ok(())
    }

    /// Opens the group of every range whose store shows it took part in one (a
    /// stored vote): a restarted node runs what its store says it is a replica
    /// of, whatever the directory says, since a group may count on its vote.
    pub async fn open_stored(&self) -> Result<(), ReplicaError> {
        let ranges = tally_core::ranges::replica_classes().flat_map(|class| self.layout.ranges_in(class));
        for range in ranges {
            if LogStore::took_part(self.kv.as_ref(), &range_prefix(range))? {
                self.open_range(range).await?;
            }
        }
        Ok(())
    }

    fn group(&self, range: RangeId) -> Result<Group, ReplicaError> {
        self.groups.read().get(&range).cloned().ok_or(ReplicaError::NoSuchRange(range))
    }

    /// `range`'s group, if this replica may propose a membership change: it leads,
    /// in the group's effective membership. A leader that appended its own removal
    /// still leads until that commits (and serves meanwhile), but openraft takes no
    /// further membership change from it: it is no longer in the membership it
    /// would change.
    fn membership_leader(&self, range: RangeId) -> Result<Group, ReplicaError> {
        let g = self.group(range)?;
        let metrics = g.raft.metrics().borrow().clone();
        let member = metrics.membership_config.membership().nodes().any(|(id, _)| *id == self.id);
        if metrics.state != openraft::ServerState::Leader || !member {
            let leader = metrics.current_leader.filter(|l| *l != self.id);
            return Err(ReplicaError::NotLeader { range, leader, leader_node: None });
        }
        Ok(g)
    }

    /// The ranges open on this node.
    pub fn ranges(&self) -> Vec<RangeId> {
        self.groups.read().keys().copied().collect()
    }

    /// The ranges whose group stopped on its own, each with the fatal error that
    /// stopped it (a storage error, or a panic of its core): that replica takes no
    /// part in its group until the node restarts. None in a healthy node.
    pub fn stopped(&self) -> Vec<(RangeId, String)> {
        let groups = self.groups.read();
        groups.iter().filter_map(|(range, g)| Some((*range, g.stopped()?))).collect()
    }

    /// Makes `members` the first voters of `range`'s group. Every first voter may
    /// call it, with the same members; a group that was initialized already
    /// answers Ok.
    pub async fn initialize(
        &self,
        range: RangeId,
        members: &[(ReplicaId, ReplicaNode)],
    ) -> Result<(), ReplicaError> {
        let g = self.group(range)?;
        let members: BTreeMap<ReplicaId, ReplicaNode> = members.iter().cloned().collect();
        match g.raft.initialize(members.clone()).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(InitializeError::NotAllowed(n))) if n.last_log_id.is_none() => {
                self.seed_first_entry(range, members).await
            }
            Err(RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
            Err(e) => Err(fatal(e)),
        }
    }

    /// Gives a first voter that holds a vote and no log its group's first entry.
    ///
    /// A first voter that granted its vote to another one's first campaign before
    /// that one's first entry reached it is a replica openraft will not
    /// initialize (it voted), and that no leader may ever complete: if the
    /// candidate's disk is lost, nobody holds the first entry, and the group has
    /// no membership to elect in. The first entry is the recorded first voters at
    /// log id 0, the same on every first voter, so this replica writes it itself,
    /// as if the candidate's had arrived, keeping its vote (it votes no twice in a
    /// term), and opens its group again: a follower of that membership.
    async fn seed_first_entry(
        &self,
        range: RangeId,
        members: BTreeMap<ReplicaId, ReplicaNode>,
    ) -> Result<(), ReplicaError> {
        {
            let _opening = self.opening.lock().await;
            let Some(g) = self.groups.write().remove(&range) else {
                return Err(ReplicaError::NoSuchRange(range));
            };
            g.raft.shutdown().await.map_err(fatal)?;
            let mut log = LogStore::open(self.kv.clone(), &range_prefix(range))?;
            let first =
                openraft::Entry::<RangeConfig>::new_membership(LogId::default(), Membership::from(members));
            if log.seed_first(first).await.map_err(fatal)? {
                tracing::info!(%range, "wrote the first entry of a group whose first campaign this replica voted in");
            }
        }
        self.open_range(range).await
    }

    fn check(&self, range: RangeId, images: &[ShardEntry]) -> Result<(), ReplicaError> {
        if images.is_empty() || images.len() > BATCH_IMAGES_MAX {
            return Err(ReplicaError::Invalid(format!(
                "{} images; 1..={BATCH_IMAGES_MAX} allowed",
                images.len()
            )));
        }
        for e in images {
            let records = e.write.dedup_put.len() + e.write.dedup_remove.len();
            if records > IMAGE_RECORDS_MAX {
                return Err(ReplicaError::Invalid(format!("{}: {records} dedup changes", e.shard)));
            }
            if self.layout.range_of_shard(&e.shard) != range {
                return Err(ReplicaError::Invalid(format!("{} is not in {range}", e.shard)));
            }
        }
        let (bytes, bytes_max) = (batch_bytes(images), self.config.entry_bytes_max());
        if bytes > bytes_max {
            return Err(ReplicaError::TooLarge { range, bytes, bytes_max });
        }
        Ok(())
    }

    /// Replicates `images` through `range`'s group. Answers Ok only once a quorum
    /// of the group holds the entry durably and it is applied here; a replica that
    /// does not lead answers [`ReplicaError::NotLeader`] with the leader it knows;
    /// [`ReplicaError::Timeout`] means the outcome is unknown (retry with the same
    /// images: they are absolute, so a repeat changes nothing).
    pub async fn write(&self, range: RangeId, images: Vec<ShardEntry>) -> Result<WriteAck, ReplicaError> {
        self.check(range, &images)?;
        let g = self.group(range)?;
        let ms = self.config.write_timeout_ms;
        let written =
            tokio::time::timeout(Duration::from_millis(ms), g.raft.client_write(Batch { range, images }));
        match written.await {
            Err(_) => Err(ReplicaError::Timeout { range, ms }),
            Ok(Ok(r)) => Ok(WriteAck { log_id: r.log_id, report: r.data }),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => Err(leader_of(range, &f)),
            Ok(Err(e)) => Err(fatal(e)),
        }
    }

    /// A leader's read index: confirms with a quorum that this replica leads, then
    /// waits until it applied every entry its log held when the read began.
    /// openraft's own read index is the leader's commit position, which a leader
    /// restored at start-up (a replica that led before a crash resumes its term at
    /// once, if its vote was committed) has not learnt yet; every entry committed
    /// before the read is in the leader's log by then, so waiting for that prefix
    /// covers them. Entries appended after the read began are not waited for: under a
    /// steady stream of writes the log never stops growing, and a read that waited
    /// for all of it would wait for the stream to pause.
    async fn linearize(&self, range: RangeId, g: &Group) -> Result<Option<LogId>, ReplicaError> {
        let ms = self.config.read_timeout_ms;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
        // The log as the read began, if this replica led then; otherwise as it stands
        // once the read index confirmed it leads (it then holds every committed entry).
        let leading = |m: &GroupMetrics| (m.current_leader == Some(self.id)).then_some(m.last_log_index);
        let began = leading(&g.raft.metrics().borrow());
        let at = self.read_index(range, g).await?;
        let held = began.unwrap_or_else(|| g.raft.metrics().borrow().last_log_index);
        loop {
            let m = g.raft.metrics().borrow().clone();
            if m.current_leader != Some(self.id) {
                return Err(ReplicaError::NotLeader { range, leader: m.current_leader, leader_node: None });
            }
            if m.last_applied.map(|l| l.index) >= held {
                return Ok(at);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ReplicaError::Timeout { range, ms });
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }

    /// The read index: the leader's committed position once a quorum confirmed it
    /// still leads, from the first of the group's rounds that began after this call
    /// did ([`ReadRounds`]). Within the read timeout.
    async fn read_index(&self, range: RangeId, g: &Group) -> ReadIndex {
        let arrived_after = g.reads.begun.load(SeqCst);
        let ms = self.config.read_timeout_ms;
        let shared = async {
            let _turn = g.reads.running.lock().await;
            if let Some((round, answer)) = &*g.reads.last.lock() {
                if *round > arrived_after {
                    return answer.clone();
                }
            }
            let round = g.reads.begun.fetch_add(1, SeqCst) + 1;
            let answer = self.read_index_round(range, g).await;
            *g.reads.last.lock() = Some((round, answer.clone()));
            answer
        };
        tokio::time::timeout(Duration::from_millis(ms), shared)
            .await
            .unwrap_or(Err(ReplicaError::Timeout { range, ms }))
    }

    /// One read-index round: attempts that find no quorum, or whose round does not
    /// complete within [`READ_INDEX_ATTEMPT_MS`], are tried again until the read
    /// timeout.
    async fn read_index_round(&self, range: RangeId, g: &Group) -> Result<Option<LogId>, ReplicaError> {
        let ms = self.config.read_timeout_ms;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let attempt = left.min(Duration::from_millis(READ_INDEX_ATTEMPT_MS));
            match tokio::time::timeout(attempt, g.raft.ensure_linearizable()).await {
                Ok(Ok(at)) => return Ok(at),
                Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => {
                    return Err(leader_of(range, &f))
                }
                Err(_) | Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_)))) => {}
                Ok(Err(e)) => return Err(fatal(e)),
            }
            if tokio::time::Instant::now() + Duration::from_millis(READ_INDEX_RETRY_MS) >= deadline {
                return Err(ReplicaError::Timeout { range, ms });
            }
            tokio::time::sleep(Duration::from_millis(READ_INDEX_RETRY_MS)).await;
        }
    }

    /// Reads `shard` as the range's leader, after confirming with a quorum that it
    /// still leads and applying everything committed before the read (read index).
    pub async fn read_fresh(&self, range: RangeId, shard: &ShardId) -> Result<ShardRead, ReplicaError> {
        let g = self.group(range)?;
        let read_at = self.linearize(range, &g).await?;
        Ok(ShardRead { shard: g.shared.shard(shard)?, read_at })
    }

    /// What this replica has applied of `range`, without asking anyone (may be
    /// behind the leader): a copy of the whole range in memory, for tests and
    /// tools.
    pub fn read_local(&self, range: RangeId) -> Result<crate::state_machine::RangeState, ReplicaError> {
        Ok(self.group(range)?.shared.state()?)
    }

    /// The leader of `range` as this replica knows it.
    pub fn leader(&self, range: RangeId) -> Result<Option<ReplicaId>, ReplicaError> {
        Ok(self.group(range)?.raft.metrics().borrow().current_leader)
    }

    /// The node of `range`'s leader as this replica knows it.
    pub fn leader_node(&self, range: RangeId) -> Option<String> {
        self.leadership(range).map(|(node, _)| node)
    }

    /// The node of `range`'s leader as this replica knows it, and the term it leads
    /// in: a node elected again leads a new term.
    pub fn leadership(&self, range: RangeId) -> Option<(String, u64)> {
        let g = self.group(range).ok()?;
        let metrics = g.raft.metrics();
        let metrics = metrics.borrow();
        let leader = metrics.current_leader?;
        // A leader its group's membership no longer lists (removed, and not yet
        // stepped down) still leads: it is named from this node's own record, or
        // from the nodes seen in earlier memberships.
        let node = match metrics.membership_config.membership().get_node(&leader) {
            Some(n) => {
                if self.seen.read().get(&leader) != Some(&n.node) {
                    self.seen.write().insert(leader, n.node.clone());
                }
                n.node.clone()
            }
            None if leader == self.id => self.node.node.clone(),
            None => self.seen.read().get(&leader)?.clone(),
        };
        Some((node, metrics.current_term))
    }

    /// Whether this replica leads `range` now (as far as it knows: a deposed leader
    /// may not have heard yet; [`RangeGroups::confirm`] asks a quorum).
    pub fn leads(&self, range: RangeId) -> bool {
        self.leader(range).is_ok_and(|l| l == Some(self.id))
    }

    /// Whether `range`'s group here holds a membership (it was initialized, or a
    /// leader added this replica): a group that does not waits to be added.
    pub fn formed(&self, range: RangeId) -> bool {
        match self.group(range) {
            Ok(g) => {
                let metrics = g.raft.metrics().borrow().clone();
                metrics.membership_config.membership().voter_ids().next().is_some()
            }
            // A group not open here (a range this node left) counts as formed if
            // its store shows it ever took part, so no one forms it anew.
            Err(_) => LogStore::took_part(self.kv.as_ref(), &range_prefix(range)).unwrap_or(true),
        }
    }

    /// Whether this node's store holds nothing of `range`'s group (no vote, no log),
    /// and it is not open here. A store that cannot be read answers no.
    pub fn holds_nothing(&self, range: RangeId) -> bool {
        !self.groups.read().contains_key(&range)
            && LogStore::holds_nothing(self.kv.as_ref(), &range_prefix(range)).unwrap_or(false)
    }

    /// Whether this node's replica of `range` is open and a voter or learner of
    /// its group, as its own membership knows it (not one that was removed, nor
    /// a new one no leader has added yet).
    pub fn is_replica(&self, range: RangeId) -> bool {
        let Ok(g) = self.group(range) else { return false };
        let metrics = g.raft.metrics();
        let metrics = metrics.borrow();
        let m = metrics.membership_config.membership();
        let listed = m.voter_ids().chain(m.learner_ids()).any(|id| id == self.id);
        listed
    }

    /// Every replica of `range` (voters and learners) with its node.
    pub fn replica_nodes(&self, range: RangeId) -> Result<BTreeMap<ReplicaId, ReplicaNode>, ReplicaError> {
        let g = self.group(range)?;
        let metrics = g.raft.metrics().borrow().clone();
        Ok(metrics.membership_config.membership().nodes().map(|(id, n)| (*id, n.clone())).collect())
    }

    /// Confirms with a quorum that this replica still leads `range`, and returns
    /// once everything committed before the call is applied here (read index):
    /// what [`RangeGroups::shard`] answers afterwards is fresh.
    pub async fn confirm(&self, range: RangeId) -> Result<(), ReplicaError> {
        let g = self.group(range)?;
        self.linearize(range, &g).await.map(|_| ())
    }

    /// One shard's image as applied here (`None`: never written), read from the
    /// store (its dedup records stay there).
    pub fn shard(&self, range: RangeId, shard: &ShardId) -> Result<Option<StoredShard>, ReplicaError> {
        Ok(self.group(range)?.shared.shard(shard)?)
    }

    /// One dedup record of a shard as applied here.
    pub fn dedup_get(
        &self,
        range: RangeId,
        shard: &ShardId,
        event_id: &str,
    ) -> Result<Option<DedupRecord>, ReplicaError> {
        Ok(self.group(range)?.shared.dedup_get(shard, event_id)?)
    }

    /// Up to `limit` dedup records of a shard as applied here, in event-id order,
    /// after `after`.
    pub fn dedup_scan(
        &self,
        range: RangeId,
        shard: &ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, DedupRecord)>, ReplicaError> {
        Ok(self.group(range)?.shared.dedup_scan(shard, after, limit)?)
    }

    /// Up to `limit` ids of the shards of `range` as applied here, in the store's
    /// key order, after `after`.
    pub fn shard_ids(
        &self,
        range: RangeId,
        after: Option<&ShardId>,
        limit: usize,
    ) -> Result<Vec<ShardId>, ReplicaError> {
        Ok(self.group(range)?.shared.shard_ids(after, limit)?)
    }

    /// The range layout the groups are cut by.
    pub fn layout(&self) -> RangeLayout {
        self.layout
    }

    /// The voters and learners of `range` as this replica knows them.
    pub fn members(&self, range: RangeId) -> Result<GroupMembers, ReplicaError> {
        let g = self.group(range)?;
        let metrics = g.raft.metrics().borrow().clone();
        let m = metrics.membership_config.membership();
        let configs = m.get_joint_config();
        Ok(GroupMembers {
            voters: m.voter_ids().collect(),
            learners: m.learner_ids().collect(),
            joint: configs.len() > 1,
            target: configs.last().cloned().unwrap_or_default(),
        })
    }

    /// How many snapshots this node's replica of `range` installed since it opened.
    pub fn snapshots_installed(&self, range: RangeId) -> Result<u64, ReplicaError> {
        Ok(self.group(range)?.shared.snapshots_installed())
    }

    /// Encoded bytes of the snapshots this node's replica of `range` installed
    /// since it opened (catch-up by snapshot).
    pub fn snapshot_bytes_installed(&self, range: RangeId) -> Result<u64, ReplicaError> {
        Ok(self.group(range)?.shared.snapshot_bytes_installed())
    }

    /// Encoded bytes of the log entries this replica of `range` received while a
    /// learner (catch-up through the log).
    pub fn log_bytes_caught_up(&self, range: RangeId) -> Result<u64, ReplicaError> {
        Ok(self.group(range)?.shared.log_bytes_caught_up())
    }

    /// What this replica knows of `range`'s group now, read from openraft's
    /// metrics without asking anyone.
    pub fn status(&self, range: RangeId) -> Result<GroupStatus, ReplicaError> {
        let g = self.group(range)?;
        let m = g.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let node = |id: &ReplicaId| membership.get_node(id).map_or_else(String::new, |n| n.node.clone());
        let leads = m.current_leader == Some(self.id);
        Ok(GroupStatus {
            replica: self.id,
            leader: m.current_leader,
            leader_node: m
                .current_leader
                .as_ref()
                .and_then(|l| membership.get_node(l))
                .map(|n| n.node.clone()),
            term: m.current_term,
            voters: membership.voter_ids().map(|id| (id, node(&id))).collect(),
            learners: membership.learner_ids().map(|id| (id, node(&id))).collect(),
            joint: membership.get_joint_config().len() > 1,
            last_log_index: m.last_log_index,
            last_applied: m.last_applied.map(|l| l.index),
            matched: match (leads, m.replication.as_ref()) {
                (true, Some(r)) => Some(r.iter().map(|(id, l)| (*id, l.map(|l| l.index))).collect()),
                _ => None,
            },
            stopped: g.stopped(),
        })
    }

    /// A watch of `range`'s openraft metrics (it ends when the group stops).
    pub fn watch(&self, range: RangeId) -> Result<tokio::sync::watch::Receiver<GroupMetrics>, ReplicaError> {
        Ok(self.group(range)?.raft.metrics())
    }

    /// Builds a snapshot of `range` now (the log behind it is purged down to the
    /// configured number of kept entries).
    pub async fn snapshot_now(&self, range: RangeId) -> Result<(), ReplicaError> {
        self.group(range)?.raft.trigger().snapshot().await.map_err(fatal)
    }

    /// On the leader: adds `replica` on `node` as a learner of `range`. It receives
    /// the log (or a snapshot) but counts towards no quorum; call
    /// [`RangeGroups::promote`] once it caught up.
    pub async fn add_learner(
        &self,
        range: RangeId,
        replica: ReplicaId,
        node: ReplicaNode,
    ) -> Result<(), ReplicaError> {
        let g = self.membership_leader(range)?;
        match g.raft.add_learner(replica, node, false).await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => Err(leader_of(range, &f)),
            Err(e) => Err(fatal(e)),
        }
    }

    /// On the leader: whether `replica` holds every entry the leader applied.
    pub fn caught_up(&self, range: RangeId, replica: ReplicaId) -> Result<(), ReplicaError> {
        let g = self.group(range)?;
        let m = g.raft.metrics().borrow().clone();
        if m.current_leader != Some(self.id) {
            return Err(ReplicaError::NotLeader { range, leader: m.current_leader, leader_node: None });
        }
        let matched =
            m.replication.as_ref().and_then(|r| r.get(&replica).cloned().flatten()).map(|l| l.index);
        let needed = m.last_applied.map(|l| l.index);
        if matched >= needed {
            Ok(())
        } else {
            Err(ReplicaError::NotCaughtUp { range, replica, matched, needed })
        }
    }

    /// On the leader: waits until `replica` caught up ([`RangeGroups::caught_up`]),
    /// at most `timeout`.
    pub async fn wait_caught_up(
        &self,
        range: RangeId,
        replica: ReplicaId,
        timeout: Duration,
    ) -> Result<(), ReplicaError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.caught_up(range, replica) {
                Err(ReplicaError::NotCaughtUp { .. }) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(POLL_MS)).await
                }
                other => return other,
            }
        }
    }

    /// On the leader: makes the learner `replica` a voter of `range` and removes
    /// the voters in `remove` (a replaced incarnation, a node that left), by joint
    /// consensus. Refused with [`ReplicaError::NotCaughtUp`] while the learner lacks
    /// entries the leader applied, so it never counts towards a quorum before it
    /// holds everything that quorum must know.
    pub async fn promote(
        &self,
        range: RangeId,
        replica: ReplicaId,
        remove: &[ReplicaId],
    ) -> Result<(), ReplicaError> {
        let mut voters = self.members(range)?.voters;
        voters.insert(replica);
        for r in remove {
            voters.remove(r);
        }
        self.set_voters(range, voters).await
    }

    /// On the leader: makes `voters` the voters of `range` by joint consensus,
    /// removing the others. Refused with [`ReplicaError::NotCaughtUp`] while one
    /// that is not a voter yet lacks entries the leader applied.
    pub async fn set_voters(&self, range: RangeId, voters: BTreeSet<ReplicaId>) -> Result<(), ReplicaError> {
        let current = self.members(range)?.voters;
        for id in voters.difference(&current) {
            self.caught_up(range, *id)?;
        }
        self.change_voters(range, voters).await
    }

    /// On the leader: removes the learners `learners` from `range`'s group.
    pub async fn remove_learners(
        &self,
        range: RangeId,
        learners: BTreeSet<ReplicaId>,
    ) -> Result<(), ReplicaError> {
        let g = self.membership_leader(range)?;
        match g.raft.change_membership(openraft::ChangeMembers::RemoveNodes(learners), false).await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => Err(leader_of(range, &f)),
            Err(e) => Err(fatal(e)),
        }
    }

    /// On the leader: removes `replica` from `range`'s voters and learners.
    pub async fn remove_replica(&self, range: RangeId, replica: ReplicaId) -> Result<(), ReplicaError> {
        let mut voters = self.members(range)?.voters;
        voters.remove(&replica);
        self.change_voters(range, voters).await
    }

    async fn change_voters(&self, range: RangeId, voters: BTreeSet<ReplicaId>) -> Result<(), ReplicaError> {
        if voters.is_empty() {
            return Err(ReplicaError::Invalid("a group keeps at least one voter".into()));
        }
        let g = self.membership_leader(range)?;
        match g.raft.change_membership(voters, false).await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => Err(leader_of(range, &f)),
            Err(e) => Err(fatal(e)),
        }
    }

    /// Stops `range`'s group on this node, its state left in the store (it can be
    /// opened again). Used once this replica is out of the group.
    pub async fn close_range(&self, range: RangeId) -> Result<(), ReplicaError> {
        let _opening = self.opening.lock().await;
        let Some(g) = self.groups.write().remove(&range) else { return Ok(()) };
        // The followers hear of the last commit before the leader goes.
        let _ = g.raft.trigger().heartbeat().await;
        g.raft.shutdown().await.map_err(fatal)
    }

    /// The tunables of this node's groups.
    pub fn config(&self) -> GroupsConfig {
        self.config
    }

    /// Makes this replica stand for election in `range`'s group now.
    pub async fn elect(&self, range: RangeId) -> Result<(), ReplicaError> {
        self.group(range)?.raft.trigger().elect().await.map_err(fatal)
    }

    /// On `range`'s leader: the replica of `voters` other than itself that holds
    /// the most of the log (the lowest replica id among equals), with its node.
    pub fn successor(
        &self,
        range: RangeId,
        voters: &BTreeSet<ReplicaId>,
    ) -> Option<(ReplicaId, ReplicaNode)> {
        let g = self.group(range).ok()?;
        let metrics = g.raft.metrics();
        let metrics = metrics.borrow();
        if metrics.current_leader != Some(self.id) {
            return None;
        }
        let progress = metrics.replication.as_ref()?;
        let membership = metrics.membership_config.membership();
        let held = |id: &ReplicaId| progress.get(id).copied().flatten().map(|l| l.index);
        let best = voters
            .iter()
            .copied()
            .filter(|id| *id != self.id && membership.get_node(id).is_some())
            .min_by_key(|id| (std::cmp::Reverse(held(id)), *id))?;
        Some((best, membership.get_node(&best)?.clone()))
    }

    /// On `range`'s leader: whether its group lists `replica` (as a voter or a
    /// learner). `Some(false)` only once the leader applied a uniform membership
    /// without it, so its removal is committed (a later change may still add it
    /// again); `None` where this node does not lead the range, or a change is under
    /// way.
    pub fn lists(&self, range: RangeId, replica: ReplicaId) -> Option<bool> {
        let g = self.group(range).ok()?;
        let metrics = g.raft.metrics();
        let metrics = metrics.borrow();
        if metrics.current_leader != Some(self.id) {
            return None;
        }
        let m = metrics.membership_config.membership();
        if m.voter_ids().chain(m.learner_ids()).any(|id| id == replica) {
            return Some(true);
        }
        (removal(&metrics, replica) == Some(true)).then_some(false)
    }

    /// Whether `range`'s group here knows a uniform membership (no change under
    /// way) that does not list this replica: `Some(true)` once it applied that
    /// membership, `Some(false)` while it did not (its commit may still be under
    /// way, or this replica was cut off before it heard of it), `None` while the
    /// group lists this replica.
    pub fn removed(&self, range: RangeId) -> Option<bool> {
        let g = self.group(range).ok()?;
        let metrics = g.raft.metrics();
        let metrics = metrics.borrow();
        removal(&metrics, self.id)
    }

    /// Stops every group (their state stays in the store).
    pub async fn shutdown(&self) {
        let groups: Vec<Group> = std::mem::take(&mut *self.groups.write()).into_values().collect();
        for g in groups {
            if let Err(e) = g.raft.shutdown().await {
                tracing::warn!(error = %e, "a range group did not stop cleanly");
            }
        }
    }
}

impl RangeInbound for RangeGroups {
    fn handle(&self, envelope: RangeEnvelope) -> BoxFuture<'static, Result<RangeReply, NetError>> {
        let RangeEnvelope { to, range, rpc, .. } = envelope;
        let own = self.id;
        let group = self.groups.read().get(&range).cloned();
        Box::pin(async move {
            if to != own {
                return Err(NetError::NotThisReplica { asked: to, own });
            }
            let g = group.ok_or(NetError::NoGroup { to, range })?;
            Ok(match rpc {
                RangeRpc::Append(r) => {
                    // Entries that reach a replica outside the voters (a learner, or
                    // a new replica that learns it is one from these very entries)
                    // are catch-up, counted in bytes as installed snapshots are.
                    let catching_up = !r.entries.is_empty() && !g.is_voter(own);
                    let bytes = catching_up.then(|| tally_core::codec::encode(&r.entries).len());
                    let reply = g.raft.append_entries(r).await;
                    if let Some(bytes) = bytes.filter(|_| reply.is_ok() && !g.is_voter(own)) {
                        g.shared.count_log_bytes_caught_up(bytes as u64);
                    }
                    RangeReply::Append(reply)
                }
                RangeRpc::Vote(r) => RangeReply::Vote(g.raft.vote(r).await),
                RangeRpc::Snapshot(r) => RangeReply::Snapshot(g.raft.install_snapshot(r).await),
            })
        })
    }
}
