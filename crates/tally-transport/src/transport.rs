//! The runtime: starts ractor_cluster (or joins a [`MemNetwork`]), runs the heartbeat,
//! connector and sweep tasks, and serves `call`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};
use ractor_cluster::node::NodeConnectionMode;
use ractor_cluster::{
    BoxRead, BoxWrite, ClusterBidiStream, IncomingEncryptionMode, NodeServer, NodeServerMessage,
};
use std::net::IpAddr;
use tally_tls::TlsIncoming;
use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use crate::backoff::RECONNECT_LOG_INTERVAL_MS;
use crate::backoff::{unix_ms, Backoff, LogLimiter};
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::gateway::{gateway_group, DynHandler, Erased, Gateway, Handler, PG_SCOPE};
use crate::health::{on_new_session, on_ping_result, HealthAction, PeerHealth, PeerState, PingOutcome};
use crate::mem::{MemNetwork, MemNode};
use crate::sessions::{dial_label, DialState, Events, Sessions};
use crate::wire::{
    decode_reply, encode_request, FrameError, GatewayMsg, Refusal, WireReply, WireRequest, FRAME_BYTES_MAX,
    REQUEST_BYTES_MAX,
};

/// Set while a transport runs in this process: ractor's process groups are global, so two
/// transports in one process would see each other's gateways.
static RUNNING: AtomicBool = AtomicBool::new(false);

/// Id of our subscription to the NodeServer's session events.
const SUBSCRIPTION_ID: &str = "tally-transport";
/// How long a session may ignore a stop request before it is killed, in ms.
pub const SESSION_STOP_GRACE_MS: u64 = 1_000;
/// How long shutdown waits for the NodeServer and gateway to stop before killing them, in ms.
pub const SHUTDOWN_WAIT_MS: u64 = 2_000;

/// One peer as this node sees it; the data plane routes on `state`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    /// The peer's node id.
    pub node: String,
    /// Where it is dialed.
    pub addr: SocketAddr,
    /// What the failure detector believes.
    pub state: PeerState,
    /// When it last answered a ping, in ms since the Unix epoch (this node's clock).
    pub last_seen_ms: Option<u64>,
    /// Set while the peer is refused for running another cluster config: its fingerprint.
    pub refused_fingerprint: Option<u64>,
}

struct PeerEntry {
    addr: SocketAddr,
    health: PeerHealth,
    /// Set when the peer reaches `Up`; the connector reads and clears it to decide whether a
    /// session that ended was a success (reset backoff) or a failure (keep backing off).
    was_up: bool,
    /// The session (ractor_cluster session node id) the last ping went over.
    last_session: Option<u64>,
    refusal_log: LogLimiter,
}

/// What carries this node's messages.
enum Backend {
    /// ractor_cluster sessions over TCP (optionally TLS).
    Ractor(Ractor),
    /// A [`MemNetwork`] in this process.
    Mem {
        /// The network this node joined.
        net: MemNetwork,
        /// This node on it: its gateway, and whether it still runs.
        node: Arc<MemNode>,
    },
}

/// The ractor_cluster backend's parts.
struct Ractor {
    sessions: Arc<Sessions>,
    server: ActorRef<NodeServerMessage>,
    gateway: ActorRef<GatewayMsg>,
}

/// Where one request goes: a gateway actor (local, or remote over a session), or a gateway
/// on a [`MemNetwork`].
enum Route {
    Actor(ActorRef<GatewayMsg>),
    Mem { from: Arc<MemNode>, to: Arc<MemNode> },
}

struct Inner {
    cfg: TransportConfig,
    peers: Mutex<BTreeMap<String, PeerEntry>>,
    backend: Backend,
    status: watch::Sender<Vec<PeerStatus>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    nonce: AtomicU64,
    shut: AtomicBool,
}

/// Node-to-node messaging for one node: sessions to every peer over ractor_cluster, a
/// heartbeat failure detector, reconnects with backoff, and a cluster-config fingerprint check.
/// Payload-agnostic: requests and replies are bytes. Cheap to clone; one per process over
/// ractor_cluster ([`Self::start`]), any number per process in memory ([`Self::start_in`]).
///
/// Detection bound: a peer that goes silent (paused, partitioned, half-open TCP) is `Down`
/// within [`TransportConfig::detection_bound`] = `heartbeat_ms × (heartbeat_misses_max + 1)`;
/// a crashed peer whose socket closes is `Down` within about one `heartbeat_ms`.
#[derive(Clone)]
pub struct Transport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").field("node_id", &self.inner.cfg.node_id).finish_non_exhaustive()
    }
}

/// Releases the one-per-process slot if start fails half way.
struct RunningSlot(bool);

impl Drop for RunningSlot {
    fn drop(&mut self) {
        if self.0 {
            RUNNING.store(false, Ordering::SeqCst);
        }
    }
}

