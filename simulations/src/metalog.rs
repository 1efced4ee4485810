//! Cluster metadata as one linearizable log: counter specs and layouts (every counter
//! command is `tally_core::meta::apply_command`, exactly what the replicated state
//! machine applies) and the membership with the change being handed off.
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

/// The cluster membership: who owns shards, and, while a change is being handed
/// off, who owned them before it and which previous members still hold shards.
#[derive(Debug, Clone)]
pub struct Membership {
    /// Current members.
    pub members: BTreeSet<u8>,
    /// The ring over `members`.
    pub ring: Ring,
    /// The ring before the change being handed off, if one is.
    pub previous: Option<Ring>,
    /// The previous members that have not yet reported nothing left behind.
    pub handoff: BTreeSet<u8>,
    /// Bumped by every change.
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
            membership: Membership { members, ring, previous: None, handoff: BTreeSet::new(), epoch: 0 },
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

    /// Changes the membership to `members`, as the metadata group does: the new ring
    /// owns every shard at once, and each previous member must then report that it
    /// handed off everything it no longer owns. Refused while a change is handed off.
    pub fn begin_membership(&mut self, members: BTreeSet<u8>, now_ms: u64) -> Result<u64, LogError> {
        self.writable(now_ms)?;
        if self.membership.previous.is_some() {
            return Err(LogError::MembershipBusy);
        }
        let ring = ring_of(&members);
        let previous = std::mem::replace(&mut self.membership.ring, ring);
        self.membership.previous = Some(previous);
        self.membership.handoff = std::mem::replace(&mut self.membership.members, members);
        self.membership.epoch += 1;
        self.index += 1;
        Ok(self.membership.epoch)
    }

    /// Node `node` reports that it left nothing behind at `epoch` (idempotent); the
    /// change is over once every previous member has.
    pub fn handed_off(&mut self, node: u8, epoch: u64, now_ms: u64) -> Result<(), LogError> {
        self.writable(now_ms)?;
        if epoch == self.membership.epoch && self.membership.handoff.remove(&node) {
            if self.membership.handoff.is_empty() {
                self.membership.previous = None;
            }
            self.index += 1;
        }
        Ok(())
    }

    /// The node that owns `shard`.
    pub fn owner(&self, shard: &ShardId) -> u8 {
        node_index(self.membership.ring.owner(shard).expect("membership is never empty"))
    }

    /// The previous owner of `shard` for node `n`, with the change's epoch, while the
    /// change that gave `n` the shard is handed off (the engine's
    /// `Placement::previous_owner`).
    pub fn previous_owner(&self, n: u8, shard: &ShardId) -> Option<(u8, u64)> {
        let previous = self.membership.previous.as_ref()?;
        if self.owner(shard) != n {
            return None;
        }
        let before = node_index(previous.owner(shard)?);
        (before != n).then_some((before, self.membership.epoch))
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
