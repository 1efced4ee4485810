//! [`MetaRaft`]: one node of the metadata group, ready to use — storage, network,
//! endpoints, cluster initialization, forwarding and local reads behind one handle.

use crate::auth::RaftSecret;
use crate::error::RaftError;
use crate::identity::Identity;
use crate::log_store::SledLogStore;
use crate::mem_net::MemRaftNet;
use crate::network::{http_client, post_json, CallError, HttpNetworkFactory, PeerClient};
use crate::server::{
    raft_router, IdentityAnswer, ReadRequest, ReplaceRequest, PATH_CLIENT_WRITE, PATH_IDENTITY, PATH_READ,
    PATH_REPLACE, REPLACE_TIMEOUT_MS,
};
use crate::state::MetaState;
use crate::state_machine::{Shared, SledStateMachine};
use crate::store_id::StoreId;
use crate::types::{
    MembersView, MetaChange, NodeId, Raft, Request, Response, StoreRecord, StoreRejection, TypeConfig,
};
use openraft::error::{CheckIsLeaderError, ClientWriteError, ForwardToLeader, InitializeError};
use openraft::raft::ClientWriteResponse;
use openraft::BasicNode;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tally_core::meta::CounterMeta;
use tally_core::name::CounterName;
use tally_tls::TlsIncoming;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, oneshot, Mutex};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Default leader heartbeat interval, in milliseconds (generous for 2-core machines).
pub const HEARTBEAT_MS_DEFAULT: u64 = 250;
/// Default shortest election timeout, in milliseconds.
pub const ELECTION_TIMEOUT_MIN_MS_DEFAULT: u64 = 1_000;
/// Default longest election timeout, in milliseconds.
pub const ELECTION_TIMEOUT_MAX_MS_DEFAULT: u64 = 2_000;
/// Default timeout of sending one snapshot chunk and installing it, in milliseconds
/// (openraft's own default of 200 ms is too short for a loaded machine).
pub const INSTALL_SNAPSHOT_TIMEOUT_MS_DEFAULT: u64 = 5_000;
/// Default number of applied entries after which a snapshot is built.
pub const SNAPSHOT_LOGS_SINCE_LAST_DEFAULT: u64 = 5_000;
/// Default number of entries kept in the log behind a snapshot (so a briefly lagging
/// follower catches up from the log instead of a snapshot).
pub const SNAPSHOT_LOGS_KEPT_DEFAULT: u64 = 1_000;
/// Default bound on one [`MetaRaft::write`] or linearizable read, retries and
/// forwarding included, in milliseconds. Covers an election (≤ 2 election timeouts).
pub const OPERATION_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// Largest snapshot chunk sent in one RPC, in bytes.
pub const SNAPSHOT_CHUNK_BYTES: u64 = 1 << 20;
/// sled page cache of a database opened by path, in bytes: the metadata is small.
pub const SLED_CACHE_BYTES: u64 = 16 << 20;
/// How long opening a database by path waits for a previous instance in this
/// process to release its lock (a node restarting in a test), in milliseconds.
pub const SLED_LOCK_WAIT_MS: u64 = 10_000;
/// How long [`MetaRaft::shutdown`] waits for open connections to finish before it
/// stops serving them anyway, in milliseconds.
pub const SERVER_STOP_WAIT_MS: u64 = 2_000;
/// First pause between retries of a write or read during an election, in
/// milliseconds; it doubles up to [`RETRY_BACKOFF_MAX_MS`].
pub const RETRY_BACKOFF_MIN_MS: u64 = 50;
/// Longest pause between retries, in milliseconds.
pub const RETRY_BACKOFF_MAX_MS: u64 = 500;
/// Pause between rounds of probing the peers while a node with an empty log works
/// out whether the group exists, in milliseconds.
pub const JOIN_POLL_MS: u64 = 250;
/// Timeout of one identity probe of a peer, in milliseconds.
pub const PROBE_TIMEOUT_MS: u64 = 500;

/// Where a node keeps its raft log and state machine.
#[derive(Debug, Clone)]
pub enum RaftStorage {
    /// A sled database of its own at this directory (opened with a small cache).
    Path(PathBuf),
    /// Trees in a database the caller already opened (e.g. shared with the data
    /// plane's store). The raft trees are named `raft_*`.
    Db(sled::Db),
}

/// How to start one node of the metadata group.
#[derive(Debug, Clone)]
pub struct MetaRaftConfig {
    /// This node's raft id; stable for the life of its disk.
    pub node_id: NodeId,
    /// Every voter of the group: raft id → raft address (`127.0.0.1:port`), the
    /// same on every node. The initial membership, applied once by the smallest id.
    pub voters: BTreeMap<NodeId, String>,
    /// Where the log and state machine live.
    pub storage: RaftStorage,
    /// Leader heartbeat interval, in milliseconds.
    pub heartbeat_ms: u64,
    /// Shortest election timeout, in milliseconds; several heartbeats long.
    pub election_timeout_min_ms: u64,
    /// Longest election timeout, in milliseconds.
    pub election_timeout_max_ms: u64,
    /// Timeout of sending one snapshot chunk and installing it, in milliseconds.
    pub install_snapshot_timeout_ms: u64,
    /// A snapshot is built after this many entries were applied since the last one.
    pub snapshot_logs_since_last: u64,
    /// Entries kept in the log behind a snapshot; older ones are purged.
    pub snapshot_logs_kept: u64,
    /// Bound on one write or linearizable read, retries included, in milliseconds.
    pub operation_timeout_ms: u64,
    /// Mutual TLS on the raft endpoints and on every call to a peer's, with the
    /// cluster CA as the only root; plaintext when `None`.
    pub tls: Option<tally_tls::ClusterTls>,
    /// The cluster secret every raft RPC must prove ([`crate::auth`]), sent with
    /// every call and checked on every endpoint; `None` (tests of this crate only)
    /// serves any caller.
    pub secret: Option<RaftSecret>,
}

