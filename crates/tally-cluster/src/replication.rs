//! Shard replication in a running cluster: [`tally_replica::Replication`] (the
//! directory, routing to range leaders, forming groups and replacing the replica of
//! a node that came back with an empty disk) over this node's sessions.
//!
//! * **Replica ids.** A replica's raft id is derived from the node's store identity
//!   (`StoreId`, recorded in the metadata group when the node registers): a node
//!   that comes back with an empty data directory is a new replica.
//! * **Sessions.** Raft messages of every group and the question whether a peer's
//!   group of a range is formed (or, from its leader, whether it still lists a
//!   replica) travel as `PeerRequest`s on the one session per
//!   node pair.

use crate::Member;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tally_core::codec;
use tally_core::ranges::RangeId;
use tally_core::NodeId;
use tally_engine::ShardRequest;
use tally_raft::{MetaRaft, StoreId};
use tally_replica::{NetError, Peers, RangeEnvelope, RangeNetwork, RangeReply, ReplicaId, ReplicaNode};
use tally_transport::Transport;

/// How long one range message may take on the node-to-node session (a snapshot
/// chunk of 1 MiB included).
pub const RANGE_CALL_TIMEOUT_MS: u64 = 10_000;
/// How long a peer may take to say whether its group of a range is formed, or
/// whether it lists a replica.
pub const FORMED_ASK_TIMEOUT_MS: u64 = 1_000;

/// Bytes a node-to-node request adds around a range message (the peer request's
/// tag, the envelope's replica ids and range; a test measures the largest).
pub(crate) const RANGE_ENVELOPE_BYTES_MAX: usize = 256;

/// What one node sends another on its node-to-node session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum PeerRequest {
    /// A request for a shard's owner (the engine answers it).
    Shard(ShardRequest),
    /// A raft message for one of the node's range groups.
    Range(RangeEnvelope),
    /// Whether the node's group of a range holds a membership already.
    Formed(RangeId),
    /// Whether the node, as the range's leader, lists a replica in its group.
    Lists(RangeId, ReplicaId),
    /// Stand for election in a range once the lease of its leader, which is
    /// leaving it (the replica named), has run out.
    Campaign(RangeId, ReplicaId),
}

/// The raft id of the replicas a node runs on store `store`.
pub fn replica_id_of(store: StoreId) -> ReplicaId {
    // Folded to 64 bits, never 0 (openraft's ids are plain u64s; 0 reads as unset
    // in logs and is easy to confuse).
    let folded = (store.0 as u64) ^ ((store.0 >> 64) as u64);
    folded.max(1)
}

/// The raft id of the range replicas of the node whose raft id is `raft_id`, on the
/// disk whose identity is `store`: the identity's ([`replica_id_of`]), so a new disk
/// is a new replica.
pub(crate) fn node_replica_id(store: StoreId, raft_id: u64) -> ReplicaId {
    #[cfg(feature = "planted-bugs")]
    if tally_core::planted::active(tally_core::planted::Bug::ReplicaIdFromRaftId) {
        return replica_id_of(StoreId(u128::from(raft_id)));
    }
    let _ = raft_id;
    replica_id_of(store)
}

/// Range messages over the node-to-node sessions.
pub(crate) struct SessionNet {
    transport: Transport,
    /// The largest request an append may make: the groups' message bound in its
    /// envelope (never more than the transport carries).
    bytes_max: usize,
}

impl SessionNet {
    /// Range messages of groups configured as `groups` over `transport`.
    pub(crate) fn new(transport: Transport, groups: &tally_replica::GroupsConfig) -> Self {
        let bytes_max = (groups.message_bytes_max + RANGE_ENVELOPE_BYTES_MAX)
            .min(tally_transport::wire::REQUEST_BYTES_MAX);
        SessionNet { transport, bytes_max }
    }
}

impl RangeNetwork for SessionNet {
    fn call(
        &self,
        node: &ReplicaNode,
        envelope: RangeEnvelope,
    ) -> BoxFuture<'static, Result<RangeReply, NetError>> {
        let transport = self.transport.clone();
        let node = node.node.clone();
        let bytes_max = self.bytes_max;
        Box::pin(async move {
            let to = envelope.to;
            let append = matches!(envelope.rpc, tally_replica::RangeRpc::Append(_));
            let bytes = codec::encode(&PeerRequest::Range(envelope));
            // An append past the groups' own bound is refused here, as the
            // transport refuses any message past its own (snapshot frames are
            // bounded by their chunk size).
            if append && bytes.len() > bytes_max {
                return Err(NetError::TooLarge { bytes: bytes.len(), bytes_max });
            }
            let timeout = Duration::from_millis(RANGE_CALL_TIMEOUT_MS);
            // A message the transport refuses for its size would be refused again:
            // said as such, so openraft sends fewer entries instead of retrying.
            let answer = transport.call(&node, bytes, timeout).await.map_err(|e| match e {
                tally_transport::TransportError::TooLarge { bytes, bytes_max, .. } => {
                    NetError::TooLarge { bytes, bytes_max }
                }
                _ => NetError::Unreachable(to),
            })?;
            tally_replica::network::decode_reply(&answer)
        })
    }
}

