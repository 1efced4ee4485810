//! The measured cells: hot engine counters (plain, bounded and windowed), the
//! per-increment sled baseline, and reads.

use crate::drive::{drive, Driven, Op};
use crate::options::Options;
use crate::timed_store::TimedStore;
use anyhow::{ensure, Context as _};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tally_core::window::WindowSet;
use tally_engine::{
    Consistency, Durability, Increment, SledConfig, SpecPatch, SystemClock, Tally, TallyConfig, TallyError,
};

/// The hot counter's name.
const HOT: &str = "hot";

/// Whether a cell's final state matched what its writers were told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verification {
    /// The fresh total equals the acknowledged increments (or every read was right).
    Verified,
    /// It did not; why.
    Failed(String),
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Cell {
    /// The key `--only` matches, e.g. `batched/8sh/64w`.
    pub key: String,
    /// The row's kind, as printed.
    pub row: String,
    /// Shards of the counter.
    pub shards: u16,
    /// Concurrent writers (or readers).
    pub writers: usize,
    /// Acknowledged operations per second.
    pub rate: f64,
    /// What `rate` counts ("" for increments, "reads/s" for reads).
    pub unit: &'static str,
    /// Median latency of the timed calls, in microseconds.
    pub p50_us: f64,
    /// 99th percentile latency of the timed calls, in microseconds.
    pub p99_us: f64,
    /// One call in this many was timed.
    pub sample_every: u64,
    /// The check at the end.
    pub verification: Verification,
    /// Observations for the notes under the table.
    pub details: String,
}

impl Cell {
    fn from_driven(
        key: String,
        row: &str,
        shards: u16,
        writers: usize,
        d: &Driven,
        sample_every: u64,
    ) -> Self {
        Self {
            key,
            row: row.to_string(),
            shards,
            writers,
            rate: d.rate(),
            unit: "",
            p50_us: d.quantile_us(0.50),
            p99_us: d.quantile_us(0.99),
            sample_every,
            verification: Verification::Verified,
            details: String::new(),
        }
    }
}

fn err(e: TallyError) -> String {
    e.to_string()
}

/// `tally.incr("hot", Increment::new(1))` with no writer id (thread-affinity routing).
struct EngineIncr {
    tally: Tally,
}

impl Op for EngineIncr {
    async fn call(&self) -> Result<(), String> {
        let outcome = self.tally.incr(HOT, Increment::new(1)).await.map_err(err)?;
        if outcome.applied {
            Ok(())
        } else {
            Err(format!("increment not applied: {outcome:?}"))
        }
    }
}

/// The same through a resolved handle (`tally.handle("hot")`, then `incr_by(1)`):
/// no name lookup.
struct HandleIncr {
    handle: tally_engine::CounterHandle,
}

impl Op for HandleIncr {
    async fn call(&self) -> Result<(), String> {
        let outcome = self.handle.incr_by(1).await.map_err(err)?;
        if outcome.applied {
            Ok(())
        } else {
            Err(format!("increment not applied: {outcome:?}"))
        }
    }
}

/// The key of an engine or baseline cell.
pub fn hot_key(kind: &str, shards: u16, writers: usize) -> String {
    format!("{kind}/{shards}sh/{writers}w")
}

/// One hot counter hammered by `writers` tasks, then verified with a fresh read.
pub async fn hot_cell(
    durability: Durability,
    shards: u16,
    writers: usize,
    opts: &Options,
) -> anyhow::Result<Cell> {
    hot_cell_via(durability, shards, writers, opts, false).await
}

/// The key prefix of the cells that increment through a resolved handle.
pub const HANDLE_KIND: &str = "handle";

/// A fresh engine over a [`TimedStore`] in a tempdir (kept until this is dropped).
struct Timed {
    tally: Tally,
    store: Arc<TimedStore>,
    _dir: tempfile::TempDir,
}

