//! The server side: the internal HTTP endpoints every node serves on its raft
//! address. Bodies and answers are JSON; an answer is the serialized
//! `Result<_, openraft::error::RaftError<..>>` of the local raft call, so the caller
//! sees exactly the error the peer's raft raised.
//!
//! | path | body → answer |
//! | --- | --- |
//! | `POST /raft/append` | `Guarded<AppendEntriesRequest>` → `Result<AppendEntriesResponse, RaftError>` |
//! | `POST /raft/vote` | `Guarded<VoteRequest>` → `Result<VoteResponse, RaftError>` |
//! | `POST /raft/snapshot` | one chunk, `Guarded<InstallSnapshotRequest>` → `Result<InstallSnapshotResponse, RaftError<InstallSnapshotError>>` |
//! | `POST /raft/identity` | `{}` → [`IdentityAnswer`]: who this node is and what it has applied (startup probes, readiness) |
//! | `POST /raft/replace` | [`ReplaceRequest`] → `Result<(), String>`: on the leader, re-add a node whose disk was replaced (see `replace.rs`) |
//! | `POST /raft/client-write` | [`Request`] → `Result<ClientWriteResponse, RaftError<ClientWriteError>>` (no further forwarding) |
//! | `POST /raft/read` | [`ReadRequest`] → `Result<Option<CounterMeta>, RaftError<CheckIsLeaderError>>` (a linearizable read on this node) |
//!
//! Every RPC carries the sender's raft protocol version in the
//! `tally-raft-protocol` header; another version, or none, is refused with 409 and
//! both versions named before the body is read. Then it must prove the cluster
//! secret ([`crate::auth`], the `tally-raft-auth` header): without the proof, or
//! with another cluster's, it is refused with 401 and audited before its body is
//! read or raft sees it.
//!
//! A body that does not decode is refused by axum with a 4xx status before it
//! reaches raft; bodies are bounded by [`RAFT_BODY_BYTES_MAX`]. An RPC whose
//! envelope names another incarnation of this node, or comes from a node recorded
//! with another store ([`crate::network::check_incarnation`]), is refused with 409
//! and the reason as text, before raft sees it.

use crate::auth::RaftSecret;
use crate::network::{check_incarnation, Guarded};
pub use crate::rpc::{
    IdentityAnswer, ReplaceRequest, PATH_APPEND, PATH_CLIENT_WRITE, PATH_IDENTITY, PATH_READ, PATH_REPLACE,
    PATH_SNAPSHOT, PATH_VOTE,
};
use crate::state_machine::Shared;
use crate::store_id::StoreId;
use crate::types::{NodeId, Raft, Request, TypeConfig};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tally_core::name::CounterName;

/// How long the leader works on one replacement (removing the old incarnation,
/// catching the new one up as a learner, promoting it) before answering, in
/// milliseconds. The caller retries; every step resumes where it stopped.
pub const REPLACE_TIMEOUT_MS: u64 = 60_000;

pub use crate::types::RAFT_BODY_BYTES_MAX;

/// How long the server works on one forwarded write or read before answering
/// 504, in milliseconds. Bounds a handler whose leader lost its quorum.
pub const FORWARDED_CALL_TIMEOUT_MS: u64 = 5_000;

/// The body of `POST /raft/read`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadRequest {
    /// The counter to read.
    pub name: CounterName,
}

#[derive(Clone)]
struct Ctx {
    raft: Raft,
    shared: Arc<Shared>,
    me: NodeId,
    store: StoreId,
    /// Serializes replacements on this node.
    replacing: Arc<tokio::sync::Mutex<()>>,
}

