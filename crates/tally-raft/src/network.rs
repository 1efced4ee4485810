//! The client side of raft's RPCs: HTTP/JSON POSTs to the peer's raft address,
//! over mutual TLS when the node has a cluster CA ([`PeerClient`]), or through an
//! in-memory network ([`crate::mem_net`]) that runs the same requests through the
//! peer's router without a socket.
//!
//! Every call has a timeout (openraft's per-RPC TTL, clamped to
//! [`RPC_TIMEOUT_MIN_MS`]..=[`RPC_TIMEOUT_MAX_MS`]) and a bounded answer size. A peer
//! that refuses the connection is reported as `RPCError::Unreachable`, so openraft
//! backs off before retrying; any other transport failure (timeout, reset, bad
//! status, undecodable answer) is `RPCError::Network`; an error raised by the peer's
//! raft is `RPCError::RemoteError`.
//!
//! Every RPC travels in a [`Guarded`] envelope naming the sender's store incarnation
//! and the one the sender has recorded for the target. A peer that refuses the
//! envelope (its disk was replaced, or it knows the sender under another store) is
//! reported as `RPCError::Unreachable`: raft treats the node as absent, never as a
//! voter whose log contradicts what it acknowledged.

use crate::auth::RaftSecret;
use crate::rpc::{PATH_APPEND, PATH_SNAPSHOT, PATH_VOTE};
use crate::state_machine::{Applied, Shared};
use crate::store_id::StoreId;
use crate::types::{NodeId, StoreRecord, TypeConfig};
use axum::http;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RaftNetwork, RaftNetworkFactory};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Shortest timeout of one RPC, in milliseconds: openraft's TTL for heartbeats can
/// be shorter than a loaded 2-core machine needs to answer.
pub const RPC_TIMEOUT_MIN_MS: u64 = 100;
/// Longest timeout of one RPC, in milliseconds.
pub const RPC_TIMEOUT_MAX_MS: u64 = 30_000;
/// Timeout of establishing a TCP connection to a peer, in milliseconds.
pub const CONNECT_TIMEOUT_MS: u64 = 500;
/// How long an idle pooled connection to a peer is kept, in milliseconds.
pub const POOL_IDLE_MS: u64 = 10_000;
/// Largest answer accepted from a peer, in bytes. Answers are small (a vote, an
/// append result, a forwarded write's reply); this only bounds a misbehaving peer.
pub const ANSWER_BYTES_MAX: usize = 16 << 20;
/// Pause before retrying a peer that refused the connection, in milliseconds.
pub const UNREACHABLE_BACKOFF_MS: u64 = 250;

/// Longest refusal reason read from a peer, in bytes.
pub const REFUSAL_BYTES_MAX: usize = 4096;

/// A raft RPC with the incarnations it is meant for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Guarded<T> {
    /// The sender's raft id.
    pub from: NodeId,
    /// The sender's store incarnation.
    pub from_store: StoreId,
    /// The incarnation the sender has recorded for the target (`None`: none yet).
    pub to_store: Option<StoreId>,
    /// The index of the last log entry the sender applied, if its applied state
    /// records the sender's own current store (`None`: the sender has not rejoined
    /// with this store yet, or knows nothing). A receiver whose record of the
    /// sender differs but which applied less than this is behind, not the sender.
    #[serde(default)]
    pub from_applied: Option<u64>,
    /// The openraft request.
    pub rpc: T,
}

/// Why a node refuses a raft RPC: the two ends disagree about who is who.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IncarnationError {
    /// The sender expected another incarnation of this node: this node's disk was
    /// replaced, and it must rejoin as a new incarnation.
    #[error("this node runs store {own}, not the expected {expected}: its disk was replaced; it rejoins as a new incarnation")]
    NotThisStore {
        /// This node's store.
        own: StoreId,
        /// What the sender expected.
        expected: StoreId,
    },
    /// The sender runs on another store than the one recorded for it: its disk was
    /// replaced and it has not rejoined yet.
    #[error("node {node} sent from store {got} but is recorded with store {recorded}: it must rejoin as a new incarnation")]
    SenderReplaced {
        /// The sender.
        node: NodeId,
        /// Its recorded store.
        recorded: StoreId,
        /// The store it sent from.
        got: StoreId,
    },
}