/// What `Tally::open(dir, TallyConfig::default())` does, with the store's commits and
/// flushes timed.
async fn open_timed() -> anyhow::Result<Timed> {
    let dir = tempfile::tempdir()?;
    let store = Arc::new(TimedStore::open(dir.path())?);
    let tally = Tally::open_with(store.clone(), Arc::new(SystemClock), TallyConfig::default()).await?;
    Ok(Timed { tally, store, _dir: dir })
}

/// [`hot_cell`]; `via_handle`: every writer increments through one resolved
/// [`tally_engine::CounterHandle`] instead of by name (row `handle`).
pub async fn hot_cell_via(
    durability: Durability,
    shards: u16,
    writers: usize,
    opts: &Options,
    via_handle: bool,
) -> anyhow::Result<Cell> {
    let kind = if via_handle { HANDLE_KIND } else { durability.as_str() };
    let Timed { tally, store, _dir } = open_timed().await?;
    let patch = SpecPatch { shards: Some(shards), durability: Some(durability), ..SpecPatch::default() };
    tally.put_counter(HOT, patch).await?;
    let sample_every = if durability == Durability::Batched { opts.sample_every } else { 1 };
    let d = if via_handle {
        let op = Arc::new(HandleIncr { handle: tally.handle(HOT).await? });
        drive(op, writers, opts.duration(), sample_every).await
    } else {
        let op = Arc::new(EngineIncr { tally: tally.clone() });
        drive(op, writers, opts.duration(), sample_every).await
    };
    let read = tally.read(HOT, Consistency::Fresh).await.context("fresh read after the run")?;
    let mut cell = Cell::from_driven(hot_key(kind, shards, writers), kind, shards, writers, &d, sample_every);
    cell.verification = verify(read.value, &d);

    let report = tally.shards(HOT).await?;
    let used = report.shards.iter().filter(|s| s.value != 0).count();
    cell.details = format!(
        "{used} of {shards} shards received increments{}",
        engine_details(&tally, &store, durability)
    );
    tally.shutdown().await?;
    Ok(cell)
}

/// The engine's and the store's counts after a hot cell, each part after `"; "`.
fn engine_details(tally: &Tally, store: &TimedStore, durability: Durability) -> String {
    let stats = tally.stats();
    let mut details = String::new();
    match durability {
        Durability::Batched => {
            let drains = stats.drain_increments.snapshot();
            details += &format!(
                "; {} drains into shards, mean {:.0} increments each",
                drains.count,
                mean(drains.sum, drains.count)
            );
        }
        Durability::Sync => {
            let waiters = stats.flush_waiters.snapshot();
            let commits = stats.commit_submissions.snapshot();
            let cycles = stats.cycle_commits.snapshot();
            details += &format!(
                "; {} fsyncs, mean {:.1} waiters per fsync; {} shard commits, mean {:.1} increments each; \
                 {} commit cycles, mean {:.1} shard writes each",
                stats.flushes.get(),
                mean(waiters.sum, waiters.count),
                commits.count,
                mean(commits.sum, commits.count),
                cycles.count,
                mean(cycles.sum, cycles.count)
            );
        }
    }
    let t = store.times();
    details += &format!(
        "; store: {} commits p50/p99/max {:.0}/{:.0}/{:.0} µs, \
         {} flushes p50/p99/max {:.0}/{:.0}/{:.0} µs",
        t.commits,
        t.commit_us.0,
        t.commit_us.1,
        t.commit_us.2,
        t.flushes,
        t.flush_us.0,
        t.flush_us.1,
        t.flush_us.2
    );
    details
}

