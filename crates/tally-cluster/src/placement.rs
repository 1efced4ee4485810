//! [`RingPlacement`]: the engine's `Placement` — each shard's owner on the ring of
//! the placement members (or, with range groups, its range's leader) — and the way
//! to other nodes' shards over the transport.

use crate::config::{initial_members, ClusterNodeConfig};
use crate::replication::PeerRequest;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;
use tally_core::codec;
use tally_core::ring::Ring;
use tally_core::{NodeId, ShardId};
use tally_engine::{Placement, ShardRequest, ShardResponse, Tally, TallyError};
use tally_raft::MembersView;
use tally_replica::Replication;
use tally_transport::Transport;

/// The placement a node has applied: the ring of the current members and, while a
/// membership change is being handed off, the ring before it.
pub(crate) struct PlacementView {
    pub(crate) epoch: u64,
    pub(crate) members: Vec<String>,
    pub(crate) ring: Ring,
    pub(crate) previous: Option<Ring>,
    pub(crate) handoff: Vec<String>,
}

impl PlacementView {
    /// The view of `membership`; before the first change (epoch 0) the members are
    /// the config's initial ones, which every node shares.
    pub(crate) fn new(config: &ClusterNodeConfig, membership: &MembersView) -> Self {
        let ring_of = |ids: &[String]| Ring::new(ids.iter().map(NodeId::new), config.vnodes_per_node);
        let members = if membership.placement_epoch == 0 {
            initial_members(config)
        } else {
            membership.members.clone()
        };
        let previous = (!membership.handoff.is_empty()).then(|| ring_of(&membership.previous));
        Self {
            epoch: membership.placement_epoch,
            ring: ring_of(&members),
            members,
            previous,
            handoff: membership.handoff.clone(),
        }
    }
}

/// Shard ownership by consistent hashing, and the way to the owners.
pub struct RingPlacement {
    pub(crate) me: NodeId,
    pub(crate) view: parking_lot::RwLock<Arc<PlacementView>>,
    pub(crate) transport: Transport,
    pub(crate) call_timeout: Duration,
    /// Set when shards are replicated: owners are range leaders.
    pub(crate) replication: Option<Arc<Replication>>,
    /// The local engine, for a request whose range's new leader is this node.
    pub(crate) engine: crate::handler::Slot<Tally>,
    /// Every other node of the config (each may route increments).
    pub(crate) peers: Vec<NodeId>,
}

impl RingPlacement {
    pub(crate) fn view(&self) -> Arc<PlacementView> {
        self.view.read().clone()
    }

    async fn call_node(&self, node: &NodeId, request: &ShardRequest) -> Result<ShardResponse, TallyError> {
        let unavailable = |reason: String| TallyError::Unavailable { shard: format!("node {node}"), reason };
        let bytes = codec::encode(&PeerRequest::Shard(request.clone()));
        let answer = self
            .transport
            .call(node.as_str(), bytes, self.call_timeout)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        codec::decode("shard response", &answer).map_err(|e| unavailable(e.to_string()))
    }
}

impl Placement for RingPlacement {
    fn remote_owner(&self, id: &ShardId) -> Option<NodeId> {
        if let Some(r) = &self.replication {
            return Some(r.owner(id)).filter(|owner| *owner != self.me);
        }
        self.view().ring.owner(id).filter(|owner| **owner != self.me).cloned()
    }

    fn confirm_local<'a>(&'a self, id: &'a ShardId) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async move {
            match &self.replication {
                Some(r) => r.confirm(id).await,
                None => Ok(()),
            }
        })
    }

    fn local_node(&self) -> NodeId {
        self.me.clone()
    }

    fn previous_owner(&self, id: &ShardId) -> Option<(NodeId, u64)> {
        // Replicated shards never change hands by a hand-off: their range groups
        // move replicas.
        if self.replication.is_some() {
            return None;
        }
        let view = self.view();
        let previous = view.previous.as_ref()?;
        if view.ring.owner(id)? != &self.me {
            return None;
        }
        previous.owner(id).filter(|before| **before != self.me).map(|before| (before.clone(), view.epoch))
    }

    fn epoch(&self) -> u64 {
        self.view().epoch
    }

    fn peers(&self) -> Vec<NodeId> {
        self.peers.clone()
    }

    fn call<'a>(
        &'a self,
        node: &'a NodeId,
        request: ShardRequest,
    ) -> BoxFuture<'a, Result<ShardResponse, TallyError>> {
        Box::pin(async move {
            let Some(r) = &self.replication else { return self.call_node(node, &request).await };
            let send = |to: NodeId, request: ShardRequest| async move { self.call_node(&to, &request).await };
            r.call(node, request, self.engine.get().as_ref(), send).await
        })
    }
}
