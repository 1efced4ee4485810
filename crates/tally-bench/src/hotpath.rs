//! The hot-path cells: each measures one figure beside the reference it is judged
//! against, in the same run, so the report can print a ratio.
//!
//! * `hotpath/sync/1sh/1w` beside `hotpath/baseline/1w`: one writer on a one-shard
//!   `sync` counter against the per-increment-flush sled row;
//! * `hotpath/new-counters/Nw` beside `hotpath/existing-counters/Nw`: first increments
//!   to never-seen counters (default spec) against increments spread over counters
//!   that exist and are active;
//! * `hotpath/fresh-read-8w/64sh`: one reader's fresh reads of a batched 64-shard
//!   counter while 8 writers increment it (each at a paced rate, as network clients
//!   would), against the same reads with nothing else running.

use crate::cells::{Cell, Verification};
use crate::drive::{drive, Driven, Op};
use crate::options::Options;
use anyhow::{ensure, Context as _};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tally_engine::{Consistency, Durability, Increment, SpecPatch, Tally, TallyConfig};

/// Key prefix of every cell here.
pub const PREFIX: &str = "hotpath";
/// Writers of the new- and existing-counter cells.
pub const CREATE_WRITERS: usize = 64;
/// Counters the existing-counter cell spreads its increments over.
pub const EXISTING_COUNTERS: u64 = 1024;
/// Background writers of the fresh-read cell.
pub const READ_WRITERS: usize = 8;
/// Shards of the fresh-read cell's counter.
pub const READ_SHARDS: u16 = 64;
/// Each background writer of the fresh-read cell sends this many increments per
/// millisecond tick (8 writers: about 16,000 increments/s, the rate HTTP writers reach).
pub const READ_WRITER_BURST: u64 = 2;

/// The cell keys, in run order.
pub fn keys() -> Vec<String> {
    vec![
        format!("{PREFIX}/baseline/1w"),
        format!("{PREFIX}/sync/1sh/1w"),
        format!("{PREFIX}/sync/64sh/64w"),
        format!("{PREFIX}/existing-counters/{CREATE_WRITERS}w"),
        format!("{PREFIX}/new-counters/{CREATE_WRITERS}w"),
        format!("{PREFIX}/fresh-read-idle/{READ_SHARDS}sh"),
        format!("{PREFIX}/fresh-read-{READ_WRITERS}w/{READ_SHARDS}sh"),
    ]
}

/// Measures the cell `key` (one of [`keys`]).
pub async fn cell(key: &str, opts: &Options) -> anyhow::Result<Cell> {
    let rest = key.strip_prefix(PREFIX).and_then(|k| k.strip_prefix('/')).context("not a hot-path key")?;
    let mut c = match rest {
        "baseline/1w" => crate::cells::baseline_cell(1, opts).await?,
        "sync/1sh/1w" => crate::cells::hot_cell(Durability::Sync, 1, 1, opts).await?,
        "sync/64sh/64w" => crate::cells::hot_cell(Durability::Sync, 64, 64, opts).await?,
        r if r.starts_with("existing-counters/") => counters_cell(false, opts).await?,
        r if r.starts_with("new-counters/") => counters_cell(true, opts).await?,
        r if r.starts_with("fresh-read-idle/") => fresh_read_cell(0, opts).await?,
        r if r.starts_with("fresh-read-") => fresh_read_cell(READ_WRITERS, opts).await?,
        other => anyhow::bail!("unknown hot-path cell {other}"),
    };
    c.key = key.to_string();
    c.row = format!("{PREFIX}: {rest}");
    Ok(c)
}

/// Increments by name: `new`, a counter nobody created per call; otherwise the
/// [`EXISTING_COUNTERS`] counters in turn.
struct Counters {
    tally: Tally,
    new: bool,
    next: AtomicU64,
}

impl Op for Counters {
    async fn call(&self) -> Result<(), String> {
        let i = self.next.fetch_add(1, Relaxed);
        let name = if self.new { format!("new:{i}") } else { format!("old:{}", i % EXISTING_COUNTERS) };
        let outcome = self.tally.incr(&name, Increment::new(1)).await.map_err(|e| e.to_string())?;
        if outcome.applied {
            Ok(())
        } else {
            Err(format!("{name}: not applied"))
        }
    }
}

async fn counters_cell(new: bool, opts: &Options) -> anyhow::Result<Cell> {
    let dir = tempfile::tempdir()?;
    let tally = Tally::open(dir.path(), TallyConfig::default()).await?;
    if !new {
        for i in 0..EXISTING_COUNTERS {
            tally.incr(&format!("old:{i}"), Increment::new(1)).await?;
        }
    }
    let op = Arc::new(Counters { tally: tally.clone(), new, next: AtomicU64::new(0) });
    let d = drive(op.clone(), CREATE_WRITERS, opts.duration(), 1).await;
    let row = if new { "new counters" } else { "existing counters" };
    let mut cell = from_driven(row, 8, CREATE_WRITERS, &d);
    let verification = if new { verify_new(&tally, &d).await } else { verify_existing(&tally, &d).await };
    cell.verification = verification.unwrap_or_else(|e| Verification::Failed(format!("{e:#}")));
    let stats = tally.stats();
    cell.details = format!(
        "{} fsyncs; {} shard actor starts; {} first writes without an actor",
        stats.flushes.get(),
        stats.shard_activations.get(),
        stats.cold_writes.get()
    );
    tally.shutdown().await?;
    Ok(cell)
}

