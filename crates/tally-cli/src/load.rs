//! `tally load`: concurrent writers hammer one counter for a fixed time, then a
//! report of what was acknowledged, what failed and how long requests took — and,
//! with `--verify`, a fresh read proving the counter grew by exactly the
//! acknowledged count.
//!
//! # How a run goes
//!
//! 1. With `--create-shards`/`--durability`/`--flush-ms`, the counter is created
//!    (or updated) first; with `--verify`, a fresh read takes the baseline.
//! 2. `--writers` tasks start, spread round-robin over the nodes, each with its own
//!    keep-alive connection. Each loops until the deadline: one request at a time,
//!    either a single increment (`POST /v1/counters/NAME/increments`) or a batch of
//!    `--batch` increments (`POST /v1/increments`). No request starts after the
//!    deadline; one in flight finishes or hits `--timeout-ms`, so a run lasts at most
//!    the duration plus one timeout. A failed request is followed by a short pause so
//!    an unreachable node is not spun on.
//! 3. Latencies of answered requests go to per-writer HDR histograms (µs), merged at
//!    the end: per request, and per increment (the request's latency divided by the
//!    increments it carried — the amortized cost, equal to per request for single
//!    increments).
//! 4. With `--verify`: for a `batched` counter the run first waits `flush_ms` (plus a
//!    margin) so other nodes' buffers reach the shards, then reads fresh. PASS means
//!    every shard answered both reads and the total grew by at least the acknowledged
//!    count and at most that plus the failed increments (a request that timed out or
//!    was refused with 503 may have been applied without an acknowledgement; with no
//!    failures, the growth must be exact). Anything else writing the counter meanwhile
//!    makes it FAIL.

use crate::client::{codes, CliError, Client};
use crate::render;
use crate::wire::{
    BatchBody, BatchItem, BatchResults, CounterInfo, IncrOutcome, IncrementBody, ItemResult, SpecBody,
    ValueRead,
};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use reqwest::{Method, Url};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Pause after a failed request, in milliseconds, so a dead node is not spun on.
const ERROR_BACKOFF_MS: u64 = 20;
/// Extra wait after `flush_ms` before the verifying read of a `batched` counter.
const VERIFY_FLUSH_MARGIN_MS: u64 = 100;
/// How often the progress bar is redrawn, per second.
const PROGRESS_HZ: u8 = 4;
/// How often the progress figures are recomputed, in milliseconds.
const PROGRESS_TICK_MS: u64 = 250;
/// Significant digits kept by the latency histograms.
const HISTOGRAM_SIGFIG: u8 = 3;

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// The counter written.
    pub counter: String,
    /// The nodes the writers are spread over (at least one); the first one also
    /// creates and verifies.
    pub nodes: Vec<Url>,
    /// Concurrent writers.
    pub writers: u32,
    /// How long writers start new requests.
    pub duration: Duration,
    /// Increments per request (1: the single-increment endpoint).
    pub batch: u32,
    /// Whether every increment carries a unique event id.
    pub event_ids: bool,
    /// Whether every increment carries its writer's next sequence number instead
    /// (each writer a new writer id per run; a failed request is resent with the
    /// same sequences).
    pub sequences: bool,
    /// Per-request timeout.
    pub timeout: Duration,
    /// The only CA trusted for `https://` nodes (`--cacert`); the system's roots
    /// when absent.
    pub cacert: Option<reqwest::Certificate>,
    /// The spec to create (or update) the counter with before the run.
    pub create: Option<SpecBody>,
    /// Whether to verify the total after the run.
    pub verify: bool,
    /// Whether to draw a progress bar on standard error (when it is a terminal).
    pub progress: bool,
    /// The client token every request carries.
    pub token: Option<String>,
}

/// Latency percentiles, in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples recorded (answered requests).
    pub count: u64,
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Largest.
    pub max: u64,
    /// Mean.
    pub mean: f64,
}

impl Percentiles {
    fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        Self {
            count: h.len(),
            p50: h.value_at_quantile(0.5),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
            mean: (h.mean() * 10.0).round() / 10.0,
        }
    }
}

/// Latencies of answered requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Latencies {
    /// Per request.
    pub per_request: Percentiles,
    /// Per increment: each request's latency divided by the increments it carried.
    pub per_increment: Percentiles,
}