impl Transport {
    /// Starts this node: the gateway actor (joined to its process group), the ractor_cluster
    /// `NodeServer` on `cfg.listen`, and the heartbeat, connector and sweep tasks. Returns once
    /// the listener is bound; peers come up in the background (watch [`Self::subscribe`]).
    /// Must run inside a Tokio runtime.
    pub async fn start<H: Handler>(cfg: TransportConfig, handler: Arc<H>) -> Result<Self, TransportError> {
        cfg.validate()?;
        if RUNNING.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return Err(TransportError::AlreadyRunning);
        }
        let mut slot = RunningSlot(true);

        let handler: Arc<dyn DynHandler> = Arc::new(Erased(handler));
        let gateway = Gateway::new(&cfg, handler);
        let (gateway, _) = Actor::spawn(None, gateway, ())
            .await
            .map_err(|e| TransportError::Start { what: "gateway actor", reason: e.to_string() })?;
        // Join before the NodeServer exists so the first session already advertises it.
        ractor::pg::join_scoped(PG_SCOPE.to_string(), gateway_group(&cfg.node_id), vec![gateway.get_cell()]);

        // The session name is `node_id@node_id`: ractor_cluster treats an equal
        // `host:port` connection string as a self-connection, so a shared bind address such
        // as 0.0.0.0 on every machine must not end up in it.
        // With TLS this node accepts on `cfg.listen` itself (see `tls_accept_loop`)
        // and hands each verified stream to the NodeServer, whose own listener is
        // then parked on a loopback port that also requires a cluster certificate.
        let incoming = match &cfg.tls {
            Some(tls) => {
                let bound = TcpListener::bind(cfg.listen).await.and_then(|listener| {
                    TlsIncoming::start(
                        listener,
                        tls.acceptor(),
                        cfg.handshake_timeout(),
                        tally_tls::Listener::Node,
                    )
                });
                match bound {
                    Ok(incoming) => Some(incoming),
                    Err(e) => {
                        gateway.stop(None);
                        return Err(TransportError::Listen { addr: cfg.listen, reason: e.to_string() });
                    }
                }
            }
            None => None,
        };
        let (port, ip, encryption) = match &cfg.tls {
            Some(tls) => (0, IpAddr::from([127, 0, 0, 1]), IncomingEncryptionMode::Tls(tls.acceptor())),
            None => (cfg.listen.port(), cfg.listen.ip(), IncomingEncryptionMode::Raw),
        };
        let server = NodeServer::new(
            port,
            cfg.secret.clone(),
            cfg.node_id.clone(),
            cfg.node_id.clone(),
            Some(encryption),
            Some(NodeConnectionMode::Isolated),
        )
        .with_listen_addr(ip)
        .with_max_inbound_frame_size(FRAME_BYTES_MAX);
        let server = match Actor::spawn(None, server, ()).await {
            Ok((server, _)) => server,
            Err(e) => {
                gateway.stop(None);
                return Err(TransportError::Listen { addr: cfg.listen, reason: e.to_string() });
            }
        };

        let sessions = Arc::new(Sessions::new(cfg.node_id.clone(), cfg.peers.keys().cloned().collect()));
        if let Err(e) = server.cast(NodeServerMessage::SubscribeToEvents {
            id: SUBSCRIPTION_ID.to_string(),
            subscription: Box::new(Events(Arc::clone(&sessions))),
        }) {
            server.stop(None);
            gateway.stop(None);
            return Err(TransportError::Start { what: "session subscription", reason: e.to_string() });
        }

        let inner = Inner::new(cfg, Backend::Ractor(Ractor { sessions, server, gateway }));

        let mut tasks = Vec::new();
        for peer in inner.cfg.peers.keys() {
            tasks.push(tokio::spawn(Arc::clone(&inner).heartbeat_loop(peer.clone())));
            // Only the smaller name dials, so a pair never races two sessions into
            // ractor_cluster's election; the other side accepts.
            if inner.cfg.node_id < *peer {
                tasks.push(tokio::spawn(Arc::clone(&inner).connector_loop(peer.clone())));
            }
        }
        tasks.push(tokio::spawn(Arc::clone(&inner).sweep_loop()));
        if let Some(incoming) = incoming {
            tasks.push(tokio::spawn(Arc::clone(&inner).tls_accept_loop(incoming)));
        }
        *inner.lock_tasks() = tasks;

