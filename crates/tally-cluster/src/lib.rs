//! A Tally cluster node.
//!
//! The engine is the same one an embedded caller drives; this crate plugs in the
//! three things that make a node part of a cluster:
//!
//! * [`RaftCatalog`] — counter metadata replicated by `tally-raft` (openraft 0.9), so
//!   every node agrees on specs, layouts and reshardings;
//! * [`RingPlacement`] — each shard's owner is its point's successor on a
//!   consistent-hash ring of the cluster's nodes (virtual nodes), and requests for
//!   shards owned elsewhere travel over `tally-transport` (ractor_cluster sessions
//!   with heartbeats and reconnection);
//! * [`ClusterNode`] — starts and stops all of it, serves other nodes' shard requests
//!   with the local engine, and reports the cluster's state.

#![forbid(unsafe_code)]

pub mod replication;

pub use tally_replica::{Replication, ReplicationFigures};

use futures::future::BoxFuture;
use replication::PeerRequest;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tally_core::codec;
use tally_core::meta::{CounterMeta, MetaCommand, MetaEffect, MetaError};
use tally_core::ring::Ring;
use tally_core::spec::AutoShards;
use tally_core::{CounterName, NodeId, ShardId};
use tally_engine::{
    Catalog, EngineParts, Generations, Placement, ShardRequest, ShardResponse, SledConfig, SledStore,
    SystemClock, Tally, TallyConfig, TallyError,
};
use tally_raft::{
    MembersView, MetaChange, MetaRaft, MetaRaftConfig, RaftStorage, Rejection, Request, StoreRecord,
};
use tally_transport::{Handler, PeerState, Transport, TransportConfig};

/// One node of the cluster as every node's config lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Stable node name.
    pub id: String,
    /// Stable raft id.
    pub raft_id: u64,
    /// Public HTTP address.
    pub http: SocketAddr,
    /// Node-to-node (ractor_cluster) address.
    pub peer: SocketAddr,
    /// Raft RPC address.
    pub raft: SocketAddr,
    /// Whether the node holds shards from the start (placement epoch 0). A node
    /// listed with `false` runs, votes in the metadata group and serves requests,
    /// but holds shards only once a membership change adds it.
    pub initial: bool,
}