impl MetaRaftConfig {
    /// A config with the default timings.
    pub fn new(node_id: NodeId, voters: BTreeMap<NodeId, String>, storage: RaftStorage) -> Self {
        Self {
            node_id,
            voters,
            storage,
            heartbeat_ms: HEARTBEAT_MS_DEFAULT,
            election_timeout_min_ms: ELECTION_TIMEOUT_MIN_MS_DEFAULT,
            election_timeout_max_ms: ELECTION_TIMEOUT_MAX_MS_DEFAULT,
            install_snapshot_timeout_ms: INSTALL_SNAPSHOT_TIMEOUT_MS_DEFAULT,
            snapshot_logs_since_last: SNAPSHOT_LOGS_SINCE_LAST_DEFAULT,
            snapshot_logs_kept: SNAPSHOT_LOGS_KEPT_DEFAULT,
            operation_timeout_ms: OPERATION_TIMEOUT_MS_DEFAULT,
            tls: None,
            secret: None,
        }
    }

    /// This node's raft address, checked.
    pub(crate) fn own_addr(&self) -> Result<SocketAddr, RaftError> {
        let addr = self
            .voters
            .get(&self.node_id)
            .ok_or_else(|| RaftError::Config(format!("node {} is not among the voters", self.node_id)))?;
        addr.parse()
            .map_err(|e| RaftError::Config(format!("raft address {addr:?} of node {}: {e}", self.node_id)))
    }

    pub(crate) fn validate(&self) -> Result<(), RaftError> {
        for (id, addr) in &self.voters {
            addr.parse::<SocketAddr>()
                .map_err(|e| RaftError::Config(format!("raft address {addr:?} of node {id}: {e}")))?;
        }
        self.own_addr()?;
        if self.operation_timeout_ms == 0 {
            return Err(RaftError::Config("operation_timeout_ms must be positive".into()));
        }
        Ok(())
    }

    fn openraft_config(&self) -> Result<openraft::Config, RaftError> {
        let config = openraft::Config {
            cluster_name: "tally-meta".into(),
            heartbeat_interval: self.heartbeat_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            install_snapshot_timeout: self.install_snapshot_timeout_ms,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(self.snapshot_logs_since_last),
            max_in_snapshot_log_to_keep: self.snapshot_logs_kept,
            snapshot_max_chunk_size: SNAPSHOT_CHUNK_BYTES,
            ..Default::default()
        };
        config.validate().map_err(|e| RaftError::Config(e.to_string()))
    }
}

/// Opens the database at `path`, waiting up to [`SLED_LOCK_WAIT_MS`] for a previous
/// instance in this process to release it.
/// Opens the raft database at `path`, waiting a moment for a file lock that a
/// database dropped just before still holds. A node opens it before starting raft
/// to check its data directory ([`crate::identity::Identity`]), then hands it over
/// as [`RaftStorage::Db`].
pub async fn open_db(path: &std::path::Path) -> Result<sled::Db, RaftError> {
    let deadline = Instant::now() + Duration::from_millis(SLED_LOCK_WAIT_MS);
    loop {
        let opened = sled::Config::new().path(path).cache_capacity(SLED_CACHE_BYTES).open();
        match opened {
            Ok(db) => return Ok(db),
            Err(sled::Error::Io(e)) if e.to_string().contains("lock") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(RaftError::Storage(format!("cannot open {}: {e}", path.display()))),
        }
    }
}

/// The answer of a leader that was forwarded a write.
type ForwardedWrite = Result<
    ClientWriteResponse<TypeConfig>,
    openraft::error::RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>,
>;
/// The answer of a leader that was forwarded a linearizable read.
type ForwardedRead =
    Result<Option<CounterMeta>, openraft::error::RaftError<NodeId, CheckIsLeaderError<NodeId, BasicNode>>>;

/// What one attempt of a retried operation came to.
enum Attempt<T> {
    Done(T),
    Retry(String),
}

/// Time left until `deadline` (zero once it passed).
fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Where a node serves its raft endpoints.
pub(crate) enum Serve {
    /// On a bound socket.
    Socket(TcpListener),
    /// On an in-memory network.
    Memory(MemRaftNet),
}

/// A node's raft endpoints being served.
enum Serving {
    /// The running HTTP server.
    Socket { stop: oneshot::Sender<()>, task: JoinHandle<()> },
    /// The router registered in an in-memory network under `addr`.
    Memory { net: MemRaftNet, addr: String, key: u64 },
}

/// How long a peer has to complete the TLS handshake on the raft address, in
/// milliseconds.
pub const TLS_HANDSHAKE_TIMEOUT_MS: u64 = 5_000;