/// The verifying read's findings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verify {
    /// The fresh total before the run (0 for a counter that did not exist).
    pub before: i128,
    /// The fresh total after the run.
    pub after: i128,
    /// `after - before`.
    pub grew: i128,
    /// What it should have grown by: the acknowledged increments.
    pub expected: i128,
    /// Failed increments, which may have been applied all the same: the growth may
    /// exceed `expected` by up to this much.
    pub unknown: i128,
    /// Whether every shard answered both reads.
    pub complete: bool,
    /// How long the run waited for `batched` buffers before reading, in milliseconds.
    pub waited_ms: u64,
    /// `complete` and `expected <= grew <= expected + unknown`.
    pub pass: bool,
}

/// The result of a run: one JSON object in `--json` mode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadReport {
    /// The counter written.
    pub counter: String,
    /// The nodes written to.
    pub nodes: Vec<String>,
    /// Concurrent writers.
    pub writers: u32,
    /// Increments per request.
    pub batch: u32,
    /// Whether increments carried unique event ids.
    pub event_ids: bool,
    /// Whether increments carried writer sequence numbers.
    pub sequences: bool,
    /// The requested duration, in milliseconds.
    pub duration_ms: u64,
    /// From the first request to the last answer, in milliseconds.
    pub elapsed_ms: u64,
    /// Requests answered with success.
    pub requests: u64,
    /// Requests that failed as a whole (error status, timeout, connection).
    pub requests_failed: u64,
    /// Increments acknowledged as applied.
    pub acknowledged: u64,
    /// Increments answered as duplicates (counted before; not again).
    pub duplicates: u64,
    /// Increments that failed, whether alone, as a batch item or with their batch.
    pub failed: u64,
    /// Failed increments by error code (the server's, or the client's own such as
    /// `client_timeout` and `unreachable`).
    pub errors: BTreeMap<String, u64>,
    /// Acknowledged increments per second of `elapsed_ms`.
    pub increments_per_s: f64,
    /// Answered requests per second of `elapsed_ms`.
    pub requests_per_s: f64,
    /// Latencies of answered requests, in microseconds.
    pub latency_us: Latencies,
    /// The verification, with `--verify`.
    pub verify: Option<Verify>,
}

impl LoadReport {
    /// Why the run counts as failed, if it does: a failed verification, or nothing
    /// acknowledged at all.
    pub fn failure(&self) -> Option<CliError> {
        if let Some(v) = self.verify.as_ref().filter(|v| !v.pass) {
            let message = if v.complete {
                format!("the counter grew by {}, but {} increments were acknowledged", v.grew, v.expected)
            } else {
                "a verifying read did not reach every shard".to_string()
            };
            return Some(CliError::Load { code: codes::VERIFY_FAILED, message });
        }
        if self.acknowledged == 0 && self.duplicates == 0 {
            let message = match self.errors.iter().max_by_key(|(_, n)| **n) {
                Some((code, n)) => format!("no increment was acknowledged ({n} failed with {code})"),
                None => "no increment was acknowledged".to_string(),
            };
            return Some(CliError::Load { code: codes::NOTHING_ACKNOWLEDGED, message });
        }
        None
    }

    /// The friendly summary.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let mode = if self.batch == 1 {
            "single increments".to_string()
        } else {
            format!("batches of {}", self.batch)
        };
        let ids = match (self.event_ids, self.sequences) {
            (true, _) => " with event ids",
            (false, true) => " with writer sequences",
            _ => "",
        };
        let nodes = match self.nodes.as_slice() {
            [one] => one.clone(),
            many => format!("{} nodes", many.len()),
        };
        let _ = writeln!(
            out,
            "load {}: {} writers on {nodes}, {mode}{ids}, for {:.1} s",
            self.counter,
            self.writers,
            self.duration_ms as f64 / 1000.0
        );
        let secs = self.elapsed_ms as f64 / 1000.0;
        let _ = writeln!(
            out,
            "  acknowledged   {} increments in {secs:.2} s ({} duplicates)",
            self.acknowledged, self.duplicates
        );
        let _ = writeln!(
            out,
            "  throughput     {:.0} increments/s, {:.0} requests/s",
            self.increments_per_s, self.requests_per_s
        );
        if self.errors.is_empty() {
            let _ = writeln!(out, "  errors         none");
        } else {
            let by_code: Vec<String> = self.errors.iter().map(|(c, n)| format!("{c} {n}")).collect();
            let _ = writeln!(
                out,
                "  errors         {} increments in {} failed requests or items: {}",
                self.failed,
                self.requests_failed,
                by_code.join(", ")
            );
        }
        let row = |label: &str, p: &Percentiles| {
            let mut cells = vec![label.to_string()];
            cells.extend([p.p50, p.p99, p.p999, p.max].iter().map(u64::to_string));
            cells.push(format!("{:.1}", p.mean));
            cells
        };
        let rows = [
            row("per request", &self.latency_us.per_request),
            row("per increment", &self.latency_us.per_increment),
        ];
        let table = render::table(&["latency µs", "p50", "p99", "p999", "max", "mean"], &rows);
        for line in table.lines() {
            let _ = writeln!(out, "  {line}");
        }
        if let Some(v) = &self.verify {
            let verdict = if v.pass { "PASS" } else { "FAIL" };
            let whole = if v.complete { "" } else { ", NOT every shard answered" };
            let unknown = if v.unknown == 0 { String::new() } else { format!(" (+{} failed)", v.unknown) };
            let _ = writeln!(
                out,
                "  verify         {verdict}: grew by {} ({} → {}), acknowledged {}{unknown}{whole}",
                v.grew, v.before, v.after, v.expected
            );
        }
        out
    }
}