/// What a hot counter of a [`spec_cell`] carries besides its shards and durability,
/// and what its writers add. Each is measured beside the plain counter of the same
/// shards, durability and writers (`sync/8sh/64w`, `batched/8sh/64w`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// `min: Some(0)`, every shard stocked with one increment of `STOCK ÷ shards`
    /// (by a writer id that routes to it) before timing; writers add −1, each covered
    /// by the share of the shard it reaches.
    Bounded,
    /// `max: Some(STOCK)`: a new counter starts with the headroom below its bound split
    /// over its shards; writers add +1.
    BoundedMax,
    /// `min: Some(0)` with the whole stock put in by one increment, on a shard that
    /// none of the writers reaches: every decrement's headroom is borrowed from it.
    BoundedBorrow,
    /// Sliding windows [`WINDOWS`]; writers add +1.
    Windowed,
    /// A window limit of `STOCK` per minute on the `1m` window of [`WINDOWS`] (a
    /// rate limiter that never refuses here); writers add +1.
    Limited,
}

/// The windows of the [`Variant::Windowed`] cells.
pub const WINDOWS: [&str; 3] = ["1m", "1h", "24h"];
/// The window the windowed cells check against the acknowledged increments.
pub const CHECKED_WINDOW: &str = "1h";
/// The headroom of the bounded cells: far more than any cell spends (2^40, 12 days of
/// decrements at a million a second).
pub const STOCK: i64 = 1 << 40;

impl Variant {
    /// Every variant, in run order.
    pub const ALL: [Variant; 5] =
        [Variant::Bounded, Variant::BoundedMax, Variant::BoundedBorrow, Variant::Windowed, Variant::Limited];

    /// The durabilities it is measured with (bounds require `sync`).
    pub fn durabilities(self) -> &'static [Durability] {
        match self {
            Variant::Windowed => &[Durability::Sync, Durability::Batched],
            _ => &[Durability::Sync],
        }
    }

    /// The row and key prefix.
    pub fn kind(self, durability: Durability) -> &'static str {
        match (self, durability) {
            (Variant::Bounded, _) => "bounded",
            (Variant::BoundedMax, _) => "bounded-max",
            (Variant::BoundedBorrow, _) => "bounded-borrow",
            (Variant::Windowed, Durability::Sync) => "windowed",
            (Variant::Windowed, Durability::Batched) => "windowed-batched",
            (Variant::Limited, _) => "limited",
        }
    }

    /// What each writer adds.
    pub fn delta(self) -> i64 {
        match self {
            Variant::Bounded | Variant::BoundedBorrow => -1,
            Variant::BoundedMax | Variant::Windowed | Variant::Limited => 1,
        }
    }

    fn bounded(self) -> bool {
        self != Variant::Windowed
    }
}

/// `tally.incr("hot", Increment::new(delta))` on a bounded counter. A refusal
/// ([`TallyError::BoundExceeded`]) is not a failure: it is counted in `refused` and
/// returns `Ok`, so the driver counts it with the acknowledged calls and the cell
/// takes it off.
struct BoundedIncr {
    tally: Tally,
    delta: i64,
    refused: AtomicU64,
}

impl Op for BoundedIncr {
    async fn call(&self) -> Result<(), String> {
        match self.tally.incr(HOT, Increment::new(self.delta)).await {
            Ok(outcome) if outcome.applied => Ok(()),
            Ok(outcome) => Err(format!("increment not applied: {outcome:?}")),
            Err(TallyError::BoundExceeded { .. }) => {
                self.refused.fetch_add(1, Relaxed);
                Ok(())
            }
            Err(e) => Err(err(e)),
        }
    }
}

/// `tally.incr(name, Increment::new(1))`, for the routing probe.
struct ProbeIncr {
    tally: Tally,
    name: &'static str,
}

impl Op for ProbeIncr {
    async fn call(&self) -> Result<(), String> {
        self.tally.incr(self.name, Increment::new(1)).await.map(|_| ()).map_err(err)
    }
}

/// A writer id the `writer` router sends to `shard` of `shards`.
fn writer_for_shard(shard: u16, shards: u16) -> String {
    (0u64..)
        .map(|j| format!("stock-{j}"))
        .find(|w| tally_core::router::shard_of_writer(w, shards) == shard)
        .expect("some writer id routes to every shard")
}

