//! The Markdown report.

use crate::cells::{hot_key, read_key, Cell, Verification};
use crate::memory::{MemoryReport, CREATORS, IDLE_MS};
use crate::options::Options;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tally_engine::Consistency;

/// Increments/s a hot `batched` counter must reach (this benchmark's brief).
pub const BATCHED_RATE_TARGET: f64 = 5_000_000.0;
/// Increments/s a hot `batched` counter must reach (DESIGN.md, "Performance targets").
pub const BATCHED_RATE_TARGET_DESIGN: f64 = 2_000_000.0;
/// How many times the baseline a `batched` counter must reach.
pub const BATCHED_RATIO_TARGET: f64 = 50.0;
/// How many times the baseline a `sync` counter must reach.
pub const SYNC_RATIO_TARGET: f64 = 10.0;
/// Cached-read p99 bound, in microseconds (DESIGN.md).
pub const CACHED_READ_P99_TARGET_US: f64 = 1_000.0;

/// Everything one run measured.
#[derive(Debug)]
pub struct Report {
    /// The command line that produced it.
    pub command: String,
    /// The options it ran with.
    pub opts: Options,
    /// Table rows, in run order.
    pub cells: Vec<Cell>,
    /// The memory row, if selected (an error message if it failed).
    pub memory: Option<Result<MemoryReport, String>>,
    /// Wall time of the whole run.
    pub elapsed: Duration,
    /// The 1-minute load average when the run started.
    pub load_at_start: String,
    /// The 1-minute load average when the run ended.
    pub load_at_end: String,
}

impl Report {
    /// An empty report.
    pub fn new(command: String, opts: Options) -> Self {
        Self {
            command,
            opts,
            cells: Vec::new(),
            memory: None,
            elapsed: Duration::ZERO,
            load_at_start: load_average(),
            load_at_end: String::new(),
        }
    }

    /// Whether every check passed (verification, memory spot checks). Targets missed
    /// are not failures: this is a report.
    pub fn all_verified(&self) -> bool {
        self.cells.iter().all(|c| c.verification == Verification::Verified)
            && self.memory.as_ref().is_none_or(|m| m.is_ok())
    }

    fn cell(&self, key: &str) -> Option<&Cell> {
        self.cells.iter().find(|c| c.key == key && c.verification == Verification::Verified)
    }

    /// The report as Markdown.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let o = &mut out;
        let _ = writeln!(o, "# Tally benchmarks\n");
        let _ = writeln!(o, "- command: `{}`", self.command);
        let _ = writeln!(o, "- machine: {}", machine());
        let _ = writeln!(
            o,
            "- 1-minute load average {} at the start, {} at the end (the cores are shared with other work)",
            self.load_at_start, self.load_at_end
        );
        let _ = writeln!(
            o,
            "- writers are tokio tasks on a multi-thread runtime with {} worker threads, {} s per cell; \
             each cell has a fresh sled store in a tempdir and `TallyConfig::default()` (the hot-counter \
             cells open it as `Tally::open` does, through a pass-through `Store` that times commits and \
             flushes)",
            crate::WORKER_THREADS,
            self.opts.seconds
        );
        let _ = writeln!(
            o,
            "- engine writers call `tally.incr(\"hot\", Increment::new(1))` without a writer id \
             (thread-affinity routing); writers call `tokio::task::consume_budget()` after each call \
             so that calls that never wait still let other tasks run"
        );
        let _ = writeln!(
            o,
            "- latency: per-call acknowledgement time, hdrhistogram in ns; batched rows time 1 call in {} \
             (random gaps; timing costs about as much as the call, a timed call includes one `Instant::now`, ≈ 35 ns here); all other rows time every call",
            self.opts.sample_every
        );
        let _ = writeln!(
            o,
            "- baseline: one sled key (cache {} MiB) behind a tokio `Mutex` row lock held from read to \
             `flush_async().await`: read, write value + 1, flush, acknowledge\n",
            tally_engine::SledConfig::DEFAULT_CACHE_CAPACITY_BYTES >> 20
        );