fn from_driven(row: &str, shards: u16, writers: usize, d: &Driven) -> Cell {
    Cell {
        key: String::new(),
        row: row.to_string(),
        shards,
        writers,
        rate: d.rate(),
        unit: "",
        p50_us: d.quantile_us(0.5),
        p99_us: d.quantile_us(0.99),
        sample_every: 1,
        verification: Verification::Verified,
        details: String::new(),
    }
}

fn no_errors(d: &Driven) -> anyhow::Result<()> {
    ensure!(d.errors == 0, "{} calls failed (first: {})", d.errors, d.first_error.as_deref().unwrap_or("?"));
    Ok(())
}

/// Every acknowledged first increment left a listed counter.
async fn verify_new(tally: &Tally, d: &Driven) -> anyhow::Result<Verification> {
    no_errors(d)?;
    let mut listed = 0u64;
    let mut after: Option<String> = None;
    loop {
        let page = tally.list_counters("new:", after.as_deref(), tally_engine::LIST_PAGE_COUNTERS_MAX)?;
        listed += page.counters.len() as u64;
        match page.next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    ensure!(listed == d.acked, "{listed} counters listed after {} first increments", d.acked);
    Ok(Verification::Verified)
}

/// The existing counters' fresh totals add up to their first increments plus the
/// acknowledged ones.
async fn verify_existing(tally: &Tally, d: &Driven) -> anyhow::Result<Verification> {
    no_errors(d)?;
    let mut total = 0i128;
    for i in 0..EXISTING_COUNTERS {
        let r = tally.read(&format!("old:{i}"), Consistency::Fresh).await?;
        ensure!(r.complete, "old:{i}: incomplete read");
        total += r.value;
    }
    let expected = i128::from(EXISTING_COUNTERS) + i128::from(d.acked);
    ensure!(total == expected, "totals {total}, expected {expected}");
    Ok(Verification::Verified)
}

/// A fresh read that must see at least every increment acknowledged before it began.
struct FreshRead {
    tally: Tally,
    acked: Arc<AtomicU64>,
}

const READ_COUNTER: &str = "read-hot";

impl Op for FreshRead {
    async fn call(&self) -> Result<(), String> {
        let before = self.acked.load(Relaxed);
        let r = self.tally.read(READ_COUNTER, Consistency::Fresh).await.map_err(|e| e.to_string())?;
        if !r.complete || r.value < i128::from(before) {
            return Err(format!("read {} (complete: {}) after {before} acknowledged", r.value, r.complete));
        }
        Ok(())
    }
}

async fn fresh_read_cell(writers: usize, opts: &Options) -> anyhow::Result<Cell> {
    let dir = tempfile::tempdir()?;
    let tally = Tally::open(dir.path(), TallyConfig::default()).await?;
    let patch = SpecPatch { shards: Some(READ_SHARDS), ..SpecPatch::default() };
    tally.put_counter(READ_COUNTER, patch).await?;
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let background: Vec<_> = (0..writers)
        .map(|w| {
            let (tally, acked, stop) = (tally.clone(), acked.clone(), stop.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    tick.tick().await;
                    for _ in 0..READ_WRITER_BURST {
                        n += 1;
                        let inc = Increment::new(1).writer(format!("w{w}-{}", n % 64));
                        tally.incr(READ_COUNTER, inc).await?;
                        acked.fetch_add(1, Relaxed);
                    }
                }
                anyhow::Ok(())
            })
        })
        .collect();
    let op = Arc::new(FreshRead { tally: tally.clone(), acked: acked.clone() });
    let started = std::time::Instant::now();
    let d = drive(op, 1, opts.duration(), 1).await;
    stop.store(true, Relaxed);
    for t in background {
        t.await??;
    }
    let written = acked.load(Relaxed);
    let mut cell = from_driven("fresh read", READ_SHARDS, 1, &d);
    cell.unit = "reads/s";
    let last = tally.read(READ_COUNTER, Consistency::Fresh).await?;
    cell.verification = if d.errors > 0 {
        Verification::Failed(format!(
            "{} reads wrong (first: {})",
            d.errors,
            d.first_error.unwrap_or_default()
        ))
    } else if last.value != i128::from(written) {
        Verification::Failed(format!("final fresh read {} after {written} acknowledged", last.value))
    } else {
        Verification::Verified
    };
    cell.details = format!(
        "{writers} writers acknowledged {written} increments ({:.0}/s) meanwhile; {} fsyncs",
        written as f64 / started.elapsed().as_secs_f64(),
        tally.stats().flushes.get()
    );
    tally.shutdown().await?;
    Ok(cell)
}