/// The router of a node's raft endpoints (see the module docs), for node `me` on
/// store `store`, for [`serve`] on the node's raft address (which tells each
/// request its peer, [`crate::auth::RaftPeer`], for refusals to name it). With `secret`, every RPC must prove it; without, any caller is served.
/// [`crate::MetaRaft::start`] serves it itself.
pub fn raft_router(
    raft: Raft,
    shared: Arc<Shared>,
    me: NodeId,
    store: StoreId,
    secret: Option<Arc<RaftSecret>>,
) -> Router {
    Router::new()
        .route(PATH_APPEND, post(append))
        .route(PATH_VOTE, post(vote))
        .route(PATH_SNAPSHOT, post(snapshot))
        .route(PATH_CLIENT_WRITE, post(client_write))
        .route(PATH_READ, post(read))
        .route(PATH_IDENTITY, post(identity))
        .route(PATH_REPLACE, post(replace))
        .layer(DefaultBodyLimit::max(RAFT_BODY_BYTES_MAX))
        .layer(axum::middleware::from_fn_with_state(secret, crate::auth::authenticated))
        // Outermost: a peer of another release learns that, not just "401".
        .layer(axum::middleware::from_fn(same_protocol))
        .with_state(Ctx { raft, shared, me, store, replacing: Default::default() })
}

