//! Tally's pure core.
//!
//! Everything here takes inputs and returns outputs: no I/O, no clock, no global
//! randomness, no threads. Time arrives as `now_ms` arguments and randomness as
//! caller-supplied numbers, so the engine, the cluster and the simulator all drive
//! the same code and a seeded simulation replays exactly.
//!
//! # Layout
//!
//! * [`name`] — counter names and event ids: the validated strings a client chooses.
//! * [`ids`] — shard and node identities.
//! * [`hash`] — the one specified hash function (XXH3-64 with fixed seeds).
//! * [`codec`] — the byte encoding of everything stored or sent (bincode 2).
//! * [`format`](mod@format) — format markers of stores and protocol versions of peers; its
//!   submodules `v1`–`v6` and `v8` freeze the records of earlier store formats and
//!   upgrade them to today's.
//! * [`spec`] — the per-counter contract and its validation.
//! * [`meta`] — counter metadata (spec + shard layout) and its transitions,
//!   including resharding by layout generations.
//! * [`expiry`] — a counter's deadline: `EXPIRE`'s conditions and `TTL`'s arithmetic.
//! * [`namespace`] — the spec counters created under a name prefix take, and which
//!   prefix a name falls under.
//! * [`autoshard`] — when an auto counter's shard count should change: contention
//!   samples in, proposals out.
//! * [`router`] — which shard an increment goes to.
//! * [`limits`] — the arithmetic that lets increments be acknowledged from an
//!   in-memory accumulator without any shard ever overflowing.
//! * [`shard`] — a shard's decision function: given a batch of submissions and the
//!   dedup records found, the new value, the records to write and every reply.
//! * [`dedup`] — the dedup window: duplicate, conflict or fresh.
//! * [`sweep`] — when a shard sweeps its expired dedup records, and which records a
//!   sweep reads.
//! * [`escrow`] — bounded counters: a `min`/`max` that holds across a counter's shards
//!   without a global lock, by shares of the headroom.
//! * [`within`] — the arithmetic of bounds named with each increment (Redis's
//!   `INCREX`), as opposed to a spec's `min`/`max`.
//! * [`ring`] — consistent-hash placement of shards on nodes, with virtual nodes.
//! * [`ranges`] — the range directory of shard replication: the ring's circle cut
//!   into a bounded number of ranges, each replicated on `R` nodes, and the
//!   per-range replica changes a membership change causes.
//! * [`sketch`] — HyperLogLog for distinct counts; [`cms`] — count-min for frequencies.
//! * [`topk`] — mergeable heavy hitters (Misra–Gries); [`frequency`] — a counter's
//!   per-shard frequency state (count-min and heavy hitters) and its limits.
//! * [`shard_machine`], [`drain_book`], [`reshard_machine`], [`handoff_machine`] — the
//!   shard, the aggregator's drains, the resharding and the membership hand-off as
//!   pure state machines that the engine's actors and the simulator both run.
//! * [`reconcile`] — a reconciliation's correction: its delta and its per-run event id.
//! * [`rollup`] — when a cached total must be refreshed.
//! * [`window`] — sliding windows: time buckets of totals and distinct members, their
//!   arithmetic (which bucket, which span a read sums, expiry) and their merge.
//! * `planted` (feature `planted-bugs` only) — known bugs the simulator's checker must
//!   catch, switched on at run time.

#![forbid(unsafe_code)]

pub mod autoshard;
pub mod cms;
pub mod codec;
pub mod dedup;
pub mod drain_book;
pub mod escrow;
pub mod expiry;
pub mod format;
pub mod frequency;
pub mod handoff_machine;
pub mod hash;
pub mod ids;
pub mod limits;
pub mod meta;
pub mod name;
pub mod namespace;
#[cfg(feature = "planted-bugs")]
pub mod planted;
pub mod ranges;
pub mod reconcile;
pub mod reshard_machine;
pub mod ring;
pub mod rollup;
pub mod router;
pub mod shard;
pub mod shard_machine;
pub mod sketch;
pub mod spec;
pub mod sweep;
pub mod topk;
pub mod window;
pub mod within;

pub use ids::{NodeId, ShardId};
pub use name::CounterName;
pub use spec::{CounterSpec, Durability, RouterPolicy, SpecPatch};