/// The shards that increments without a writer id reach from the runtime's worker
/// threads (each thread keeps to one shard of a counter): 200 ms of `+1`s from at
/// least eight tasks on a throwaway `sync` counter of `shards` shards.
async fn writer_shards(tally: &Tally, shards: u16, writers: usize) -> anyhow::Result<Vec<u16>> {
    const PROBE: &str = "routing-probe";
    let patch =
        SpecPatch { shards: Some(shards), durability: Some(Durability::Sync), ..SpecPatch::default() };
    tally.put_counter(PROBE, patch).await?;
    let op = Arc::new(ProbeIncr { tally: tally.clone(), name: PROBE });
    let d = drive(op, writers.max(8), std::time::Duration::from_millis(200), 1).await;
    ensure!(d.errors == 0, "routing probe: {}", d.first_error.unwrap_or_default());
    let report = tally.shards(PROBE).await?;
    Ok(report.shards.iter().filter(|s| s.writes > 0).map(|s| s.index).collect())
}

/// Increments routed to each shard of the hot counter so far.
async fn shard_writes(tally: &Tally) -> anyhow::Result<Vec<(u16, u64)>> {
    Ok(tally.shards(HOT).await?.shards.iter().map(|s| (s.index, s.writes)).collect())
}

/// The key of a [`spec_cell`].
pub fn spec_key(variant: Variant, durability: Durability, shards: u16, writers: usize) -> String {
    hot_key(variant.kind(durability), shards, writers)
}