/// Everything a cluster node is started from.
#[derive(Debug, Clone)]
pub struct ClusterNodeConfig {
    /// This node's name (one of `members`).
    pub node_id: String,
    /// Where this node keeps its shard store and its raft log.
    pub data_dir: PathBuf,
    /// Every node of the cluster.
    pub members: Vec<Member>,
    /// Shared secret of node-to-node sessions.
    pub secret: String,
    /// Fingerprint of the cluster-wide config; peers with another one are refused.
    pub fingerprint: u64,
    /// Virtual nodes per node on the ring.
    pub vnodes_per_node: u32,
    /// Node heartbeat interval, in milliseconds.
    pub heartbeat_ms: u64,
    /// Missed heartbeats before a peer is declared down.
    pub heartbeat_misses_max: u32,
    /// Raft heartbeat, in milliseconds.
    pub raft_heartbeat_ms: u64,
    /// Raft election timeout range, in milliseconds.
    pub raft_election_timeout_ms: (u64, u64),
    /// The engine's settings.
    pub engine: TallyConfig,
    /// Mutual TLS between nodes (sessions and raft), with the cluster CA as the
    /// only root; plaintext when `None`.
    pub tls: Option<tally_tls::ClusterTls>,
    /// Copies of every shard, `1..=`[`tally_core::ranges::REPLICAS_MAX`]: 1 keeps
    /// one copy on the ring owner (membership changes hand shards off); more puts
    /// each shard in a range group of `min(replicas, members)` nodes (see
    /// [`replication`]; the membership is then fixed).
    pub replicas: u8,
    /// With `replicas` > 1, ranges per member
    /// ([`tally_core::ranges::RangeLayout::for_members_at`]); the same on every node.
    pub ranges_per_node: u32,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The config does not name this node, or is otherwise unusable.
    #[error("cluster config: {0}")]
    Config(String),
    /// The metadata group failed to start.
    #[error("metadata group: {0}")]
    Raft(#[from] tally_raft::RaftError),
    /// The transport failed to start.
    #[error("transport: {0}")]
    Transport(#[from] tally_transport::TransportError),
    /// The engine failed to start.
    #[error("engine: {0}")]
    Engine(#[from] TallyError),
}

/// The local store's record of how this node keeps shards: [`ONE_COPY`] or
/// [`RANGE_GROUPS`], written when the node first starts.
const SHARD_COPIES_KEY: &[u8] = b"cluster:shard_copies";
/// Each shard's one copy is in the local store, on its ring owner.
const ONE_COPY: &[u8] = b"one-copy";
/// Shards live in range groups under `data_dir/replica`.
const RANGE_GROUPS: &[u8] = b"range-groups";

/// Refuses to start over data kept the other way than `config.replicas` asks:
/// range groups would never see the local store's one-copy shards (every counter
/// would read as empty), and one copy would never see the groups'. Data written
/// before the record existed is recognized by what it holds.
fn check_copies(
    replicas: u8,
    data_dir: &std::path::Path,
    local: &dyn tally_store::Store,
) -> Result<(), ClusterError> {
    let want = if replicas > 1 { RANGE_GROUPS } else { ONE_COPY };
    let storage = |e: tally_store::StoreError| ClusterError::Engine(e.into());
    let recorded = local.meta_get(SHARD_COPIES_KEY).map_err(storage)?;
    let stored = match &recorded {
        Some(v) => Some(v.as_slice()),
        None if data_dir.join("replica").exists() => Some(RANGE_GROUPS),
        None if !local.shard_ids(None, 1).map_err(storage)?.is_empty() => Some(ONE_COPY),
        None => None,
    };
    if let Some(stored) = stored.filter(|s| *s != want) {
        let (held, asked, fix) = if stored == RANGE_GROUPS {
            (
                "shards in range groups (cluster.replicas above 1)",
                "one copy of each shard",
                "the replicas it first started with",
            )
        } else {
            (
                "one copy of each shard (cluster.replicas = 1, the default of earlier releases)",
                "range groups",
                "replicas = 1",
            )
        };
        return Err(ClusterError::Config(format!(
            "the data in {} keeps {held}, and this config asks for {asked} (cluster.replicas = {}): \
             its counters would read as empty. Put {fix} in [cluster], the same on every node",
            data_dir.display(),
            replicas,
        )));
    }
    if recorded.is_none() {
        local.meta_put(SHARD_COPIES_KEY, want).map_err(storage)?;
    }
    Ok(())
}

/// Counter metadata replicated through the cluster's raft group.
pub struct RaftCatalog {
    raft: Arc<MetaRaft>,
}

/// `e` as the engine's error; `name` is the counter the request was for.
fn rejection(e: Rejection, name: &CounterName) -> TallyError {
    match e {
        Rejection::Resharding { target } => MetaError::Resharding { target }.into(),
        Rejection::TooManyGenerations { count } => MetaError::TooManyGenerations { count }.into(),
        Rejection::StaleGeneration { current, got } => MetaError::StaleGeneration { current, got }.into(),
        Rejection::Expired { expires_at_ms } => MetaError::Expired { expires_at_ms }.into(),
        Rejection::AutoStale { version, found } => {
            TallyError::AutoProposalStale { counter: name.to_string(), version, found }
        }
        other => TallyError::Unavailable { shard: "metadata".into(), reason: other.to_string() },
    }
}

/// The answer to a namespace request: whether the prefix was declared before.
fn namespace_answer(response: tally_raft::Response) -> Result<bool, TallyError> {
    match response {
        tally_raft::Response::Namespace(Ok(existed)) => Ok(existed),
        tally_raft::Response::Namespace(Err(why)) => Err(TallyError::Namespace(why)),
        other => Err(TallyError::Unavailable {
            shard: "metadata".into(),
            reason: format!("unexpected answer to a namespace request: {other:?}"),
        }),
    }
}

fn raft_error(e: tally_raft::RaftError) -> TallyError {
    TallyError::Unavailable { shard: "metadata".into(), reason: e.to_string() }
}

impl RaftCatalog {
    /// Replicates a request about counter `name` and returns what applying it answered.
    async fn write_counter(
        &self,
        name: &CounterName,
        req: Request,
    ) -> Result<(Option<CounterMeta>, MetaEffect), TallyError> {
        let response = self.raft.write(req).await.map_err(raft_error)?;
        match response.into_counter_result() {
            Some(Ok(r)) => Ok(r),
            Some(Err(e)) => Err(rejection(e, name)),
            None => {
                Err(TallyError::Unavailable { shard: "metadata".into(), reason: "unexpected answer".into() })
            }
        }
    }
}

impl Catalog for RaftCatalog {
    fn get(&self, name: &str) -> Result<Option<CounterMeta>, TallyError> {
        Ok(self.raft.counter(name))
    }

    fn current<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<CounterMeta>, TallyError>> {
        Box::pin(async move { self.raft.counter_linearizable(name).await.map_err(raft_error) })
    }

    fn apply<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            // Refuse a bad command here, with the exact error, before replicating it.
            self.raft.check(name, cmd, now_ms)?;
            self.write_counter(name, Request::Counter { name: name.clone(), cmd: cmd.clone(), now_ms }).await
        })
    }

    fn auto_shards(&self, name: &str) -> Result<Option<AutoShards>, TallyError> {
        Ok(self.raft.auto_shards(name))
    }

    fn auto_counters(&self) -> Result<Vec<(CounterName, AutoShards)>, TallyError> {
        Ok(self.raft.auto_counters())
    }

