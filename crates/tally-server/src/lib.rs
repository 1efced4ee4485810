//! Tally's server: a node's configuration, the public HTTP/JSON interface, and the
//! serving loop that the `tallyd` binary runs.
//!
//! # Layout
//!
//! * [`auth`] — [`auth::Gate`]: client tokens (`tally_auth`), shared by every
//!   listener, with the audit trail (`tally::audit`) and the refusal metrics.
//! * [`config`] — the node's TOML file: a `[cluster]` section identical on every
//!   node (fingerprinted) and the per-node `[node]`, `[http]`, `[engine]` sections,
//!   validated at load.
//! * [`service`] — the [`Service`] trait: what the HTTP front end needs from a node.
//!   The router is generic over it so a cluster member can replace the single node.
//! * [`single`] — [`SingleNode`], the service of a one-node deployment over the
//!   embedded engine.
//! * [`cluster`] — [`ClusterService`], the service of a node in a multi-node cluster
//!   (`tally-cluster`: replicated metadata, ring placement, node-to-node calls).
//! * [`http`] — the router (`http/mod.rs`): routes and the guard that bounds every
//!   request's time and turns every failure into `{"error": {...}}`; its modules
//!   [`http::body`] (bounded bodies and their wire shapes), [`http::error`] (the one
//!   error shape), [`http::access`] (the access table over client tokens),
//!   [`http::browser`] (what a web page may make a browser do) and [`http::ops`]
//!   (the listing, `/v1/stats`, the status page and the OpenAPI document).
//! * `ui/` — the status page's `index.html`, `app.js` and `app.css`, compiled into
//!   the binary and served by [`http::ops`] at `/ui`.
//! * [`resp`] — the Redis-protocol (RESP2/RESP3) front end over the same
//!   [`Service`]: `redis-cli`, `redis-benchmark` and Redis client libraries. Its
//!   modules: [`resp::wire`], [`resp::command`], [`resp::exec`], [`resp::auth`],
//!   [`resp::registry`] and [`resp::glob`] (listed in [`resp`]'s docs).
//! * [`server`] — [`serve`]: the accept loop with header-read timeout, connection
//!   limit (a full listener closes a connection that serves nobody, by
//!   `tally_tls::Admission`) and graceful shutdown.
//! * [`repoll`] — [`repoll::Repoll`]: a connection that wakes its own task while it
//!   runs is polled again at once instead of being rescheduled as a yield.
//! * [`metrics`] — Prometheus text written by hand from the engine's statistics.
//! * [`sources`] — sources of truth (PostgreSQL, an event log) reconciled on a
//!   schedule, and the record of every run: [`sources::config`],
//!   [`sources::postgres`], [`sources::pg_tls`], [`sources::event_log`],
//!   [`sources::runs`] (listed in [`sources`]'s docs).
//! * `bin/tallyd.rs` — the `tallyd` binary: reads the config, opens the engine (a
//!   single node or a cluster member) and serves until a signal stops it.
//!
//! # Seams for the cluster
//!
//! A cluster member implements [`Service`] (forwarding to remote shards, answering
//! [`Service::cluster`] from its failure detector and raft state) and hands it to
//! [`router`]; [`serve`] takes any `axum::Router`, so internal routes can be merged
//! in. [`ClusterConfig::fingerprint`](config::ClusterConfig::fingerprint) is what
//! the handshake compares.

#![forbid(unsafe_code)]

pub mod auth;
pub mod cluster;
pub mod config;
pub mod http;
pub mod metrics;
pub mod repoll;
pub mod resp;
pub mod server;
pub mod service;
pub mod single;
pub mod sources;

pub use cluster::ClusterService;
pub use config::{
    ClusterConfig, Config, ConfigError, EngineConfig, HttpConfig, NodeConfig, NodeEntry, RespConfig,
};
pub use http::{router, router_with_gate};
pub use server::{serve, serve_tls};
pub use service::{ClusterView, NodeState, NodeView, Service};
pub use single::{SingleNode, StartError};