/// One hot counter of `variant` hammered by `writers` tasks, as in [`hot_cell`], then
/// verified: a bounded counter's fresh value must equal its stock plus the
/// acknowledged deltas (refusals are counted apart, not as acknowledged); a windowed
/// counter's fresh total and its [`CHECKED_WINDOW`] window must both equal the
/// acknowledged increments.
pub async fn spec_cell(
    variant: Variant,
    durability: Durability,
    shards: u16,
    writers: usize,
    opts: &Options,
) -> anyhow::Result<Cell> {
    let kind = variant.kind(durability);
    let Timed { tally, store, _dir } = open_timed().await?;
    let mut patch = SpecPatch { shards: Some(shards), durability: Some(durability), ..SpecPatch::default() };
    match variant {
        Variant::Bounded | Variant::BoundedBorrow => patch.min = Some(0),
        Variant::BoundedMax => patch.max = Some(STOCK),
        Variant::Windowed => patch.windows = Some(WindowSet::parse(&WINDOWS)?),
        Variant::Limited => {
            patch.windows = Some(WindowSet::parse(&WINDOWS)?);
            patch.limit = Some(tally_core::spec::WindowLimit::parse(WINDOWS[0], STOCK as u64)?);
        }
    }
    tally.put_counter(HOT, patch).await?;

    // The stock, put in before timing (for `min`: `max` starts with its headroom).
    let mut notes = Vec::new();
    let stock: i64 = match variant {
        Variant::Bounded => {
            let share = STOCK / i64::from(shards);
            for s in 0..shards {
                tally.incr(HOT, Increment::new(share).writer(writer_for_shard(s, shards))).await?;
            }
            notes.push(format!("stock {} in one increment per shard", share * i64::from(shards)));
            share * i64::from(shards)
        }
        Variant::BoundedBorrow => {
            let reached = writer_shards(&tally, shards, writers).await?;
            let stocked = (0..shards).find(|s| !reached.contains(s)).unwrap_or(0);
            tally.incr(HOT, Increment::new(STOCK).writer(writer_for_shard(stocked, shards))).await?;
            notes.push(format!(
                "stock {STOCK} in one increment on shard {stocked} (the writers' threads route to shards {reached:?})"
            ));
            STOCK
        }
        Variant::BoundedMax => {
            notes.push(format!("max {STOCK}, its headroom split over the shards at creation"));
            0
        }
        Variant::Limited => {
            notes.push(format!("limit {STOCK} per {}, split over the shards at creation", WINDOWS[0]));
            0
        }
        Variant::Windowed => 0,
    };
    let writes_before = shard_writes(&tally).await?;

    let sample_every = if durability == Durability::Batched { opts.sample_every } else { 1 };
    let (d, refused) = if variant.bounded() {
        let op = Arc::new(BoundedIncr {
            tally: tally.clone(),
            delta: variant.delta(),
            refused: AtomicU64::new(0),
        });
        let d = drive(op.clone(), writers, opts.duration(), sample_every).await;
        (d, op.refused.load(Relaxed))
    } else {
        let op = Arc::new(EngineIncr { tally: tally.clone() });
        (drive(op, writers, opts.duration(), sample_every).await, 0)
    };
    let acked = d.acked - refused;

    let read = tally.read(HOT, Consistency::Fresh).await.context("fresh read after the run")?;
    let expected = i128::from(stock) + i128::from(variant.delta()) * i128::from(acked);
    let mut cell = Cell::from_driven(hot_key(kind, shards, writers), kind, shards, writers, &d, sample_every);
    cell.rate = acked as f64 / d.elapsed.as_secs_f64();
    cell.verification = verify_expected(read.value, expected, acked, &d);
    if variant == Variant::Windowed && cell.verification == Verification::Verified {
        let w = tally.window(HOT, CHECKED_WINDOW).await.context("window read after the run")?;
        cell.verification = if !w.complete {
            Verification::Failed(format!("{CHECKED_WINDOW} window read incomplete: {:?}", w.missing_shards))
        } else if w.value != i128::from(acked) {
            Verification::Failed(format!("{CHECKED_WINDOW} window {} != acknowledged {acked}", w.value))
        } else {
            Verification::Verified
        };
        notes.push(format!(
            "{CHECKED_WINDOW} window = fresh total = {acked}; window buckets {} bytes (bound {})",
            w.window_bytes, w.window_bytes_bound
        ));
    }

    let writes_after = shard_writes(&tally).await?;
    let reached: Vec<u16> = writes_after
        .iter()
        .filter(|(i, w)| writes_before.iter().find(|(j, _)| j == i).is_none_or(|(_, b)| w > b))
        .map(|(i, _)| *i)
        .collect();
    let mut details = format!("increments reached shards {reached:?} of {shards}");
    for n in notes {
        details += "; ";
        details += &n;
    }
    if variant.bounded() {
        let stats = tally.stats();
        details += &format!(
            "; **{refused} refused** (engine: {} refusals; latency includes them); escrow: {} messages, {} grants",
            stats.bound_refusals.get(),
            stats.escrow_messages.get(),
            stats.escrow_grants_sent.get()
        );
    }
    details += &engine_details(&tally, &store, durability);
    cell.details = details;
    tally.shutdown().await?;
    Ok(cell)
}

fn mean(sum: u64, count: u64) -> f64 {
    if count == 0 {
        0.0
    } else {
        sum as f64 / count as f64
    }
}

fn verify(total: i128, d: &Driven) -> Verification {
    verify_expected(total, i128::from(d.acked), d.acked, d)
}

/// Verified when no call failed and the fresh `total` is `expected`, the value the
/// `acked` acknowledged calls (and any stock) add up to.
fn verify_expected(total: i128, expected: i128, acked: u64, d: &Driven) -> Verification {
    if d.errors > 0 {
        return Verification::Failed(format!(
            "{} calls failed (first: {}); total {total}, acknowledged {acked}",
            d.errors,
            d.first_error.as_deref().unwrap_or("?"),
        ));
    }
    if total != expected {
        return Verification::Failed(format!(
            "fresh total {total} != {expected} expected from {acked} acknowledged"
        ));
    }
    Verification::Verified
}

