//! [`ClusterNode`]: starts and stops a node — its data directory's stores, the
//! metadata group, the transport, the range groups and the engine — serves other
//! nodes' requests, drives membership hand-offs and reports the cluster's state.

use crate::catalog::RaftCatalog;
use crate::config::{check_copies, initial_members, ClusterError, ClusterNodeConfig, Member};
use crate::handler::{ShardHandler, Slot};
use crate::parts;
use crate::placement::{PlacementView, RingPlacement};
use crate::replication;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tally_core::{CounterName, NodeId, ShardId};
use tally_engine::{Clock, EngineParts, SledConfig, SledStore, SystemClock, Tally, TallyError};
use tally_raft::{MembersView, MetaChange, MetaRaft, MetaRaftConfig, RaftStorage, Request, StoreRecord};
use tally_replica::storage::KvStore;
use tally_replica::Replication;
use tally_store::Store;
use tally_transport::{PeerState, Transport, TransportConfig};

/// First pause between hand-off passes that left shards behind.
pub const HANDOFF_RETRY_MIN_MS: u64 = 100;
/// Longest pause between hand-off passes.
pub const HANDOFF_RETRY_MAX_MS: u64 = 2_000;

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

/// What a node runs on.
pub enum NodeWiring {
    /// A process of its own (`tallyd`): the stores under the config's `data_dir`,
    /// sockets on the members' addresses, the system clock.
    Sockets,
    /// Stores, a clock and networks handed in, so that several nodes run in one
    /// process (a simulation of whole nodes on paused time).
    InMemory(InMemoryWiring),
}

/// The parts of a node that [`NodeWiring::InMemory`] hands in. They stand for the
/// data directory and the sockets; everything else is what `tallyd` runs.
pub struct InMemoryWiring {
    /// The metadata group's database (the directory's `raft` store), which holds
    /// the node's identity: a new one is a new disk.
    pub raft_db: sled::Db,
    /// The engine's store (the directory's `store`).
    pub store: Arc<dyn Store>,
    /// The range replicas' store (the directory's `replica`); needed when the
    /// config keeps more than one copy.
    pub replica: Option<Arc<dyn KvStore>>,
    /// The engine's clock.
    pub clock: Arc<dyn Clock>,
    /// The network the metadata group's RPCs cross.
    pub raft_net: tally_raft::MemRaftNet,
    /// The network node-to-node sessions cross (shard requests, range groups).
    pub peers: tally_transport::MemNetwork,
}

/// A node's stores and clock, opened or handed in, and the networks it was handed.
struct Opened {
    raft_db: sled::Db,
    local: Arc<dyn Store>,
    replica_kv: Option<Arc<dyn KvStore>>,
    clock: Arc<dyn Clock>,
    nets: Option<(tally_raft::MemRaftNet, tally_transport::MemNetwork)>,
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
    /// What the node answers other nodes with.
    handler: Arc<ShardHandler>,
    /// The task that forms range groups and replaces replicas.
    tending: Arc<parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>>,
    config: Arc<ClusterNodeConfig>,
    /// Set while this node's hand-off task runs.
    handing_off: Arc<std::sync::atomic::AtomicBool>,
    /// Whether the node can serve (see [`ClusterNode::ready`]).
    ready: Arc<std::sync::atomic::AtomicBool>,
    /// The task that keeps `ready` and the engine's lost-data mark current.
    watching: Arc<parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>>,
    /// The task that applies the metadata group's changes to the engine.
    following: Arc<parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>>,
    /// Set once the node stops: its hand-off task ends.
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

/// Pause between readiness checks, in milliseconds.
pub const READY_POLL_MS: u64 = 200;
/// How long after it starts a node waits for every one of its range groups to know
/// a leader before it is ready anyway, in milliseconds. A range whose group cannot
/// form (its majority is down, or cannot take this node's new replica) must not
/// keep the node from serving every other range: requests for that range answer
/// 503 as they would during a failover, and `GET /v1/cluster` shows it leaderless.
/// Five failovers' worth (`FAILOVER_BOUND_MS`) leaves first elections time.
pub const READY_GROUP_LEADERS_WAIT_MS: u64 = 5 * tally_replica::FAILOVER_BOUND_MS;

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
    /// The change would leave range groups of two voters, which cannot replace a
    /// lost disk.
    #[error(
        "two members cannot keep range groups that survive a lost disk (every majority of two needs \
         both): keep three members or more, or stop before removing the third"
    )]
    TwoVoters,
    /// The metadata group could not be reached.
    #[error("metadata group unavailable: {0}")]
    Unavailable(String),
}