/// One node of the metadata group: it persists the log and state machine in sled,
/// serves the raft endpoints on its raft address, forwards writes to the leader and
/// answers local reads of the applied metadata.
///
/// # Initialization
///
/// A node whose log is empty probes its peers (`POST /raft/identity`) until it
/// knows whether the group exists. If no peer has a group and enough peers answered
/// to form a quorum with it, the voter with the smallest id initializes the group
/// with all voters; the others wait to be contacted by a leader. If the group
/// exists and records this node under another store incarnation (its disk was
/// replaced), the node records locally that its data is lost and asks the leader to
/// re-add it as a new incarnation (`POST /raft/replace`: removed as a voter, caught
/// up as a learner, promoted). It never initializes or votes under its old identity.
///
/// Once a leader is known, every node registers its store incarnation
/// ([`Request::RegisterStore`]); every raft RPC then names it.
///
/// # Serving
///
/// [`MetaRaft::start`] binds the node's raft address and serves
/// [`crate::raft_router`] there until [`MetaRaft::shutdown`]; use
/// [`MetaRaft::start_with_listener`] to hand it an already bound listener, or
/// [`MetaRaft::start_in`] to serve it on an in-memory network instead
/// ([`crate::mem_net`]).
#[derive(Clone)]
pub struct MetaRaft {
    id: NodeId,
    raft: Raft,
    shared: Arc<Shared>,
    client: PeerClient,
    operation_timeout: Duration,
    addr: SocketAddr,
    serving: Arc<Mutex<Option<Serving>>>,
    identity: Identity,
    voters: BTreeMap<NodeId, String>,
    joining: Arc<std::sync::Mutex<Option<JoinHandle<()>>>>,
    /// This run's identity as a proposer, and the number of its last proposal
    /// (see [`MetaRaft::write`]).
    proposer: u128,
    proposed: Arc<std::sync::atomic::AtomicU64>,
}

/// What one probe round of the peers found (see [`MetaRaft::readiness`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Readiness {
    /// The leader this node knows of.
    pub leader: Option<NodeId>,
    /// This node has applied everything the leader had applied when probed.
    pub caught_up: bool,
    /// The group records this node's current store incarnation.
    pub registered: bool,
    /// Peers whose raft endpoint answered the probe.
    pub reachable: Vec<NodeId>,
}

