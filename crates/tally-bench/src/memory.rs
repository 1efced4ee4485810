//! Memory per idle counter: create many counters with one increment each, wait until
//! the engine has evicted their runtimes and stopped their shard actors, then compare
//! the process's resident memory and the store's size with the start.

use crate::options::Options;
use anyhow::{bail, ensure};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_engine::{Consistency, Increment, Tally, TallyConfig};

/// Idle time after which this row's engine evicts runtimes and stops shard actors.
pub const IDLE_MS: u64 = 2_000;
/// Tasks creating counters at once.
pub const CREATORS: usize = 256;
/// How long to wait for the engine to go idle before giving up.
const IDLE_WAIT_MAX: Duration = Duration::from_secs(120);
/// Counters read back at the end.
const SPOT_CHECKS: usize = 100;

/// What the memory row measured.
#[derive(Debug, Clone)]
pub struct MemoryReport {
    /// Counters created.
    pub counters: usize,
    /// Counters created in the warm-up phase (a tenth).
    pub warm_counters: usize,
    /// Resident memory with the engine open and empty, in bytes.
    pub rss_before: u64,
    /// Resident memory once the warm-up counters were idle, in bytes.
    pub rss_warm: u64,
    /// Resident memory right after the last counter was created, in bytes.
    pub rss_loaded: u64,
    /// Peak resident memory of the process so far, in bytes.
    pub rss_peak: u64,
    /// Resident memory once the engine was idle, in bytes.
    pub rss_after: u64,
    /// Resident memory after the engine shut down and its store closed, in bytes.
    pub rss_closed: u64,
    /// The store's size on disk at the end, in bytes.
    pub disk_bytes: u64,
    /// Time to create every counter (including the idle wait after the warm-up).
    pub create_time: Duration,
    /// Time from the last creation until the engine was idle.
    pub idle_time: Duration,
    /// Active counters and running shard actors when the row finished waiting.
    pub active_at_end: (usize, usize),
    /// Most active counters and shard actors seen while creating.
    pub active_peak: (usize, usize),
    /// Counters read back, all equal to 1.
    pub spot_checked: usize,
}

impl MemoryReport {
    /// The key `--only` matches.
    pub const KEY: &'static str = "memory";
}

/// Resident and peak resident memory of this process, in bytes, from /proc/self/status.
pub fn rss() -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or_else(|| anyhow::anyhow!("no {name} in /proc/self/status"))?;
        let kb: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse()?;
        Ok(kb * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Creates counters `c:{from}` .. `c:{to - 1}` with one increment each, from
/// [`CREATORS`] tasks. Returns the most live (counters, shard actors) seen meanwhile.
async fn create(tally: &Tally, from: usize, to: usize, started: Instant) -> anyhow::Result<(usize, usize)> {
    let next = Arc::new(AtomicUsize::new(from));
    let failures = Arc::new(AtomicU64::new(0));
    let creators: Vec<_> = (0..CREATORS.min(to - from))
        .map(|_| {
            let (tally, next, failures) = (tally.clone(), next.clone(), failures.clone());
            tokio::spawn(async move {
                let mut first_error = None;
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    if i >= to {
                        return first_error;
                    }
                    match tally.incr(&format!("c:{i}"), Increment::new(1)).await {
                        Ok(o) if o.applied => {}
                        other => {
                            failures.fetch_add(1, Relaxed);
                            first_error.get_or_insert(format!("c:{i}: {other:?}"));
                        }
                    }
                }
            })
        })
        .collect();
    // Watch progress (and the live set) while the creators run.
    let mut active_peak = (0, 0);
    let mut last_report = Instant::now();
    while !creators.iter().all(|t| t.is_finished()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (c, s) = tally.active();
        active_peak = (active_peak.0.max(c), active_peak.1.max(s));
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            let done = next.load(Relaxed).min(to);
            eprintln!(
                "  memory: {done}/{to} counters created in {:.0?} ({:.0}/s); active {c} counters, {s} shard actors",
                started.elapsed(),
                done as f64 / started.elapsed().as_secs_f64()
            );
        }
    }
    let mut first_error = None;
    for t in creators {
        if let Some(e) = t.await? {
            first_error.get_or_insert(e);
        }
    }
    let failed = failures.load(Relaxed);
    if failed > 0 {
        bail!(
            "{failed} of {} creating increments failed (first: {})",
            to - from,
            first_error.unwrap_or_default()
        );
    }
    Ok(active_peak)
}

/// Waits until no counter runtime and no shard actor is live (or [`IDLE_WAIT_MAX`]).
async fn wait_idle(tally: &Tally) -> (usize, usize) {
    let started = Instant::now();
    let mut active = tally.active();
    while active != (0, 0) && started.elapsed() < IDLE_WAIT_MAX {
        tokio::time::sleep(Duration::from_millis(100)).await;
        active = tally.active();
    }
    active
}

/// Runs the memory row: a warm-up tenth of the counters first (so that fixed costs such
/// as sled's cache and the runtime's threads are paid), idle; then the rest, idle.
pub async fn memory_row(opts: &Options) -> anyhow::Result<MemoryReport> {
    let n = opts.counters;
    ensure!(n >= 2, "--counters must be at least 2");
    let warm = (n / 10).max(1);
    let dir = tempfile::tempdir()?;
    let config =
        TallyConfig { counter_idle_evict_ms: IDLE_MS, shard_idle_stop_ms: IDLE_MS, ..TallyConfig::default() };
    let tally = Tally::open(dir.path(), config).await?;
    let (rss_before, _) = rss()?;

    let started = Instant::now();
    let peak_warm = create(&tally, 0, warm, started).await?;
    wait_idle(&tally).await;
    let (rss_warm, _) = rss()?;
    let peak_rest = create(&tally, warm, n, started).await?;
    let create_time = started.elapsed();
    let (rss_loaded, _) = rss()?;

    let idle_started = Instant::now();
    let active = wait_idle(&tally).await;
    let idle_time = idle_started.elapsed();
    let (rss_after, rss_peak) = rss()?;
    let disk_bytes = tally.store().size_on_disk()?;

    let mut spot_checked = 0;
    for k in 0..SPOT_CHECKS.min(n) {
        let i = k * n / SPOT_CHECKS.min(n);
        let name = format!("c:{i}");
        let read = tally.read(&name, Consistency::Fresh).await?;
        ensure!(read.value == 1, "{name} reads {} (expected 1)", read.value);
        spot_checked += 1;
    }
    tally.shutdown().await?;
    drop(tally);
    // sled closes when its last handle goes; give its threads a moment to let go.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_closed, _) = rss()?;
    Ok(MemoryReport {
        counters: n,
        warm_counters: warm,
        rss_before,
        rss_warm,
        rss_loaded,
        rss_peak,
        rss_after,
        rss_closed,
        disk_bytes,
        create_time,
        idle_time,
        active_at_end: active,
        active_peak: (peak_warm.0.max(peak_rest.0), peak_warm.1.max(peak_rest.1)),
        spot_checked,
    })
}
