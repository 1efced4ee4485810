//! Raft messages between the replicas of range groups, multiplexed by range: every
//! group of a node sends through one [`RangeNetwork`], so one connection per node
//! pair carries every group's traffic, and the receiving node hands each message to
//! the group it names ([`RangeInbound`]).
//!
//! [`MemRouter`] is the in-memory implementation, for tests and the simulator: it
//! delivers by replica id with a fixed latency and can cut links, isolate a replica
//! or drop it. Messages and replies are serde types, ready for a byte transport.

// openraft's RPC error types are large and its network trait returns them; the
// helpers here return the same types rather than boxing and unboxing them.
#![allow(clippy::result_large_err)]

use crate::types::{RangeConfig, ReplicaId, ReplicaNode};
use futures::future::BoxFuture;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{RaftNetwork, RaftNetworkFactory};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tally_core::ranges::RangeId;

/// One-way latency of a [`MemRouter`] link, in milliseconds.
pub const MEM_LINK_LATENCY_MS: u64 = 1;
/// Pause before openraft retries a replica that was unreachable, in milliseconds.
pub const UNREACHABLE_BACKOFF_MS: u64 = 100;

/// A raft message for one group.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RangeRpc {
    /// Log replication and heartbeats.
    Append(AppendEntriesRequest<RangeConfig>),
    /// An election.
    Vote(VoteRequest<ReplicaId>),
    /// A chunk of a snapshot.
    Snapshot(InstallSnapshotRequest<RangeConfig>),
}

/// The answer of the receiving group's raft.
#[derive(Debug, Serialize, Deserialize)]
pub enum RangeReply {
    /// To [`RangeRpc::Append`].
    Append(Result<AppendEntriesResponse<ReplicaId>, RaftError<ReplicaId>>),
    /// To [`RangeRpc::Vote`].
    Vote(Result<VoteResponse<ReplicaId>, RaftError<ReplicaId>>),
    /// To [`RangeRpc::Snapshot`].
    Snapshot(Result<InstallSnapshotResponse<ReplicaId>, RaftError<ReplicaId, InstallSnapshotError>>),
}

/// Why a message was not answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum NetError {
    /// The replica cannot be reached (down, partitioned, or no longer this id: a
    /// node with a new store answers to a new id only).
    #[error("replica {0} is unreachable")]
    Unreachable(ReplicaId),
    /// The replica's node does not run this range's group.
    #[error("replica {to} runs no group for {range}")]
    NoGroup {
        /// The replica.
        to: ReplicaId,
        /// The range.
        range: RangeId,
    },
    /// No answer within the deadline.
    #[error("no answer from replica {0} in time")]
    Timeout(ReplicaId),
    /// The answer was of another kind than the message.
    #[error("replica {0} answered with another kind of reply")]
    Mismatch(ReplicaId),
}

/// Sends a group's messages to other replicas.
pub trait RangeNetwork: Send + Sync + 'static {
    /// Delivers `rpc` for group `range` from `from` to replica `to` and waits for
    /// its answer.
    fn call(
        &self,
        from: ReplicaId,
        to: ReplicaId,
        range: RangeId,
        rpc: RangeRpc,
    ) -> BoxFuture<'static, Result<RangeReply, NetError>>;
}

/// The receiving side: a node's groups, by range.
pub trait RangeInbound: Send + Sync + 'static {
    /// Hands `rpc` to the group of `range`.
    fn handle(&self, range: RangeId, rpc: RangeRpc) -> BoxFuture<'static, Result<RangeReply, NetError>>;
}

// ------------------------------------------------------------ openraft adapters

/// openraft's network factory of one group: every client goes through the node's
/// shared [`RangeNetwork`].
#[derive(Clone)]
pub struct GroupNetworkFactory {
    pub(crate) me: ReplicaId,
    pub(crate) range: RangeId,
    pub(crate) net: Arc<dyn RangeNetwork>,
}

/// openraft's connection to one replica of a group.
pub struct GroupNetwork {
    factory: GroupNetworkFactory,
    target: ReplicaId,
    node: ReplicaNode,
}

impl RaftNetworkFactory<RangeConfig> for GroupNetworkFactory {
    type Network = GroupNetwork;

    async fn new_client(&mut self, target: ReplicaId, node: &ReplicaNode) -> GroupNetwork {
        GroupNetwork { factory: self.clone(), target, node: node.clone() }
    }
}

type Rpc<T, E = openraft::error::Infallible> =
    Result<T, RPCError<ReplicaId, ReplicaNode, RaftError<ReplicaId, E>>>;

impl GroupNetwork {
    async fn send(&self, rpc: RangeRpc, option: &RPCOption) -> Result<RangeReply, NetError> {
        let f = &self.factory;
        let call = f.net.call(f.me, self.target, f.range, rpc);
        match tokio::time::timeout(option.hard_ttl(), call).await {
            Ok(r) => r,
            Err(_) => Err(NetError::Timeout(self.target)),
        }
    }