/// Checks an RPC's incarnations against this node's store `own` and the records it
/// has applied (`stores`, up to log index `applied`). A missing record or
/// expectation lets the RPC through: nodes register their store once a leader is
/// known.
///
/// A sender whose store differs from the one recorded here is refused unless it
/// has applied the record of its own store ([`Guarded::from_applied`]) at a log
/// index past what this node applied: then the record committed and this node,
/// not the sender, is behind (an emptied node replaying the log meets a leader's
/// earlier incarnation before the entry that replaced it, and must take that
/// leader's appends to ever reach it).
pub fn check_incarnation<T>(
    own: StoreId,
    applied: Option<u64>,
    stores: &BTreeMap<NodeId, StoreRecord>,
    rpc: &Guarded<T>,
) -> Result<(), IncarnationError> {
    if let Some(expected) = rpc.to_store.filter(|e| *e != own) {
        return Err(IncarnationError::NotThisStore { own, expected });
    }
    match stores.get(&rpc.from) {
        Some(r) if r.store != rpc.from_store => {
            let behind = matches!(rpc.from_applied, Some(theirs) if applied.is_none_or(|ours| ours < theirs));
            if behind {
                Ok(())
            } else {
                Err(IncarnationError::SenderReplaced {
                    node: rpc.from,
                    recorded: r.store,
                    got: rpc.from_store,
                })
            }
        }
        _ => Ok(()),
    }
}

/// What a sender states in [`Guarded::from_applied`]: its last applied index if its
/// applied records hold its own current store.
pub fn own_applied(me: NodeId, store: StoreId, applied: &Applied) -> Option<u64> {
    let recorded = applied.state.stores.get(&me).is_some_and(|r| r.store == store);
    recorded.then(|| applied.last_applied.map_or(0, |l| l.index))
}

/// Why an HTTP call to a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No connection could be made: the peer is down or not listening yet. The
    /// request was not delivered.
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The peer's address.
        addr: String,
        /// The transport's explanation.
        reason: String,
    },
    /// The peer refused the request without handing it to raft: the two nodes
    /// disagree about a store incarnation ([`IncarnationError`]), the raft protocol
    /// version, or the cluster secret.
    #[error("{addr} refused the call: {reason}")]
    Refused {
        /// The peer's address.
        addr: String,
        /// The peer's explanation.
        reason: String,
    },
    /// The request may or may not have been delivered: a timeout, a reset, an
    /// error status or an undecodable answer.
    #[error("call to {addr}{path} failed: {reason}")]
    Failed {
        /// The peer's address.
        addr: String,
        /// The endpoint.
        path: &'static str,
        /// What went wrong.
        reason: String,
    },
}

pub(crate) use crate::error::Transport;

/// The HTTP client shared by the raft network and request forwarding, with the
/// scheme it speaks.
#[derive(Clone, Debug)]
pub struct PeerClient {
    backend: Backend,
    scheme: &'static str,
    secret: Option<Arc<RaftSecret>>,
    /// With TLS: the node id at each address, which URLs name (and the client
    /// resolves back to the address) so that the peer's certificate is checked
    /// against the node dialed.
    names: Arc<std::collections::HashMap<String, String>>,
}

/// What carries a [`PeerClient`]'s requests: sockets, or an in-memory network.
#[derive(Clone, Debug)]
enum Backend {
    Http(reqwest::Client),
    Mem(crate::mem_net::MemEnd),
}

impl PeerClient {
    /// A client whose calls go through `end`'s in-memory network, in plaintext,
    /// each carrying its proof of `secret` as over a socket.
    pub(crate) fn in_memory(end: crate::mem_net::MemEnd, secret: Option<Arc<RaftSecret>>) -> Self {
        PeerClient { backend: Backend::Mem(end), scheme: "http", secret, names: Default::default() }
    }