    fn apply_auto<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        auto: Option<AutoShards>,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            self.raft.check(name, cmd, now_ms)?;
            let req = Request::CounterAuto { name: name.clone(), cmd: cmd.clone(), auto, now_ms };
            self.write_counter(name, req).await
        })
    }

    fn auto_reshard<'a>(
        &'a self,
        name: &'a CounterName,
        version: u64,
        shards: u16,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            let req = Request::AutoReshard { name: name.clone(), version, shards, now_ms };
            self.write_counter(name, req).await
        })
    }

    fn pending_reshards(&self) -> Result<Vec<CounterName>, TallyError> {
        Ok(self.raft.pending_reshards())
    }

    fn expired(&self, now_ms: u64, limit: usize) -> Result<Vec<CounterName>, TallyError> {
        Ok(self.raft.expired_counters(now_ms, limit))
    }

    fn reclaims_expired(&self) -> bool {
        self.raft.is_leader()
    }

    fn count(&self) -> Result<(u64, u64), TallyError> {
        Ok(self.raft.counter_count())
    }

    fn namespaces(&self) -> Result<tally_core::namespace::Namespaces, TallyError> {
        Ok(self.raft.namespaces())
    }

    fn put_namespace<'a>(
        &'a self,
        prefix: &'a str,
        spec: tally_core::namespace::NamespaceSpec,
    ) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async move {
            let req = Request::PutNamespace { prefix: prefix.to_owned(), spec };
            namespace_answer(self.raft.write(req).await.map_err(raft_error)?)
        })
    }

    fn delete_namespace<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async move {
            let req = Request::DeleteNamespace { prefix: prefix.to_owned() };
            namespace_answer(self.raft.write(req).await.map_err(raft_error)?)
        })
    }

    fn tombstones(&self) -> Result<Vec<(CounterName, Generations)>, TallyError> {
        Ok(self.raft.tombstones().into_iter().collect())
    }

    fn tombstone(&self, name: &str) -> Result<Option<Generations>, TallyError> {
        Ok(self.raft.tombstones().into_iter().find(|(n, _)| n.as_str() == name).map(|(_, g)| g))
    }

    fn clear_tombstone<'a>(&'a self, name: &'a CounterName) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async move {
            self.raft.write(Request::ClearTombstone { name: name.clone() }).await.map_err(raft_error)?;
            Ok(())
        })
    }

    fn list(
        &self,
        prefix: &str,
        after: Option<&CounterName>,
        limit: usize,
    ) -> Result<Vec<CounterName>, TallyError> {
        Ok(self.raft.counter_names(prefix, after, limit))
    }
}

/// The placement a node has applied: the ring of the current members and, while a
/// membership change is being handed off, the ring before it.
struct PlacementView {
    epoch: u64,
    members: Vec<String>,
    ring: Ring,
    previous: Option<Ring>,
    handoff: Vec<String>,
}

impl PlacementView {
    /// The view of `membership`; before the first change (epoch 0) the members are
    /// the config's initial ones, which every node shares.
    fn new(config: &ClusterNodeConfig, membership: &MembersView) -> Self {
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

fn initial_members(config: &ClusterNodeConfig) -> Vec<String> {
    let mut ids: Vec<String> = config.members.iter().filter(|m| m.initial).map(|m| m.id.clone()).collect();
    ids.sort();
    ids
}

/// Shard ownership by consistent hashing, and the way to the owners.
pub struct RingPlacement {
    me: NodeId,
    view: parking_lot::RwLock<Arc<PlacementView>>,
    transport: Transport,
    call_timeout: Duration,
    /// Set when shards are replicated: owners are range leaders.
    replication: Option<Arc<Replication>>,
    /// The local engine, for a request whose range's new leader is this node.
    engine: OnceLock<Tally>,
    /// Every other node of the config (each may route increments).
    peers: Vec<NodeId>,
}

impl RingPlacement {
    fn view(&self) -> Arc<PlacementView> {
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
            r.call(node, request, self.engine.get(), send).await
        })
    }
}

/// First pause between hand-off passes that left shards behind.
pub const HANDOFF_RETRY_MIN_MS: u64 = 100;
/// Longest pause between hand-off passes.
pub const HANDOFF_RETRY_MAX_MS: u64 = 2_000;

/// Serves other nodes' requests: shard requests with the local engine, range
/// messages with the local range groups.
struct ShardHandler {
    engine: OnceLock<Tally>,
    replication: OnceLock<Arc<Replication>>,
}

