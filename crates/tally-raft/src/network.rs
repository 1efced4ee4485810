//! The client side of raft's RPCs: HTTP/JSON POSTs to the peer's raft address.
//!
//! Every call has a timeout (openraft's per-RPC TTL, clamped to
//! [`RPC_TIMEOUT_MIN_MS`]..=[`RPC_TIMEOUT_MAX_MS`]) and a bounded answer size. A peer
//! that refuses the connection is reported as `RPCError::Unreachable`, so openraft
//! backs off before retrying; any other transport failure (timeout, reset, bad
//! status, undecodable answer) is `RPCError::Network`; an error raised by the peer's
//! raft is `RPCError::RemoteError`.

use crate::server::{PATH_APPEND, PATH_SNAPSHOT, PATH_VOTE};
use crate::types::{NodeId, TypeConfig};
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RaftNetwork, RaftNetworkFactory};
use serde::{de::DeserializeOwned, Serialize};
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

/// Why an HTTP call to a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No connection could be made: the peer is down or not listening yet. The
    /// request was not delivered.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The peer's address.
        addr: String,
        /// The client's error.
        source: reqwest::Error,
    },
    /// The request may or may not have been delivered: a timeout, a reset, an
    /// error status or an undecodable answer.
    #[error("call to http://{addr}{path} failed: {reason}")]
    Failed {
        /// The peer's address.
        addr: String,
        /// The endpoint.
        path: &'static str,
        /// What went wrong.
        reason: String,
    },
}

/// Builds the HTTP client shared by the raft network and request forwarding.
pub fn http_client() -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
        .timeout(Duration::from_millis(RPC_TIMEOUT_MAX_MS))
        .pool_idle_timeout(Duration::from_millis(POOL_IDLE_MS))
        .build()
}

/// POSTs `body` as JSON to `http://{addr}{path}` and decodes a JSON answer of at
/// most [`ANSWER_BYTES_MAX`] bytes, all within `timeout`.
pub(crate) async fn post_json<Req: Serialize, Resp: DeserializeOwned>(
    client: &reqwest::Client,
    addr: &str,
    path: &'static str,
    body: &Req,
    timeout: Duration,
) -> Result<Resp, CallError> {
    let failed = |reason: String| CallError::Failed { addr: addr.to_owned(), path, reason };
    let url = format!("http://{addr}{path}");
    let call = async {
        let mut resp = client.post(url).json(body).timeout(timeout).send().await.map_err(|e| {
            if e.is_connect() {
                CallError::Connect { addr: addr.to_owned(), source: e }
            } else {
                failed(e.to_string())
            }
        })?;
        if !resp.status().is_success() {
            return Err(failed(format!("status {}", resp.status())));
        }
        if resp.content_length().is_some_and(|n| n > ANSWER_BYTES_MAX as u64) {
            return Err(failed(format!("answer longer than {ANSWER_BYTES_MAX} bytes")));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| failed(e.to_string()))? {
            if bytes.len() + chunk.len() > ANSWER_BYTES_MAX {
                return Err(failed(format!("answer longer than {ANSWER_BYTES_MAX} bytes")));
            }
            bytes.extend_from_slice(&chunk);
        }
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
    client: reqwest::Client,
}

impl HttpNetworkFactory {
    /// A factory whose clients use `client` (see [`http_client`]).
    pub fn new(client: reqwest::Client) -> Self {
        Self { client }
    }
}

impl RaftNetworkFactory<TypeConfig> for HttpNetworkFactory {
    type Network = HttpNetwork;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> HttpNetwork {
        HttpNetwork { client: self.client.clone(), target, node: node.clone() }
    }
}

/// openraft's connection to one peer: POSTs to the peer's `/raft/*` endpoints.
pub struct HttpNetwork {
    client: reqwest::Client,
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
        let answer: Result<Resp, RaftError<NodeId, E>> =
            post_json(&self.client, &self.node.addr, path, req, Duration::from_millis(timeout_ms))
                .await
                .map_err(|e| match e {
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
