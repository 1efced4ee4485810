//! A Tally cluster node.
//!
//! The engine is the same one an embedded caller drives; this crate plugs in the
//! three things that make a node part of a cluster:
//!
//! * [`RaftCatalog`] — counter metadata replicated by `tally-raft` (openraft 0.9), so
//!   every node agrees on specs, layouts and reshardings;
//! * [`RingPlacement`] — each shard's owner is its point's successor on a
//!   consistent-hash ring of the cluster's nodes (virtual nodes; with range groups,
//!   the leader of the shard's range), and requests for
//!   shards owned elsewhere travel over `tally-transport` (ractor_cluster sessions
//!   with heartbeats and reconnection);
//! * [`ClusterNode`] — starts and stops all of it, serves other nodes' shard requests
//!   with the local engine, and reports the cluster's state.
//!
//! # Layout
//!
//! * [`config`] — [`ClusterNodeConfig`], [`Member`], [`ClusterError`], and the
//!   check that a node's data was kept the way its config asks;
//! * `parts` — a data directory's stores belong to one identity;
//! * [`catalog`] — [`RaftCatalog`];
//! * [`placement`] — [`RingPlacement`];
//! * `handler` — what a node answers on its node-to-node sessions;
//! * [`replication`] — range groups over the node's sessions;
//! * [`node`] — [`ClusterNode`].

pub mod catalog;
pub mod config;
mod handler;
pub mod node;
mod parts;
pub mod placement;
pub mod replication;

pub use catalog::RaftCatalog;
pub use config::{ClusterError, ClusterNodeConfig, Member};
pub use node::{
    AcceptLossError, ClusterNode, InMemoryWiring, MemberView, MembershipError, NodeWiring,
    HANDOFF_RETRY_MAX_MS, HANDOFF_RETRY_MIN_MS, MEMBERSHIP_ATTEMPTS_MAX, READY_GROUP_LEADERS_WAIT_MS,
    READY_POLL_MS,
};
pub use placement::RingPlacement;
pub use tally_replica::{GroupsConfig, Replication, ReplicationFigures};
