//! Known bugs that can be switched on at run time, so the simulator can show that its
//! checker catches them. Compiled only with the `planted-bugs` feature; without it no
//! hook exists and nothing in the core changes.
//!
//! The switch is per thread: a simulation runs on one thread, and tests that run
//! simulations in parallel each plant their own bug. Bugs that live in the core are
//! hooked where the real logic is (`dedup`, `limits`, `rollup`, `shard_machine`,
//! `handoff_machine`); the others live in the engine's or the simulator's shells and
//! read the same switch.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Bug {
    /// A `sync` increment is acknowledged when committed, before the flush.
    AckBeforeFlush,
    /// Every event id is judged fresh: the dedup window remembers nothing.
    DedupOff,
    /// A client retries a timed-out increment under a new event id.
    RetryFreshId,
    /// A checked write wraps around instead of being refused.
    WrappingAdd,
    /// Dedup lookups skip the sealed generations, as if a resharding lost them.
    DedupLostOnReshard,
    /// A cached total is never refreshed.
    RollupNeverRefreshed,
    /// The reconciler writes its correction twice, under two ids.
    ReconcileTwice,
    /// Engine: the shard actor answers `sync` submissions once their write is
    /// applied, before the flush that makes it durable.
    EngineAckBeforeFlush,
    /// Engine: a shard reopened after a restart forgets its durable seal marker and
    /// accepts writes its generation's successor no longer counts.
    SealForgottenOnRestart,
    /// Engine: a read that finds every shard of its generation sealed sums them as
    /// current, without asking whether a resharding completed meanwhile.
    ReadIgnoresSeal,
    /// Hand-off machine: a hand-off pass deletes the previous owner's copy of a shard
    /// before its new owner has adopted it.
    HandoffDeletesEarly,
    /// Hand-off machine: a shard handed off to a new owner loses its seal there.
    HandoffForgetsSeal,
    /// Engine: a sealed generation's sketch is merged into the store beside a live
    /// shard actor, whose next commit writes its own sketch back over it.
    SketchMergeBesideLive,
    /// Escrow: a shard short of headroom spends what it has and admits the increment
    /// anyway, as if its share covered it.
    EscrowOverspend,
    /// Replication: a replicated store answers a shard commit as soon as it is sent
    /// to its range group, before a quorum holds it durably.
    AckBeforeQuorumDurable,
    /// Replication: a node that believes it leads a range serves its shards without
    /// confirming with a quorum, and a range group applies every image whatever
    /// state its writer built on, so a deposed leader's writer acknowledges too.
    TwoLeadersAck,
    /// Replication: a node that comes back with an empty disk rejoins its range
    /// groups as the replica it was, counting towards quorums before it caught up.
    CatchUpSkipped,
    /// Replication: an append carries every entry openraft hands over, however many
    /// bytes they take, and the transport's refusal of it for its size is reported
    /// as an unreachable replica, so openraft sends the same append again, for ever:
    /// a replica that fell behind by more than one message never catches up.
    OversizedAppendUnreachable,
    /// Cluster: a node's range replicas take their raft id from the node's raft id,
    /// the same on every disk, instead of from its data directory's identity, so a
    /// node back with an empty disk rejoins its groups as the replica it was.
    ReplicaIdFromRaftId,
    /// Metadata: a proposer resends a proposal whose outcome it does not know as the
    /// bare request, without its identity, so the state machine applies it again.
    ProposalResentWithoutIdentity,
    /// Metadata: a read that must see every change committed before it began
    /// (`MetaRaft::counter_linearizable`) answers from this node's applied state
    /// without a read index, so a node whose metadata lags a creation made elsewhere
    /// answers that the counter does not exist.
    ReadIndexSkipped,
    /// Metadata: the state machine applies a proposal it already applied (a copy the
    /// proposer resent after losing the answer) again, instead of answering what it
    /// answered the first time.
    ProposalAppliedTwice,
}

impl Bug {
    /// The bugs tier 1 catches, in a fixed order (`handoff-deletes-early` is in the
    /// hand-off machine, which both tiers run, so it is in [`Bug::ENGINE`] too).
    pub const ALL: [Bug; 8] = [
        Bug::AckBeforeFlush,
        Bug::DedupOff,
        Bug::RetryFreshId,
        Bug::WrappingAdd,
        Bug::DedupLostOnReshard,
        Bug::RollupNeverRefreshed,
        Bug::ReconcileTwice,
        Bug::HandoffDeletesEarly,
    ];

