//! The recorded history of a run: every invocation and every answer the clients saw,
//! the faults the simulator injected, and the counters' contracts. The checker reads
//! only this; a timeout is recorded as an attempt without an answer (*unknown*),
//! never as *absent*.

use crate::msg::{Answer, Consistency, ReadValue};
use std::collections::BTreeSet;
use tally_core::CounterSpec;

/// What a workload counter is for; each role is checked by its own invariants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// `sync`, every increment with an event id: exact.
    Sync,
    /// `batched`, increments with and without event ids: bounded loss.
    Batched,
    /// `sync` with `distinct`: members counted by HyperLogLog.
    Distinct,
    /// `sync`, one shard, huge deltas: overflow refused, never wrapped.
    Big,
    /// `batched` with event ids, reconciled against an authoritative total.
    Recon,
    /// `sync` with a `min` or a `max` (tier 2), every increment with an event id: an
    /// increment that would cross the bound is refused, nothing counted.
    Bounded,
    /// `sync`, every increment with an event id, created under a namespace by its
    /// first increment (tier 3): an operator deletes it now and then while clients
    /// still write, and their next increment creates it anew under the same name.
    Recreated,
}

/// One workload counter.
#[derive(Debug, Clone)]
pub struct CounterInfo {
    /// Its name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// Its spec at creation.
    pub spec: CounterSpec,
    /// Amount the authoritative source knows beyond what was sent (recon counters):
    /// increments recorded upstream that never reached the counter.
    pub offline_extra: i128,
}

/// One attempt of an increment.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The event id it carried.
    pub event_id: Option<String>,
    /// When it was sent.
    pub sent_ms: u64,
    /// Every answer received for it (none: unknown), with the time.
    pub answers: Vec<(u64, Answer)>,
}

/// One logical increment, with all its attempts.
#[derive(Debug, Clone)]
pub struct IncrOp {
    /// The client.
    pub client: u16,
    /// Index into [`History::counters`].
    pub counter: usize,
    /// The delta.
    pub delta: i64,
    /// The distinct-count member, as a number (the member string is `m-{n}`).
    pub member: Option<u32>,
    /// When the client invoked it.
    pub invoked_ms: u64,
    /// Its attempts.
    pub attempts: Vec<Attempt>,
}

/// What became of an increment, as far as the history tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Some attempt was answered applied or duplicate: counted once; the first such
    /// answer came at `ack_ms`.
    Applied {
        /// The first acknowledgement.
        ack_ms: u64,
    },
    /// Every attempt was refused (overflow or conflict). (One refused attempt says
    /// nothing about another attempt of the same increment, nor about a duplicated
    /// copy of its own submission, which may be counted later when the shard has room:
    /// only a refusal after the cluster settled is final.)
    Refused,
    /// No attempt was answered definitely.
    Unknown,
}

impl IncrOp {
    /// This operation's status by the end of the history.
    pub fn status(&self) -> Status {
        self.status_at(u64::MAX)
    }

    /// This operation's status considering answers received before `t_ms`.
    pub fn status_at(&self, t_ms: u64) -> Status {
        let mut ack: Option<u64> = None;
        let mut refused = !self.attempts.is_empty();
        for a in &self.attempts {
            let mut this_refused = false;
            for &(at, ans) in &a.answers {
                if at >= t_ms {
                    continue;
                }
                match ans {
                    Answer::Applied | Answer::Duplicate => ack = Some(ack.map_or(at, |x: u64| x.min(at))),
                    Answer::Conflict | Answer::Overflow | Answer::Refused => this_refused = true,
                    Answer::Unavailable => {}
                }
            }
            refused &= this_refused;
        }
        match (ack, refused) {
            (Some(ack_ms), _) => Status::Applied { ack_ms },
            (None, true) => Status::Refused,
            (None, false) => Status::Unknown,
        }
    }
}

/// One read of a total.
#[derive(Debug, Clone)]
pub struct ReadOp {
    /// The counter.
    pub counter: usize,
    /// Which read.
    pub consistency: Consistency,
    /// When invoked.
    pub invoked_ms: u64,
    /// When answered (if it was).
    pub done_ms: Option<u64>,
    /// The answer.
    pub value: Option<ReadValue>,
    /// Taken after the cluster healed and every outcome was resolved.
    pub settled: bool,
}

