//! Tally's benchmarks: the embedded engine's hot-counter throughput (`batched` and
//! `sync`, plain, bounded and windowed) against a naive per-increment-flush sled
//! counter, read latency, and memory per idle counter. [`run`] measures every selected cell in one process, side by
//! side, and [`Report::render`] prints a Markdown table; the `tally-bench` binary and
//! the `engine` bench target are thin wrappers around them.
//!
//! # Layout
//!
//! * [`cells`] — the measured cells: hot engine counters (plain, bounded and
//!   windowed), the per-increment sled baseline, and reads.
//! * [`hotpath`] — the hot-path cells, each beside the reference it is judged
//!   against, so the report prints a ratio.
//! * [`memory`] — memory per idle counter.
//! * [`drive`] — the load driver: N writer tasks, acknowledgements and latency.
//! * [`timed_store`] — a pass-through [`Store`](tally_store::Store) that times the
//!   sled store's commits and flushes.
//! * [`options`] — the command-line options, parsed by hand.
//! * [`report`] — the Markdown report.
//! * `main.rs` — the `tally-bench` binary; `benches/engine.rs` — the `engine` bench
//!   target. Both are thin wrappers around [`run`].
//!
//! Every throughput cell ends with a check: the counter's fresh total must equal the
//! number of increments its writers saw acknowledged (for a bounded counter, its
//! stock less the acknowledged decrements).

pub mod cells;
pub mod drive;
pub mod hotpath;
pub mod memory;
pub mod options;
pub mod report;
pub mod timed_store;

pub use cells::{Cell, Verification};
pub use memory::MemoryReport;
pub use options::{Options, Parsed, USAGE};
pub use report::Report;

use std::time::Instant;
use tally_engine::{Consistency, Durability};

/// Worker threads of the runtime the writers run on (the project's machines have 2 cores).
pub const WORKER_THREADS: usize = 2;
/// Shard counts of the `batched` rows.
pub const BATCHED_SHARDS: [u16; 3] = [8, 16, 64];
/// Shard count of the `handle` rows (batched increments through a resolved handle).
pub const HANDLE_SHARDS: u16 = 64;
/// Shard counts of the `sync` rows.
pub const SYNC_SHARDS: [u16; 2] = [8, 64];
/// Writer counts of every throughput row.
pub const WRITERS: [usize; 4] = [1, 2, 4, 64];
/// Shard count of the bounded and windowed rows (beside `sync/8sh/…` and `batched/8sh/…`).
pub const SPEC_SHARDS: u16 = 8;
/// Writer counts of the bounded and windowed rows.
pub const SPEC_WRITERS: [usize; 2] = [1, 64];
/// Shard counts of the fresh-read rows.
pub const FRESH_READ_SHARDS: [u16; 2] = [8, 64];
/// Shard count of the cached-read row.
pub const CACHED_READ_SHARDS: u16 = 64;
/// Active counters of the many-counters cached-read cell.
pub const ACTIVE_COUNTERS: usize = 100_000;

/// The runtime every cell runs on: multi-threaded, [`WORKER_THREADS`] workers.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .thread_name(timed_store::WORKER_THREAD_NAME)
        .enable_all()
        .build()
}

fn failed_cell(key: String, row: &str, shards: u16, writers: usize, e: anyhow::Error) -> Cell {
    Cell {
        key,
        row: row.to_string(),
        shards,
        writers,
        rate: f64::NAN,
        unit: "",
        p50_us: f64::NAN,
        p99_us: f64::NAN,
        sample_every: 1,
        verification: Verification::Failed(format!("error: {e:#}")),
        details: String::new(),
    }
}