    /// The bugs planted in the engine's own code (`tally-engine`) or in a machine of
    /// the core that only the engine's shells make observable, caught by tier 2. The
    /// two hand-off bugs live in `handoff_machine`; tier 1 runs that machine too, but
    /// cannot observe a forgotten seal (its metadata is never stale, so the layout
    /// refuses the sealed shard's writes anyway).
    pub const ENGINE: [Bug; 7] = [
        Bug::EngineAckBeforeFlush,
        Bug::SealForgottenOnRestart,
        Bug::ReadIgnoresSeal,
        Bug::HandoffDeletesEarly,
        Bug::HandoffForgetsSeal,
        Bug::SketchMergeBesideLive,
        Bug::EscrowOverspend,
    ];

    /// The bugs planted in shard replication (`tally-replica`, and the identity a
    /// node's store incarnation gives its replicas), caught by tier 2 with range
    /// groups (`--replicas 3`).
    pub const REPLICA: [Bug; 3] = [Bug::AckBeforeQuorumDurable, Bug::TwoLeadersAck, Bug::CatchUpSkipped];

    /// The bugs planted in the cluster layer (`tally-cluster`, `tally-raft`, and the
    /// range groups' use of the node-to-node transport's message bound), caught by
    /// tier 3 (whole nodes).
    pub const CLUSTER: [Bug; 5] = [
        Bug::OversizedAppendUnreachable,
        Bug::ReplicaIdFromRaftId,
        Bug::ProposalResentWithoutIdentity,
        Bug::ReadIndexSkipped,
        Bug::ProposalAppliedTwice,
    ];

    /// The name used on command lines.
    pub fn as_str(self) -> &'static str {
        match self {
            Bug::AckBeforeFlush => "ack-before-flush",
            Bug::DedupOff => "dedup-off",
            Bug::RetryFreshId => "retry-fresh-id",
            Bug::WrappingAdd => "wrapping-add",
            Bug::DedupLostOnReshard => "dedup-lost-on-reshard",
            Bug::RollupNeverRefreshed => "rollup-never-refreshed",
            Bug::ReconcileTwice => "reconcile-twice",
            Bug::EngineAckBeforeFlush => "engine-ack-before-flush",
            Bug::SealForgottenOnRestart => "seal-forgotten-on-restart",
            Bug::ReadIgnoresSeal => "read-ignores-seal",
            Bug::HandoffDeletesEarly => "handoff-deletes-early",
            Bug::HandoffForgetsSeal => "handoff-forgets-seal",
            Bug::SketchMergeBesideLive => "sketch-merge-beside-live",
            Bug::EscrowOverspend => "escrow-overspend",
            Bug::AckBeforeQuorumDurable => "ack-before-quorum-durable",
            Bug::TwoLeadersAck => "two-leaders-ack",
            Bug::CatchUpSkipped => "catch-up-skipped",
            Bug::OversizedAppendUnreachable => "oversized-append-unreachable",
            Bug::ReplicaIdFromRaftId => "replica-id-from-raft-id",
            Bug::ProposalResentWithoutIdentity => "proposal-resent-without-identity",
            Bug::ReadIndexSkipped => "read-index-skipped",
            Bug::ProposalAppliedTwice => "proposal-applied-twice",
        }
    }
}

impl fmt::Display for Bug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A bug name that is not planted anywhere.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown planted bug {0:?}")]
pub struct UnknownBug(pub String);

impl FromStr for Bug {
    type Err = UnknownBug;
    fn from_str(s: &str) -> Result<Self, UnknownBug> {
        Bug::ALL
            .into_iter()
            .chain(Bug::ENGINE)
            .chain(Bug::REPLICA)
            .chain(Bug::CLUSTER)
            .find(|b| b.as_str() == s)
            .ok_or_else(|| UnknownBug(s.to_owned()))
    }
}

thread_local! {
    static ACTIVE: Cell<Option<Bug>> = const { Cell::new(None) };
}

/// Plants `bug` on this thread (or none), replacing the one planted before.
pub fn plant(bug: Option<Bug>) {
    ACTIVE.with(|a| a.set(bug));
}

/// The bug planted on this thread, if any.
pub fn planted() -> Option<Bug> {
    ACTIVE.with(Cell::get)
}

/// Whether `bug` is planted on this thread.
pub fn active(bug: Bug) -> bool {
    planted() == Some(bug)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_switch_is_per_thread() {
        for b in Bug::ALL.into_iter().chain(Bug::ENGINE).chain(Bug::REPLICA).chain(Bug::CLUSTER) {
            assert_eq!(b.as_str().parse::<Bug>(), Ok(b));
        }
        plant(Some(Bug::DedupOff));
        assert!(active(Bug::DedupOff));
        std::thread::spawn(|| assert_eq!(planted(), None)).join().unwrap();
        plant(None);
        assert!(!active(Bug::DedupOff));
    }
}