        tracing::info!(
            node = %inner.cfg.node_id, listen = %inner.cfg.listen, peers = inner.cfg.peers.len(),
            tls = inner.cfg.tls.is_some(),
            fingerprint = format_args!("{:#018x}", inner.cfg.fingerprint),
            detection_bound_ms = inner.cfg.detection_bound().as_millis() as u64,
            "transport started"
        );
        slot.0 = false;
        Ok(Transport { inner })
    }

    /// Starts this node on `net` instead of sockets: same call/peers/shutdown contract, same
    /// limits, several per process.
    ///
    /// Requests and replies are encoded as on the wire and served by the same gateway logic;
    /// `net`'s [`crate::Links`] decide the fate of every message between two nodes (calls to
    /// this node itself skip them). A "session" to a peer exists while the peer is started
    /// on `net` with the same secret and lists this node; each start of a node is a new
    /// session. The heartbeat runs as over ractor_cluster, on tokio time, so a paused clock
    /// drives it. A node id can be started again on `net` once its previous transport was
    /// shut down (a restart); while it runs, starting it again fails with
    /// [`TransportError::Listen`].
    pub async fn start_in<H: Handler>(
        cfg: TransportConfig,
        handler: Arc<H>,
        net: MemNetwork,
    ) -> Result<Self, TransportError> {
        cfg.validate()?;
        let handler: Arc<dyn DynHandler> = Arc::new(Erased(handler));
        let node = net.join(&cfg, Gateway::new(&cfg, handler))?;
        let inner = Inner::new(cfg, Backend::Mem { net, node });
        let tasks =
            inner.cfg.peers.keys().map(|peer| tokio::spawn(Arc::clone(&inner).heartbeat_loop(peer.clone())));
        *inner.lock_tasks() = tasks.collect();
        tracing::info!(
            node = %inner.cfg.node_id, peers = inner.cfg.peers.len(),
            fingerprint = format_args!("{:#018x}", inner.cfg.fingerprint),
            detection_bound_ms = inner.cfg.detection_bound().as_millis() as u64,
            "transport started in memory"
        );
        Ok(Transport { inner })
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.inner.cfg.node_id
    }

    /// The configured default deadline for [`Self::call`] (`call_timeout_ms`).
    pub fn default_call_timeout(&self) -> Duration {
        Duration::from_millis(self.inner.cfg.call_timeout_ms)
    }

    /// How long a silent peer can stay `Up`/`Suspect` before it is `Down` (see
    /// [`TransportConfig::detection_bound`]).
    pub fn detection_bound(&self) -> Duration {
        self.inner.cfg.detection_bound()
    }

    /// Sends `request` to `node`'s handler and returns its reply, or an error no later than
    /// `timeout` (plus scheduling). A `Down` peer fails at once with `Unreachable` (or
    /// `Refused` if its fingerprint differs); `node` may be this node itself.
    pub async fn call(
        &self,
        node: &str,
        request: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        let inner = &self.inner;
        if inner.shut.load(Ordering::SeqCst) {
            return Err(TransportError::ShutDown);
        }
        if request.len() > REQUEST_BYTES_MAX {
            return Err(TransportError::TooLarge {
                what: "request",
                bytes: request.len(),
                bytes_max: REQUEST_BYTES_MAX,
            });
        }
        let route = if node == inner.cfg.node_id {
            inner.local_route()
        } else {
            let (state, refused) = {
                let peers = inner.lock_peers();
                let entry = peers.get(node).ok_or_else(|| TransportError::UnknownNode(node.to_string()))?;
                (entry.health.state, entry.health.refused_fingerprint)
            };
            if state == PeerState::Down {
                return Err(match refused {
                    Some(theirs) => TransportError::Refused {
                        node: node.to_string(),
                        reason: Refusal::FingerprintMismatch { ours: theirs, theirs: inner.cfg.fingerprint }
                            .to_string(),
                    },
                    None => TransportError::Unreachable(node.to_string()),
                });
            }
            inner.route(node).ok_or_else(|| TransportError::Unreachable(node.to_string()))?
        };
        let wire = WireRequest::Call {
            from: inner.cfg.node_id.clone(),
            fingerprint: inner.cfg.fingerprint,
            body: request,
        };
        let bytes = inner.rpc(&route, node, encode_request(&wire), timeout).await?;
        match decode_reply(&bytes) {
            Ok(WireReply::Reply(body)) => Ok(body),
            Ok(WireReply::Refused(r)) => {
                Err(TransportError::Refused { node: node.to_string(), reason: r.to_string() })
            }
            Ok(WireReply::Overloaded) => Err(TransportError::Overloaded(node.to_string())),
            Ok(WireReply::HandlerFailed) => Err(TransportError::HandlerFailed(node.to_string())),
            Ok(WireReply::ReplyTooLarge(n)) => Err(TransportError::TooLarge {
                what: "reply",
                bytes: usize::try_from(n).unwrap_or(usize::MAX),
                bytes_max: crate::wire::REPLY_BYTES_MAX,
            }),
            Ok(WireReply::Malformed(m)) => {
                Err(TransportError::Protocol { node: node.to_string(), reason: m })
            }
            Ok(WireReply::Pong { .. }) => Err(TransportError::Protocol {
                node: node.to_string(),
                reason: "pong in answer to a call".into(),
            }),
            Err(e) => Err(TransportError::Protocol { node: node.to_string(), reason: e.to_string() }),
        }
    }

    /// Every peer's current status, sorted by name, with fresh `last_seen_ms`.
    pub fn peers(&self) -> Vec<PeerStatus> {
        self.inner.snapshot()
    }

    /// A receiver that changes whenever some peer's `state` (or refusal) changes, so the data
    /// plane can re-route. `last_seen_ms` in it is as of the change; use [`Self::peers`] for
    /// current values.
    pub fn subscribe(&self) -> watch::Receiver<Vec<PeerStatus>> {
        self.inner.status.subscribe()
    }

    /// Stops the tasks, the NodeServer (closing every session) and the gateway, marks every
    /// peer `Down`, and frees the one-per-process slot. Idempotent. Dropping every handle
    /// without calling this leaves the node running: its tasks keep it alive.
    ///
    /// In memory: stops the heartbeat and takes the node off its [`MemNetwork`], so calls
    /// to it fail as to a closed session and its id can be started again. Calls in flight
    /// to or from it fail with `Disconnected`; requests its handler is serving still finish.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        if inner.shut.swap(true, Ordering::SeqCst) {
            return;
        }
        for task in inner.lock_tasks().drain(..) {
            task.abort();
        }
        match &inner.backend {
            Backend::Ractor(r) => {
                let _ = r.server.cast(NodeServerMessage::UnsubscribeToEvents(SUBSCRIPTION_ID.to_string()));
                let wait = Some(Duration::from_millis(SHUTDOWN_WAIT_MS));
                if r.server.stop_and_wait(Some("tally: shutdown".into()), wait).await.is_err() {
                    r.server.kill();
                }
                if r.gateway.stop_and_wait(Some("tally: shutdown".into()), wait).await.is_err() {
                    r.gateway.kill();
                }
            }
            Backend::Mem { net, node } => net.leave(node),
        }
        for entry in inner.lock_peers().values_mut() {
            entry.health.state = PeerState::Down;
            entry.health.misses = 0;
        }
        inner.publish();
        if let Backend::Ractor(_) = inner.backend {
            // The listening socket belongs to the NodeServer's listener child (or to the
            // aborted TLS accept task); both drop it after the stop returned. Wait, within
            // the bound, until the address can be bound again, so a restart in this process
            // finds it free.
            wait_until_bindable(inner.cfg.listen, Duration::from_millis(SHUTDOWN_WAIT_MS)).await;
            RUNNING.store(false, Ordering::SeqCst);
        }
        tracing::info!(node = %inner.cfg.node_id, "transport shut down");
    }
}

