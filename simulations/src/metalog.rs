//! Cluster metadata as one linearizable log: counter specs and layouts (every counter
//! command is `tally_core::meta::apply_command`, exactly what the replicated state
//! machine applies) and the membership with its pending change.
//!
//! The real metadata is an openraft group; here it is a model of what a client of
//! that group observes: every node reads the latest committed state, and a leader
//! failover shows as a window during which writes are refused.

use std::collections::{BTreeMap, BTreeSet};
use tally_core::meta::{apply_command, CounterMeta, MetaCommand, MetaEffect, MetaError};
use tally_core::ring::{Ring, VNODES_PER_NODE_DEFAULT};
use tally_core::{CounterName, NodeId, ShardId};

/// Why a metadata write was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// The log has no leader right now (a failover): retry later.
    #[error("metadata leader unavailable until {until_ms} ms")]
    Unavailable {
        /// When writes are possible again.
        until_ms: u64,
    },
    /// The counter command was refused by `apply_command`.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// A membership change was asked for while another is in progress.
    #[error("a membership change is already in progress")]
    MembershipBusy,
}

/// The cluster membership: who owns shards now, and who will once a change completes.
#[derive(Debug, Clone)]
pub struct Membership {
    /// Current members.
    pub members: BTreeSet<u8>,
    /// The ring over `members`.
    pub ring: Ring,
    /// The members and ring after the change in progress, if any.
    pub pending: Option<(BTreeSet<u8>, Ring)>,
    /// Bumped by every completed change.
    pub epoch: u64,
}

/// The name of node `i`.
pub fn node_name(i: u8) -> NodeId {
    NodeId::new(format!("node{}", i + 1))
}

/// The index of a node named by [`node_name`].
pub fn node_index(id: &NodeId) -> u8 {
    id.as_str()["node".len()..].parse::<u8>().expect("simulated node names are nodeN") - 1
}

fn ring_of(members: &BTreeSet<u8>) -> Ring {
    Ring::new(members.iter().map(|&i| node_name(i)), VNODES_PER_NODE_DEFAULT)
}

/// The metadata log.
#[derive(Debug, Clone)]
pub struct MetaLog {
    /// Every counter's metadata.
    pub counters: BTreeMap<CounterName, CounterMeta>,
    /// The membership.
    pub membership: Membership,
    /// Entries applied so far.
    pub index: u64,
    /// Writes are refused before this time (a leader failover).
    pub unavailable_until_ms: u64,
}

impl MetaLog {
    /// A log whose members are nodes `0..nodes`.
    pub fn new(nodes: u8) -> Self {
        let members: BTreeSet<u8> = (0..nodes).collect();
        let ring = ring_of(&members);
        Self {
            counters: BTreeMap::new(),
            membership: Membership { members, ring, pending: None, epoch: 0 },
            index: 0,
            unavailable_until_ms: 0,
        }
    }

    fn writable(&self, now_ms: u64) -> Result<(), LogError> {
        if now_ms < self.unavailable_until_ms {
            return Err(LogError::Unavailable { until_ms: self.unavailable_until_ms });
        }
        Ok(())
    }

    /// Appends and applies a counter command.
    pub fn counter(
        &mut self,
        name: &CounterName,
        cmd: &MetaCommand,
        now_ms: u64,
    ) -> Result<MetaEffect, LogError> {
        self.writable(now_ms)?;
        let current = self.counters.get(name).cloned();
        let (next, effect) = apply_command(current, cmd, now_ms)?;
        match next {
            Some(m) => self.counters.insert(name.clone(), m),
            None => self.counters.remove(name),
        };
        self.index += 1;
        Ok(effect)
    }

    /// Starts a membership change to `members`.
    pub fn begin_membership(&mut self, members: BTreeSet<u8>, now_ms: u64) -> Result<(), LogError> {
        self.writable(now_ms)?;
        if self.membership.pending.is_some() {
            return Err(LogError::MembershipBusy);
        }
        let ring = ring_of(&members);
        self.membership.pending = Some((members, ring));
        self.index += 1;
        Ok(())
    }

    /// Completes the membership change in progress (idempotent).
    pub fn complete_membership(&mut self, now_ms: u64) -> Result<(), LogError> {
        self.writable(now_ms)?;
        if let Some((members, ring)) = self.membership.pending.take() {
            self.membership.members = members;
            self.membership.ring = ring;
            self.membership.epoch += 1;
            self.index += 1;
        }
        Ok(())
    }

    /// The node that owns `shard` now.
    pub fn owner(&self, shard: &ShardId) -> u8 {
        node_index(self.membership.ring.owner(shard).expect("membership is never empty"))
    }

    /// Whether `shard` is moving in the membership change in progress: it takes no
    /// writes until the change completes.
    pub fn moving(&self, shard: &ShardId) -> bool {
        match &self.membership.pending {
            Some((_, ring)) => ring.owner(shard) != self.membership.ring.owner(shard),
            None => false,
        }
    }

    /// Every shard that holds data: all generations of every counter.
    pub fn all_shards(&self) -> Vec<ShardId> {
        let mut out = Vec::new();
        for (name, meta) in &self.counters {
            for (generation, shards) in meta.generations() {
                for index in 0..shards {
                    out.push(ShardId::new(name.clone(), generation, index));
                }
            }
        }
        out
    }
}