impl Handler for ShardHandler {
    fn handle(&self, from: &str, request: Vec<u8>) -> impl std::future::Future<Output = Vec<u8>> + Send {
        let engine = self.engine.get().cloned();
        let replication = self.replication.get().cloned();
        let from = from.to_string();
        async move {
            let starting = || ShardResponse::Failed {
                code: "starting".into(),
                message: "node is starting".into(),
                owner: None,
            };
            let response = match codec::decode::<PeerRequest>("node request", &request) {
                Ok(PeerRequest::Shard(req)) => match engine {
                    Some(engine) => engine.serve_shard_request(req).await,
                    None => starting(),
                },
                Ok(PeerRequest::Range(envelope)) => {
                    let reply = match replication {
                        Some(r) => tally_replica::RangeInbound::handle(&**r.groups(), envelope).await,
                        None => {
                            Err(tally_replica::NetError::NoGroup { to: envelope.to, range: envelope.range })
                        }
                    };
                    return tally_replica::network::encode_reply(&reply);
                }
                Ok(PeerRequest::Formed(range)) => {
                    return codec::encode(&replication.is_some_and(|r| r.formed(range)));
                }
                Ok(PeerRequest::Lists(range, replica)) => {
                    return codec::encode(&replication.and_then(|r| r.lists(range, replica)));
                }
                Ok(PeerRequest::Campaign(range, departed)) => {
                    if let Some(r) = replication {
                        r.campaign(range, departed);
                    }
                    return codec::encode(&());
                }
                Err(e) => {
                    tracing::warn!(from = %from, error = %e, "undecodable node request");
                    ShardResponse::Failed { code: "malformed".into(), message: e.to_string(), owner: None }
                }
            };
            codec::encode(&response)
        }
    }
}

/// What a node knows of one member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberView {
    /// Node name.
    pub id: String,
    /// `up`, `suspect` or `down` (this node is always `up`).
    pub state: &'static str,
    /// Its HTTP address.
    pub http: SocketAddr,
}

/// A running cluster node.
#[derive(Clone)]
pub struct ClusterNode {
    tally: Tally,
    raft: Arc<MetaRaft>,
    transport: Transport,
    placement: Arc<RingPlacement>,
    /// Set when shards are replicated.
    replication: Option<Arc<Replication>>,
    /// The task that forms range groups and replaces replicas.
    tending: Arc<parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>>,
    config: Arc<ClusterNodeConfig>,
    /// Set while this node's hand-off task runs.
    handing_off: Arc<std::sync::atomic::AtomicBool>,
    /// Whether the node can serve (see [`ClusterNode::ready`]).
    ready: Arc<std::sync::atomic::AtomicBool>,
    /// The task that keeps `ready` and the engine's lost-data mark current.
    watching: Arc<parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

/// Pause between readiness checks, in milliseconds.
pub const READY_POLL_MS: u64 = 200;

/// Why accepting a node's data loss was refused.
#[derive(Debug, thiserror::Error)]
pub enum AcceptLossError {
    /// The node is not in the cluster config's address book.
    #[error("node {0:?} is not one of cluster.nodes")]
    UnknownNode(String),
    /// The metadata group has no store recorded for the node.
    #[error("node {0:?} has not registered a store yet")]
    NotRegistered(String),
    /// The metadata group refused the command.
    #[error("{0}")]
    Refused(tally_raft::StoreRejection),
    /// The metadata group could not be reached.
    #[error("metadata group unavailable: {0}")]
    Unavailable(String),
}

/// Why a membership change was refused.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// The node is not in the cluster config's address book.
    #[error("node {0:?} is not one of cluster.nodes")]
    UnknownNode(String),
    /// The metadata group refused the change.
    #[error("{0}")]
    Refused(tally_raft::MemberRejection),
    /// The metadata group could not be reached.
    #[error("metadata group unavailable: {0}")]
    Unavailable(String),
}

/// Attempts at a membership change that keeps meeting concurrent changes.
pub const MEMBERSHIP_ATTEMPTS_MAX: usize = 5;

impl ClusterNode {
    /// Starts this node: its raft member, its transport and its engine.
    pub async fn start(config: ClusterNodeConfig) -> Result<Self, ClusterError> {
        let me = config
            .members
            .iter()
            .find(|m| m.id == config.node_id)
            .cloned()
            .ok_or_else(|| ClusterError::Config(format!("node {:?} is not a member", config.node_id)))?;
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|e| ClusterError::Config(format!("cannot create {}: {e}", config.data_dir.display())))?;

        let voters: BTreeMap<u64, String> =
            config.members.iter().map(|m| (m.raft_id, m.raft.to_string())).collect();
        let mut raft_cfg =
            MetaRaftConfig::new(me.raft_id, voters, RaftStorage::Path(config.data_dir.join("raft")));
        raft_cfg.heartbeat_ms = config.raft_heartbeat_ms;
        raft_cfg.election_timeout_min_ms = config.raft_election_timeout_ms.0;
        raft_cfg.election_timeout_max_ms = config.raft_election_timeout_ms.1;
        raft_cfg.tls = config.tls.clone();
        raft_cfg.secret = Some(tally_raft::RaftSecret::new(&config.secret));
        let raft = Arc::new(MetaRaft::start(raft_cfg).await?);

