//! Sources of truth for the reconciler: `tallyd` recomputes authoritative totals on
//! a schedule and corrects the counters' drift through the engine's idempotent
//! `Tally::reconcile`.
//!
//! * [`config`] — the `[[reconcile]]` sections: counter pattern, schedule, backend.
//! * [`postgres`] — one parameterized query per counter, pooled and time-bounded.
//! * [`pg_tls`] — TLS to PostgreSQL (`sslmode=verify-full` / `verify-ca`) over rustls.
//! * [`event_log`] — a streaming recount of a directory of JSON-lines events.
//! * [`runs`] — the bounded, persisted [`RunBook`] of every run.
//!
//! A run lists the existing counters that match the pattern (through
//! `Tally::list_counters`, in pages), asks the source for each one's total, and
//! reconciles the counter against it. A source that cannot give a complete total
//! records the run as `source_failed` and writes nothing. In a cluster only the
//! metadata leader runs the schedules (see [`Scheduler::start`]'s `owner`).

pub mod config;
pub mod event_log;
pub mod pg_tls;
pub mod postgres;
pub mod runs;

pub use config::{EventLogSource, Pattern, PostgresSource, Schedule, SourceConfig, SourceConfigError};
pub use runs::{RunBook, RunOutcome, RunRecord};

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tally_engine::{Tally, TallyError, LIST_PAGE_COUNTERS_MAX};
use tokio::task::JoinHandle;

/// Most counters one run of one source reconciles; the rest wait for the next run
/// (a warning names the source). Bounds a run's time and its list in memory.
pub const SOURCE_RUN_COUNTERS_MAX: usize = 100_000;

/// Whether this node should run the schedules right now (a cluster: whether it
/// leads the metadata group).
pub type OwnerCheck = Arc<dyn Fn() -> bool + Send + Sync>;

/// The current time in Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The running schedules of a node's sources; stopping it (or dropping it) aborts
/// them. A run cut short by a stop has written only whole corrections.
pub struct Scheduler {
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// What one run does, shared by its scheduled task.
struct Source {
    cfg: SourceConfig,
    pattern: Pattern,
    schedule: Schedule,
    /// The PostgreSQL pool, built on the first run.
    pg: tokio::sync::OnceCell<Result<postgres::PgSource, String>>,
}

/// What a run needs of the node.
#[derive(Clone)]
pub struct RunContext {
    /// The engine whose counters are reconciled.
    pub tally: Tally,
    /// This node's id, recorded with every run.
    pub node: String,
    /// Where runs are recorded.
    pub book: Arc<RunBook>,
}

impl Scheduler {
    /// Starts one task per source (validated sources only: [`crate::Config::validate`]
    /// checks them). Each waits for its schedule's next instant, asks `owner`, and
    /// runs only if this node is the owner, so a cluster's runs are not duplicated.
    pub fn start(sources: &[SourceConfig], ctx: RunContext, owner: OwnerCheck) -> Self {
        let mut tasks = Vec::new();
        for cfg in sources {
            let (Ok(pattern), Ok(schedule)) = (cfg.pattern(), cfg.schedule()) else {
                tracing::error!(source = %cfg.name, "source of truth not validated; not scheduled");
                continue;
            };
            let source =
                Arc::new(Source { cfg: cfg.clone(), pattern, schedule, pg: tokio::sync::OnceCell::new() });
            let (ctx, owner) = (ctx.clone(), owner.clone());
            tracing::info!(source = %cfg.name, counters = %cfg.counters, every = %cfg.every, "reconciliation scheduled");
            tasks.push(tokio::spawn(async move {
                loop {
                    let now = now_ms();
                    let next = source.schedule.next_after(now);
                    tokio::time::sleep(Duration::from_millis(next - now)).await;
                    if !owner() {
                        tracing::debug!(source = %source.cfg.name, "not the owner of the schedule; skipping this run");
                        continue;
                    }
                    run_once(&source, &ctx, next).await;
                    let book = ctx.book.clone();
                    let _ = tokio::task::spawn_blocking(move || book.persist()).await;
                }
            }));
        }
        Self { tasks: Mutex::new(tasks) }
    }

