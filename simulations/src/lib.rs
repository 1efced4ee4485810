//! Seeded chaos simulations of whole Tally clusters, with a checker.
//!
//! A run is a whole cluster in one thread: the real pure core (`tally_core`: routing,
//! ring placement, `shard::decide`, dedup windows, overflow limits, metadata
//! transitions, rollup refresh rules, HyperLogLog sketches) over one
//! `tally_store::MemStore` per node, driven by modelled shells (shard, aggregator,
//! rollup, reconciler, gateway, control plane) on a deterministic event queue with
//! simulated time, a faulty simulated network and injected crashes, pauses, partitions,
//! fsync failures and metadata failovers. Clients record a history; the checker
//! ([`check`]) judges it. The same seed always gives the same run ([`RunReport::trace_hash`]).
//!
//! # Layout
//!
//! * [`config`] — what a run is: seed, size, fault level, the fault rates drawn from
//!   the seed, and every timing constant of the shells.
//! * `sim` — the event queue, the fault injector, the trace hash.
//! * `node` — a node's shells around the core.
//! * `coord` — the control plane: reshardings and membership changes.
//! * `client` — the workload and the settle phase.
//! * `workload` — the counters and the operation mix, shared by both tiers.
//! * `engine` — tier 2: real engines on a paused-time runtime, with the same
//!   workload, history and checker.
//! * [`metalog`] — metadata as one linearizable log over `tally_core::meta::apply_command`.
//! * [`net`] — the simulated network.
//! * [`msg`] — messages.
//! * [`history`] — what the checker reads.
//! * [`check`] — one file per invariant.

#![forbid(unsafe_code)]

/// Whether a planted bug is switched on for this run (always false without the
/// `planted-bugs` feature, so release code paths are unchanged).
#[cfg(feature = "planted-bugs")]
macro_rules! bug {
    ($b:ident) => {
        tally_core::planted::active(tally_core::planted::Bug::$b)
    };
}
#[cfg(not(feature = "planted-bugs"))]
macro_rules! bug {
    ($b:ident) => {
        false
    };
}

pub mod check;
mod client;
pub mod config;
mod coord;
mod engine;
pub mod history;
pub mod metalog;
pub mod msg;
pub mod net;
mod node;
mod sim;
mod workload;

pub use check::Violation;
pub use config::{FaultLevel, FaultRates, SimConfig, Tier};
pub use sim::RunReport;

/// Runs one seeded simulation on the tier its config names.
pub fn run(cfg: SimConfig) -> RunReport {
    match cfg.tier {
        Tier::Model => sim::run(cfg),
        Tier::Engine | Tier::Cluster => engine::run(cfg),
    }
}