        if !self.cells.is_empty() {
            let _ = writeln!(o, "| row | shards | writers | increments/s | p50 µs | p99 µs | verified |");
            let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---|");
            for c in &self.cells {
                let rate = if c.unit.is_empty() {
                    thousands(c.rate)
                } else {
                    format!("{} {}", thousands(c.rate), c.unit)
                };
                let verified = match &c.verification {
                    Verification::Verified => "verified".to_string(),
                    Verification::Failed(why) => format!("**FAILED**: {}", why.replace('|', "\\|")),
                };
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    c.row,
                    c.shards,
                    c.writers,
                    rate,
                    us(c.p50_us),
                    us(c.p99_us),
                    verified
                );
            }
            let _ = writeln!(o);
            self.render_targets(o);
            self.render_spec(o);
        }
        if let Some(m) = &self.memory {
            render_memory(o, m);
        }
        if !self.cells.is_empty() {
            let _ = writeln!(o, "## Per-cell notes\n");
            for c in &self.cells {
                if !c.details.is_empty() {
                    let _ = writeln!(o, "- `{}`: {}", c.key, c.details);
                }
            }
            let _ = writeln!(o);
        }
        let _ = writeln!(
            o,
            "Total run time {:.0} s; all checks {}.",
            self.elapsed.as_secs_f64(),
            if self.all_verified() { "verified" } else { "**NOT verified**" }
        );
        out
    }

    fn render_targets(&self, o: &mut String) {
        let _ = writeln!(o, "## Targets\n");
        let baseline = self.cell(&hot_key("baseline", 1, 64));
        let batched8 = self.cell(&hot_key("batched", 8, 64));
        let best = self
            .cells
            .iter()
            .filter(|c| c.row == "batched" && c.verification == Verification::Verified)
            .max_by(|a, b| a.rate.total_cmp(&b.rate));
        let sync64 = self.cell(&hot_key("sync", 64, 64));
        let ratio = |c: Option<&Cell>, target: f64, what: &str| -> String {
            match (c, baseline) {
                (Some(c), Some(b)) if b.rate > 0.0 => {
                    let r = c.rate / b.rate;
                    format!("- {what} ÷ baseline (64 writers) = {} ÷ {} = **{r:.1}×** — target ≥ {target}×: **{}**",
                        thousands(c.rate), thousands(b.rate), pass(r >= target))
                }
                _ => format!("- {what} ÷ baseline (64 writers): n/a (cell not run or not verified)"),
            }
        };
        let best_name = best.map(|c| format!("best batched ({} shards, {} writers)", c.shards, c.writers));
        let _ = writeln!(o, "{}", ratio(batched8, BATCHED_RATIO_TARGET, "batched (8 shards, 64 writers)"));
        let _ = writeln!(
            o,
            "{}",
            ratio(best, BATCHED_RATIO_TARGET, best_name.as_deref().unwrap_or("best batched"))
        );
        let _ = writeln!(o, "{}", ratio(sync64, SYNC_RATIO_TARGET, "sync (64 shards, 64 writers)"));
        for (c, what) in
            [(batched8, "batched (8 shards, 64 writers)".to_string()), (best, best_name.unwrap_or_default())]
        {
            let Some(c) = c else { continue };
            let _ = writeln!(
                o,
                "- {what} = {} increments/s — target ≥ {} (brief): **{}**; ≥ {} (DESIGN.md): **{}**",
                thousands(c.rate),
                thousands(BATCHED_RATE_TARGET),
                pass(c.rate >= BATCHED_RATE_TARGET),
                thousands(BATCHED_RATE_TARGET_DESIGN),
                pass(c.rate >= BATCHED_RATE_TARGET_DESIGN),
            );
        }
        if let Some(c) = self.cell(&read_key(Consistency::Cached, crate::CACHED_READ_SHARDS)) {
            let _ = writeln!(
                o,
                "- cached read p99 ({} shards) = {} µs — target < {} µs (DESIGN.md): **{}**",
                c.shards,
                us(c.p99_us),
                CACHED_READ_P99_TARGET_US,
                pass(c.p99_us < CACHED_READ_P99_TARGET_US)
            );
        }
        let _ = writeln!(o);
        self.render_hotpath(o);
    }

    /// The hot-path figures, each beside its reference from the same run.
    fn render_hotpath(&self, o: &mut String) {
        use crate::hotpath::{CREATE_WRITERS, PREFIX, READ_SHARDS, READ_WRITERS};
        if !self.cells.iter().any(|c| c.key.starts_with(PREFIX)) {
            return;
        }
        let _ = writeln!(o, "## Hot path\n");
        let get = |k: String| self.cell(&k);
        let ratio = |a: Option<&Cell>, b: Option<&Cell>, what: &str, target: f64| {
            let line = match (a, b) {
                (Some(a), Some(b)) if b.rate > 0.0 => {
                    let r = a.rate / b.rate;
                    format!(
                        "- {what} = {} ÷ {} = **{r:.2}×** — target ≥ {target}×: **{}**",
                        thousands(a.rate),
                        thousands(b.rate),
                        pass(r >= target)
                    )
                }
                _ => format!("- {what}: n/a (cell not run or not verified)"),
            };
            line
        };
        let sync1 = ratio(
            get(format!("{PREFIX}/sync/1sh/1w")),
            get(format!("{PREFIX}/baseline/1w")),
            "one `sync` writer (1 shard) ÷ the per-increment-flush baseline (1 writer)",
            1.0,
        );
        let _ = writeln!(o, "{sync1}");
        let created = ratio(
            get(format!("{PREFIX}/new-counters/{CREATE_WRITERS}w")),
            get(format!("{PREFIX}/existing-counters/{CREATE_WRITERS}w")),
            &format!(
                "first increments to new counters ÷ increments to existing ones ({CREATE_WRITERS} writers)"
            ),
            0.5,
        );
        let _ = writeln!(o, "{created}");
        if let Some(c) = get(format!("{PREFIX}/sync/64sh/64w")) {
            let _ = writeln!(
                o,
                "- `sync`, 64 shards, 64 writers (not to be hurt): {} increments/s",
                thousands(c.rate)
            );
        }
        let idle = get(format!("{PREFIX}/fresh-read-idle/{READ_SHARDS}sh"));
        if let Some(c) = get(format!("{PREFIX}/fresh-read-{READ_WRITERS}w/{READ_SHARDS}sh")) {
            let _ = writeln!(
                o,
                "- fresh read, {READ_SHARDS} shards, {READ_WRITERS} writers: {} reads/s, p50 {} µs, p99 {} µs \
                 (idle: {}) — target p99 < 5,000 µs: **{}**",
                thousands(c.rate),
                us(c.p50_us),
                us(c.p99_us),
                idle.map_or("n/a".to_string(), |i| format!("{} reads/s, p99 {} µs", thousands(i.rate), us(i.p99_us))),
                pass(c.p99_us < 5_000.0)
            );
        }
        let _ = writeln!(o);
    }
}

