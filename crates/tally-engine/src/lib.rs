//! Tally's engine: the shard, aggregator, rollup and reconciler actors, and the
//! embedded API that drives them.
//!
//! # Layout
//!
//! The handle and what callers exchange with it:
//!
//! * [`Tally`] (`tally.rs`) — the handle callers hold.
//! * [`CounterHandle`] (`handle.rs`) — a counter resolved once, so a hot loop skips
//!   the name lookup.
//! * `api.rs` — the types callers exchange with the engine, in the JSON shapes of
//!   the public HTTP interface.
//! * `config.rs` — [`TallyConfig`], every limit the engine enforces, and the
//!   [`AuthoritativeSource`] the reconciler compares with.
//! * `error.rs` — [`TallyError`] and [`ListError`]: one HTTP status and one stable
//!   code each.
//! * `clock.rs` — [`Clock`]: time as an input, so tests and simulations drive it.
//! * `stats.rs` — [`Stats`]: write rates, flush batch sizes, dedup hits, drift, as
//!   plain atomics the front ends export.
//!
//! The write path:
//!
//! * `ctx.rs` — what every actor shares: the store, the catalog, the registry of
//!   active counters, the directory of running shard actors, and the write path.
//! * `runtime.rs` — a counter's accumulator slots (the lock-free fast path).
//! * `ledger.rs` — what `INCR` answers: this node's acknowledged increments over
//!   one sum of the shards, without a read per increment.
//! * `within.rs` — increments kept within bounds named with each call (Redis's
//!   `INCREX`, [`Tally::incr_within`]).
//! * `create.rs` — counters created by their first increment, many per metadata
//!   commit.
//! * `messages.rs` — the messages of the shard, supervisor and aggregator actors,
//!   apart from the actors so that senders and handlers do not depend on each other.
//! * `shard.rs` — the shard actor, sole writer of one shard, and the one interpreter of
//!   a shard machine's effects (`execute`), for actors and cold writes alike.
//! * `cold.rs` — the first write of a just-created shard, run through its machine
//!   without starting an actor.
//! * `supervisor.rs` — starts shard actors on demand and stops idle ones.
//! * `aggregator.rs` — drains accumulators into shard messages every `flush_ms`.
//! * `flusher.rs` — the commit path: applies every shard write, then one fsync serves
//!   every waiting write (group commit).
//!
//! Reads, metadata and housekeeping:
//!
//! * `read.rs` — sums, sketches and shard reports.
//! * `rollup.rs` — caches totals for constant-cost reads.
//! * `catalog.rs` — where counter metadata lives: the [`Catalog`] trait and
//!   [`LocalCatalog`], in the node's own store (a cluster plugs in a replicated one).
//! * `list.rs` — listing counters by name, one bounded page at a time.
//! * `quota.rs` — the quotas: counters on the node and per prefix, event ids a
//!   counter keeps, bytes its sketches take.
//! * `expire.rs` — expired counters: missing for reads at once, reclaimed by a sweep.
//! * `dormant.rs` — the dedup sweep of shards that no actor runs.
//! * `lost.rs` — refuses reads of shards whose earlier values this node lost.
//! * `reconciler.rs` — corrects drift against an authoritative total.
//! * `reshard.rs` — changes a live counter's shard count by generations.
//! * `autoshard.rs` — samples auto counters' contention and carries out the shard
//!   counts `tally_core::autoshard` proposes, through resharding.
//! * `auto_book.rs` — the auto counters this engine follows, with their machines.
//!
//! Other nodes:
//!
//! * `placement.rs` — where shards live: the [`Placement`] trait a cluster implements,
//!   and the [`ShardRequest`]s and [`ShardResponse`]s it carries between nodes' engines
//!   (an embedded engine owns every shard).
//! * `handoff.rs` — shards move to their new owner after a membership change.
//!
//! Actors talk by messages and reply in them; a handler returns `Err` only for a
//! fatal condition. The decisions themselves are `tally_core`'s pure functions.

#![forbid(unsafe_code)]

/// Whether a planted bug is switched on (`tally_core::planted`, feature
/// `planted-bugs`); always false without the feature, so nothing changes.
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

mod aggregator;
mod api;
mod auto_book;
mod autoshard;
mod catalog;
mod clock;
mod cold;
mod config;
mod create;
mod ctx;
mod dormant;
mod error;
mod expire;
mod flusher;
mod handle;
mod handoff;
mod ledger;
mod list;
mod lost;
mod messages;
mod placement;
mod quota;
mod read;
mod reconciler;
mod reshard;
mod rollup;
mod runtime;
mod shard;
mod stats;
mod supervisor;
mod tally;
mod within;

pub use aggregator::{DRAINS_CONCURRENT_MAX, EVICTION_SWEEP_MS, SHUTDOWN_DELIVER_MS};
pub use api::*;
pub use autoshard::AUTO_COUNTERS_MAX;
pub use catalog::{Catalog, EnsureResults, Generations, LocalCatalog, CREATIONS_UNWRITTEN_MAX};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{AuthoritativeSource, TallyConfig};
pub use create::CREATE_BATCH_MAX;
pub use ctx::{
    seed_thread_routing, CREATED_UNDRAINED_MAX, IN_DOUBT_RESENDS_CONCURRENT_MAX, IN_DOUBT_RETRY_MS_MAX,
    PREDECESSORS_MAX,
};
pub use error::ListError;
pub use error::TallyError;
pub use expire::EXPIRED_RECLAIMS_PER_SWEEP_MAX;
pub use handle::CounterHandle;
pub use handoff::{HandoffReport, EPOCH_WAIT_MS, HANDOFF_RECORDS_MAX, HANDOFF_SCAN_PAGE};
pub use ledger::LEDGER_REFRESH_MS;
pub use list::{CounterPage, LIST_PAGE_COUNTERS_MAX, LIST_PREFIX_BYTES_MAX};
pub use placement::{Placement, ShardRequest, ShardResponse};
pub use quota::{CounterQuota, QUOTA_RECOUNT_MS};
pub use read::{skew, SUM_MANY_CONCURRENT_MAX};
pub use reconciler::RECONCILE_DRIFT_ABS_MAX;
pub use rollup::ROLLUP_REFRESH_BATCH_MAX;
pub use shard::ShardReply;
pub use stats::AutoChangeCounts;
pub use stats::{Count, DriftBook, Histogram, HistogramSnapshot, Stats, DRIFT_BOOK_COUNTERS_MAX};
pub use tally::{EngineParts, Tally, STORE_FORMAT_KEY};
pub use tally_core::autoshard::{
    AutoStatus, Change as AutoChange, Figures as Contention, Reason as AutoReason, Tuning as AutoTuning,
};
pub use tally_core::spec::{AutoPatch, AutoShards, CounterSpec, Durability, RouterPolicy, SpecPatch};
pub use tally_store::{MemStore, SledConfig, SledStore, Store, StoreError, Upgrade};
pub use within::{WithinOutcome, SATURATE_ATTEMPTS_MAX, WITHIN_TURNS};