    fn net_err<E: std::error::Error>(
        &self,
        e: NetError,
    ) -> RPCError<ReplicaId, ReplicaNode, RaftError<ReplicaId, E>> {
        match e {
            NetError::Unreachable(_) | NetError::NoGroup { .. } => {
                RPCError::Unreachable(Unreachable::new(&e))
            }
            NetError::Timeout(_) | NetError::Mismatch(_) => RPCError::Network(NetworkError::new(&e)),
        }
    }

    fn remote<T, E: std::error::Error>(&self, r: Result<T, RaftError<ReplicaId, E>>) -> Rpc<T, E> {
        r.map_err(|e| RPCError::RemoteError(RemoteError::new_with_node(self.target, self.node.clone(), e)))
    }
}

impl RaftNetwork<RangeConfig> for GroupNetwork {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<RangeConfig>,
        option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<ReplicaId>> {
        match self.send(RangeRpc::Append(rpc), &option).await.map_err(|e| self.net_err(e))? {
            RangeReply::Append(r) => self.remote(r),
            _ => Err(self.net_err(NetError::Mismatch(self.target))),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<RangeConfig>,
        option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<ReplicaId>, InstallSnapshotError> {
        match self.send(RangeRpc::Snapshot(rpc), &option).await.map_err(|e| self.net_err(e))? {
            RangeReply::Snapshot(r) => self.remote(r),
            _ => Err(self.net_err(NetError::Mismatch(self.target))),
        }
    }

    async fn vote(&mut self, rpc: VoteRequest<ReplicaId>, option: RPCOption) -> Rpc<VoteResponse<ReplicaId>> {
        match self.send(RangeRpc::Vote(rpc), &option).await.map_err(|e| self.net_err(e))? {
            RangeReply::Vote(r) => self.remote(r),
            _ => Err(self.net_err(NetError::Mismatch(self.target))),
        }
    }

    fn backoff(&self) -> openraft::network::Backoff {
        openraft::network::Backoff::new(std::iter::repeat(Duration::from_millis(UNREACHABLE_BACKOFF_MS)))
    }
}

// ------------------------------------------------------------------ in memory

#[derive(Default)]
struct RouterState {
    nodes: BTreeMap<ReplicaId, Weak<dyn RangeInbound>>,
    /// Cut links, both directions, stored as (smaller, larger).
    cut: BTreeSet<(ReplicaId, ReplicaId)>,
    isolated: BTreeSet<ReplicaId>,
}

impl RouterState {
    fn linked(&self, a: ReplicaId, b: ReplicaId) -> bool {
        !self.isolated.contains(&a)
            && !self.isolated.contains(&b)
            && !self.cut.contains(&(a.min(b), a.max(b)))
    }
}

/// The in-memory network: replicas register their node's groups under their id;
/// a message is delivered after [`MEM_LINK_LATENCY_MS`], and its answer after as
/// long again, if the link is up at both moments.
#[derive(Clone, Default)]
pub struct MemRouter {
    state: Arc<Mutex<RouterState>>,
}

impl MemRouter {
    /// A router with no replica.
    pub fn new() -> Self {
        Self::default()
    }

    /// Delivers messages for `id` to `node` from now on (held weakly: a dropped
    /// node is unreachable).
    pub fn register(&self, id: ReplicaId, node: Weak<dyn RangeInbound>) {
        self.state.lock().nodes.insert(id, node);
    }

    /// Stops delivering to `id` (the node crashed or was stopped).
    pub fn drop_replica(&self, id: ReplicaId) {
        self.state.lock().nodes.remove(&id);
    }

    /// Cuts the link between `a` and `b`, both ways.
    pub fn cut(&self, a: ReplicaId, b: ReplicaId) {
        self.state.lock().cut.insert((a.min(b), a.max(b)));
    }

    /// Restores the link between `a` and `b`.
    pub fn heal(&self, a: ReplicaId, b: ReplicaId) {
        self.state.lock().cut.remove(&(a.min(b), a.max(b)));
    }

    /// Cuts every link of `id`.
    pub fn isolate(&self, id: ReplicaId) {
        self.state.lock().isolated.insert(id);
    }

    /// Restores every cut link and isolated replica.
    pub fn heal_all(&self) {
        let mut s = self.state.lock();
        s.cut.clear();
        s.isolated.clear();
    }
}

impl RangeNetwork for MemRouter {
    fn call(
        &self,
        from: ReplicaId,
        to: ReplicaId,
        range: RangeId,
        rpc: RangeRpc,
    ) -> BoxFuture<'static, Result<RangeReply, NetError>> {
        let state = self.state.clone();
        Box::pin(async move {
            let latency = Duration::from_millis(MEM_LINK_LATENCY_MS);
            tokio::time::sleep(latency).await;
            let target = {
                let s = state.lock();
                if !s.linked(from, to) {
                    return Err(NetError::Unreachable(to));
                }
                s.nodes.get(&to).and_then(Weak::upgrade)
            };
            let target = target.ok_or(NetError::Unreachable(to))?;
            let reply = target.handle(range, rpc).await;
            tokio::time::sleep(latency).await;
            let s = state.lock();
            if !s.linked(from, to) || !s.nodes.contains_key(&to) {
                return Err(NetError::Unreachable(to));
            }
            reply
        })
    }
}