impl Report {
    /// The bounded and windowed rows, each beside the plain counter of the same shards,
    /// durability and writers from this run.
    fn render_spec(&self, o: &mut String) {
        use crate::cells::{spec_key, Variant};
        let mut lines = Vec::new();
        for variant in Variant::ALL {
            for &durability in variant.durabilities() {
                for writers in crate::SPEC_WRITERS {
                    let key = spec_key(variant, durability, crate::SPEC_SHARDS, writers);
                    let Some(c) = self.cells.iter().find(|c| c.key == key) else { continue };
                    let plain_key = hot_key(durability.as_str(), crate::SPEC_SHARDS, writers);
                    let line = match (&c.verification, self.cell(&plain_key)) {
                        (Verification::Verified, Some(p)) if p.rate > 0.0 => format!(
                            "| `{key}` | {} | {} / {} | `{plain_key}` | {} | {} / {} | **{}×** |",
                            thousands(c.rate),
                            us(c.p50_us),
                            us(c.p99_us),
                            thousands(p.rate),
                            us(p.p50_us),
                            us(p.p99_us),
                            ratio(c.rate / p.rate)
                        ),
                        (Verification::Verified, _) => format!(
                            "| `{key}` | {} | {} / {} | `{plain_key}` | n/a (not run or not verified) | | |",
                            thousands(c.rate),
                            us(c.p50_us),
                            us(c.p99_us)
                        ),
                        (Verification::Failed(_), _) => {
                            format!("| `{key}` | not verified | | `{plain_key}` | | | |")
                        }
                    };
                    lines.push(line);
                }
            }
        }
        if lines.is_empty() {
            return;
        }
        let _ = writeln!(o, "## Bounded and windowed increments\n");
        let _ = writeln!(
            o,
            "Each beside the plain counter of the same shards, durability and writers, from this run \
             (refusals and escrow traffic in the per-cell notes):\n"
        );
        let _ = writeln!(o, "| cell | increments/s | p50 / p99 µs | plain cell | plain increments/s | plain p50 / p99 µs | ÷ plain |");
        let _ = writeln!(o, "|---|---:|---:|---|---:|---:|---:|");
        for l in lines {
            let _ = writeln!(o, "{l}");
        }
        let _ = writeln!(o);
    }
}

