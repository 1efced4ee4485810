//! The server side: the internal HTTP endpoints every node serves on its raft
//! address. Bodies and answers are JSON; an answer is the serialized
//! `Result<_, openraft::error::RaftError<..>>` of the local raft call, so the caller
//! sees exactly the error the peer's raft raised.
//!
//! | path | body → answer |
//! | --- | --- |
//! | `POST /raft/append` | `AppendEntriesRequest` → `Result<AppendEntriesResponse, RaftError>` |
//! | `POST /raft/vote` | `VoteRequest` → `Result<VoteResponse, RaftError>` |
//! | `POST /raft/snapshot` | one chunk, `InstallSnapshotRequest` → `Result<InstallSnapshotResponse, RaftError<InstallSnapshotError>>` |
//! | `POST /raft/client-write` | [`Request`] → `Result<ClientWriteResponse, RaftError<ClientWriteError>>` (no further forwarding) |
//! | `POST /raft/read` | [`ReadRequest`] → `Result<Option<CounterMeta>, RaftError<CheckIsLeaderError>>` (a linearizable read on this node) |
//!
//! A body that does not decode is refused by axum with a 4xx status before it
//! reaches raft; bodies are bounded by [`RAFT_BODY_BYTES_MAX`].

use crate::state_machine::Shared;
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

/// Path of the append-entries RPC.
pub const PATH_APPEND: &str = "/raft/append";
/// Path of the vote RPC.
pub const PATH_VOTE: &str = "/raft/vote";
/// Path of the install-snapshot RPC (one chunk per call).
pub const PATH_SNAPSHOT: &str = "/raft/snapshot";
/// Path where a follower forwards a client write to the leader.
pub const PATH_CLIENT_WRITE: &str = "/raft/client-write";
/// Path where a follower asks the leader for a linearizable read.
pub const PATH_READ: &str = "/raft/read";

/// Largest accepted request body, in bytes. A snapshot chunk is at most
/// `SNAPSHOT_CHUNK_BYTES` of data, which JSON encodes as up to 4 bytes per byte.
pub const RAFT_BODY_BYTES_MAX: usize = 16 << 20;

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
}

/// The router of a node's raft endpoints (see the module docs), for the caller to
/// serve on the node's raft address. [`crate::MetaRaft::start`] serves it itself.
pub fn raft_router(raft: Raft, shared: Arc<Shared>) -> Router {
    Router::new()
        .route(PATH_APPEND, post(append))
        .route(PATH_VOTE, post(vote))
        .route(PATH_SNAPSHOT, post(snapshot))
        .route(PATH_CLIENT_WRITE, post(client_write))
        .route(PATH_READ, post(read))
        .layer(DefaultBodyLimit::max(RAFT_BODY_BYTES_MAX))
        .with_state(Ctx { raft, shared })
}

async fn append(State(ctx): State<Ctx>, Json(req): Json<AppendEntriesRequest<TypeConfig>>) -> Response {
    Json(ctx.raft.append_entries(req).await).into_response()
}

async fn vote(State(ctx): State<Ctx>, Json(req): Json<VoteRequest<NodeId>>) -> Response {
    Json(ctx.raft.vote(req).await).into_response()
}

async fn snapshot(State(ctx): State<Ctx>, Json(req): Json<InstallSnapshotRequest<TypeConfig>>) -> Response {
    Json(ctx.raft.install_snapshot(req).await).into_response()
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