impl MetaRaft {
    /// Starts the node: opens its storage, starts raft, serves the raft endpoints on
    /// its address from `cfg.voters`, and initializes the group if this node has the
    /// smallest id and an empty log. Returns without waiting for a leader (see
    /// [`MetaRaft::wait_for_leader`]).
    pub async fn start(cfg: MetaRaftConfig) -> Result<Self, RaftError> {
        let addr = cfg.own_addr()?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| RaftError::Bind { addr: addr.to_string(), reason: e.to_string() })?;
        Self::start_with_listener(cfg, listener).await
    }

    /// Like [`MetaRaft::start`], serving on `listener`, which must be bound to this
    /// node's address in `cfg.voters` (tests bind port 0 first to learn free ports).
    pub async fn start_with_listener(cfg: MetaRaftConfig, listener: TcpListener) -> Result<Self, RaftError> {
        cfg.validate()?;
        let addr = listener
            .local_addr()
            .map_err(|e| RaftError::Bind { addr: "listener".into(), reason: e.to_string() })?;
        if addr != cfg.own_addr()? {
            return Err(RaftError::Config(format!(
                "listener is bound to {addr} but node {} has raft address {}",
                cfg.node_id,
                cfg.own_addr()?
            )));
        }
        Self::launch(cfg, addr, Serve::Socket(listener)).await
    }

    /// Starts the node at raft address `addr` (checked against `cfg`), serving as
    /// `serve` says.
    pub(crate) async fn launch(
        cfg: MetaRaftConfig,
        addr: SocketAddr,
        serve: Serve,
    ) -> Result<Self, RaftError> {
        let config = Arc::new(cfg.openraft_config()?);
        let db = match &cfg.storage {
            RaftStorage::Path(path) => open_db(path).await?,
            RaftStorage::Db(db) => db.clone(),
        };
        let identity = Identity::open(&db).map_err(|e| RaftError::Storage(e.to_string()))?;
        let log = SledLogStore::open(&db).map_err(|e| RaftError::Storage(e.to_string()))?;
        let sm = SledStateMachine::open(&db).map_err(|e| RaftError::Storage(e.to_string()))?;
        drop(db);
        let shared = sm.shared();
        let secret = cfg.secret.clone().map(Arc::new);
        let client = match &serve {
            Serve::Socket(_) => http_client(cfg.tls.as_ref(), secret.clone())
                .map_err(|e| RaftError::Config(format!("cannot build HTTP client: {e}")))?,
            Serve::Memory(net) => PeerClient::in_memory(net.end(cfg.node_id, addr), secret.clone()),
        };
        let network = HttpNetworkFactory::new(client.clone(), cfg.node_id, identity.store, shared.clone());
        let raft = Raft::new(cfg.node_id, config, network, log, sm)
            .await
            .map_err(|e| RaftError::Stopped(e.to_string()))?;

        let router = raft_router(raft.clone(), shared.clone(), cfg.node_id, identity.store, secret);
        let serving = match serve {
            Serve::Socket(listener) => {
                let (stop, stopped) = oneshot::channel::<()>();
                let stopped = async move {
                    let _ = stopped.await;
                };
                let incoming = match &cfg.tls {
                    None => crate::server::RaftIncoming::Plain(listener),
                    Some(tls) => {
                        let handshake = Duration::from_millis(TLS_HANDSHAKE_TIMEOUT_MS);
                        let incoming = TlsIncoming::start(
                            listener,
                            tls.acceptor(),
                            handshake,
                            tally_tls::Listener::Raft,
                        )
                        .map_err(|e| RaftError::Bind { addr: addr.to_string(), reason: e.to_string() })?;
                        crate::server::RaftIncoming::Tls(incoming, tls.clone())
                    }
                };
                let task = tokio::spawn(crate::server::serve(incoming, router, stopped));
                Serving::Socket { stop, task }
            }
            Serve::Memory(net) => {
                // `validate` checked that this node is among the voters.
                let own = cfg.voters.get(&cfg.node_id).cloned().unwrap_or_else(|| addr.to_string());
                let key = net.register(own.clone(), cfg.node_id, router);
                Serving::Memory { net, addr: own, key }
            }
        };

        let store = identity.store;
        let node = Self {
            id: cfg.node_id,
            raft,
            shared,
            client,
            operation_timeout: Duration::from_millis(cfg.operation_timeout_ms),
            addr,
            serving: Arc::new(Mutex::new(Some(serving))),
            identity,
            voters: cfg.voters.clone(),
            proposer: tally_raft_kit::random_u128(),
            proposed: Default::default(),
            joining: Default::default(),
        };
        // Ends once this node is in the group with its store registered; shutdown
        // aborts it.
        let joiner = node.clone();
        let joining = tokio::spawn(async move { joiner.join().await });
        *node.joining.lock().unwrap_or_else(|e| e.into_inner()) = Some(joining);
        tracing::info!(node = cfg.node_id, %addr, %store, "metadata raft node started");
        Ok(node)
    }

    /// Asks every peer who it is; the answers of those that answered in time.
    async fn probe_peers(&self) -> Vec<IdentityAnswer> {
        let limit = Duration::from_millis(PROBE_TIMEOUT_MS);
        let probes = self.voters.iter().filter(|(id, _)| **id != self.id).map(|(_, addr)| async move {
            post_json::<_, IdentityAnswer>(&self.client, addr, PATH_IDENTITY, &serde_json::json!({}), limit)
                .await
        });
        futures::future::join_all(probes).await.into_iter().filter_map(Result::ok).collect()
    }

    /// Brings this node into the group (see the type's docs), then registers its
    /// store incarnation.
    async fn join(&self) {
        let poll = Duration::from_millis(JOIN_POLL_MS);
        let quorum = self.voters.len() / 2 + 1;
        loop {
            match self.raft.is_initialized().await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(node = self.id, error = %e, "raft stopped while joining");
                    return;
                }
            }
            let answers = self.probe_peers().await;
            if let Some(group) = answers.iter().find(|a| a.initialized) {
                let recorded = group.stores.get(&self.id).map(|r| r.store);
                let was_replaced = self.identity.replaced().unwrap_or(true);
                let unfinished = was_replaced && !group.voters.contains(&self.id);
                if recorded.is_some_and(|r| r != self.identity.store) || unfinished {
                    self.rejoin(group, recorded).await;
                }
                // Otherwise a leader contacts this node soon.
            } else if self.voters.keys().next() == Some(&self.id) && answers.len() + 1 >= quorum {
                self.initialize().await;
            }
            tokio::time::sleep(poll).await;
        }
        self.register().await;
    }

    /// Records that this node's earlier data is lost and asks the leader to re-add
    /// it as a new incarnation.
    async fn rejoin(&self, group: &IdentityAnswer, recorded: Option<StoreId>) {
        if let Err(e) = self.identity.set_replaced(true) {
            tracing::error!(node = self.id, error = %e, "cannot record that this node's data is lost");
            return;
        }
        tracing::warn!(
            node = self.id,
            store = %self.identity.store,
            recorded = ?recorded.map(|r| r.to_string()),
            "the metadata group knows this node under another disk: rejoining as a new incarnation whose earlier data is lost"
        );
        let Some(leader) = group.leader.and_then(|l| self.voters.get(&l)) else { return };
        let req = ReplaceRequest { node: self.id, store: self.identity.store, addr: self.addr.to_string() };
        let limit = Duration::from_millis(REPLACE_TIMEOUT_MS + PROBE_TIMEOUT_MS);
        match post_json::<_, Result<(), String>>(&self.client, leader, PATH_REPLACE, &req, limit).await {
            Ok(Ok(())) => tracing::info!(node = self.id, "rejoined the metadata group as a new incarnation"),
            Ok(Err(why)) => {
                tracing::warn!(node = self.id, leader = %leader, %why, "rejoin refused; retrying")
            }
            Err(e) => tracing::warn!(node = self.id, error = %e, "rejoin failed; retrying"),
        }
    }

    async fn initialize(&self) {
        let members: BTreeMap<NodeId, BasicNode> =
            self.voters.iter().map(|(id, addr)| (*id, BasicNode { addr: addr.clone() })).collect();
        match self.raft.initialize(members).await {
            Ok(()) => {
                tracing::info!(node = self.id, voters = ?self.voters.keys().collect::<Vec<_>>(), "initialized metadata group")
            }
            Err(openraft::error::RaftError::APIError(InitializeError::NotAllowed(_))) => {}
            Err(e) => tracing::warn!(node = self.id, error = %e, "cannot initialize the metadata group"),
        }
    }

    /// Registers this node's store incarnation, retrying until the group answers.
    async fn register(&self) {
        let backoff = Duration::from_millis(RETRY_BACKOFF_MAX_MS);
        loop {
            if self.store_record().is_some() {
                return;
            }
            let req = Request::RegisterStore { node: self.id, store: self.identity.store };
            match self.write(req).await {
                Ok(Response::Store(Ok(_))) => {
                    tracing::info!(node = self.id, store = %self.identity.store, "registered store incarnation");
                    return;
                }
                Ok(Response::Store(Err(e @ StoreRejection::Replaced { .. }))) => {
                    tracing::error!(node = self.id, error = %e, "this node's store is not the one the group knows");
                    return;
                }
                Ok(other) => {
                    tracing::warn!(node = self.id, answer = ?other, "unexpected answer to a registration")
                }
                Err(e) => tracing::debug!(node = self.id, error = %e, "cannot register the store yet"),
            }
            tokio::time::sleep(backoff).await;
        }
    }

    /// This node's store incarnation.
    pub fn store_id(&self) -> StoreId {
        self.identity.store
    }

    /// What this node has applied about raft node `node`'s store.
    pub fn store_of(&self, node: NodeId) -> Option<StoreRecord> {
        self.shared.read().state.stores.get(&node).copied()
    }

    /// This node's own record, if the group has registered its current store.
    fn store_record(&self) -> Option<StoreRecord> {
        self.store_of(self.id).filter(|r| r.store == self.identity.store)
    }

    /// Whether the shards this node holds may be missing data: its disk replaced one
    /// whose data is lost and the operator has not accepted the loss, or its store is
    /// not registered yet (so it cannot know). Clears the local record of the loss
    /// once the group has applied its acceptance.
    pub fn data_lost(&self) -> bool {
        match self.store_record() {
            Some(r) if !r.data_lost => {
                if self.identity.replaced().unwrap_or(false) {
                    if let Err(e) = self.identity.set_replaced(false) {
                        tracing::warn!(node = self.id, error = %e, "cannot clear the record of lost data");
                    }
                }
                false
            }
            _ => true,
        }
    }

    /// One probe round: the leader, whether this node has applied what the leader
    /// had applied, whether its store is registered, and which peers answered.
    pub async fn readiness(&self) -> Readiness {
        let answers = self.probe_peers().await;
        let leader = self.leader();
        let local = self.shared.read().last_applied.map(|l| l.index);
        let caught_up = match leader {
            Some(l) if l == self.id => true,
            Some(l) => answers.iter().find(|a| a.node == l).is_some_and(|a| local >= a.applied_index),
            None => false,
        };
        Readiness {
            leader,
            caught_up,
            registered: self.store_record().is_some(),
            reachable: answers.iter().map(|a| a.node).collect(),
        }
    }

    /// Runs `attempt` until it is done, retrying with backoff until the operation
    /// timeout passes. Each attempt gets the deadline and bounds its own steps by it
    /// (an attempt is never cut from outside, so a write the leader answered is
    /// never abandoned half-way and retried).
    async fn retrying<T, F, Fut>(&self, mut attempt: F) -> Result<T, RaftError>
    where
        F: FnMut(Instant) -> Fut,
        Fut: std::future::Future<Output = Result<Attempt<T>, RaftError>>,
    {
        let started = Instant::now();
        let deadline = started + self.operation_timeout;
        let mut backoff_ms = RETRY_BACKOFF_MIN_MS;
        loop {
            let last = match attempt(deadline).await? {
                Attempt::Done(v) => return Ok(v),
                Attempt::Retry(reason) => reason,
            };
            let pause = Duration::from_millis(backoff_ms);
            if Instant::now() + pause >= deadline {
                let waited_ms = started.elapsed().as_millis() as u64;
                return Err(RaftError::Timeout { waited_ms, last });
            }
            tracing::debug!(node = self.id, reason = %last, "retrying metadata operation");
            tokio::time::sleep(pause).await;
            backoff_ms = (backoff_ms * 2).min(RETRY_BACKOFF_MAX_MS);
        }
    }

    /// Where to forward to, given a `ForwardToLeader`.
    fn leader_addr(&self, f: &ForwardToLeader<NodeId, BasicNode>) -> Result<String, String> {
        match (f.leader_id, &f.leader_node) {
            (Some(id), Some(node)) if id != self.id => Ok(node.addr.clone()),
            _ => Err("no leader known (election in progress)".to_string()),
        }
    }

    /// Proposes `req` and waits until it is applied, on any node: on a follower the
    /// request is forwarded to the leader (`POST /raft/client-write`). Elections and
    /// unreachable leaders are retried with backoff for up to the configured
    /// operation timeout. An attempt whose outcome is unknown (a local timeout, a
    /// forwarded write whose answer was lost) may still commit, so `req` goes out as
    /// a [`Request::Proposal`] under this run's proposer identity and a fresh
    /// number, and every attempt carries the same one: the state machine applies it
    /// once and answers the copies with the first answer. A resend the group had
    /// forgotten is refused as [`RaftError::Timeout`] (its outcome unknown).
    ///
    /// When it returns, this node has applied the write too, so the local reads
    /// ([`MetaRaft::counter`], ...) see it — unless this node fell so far behind that
    /// catching up took longer than the operation timeout (logged as a warning).
    pub async fn write(&self, req: Request) -> Result<Response, RaftError> {
        let seq = self.proposed.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let id = crate::types::ProposalId { proposer: self.proposer, seq };
        let req = Request::Proposal { id, request: Box::new(req) };
        let answer = self.propose(req).await?;
        if answer == Response::Forgotten {
            return Err(RaftError::Timeout {
                waited_ms: self.operation_timeout.as_millis() as u64,
                last: "the proposal was resent after the group had forgotten it: its outcome is unknown"
                    .into(),
            });
        }
        Ok(answer)
    }

    /// Creates every counter of `names` that does not exist (in order, with
    /// `default` for a name under no namespace) in one log entry per
    /// [`crate::ENSURE_MANY_MAX`] names, and answers per name. An ensure applied twice
    /// changes nothing the second time, so it goes out bare, not as a proposal: a
    /// resend whose first copy committed answers `Unchanged` for the counters that
    /// copy created.
    pub async fn ensure_many(
        &self,
        names: &[CounterName],
        default: tally_core::namespace::NamespaceSpec,
        now_ms: u64,
    ) -> Result<Vec<crate::CounterAnswer>, RaftError> {
        let mut answers = Vec::with_capacity(names.len());
        for chunk in names.chunks(crate::ENSURE_MANY_MAX) {
            let req = Request::EnsureMany { names: chunk.to_vec(), default, now_ms };
            match self.propose(req).await? {
                Response::Ensured(got) if got.len() == chunk.len() => answers.extend(got),
                _ => {
                    let why = format!("a creation of {} counters had an answer of another kind", chunk.len());
                    return Err(RaftError::Refused(why));
                }
            }
        }
        Ok(answers)
    }

    /// Applies `req` through the leader, retrying attempts whose outcome is unknown.
    async fn propose(&self, req: Request) -> Result<Response, RaftError> {
        #[cfg(feature = "planted-bugs")]
        let sent = std::sync::atomic::AtomicU32::new(0);
        self.retrying(|deadline| {
            let req = req.clone();
            #[cfg(feature = "planted-bugs")]
            let req = match req {
                Request::Proposal { request, .. }
                    if sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) > 0
                        && tally_core::planted::active(
                            tally_core::planted::Bug::ProposalResentWithoutIdentity,
                        ) =>
                {
                    *request
                }
                other => other,
            };
            async move {
                let local = tokio::time::timeout(left(deadline), self.raft.client_write(req.clone())).await;
                let Ok(local) = local else {
                    return Ok(Attempt::Retry("this node leads but did not commit in time".into()));
                };
                match local {
                    Ok(r) => Ok(Attempt::Done(r.data)),
                    Err(openraft::error::RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                        let addr = match self.leader_addr(&f) {
                            Ok(a) => a,
                            Err(why) => return Ok(Attempt::Retry(why)),
                        };
                        let answer: Result<ForwardedWrite, CallError> =
                            post_json(&self.client, &addr, PATH_CLIENT_WRITE, &req, left(deadline)).await;
                        Ok(match answer {
                            Ok(Ok(r)) => {
                                self.wait_applied(r.log_id.index, left(deadline)).await;
                                Attempt::Done(r.data)
                            }
                            Ok(Err(e)) => Attempt::Retry(format!("leader at {addr} answered: {e}")),
                            Err(e) => Attempt::Retry(e.to_string()),
                        })
                    }
                    Err(openraft::error::RaftError::APIError(e)) => Err(RaftError::Refused(e.to_string())),
                    Err(openraft::error::RaftError::Fatal(e)) => Err(RaftError::Stopped(e.to_string())),
                }
            }
        })
        .await
    }

    /// Waits up to `limit` until this node has applied the entry at `index`.
    async fn wait_applied(&self, index: u64, limit: Duration) {
        let waited =
            self.raft.wait(Some(limit)).applied_index_at_least(Some(index), "forwarded write applied").await;
        if let Err(e) = waited {
            tracing::warn!(node = self.id, index, error = %e, "forwarded write is not applied here yet");
        }
    }

    /// The counter's applied metadata on this node. May lag the leader by the
    /// entries not yet applied here; see [`MetaRaft::counter_linearizable`].
    pub fn counter(&self, name: &str) -> Option<CounterMeta> {
        self.shared.read().state.counters.get(name).cloned()
    }

    /// The counter's metadata as of a moment after this call started: the leader
    /// confirms its leadership with a quorum and waits until its state machine has
    /// applied everything committed before answering. Forwarded to the leader from a
    /// follower (`POST /raft/read`).
    ///
    /// An invalid name answers `None` at once: no such counter can exist.
    pub async fn counter_linearizable(&self, name: &str) -> Result<Option<CounterMeta>, RaftError> {
        let Ok(name) = CounterName::new(name) else { return Ok(None) };
        #[cfg(feature = "planted-bugs")]
        if tally_core::planted::active(tally_core::planted::Bug::ReadIndexSkipped) {
            return Ok(self.counter(name.as_str()));
        }
        let name = &name;
        self.retrying(|deadline| async move {
            let local = tokio::time::timeout(left(deadline), self.raft.ensure_linearizable()).await;
            let Ok(local) = local else {
                return Ok(Attempt::Retry("this node leads but no quorum confirmed it in time".into()));
            };
            match local {
                Ok(_) => Ok(Attempt::Done(self.counter(name.as_str()))),
                Err(openraft::error::RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f))) => {
                    let addr = match self.leader_addr(&f) {
                        Ok(a) => a,
                        Err(why) => return Ok(Attempt::Retry(why)),
                    };
                    let body = ReadRequest { name: name.clone() };
                    let answer: Result<ForwardedRead, CallError> =
                        post_json(&self.client, &addr, PATH_READ, &body, left(deadline)).await;
                    Ok(match answer {
                        Ok(Ok(meta)) => Attempt::Done(meta),
                        Ok(Err(e)) => Attempt::Retry(format!("leader at {addr} answered: {e}")),
                        Err(e) => Attempt::Retry(e.to_string()),
                    })
                }
                Err(openraft::error::RaftError::APIError(e)) => Ok(Attempt::Retry(e.to_string())),
                Err(openraft::error::RaftError::Fatal(e)) => Err(RaftError::Stopped(e.to_string())),
            }
        })
        .await
    }

    /// Up to `limit` applied counters whose names start with `prefix` and sort after
    /// `after`, in byte order: one page of a listing, costing a range walk of at most
    /// `limit` entries under the read lock.
    pub fn counter_names(&self, prefix: &str, after: Option<&CounterName>, limit: usize) -> Vec<CounterName> {
        use std::ops::Bound;
        let applied = self.shared.read();
        let start = match after {
            Some(a) if a.as_str() >= prefix => Bound::Excluded(a.as_str()),
            _ => Bound::Included(prefix),
        };
        applied
            .state
            .counters
            .range::<str, _>((start, Bound::Unbounded))
            .take_while(|(n, _)| n.as_str().starts_with(prefix))
            .take(limit)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Deleted counters whose shard data may still exist: name → every
    /// `(generation, shards)` to delete. The data plane deletes them, then writes
    /// [`Request::ClearTombstone`].
    pub fn tombstones(&self) -> BTreeMap<CounterName, Vec<(u32, u16)>> {
        self.shared.read().state.tombstones.clone()
    }

    /// The replica classes of counters that state their own replica count, each
    /// with the members it is assigned on ([`MetaState::classes`]).
    pub fn replica_classes(&self) -> BTreeMap<u8, Vec<String>> {
        self.shared.read().state.classes.clone()
    }

    /// The voters the group of `range` (a replica class's) started with, if recorded.
    pub fn formation(&self, range: u32) -> Option<Vec<(u64, String)>> {
        self.shared.read().state.formations.get(&range).cloned()
    }

    /// Records `voters` as the first voters of `range`'s group unless a record
    /// exists ([`Request::FormRange`]); answers the record that stays.
    pub async fn form_range(
        &self,
        range: u32,
        voters: Vec<(u64, String)>,
    ) -> Result<Vec<(u64, String)>, RaftError> {
        match self.write(Request::FormRange { range, voters }).await? {
            Response::Formation(first) => Ok(first),
            other => Err(RaftError::Refused(format!("{other:?} answered a range formation"))),
        }
    }

    /// The auto bounds of `name`, if its shard count follows contention.
    pub fn auto_shards(&self, name: &str) -> Option<tally_core::spec::AutoShards> {
        self.shared.read().state.auto.get(name).copied()
    }

    /// Every counter whose shard count follows contention, with its bounds.
    pub fn auto_counters(&self) -> Vec<(CounterName, tally_core::spec::AutoShards)> {
        self.shared.read().state.auto.iter().map(|(n, b)| (n.clone(), *b)).collect()
    }

    /// Up to `limit` counters whose deadline is at or before `now_ms`, earliest
    /// first: what the reclaim of expired counters deletes next.
    pub fn expired_counters(&self, now_ms: u64, limit: usize) -> Vec<CounterName> {
        self.shared.read().state.expired(now_ms, limit)
    }

    /// Applies `cmd` to counter `name` against this node's applied state (its
    /// metadata and the namespaces), without changing anything: the proposer's check
    /// that refuses a bad command with its exact error before it is replicated.
    pub fn check(
        &self,
        name: &CounterName,
        cmd: &tally_core::meta::MetaCommand,
        now_ms: u64,
    ) -> Result<(), tally_core::meta::MetaError> {
        let applied = self.shared.read();
        let current = applied.state.counters.get(name).cloned();
        tally_core::meta::apply_command_in(name.as_str(), current, cmd, now_ms, &applied.state.namespaces)
            .map(|_| ())
    }

    /// How many counters are applied here, and how many of them have a deadline.
    pub fn counter_count(&self) -> (u64, u64) {
        let applied = self.shared.read();
        (applied.state.counters.len() as u64, applied.state.expiring.len() as u64)
    }

    /// The namespaces as applied here, by prefix.
    pub fn namespaces(&self) -> tally_core::namespace::Namespaces {
        self.shared.read().state.namespaces.clone()
    }

    /// Whether this node is the metadata group's leader now (as far as it knows):
    /// the one node that runs the cluster's chores, such as reclaiming expired
    /// counters.
    pub fn is_leader(&self) -> bool {
        self.leader() == Some(self.id)
    }

    /// Counters with a resharding in progress, which the data plane must complete
    /// (seal the old generation, then write `CompleteReshard`).
    pub fn pending_reshards(&self) -> Vec<CounterName> {
        self.shared.read().state.pending_reshards()
    }

    /// The data-plane members (sorted) and the placement epoch, as applied here.
    pub fn members(&self) -> (Vec<String>, u64) {
        let applied = self.shared.read();
        (applied.state.members.clone(), applied.state.placement_epoch)
    }

    /// The data-plane membership with the progress of its last change, as applied here.
    pub fn membership(&self) -> MembersView {
        self.shared.read().state.view(false)
    }

    /// A copy of the whole applied state (tests compare replicas with it).
    pub fn state(&self) -> MetaState {
        self.shared.read().state.clone()
    }

    /// How many requests this node's state machine has applied in total, across
    /// restarts. Equal on every caught-up replica; a restart never raises it.
    pub fn applied_requests(&self) -> u64 {
        self.shared.read().state.applied_requests
    }

    /// The leader this node currently knows of, if any.
    pub fn leader(&self) -> Option<NodeId> {
        self.raft.metrics().borrow().current_leader
    }

    /// This node's current raft term.
    pub fn term(&self) -> u64 {
        self.raft.metrics().borrow().current_term
    }

    /// This node's raft id.
    pub fn node_id(&self) -> NodeId {
        self.id
    }

    /// The address the raft endpoints are served on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The underlying openraft handle, for metrics and waits.
    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    /// Announcements of every change this node applies from now on, in apply order,
    /// so the data plane can refresh its caches. A receiver that falls more than
    /// `CHANGES_BUFFERED_MAX` behind gets `RecvError::Lagged` and must re-read
    /// everything, as after [`MetaChange::Reset`].
    pub fn subscribe(&self) -> broadcast::Receiver<MetaChange> {
        self.shared.subscribe()
    }

    /// Waits up to `timeout` until this node knows a leader, returning its id.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Result<NodeId, RaftError> {
        let started = Instant::now();
        let metrics = self
            .raft
            .wait(Some(timeout))
            .metrics(|m| m.current_leader.is_some(), "a leader is known")
            .await
            .map_err(|e| match e {
                openraft::metrics::WaitError::Timeout(..) => RaftError::Timeout {
                    waited_ms: started.elapsed().as_millis() as u64,
                    last: "no leader elected".into(),
                },
                other => RaftError::Stopped(other.to_string()),
            })?;
        metrics.current_leader.ok_or_else(|| RaftError::Stopped("leader vanished".into()))
    }

    /// Stops raft and the endpoint server (on an in-memory network: unregisters the
    /// router, so that calls to this node fail to connect). Idempotent. After it returns the node's
    /// sled database is released once openraft's tasks have dropped their handles
    /// (reopening by path waits for that).
    pub async fn shutdown(&self) {
        if let Some(joining) = self.joining.lock().unwrap_or_else(|e| e.into_inner()).take() {
            joining.abort();
        }
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(node = self.id, error = %e, "raft core ended abnormally");
        }
        let serving = self.serving.lock().await.take();
        match serving {
            Some(Serving::Socket { stop, mut task }) => {
                let _ = stop.send(());
                let wait = Duration::from_millis(SERVER_STOP_WAIT_MS);
                if tokio::time::timeout(wait, &mut task).await.is_err() {
                    task.abort();
                }
            }
            Some(Serving::Memory { net, addr, key }) => net.unregister(&addr, key),
            None => {}
        }
        tracing::info!(node = self.id, "metadata raft node stopped");
    }
}