/// Waits until `addr` can be bound (as tokio binds a listener: with `SO_REUSEADDR`, so
/// connections left in `TIME_WAIT` do not count), or until `bound` has passed.
async fn wait_until_bindable(addr: SocketAddr, bound: Duration) {
    let probe = || {
        let socket =
            if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }?;
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(1).map(drop)
    };
    let deadline = tokio::time::Instant::now() + bound;
    while probe().is_err() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Inner {
    /// A node's runtime state, every peer `Down` and published as such.
    fn new(cfg: TransportConfig, backend: Backend) -> Arc<Self> {
        let peers = cfg
            .peers
            .iter()
            .map(|(name, addr)| {
                let entry = PeerEntry {
                    addr: *addr,
                    health: PeerHealth::new(),
                    was_up: false,
                    last_session: None,
                    refusal_log: LogLimiter::new(RECONNECT_LOG_INTERVAL_MS),
                };
                (name.clone(), entry)
            })
            .collect();
        let inner = Arc::new(Inner {
            status: watch::Sender::new(Vec::new()),
            peers: Mutex::new(peers),
            backend,
            tasks: Mutex::new(Vec::new()),
            nonce: AtomicU64::new(unix_ms()),
            shut: AtomicBool::new(false),
            cfg,
        });
        inner.status.send_replace(inner.snapshot());
        inner
    }

    /// The ractor_cluster parts, unless this node runs in memory.
    fn ractor(&self) -> Option<&Ractor> {
        match &self.backend {
            Backend::Ractor(r) => Some(r),
            Backend::Mem { .. } => None,
        }
    }

    fn lock_peers(&self) -> MutexGuard<'_, BTreeMap<String, PeerEntry>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_tasks(&self) -> MutexGuard<'_, Vec<JoinHandle<()>>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn snapshot(&self) -> Vec<PeerStatus> {
        self.lock_peers()
            .iter()
            .map(|(node, e)| PeerStatus {
                node: node.clone(),
                addr: e.addr,
                state: e.health.state,
                last_seen_ms: e.health.last_seen_ms,
                refused_fingerprint: e.health.refused_fingerprint,
            })
            .collect()
    }

    /// Publishes the snapshot if some peer's state or refusal changed.
    fn publish(&self) {
        let snap = self.snapshot();
        self.status.send_if_modified(|current| {
            let key = |v: &[PeerStatus]| {
                v.iter().map(|p| (p.node.clone(), p.state, p.refused_fingerprint)).collect::<Vec<_>>()
            };
            if key(current) == key(&snap) {
                false
            } else {
                *current = snap;
                true
            }
        });
    }

    /// This node's own gateway.
    fn local_route(&self) -> Route {
        match &self.backend {
            Backend::Ractor(r) => Route::Actor(r.gateway.clone()),
            Backend::Mem { node, .. } => Route::Mem { from: Arc::clone(node), to: Arc::clone(node) },
        }
    }

    /// The peer's gateway as seen through its current session: a pg member whose remote id
    /// belongs to a live authenticated session (ids from a torn-down session are stale).
    fn route(&self, peer: &str) -> Option<Route> {
        self.route_with_session(peer).map(|(route, _)| route)
    }

    /// [`Self::route`], plus the session the gateway was reached over (ractor_cluster's
    /// session node id, or the peer's start on the [`MemNetwork`]).
    fn route_with_session(&self, peer: &str) -> Option<(Route, u64)> {
        let r = match &self.backend {
            Backend::Ractor(r) => r,
            Backend::Mem { net, node } => {
                return net.route(node, peer).map(|to| {
                    let session = to.session();
                    (Route::Mem { from: Arc::clone(node), to }, session)
                })
            }
        };
        let ids = r.sessions.route_ids(peer);
        if ids.is_empty() {
            return None;
        }
        let members = ractor::pg::get_scoped_members(&PG_SCOPE.to_string(), &gateway_group(peer));
        ids.iter().find_map(|id| {
            members
                .iter()
                .find(|m| matches!(m.get_id(), ractor::ActorId::Remote { node_id, .. } if node_id == *id))
                .map(|m| (Route::Actor(ActorRef::from(m.clone())), *id))
        })
    }

    /// One request/response with a hard deadline; maps every ractor outcome to our errors
    /// (in memory, the exchange maps its outcomes to the same ones).
    async fn rpc(
        &self,
        route: &Route,
        node: &str,
        request: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        let gateway = match route {
            Route::Actor(gateway) => gateway,
            Route::Mem { from, to } => return to.exchange(from, request, timeout).await,
        };
        let timeout_err =
            || TransportError::Timeout { node: node.to_string(), timeout_ms: timeout.as_millis() as u64 };
        // ractor's own timeout covers the reply; the outer one also covers anything that
        // could block before it (nothing should, but a call must never hang).
        let call = gateway.call(|reply| GatewayMsg { request, reply }, Some(timeout));
        match tokio::time::timeout(timeout, call).await {
            Err(_) | Ok(Ok(CallResult::Timeout)) => Err(timeout_err()),
            Ok(Ok(CallResult::Success(bytes))) => Ok(bytes),
            // The reply port was dropped: the session died (remote) or the gateway stopped.
            Ok(Ok(CallResult::SenderError)) => Err(TransportError::Disconnected(node.to_string())),
            // The actor was already gone: nothing was sent.
            Ok(Err(_)) => Err(TransportError::Unreachable(node.to_string())),
        }
    }

    /// Pings `peer` once; also returns the session the ping went over, if any.
    async fn ping(&self, peer: &str) -> (PingOutcome, Option<u64>) {
        let Some((route, session)) = self.route_with_session(peer) else {
            return (PingOutcome::NoRoute, None);
        };
        (self.ping_over(peer, &route).await, Some(session))
    }

    async fn ping_over(&self, peer: &str, route: &Route) -> PingOutcome {
        let nonce = self.nonce.fetch_add(1, Ordering::Relaxed);
        let wire =
            WireRequest::Ping { from: self.cfg.node_id.clone(), fingerprint: self.cfg.fingerprint, nonce };
        match self.rpc(route, peer, encode_request(&wire), self.cfg.ping_timeout()).await {
            Ok(bytes) => match decode_reply(&bytes) {
                Ok(WireReply::Pong { node, fingerprint, nonce: n }) if n == nonce && node == peer => {
                    if fingerprint == self.cfg.fingerprint {
                        PingOutcome::Answered
                    } else {
                        PingOutcome::Refused { theirs: fingerprint }
                    }
                }
                Ok(WireReply::Refused(Refusal::FingerprintMismatch { ours, .. })) => {
                    PingOutcome::Refused { theirs: ours }
                }
                Ok(WireReply::Refused(refusal @ Refusal::ProtocolMismatch { .. })) => {
                    self.log_protocol_refusal(peer, &refusal.to_string());
                    PingOutcome::Missed
                }
                Ok(other) => {
                    tracing::debug!(node = %self.cfg.node_id, peer, "unusable answer to a ping: {other:?}");
                    PingOutcome::Missed
                }
                Err(e @ FrameError::Protocol(_)) => {
                    self.log_protocol_refusal(peer, &e.to_string());
                    PingOutcome::Missed
                }
                Err(e) => {
                    tracing::debug!(node = %self.cfg.node_id, peer, "undecodable pong: {e}");
                    PingOutcome::Missed
                }
            },
            Err(TransportError::Unreachable(_)) => PingOutcome::NoRoute,
            Err(_) => PingOutcome::Missed,
        }
    }

    /// Logs (rate-limited per peer) that `peer` speaks another node-to-node protocol; its
    /// pings count as missed, so it never becomes `Up`.
    fn log_protocol_refusal(&self, peer: &str, reason: &str) {
        let mut peers = self.lock_peers();
        let Some(entry) = peers.get_mut(peer) else { return };
        if let Some(suppressed) = entry.refusal_log.allow(unix_ms()) {
            tracing::error!(node = %self.cfg.node_id, peer, suppressed, "peer {peer} refused: {reason}");
        }
    }

    fn apply_ping(&self, peer: &str, outcome: PingOutcome, session: Option<u64>) {
        let misses_max = self.cfg.heartbeat_misses_max;
        let action = {
            let mut peers = self.lock_peers();
            let Some(entry) = peers.get_mut(peer) else { return };
            if session.is_some() && session != entry.last_session {
                entry.last_session = session;
                entry.health = on_new_session(entry.health);
            }
            let before = entry.health;
            let (after, action) = on_ping_result(before, outcome, unix_ms(), misses_max);
            entry.health = after;
            let node = &self.cfg.node_id;
            match (before.state, after.state, outcome) {
                (_, _, PingOutcome::Refused { theirs }) => {
                    if let Some(suppressed) = entry.refusal_log.allow(unix_ms()) {
                        tracing::error!(
                            node = %node, peer, ours = format_args!("{:#018x}", self.cfg.fingerprint),
                            theirs = format_args!("{theirs:#018x}"), suppressed,
                            "peer {peer} refused: cluster-config fingerprint mismatch (ours {:#018x}, theirs \
                             {theirs:#018x}); closing its session, it stays down until the configs agree",
                            self.cfg.fingerprint
                        );
                    }
                }
                (b, PeerState::Up, _) if b != PeerState::Up => {
                    entry.was_up = true;
                    entry.refusal_log.reset();
                    tracing::info!(node = %node, peer, "peer {peer} is up");
                }
                (PeerState::Up, PeerState::Suspect, _) => {
                    tracing::warn!(node = %node, peer, "peer {peer} missed a heartbeat; suspect");
                }
                (PeerState::Up | PeerState::Suspect, PeerState::Down, PingOutcome::Missed) => tracing::warn!(
                    node = %node, peer,
                    "peer {peer} missed {misses_max} heartbeats in a row; down, closing its session \
                     (detection bound {} ms)",
                    self.cfg.detection_bound().as_millis()
                ),
                (PeerState::Up | PeerState::Suspect, PeerState::Down, _) => {
                    tracing::warn!(node = %node, peer, "peer {peer} is down: its session closed");
                }
                (PeerState::Down, PeerState::Down, PingOutcome::Missed)
                    if action == HealthAction::TearDown =>
                {
                    tracing::debug!(node = %node, peer, "session to {peer} never answered; closing it again");
                }
                _ => {}
            }
            action
        };
        match action {
            HealthAction::Nothing => {}
            HealthAction::Publish => self.publish(),
            HealthAction::TearDown => {
                match &self.backend {
                    Backend::Ractor(r) => {
                        r.sessions.stop_peer(peer, "heartbeat failure detector");
                    }
                    // Nothing to stop in memory: forget the session, so the next answered
                    // ping counts as a new one, as after a redial.
                    Backend::Mem { .. } => {
                        if let Some(entry) = self.lock_peers().get_mut(peer) {
                            entry.last_session = None;
                        }
                    }
                }
                self.publish();
            }
        }
    }

    /// Pings `peer` once per heartbeat, forever; pings to different peers run concurrently.
    async fn heartbeat_loop(self: Arc<Self>, peer: String) {
        let mut tick = tokio::time::interval(self.cfg.ping_timeout());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (outcome, session) = self.ping(&peer).await;
            self.apply_ping(&peer, outcome, session);
        }
    }

    /// Keeps one session to `peer` (which has a larger name than ours): dial when there is
    /// none, kill the dial if it does not authenticate within the handshake timeout, back off
    /// between failures; a session that never got the peer `Up` (wrong secret, refused
    /// fingerprint, mute peer) counts as a failure.
    async fn connector_loop(self: Arc<Self>, peer: String) {
        let Some(addr) = self.cfg.peers.get(&peer).copied() else { return };
        let Some(Ractor { sessions, server, .. }) = self.ractor() else { return };
        let backoff = Backoff::for_pair(
            self.cfg.reconnect_backoff_min_ms,
            self.cfg.reconnect_backoff_max_ms,
            &self.cfg.node_id,
            &peer,
        );
        let handshake_timeout = self.cfg.handshake_timeout();
        let recheck = self.cfg.ping_timeout();
        let mut changes = sessions.watch();
        // Separate limiters: "cannot connect" and "handshake failed" point at different causes.
        let mut connect_log = LogLimiter::new(RECONNECT_LOG_INTERVAL_MS);
        let mut handshake_log = LogLimiter::new(RECONNECT_LOG_INTERVAL_MS);
        let mut failures: u32 = 0;
        let mut seq: u64 = 0;
        let mut had_session = false;
        loop {
            // Wait while a session exists (ours or one the peer opened).
            while sessions.has_session(&peer) {
                let _ = tokio::time::timeout(recheck, changes.changed()).await;
            }
            // A session that ended without ever getting the peer up (refused fingerprint, mute
            // peer) is a failure too, so such a peer is redialed at the backoff pace.
            let was_up = self.lock_peers().get_mut(&peer).is_some_and(|e| std::mem::take(&mut e.was_up));
            if was_up {
                failures = 0;
                connect_log.reset();
                handshake_log.reset();
            } else if had_session {
                failures = failures.saturating_add(1);
            }
            had_session = false;
            if failures > 0 {
                let delay_ms = backoff.delay_ms(failures - 1);
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                if sessions.has_session(&peer) {
                    continue;
                }
            }
            seq += 1;
            let label = dial_label(&peer, seq);
            let dialed = match tokio::time::timeout(handshake_timeout, self.dial(&peer, addr, &label)).await {
                Ok(Ok(stream)) => {
                    ractor_cluster::client_connect_external(server, stream).await.map_err(|e| e.to_string())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(format!("connect timed out after {} ms", handshake_timeout.as_millis())),
            };
            if let Err(reason) = dialed {
                failures = failures.saturating_add(1);
                if let Some(suppressed) = connect_log.allow(unix_ms()) {
                    tracing::warn!(
                        node = %self.cfg.node_id, peer = %peer, %addr, attempt = failures, suppressed,
                        "cannot reach {peer} at {addr}: {reason}; retrying with backoff"
                    );
                }
                continue;
            }
            tracing::debug!(node = %self.cfg.node_id, peer = %peer, %addr, "dialed {peer}, handshaking");
            let deadline = tokio::time::Instant::now() + handshake_timeout;
            let outcome = loop {
                match sessions.dial_state(&peer, &label) {
                    DialState::Pending => {}
                    done => break done,
                }
                if tokio::time::timeout_at(deadline, changes.changed()).await.is_err() {
                    sessions.stop_dial(&label);
                    break DialState::Pending;
                }
            };
            if outcome == DialState::Authenticated {
                had_session = true;
            } else {
                failures = failures.saturating_add(1);
                if let Some(suppressed) = handshake_log.allow(unix_ms()) {
                    tracing::warn!(
                        node = %self.cfg.node_id, peer = %peer, %addr, attempt = failures, suppressed,
                        "handshake with {peer} at {addr} {} (wrong secret, paused peer, or lost election); \
                         retrying with backoff",
                        if outcome == DialState::Pending { "timed out" } else { "failed" }
                    );
                }
            }
        }
    }

    /// A connected stream to `peer` at `addr`, labelled `label`: TCP, with a TLS
    /// handshake on it when TLS is on (the peer's certificate must be signed by the
    /// cluster CA and name the node id `peer`).
    async fn dial(
        &self,
        peer: &str,
        addr: SocketAddr,
        label: &str,
    ) -> Result<Box<dyn ClusterBidiStream>, String> {
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        let label = label.to_string();
        match &self.cfg.tls {
            None => Ok(Box::new(LabelledTcp { stream, label })),
            Some(tls) => {
                let name = tally_tls::node_server_name(peer).map_err(|e| e.to_string())?;
                let stream = tls
                    .connector()
                    .connect(name, stream)
                    .await
                    .map_err(|e| format!("TLS handshake failed: {e}"))?;
                Ok(Box::new(Labelled { stream, label }))
            }
        }
    }

    /// Hands every inbound connection whose TLS handshake succeeded (its client
    /// certificate is signed by the cluster CA) to the NodeServer, which then runs
    /// the secret handshake on it as on any inbound session. Refused handshakes are
    /// logged by [`TlsIncoming`].
    async fn tls_accept_loop(self: Arc<Self>, mut incoming: TlsIncoming) {
        let Some(Ractor { server, .. }) = self.ractor() else { return };
        while let Some((stream, peer)) = incoming.next().await {
            tracing::debug!(node = %self.cfg.node_id, %peer, "inbound TLS session, handshaking");
            let stream = Box::new(Labelled { stream, label: peer.to_string() });
            if server.cast(NodeServerMessage::ConnectionOpenedExternal { stream, is_server: true }).is_err() {
                return;
            }
        }
    }

    /// Once per heartbeat: session housekeeping, plus a reconciliation with the NodeServer's
    /// own list in case a session event was missed.
    async fn sweep_loop(self: Arc<Self>) {
        let Some(Ractor { sessions, server, .. }) = self.ractor() else { return };
        let period = self.cfg.ping_timeout();
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            sessions.sweep(self.cfg.handshake_timeout(), Duration::from_millis(SESSION_STOP_GRACE_MS));
            if let Ok(CallResult::Success(list)) =
                server.call(NodeServerMessage::GetSessions, Some(period)).await
            {
                sessions.reconcile(list.into_values());
            }
        }
    }
}