    /// A scheduler with nothing to run.
    pub fn none() -> Self {
        Self { tasks: Mutex::new(Vec::new()) }
    }

    /// Aborts every schedule.
    pub fn stop(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The existing counters `pattern` matches, with their placeholder values, at most
/// [`SOURCE_RUN_COUNTERS_MAX`].
fn matching_counters(
    tally: &Tally,
    pattern: &Pattern,
    source: &str,
) -> Result<Vec<(String, Vec<String>)>, TallyError> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = tally.list_counters(pattern.prefix(), after.as_deref(), LIST_PAGE_COUNTERS_MAX)?;
        for name in page.counters {
            if let Some(values) = pattern.matches(&name) {
                if out.len() >= SOURCE_RUN_COUNTERS_MAX {
                    tracing::warn!(
                        source,
                        limit = SOURCE_RUN_COUNTERS_MAX,
                        "more matching counters than one run reconciles; the rest wait"
                    );
                    return Ok(out);
                }
                out.push((name, values));
            }
        }
        match page.next {
            Some(next) => after = Some(next),
            None => return Ok(out),
        }
    }
}

/// Reconciles `name` against `authoritative` as `source`'s run of `instant_ms` and
/// records the run.
async fn reconcile_one(ctx: &RunContext, source: &str, instant_ms: u64, name: &str, authoritative: i128) {
    let at_ms = now_ms();
    let result = ctx.tally.reconcile_scheduled(name, authoritative, source, instant_ms).await;
    match &result {
        Ok(r) if r.corrected => tracing::info!(source, counter = name, drift = %r.drift, "corrected drift"),
        Ok(_) => tracing::debug!(source, counter = name, "no drift"),
        Err(e) => {
            tracing::warn!(source, counter = name, error = %e, "reconciliation refused; nothing written")
        }
    }
    ctx.book.record(name, RunRecord::from_engine(at_ms, source, &ctx.node, authoritative, &result));
}

/// One run of `source` over every matching counter, for its instant `instant_ms`.
async fn run_once(source: &Source, ctx: &RunContext, instant_ms: u64) {
    let name = source.cfg.name.as_str();
    let counters = match matching_counters(&ctx.tally, &source.pattern, name) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(source = name, error = %e, "cannot list the counters to reconcile; run skipped");
            return;
        }
    };
    if let Some(pg_cfg) = &source.cfg.postgres {
        let pg = source
            .pg
            .get_or_init(|| async { postgres::PgSource::new(pg_cfg).map_err(|e| e.to_string()) })
            .await;
        for (counter, values) in &counters {
            let total = match pg {
                Ok(pg) => pg.total(values).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.clone()),
            };
            match total {
                Ok(total) => reconcile_one(ctx, name, instant_ms, counter, total).await,
                Err(e) => {
                    tracing::warn!(source = name, counter = %counter, error = %e, "source gave no total; nothing written");
                    ctx.book.record(counter, RunRecord::source_failed(now_ms(), name, &ctx.node, &e));
                }
            }
        }
    } else if let Some(log) = &source.cfg.event_log {
        let (dir, pattern) = (log.dir.clone(), source.pattern.clone());
        let recount = tokio::task::spawn_blocking(move || event_log::recount(&dir, &pattern))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        match recount {
            Ok(r) => {
                tracing::debug!(
                    source = name,
                    files = r.files,
                    events = r.events,
                    duplicates = r.duplicates,
                    "event log recounted"
                );
                for (counter, _) in &counters {
                    let total = r.totals.get(counter).copied().unwrap_or(0);
                    reconcile_one(ctx, name, instant_ms, counter, total).await;
                }
            }
            Err(e) => {
                tracing::warn!(source = name, error = %e, "event log unreadable; nothing written");
                for (counter, _) in &counters {
                    ctx.book.record(counter, RunRecord::source_failed(now_ms(), name, &ctx.node, &e));
                }
            }
        }
    }
}