/// What the writers share with the progress bar.
#[derive(Debug, Default)]
struct Live {
    acknowledged: AtomicU64,
    failed: AtomicU64,
}

/// One writer's tally.
struct WriterStats {
    requests: u64,
    requests_failed: u64,
    acknowledged: u64,
    duplicates: u64,
    failed: u64,
    errors: BTreeMap<String, u64>,
    per_request: Histogram<u64>,
    per_increment: Histogram<u64>,
}

fn histogram() -> Histogram<u64> {
    // Auto-resizing: memory grows with the largest latency seen, not a fixed range.
    Histogram::new(HISTOGRAM_SIGFIG).expect("3 significant digits are within hdrhistogram's 0..=5")
}

impl WriterStats {
    fn new() -> Self {
        Self {
            requests: 0,
            requests_failed: 0,
            acknowledged: 0,
            duplicates: 0,
            failed: 0,
            errors: BTreeMap::new(),
            per_request: histogram(),
            per_increment: histogram(),
        }
    }

    fn error(&mut self, code: &str, increments: u64) {
        self.failed += increments;
        *self.errors.entry(code.to_string()).or_default() += increments;
    }

    fn outcome(&mut self, o: IncrOutcome) {
        if o.applied {
            self.acknowledged += 1;
        } else if o.duplicate {
            self.duplicates += 1;
        } else {
            self.error("not_applied", 1);
        }
    }

    fn merge(&mut self, other: WriterStats) {
        self.requests += other.requests;
        self.requests_failed += other.requests_failed;
        self.acknowledged += other.acknowledged;
        self.duplicates += other.duplicates;
        self.failed += other.failed;
        for (code, n) in other.errors {
            *self.errors.entry(code).or_default() += n;
        }
        // Both histograms auto-resize, so adding cannot run out of range.
        let _ = self.per_request.add(&other.per_request);
        let _ = self.per_increment.add(&other.per_increment);
    }
}

/// One writer task's fixed inputs.
struct Writer {
    client: Client,
    url: Url,
    counter: Arc<str>,
    writer_id: String,
    /// The run's event id prefix, when increments carry event ids.
    event_prefix: Option<Arc<str>>,
    /// Whether increments carry this writer's sequence numbers.
    sequences: bool,
    batch: u32,
    deadline: Instant,
    live: Arc<Live>,
}

impl Writer {
    /// The next request's body and the number of increments in it.
    fn body(&self, seq: &mut u64) -> Vec<u8> {
        let mut next_id = || {
            *seq += 1;
            (self.event_prefix.as_ref().map(|p| format!("{p}-{}", seq)), self.sequences.then_some(*seq))
        };
        let encoded = if self.batch == 1 {
            let (id, seq) = next_id();
            let inc = IncrementBody {
                delta: 1,
                event_id: id.as_deref(),
                writer: Some(&self.writer_id),
                seq,
                member: None,
                item: None,
            };
            serde_json::to_vec(&inc)
        } else {
            let ids: Vec<(Option<String>, Option<u64>)> = (0..self.batch).map(|_| next_id()).collect();
            let increments = ids
                .iter()
                .map(|(id, seq)| BatchItem {
                    counter: &self.counter,
                    increment: IncrementBody {
                        delta: 1,
                        event_id: id.as_deref(),
                        writer: Some(&self.writer_id),
                        seq: *seq,
                        member: None,
                        item: None,
                    },
                })
                .collect();
            serde_json::to_vec(&BatchBody { increments })
        };
        encoded.unwrap_or_default()
    }