/// Serves an RPC only if it names this release's raft protocol
/// ([`crate::rpc::PROTOCOL_HEADER`]); any other version, or none (a release before
/// versioned RPCs), is refused with 409 and both versions, before its body is read.
pub(crate) async fn same_protocol(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use tally_core::format::{check_protocol, RAFT_PROTOCOL};
    let theirs = request
        .headers()
        .get(crate::rpc::PROTOCOL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(0);
    match check_protocol("raft", RAFT_PROTOCOL, theirs) {
        Ok(()) => next.run(request).await,
        Err(e) => {
            tracing::error!(path = %request.uri().path(), theirs, ours = RAFT_PROTOCOL, "refused a raft RPC: {e}");
            (StatusCode::CONFLICT, e.to_string()).into_response()
        }
    }
}

/// The 409 answer to an RPC meant for another incarnation, or `None` to serve it.
fn refused<T>(ctx: &Ctx, rpc: &Guarded<T>) -> Option<Response> {
    let checked = {
        let applied = ctx.shared.read();
        check_incarnation(ctx.store, applied.last_applied.map(|l| l.index), &applied.state.stores, rpc)
    };
    checked.err().map(|e| {
        tracing::warn!(node = ctx.me, from = rpc.from, error = %e, "refused a raft RPC");
        (StatusCode::CONFLICT, e.to_string()).into_response()
    })
}

async fn append(
    State(ctx): State<Ctx>,
    Json(req): Json<Guarded<AppendEntriesRequest<TypeConfig>>>,
) -> Response {
    if let Some(r) = refused(&ctx, &req) {
        return r;
    }
    Json(ctx.raft.append_entries(req.rpc).await).into_response()
}

async fn vote(State(ctx): State<Ctx>, Json(req): Json<Guarded<VoteRequest<NodeId>>>) -> Response {
    if let Some(r) = refused(&ctx, &req) {
        return r;
    }
    Json(ctx.raft.vote(req.rpc).await).into_response()
}

async fn snapshot(
    State(ctx): State<Ctx>,
    Json(req): Json<Guarded<InstallSnapshotRequest<TypeConfig>>>,
) -> Response {
    if let Some(r) = refused(&ctx, &req) {
        return r;
    }
    Json(ctx.raft.install_snapshot(req.rpc).await).into_response()
}

async fn identity(State(ctx): State<Ctx>) -> Response {
    let initialized = ctx.raft.is_initialized().await.unwrap_or(false);
    let leader = ctx.raft.metrics().borrow().current_leader;
    let answer = {
        let applied = ctx.shared.read();
        IdentityAnswer {
            node: ctx.me,
            store: ctx.store,
            initialized,
            leader,
            applied_index: applied.last_applied.map(|l| l.index),
            voters: applied.membership.membership().voter_ids().collect(),
            stores: applied.state.stores.clone(),
        }
    };
    Json(answer).into_response()
}

async fn replace(State(ctx): State<Ctx>, Json(req): Json<ReplaceRequest>) -> Response {
    let limit = Duration::from_millis(REPLACE_TIMEOUT_MS);
    let _one_at_a_time = ctx.replacing.lock().await;
    let done = tokio::time::timeout(limit, crate::replace::replace_voter(&ctx.raft, &ctx.shared, &req)).await;
    let answer: Result<(), String> = match done {
        Ok(r) => r,
        Err(_) => Err(format!("the replacement did not finish within {REPLACE_TIMEOUT_MS} ms; retry")),
    };
    Json(answer).into_response()
}

fn timed_out() -> Response {
    (StatusCode::GATEWAY_TIMEOUT, "raft did not answer in time").into_response()
}

async fn client_write(State(ctx): State<Ctx>, Json(req): Json<Request>) -> Response {
    let limit = Duration::from_millis(FORWARDED_CALL_TIMEOUT_MS);
    match tokio::time::timeout(limit, ctx.raft.client_write(req)).await {
        Ok(r) => Json(r).into_response(),
        Err(_) => timed_out(),
    }
}

async fn read(State(ctx): State<Ctx>, Json(req): Json<ReadRequest>) -> Response {
    let limit = Duration::from_millis(FORWARDED_CALL_TIMEOUT_MS);
    match tokio::time::timeout(limit, ctx.raft.ensure_linearizable()).await {
        Ok(r) => {
            let answer = r.map(|_| ctx.shared.read().state.counters.get(&req.name).cloned());
            Json(answer).into_response()
        }
        Err(_) => timed_out(),
    }
}

/// Most simultaneous connections on a node's raft listener. Peers keep a few
/// pooled connections each (at most 32 nodes); a full listener closes one that
/// serves nobody to make room (`tally_tls::admission`), so silent sockets never
/// shut peers out.
pub const RAFT_CONNECTIONS_MAX: usize = 256;
/// How long a raft connection may take to send a request's headers, and stay idle
/// between requests, in milliseconds: longer than peers keep an idle pooled
/// connection (`network::POOL_IDLE_MS`), so it is the client that drops it first.
pub const RAFT_HEADER_READ_TIMEOUT_MS: u64 = 15_000;
/// How long a connection must have been idle between requests before a full raft
/// listener may close it to make room, in milliseconds.
pub const RAFT_IDLE_EVICT_MIN_MS: u64 = 1_000;
/// How long the raft listener lets requests in flight finish after it was told to
/// stop, in milliseconds.
pub const RAFT_SHUTDOWN_GRACE_MS: u64 = 2_000;
/// How long the accept loop pauses after an accept error, in milliseconds.
const ACCEPT_BACKOFF_MS: u64 = 100;

/// Where raft connections come from: plain TCP, or TCP behind TLS handshakes.
pub enum RaftIncoming {
    /// Plaintext (loopback, or `insecure_plaintext`).
    Plain(tokio::net::TcpListener),
    /// Mutual TLS with the cluster CA; the handshakes ran in their own tasks, and
    /// each peer's certificate names a node of the cluster.
    Tls(tally_tls::TlsIncoming, tally_tls::ClusterTls),
}

impl RaftIncoming {
    /// The next connection, its peer's address and, under TLS, the node its
    /// certificate names.
    async fn next(&mut self) -> Option<(RaftStream, std::net::SocketAddr, Option<String>)> {
        match self {
            RaftIncoming::Plain(listener) => loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        return Some((RaftStream::Plain(stream), peer, None));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "raft: accept failed; backing off");
                        tokio::time::sleep(Duration::from_millis(ACCEPT_BACKOFF_MS)).await;
                    }
                }
            },
            RaftIncoming::Tls(incoming, tls) => incoming.next().await.map(|(s, p)| {
                let node = tls.node_of(s.get_ref().1.peer_certificates());
                (RaftStream::Tls(Box::new(s)), p, node)
            }),
        }
    }
}

/// One raft connection.
enum RaftStream {
    Plain(tokio::net::TcpStream),
    Tls(Box<tally_tls::TlsStream<tokio::net::TcpStream>>),
}

