//! The raft endpoints' vocabulary: their paths and the bodies that are not openraft's
//! own. Both sides use it — the server that answers (`server.rs`) and the clients
//! that call (`network.rs`, `replace.rs`) — so neither depends on the other for it.

use crate::store_id::StoreId;
use crate::types::{NodeId, StoreRecord};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
/// Path where a node tells who it is and what it has applied.
pub const PATH_IDENTITY: &str = "/raft/identity";
/// Path where a node whose disk was replaced asks the leader to re-add it.
pub const PATH_REPLACE: &str = "/raft/replace";

/// The header every raft RPC carries with the sender's raft protocol version
/// ([`tally_core::format::RAFT_PROTOCOL`]); a server refuses any other version, or
/// none, with 409 and both versions named.
pub const PROTOCOL_HEADER: &str = "tally-raft-protocol";

/// The answer of `POST /raft/identity`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdentityAnswer {
    /// The answering node's raft id.
    pub node: NodeId,
    /// Its store incarnation.
    pub store: StoreId,
    /// Whether its raft log holds a membership (the group exists for it).
    pub initialized: bool,
    /// The leader it knows of.
    pub leader: Option<NodeId>,
    /// The index of the last entry it applied.
    pub applied_index: Option<u64>,
    /// The voters of the membership it applied.
    pub voters: Vec<NodeId>,
    /// The store records it applied.
    pub stores: BTreeMap<NodeId, StoreRecord>,
}

/// The body of `POST /raft/replace`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplaceRequest {
    /// The raft id of the node whose disk was replaced.
    pub node: NodeId,
    /// Its new store incarnation.
    pub store: StoreId,
    /// Its raft address.
    pub addr: String,
}
