//! Shard replication in a running cluster: the range groups of `tally-replica`
//! over this node's sessions, the directory of ranges, forming the groups, and
//! replacing the replica of a node that came back with an empty disk.
//!
//! * **Directory.** The ring's circle is cut into `RANGES_PER_NODE` ranges per
//!   initial member; each range is replicated on `min(R, members)` nodes
//!   ([`tally_core::ranges::Directory`]). Every node computes the same directory
//!   from the config's initial members, so it needs no agreement of its own; the
//!   membership of the cluster is fixed while shards are replicated.
//! * **Replica ids.** A replica's raft id is derived from the node's store identity
//!   (`StoreId`, recorded in the metadata group when the node registers): a node
//!   that comes back with an empty data directory is a new replica, which the
//!   range's leader adds as a learner and promotes, replacing the old id, only once
//!   it holds everything the leader applied ([`Replication::tend`]).
//! * **Forming.** A range's group is initialized once, by its preferred leader,
//!   when every replica's store is registered and every other replica answers that
//!   its group holds nothing yet; a node whose peers already formed the group waits
//!   to be added instead, so an emptied node never starts a rival group.
//! * **Routing.** A shard's requests go to its range's leader; a node that is not
//!   the leader refuses to serve the shard's state ([`Replication::confirm`]); a
//!   request that found no leader waits for the next one, up to
//!   [`LEADER_WAIT_MS`].

use crate::Member;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tally_core::codec;
use tally_core::ranges::{Directory, RangeId};
use tally_core::{NodeId, ShardId};
use tally_engine::{ShardRequest, TallyError};
use tally_raft::{MetaRaft, StoreId};
use tally_replica::{
    NetError, RangeEnvelope, RangeGroups, RangeNetwork, RangeReply, ReplicaError, ReplicaId, ReplicaNode,
    FAILOVER_BOUND_MS,
};
use tally_transport::Transport;

/// Longest wait for a range to have a leader before a request gives up: a
/// failover, and a heartbeat for the news to spread.
pub const LEADER_WAIT_MS: u64 = FAILOVER_BOUND_MS + 500;
/// Pause between looks at a range's leader while waiting for one.
pub const LEADER_POLL_MS: u64 = 20;
/// Pause between passes that form groups and replace replicas.
pub const TEND_EVERY_MS: u64 = 500;
/// How long one range message may take on the node-to-node session (a snapshot
/// chunk of 1 MiB included).
pub const RANGE_CALL_TIMEOUT_MS: u64 = 10_000;
/// How long a peer may take to say whether its group of a range is formed.
pub const FORMED_ASK_TIMEOUT_MS: u64 = 1_000;
/// How long a learner may take to catch up before its promotion is tried again
/// on the next pass.
pub const CATCH_UP_WAIT_MS: u64 = 2_000;

/// What one node sends another on its node-to-node session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum PeerRequest {
    /// A request for a shard's owner (the engine answers it).
    Shard(ShardRequest),
    /// A raft message for one of the node's range groups.
    Range(RangeEnvelope),
    /// Whether the node's group of a range holds a membership already.
    Formed(RangeId),
}

/// The raft id of the replicas a node runs on store `store`.
pub fn replica_id_of(store: StoreId) -> ReplicaId {
    // Folded to 64 bits, never 0 (openraft's ids are plain u64s; 0 reads as unset
    // in logs and is easy to confuse).
    let folded = (store.0 as u64) ^ ((store.0 >> 64) as u64);
    folded.max(1)
}

/// Range messages over the node-to-node sessions.
pub(crate) struct SessionNet {
    pub(crate) transport: Transport,
}

impl RangeNetwork for SessionNet {
    fn call(
        &self,
        node: &ReplicaNode,
        envelope: RangeEnvelope,
    ) -> BoxFuture<'static, Result<RangeReply, NetError>> {
        let transport = self.transport.clone();
        let node = node.node.clone();
        Box::pin(async move {
            let to = envelope.to;
            let bytes = codec::encode(&PeerRequest::Range(envelope));
            let timeout = Duration::from_millis(RANGE_CALL_TIMEOUT_MS);
            let answer =
                transport.call(&node, bytes, timeout).await.map_err(|_| NetError::Unreachable(to))?;
            tally_replica::network::decode_reply(&answer)
        })
    }
}

/// A node's part in shard replication.
pub struct Replication {
    pub(crate) me: NodeId,
    pub(crate) groups: Arc<RangeGroups>,
    pub(crate) directory: Directory,
    pub(crate) members: Vec<Member>,
    pub(crate) raft: Arc<MetaRaft>,
    pub(crate) transport: Transport,
}

fn unavailable(id: &ShardId, reason: String) -> TallyError {
    TallyError::Unavailable { shard: id.to_string(), reason }
}

impl Replication {
    /// The range of shard `id`.
    pub fn range_of(&self, id: &ShardId) -> RangeId {
        self.directory.range_of_shard(id)
    }

    /// The node leading `id`'s range, as this node knows it.
    pub fn leader_of(&self, id: &ShardId) -> Option<NodeId> {
        self.groups.leader_node(self.range_of(id)).map(NodeId::new)
    }

    /// The node that should serve `id` now: the range's leader, or while none is
    /// known its preferred leader.
    pub fn owner(&self, id: &ShardId) -> NodeId {
        let range = self.range_of(id);
        match self.groups.leader_node(range) {
            Some(n) => NodeId::new(n),
            None => self.directory.preferred_leader(range).cloned().unwrap_or_else(|| self.me.clone()),
        }
    }