    /// The request [`post_json`] sends to `path` at `addr` with the JSON `body`:
    /// the raft protocol header, the content type and, in plaintext with a secret,
    /// the proof bound to this one request (TLS: the certificate proves us).
    fn request(
        &self,
        addr: &str,
        path: &'static str,
        body: Vec<u8>,
    ) -> Result<http::Request<Vec<u8>>, String> {
        let host = self.names.get(addr).map_or(addr, String::as_str);
        let mut request = http::Request::post(format!("{}://{host}{path}", self.scheme))
            .header(crate::rpc::PROTOCOL_HEADER, tally_core::format::RAFT_PROTOCOL.to_string())
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(secret) = &self.secret {
            request =
                request.header(crate::auth::AUTH_HEADER, secret.sign(path, &body, crate::auth::unix_ms()));
        }
        request.body(body).map_err(|e| format!("cannot build the request: {e}"))
    }
}

/// Builds the HTTP client shared by the raft network and request forwarding.
/// With `tls`, it speaks `https://` only, trusts only the cluster CA, checks that
/// the peer's certificate names the node it dials (URLs name the node id, which
/// the client resolves to the node's address) and presents this node's
/// certificate, which is what proves this node to the peer. Without TLS, with
/// `secret`, every call carries its proof ([`crate::auth::AUTH_HEADER`]).
pub fn http_client(
    tls: Option<&tally_tls::ClusterTls>,
    secret: Option<Arc<RaftSecret>>,
) -> Result<PeerClient, reqwest::Error> {
    let builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
        .timeout(Duration::from_millis(RPC_TIMEOUT_MAX_MS))
        .pool_idle_timeout(Duration::from_millis(POOL_IDLE_MS))
        .no_proxy();
    Ok(match tls {
        Some(tls) => {
            let mut names = std::collections::HashMap::new();
            let mut builder = builder.https_only(true).tls_backend_preconfigured(tls.client_config());
            // A node's first address is its raft address (`tally_tls::NodeNames`).
            for (id, addrs) in tls.nodes() {
                if let Some(raft) = addrs.first() {
                    names.insert(raft.to_string(), format!("{id}:{}", raft.port()));
                    builder = builder.resolve(id, *raft);
                }
            }
            let http = Backend::Http(builder.build()?);
            PeerClient { backend: http, scheme: "https", secret: None, names: Arc::new(names) }
        }
        None => {
            let http = Backend::Http(builder.build()?);
            PeerClient { backend: http, scheme: "http", secret, names: Default::default() }
        }
    })
}

/// Sends `request` with reqwest, within `timeout`.
async fn send_http(
    http: &reqwest::Client,
    request: http::Request<Vec<u8>>,
    timeout: Duration,
) -> Result<http::Response<axum::body::Body>, Transport> {
    let mut request = reqwest::Request::try_from(request).map_err(|e| Transport::Failed(e.to_string()))?;
    *request.timeout_mut() = Some(timeout);
    let resp = http.execute(request).await.map_err(|e| {
        if e.is_connect() {
            Transport::Connect(e.to_string())
        } else {
            Transport::Failed(e.to_string())
        }
    })?;
    Ok(http::Response::<reqwest::Body>::from(resp).map(axum::body::Body::new))
}