/// One distinct-count read.
#[derive(Debug, Clone)]
pub struct DistinctOp {
    /// The counter.
    pub counter: usize,
    /// When invoked.
    pub invoked_ms: u64,
    /// When answered.
    pub done_ms: Option<u64>,
    /// (estimate, complete).
    pub estimate: Option<(u64, bool)>,
    /// Taken after the cluster healed and every outcome was resolved.
    pub settled: bool,
}

/// One frequency read of a counter that keeps frequencies (tiers 2 and 3): the
/// estimate of one member, and the heaviest members.
#[derive(Debug, Clone)]
pub struct FrequencyOp {
    /// The counter.
    pub counter: usize,
    /// The member asked about (its number, see `workload::member_name`).
    pub member: u32,
    /// When invoked.
    pub invoked_ms: u64,
    /// When both answers were in.
    pub done_ms: Option<u64>,
    /// The answers.
    pub answer: Option<FrequencyAnswer>,
}

/// What a frequency read answered.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FrequencyAnswer {
    /// The member's count-min estimate.
    pub estimate: u64,
    /// The weight the member certainly has.
    pub lower_bound: u64,
    /// The heaviest members: (member, estimate, lower bound).
    pub top: Vec<(u32, u64, u64)>,
    /// The weight the top read merged over all members.
    pub total: u64,
    /// Whether both reads merged every shard.
    pub complete: bool,
}

/// One read of a counter's sliding window (counters with `windows`).
#[derive(Debug, Clone)]
pub struct WindowOp {
    /// The counter.
    pub counter: usize,
    /// When invoked.
    pub invoked_ms: u64,
    /// When answered.
    pub done_ms: Option<u64>,
    /// The answer.
    pub value: Option<WindowValue>,
    /// Taken after the cluster healed and every outcome was resolved.
    pub settled: bool,
}

/// A window read's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowValue {
    /// The sum of the deltas in the window's buckets.
    pub value: i128,
    /// The start of its oldest bucket, in run time (negative: before the run began).
    pub start_ms: i64,
    /// The estimated distinct members in the window (counters with `distinct`).
    pub estimate: Option<u64>,
    /// Whether every shard answered.
    pub complete: bool,
}

/// One reconciliation.
#[derive(Debug, Clone)]
pub struct ReconcileOp {
    /// The counter.
    pub counter: usize,
    /// The authoritative total it was given.
    pub authoritative: i128,
    /// When invoked.
    pub invoked_ms: u64,
    /// When answered.
    pub done_ms: Option<u64>,
    /// (before, drift).
    pub result: Option<(i128, i128)>,
}

/// How the node asked to delete a counter answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// The counter existed and is deleted.
    Yes,
    /// There was no such counter: nothing was deleted.
    NotFound,
    /// It failed, or its answer was lost: the deletion may apply, until the cluster
    /// settles.
    Unknown,
}

/// One deletion of a counter, by an operator who waits for its answer.
#[derive(Debug, Clone)]
pub struct DeleteOp {
    /// The counter.
    pub counter: usize,
    /// When it was sent.
    pub invoked_ms: u64,
    /// When it was answered (if it was).
    pub done_ms: Option<u64>,
    /// The answer.
    pub outcome: Deleted,
}

impl DeleteOp {
    /// Until when the deletion may take effect: its answer, or, when that says
    /// nothing, the moment the cluster settled (nothing sent before is in flight
    /// then). A deletion answered not found takes no effect at all.
    pub fn may_apply_until(&self, h: &History) -> u64 {
        match (self.outcome, self.done_ms) {
            (Deleted::Yes | Deleted::NotFound, Some(done)) => done,
            _ => h.settle_ms.max(self.invoked_ms),
        }
    }
}