    /// Waits until `id`'s range has a leader other than `not`, at most
    /// [`LEADER_WAIT_MS`].
    pub async fn next_leader(&self, id: &ShardId, not: Option<&NodeId>) -> Option<NodeId> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(LEADER_WAIT_MS);
        loop {
            if let Some(l) = self.leader_of(id).filter(|l| Some(l) != not) {
                return Some(l);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(LEADER_POLL_MS)).await;
        }
    }

    /// Confirms that this node leads `id`'s range and has applied everything
    /// committed (a read index): only then may it start the shard's actor or
    /// answer its state. While the range has no leader, waits for one.
    pub async fn confirm(&self, id: &ShardId) -> Result<(), TallyError> {
        let range = self.range_of(id);
        let leader = self.next_leader(id, None).await;
        match leader {
            Some(l) if l == self.me => {}
            Some(l) => return Err(unavailable(id, format!("{l} leads its replica group {range}"))),
            None => return Err(unavailable(id, format!("its replica group {range} has no leader"))),
        }
        self.groups.confirm(range).await.map_err(|e| unavailable(id, e.to_string()))
    }

    /// Whether every group this node runs knows a leader (once true at start, the
    /// node's shards can be served; see `ClusterNode::ready`).
    pub fn every_group_has_a_leader(&self) -> bool {
        self.groups.ranges().into_iter().all(|r| self.groups.leader(r).is_ok_and(|l| l.is_some()))
    }

    /// Answers a peer's question whether this node's group of `range` is formed.
    pub(crate) fn formed(&self, range: RangeId) -> bool {
        self.groups.formed(range)
    }

    fn member(&self, node: &NodeId) -> Option<&Member> {
        self.members.iter().find(|m| m.id == node.as_str())
    }

    /// The replica id each node of `range` runs now, from the stores the metadata
    /// group recorded; `None` while one is not registered.
    fn current_replicas(&self, range: RangeId) -> Option<BTreeMap<ReplicaId, ReplicaNode>> {
        let mut out = BTreeMap::new();
        for node in self.directory.replicas(range) {
            let m = self.member(node)?;
            let record = self.raft.store_of(m.raft_id)?;
            out.insert(replica_id_of(record.store), ReplicaNode { node: node.as_str().to_owned() });
        }
        Some(out)
    }

    async fn peer_formed(&self, node: &str, range: RangeId) -> Option<bool> {
        let bytes = codec::encode(&PeerRequest::Formed(range));
        let answer =
            self.transport.call(node, bytes, Duration::from_millis(FORMED_ASK_TIMEOUT_MS)).await.ok()?;
        codec::decode::<bool>("formed answer", &answer).ok()
    }

    /// Forms `range`'s group if this node is its preferred leader and nobody formed
    /// it yet.
    async fn form(&self, range: RangeId) -> Result<(), ReplicaError> {
        if self.groups.formed(range) || self.directory.preferred_leader(range) != Some(&self.me) {
            return Ok(());
        }
        let Some(replicas) = self.current_replicas(range) else { return Ok(()) };
        for node in replicas.values().filter(|n| n.node != self.me.as_str()) {
            match self.peer_formed(&node.node, range).await {
                Some(false) => {}
                // Formed elsewhere: this node waits to be added. Unreachable: ask
                // again on the next pass.
                Some(true) | None => return Ok(()),
            }
        }
        let members: Vec<(ReplicaId, ReplicaNode)> = replicas.into_iter().collect();
        self.groups.initialize(range, &members).await?;
        tracing::info!(%range, replicas = members.len(), "formed a range group");
        Ok(())
    }

    /// On the leader of `range`: a node whose store changed (an empty disk) runs
    /// a new replica; it is added as a learner, and once caught up promoted in
    /// place of the node's old replica, by joint consensus.
    async fn replace(&self, range: RangeId) -> Result<(), ReplicaError> {
        if !self.groups.leads(range) {
            return Ok(());
        }
        let Some(wanted) = self.current_replicas(range) else { return Ok(()) };
        let members = self.groups.members(range)?;
        if members.joint {
            return Ok(());
        }
        let held = self.groups.replica_nodes(range)?;
        for (id, node) in wanted {
            if members.voters.contains(&id) {
                continue;
            }
            if !members.learners.contains(&id) {
                tracing::info!(%range, replica = id, node = %node, "adding a new replica as a learner");
                self.groups.add_learner(range, id, node).await?;
                continue;
            }
            self.groups.wait_caught_up(range, id, Duration::from_millis(CATCH_UP_WAIT_MS)).await?;
            let old: Vec<ReplicaId> =
                held.iter().filter(|(r, n)| **r != id && n.node == node.node).map(|(r, _)| *r).collect();
            tracing::info!(%range, replica = id, node = %node, replaced = ?old, "promoting a caught-up replica");
            self.groups.promote(range, id, &old).await?;
        }
        Ok(())
    }

    /// One pass over this node's ranges: forms what needs forming, replaces what
    /// needs replacing. Failures are retried on the next pass.
    pub(crate) async fn tend(&self) {
        // Ranges are tended side by side: one whose peer is slow to answer holds up
        // no other.
        let passes = self.groups.ranges().into_iter().map(|range| async move {
            if let Err(e) = self.form(range).await {
                tracing::warn!(%range, error = %e, "cannot form a range group yet");
            }
            match self.replace(range).await {
                Ok(()) | Err(ReplicaError::NotCaughtUp { .. }) | Err(ReplicaError::NotLeader { .. }) => {}
                Err(e) => tracing::warn!(%range, error = %e, "cannot replace a replica yet"),
            }
        });
        futures::future::join_all(passes).await;
    }

    /// Tends the groups every [`TEND_EVERY_MS`] until the task is dropped.
    pub(crate) async fn run(self: Arc<Self>) {
        loop {
            self.tend().await;
            tokio::time::sleep(Duration::from_millis(TEND_EVERY_MS)).await;
        }
    }
}