        let handler = Arc::new(ShardHandler { engine: OnceLock::new(), replication: OnceLock::new() });
        let transport_cfg = TransportConfig {
            node_id: me.id.clone(),
            listen: me.peer,
            peers: config.members.iter().filter(|m| m.id != me.id).map(|m| (m.id.clone(), m.peer)).collect(),
            secret: config.secret.clone(),
            fingerprint: config.fingerprint,
            heartbeat_ms: config.heartbeat_ms,
            heartbeat_misses_max: config.heartbeat_misses_max,
            reconnect_backoff_min_ms: 100,
            reconnect_backoff_max_ms: 2_000,
            call_timeout_ms: config.engine.call_timeout_ms,
            tls: config.tls.clone(),
        };
        let transport = Transport::start(transport_cfg, handler.clone()).await?;

        let view = PlacementView::new(&config, &raft.membership());
        let local: Arc<dyn tally_store::Store> =
            Arc::new(SledStore::open(&SledConfig::new(config.data_dir.join("store")))?);
        check_copies(config.replicas, &config.data_dir, local.as_ref())?;
        let (replication, store) = if config.replicas > 1 {
            let r = Self::start_replication(&config, &me, &raft, &transport).await?;
            let _ = handler.replication.set(r.clone());
            let store =
                tally_replica::RangeStore::new(r.groups().clone(), local, tokio::runtime::Handle::current());
            (Some(r), Arc::new(store) as Arc<dyn tally_store::Store>)
        } else {
            (None, local)
        };
        let placement = Arc::new(RingPlacement {
            me: NodeId::new(&me.id),
            view: parking_lot::RwLock::new(Arc::new(view)),
            transport: transport.clone(),
            call_timeout: Duration::from_millis(config.engine.call_timeout_ms),
            replication: replication.clone(),
            engine: OnceLock::new(),
            peers: config.members.iter().filter(|m| m.id != me.id).map(|m| NodeId::new(&m.id)).collect(),
        });
        let mut engine_cfg = config.engine.clone();
        engine_cfg.node_id = NodeId::new(&me.id);
        if replication.is_some() {
            // Range groups hold the shards: a counter may ask for its own count.
            engine_cfg.replicas_max = tally_core::ranges::REPLICAS_MAX;
        }
        let tally = Tally::open_parts(EngineParts {
            store,
            clock: Arc::new(SystemClock),
            config: engine_cfg,
            catalog: Some(Arc::new(RaftCatalog { raft: raft.clone() })),
            placement: Some(placement.clone()),
        })
        .await?;
        // Before any other node can read this node's shards: a new or replaced disk
        // holds no trustworthy values until the metadata group says otherwise.
        let _ = handler.engine.set(tally.clone());
        let _ = placement.engine.set(tally.clone());
        let node = Self {
            tally: tally.clone(),
            raft: raft.clone(),
            transport,
            replication,
            tending: Default::default(),
            placement,
            config: Arc::new(config),
            handing_off: Default::default(),
            ready: Default::default(),
            watching: Default::default(),
        };

        node.sync_data_lost();
        if let Some(r) = &node.replication {
            *node.tending.lock() = Some(tokio::spawn(r.clone().run()));
        }
        // Metadata changed elsewhere: rebuild this node's view of the counter, or of
        // the placement (and hand off what it no longer owns).
        let mut changes = raft.subscribe();
        let engine = tally.clone();
        let watcher = node.clone();
        tokio::spawn(async move {
            loop {
                match changes.recv().await {
                    Ok(MetaChange::Counter(name)) => {
                        if let Err(e) = engine.metadata_changed(name.as_str()).await {
                            tracing::warn!(counter = %name, error = %e, "cannot apply a metadata change");
                        }
                    }
                    Ok(MetaChange::Members(_)) => watcher.membership_changed(),
                    Ok(MetaChange::Reset) => {
                        watcher.membership_changed();
                        watcher.sync_data_lost();
                    }
                    Ok(MetaChange::Store(_)) => engine.set_data_lost(watcher.raft.data_lost()),
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "metadata change feed lagged; shards re-read on demand");
                        watcher.membership_changed();
                        watcher.sync_data_lost();
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        });
        // A hand-off a restart interrupted goes on.
        node.membership_changed();
        let checker = node.clone();
        *node.watching.lock() = Some(tokio::spawn(async move { checker.watch_ready().await }));
        tracing::info!(node = %me.id, nodes = node.config.members.len(), "cluster node started");
        Ok(node)
    }

