//! The measured cells: hot engine counters, the per-increment sled baseline, and reads.

use crate::drive::{drive, Driven, Op};
use crate::options::Options;
use crate::timed_store::TimedStore;
use anyhow::{ensure, Context as _};
use std::sync::Arc;
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

/// The same through a resolved handle (`tally.handle("hot")`): no name lookup.
struct HandleIncr {
    handle: tally_engine::CounterHandle,
}

impl Op for HandleIncr {
    async fn call(&self) -> Result<(), String> {
        let outcome = self.handle.incr(Increment::new(1)).await.map_err(err)?;
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
    let dir = tempfile::tempdir()?;
    // What `Tally::open(dir, TallyConfig::default())` does, with the store's commits and
    // flushes timed.
    let store = Arc::new(TimedStore::open(dir.path())?);
    let tally = Tally::open_with(store.clone(), Arc::new(SystemClock), TallyConfig::default()).await?;
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
    let stats = tally.stats();
    let mut details = format!("{used} of {shards} shards received increments");
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
    if d.errors > 0 {
        return Verification::Failed(format!(
            "{} calls failed (first: {}); total {total}, acknowledged {}",
            d.errors,
            d.first_error.as_deref().unwrap_or("?"),
            d.acked
        ));
    }
    if total != i128::from(d.acked) {
        return Verification::Failed(format!("fresh total {total} != acknowledged {}", d.acked));
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
