//! Node-to-node messaging for a Tally cluster, over `ractor_cluster`.
//!
//! ractor_cluster gives authenticated sessions, remote actors and process groups, but no
//! failure detector, no reconnect, and no notion of "the same cluster config". This crate adds
//! those, and hides ractor's remote actor ids (which change on every reconnect) behind stable
//! node names: callers say `transport.call("node2", bytes, timeout)`.
//!
//! # How it works
//!
//! - **Gateway.** Each node runs one remote-capable actor, registered in the process group
//!   `tally.gw.<node_id>`. A request is a [`wire::WireRequest`] encoded with
//!   `tally_core::codec` and carried by ractor as a serialized RPC; the gateway answers pings
//!   inline and runs calls concurrently on the [`Handler`].
//! - **Sessions.** For each pair of nodes only the smaller name dials (the other accepts), so
//!   a pair never races two sessions into ractor_cluster's election. Dials are plain TCP
//!   streams handed to `client_connect_external` with a label that identifies them.
//! - **Heartbeat.** Every `heartbeat_ms` each node pings each peer's gateway with a deadline
//!   of one interval. The pure state machine in [`health`] turns outcomes into `Up`,
//!   `Suspect` and `Down`; the `heartbeat_misses_max`-th consecutive miss stops the peer's
//!   `NodeSession` (which is what unblocks ractor after a silent failure) and the connector
//!   dials again with exponential backoff ([`backoff`]).
//! - **Fingerprint.** Every ping and call carries the cluster-config fingerprint; a mismatch is
//!   refused, logged with both values, and the session is closed: the peer never becomes `Up`.
//!
//! **Detection bound:** a silent peer is `Down` within `heartbeat_ms × (misses_max + 1)`
//! ([`TransportConfig::detection_bound`]); calls to it time out (never hang) until then and
//! fail fast with [`TransportError::Unreachable`] after.
//!
//! **One process is one node** over ractor_cluster: its process groups and pid registry are
//! process-global, so [`Transport::start`] refuses to run twice in one process. For several
//! nodes in one process (a simulator, on a current-thread runtime with paused time),
//! [`Transport::start_in`] starts a node on a [`MemNetwork`] instead: the same `Transport`,
//! the same checks, limits, wire frames, gateway logic and failure detector, with messages
//! carried in memory and each one's delay or loss decided by the network's [`Links`].
//!
//! # Layout
//!
//! - `config.rs` — [`TransportConfig`], validation, the detection bound.
//! - `health.rs` — the failure detector as a pure function ([`health::on_ping_result`]).
//! - `backoff.rs` — seeded reconnect backoff and log rate limiting, pure.
//! - `wire.rs` — the request/reply enums and the ractor message that carries them.
//! - `gateway.rs` — the [`Handler`] trait, how a gateway serves a request, and the gateway
//!   actor.
//! - `sessions.rs` — the table of ractor_cluster sessions, fed by its event subscription.
//! - `mem.rs` — the in-memory backend: [`MemNetwork`], [`Links`], [`LinkFate`].
//! - `transport.rs` — [`Transport`]: start (over ractor_cluster or in memory), call, and the
//!   heartbeat/connector/sweep tasks.
//! - `error.rs` — every way starting the transport or calling a peer can fail.

pub mod backoff;
pub mod config;
pub mod error;
pub mod gateway;
pub mod health;
mod mem;
mod sessions;
mod transport;
pub mod wire;

pub use config::TransportConfig;
pub use error::TransportError;
pub use gateway::Handler;
pub use health::PeerState;
pub use mem::{LinkFate, Links, MemNetwork};
pub use transport::{PeerStatus, Transport};