/// What the replication of a cluster node knows of its peers: their stores, as the
/// metadata group recorded them, and their answers over the sessions.
pub(crate) struct ClusterPeers {
    pub(crate) members: Vec<Member>,
    pub(crate) raft: Arc<MetaRaft>,
    pub(crate) transport: Transport,
}

impl ClusterPeers {
    /// Sends `node` a question; its decoded answer, `None` if it did not answer in
    /// time or answered something undecodable.
    async fn ask<T: serde::de::DeserializeOwned>(
        &self,
        node: &NodeId,
        request: PeerRequest,
        what: &'static str,
    ) -> Option<T> {
        let timeout = Duration::from_millis(FORMED_ASK_TIMEOUT_MS);
        let answer = self.transport.call(node.as_str(), codec::encode(&request), timeout).await.ok()?;
        codec::decode::<T>(what, &answer).ok()
    }
}

impl Peers for ClusterPeers {
    fn replica_of(&self, node: &NodeId) -> Option<ReplicaId> {
        let m = self.members.iter().find(|m| m.id == node.as_str())?;
        Some(replica_id_of(self.raft.store_of(m.raft_id)?.store))
    }

    fn replica_classes(&self) -> std::collections::BTreeMap<u8, Vec<NodeId>> {
        let classes = self.raft.replica_classes().into_iter();
        classes.map(|(class, members)| (class, members.iter().map(NodeId::new).collect())).collect()
    }

    fn formation(&self, range: RangeId) -> Option<Vec<(ReplicaId, ReplicaNode)>> {
        Some(from_record(self.raft.formation(range.0)?))
    }

    fn form_range(
        &self,
        range: RangeId,
        voters: Vec<(ReplicaId, ReplicaNode)>,
    ) -> BoxFuture<'_, Option<Vec<(ReplicaId, ReplicaNode)>>> {
        let record = voters.into_iter().map(|(id, node)| (id, node.node)).collect();
        Box::pin(async move {
            match self.raft.form_range(range.0, record).await {
                Ok(first) => Some(from_record(first)),
                Err(e) => {
                    tracing::info!(%range, error = %e, "cannot record a range group's first voters yet");
                    None
                }
            }
        })
    }

    fn formed<'a>(&'a self, node: &'a NodeId, range: RangeId) -> BoxFuture<'a, Option<bool>> {
        Box::pin(self.ask(node, PeerRequest::Formed(range), "formed answer"))
    }

    fn lists<'a>(
        &'a self,
        node: &'a NodeId,
        range: RangeId,
        replica: ReplicaId,
    ) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async move {
            let answer: Option<Option<bool>> =
                self.ask(node, PeerRequest::Lists(range, replica), "lists answer").await;
            answer.flatten()
        })
    }

    fn campaign<'a>(&'a self, node: &'a NodeId, range: RangeId, departed: ReplicaId) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let _: Option<()> =
                self.ask(node, PeerRequest::Campaign(range, departed), "campaign answer").await;
        })
    }
}

/// A range formation as the metadata group records it, as replicas and nodes.
fn from_record(record: Vec<(u64, String)>) -> Vec<(ReplicaId, ReplicaNode)> {
    record.into_iter().map(|(id, node)| (id, ReplicaNode { node })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, LogId, Vote};
    use tally_replica::RangeRpc;

    /// The largest envelope a range message travels in (ids and range at their
    /// widest, an append of the longest log ids) stays within
    /// [`RANGE_ENVELOPE_BYTES_MAX`].
    #[test]
    fn a_range_message_s_envelope_fits_its_bound() {
        let log_id = Some(LogId::new(CommittedLeaderId::new(u64::MAX, u64::MAX), u64::MAX));
        let rpc = RangeRpc::Append(openraft::raft::AppendEntriesRequest {
            vote: Vote::new_committed(u64::MAX, u64::MAX),
            prev_log_id: log_id,
            entries: Vec::new(),
            leader_commit: log_id,
        });
        let inner = codec::encoded_len(&rpc);
        let envelope = RangeEnvelope { from: u64::MAX, to: u64::MAX, range: RangeId(u32::MAX), rpc };
        let outer = codec::encode(&PeerRequest::Range(envelope)).len();
        assert!(outer > inner);
        assert!(outer - inner <= RANGE_ENVELOPE_BYTES_MAX, "{} bytes around the message", outer - inner);
    }
}