/// The naive hot row: one sled key behind a row lock; every increment reads, writes
/// value + 1 and flushes before it is acknowledged. The lock is held until the flush
/// completes, as a database holds a row lock until its transaction commits.
struct Baseline {
    db: sled::Db,
    row: tokio::sync::Mutex<()>,
}

const BASELINE_KEY: &[u8] = b"hot";

fn decode(v: Option<sled::IVec>) -> Result<u64, String> {
    match v {
        None => Ok(0),
        Some(b) => Ok(u64::from_be_bytes(b.as_ref().try_into().map_err(|_| "bad value".to_string())?)),
    }
}

impl Op for Baseline {
    async fn call(&self) -> Result<(), String> {
        let _row = self.row.lock().await;
        let v = decode(self.db.get(BASELINE_KEY).map_err(|e| e.to_string())?)?;
        self.db.insert(BASELINE_KEY, &(v + 1).to_be_bytes()).map_err(|e| e.to_string())?;
        self.db.flush_async().await.map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// The baseline: a one-shard counter that writes and flushes every increment to sled.
pub async fn baseline_cell(writers: usize, opts: &Options) -> anyhow::Result<Cell> {
    let dir = tempfile::tempdir()?;
    let db = sled::Config::new()
        .path(dir.path())
        .cache_capacity(SledConfig::DEFAULT_CACHE_CAPACITY_BYTES)
        .open()?;
    let op = Arc::new(Baseline { db: db.clone(), row: tokio::sync::Mutex::new(()) });
    let d = drive(op, writers, opts.duration(), 1).await;
    let total = decode(db.get(BASELINE_KEY)?).map_err(anyhow::Error::msg)?;
    let mut cell = Cell::from_driven(hot_key("baseline", 1, writers), "baseline", 1, writers, &d, 1);
    cell.verification = verify(i128::from(total), &d);
    cell.details = format!("{} sled flushes (one per increment)", d.acked);
    db.flush_async().await?;
    Ok(cell)
}

/// Reads of one counter, checked against its known total.
struct Read {
    tally: Tally,
    name: String,
    consistency: Consistency,
    expected: i128,
}

impl Op for Read {
    async fn call(&self) -> Result<(), String> {
        let r = self.tally.read(&self.name, self.consistency).await.map_err(err)?;
        if r.value != self.expected || !r.complete {
            return Err(format!("read {} (complete: {}), expected {}", r.value, r.complete, self.expected));
        }
        Ok(())
    }
}

/// Verified when reads ran and every one returned the expected total.
fn reads_verified(d: &Driven) -> Verification {
    match (&d.first_error, d.acked) {
        (None, n) if n > 0 => Verification::Verified,
        (e, _) => Verification::Failed(format!(
            "{} of {} reads wrong or failed (first: {})",
            d.errors,
            d.errors + d.acked,
            e.as_deref().unwrap_or("none ran")
        )),
    }
}

/// The key of a read cell.
pub fn read_key(consistency: Consistency, shards: u16) -> String {
    match consistency {
        Consistency::Cached => format!("cached-read/{shards}sh"),
        Consistency::Fresh => format!("fresh-read/{shards}sh"),
    }
}

/// One reader reading a counter whose every shard holds a value, with nothing else
/// running.
pub async fn read_cell(consistency: Consistency, shards: u16, opts: &Options) -> anyhow::Result<Cell> {
    let dir = tempfile::tempdir()?;
    let tally = Tally::open(dir.path(), TallyConfig::default()).await?;
    let name = "read-me";
    tally.put_counter(name, SpecPatch { shards: Some(shards), ..SpecPatch::default() }).await?;
    // Writer ids spread increments over the shards; keep adding until each holds some.
    let mut written = 0i128;
    for round in 0..64 {
        for w in 0..shards * 4 {
            tally.incr(name, Increment::new(1).writer(format!("w-{round}-{w}"))).await?;
            written += 1;
        }
        let report = tally.shards(name).await?;
        if report.shards.iter().all(|s| s.value != 0) {
            break;
        }
    }
    let populated = tally.shards(name).await?.shards.iter().filter(|s| s.value != 0).count();
    let fresh = tally.read(name, Consistency::Fresh).await?;
    ensure!(fresh.value == written, "fresh read {} after writing {written}", fresh.value);
    // The first cached read computes the rollup's entry; the measured ones hit it.
    tally.read(name, Consistency::Cached).await?;
    let op = Arc::new(Read { tally: tally.clone(), name: name.into(), consistency, expected: written });
    let d = drive(op, 1, opts.duration(), 1).await;
    let label = match consistency {
        Consistency::Cached => "cached read",
        Consistency::Fresh => "fresh read",
    };
    let mut cell = Cell::from_driven(read_key(consistency, shards), label, shards, 1, &d, 1);
    cell.unit = "reads/s";
    cell.verification = reads_verified(&d);
    cell.details = format!("{populated} of {shards} shards hold a value; every read returned {written}");
    tally.shutdown().await?;
    Ok(cell)
}

/// Reads that cycle through many cached counters.
struct ManyReads {
    tally: Tally,
    counters: usize,
    next: std::sync::atomic::AtomicUsize,
}

fn many_name(i: usize) -> String {
    format!("active:{i}")
}

impl Op for ManyReads {
    async fn call(&self) -> Result<(), String> {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.counters;
        let r = self.tally.read(&many_name(i), Consistency::Cached).await.map_err(err)?;
        if r.value != 1 || !r.complete {
            return Err(format!("{}: read {} (complete: {}), expected 1", many_name(i), r.value, r.complete));
        }
        Ok(())
    }
}

/// The key of the many-counters cached-read cell.
pub fn many_cached_key(counters: usize) -> String {
    format!("cached-read/{counters}ctr")
}

/// `counters` active counters (default spec, one increment each) all read once with
/// `cached` — each a first read that fills the rollup — and then read in turn for the
/// cell's duration while the rollup keeps every one of them refreshed.
pub async fn many_cached_cell(counters: usize, opts: &Options) -> anyhow::Result<Cell> {
    let dir = tempfile::tempdir()?;
    let tally = Tally::open(dir.path(), TallyConfig::default()).await?;
    let creators = 64;
    let mut tasks = Vec::new();
    for c in 0..creators {
        let tally = tally.clone();
        tasks.push(tokio::spawn(async move {
            for i in (c..counters).step_by(creators) {
                tally.incr(&many_name(i), Increment::new(1)).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    // Delivered and cached: every counter's first cached read loads it.
    let started = std::time::Instant::now();
    let mut first = histogram_us();
    for i in 0..counters {
        let _ = tally.read(&many_name(i), Consistency::Fresh).await?;
    }
    for i in 0..counters {
        let t = std::time::Instant::now();
        let r = tally.read(&many_name(i), Consistency::Cached).await?;
        ensure!(r.value == 1, "{}: first cached read {}", many_name(i), r.value);
        first.record(t.elapsed().as_micros() as u64)?;
    }
    let fill_s = started.elapsed().as_secs_f64();
    let op = Arc::new(ManyReads { tally: tally.clone(), counters, next: Default::default() });
    let d = drive(op, 1, opts.duration(), 1).await;
    let mut cell = Cell::from_driven(many_cached_key(counters), "cached read, many counters", 8, 1, &d, 1);
    cell.unit = "reads/s";
    cell.verification = reads_verified(&d);
    let (active, _) = tally.active();
    cell.details = format!(
        "{counters} counters of 8 shards, {active} active; first cached reads: p50 {} µs, p99 {} µs ({fill_s:.1} s with the fresh reads before them)",
        first.value_at_quantile(0.5),
        first.value_at_quantile(0.99)
    );
    tally.shutdown().await?;
    Ok(cell)
}

fn histogram_us() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}