    /// Writes until the deadline.
    async fn run(self) -> WriterStats {
        let mut stats = WriterStats::new();
        let mut seq = 0u64;
        let items = u64::from(self.batch);
        while Instant::now() < self.deadline {
            let first = seq;
            let body = self.body(&mut seq);
            let started = Instant::now();
            let result = self.client.send_raw(Method::POST, self.url.clone(), Some(body)).await;
            let elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX).max(1);
            let (acked_before, failed_before) = (stats.acknowledged, stats.failed);
            match result {
                Ok(answer) => {
                    stats.requests += 1;
                    let _ = stats.per_request.record(elapsed_us);
                    let _ = stats.per_increment.record(elapsed_us.div_ceil(items).max(1));
                    self.read_answer(&mut stats, &answer.text);
                }
                Err(e) => {
                    stats.requests_failed += 1;
                    stats.error(e.code(), items);
                }
            }
            self.live.acknowledged.fetch_add(stats.acknowledged - acked_before, Ordering::Relaxed);
            self.live.failed.fetch_add(stats.failed - failed_before, Ordering::Relaxed);
            if stats.failed > failed_before {
                if self.sequences {
                    // Resend the same sequences: those applied answer duplicate.
                    seq = first;
                }
                let left = self.deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(left.min(Duration::from_millis(ERROR_BACKOFF_MS))).await;
            }
        }
        stats
    }

    /// Counts a success answer's outcomes.
    fn read_answer(&self, stats: &mut WriterStats, text: &str) {
        let items = u64::from(self.batch);
        if self.batch == 1 {
            match serde_json::from_str::<IncrOutcome>(text) {
                Ok(o) => stats.outcome(o),
                Err(_) => stats.error(codes::BAD_ANSWER, 1),
            }
            return;
        }
        let Ok(answer) = serde_json::from_str::<BatchResults>(text) else {
            stats.error(codes::BAD_ANSWER, items);
            return;
        };
        let answered = answer.results.len() as u64;
        for result in answer.results.into_iter().take(self.batch as usize) {
            match result {
                ItemResult::Ok(o) => stats.outcome(o),
                ItemResult::Err(e) => stats.error(&e.error.code, 1),
            }
        }
        if answered < items {
            stats.error(codes::BAD_ANSWER, items - answered);
        }
    }
}

/// A run id unlikely to repeat: event ids of different runs must not collide
/// within the dedup window, or the second run's increments would be duplicates.
fn run_id() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("load-{:x}{:x}", nanos as u64, std::process::id())
}

/// A fresh read; `None` for a counter that does not exist yet.
async fn fresh(client: &Client, counter: &str) -> Result<Option<ValueRead>, CliError> {
    let mut url = client.counter_url(counter, &["value"]);
    url.query_pairs_mut().append_pair("consistency", "fresh");
    match client.call::<()>(Method::GET, url, None).await {
        Ok(answer) => answer.parse().map(Some),
        Err(CliError::Api { status: 404, code, .. }) if code == "counter_not_found" => Ok(None),
        Err(e) => Err(e),
    }
}

fn progress_bar(plan: &LoadPlan) -> ProgressBar {
    if !plan.progress {
        return ProgressBar::hidden();
    }
    let len = u64::try_from(plan.duration.as_millis()).unwrap_or(u64::MAX);
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr_with_hz(PROGRESS_HZ));
    if let Ok(style) = ProgressStyle::with_template("[{elapsed_precise}] {bar:30} {msg}") {
        bar.set_style(style);
    }
    bar
}

/// Keeps the progress bar's position and figures current until aborted.
fn spawn_progress(bar: ProgressBar, live: Arc<Live>, started: Instant) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(PROGRESS_TICK_MS));
        let (mut last_acked, mut last_at) = (0u64, started);
        loop {
            tick.tick().await;
            let now = Instant::now();
            let acked = live.acknowledged.load(Ordering::Relaxed);
            let failed = live.failed.load(Ordering::Relaxed);
            let window = now.duration_since(last_at).as_secs_f64();
            let rate = if window > 0.0 { (acked - last_acked) as f64 / window } else { 0.0 };
            (last_acked, last_at) = (acked, now);
            bar.set_position(u64::try_from(now.duration_since(started).as_millis()).unwrap_or(u64::MAX));
            bar.set_message(format!("{acked} acknowledged, {rate:.0} increments/s, {failed} errors"));
        }
    })
}