fn render_memory(o: &mut String, m: &Result<MemoryReport, String>) {
    let _ = writeln!(o, "## Memory per idle counter\n");
    let m = match m {
        Ok(m) => m,
        Err(e) => {
            let _ = writeln!(o, "**FAILED**: {e}\n");
            return;
        }
    };
    let n = m.counters as f64;
    let rest = (m.counters - m.warm_counters) as f64;
    let grown = m.rss_after as f64 - m.rss_before as f64;
    let marginal = m.rss_after as f64 - m.rss_warm as f64;
    let _ = writeln!(
        o,
        "{} counters, each created by one `incr` (batched, 8 shards) from {} concurrent tasks; engine with \
         `counter_idle_evict_ms` = `shard_idle_stop_ms` = {IDLE_MS}; ran first, in a fresh process. A warm-up \
         tenth ({}) is created and left to go idle first, so the marginal figure excludes fixed costs \
         (sled's cache, runtime threads).\n",
        thousands(n),
        CREATORS,
        thousands(m.warm_counters as f64),
    );
    let _ = writeln!(o, "| measure | value |");
    let _ = writeln!(o, "|---|---:|");
    let rows: Vec<(&str, String)> = vec![
        (
            "create time (incl. one idle wait)",
            format!(
                "{:.1} s ({} counters/s)",
                m.create_time.as_secs_f64(),
                thousands(n / m.create_time.as_secs_f64())
            ),
        ),
        (
            "peak live (counters, shard actors) while creating",
            format!("{}, {}", m.active_peak.0, m.active_peak.1),
        ),
        ("wait until idle after the last create", format!("{:.1} s", m.idle_time.as_secs_f64())),
        ("live (counters, shard actors) at the end", format!("{}, {}", m.active_at_end.0, m.active_at_end.1)),
        ("RSS before (engine open, empty)", mib(m.rss_before)),
        ("RSS with the warm-up tenth idle", mib(m.rss_warm)),
        ("RSS right after the last create", mib(m.rss_loaded)),
        ("RSS peak (VmHWM)", mib(m.rss_peak)),
        ("RSS once idle", mib(m.rss_after)),
        ("RSS after shutdown, engine and store dropped", mib(m.rss_closed)),
        ("bytes per idle counter, gross ((idle − before) ÷ all counters)", format!("{:.0}", grown / n)),
        (
            "**bytes per idle counter in memory**, marginal ((idle − warm) ÷ counters after the warm-up)",
            format!("**{:.0}**", marginal / rest),
        ),
        ("store size on disk", mib(m.disk_bytes)),
        ("**bytes per counter on disk**", format!("**{:.0}**", m.disk_bytes as f64 / n)),
        ("spot check (fresh reads = 1)", format!("{} of {} verified", m.spot_checked, m.spot_checked)),
    ];
    for (k, v) in rows {
        let _ = writeln!(o, "| {k} | {v} |");
    }
    let _ = writeln!(
        o,
        "\nRSS growth is an upper bound on what idle counters hold: it includes sled's page cache \
         (≤ {} MiB configured; sled's in-memory page table grows with the number of keys) and memory \
         the allocator keeps after the runtimes and actors were freed. The RSS after shutdown shows \
         how much of it the allocator keeps once everything is dropped.\n",
        tally_engine::SledConfig::DEFAULT_CACHE_CAPACITY_BYTES >> 20
    );
}

/// A ratio with two decimals, or three below 0.1 (so that a small one is not 0.01 or 0.00).
fn ratio(r: f64) -> String {
    if r < 0.1 {
        format!("{r:.3}")
    } else {
        format!("{r:.2}")
    }
}

fn pass(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "MISS"
    }
}

/// `1234567.8` as `1,234,568`.
pub fn thousands(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    if v < 0.0 && digits != "0" {
        out.insert(0, '-');
    }
    out
}

fn us(v: f64) -> String {
    if !v.is_finite() {
        "–".into()
    } else if v < 10.0 {
        format!("{v:.3}")
    } else if v < 1000.0 {
        format!("{v:.1}")
    } else {
        thousands(v)
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Cores, CPU model, kernel and date.
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map(|n| n.get().to_string()).unwrap_or("?".into());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| format!("Linux {}", s.trim()))
        .unwrap_or_else(|_| std::env::consts::OS.into());
    format!("{cores} cores (available_parallelism), {cpu}, {kernel}, {}", utc_now())
}

/// The 1-minute load average from /proc/loadavg (other work sharing the cores).
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// Now, as `YYYY-MM-DD HH:MM UTC`.
fn utc_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(1_234_567.8), "1,234,568");
        assert_eq!(thousands(-1234.0), "-1,234");
        assert_eq!(thousands(f64::NAN), "–");
    }

    #[test]
    fn small_ratios_keep_a_third_decimal() {
        assert_eq!(ratio(1.046), "1.05");
        assert_eq!(ratio(0.0072), "0.007");
    }

    #[test]
    fn date_is_plausible() {
        let d = utc_now();
        assert!(d.starts_with("20") && d.ends_with("UTC"), "{d}");
    }
}