/// Kinds of injected faults, for the summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// A node crashed (volatile state gone, unflushed writes lost).
    Crash,
    /// A node was restarted after a crash or a failed flush.
    Restart,
    /// Two groups of nodes could not talk.
    PartitionSymmetric,
    /// One node could not send to another (the reverse worked).
    PartitionOneWay,
    /// A node stopped processing for a while.
    Pause,
    /// A flush failed and poisoned its node.
    FsyncFailure,
    /// The metadata leader failed over; writes were unavailable.
    MetaOutage,
    /// A message was lost.
    MessageLost,
    /// A message was delivered twice.
    MessageDuplicated,
    /// A message was dropped by a partition.
    MessageCut,
    /// A shard moved to a new owner in a membership change (counted by the tier that
    /// runs the engine's hand-off).
    ShardMoved,
    /// A crashed node came back with an empty disk (replicated runs).
    DiskLost,
    /// A range group's replica on an emptied disk was promoted in place of the old
    /// one (replicated runs, counted at the end).
    ReplicaReplaced,
    /// A range's leader was cut off from every other node for longer than an
    /// election takes (replicated runs): the others elect a new leader while it
    /// still believes it leads.
    LeaderIsolated,
    /// A range's leader stopped for longer than an election takes (replicated runs):
    /// its lease expires while it cannot notice, and it resumes as a deposed leader.
    LeaderPaused,
    /// A range group's voters sit on other nodes than at the start, after
    /// membership changes (replicated runs, counted at the end).
    RangeMoved,
    /// A snapshot a range replica installed (replicated runs, counted at the end
    /// over the replicas of the nodes' last lives).
    SnapshotInstalled,
    /// A range's leader left its group in a membership change and closed it; the
    /// remaining voters elect another once its lease runs out (replicated runs).
    LeaderHandedOver,
    /// A node closed its group of a range the group had removed it from
    /// (replicated runs).
    GroupRetired,
    /// A node's wall clock jumped to another offset from true time, backwards or
    /// forwards (tier 2 with skewed clocks).
    ClockJump,
    /// A dedup record read by a shard's sweep of expired records (tier 2, counted at
    /// the end over the nodes' last lives): with short dedup windows, records expire
    /// and are swept within a run.
    DedupRecordSwept,
    /// A membership change the metadata group committed (tier 3, through a node's
    /// `add_member` or `remove_member`).
    MembershipChange,
    /// Of the disks lost, those that lost only the range replicas' store, the rest
    /// of the data directory kept (tier 3): the node refused to start on part of its
    /// directory.
    ReplicaStoreLost,
    /// A node that refused to start on part of its data directory was brought back
    /// by its operator with a whole empty one (tier 3).
    DirectoryEmptied,
    /// An operator's deletion of a counter that clients still write to (tier 3).
    CounterDeleted,
    /// A metadata RPC whose connection broke off: its caller learned at once that
    /// it failed, not whether it was served (tier 3).
    MetaReset,
}

impl FaultKind {
    /// Every kind, in summary order.
    pub const ALL: [FaultKind; 26] = [
        FaultKind::Crash,
        FaultKind::Restart,
        FaultKind::PartitionSymmetric,
        FaultKind::PartitionOneWay,
        FaultKind::Pause,
        FaultKind::FsyncFailure,
        FaultKind::MetaOutage,
        FaultKind::MessageLost,
        FaultKind::MessageDuplicated,
        FaultKind::MessageCut,
        FaultKind::ShardMoved,
        FaultKind::DiskLost,
        FaultKind::ReplicaReplaced,
        FaultKind::LeaderIsolated,
        FaultKind::LeaderPaused,
        FaultKind::RangeMoved,
        FaultKind::SnapshotInstalled,
        FaultKind::LeaderHandedOver,
        FaultKind::GroupRetired,
        FaultKind::ClockJump,
        FaultKind::DedupRecordSwept,
        FaultKind::MembershipChange,
        FaultKind::ReplicaStoreLost,
        FaultKind::DirectoryEmptied,
        FaultKind::CounterDeleted,
        FaultKind::MetaReset,
    ];

    /// A short name for tables.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Crash => "crash",
            FaultKind::Restart => "restart",
            FaultKind::PartitionSymmetric => "partition",
            FaultKind::PartitionOneWay => "one-way partition",
            FaultKind::Pause => "pause",
            FaultKind::FsyncFailure => "fsync failure",
            FaultKind::MetaOutage => "metadata failover",
            FaultKind::MessageLost => "message lost",
            FaultKind::MessageDuplicated => "message duplicated",
            FaultKind::MessageCut => "message cut",
            FaultKind::ShardMoved => "shard moved",
            FaultKind::DiskLost => "disk lost",
            FaultKind::ReplicaReplaced => "replica replaced",
            FaultKind::LeaderIsolated => "leader isolated",
            FaultKind::LeaderPaused => "leader paused",
            FaultKind::RangeMoved => "range moved",
            FaultKind::SnapshotInstalled => "snapshot installed",
            FaultKind::LeaderHandedOver => "leader handed over",
            FaultKind::GroupRetired => "group retired",
            FaultKind::ClockJump => "clock jump",
            FaultKind::DedupRecordSwept => "dedup record swept",
            FaultKind::MembershipChange => "membership change",
            FaultKind::ReplicaStoreLost => "replica store lost",
            FaultKind::DirectoryEmptied => "directory emptied",
            FaultKind::CounterDeleted => "counter deleted",
            FaultKind::MetaReset => "metadata RPC reset",
        }
    }
}