/// Runs the plan and reports. Errors only when the run cannot start (the counter
/// cannot be created, the baseline cannot be read) or cannot be verified.
pub async fn run(plan: &LoadPlan) -> Result<LoadReport, CliError> {
    let first = plan.nodes.first().ok_or_else(|| CliError::Usage {
        code: codes::INVALID_NODE_URL,
        message: "tally load needs at least one node".into(),
    })?;
    let control =
        Client::connect(first.clone(), plan.timeout, plan.cacert.as_ref())?.with_token(plan.token.as_deref());
    if let Some(spec) = &plan.create {
        control.call(Method::PUT, control.counter_url(&plan.counter, &[]), Some(spec)).await?;
    }
    let before = if plan.verify { Some(fresh(&control, &plan.counter).await?) } else { None };

    let live = Arc::new(Live::default());
    let counter: Arc<str> = plan.counter.as_str().into();
    let event_prefix: Option<Arc<str>> = plan.event_ids.then(|| run_id().into());
    // Sequenced writers are new writers each run: an earlier run's marks would make
    // their first sequences duplicates.
    let writer_prefix = if plan.sequences { format!("{}-w", run_id()) } else { "load-w".to_string() };
    let started = Instant::now();
    let deadline = started + plan.duration;
    let mut tasks = Vec::with_capacity(plan.writers as usize);
    for index in 0..plan.writers {
        let base = plan.nodes[index as usize % plan.nodes.len()].clone();
        let client =
            Client::connect(base, plan.timeout, plan.cacert.as_ref())?.with_token(plan.token.as_deref());
        let url = if plan.batch == 1 {
            client.counter_url(&plan.counter, &["increments"])
        } else {
            client.url(&["v1", "increments"])
        };
        let writer = Writer {
            client,
            url,
            counter: counter.clone(),
            writer_id: format!("{writer_prefix}{index}"),
            event_prefix: event_prefix.as_ref().map(|p| format!("{p}-w{index}").into()),
            sequences: plan.sequences,
            batch: plan.batch,
            deadline,
            live: live.clone(),
        };
        tasks.push(tokio::spawn(writer.run()));
    }
    let bar = progress_bar(plan);
    let ticker = spawn_progress(bar.clone(), live, started);

    let mut total = WriterStats::new();
    let mut lost = None;
    for task in tasks {
        match task.await {
            Ok(stats) => total.merge(stats),
            Err(e) => lost = Some(e.to_string()),
        }
    }
    let elapsed = started.elapsed();
    ticker.abort();
    bar.finish_and_clear();
    if let Some(why) = lost {
        return Err(CliError::Load {
            code: codes::INTERNAL,
            message: format!("a writer task failed: {why}"),
        });
    }

    let verify = match before {
        Some(before) => {
            Some(verify(&control, &plan.counter, before, total.acknowledged, total.failed).await?)
        }
        None => None,
    };
    let secs = elapsed.as_secs_f64().max(f64::MIN_POSITIVE);
    Ok(LoadReport {
        counter: plan.counter.clone(),
        nodes: plan.nodes.iter().map(|u| u.as_str().trim_end_matches('/').to_string()).collect(),
        writers: plan.writers,
        batch: plan.batch,
        event_ids: plan.event_ids,
        sequences: plan.sequences,
        duration_ms: u64::try_from(plan.duration.as_millis()).unwrap_or(u64::MAX),
        elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        requests: total.requests,
        requests_failed: total.requests_failed,
        acknowledged: total.acknowledged,
        duplicates: total.duplicates,
        failed: total.failed,
        errors: total.errors,
        increments_per_s: (total.acknowledged as f64 / secs * 10.0).round() / 10.0,
        requests_per_s: (total.requests as f64 / secs * 10.0).round() / 10.0,
        latency_us: Latencies {
            per_request: Percentiles::of(&total.per_request),
            per_increment: Percentiles::of(&total.per_increment),
        },
        verify,
    })
}