/// The body of `resp`, or why it cannot be had: longer than [`ANSWER_BYTES_MAX`],
/// or broken off.
async fn read_body(resp: http::Response<axum::body::Body>) -> Result<Vec<u8>, String> {
    use futures::StreamExt;
    let too_long = || format!("answer longer than {ANSWER_BYTES_MAX} bytes");
    let body = resp.into_body();
    if axum::body::HttpBody::size_hint(&body).exact().is_some_and(|n| n > ANSWER_BYTES_MAX as u64) {
        return Err(too_long());
    }
    let mut chunks = body.into_data_stream();
    let mut bytes = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if bytes.len() + chunk.len() > ANSWER_BYTES_MAX {
            return Err(too_long());
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// POSTs `body` as JSON to `{scheme}://{addr}{path}` and decodes a JSON answer of
/// at most [`ANSWER_BYTES_MAX`] bytes, all within `timeout`. Over a socket or
/// through an in-memory network ([`crate::mem_net`]), the request is built and the
/// answer judged the same way: 409 and 401 are refusals ([`CallError::Refused`]),
/// any other status but success a failure.
pub(crate) async fn post_json<Req: Serialize, Resp: DeserializeOwned>(
    client: &PeerClient,
    addr: &str,
    path: &'static str,
    body: &Req,
    timeout: Duration,
) -> Result<Resp, CallError> {
    let failed = |reason: String| CallError::Failed { addr: addr.to_owned(), path, reason };
    let call = async {
        let bytes =
            serde_json::to_vec(body).map_err(|e| failed(format!("cannot encode the request: {e}")))?;
        let request = client.request(addr, path, bytes).map_err(failed)?;
        let sent = match &client.backend {
            Backend::Http(http) => send_http(http, request, timeout).await,
            Backend::Mem(end) => end.send(addr, request.map(axum::body::Body::from)).await,
        };
        let resp = sent.map_err(|e| match e {
            Transport::Connect(reason) => CallError::Connect { addr: addr.to_owned(), reason },
            Transport::Failed(reason) => failed(reason),
        })?;
        let status = resp.status();
        if status == http::StatusCode::CONFLICT || status == http::StatusCode::UNAUTHORIZED {
            let text = read_body(resp).await.unwrap_or_default();
            let reason = String::from_utf8_lossy(&text).chars().take(REFUSAL_BYTES_MAX).collect();
            return Err(CallError::Refused { addr: addr.to_owned(), reason });
        }
        if !status.is_success() {
            return Err(failed(format!("status {status}")));
        }
        let bytes = read_body(resp).await.map_err(failed)?;
        serde_json::from_slice(&bytes).map_err(|e| failed(format!("undecodable answer: {e}")))
    };
    // reqwest's timeout covers the body too, but keep one deadline for the whole call.
    match tokio::time::timeout(timeout, call).await {
        Ok(r) => r,
        Err(_) => Err(failed(format!("no answer within {} ms", timeout.as_millis()))),
    }
}

/// Creates [`HttpNetwork`] clients for openraft, one per peer, sharing one HTTP
/// connection pool.
#[derive(Clone)]
pub struct HttpNetworkFactory {
    client: PeerClient,
    me: NodeId,
    store: StoreId,
    shared: Arc<Shared>,
}

impl HttpNetworkFactory {
    /// A factory whose clients use `client` (see [`http_client`]) and send as node
    /// `me` on store `store`, expecting the targets' stores recorded in `shared`.
    pub fn new(client: PeerClient, me: NodeId, store: StoreId, shared: Arc<Shared>) -> Self {
        Self { client, me, store, shared }
    }
}

impl RaftNetworkFactory<TypeConfig> for HttpNetworkFactory {
    type Network = HttpNetwork;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> HttpNetwork {
        HttpNetwork { factory: self.clone(), target, node: node.clone() }
    }
}

/// openraft's connection to one peer: POSTs to the peer's `/raft/*` endpoints.
pub struct HttpNetwork {
    factory: HttpNetworkFactory,
    target: NodeId,
    node: BasicNode,
}

impl HttpNetwork {
    async fn call<Req, Resp, E>(
        &self,
        path: &'static str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let timeout_ms = (option.hard_ttl().as_millis() as u64).clamp(RPC_TIMEOUT_MIN_MS, RPC_TIMEOUT_MAX_MS);
        let f = &self.factory;
        let (to_store, from_applied) = {
            let applied = f.shared.read();
            (applied.state.stores.get(&self.target).map(|r| r.store), own_applied(f.me, f.store, &applied))
        };
        let envelope = Guarded { from: f.me, from_store: f.store, to_store, from_applied, rpc: req };
        let answer: Result<Resp, RaftError<NodeId, E>> =
            post_json(&f.client, &self.node.addr, path, &envelope, Duration::from_millis(timeout_ms))
                .await
                .map_err(|e| match e {
                CallError::Refused { .. } => {
                    tracing::debug!(target = self.target, error = %e, "raft RPC refused");
                    RPCError::Unreachable(Unreachable::new(&e))
                }
                CallError::Connect { .. } => RPCError::Unreachable(Unreachable::new(&e)),
                CallError::Failed { .. } => RPCError::Network(NetworkError::new(&e)),
            })?;
        answer
            .map_err(|e| RPCError::RemoteError(RemoteError::new_with_node(self.target, self.node.clone(), e)))
    }
}

impl RaftNetwork<TypeConfig> for HttpNetwork {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(PATH_APPEND, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call(PATH_SNAPSHOT, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(PATH_VOTE, &rpc, &option).await
    }

    fn backoff(&self) -> openraft::network::Backoff {
        openraft::network::Backoff::new(std::iter::repeat(Duration::from_millis(UNREACHABLE_BACKOFF_MS)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rpc(from: NodeId, from_store: u128, to_store: Option<u128>) -> Guarded<()> {
        Guarded {
            from,
            from_store: StoreId(from_store),
            to_store: to_store.map(StoreId),
            from_applied: None,
            rpc: (),
        }
    }

    fn stores() -> BTreeMap<NodeId, StoreRecord> {
        [
            (1, StoreRecord { store: StoreId(10), data_lost: false }),
            (3, StoreRecord { store: StoreId(30), data_lost: false }),
        ]
        .into()
    }

    #[test]
    fn the_guard_refuses_a_replaced_receiver_and_a_replaced_sender() {
        let (own, stores, at) = (StoreId(30), stores(), Some(500));
        // Agreeing ends, and ends that have not registered yet, pass.
        assert_eq!(check_incarnation(own, at, &stores, &rpc(1, 10, Some(30))), Ok(()));
        assert_eq!(check_incarnation(own, at, &stores, &rpc(1, 10, None)), Ok(()));
        assert_eq!(check_incarnation(own, at, &stores, &rpc(2, 99, Some(30))), Ok(()));
        assert_eq!(check_incarnation(own, None, &BTreeMap::new(), &rpc(1, 11, None)), Ok(()));
        // The leader expects this node's old disk.
        assert_eq!(
            check_incarnation(StoreId(31), at, &stores, &rpc(1, 10, Some(30))),
            Err(IncarnationError::NotThisStore { own: StoreId(31), expected: StoreId(30) })
        );
        // A sender with a new disk under its old id, which has not rejoined with it.
        let replaced = IncarnationError::SenderReplaced { node: 1, recorded: StoreId(10), got: StoreId(12) };
        assert_eq!(check_incarnation(own, at, &stores, &rpc(1, 12, Some(30))), Err(replaced.clone()));
        // A sender that claims a record of its store this node already applied past:
        // this node's record is the newer one, the sender a stale incarnation.
        let stale = Guarded { from_applied: Some(400), ..rpc(1, 12, Some(30)) };
        assert_eq!(check_incarnation(own, at, &stores, &stale), Err(replaced.clone()));
        let even = Guarded { from_applied: Some(500), ..rpc(1, 12, Some(30)) };
        assert_eq!(check_incarnation(own, at, &stores, &even), Err(replaced));
    }

    #[test]
    fn a_receiver_behind_the_record_of_the_senders_new_store_takes_its_rpcs() {
        // An emptied node replaying the log has applied the leader's first store
        // record (10) but not yet the one of its replaced disk (12), which the
        // leader applied by index 900.
        let (own, stores) = (StoreId(30), stores());
        let leader = Guarded { from_applied: Some(900), ..rpc(1, 12, Some(30)) };
        assert_eq!(check_incarnation(own, Some(350), &stores, &leader), Ok(()));
        assert_eq!(check_incarnation(own, None, &stores, &leader), Ok(()));
    }

    #[test]
    fn a_sender_states_an_applied_index_only_once_its_own_store_is_recorded() {
        let mut applied = Applied {
            state: crate::state::MetaState::default(),
            last_applied: None,
            membership: Default::default(),
        };
        assert_eq!(own_applied(1, StoreId(12), &applied), None);
        applied.state.stores = stores();
        assert_eq!(own_applied(1, StoreId(12), &applied), None);
        assert_eq!(own_applied(1, StoreId(10), &applied), Some(0));
        applied.last_applied = Some(openraft::LogId::new(openraft::CommittedLeaderId::new(3, 1), 77));
        assert_eq!(own_applied(1, StoreId(10), &applied), Some(77));
    }
}