    /// Starts this node's range groups: the directory of the initial members, one
    /// group per range this node replicates, all in one sled database.
    async fn start_replication(
        config: &ClusterNodeConfig,
        me: &Member,
        raft: &Arc<MetaRaft>,
        transport: &Transport,
    ) -> Result<Arc<Replication>, ClusterError> {
        let members = initial_members(config).into_iter().map(NodeId::new);
        let members: Vec<NodeId> = members.collect();
        let layout = tally_core::ranges::RangeLayout::for_members_at(members.len(), config.ranges_per_node);
        let directory = tally_core::ranges::Directory::with_layout(layout, members, Some(config.replicas))
            .map_err(|e| ClusterError::Config(format!("replicas: {e}")))?;
        let replica = |e: tally_replica::ReplicaError| ClusterError::Config(format!("range groups: {e}"));
        let kv = tally_replica::SledKv::open(&config.data_dir.join("replica"))
            .map_err(|e| ClusterError::Config(format!("range groups: {e}")))?;
        let net = Arc::new(replication::SessionNet { transport: transport.clone() });
        let groups = tally_replica::RangeGroups::open(
            &me.id,
            replication::replica_id_of(raft.store_id()),
            Arc::new(kv),
            net,
            directory.layout(),
            tally_replica::GroupsConfig::default(),
        )
        .await
        .map_err(replica)?;
        let mine = directory.ranges_of(&NodeId::new(&me.id));
        for range in &mine {
            groups.open_range(*range).await.map_err(replica)?;
        }
        groups.open_stored().await.map_err(replica)?;
        tracing::info!(
            ranges = directory.layout().count(),
            replicated_here = mine.len(),
            replicas = directory.replicas_per_range(),
            replica = groups.replica_id(),
            "range groups open"
        );
        let peers = replication::ClusterPeers {
            members: config.members.clone(),
            raft: raft.clone(),
            transport: transport.clone(),
        };
        Ok(Arc::new(Replication::new(NodeId::new(&me.id), groups, directory, Arc::new(peers))))
    }

    /// Marks the engine's shards as missing data while this node's earlier disk is
    /// lost and not accepted. Replicated shards lose nothing with one disk: the
    /// node's replicas catch up from the others before they count.
    fn sync_data_lost(&self) {
        self.tally.set_data_lost(self.replication.is_none() && self.raft.data_lost());
    }

    /// Keeps [`ClusterNode::ready`] and the engine's lost-data mark current.
    async fn watch_ready(&self) {
        let mut caught_up_once = false;
        let mut groups_led_once = false;
        loop {
            let r = self.raft.readiness().await;
            caught_up_once |= r.caught_up;
            groups_led_once |= self.replication.as_ref().is_none_or(|g| g.every_group_has_a_leader());
            self.sync_data_lost();
            let peers = self.transport.peers();
            let sessions_up = r.reachable.iter().all(|raft_id| {
                let Some(m) = self.config.members.iter().find(|m| m.raft_id == *raft_id) else { return true };
                peers.iter().any(|p| p.node == m.id && p.state == PeerState::Up)
            });
            let ready =
                r.leader.is_some() && caught_up_once && r.registered && sessions_up && groups_led_once;
            let was = self.ready.swap(ready, std::sync::atomic::Ordering::SeqCst);
            if was != ready {
                tracing::info!(ready, leader = ?r.leader, caught_up = caught_up_once, registered = r.registered, sessions_up, groups_led = groups_led_once, "readiness changed");
            }
            tokio::time::sleep(Duration::from_millis(READY_POLL_MS)).await;
        }
    }