/// The verifying read after a run (see the module docs).
async fn verify(
    control: &Client,
    counter: &str,
    before: Option<ValueRead>,
    acknowledged: u64,
    failed: u64,
) -> Result<Verify, CliError> {
    let info: CounterInfo =
        control.call::<()>(Method::GET, control.counter_url(counter, &[]), None).await?.parse()?;
    let waited_ms =
        if info.spec.durability == "batched" { info.spec.flush_ms + VERIFY_FLUSH_MARGIN_MS } else { 0 };
    tokio::time::sleep(Duration::from_millis(waited_ms)).await;
    let after = fresh(control, counter).await?.ok_or_else(|| CliError::Api {
        status: 404,
        code: "counter_not_found".into(),
        message: format!("counter {counter:?} vanished during the run"),
    })?;
    let (before_value, before_complete) = before.map_or((0, true), |b| (b.value, b.complete));
    let grew = after.value - before_value;
    let (expected, unknown) = (i128::from(acknowledged), i128::from(failed));
    let complete = before_complete && after.complete;
    Ok(Verify {
        before: before_value,
        after: after.value,
        grew,
        expected,
        unknown,
        complete,
        waited_ms,
        pass: complete && (expected..=expected + unknown).contains(&grew),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> LoadReport {
        LoadReport {
            counter: "likes".into(),
            nodes: vec!["http://127.0.0.1:7070".into()],
            writers: 8,
            batch: 1,
            event_ids: true,
            sequences: false,
            duration_ms: 2000,
            elapsed_ms: 2004,
            requests: 100,
            requests_failed: 1,
            acknowledged: 100,
            duplicates: 0,
            failed: 1,
            errors: BTreeMap::from([("client_timeout".to_string(), 1)]),
            increments_per_s: 49.9,
            requests_per_s: 49.9,
            latency_us: Latencies::default(),
            verify: Some(Verify {
                before: 5,
                after: 105,
                grew: 100,
                expected: 100,
                unknown: 1,
                complete: true,
                waited_ms: 300,
                pass: true,
            }),
        }
    }

    #[test]
    fn the_summary_names_rate_errors_and_verdict() {
        let text = report().text();
        assert!(
            text.contains("8 writers on http://127.0.0.1:7070, single increments with event ids"),
            "{text}"
        );
        assert!(text.contains("50 increments/s"), "{text}");
        assert!(text.contains("client_timeout 1"), "{text}");
        assert!(text.contains("PASS: grew by 100 (5 → 105), acknowledged 100 (+1 failed)"), "{text}");
        assert_eq!(report().failure(), None);
    }

    #[test]
    fn failures_are_errors() {
        let mut r = report();
        r.verify.as_mut().expect("verify").pass = false;
        assert_eq!(r.failure().map(|e| e.code().to_string()), Some(codes::VERIFY_FAILED.to_string()));
        let mut r = report();
        (r.acknowledged, r.verify) = (0, None);
        let e = r.failure().expect("nothing acknowledged");
        assert_eq!(e.code(), codes::NOTHING_ACKNOWLEDGED);
        assert!(e.message().contains("client_timeout"), "{e}");
    }

    #[test]
    fn percentiles_of_a_histogram() {
        let mut h = histogram();
        for v in 1..=1000 {
            h.record(v).expect("records");
        }
        let p = Percentiles::of(&h);
        assert_eq!((p.count, p.p50, p.max), (1000, 500, 1000));
        assert!(p.p99 >= 990 && p.p999 >= 999, "{p:?}");
        assert_eq!(Percentiles::of(&histogram()), Percentiles::default());
    }

    #[test]
    fn bodies_carry_unique_event_ids() {
        let client =
            Client::new(Url::parse("http://127.0.0.1:1").expect("url"), Duration::from_secs(1)).expect("c");
        let w = Writer {
            url: client.url(&["v1", "increments"]),
            client,
            counter: "c".into(),
            writer_id: "load-w0".into(),
            event_prefix: Some("p".into()),
            sequences: false,
            batch: 2,
            deadline: Instant::now(),
            live: Arc::default(),
        };
        let mut seq = 0;
        let body = String::from_utf8(w.body(&mut seq)).expect("utf8");
        assert_eq!(
            body,
            r#"{"increments":[{"counter":"c","delta":1,"event_id":"p-1","writer":"load-w0"},{"counter":"c","delta":1,"event_id":"p-2","writer":"load-w0"}]}"#
        );
        let w = Writer { event_prefix: None, sequences: true, batch: 1, ..w };
        let mut seq = 4;
        let body = String::from_utf8(w.body(&mut seq)).expect("utf8");
        assert_eq!(body, r#"{"delta":1,"writer":"load-w0","seq":5}"#);
        assert_eq!(seq, 5);
    }
}