impl MetaRaft {
    /// Like `start`, but serves on `net` instead of a socket: its router is registered under its
    /// raft address from `cfg.voters`, and all its calls go through `net`.
    ///
    /// Everything else is as with [`MetaRaft::start`]: storage (a simulation passes
    /// [`crate::RaftStorage::Db`] and, to restart a crashed node, the same database
    /// again — the node registers anew under its address), raft, joining the group.
    /// [`MetaRaft::shutdown`] unregisters the router, so that calls to the node fail
    /// to connect until it starts again. `cfg.tls` must be `None` (there is no socket
    /// to secure). With `cfg.secret` every call carries and every router checks a
    /// proof of the secret as over a socket; the proof is stamped and checked with
    /// the wall clock ([`crate::auth::unix_ms`]), which paused time does not move
    /// (both ends read it at nearly the same moment, so proofs pass), but a
    /// simulation passes `secret: None`, so that nothing it runs reads the wall
    /// clock. Every timer of the node is tokio's.
    pub async fn start_in(cfg: MetaRaftConfig, net: MemRaftNet) -> Result<Self, RaftError> {
        cfg.validate()?;
        if cfg.tls.is_some() {
            return Err(RaftError::Config("a node on an in-memory network runs without TLS".into()));
        }
        let addr = cfg.own_addr()?;
        MetaRaft::launch(cfg, addr, Serve::Memory(net)).await
    }
}
