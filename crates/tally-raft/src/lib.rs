//! Tally's replicated cluster metadata.
//!
//! Every node of a cluster must agree on what each counter is (its spec and shard
//! layout, including resharding generations), which deleted counters still have
//! shard data to clean up, and which nodes hold shards. This crate keeps that state
//! in a raft group (openraft 0.9, `storage-v2`) across the cluster's nodes, persisted
//! in sled, and hands the data plane a local, always-available copy of it.
//!
//! # Layout
//!
//! * [`types`] — the openraft type configuration, the log's commands ([`Request`])
//!   and what applying them answered ([`Response`]).
//! * [`state`] — the replicated state as plain data with a pure transition
//!   function; counters change only through `tally_core::meta::apply_command`.
//! * [`log_store`] — the raft log and vote in sled (`RaftLogStorage`).
//! * [`state_machine`] — the state machine and snapshots in sled
//!   (`RaftStateMachine`), one atomic batch per apply.
//! * [`rpc`] — the raft endpoints' paths and the bodies that are not openraft's own,
//!   shared by the server and its clients.
//! * [`network`] — raft RPCs over HTTP/JSON with reqwest (`RaftNetwork`).
//! * [`mem_net`] — [`MemRaftNet`], an in-memory network that carries the same
//!   requests to the same routers without sockets, each message as a simulator's
//!   [`RaftLinks`] says ([`MetaRaft::start_in`]).
//! * [`server`] — the axum endpoints every node serves on its raft address.
//! * [`auth`] — the proof of the cluster secret every raft RPC carries and every
//!   endpoint checks.
//! * [`identity`] — the store incarnation of a node's data directory, which every
//!   raft RPC names so that a node with a replaced disk is never taken for its
//!   predecessor; [`store_id`] — that identity's type, apart from the code that keeps
//!   it; `replace.rs` — the leader re-adds such a node as a new incarnation.
//! * [`upgrade`] — a raft database of an earlier format upgraded in place.
//! * [`error`] — the crate's error type.
//! * [`meta_raft`] — [`MetaRaft`], the facade: start, initialize once, write from any
//!   node (forwarded to the leader), read locally or linearizably, subscribe.
//!
//! # Determinism
//!
//! Applying an entry reads nothing but the entry and the state: the clock a counter
//! transition needs (`now_ms`) is chosen by the proposer and stored in the entry,
//! maps are `BTreeMap`s and the member list is kept sorted, so every replica computes
//! byte-identical state from the same log.
//!
//! A simulation runs several nodes on one current-thread runtime with paused time
//! ([`MetaRaft::start_in`]). What the nodes draw at random — election timeouts,
//! store incarnations, proposer identities, nonces of proofs — comes from one
//! per-thread generator it seeds (`tally_raft_kit::seed_thread_rng`), and sled
//! flushes run on the spot there ([`log_store::flush`]), so that the clock never
//! jumps while another thread works.

#![forbid(unsafe_code)]

pub mod auth;
pub mod error;
pub mod identity;
pub mod log_store;
pub mod mem_net;
pub mod meta_raft;
pub mod network;
mod replace;
pub mod rpc;
pub mod server;
pub mod state;
pub mod state_machine;
pub mod store_id;
pub mod types;
pub mod upgrade;

pub use auth::RaftSecret;
pub use error::RaftError;
pub use log_store::SledLogStore;
pub use mem_net::{LinkFate, MemRaftNet, RaftLinks, RaftMessage};
pub use meta_raft::{MetaRaft, MetaRaftConfig, RaftStorage};
pub use server::raft_router;
pub use state::MetaState;
pub use state_machine::SledStateMachine;
pub use store_id::StoreId;
pub use types::{
    CounterAnswer, Effect, MemberRejection, MembersView, MetaChange, NodeId, ProposalId, Raft, Rejection,
    Request, Response, StoreRecord, StoreRejection, TypeConfig, ENSURE_MANY_MAX,
};