/// A period during which some node could not serve normally (down, paused, poisoned,
/// cut off) or metadata was unavailable: bounds that hold only while the cluster is
/// healthy are not checked across it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disturbance {
    /// Start.
    pub from_ms: u64,
    /// End (exclusive).
    pub to_ms: u64,
}

/// Everything a run recorded.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// The workload counters.
    pub counters: Vec<CounterInfo>,
    /// Increments.
    pub incrs: Vec<IncrOp>,
    /// Total reads.
    pub reads: Vec<ReadOp>,
    /// Distinct reads.
    pub distincts: Vec<DistinctOp>,
    /// Window reads (tier 2).
    pub windows: Vec<WindowOp>,
    /// Frequency reads (tiers 2 and 3).
    pub frequencies: Vec<FrequencyOp>,
    /// Reconciliations.
    pub reconciles: Vec<ReconcileOp>,
    /// Deletions of counters (tier 3).
    pub deletions: Vec<DeleteOp>,
    /// Times at which a node lost its volatile state and unflushed writes (crash, or
    /// restart after a failed flush), with the node.
    pub crashes: Vec<(u64, u8)>,
    /// Periods of disturbance.
    pub disturbances: Vec<Disturbance>,
    /// When the cluster was healed (every fault ended).
    pub healed_ms: u64,
    /// When clients started resolving unknown outcomes: no message sent before is in
    /// flight any more, so an answer to a later attempt is final.
    pub settle_ms: u64,
    /// Nodes that were ever members.
    pub nodes: BTreeSet<u8>,
    /// How much longer than the model's one tick a rollup refresh may take: 0 where
    /// remote shard reads are instantaneous (tier 1); the slowest round trip where
    /// they cross a simulated network (tier 2).
    pub refresh_slack_ms: u64,
    /// Periods in which some node-to-node call went unanswered (its request or answer
    /// lost or cut, until the caller's timeout and one more tick): a rollup refresh
    /// may fail then, so the staleness bound is not checked across them. In tier 1,
    /// where remote reads cannot be lost, the membership hand-offs: a shard not yet
    /// adopted by its new owner answers no read until it is. With range groups, a
    /// leader that left its range in a membership change: the range has no leader
    /// until the remaining voters elect one, up to a failover later.
    pub unanswered_calls: Vec<Disturbance>,
    /// How long after a disturbance ends the cluster may still not serve normally:
    /// 0 with one copy of every shard; with range groups, a failover (a range whose
    /// leader was disturbed elects another, and requests wait for it).
    pub recovery_ms: u64,
    /// How far any node's wall clock may be off true time, in milliseconds: what a
    /// node stamps (a cached total's `as_of`, a window's start, the bucket an
    /// increment is filed in) is that much off the history's time.
    pub clock_skew_ms: u64,
}

#[cfg(test)]
impl History {
    /// A history of one workload counter, settled at 10 s: what a checker's unit
    /// test builds its operations on.
    pub(crate) fn of_one(name: &str, role: Role) -> Self {
        let spec = tally_core::CounterSpec::default();
        let counters = vec![CounterInfo { name: name.into(), role, spec, offline_extra: 0 }];
        Self { counters, settle_ms: 10_000, ..Self::default() }
    }

    /// Adds an increment of 1 to counter 0 sent at `sent` (event id `e{sent}`), of
    /// `member` if given, answered applied at `answered` or never answered.
    pub(crate) fn push_one(&mut self, sent: u64, member: Option<u32>, answered: Option<u64>) {
        let answers = answered.map(|t| vec![(t, crate::msg::Answer::Applied)]).unwrap_or_default();
        let attempts = vec![Attempt { event_id: Some(format!("e{sent}")), sent_ms: sent, answers }];
        self.incrs.push(IncrOp { client: 0, counter: 0, delta: 1, member, invoked_ms: sent, attempts });
    }
}