/// Measures every cell `opts` selects. `command` is echoed at the top of the report.
/// Progress goes to stderr.
pub async fn run(opts: &Options, command: String) -> Report {
    let started = Instant::now();
    let mut report = Report::new(command, opts.clone());
    // Memory first: the process is fresh, so the allocator holds no memory freed by
    // earlier cells that the counters could reuse (which would hide their cost).
    if opts.selects(MemoryReport::KEY) {
        eprintln!("memory: creating {} counters ...", opts.counters);
        report.memory = Some(memory::memory_row(opts).await.map_err(|e| format!("{e:#}")));
    }
    let mut plan: Vec<(String, Durability, u16, usize)> = Vec::new();
    for (durability, shard_counts) in
        [(Durability::Batched, &BATCHED_SHARDS[..]), (Durability::Sync, &SYNC_SHARDS[..])]
    {
        for &shards in shard_counts {
            for &writers in &WRITERS {
                plan.push((
                    cells::hot_key(durability.as_str(), shards, writers),
                    durability,
                    shards,
                    writers,
                ));
            }
        }
    }
    for (key, durability, shards, writers) in plan {
        if !opts.selects(&key) {
            continue;
        }
        eprintln!("{key} ...");
        let cell = cells::hot_cell(durability, shards, writers, opts)
            .await
            .unwrap_or_else(|e| failed_cell(key, durability.as_str(), shards, writers, e));
        report.cells.push(cell);
    }
    for variant in cells::Variant::ALL {
        for &durability in variant.durabilities() {
            for writers in SPEC_WRITERS {
                let key = cells::spec_key(variant, durability, SPEC_SHARDS, writers);
                if !opts.selects(&key) {
                    continue;
                }
                eprintln!("{key} ...");
                let cell = cells::spec_cell(variant, durability, SPEC_SHARDS, writers, opts)
                    .await
                    .unwrap_or_else(|e| failed_cell(key, variant.kind(durability), SPEC_SHARDS, writers, e));
                report.cells.push(cell);
            }
        }
    }
    for writers in WRITERS {
        let key = cells::hot_key(cells::HANDLE_KIND, HANDLE_SHARDS, writers);
        if !opts.selects(&key) {
            continue;
        }
        eprintln!("{key} ...");
        let cell = cells::hot_cell_via(Durability::Batched, HANDLE_SHARDS, writers, opts, true)
            .await
            .unwrap_or_else(|e| failed_cell(key, cells::HANDLE_KIND, HANDLE_SHARDS, writers, e));
        report.cells.push(cell);
    }
    for writers in WRITERS {
        let key = cells::hot_key("baseline", 1, writers);
        if !opts.selects(&key) {
            continue;
        }
        eprintln!("{key} ...");
        let cell = cells::baseline_cell(writers, opts)
            .await
            .unwrap_or_else(|e| failed_cell(key, "baseline", 1, writers, e));
        report.cells.push(cell);
    }
    let reads = std::iter::once((Consistency::Cached, CACHED_READ_SHARDS))
        .chain(FRESH_READ_SHARDS.iter().map(|&s| (Consistency::Fresh, s)));
    for (consistency, shards) in reads {
        let key = cells::read_key(consistency, shards);
        if !opts.selects(&key) {
            continue;
        }
        eprintln!("{key} ...");
        let cell = cells::read_cell(consistency, shards, opts)
            .await
            .unwrap_or_else(|e| failed_cell(key, "read", shards, 1, e));
        report.cells.push(cell);
    }
    let key = cells::many_cached_key(ACTIVE_COUNTERS);
    if opts.selects(&key) {
        eprintln!("{key} ...");
        let cell = cells::many_cached_cell(ACTIVE_COUNTERS, opts)
            .await
            .unwrap_or_else(|e| failed_cell(key, "read", 8, 1, e));
        report.cells.push(cell);
    }
    for key in hotpath::keys() {
        if !opts.selects(&key) {
            continue;
        }
        eprintln!("{key} ...");
        let cell =
            hotpath::cell(&key, opts).await.unwrap_or_else(|e| failed_cell(key, hotpath::PREFIX, 0, 0, e));
        report.cells.push(cell);
    }
    report.elapsed = started.elapsed();
    report.load_at_end = report::load_average();
    report
}