/// A dialed TCP stream with the label ractor_cluster will report as the session's peer
/// address, so the connector can match its dial to the session it becomes.
struct LabelledTcp {
    stream: TcpStream,
    label: String,
}

impl ClusterBidiStream for LabelledTcp {
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        let (read, write) = self.stream.into_split();
        (Box::new(read), Box::new(write))
    }

    fn peer_label(&self) -> Option<String> {
        Some(self.label.clone())
    }
}

/// A TLS stream with the label ractor_cluster reports as the session's peer address
/// (the dial label for outbound sessions, the peer's address for inbound ones).
struct Labelled<S> {
    stream: S,
    label: String,
}

impl<S> ClusterBidiStream for Labelled<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        let (read, write) = tokio::io::split(self.stream);
        (Box::new(read), Box::new(write))
    }

    fn peer_label(&self) -> Option<String> {
        Some(self.label.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::sample;

    struct Echo;

    impl Handler for Echo {
        async fn handle(&self, from: &str, request: Vec<u8>) -> Vec<u8> {
            [from.as_bytes(), b":", &request].concat()
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// The only test in this binary that starts a transport: one process hosts one node.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn single_node_lifecycle() {
        let mut cfg = sample();
        cfg.listen.set_port(free_port());
        let dead_peer_port = free_port();
        cfg.peers = [("node2".to_string(), SocketAddr::from(([127, 0, 0, 1], dead_peer_port)))].into();
        let t = Transport::start(cfg.clone(), Arc::new(Echo)).await.expect("start");

        // One per process.
        let again = Transport::start(cfg.clone(), Arc::new(Echo)).await;
        assert_eq!(again.err(), Some(TransportError::AlreadyRunning));

        // Self-calls go through the local gateway.
        let second = Duration::from_secs(1);
        assert_eq!(t.call("node1", b"hi".to_vec(), second).await, Ok(b"node1:hi".to_vec()));
        // A peer that never came up fails fast; strangers and oversized requests are refused.
        let started = std::time::Instant::now();
        assert_eq!(t.call("node2", vec![], second).await, Err(TransportError::Unreachable("node2".into())));
        assert!(started.elapsed() < Duration::from_millis(100));
        assert_eq!(t.call("nobody", vec![], second).await, Err(TransportError::UnknownNode("nobody".into())));
        assert!(matches!(
            t.call("node1", vec![0; REQUEST_BYTES_MAX + 1], second).await,
            Err(TransportError::TooLarge { what: "request", .. })
        ));
        let peers = t.peers();
        assert_eq!(peers.len(), 1);
        assert_eq!(
            (peers[0].node.as_str(), peers[0].state, peers[0].last_seen_ms),
            ("node2", PeerState::Down, None)
        );
        assert_eq!(t.detection_bound(), Duration::from_millis(800));
        assert_eq!(t.default_call_timeout(), Duration::from_millis(1_000));

        // ractor_cluster never times out a handshake; the sweep closes a connection that
        // stays silent for longer than the handshake timeout.
        let mut silent = tokio::net::TcpStream::connect(cfg.listen).await.expect("connect");
        let closed = tokio::time::timeout(Duration::from_secs(5), async {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 64];
            loop {
                match silent.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a silent inbound connection was kept open");

        t.shutdown().await;
        t.shutdown().await; // idempotent
        assert_eq!(t.call("node1", vec![], second).await, Err(TransportError::ShutDown));

        // The slot and the port are free again.
        let t2 = Transport::start(cfg.clone(), Arc::new(Echo)).await.expect("restart after shutdown");
        assert_eq!(t2.call("node1", b"x".to_vec(), second).await, Ok(b"node1:x".to_vec()));
        t2.shutdown().await;

        // A port that is taken is a clear error, and frees the slot.
        let blocker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        cfg.listen = blocker.local_addr().unwrap();
        assert!(matches!(
            Transport::start(cfg.clone(), Arc::new(Echo)).await,
            Err(TransportError::Listen { .. })
        ));
        cfg.listen.set_port(free_port());
        Transport::start(cfg, Arc::new(Echo)).await.expect("start after a failed start").shutdown().await;
    }
}
