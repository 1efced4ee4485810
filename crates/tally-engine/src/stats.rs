//! Operational signals: write rates, flush batch sizes, dedup hits, drift. Plain
//! atomics, cheap enough for the write path; front ends export them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use tally_core::autoshard::Reason;
use tally_core::CounterName;

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Count(AtomicU64);

impl Count {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// The current count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A distribution summarized by count, sum and power-of-two buckets (bucket `i` holds
/// values in `[2^(i-1), 2^i)`, bucket 0 holds zero).
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; 41],
    sum: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Records one value.
    pub fn record(&self, v: u64) {
        let i = (64 - v.leading_zeros() as usize).min(self.buckets.len() - 1);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
    /// (count, sum, cumulative buckets as (upper bound exclusive, count)).
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0;
        let buckets = self
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                acc += b.load(Ordering::Relaxed);
                (1u64.checked_shl(i as u32).unwrap_or(u64::MAX), acc)
            })
            .collect();
        HistogramSnapshot {
            count: self.count.load(Ordering::Relaxed),
            sum: self.sum.load(Ordering::Relaxed),
            buckets,
        }
    }
}

/// A point-in-time copy of a [`Histogram`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Values recorded.
    pub count: u64,
    /// Their sum.
    pub sum: u64,
    /// Cumulative counts below each power-of-two bound.
    pub buckets: Vec<(u64, u64)>,
}

/// Every signal the engine keeps.
#[derive(Debug, Default)]
pub struct Stats {
    /// Increments acknowledged on `batched` counters.
    pub increments_batched: Count,
    /// Increments acknowledged on `sync` counters.
    pub increments_sync: Count,
    /// Increments whose event id was a duplicate.
    pub dedup_hits: Count,
    /// Increments refused for a conflicting event id.
    pub conflicts: Count,
    /// Increments refused because they would cross their counter's bound.
    pub bound_refusals: Count,
    /// Creations refused by a counters quota (`engine.counters_max`, `[[quotas]]`).
    pub quota_counters_refused: Count,
    /// Increments refused by the event-id quota.
    pub quota_event_ids_refused: Count,
    /// Specs refused by the sketch-bytes quota.
    pub quota_sketch_bytes_refused: Count,
    /// Headroom transfers (escrow grants) this node's shards sent, counting resends.
    pub escrow_grants_sent: Count,
    /// Escrow messages (borrow requests, grants, acknowledgements) this node's shards
    /// sent to shards on other nodes or could not deliver.
    pub escrow_messages: Count,
    /// Shard commits written to the store.
    pub commits: Count,
    /// Submissions per shard commit.
    pub commit_submissions: Histogram,
    /// Increments per aggregator drain sent to a shard.
    pub drain_increments: Histogram,
    /// Store flushes (fsyncs).
    pub flushes: Count,
    /// Waiters served per flush (the group-commit factor).
    pub flush_waiters: Histogram,
    /// Shard writes applied per commit cycle (each cycle ends with at most one flush).
    pub cycle_commits: Histogram,
    /// Fresh reads served.
    pub reads_fresh: Count,
    /// Cached reads served.
    pub reads_cached: Count,
    /// Read latency in microseconds, fresh.
    pub read_fresh_us: Histogram,
    /// Read latency in microseconds, cached.
    pub read_cached_us: Histogram,
    /// Reconciliations that found drift.
    pub reconcile_corrections: Count,
    /// Expired counters this node deleted (its sweep, or a write that met one).
    pub expired_reclaimed: Count,
    /// Acknowledged buffered increments given up on: their drained sum stayed in doubt
    /// past the resend limit, or a shutdown could not deliver them. Should stay 0.
    pub buffered_lost: Count,
    /// The last measured drift (authoritative minus sum of shards), any counter.
    pub drift_last: AtomicI64,
    /// Shard actors started.
    pub shard_activations: Count,
    /// First writes of just-created shards carried out without an actor (`cold.rs`).
    pub cold_writes: Count,
    /// Shards started only to sweep their expired dedup records (no actor ran them).
    pub dormant_wakes: Count,
    /// Dedup records read by sweep passes (live ones included): a pass starts only
    /// once a record is due, so this grows with the records written, not with time.
    pub dedup_sweep_reads: Count,
    /// Shard actors stopped for idleness.
    pub shard_retirements: Count,
    /// Shards this node took over from their previous owner after a membership change.
    pub shards_adopted: Count,
    /// The last measured drift of each counter reconciled on this node.
    pub drifts: DriftBook,
    /// Auto reshardings proposed by this node (`shards: "auto"`).
    pub auto_proposals: Count,
    /// Auto reshardings completed, by direction and reason.
    pub auto_changes: AutoChangeCounts,
    /// Auto proposals that did not happen (refused, or overtaken by another change).
    pub auto_dropped: Count,
}

/// Most counters whose last drift a [`DriftBook`] remembers: it is a signal for
/// operators, not a record, so it must not grow with the number of counters.
pub const DRIFT_BOOK_COUNTERS_MAX: usize = 4096;

/// The last measured drift (authoritative total minus sum of shards) per counter,
/// with when it was measured, so a status view can show drift beside each counter.
/// Holds at most [`DRIFT_BOOK_COUNTERS_MAX`] counters; the oldest measurement makes
/// room for a new counter.
#[derive(Debug, Default)]
pub struct DriftBook(parking_lot::Mutex<BTreeMap<CounterName, (i128, u64)>>);

impl DriftBook {
    /// Records `drift` of `name`, measured at `at_ms`.
    pub fn record(&self, name: &CounterName, drift: i128, at_ms: u64) {
        let mut book = self.0.lock();
        if book.len() >= DRIFT_BOOK_COUNTERS_MAX && !book.contains_key(name) {
            let oldest = book.iter().min_by_key(|(_, (_, at))| *at).map(|(n, _)| n.clone());
            if let Some(oldest) = oldest {
                book.remove(&oldest);
            }
        }
        book.insert(name.clone(), (drift, at_ms));
    }

    /// The last drift of `name` and when it was measured, if it was reconciled here.
    pub fn get(&self, name: &str) -> Option<(i128, u64)> {
        self.0.lock().get(name).copied()
    }
}

/// Auto changes completed, by direction and reason: a fixed set of labels.
#[derive(Debug, Default)]
pub struct AutoChangeCounts([[Count; Reason::ALL.len()]; 2]);

impl AutoChangeCounts {
    pub(crate) fn record(&self, up: bool, reason: Reason) {
        let i = Reason::ALL.iter().position(|r| *r == reason).expect("every reason is listed");
        self.0[usize::from(!up)][i].inc();
    }

    /// Every (direction, reason, count), `"up"` then `"down"`.
    pub fn snapshot(&self) -> Vec<(&'static str, &'static str, u64)> {
        let mut out = Vec::new();
        for (d, direction) in ["up", "down"].into_iter().enumerate() {
            for (i, reason) in Reason::ALL.iter().enumerate() {
                out.push((direction, reason.as_str(), self.0[d][i].get()));
            }
        }
        out
    }
}