/// Attempts at a membership change that keeps meeting concurrent changes.
pub const MEMBERSHIP_ATTEMPTS_MAX: usize = 5;

impl ClusterNode {
    /// Starts this node: its raft member, its transport and its engine, on its data
    /// directory and sockets.
    pub async fn start(config: ClusterNodeConfig) -> Result<Self, ClusterError> {
        Self::start_with(config, NodeWiring::Sockets).await
    }

    /// Starts this node on `wiring`: the same node [`ClusterNode::start`] runs, on
    /// stores, a clock and networks handed in when `wiring` is
    /// [`NodeWiring::InMemory`].
    pub async fn start_with(config: ClusterNodeConfig, wiring: NodeWiring) -> Result<Self, ClusterError> {
        let me = config
            .members
            .iter()
            .find(|m| m.id == config.node_id)
            .cloned()
            .ok_or_else(|| ClusterError::Config(format!("node {:?} is not a member", config.node_id)))?;
        let Opened { raft_db, local, replica_kv, clock, nets } = Self::open_stores(&config, wiring).await?;
        // The data directory is one unit: checked whole before raft starts, so the
        // node never takes part in anything under an identity whose data it lacks.
        let identity = tally_raft::identity::Identity::open(&raft_db)
            .map_err(|e| ClusterError::DataDir(format!("raft store identity: {e}")))?;
        let replica_id = replication::node_replica_id(identity.store, me.raft_id);
        let replica = replica_kv.as_deref().map(|kv| (kv, replica_id));
        parts::check(&config.data_dir, &identity, local.as_ref(), replica)?;

        let voters: BTreeMap<u64, String> =
            config.members.iter().map(|m| (m.raft_id, m.raft.to_string())).collect();
        let mut raft_cfg = MetaRaftConfig::new(me.raft_id, voters, RaftStorage::Db(raft_db));
        raft_cfg.heartbeat_ms = config.raft_heartbeat_ms;
        raft_cfg.election_timeout_min_ms = config.raft_election_timeout_ms.0;
        raft_cfg.election_timeout_max_ms = config.raft_election_timeout_ms.1;
        raft_cfg.tls = config.tls.clone();
        raft_cfg.secret = Some(tally_raft::RaftSecret::new(&config.secret));
        let raft = match &nets {
            None => MetaRaft::start(raft_cfg).await?,
            // No other party shares an in-memory network: nothing to prove.
            Some((raft_net, _)) => {
                MetaRaft::start_in(MetaRaftConfig { secret: None, ..raft_cfg }, raft_net.clone()).await?
            }
        };
        let raft = Arc::new(raft);

        let handler = Arc::new(ShardHandler { engine: Slot::new(), replication: Slot::new() });
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
        let transport = match nets {
            None => Transport::start(transport_cfg, handler.clone()).await,
            Some((_, peers)) => Transport::start_in(transport_cfg, handler.clone(), peers).await,
        };
        let transport = match transport {
            Ok(t) => t,
            Err(e) => {
                raft.shutdown().await;
                return Err(e.into());
            }
        };

        // What starts from here on may fail; a node that cannot start stops what it
        // started, or its metadata member and sessions would hold its addresses in a
        // process that goes on (an embedding, a simulation).
        let started = async {
            let view = PlacementView::new(&config, &raft.membership());
            let (replication, store) = if let Some(kv) = replica_kv {
                let r = Self::start_replication(&config, &me, &raft, &transport, kv).await?;
                handler.replication.set(r.clone());
                let store = tally_replica::RangeStore::new(
                    r.groups().clone(),
                    local.clone(),
                    tokio::runtime::Handle::current(),
                );
                (Some(r), Arc::new(store) as Arc<dyn tally_store::Store>)
            } else {
                (None, local.clone())
            };
            let placement = Arc::new(RingPlacement {
                me: NodeId::new(&me.id),
                view: parking_lot::RwLock::new(Arc::new(view)),
                transport: transport.clone(),
                call_timeout: Duration::from_millis(config.engine.call_timeout_ms),
                replication: replication.clone(),
                engine: Slot::new(),
                peers: config.members.iter().filter(|m| m.id != me.id).map(|m| NodeId::new(&m.id)).collect(),
            });
            let mut engine_cfg = config.engine.clone();
            engine_cfg.node_id = NodeId::new(&me.id);
            if replication.is_some() {
                // Range groups hold the shards: a counter may ask for its own count.
                engine_cfg.replicas_max = tally_core::ranges::REPLICAS_MAX;
            }
            parts::bind(&identity, local.as_ref())?;
            let tally = Tally::open_parts(EngineParts {
                store,
                clock,
                config: engine_cfg,
                catalog: Some(Arc::new(RaftCatalog { raft: raft.clone() })),
                placement: Some(placement.clone()),
            })
            .await?;
            Ok::<_, ClusterError>((replication, placement, tally))
        };
        let (replication, placement, tally) = match started.await {
            Ok(started) => started,
            Err(e) => {
                if let Some(r) = handler.replication.get() {
                    r.groups().shutdown().await;
                }
                handler.replication.clear();
                transport.shutdown().await;
                raft.shutdown().await;
                return Err(e);
            }
        };
        // Before any other node can read this node's shards: a new or replaced disk
        // holds no trustworthy values until the metadata group says otherwise.
        handler.engine.set(tally.clone());
        placement.engine.set(tally.clone());
        let node = Self {
            tally: tally.clone(),
            raft: raft.clone(),
            transport,
            replication,
            tending: Default::default(),
            placement,
            handler,
            config: Arc::new(config),
            handing_off: Default::default(),
            ready: Default::default(),
            watching: Default::default(),
            following: Default::default(),
            stopping: Default::default(),
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
        *node.following.lock() = Some(tokio::spawn(async move {
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
        }));
        // A hand-off a restart interrupted goes on.
        node.membership_changed();
        let checker = node.clone();
        *node.watching.lock() = Some(tokio::spawn(async move { checker.watch_ready().await }));
        tracing::info!(node = %me.id, nodes = node.config.members.len(), "cluster node started");
        Ok(node)
    }

    /// Opens the node's stores and picks its clock, as `wiring` says: the metadata
    /// group's database, the engine's store, the range replicas' store (with more
    /// than one copy) and, in memory, the two networks.
    async fn open_stores(config: &ClusterNodeConfig, wiring: NodeWiring) -> Result<Opened, ClusterError> {
        let dir = &config.data_dir;
        let opened = match wiring {
            NodeWiring::Sockets => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| ClusterError::Config(format!("cannot create {}: {e}", dir.display())))?;
                let raft_db = tally_raft::meta_raft::open_db(&dir.join("raft")).await?;
                let local: Arc<dyn Store> = Arc::new(SledStore::open(&SledConfig::new(dir.join("store")))?);
                let had_replicas = dir.join("replica").exists();
                check_copies(config.replicas, dir, had_replicas, local.as_ref())?;
                let replica: Option<Arc<dyn KvStore>> = if config.replicas > 1 {
                    let kv = tally_replica::SledKv::open(&dir.join("replica"))
                        .map_err(|e| ClusterError::Config(format!("range groups: {e}")))?;
                    Some(Arc::new(kv))
                } else {
                    None
                };
                Opened { raft_db, local, replica_kv: replica, clock: Arc::new(SystemClock), nets: None }
            }
            NodeWiring::InMemory(w) => {
                check_copies(config.replicas, dir, w.replica.is_some(), w.store.as_ref())?;
                if config.replicas > 1 && w.replica.is_none() {
                    return Err(ClusterError::Config(format!(
                        "{} copies of each shard need a replica store",
                        config.replicas
                    )));
                }
                let replica = w.replica.filter(|_| config.replicas > 1);
                Opened {
                    raft_db: w.raft_db,
                    local: w.store,
                    replica_kv: replica,
                    clock: w.clock,
                    nets: Some((w.raft_net, w.peers)),
                }
            }
        };
        Ok(opened)
    }

    /// Starts this node's range groups: the directory of the initial members, one
    /// group per range this node replicates, all in one sled database.
    async fn start_replication(
        config: &ClusterNodeConfig,
        me: &Member,
        raft: &Arc<MetaRaft>,
        transport: &Transport,
        kv: Arc<dyn KvStore>,
    ) -> Result<Arc<Replication>, ClusterError> {
        let members = initial_members(config).into_iter().map(NodeId::new);
        let members: Vec<NodeId> = members.collect();
        let layout = tally_core::ranges::RangeLayout::for_members_at(members.len(), config.ranges_per_node);
        let directory = tally_core::ranges::Directory::with_layout(layout, members, Some(config.replicas))
            .map_err(|e| ClusterError::Config(format!("replicas: {e}")))?;
        let replica = |e: tally_replica::ReplicaError| ClusterError::Config(format!("range groups: {e}"));
        let net = Arc::new(replication::SessionNet::new(transport.clone(), &config.groups));
        let groups = tally_replica::RangeGroups::open(
            &me.id,
            replication::node_replica_id(raft.store_id(), me.raft_id),
            kv,
            net,
            directory.layout(),
            config.groups,
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
        let started = tokio::time::Instant::now();
        let groups_wait = Duration::from_millis(READY_GROUP_LEADERS_WAIT_MS);
        loop {
            let r = self.raft.readiness().await;
            caught_up_once |= r.caught_up;
            groups_led_once |= self.replication.as_ref().is_none_or(|g| g.every_group_has_a_leader())
                || started.elapsed() >= groups_wait;
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
    /// registered, it has a node-to-node session with every peer whose raft
    /// endpoint answers, and its range groups knew a leader (or
    /// [`READY_GROUP_LEADERS_WAIT_MS`] passed: a range that cannot form does not
    /// hold up the others). Before that, requests may fail for reasons that clear by
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
            if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
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
            // Range groups of every replica class have `group_voters(class,
            // members)` voters: two members make each group a pair.
            if self.replication.is_some() && members.len() == 2 && previous.len() != 2 {
                return Err(MembershipError::TwoVoters);
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
        self.stop_tasks();
        let r = self.tally.shutdown().await;
        self.stop_members().await;
        r
    }

    /// Stops the node the way a crash would, as far as one process can: the engine
    /// is aborted without flushing (what it had not flushed is the store's to keep
    /// or lose), then the range groups, raft and the transport stop. For nodes
    /// started [`NodeWiring::InMemory`], whose process goes on.
    pub async fn abort(&self) {
        self.stop_tasks();
        self.tally.abort();
        self.stop_members().await;
    }

    /// Ends the node's own tasks: readiness, group tending, the metadata feed and
    /// hand-offs.
    fn stop_tasks(&self) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        for task in [&self.watching, &self.tending, &self.following] {
            if let Some(task) = task.lock().take() {
                task.abort();
            }
        }
    }

    /// Stops the range groups, raft and the transport, and lets go of the engine
    /// and the groups where other parts reach them.
    async fn stop_members(&self) {
        if let Some(r) = &self.replication {
            r.groups().shutdown().await;
        }
        self.raft.shutdown().await;
        self.transport.shutdown().await;
        self.handler.engine.clear();
        self.handler.replication.clear();
        self.placement.engine.clear();
    }
}