    /// Whether the node can serve: the metadata group has a leader, this node has
    /// applied what the leader had applied (once since it started), its store is
    /// registered, and it has a node-to-node session with every peer whose raft
    /// endpoint answers. Before that, requests may fail for reasons that clear by
    /// themselves within a second or two (a remote shard whose session is not up
    /// yet answers 503), so `/healthz` answers 503 until it holds.
    pub fn ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Accepts that node `id` lost the data of its previous disk: reads count its
    /// shards again, from what they hold now. Answers the node's store record.
    pub async fn accept_loss(&self, id: &str) -> Result<StoreRecord, AcceptLossError> {
        let member = self
            .config
            .members
            .iter()
            .find(|m| m.id == id)
            .ok_or_else(|| AcceptLossError::UnknownNode(id.to_string()))?;
        let record = self
            .raft
            .store_of(member.raft_id)
            .ok_or_else(|| AcceptLossError::NotRegistered(id.to_string()))?;
        let req = Request::AcceptLoss { node: member.raft_id, store: record.store };
        match self.raft.write(req).await.map_err(|e| AcceptLossError::Unavailable(e.to_string()))? {
            tally_raft::Response::Store(Ok(r)) => {
                tracing::warn!(node = %id, store = %r.store, "the loss of the node's earlier data was accepted");
                Ok(r)
            }
            tally_raft::Response::Store(Err(e)) => Err(AcceptLossError::Refused(e)),
            other => Err(AcceptLossError::Unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// The nodes whose earlier data is lost and not accepted yet, as applied here.
    pub fn data_lost_nodes(&self) -> Vec<String> {
        self.config
            .members
            .iter()
            .filter(|m| self.raft.store_of(m.raft_id).is_some_and(|r| r.data_lost))
            .map(|m| m.id.clone())
            .collect()
    }

    /// Applies the membership the metadata group holds, and starts handing off the
    /// shards this node no longer owns if the change waits for it.
    fn membership_changed(&self) {
        let membership = self.raft.membership();
        let view = PlacementView::new(&self.config, &membership);
        let epoch = view.epoch;
        let waits_for_me = view.handoff.iter().any(|n| *n == self.config.node_id);
        if let Some(r) = &self.replication {
            if let Err(e) = r.set_members(view.members.iter().map(NodeId::new)) {
                tracing::error!(members = ?view.members, error = %e, "cannot place range replicas on these members");
            }
        }
        {
            let mut current = self.placement.view.write();
            if view.epoch >= current.epoch {
                *current = Arc::new(view);
            }
        }
        if waits_for_me && !self.handing_off.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let node = self.clone();
            tokio::spawn(async move {
                node.hand_off(epoch).await;
                node.handing_off.store(false, std::sync::atomic::Ordering::SeqCst);
                // A change that arrived meanwhile may wait for this node again.
                if node.raft.membership().placement_epoch != epoch {
                    node.membership_changed();
                }
            });
        }
    }

    /// Hands off every shard this node no longer owns at `epoch`, retrying until
    /// all are adopted, then reports it to the metadata group.
    async fn hand_off(&self, epoch: u64) {
        let me = self.config.node_id.clone();
        let mut backoff = Duration::from_millis(HANDOFF_RETRY_MIN_MS);
        loop {
            let m = self.raft.membership();
            if m.placement_epoch != epoch || !m.handoff.contains(&me) {
                return;
            }
            // Replicated shards stay where their range groups hold them; the groups
            // follow the new directory by themselves.
            let pass = match self.replication {
                Some(_) => Ok(tally_engine::HandoffReport::default()),
                None => self.tally.hand_off_foreign(epoch).await,
            };
            match pass {
                Ok(report) if report.failed == 0 => {
                    let done = Request::HandoffDone { node: me.clone(), epoch };
                    match self.raft.write(done).await {
                        Ok(_) => {
                            tracing::info!(epoch, moved = report.moved, "hand-off complete");
                            return;
                        }
                        Err(e) => tracing::warn!(epoch, error = %e, "cannot report the hand-off; retrying"),
                    }
                }
                Ok(report) => {
                    tracing::info!(epoch, moved = report.moved, failed = report.failed, "hand-off retries")
                }
                Err(e) => tracing::warn!(epoch, error = %e, "hand-off pass failed; retrying"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(HANDOFF_RETRY_MAX_MS));
        }
    }

    /// Adds `id` (a node of the config's address book) to the placement ring.
    pub async fn add_member(&self, id: &str) -> Result<MembersView, MembershipError> {
        self.change_members(|members| {
            if !members.iter().any(|m| m == id) {
                members.push(id.to_string());
            }
        })
        .await
    }

    /// Removes `id` from the placement ring; its shards move to the others.
    pub async fn remove_member(&self, id: &str) -> Result<MembersView, MembershipError> {
        self.change_members(|members| members.retain(|m| m != id)).await
    }

    async fn change_members(
        &self,
        change: impl Fn(&mut Vec<String>),
    ) -> Result<MembersView, MembershipError> {
        let mut last = None;
        for _ in 0..MEMBERSHIP_ATTEMPTS_MAX {
            let current = self.raft.membership();
            let previous = PlacementView::new(&self.config, &current).members;
            let mut members = previous.clone();
            change(&mut members);
            for m in &members {
                if !self.config.members.iter().any(|c| c.id == *m) {
                    return Err(MembershipError::UnknownNode(m.clone()));
                }
            }
            let request = Request::SetMembers {
                from_epoch: current.placement_epoch,
                previous,
                members: members.clone(),
            };
            let response =
                self.raft.write(request).await.map_err(|e| MembershipError::Unavailable(e.to_string()))?;
            match response {
                tally_raft::Response::Members(Ok(view)) => {
                    self.membership_changed();
                    return Ok(view);
                }
                tally_raft::Response::Members(Err(e @ tally_raft::MemberRejection::StaleEpoch { .. })) => {
                    last = Some(e);
                }
                tally_raft::Response::Members(Err(e)) => return Err(MembershipError::Refused(e)),
                other => return Err(MembershipError::Unavailable(format!("unexpected answer {other:?}"))),
            }
        }
        Err(MembershipError::Refused(last.expect("at least one attempt")))
    }

    /// The placement members (sorted), the placement epoch, and the nodes still
    /// handing off after the last change.
    pub fn placement(&self) -> (Vec<String>, u64, Vec<String>) {
        let v = self.placement.view();
        (v.members.clone(), v.epoch, v.handoff.clone())
    }

    /// The node's engine (every counter is served through it).
    pub fn tally(&self) -> &Tally {
        &self.tally
    }

    /// The node's shard replication, when shards are replicated.
    pub fn replication(&self) -> Option<&Arc<Replication>> {
        self.replication.as_ref()
    }

    /// `name`'s shards as the engine reports them, each with its range's replicas,
    /// leader and term when shards are replicated.
    pub async fn shards(&self, name: &str) -> Result<tally_engine::ShardsReport, TallyError> {
        let mut report = self.tally.shards(name).await?;
        if let Some(r) = &self.replication {
            let counter = CounterName::new(name)?;
            let class = self.tally.counter(name).await?.spec.replica_class();
            for shard in &mut report.shards {
                let id = ShardId::new(counter.clone(), report.generation, shard.index).in_class(class);
                shard.replication = Some(r.range_report(r.range_of(&id)));
            }
        }
        Ok(report)
    }

    /// Every member with its state as this node sees it.
    pub fn members(&self) -> Vec<MemberView> {
        let peers = self.transport.peers();
        self.config
            .members
            .iter()
            .map(|m| {
                let state = if m.id == self.config.node_id {
                    "up"
                } else {
                    match peers.iter().find(|p| p.node == m.id).map(|p| p.state) {
                        Some(PeerState::Up) => "up",
                        Some(PeerState::Suspect) => "suspect",
                        _ => "down",
                    }
                };
                MemberView { id: m.id.clone(), state, http: m.http }
            })
            .collect()
    }

    /// The raft leader's node name, if one is known.
    pub fn leader(&self) -> Option<String> {
        let leader = self.raft.leader()?;
        self.config.members.iter().find(|m| m.raft_id == leader).map(|m| m.id.clone())
    }

    /// The raft term.
    pub fn term(&self) -> u64 {
        self.raft.term()
    }

    /// Peers currently connected.
    pub fn connected_peers(&self) -> usize {
        self.transport.peers().iter().filter(|p| p.state == PeerState::Up).count()
    }

    /// Flushes the engine, then stops raft and the transport.
    pub async fn shutdown(&self) -> Result<(), TallyError> {
        if let Some(watching) = self.watching.lock().take() {
            watching.abort();
        }
        if let Some(tending) = self.tending.lock().take() {
            tending.abort();
        }
        let r = self.tally.shutdown().await;
        if let Some(r) = &self.replication {
            r.groups().shutdown().await;
        }
        self.raft.shutdown().await;
        self.transport.shutdown().await;
        r
    }
}

impl From<tally_store::StoreError> for ClusterError {
    fn from(e: tally_store::StoreError) -> Self {
        ClusterError::Engine(e.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::ids::ShardId;
    use tally_core::name::CounterName;
    use tally_store::{MemStore, ShardWrite, Store};

    fn refused(replicas: u8, dir: &std::path::Path, store: &MemStore) -> String {
        match check_copies(replicas, dir, store) {
            Err(ClusterError::Config(why)) => why,
            other => panic!("replicas = {replicas} over {}: {other:?}", dir.display()),
        }
    }

    #[test]
    fn a_node_keeps_shards_the_way_it_first_started() {
        let dir = tempfile::tempdir().expect("temp dir");
        // A new node records what it was started with, and keeps to it.
        for (first, other) in [(1u8, 3u8), (3, 1)] {
            let store = MemStore::new();
            check_copies(first, dir.path(), &store).expect("a new node takes its config");
            check_copies(first, dir.path(), &store).expect("and starts again the same way");
            let why = refused(other, dir.path(), &store);
            assert!(why.contains("would read as empty"), "{why}");
            let fix = if first == 1 { "replicas = 1" } else { "the replicas it first started with" };
            assert!(why.contains(fix), "{why}");
            if first > 1 {
                check_copies(5, dir.path(), &store)
                    .expect("another count of range groups is still range groups");
            }
        }

        // Data of a release before the record: one-copy shards in the local store...
        let store = MemStore::new();
        let shard = ShardId::new(CounterName::new("likes").expect("name"), 0, 0);
        store.commit(&shard, &ShardWrite::default()).expect("commit");
        refused(3, dir.path(), &store);
        check_copies(1, dir.path(), &store).expect("one copy reads them");
        assert_eq!(store.meta_get(SHARD_COPIES_KEY).expect("meta").as_deref(), Some(ONE_COPY));

        // ... or range groups under data_dir/replica.
        std::fs::create_dir(dir.path().join("replica")).expect("mkdir");
        let store = MemStore::new();
        refused(1, dir.path(), &store);
        check_copies(3, dir.path(), &store).expect("range groups read them");
        assert_eq!(store.meta_get(SHARD_COPIES_KEY).expect("meta").as_deref(), Some(RANGE_GROUPS));
    }
}