/// Serves `router` (see [`raft_router`]) on `incoming` until `stopped` completes:
/// hyper's HTTP/1 with a header-read timeout ([`RAFT_HEADER_READ_TIMEOUT_MS`]), at
/// most [`RAFT_CONNECTIONS_MAX`] connections, each request told its peer's address
/// ([`crate::auth::RaftPeer`]) and, under TLS, the node its certificate names
/// ([`crate::auth::PeerNode`], which proves the caller); then lets requests in flight finish for at most
/// [`RAFT_SHUTDOWN_GRACE_MS`]. `axum::serve` has neither the timeout nor the cap.
pub async fn serve(
    mut incoming: RaftIncoming,
    router: Router,
    stopped: impl std::future::Future<Output = ()>,
) {
    use tally_tls::refusals::{self, Listener, Reason};
    let admission =
        tally_tls::Admission::new(RAFT_CONNECTIONS_MAX, Duration::from_millis(RAFT_IDLE_EVICT_MIN_MS));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_millis(RAFT_HEADER_READ_TIMEOUT_MS))
        .keep_alive(true);
    let builder = Arc::new(builder);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(stopped);
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer, node) = tokio::select! {
            _ = &mut stopped => break,
            next = incoming.next() => match next {
                Some(accepted) => accepted,
                None => break,
            },
        };
        let evicted_before = admission.evictions();
        let slot = tokio::select! {
            _ = &mut stopped => break,
            slot = admission.admit() => Arc::new(slot),
        };
        if admission.evictions() > evicted_before {
            refusals::count(Listener::Raft, Reason::Evicted);
        }
        let (builder, router, mut stop) = (builder.clone(), router.clone(), stop_rx.clone());
        connections.spawn(async move {
            let marks = slot.clone();
            let service =
                hyper::service::service_fn(move |mut req: axum::http::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(axum::extract::ConnectInfo(crate::auth::RaftPeer(peer)));
                    if let Some(node) = &node {
                        req.extensions_mut().insert(crate::auth::PeerNode(node.clone()));
                    }
                    let busy = marks.begin();
                    let answer = tower::ServiceExt::oneshot(router.clone(), req);
                    async move {
                        let answer = answer.await;
                        drop(busy);
                        answer
                    }
                });
            match stream {
                RaftStream::Plain(s) => {
                    drive(&builder, hyper_util::rt::TokioIo::new(s), service, &slot, &mut stop).await
                }
                RaftStream::Tls(s) => {
                    drive(&builder, hyper_util::rt::TokioIo::new(s), service, &slot, &mut stop).await
                }
            }
        });
    }
    let _ = stop_tx.send(true);
    let grace = Duration::from_millis(RAFT_SHUTDOWN_GRACE_MS);
    if tokio::time::timeout(grace, async { while connections.join_next().await.is_some() {} }).await.is_err()
    {
        connections.shutdown().await;
    }
}

/// Serves one connection until it ends, its listener evicts it (when idle), or
/// `stop` is set (then it finishes the request in flight).
async fn drive<IO, S>(
    builder: &hyper::server::conn::http1::Builder,
    io: IO,
    service: S,
    slot: &tally_tls::Slot,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::ResBody: 'static,
    <S::ResBody as axum::body::HttpBody>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        tokio::select! {
            _ = &mut conn => break,
            _ = slot.evicted(), if !draining => {
                if !slot.is_busy() {
                    break;
                }
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = stop.wait_for(|s| *s), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::format::RAFT_PROTOCOL;

    #[tokio::test]
    async fn an_rpc_of_another_protocol_or_none_is_refused_before_it_is_served() {
        let router = Router::new()
            .route("/probe", post(|| async { "served" }))
            .layer(axum::middleware::from_fn(same_protocol));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, router).await });
        let client = reqwest::Client::new();
        let url = format!("http://{addr}/probe");
        let send = |version: Option<String>| {
            let mut request = client.post(&url);
            if let Some(v) = version {
                request = request.header(crate::rpc::PROTOCOL_HEADER, v);
            }
            async move {
                let resp = request.send().await.unwrap();
                (resp.status().as_u16(), resp.text().await.unwrap())
            }
        };
        assert_eq!(send(Some(RAFT_PROTOCOL.to_string())).await, (200, "served".to_string()));
        for other in [None, Some((RAFT_PROTOCOL + 1).to_string()), Some("one".to_string())] {
            let (status, text) = send(other.clone()).await;
            assert_eq!(status, 409, "{other:?}");
            assert!(text.contains("raft protocol mismatch") && text.contains("same release"), "{text}");
        }
        server.abort();
    }
}
