//! `tally-sim`: runs seeded chaos simulations of a Tally cluster and checks each
//! history. Exits non-zero if any seed violates an invariant, printing the command
//! that reproduces it.

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tally_sim::history::FaultKind;
use tally_sim::{run, FaultLevel, RunReport, SimConfig, Tier};

/// Failing seeds printed in full at the end; the rest are counted.
const FAILURES_SHOWN_MAX: usize = 20;
/// Violations printed per failing seed.
const VIOLATIONS_SHOWN_MAX: usize = 5;

#[derive(Parser, Debug)]
#[command(about = "Seeded chaos simulations of a Tally cluster, checked against its invariants")]
struct Args {
    /// Seeds to run, as START..END (END exclusive).
    #[arg(long, default_value = "0..100")]
    seeds: String,
    /// Run only this seed and print its history summary and trace hash.
    #[arg(long)]
    reproduce: Option<u64>,
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 5)]
    nodes: u8,
    /// Fault level: light or heavy.
    #[arg(long, default_value = "heavy")]
    faults: FaultLevel,
    /// Which simulation: model (tier 1, the core's machines in modelled shells),
    /// engine (tier 2, real engines on a paused-time runtime) or cluster (tier 3,
    /// whole cluster nodes: engine, metadata group, range groups, transport).
    #[arg(long, default_value = "model")]
    tier: Tier,
    /// Concurrent clients per run.
    #[arg(long)]
    clients: Option<u16>,
    /// Length of the chaos phase, in simulated milliseconds.
    #[arg(long)]
    chaos_ms: Option<u64>,
    /// Reshardings and membership changes requested per run.
    #[arg(long)]
    transitions: Option<u32>,
    /// Copies of every shard (tier 2 only; 1–5): above 1, shards live in range
    /// groups whose voters follow membership changes, and some crashes lose the
    /// node's disk.
    #[arg(long, default_value_t = 1)]
    replicas: u8,
    /// With --replicas: range groups snapshot every 10 entries, in 512-byte frames,
    /// so that catch-up goes through snapshots of many frames.
    #[arg(long)]
    small_snapshots: bool,
    /// With --replicas: range appends carry at most 3 KiB (8 MiB in a cluster),
    /// so that appends to a replica that fell behind are cut to that bound.
    #[arg(long)]
    small_messages: bool,
    /// Tier 2: the largest offset of a node's wall clock from true time, in
    /// milliseconds (default: 5,000 with heavy faults, 0 with light ones; at most
    /// 600,000). Nodes start at offsets drawn within it and jump now and then.
    #[arg(long)]
    clock_skew_ms: Option<u64>,
    /// Tier 2: add (true) or leave out (false) `short:0`, a sync counter with a
    /// one-second dedup window whose records expire within the run (default: in
    /// heavy runs with clocks in sync, half of them; needs a skew of at most 100 ms).
    #[arg(long)]
    short_dedup: Option<bool>,
    /// Tier 3: delete and re-create `del:0` now and then, and break metadata RPCs
    /// off (true, the default) or not (false).
    #[arg(long)]
    deletions: Option<bool>,
    /// Tier 2 on one engine embedded as a library: its own local catalog, no
    /// placement, no peers (implies --tier engine, one node, one copy).
    #[arg(long)]
    embedded: bool,
    /// With --reproduce: print the history of this counter (e.g. sync:0).
    #[arg(long)]
    dump: Option<String>,
    /// Worker threads (each run is single-threaded and deterministic).
    #[arg(long)]
    threads: Option<usize>,
    /// Plant a known bug (ack-before-flush, dedup-off, retry-fresh-id, wrapping-add,
    /// dedup-lost-on-reshard, rollup-never-refreshed, reconcile-twice; with --tier
    /// engine: engine-ack-before-flush, seal-forgotten-on-restart, read-ignores-seal,
    /// handoff-deletes-early, handoff-forgets-seal, sketch-merge-beside-live,
    /// escrow-overspend; with --tier engine --replicas 3: ack-before-quorum-durable,
    /// two-leaders-ack, catch-up-skipped; with --tier cluster --replicas 3:
    /// replica-id-from-raft-id; with --tier cluster: proposal-resent-without-identity,
    /// read-index-skipped, proposal-applied-twice).
    #[cfg(feature = "planted-bugs")]
    #[arg(long)]
    plant: Option<tally_core::planted::Bug>,
}

impl Args {
    fn config(&self, seed: u64) -> SimConfig {
        let mut cfg =
            SimConfig::standard(seed, self.nodes, self.faults).on(self.tier).replicated(self.replicas);
        cfg.small_snapshots = self.small_snapshots;
        cfg.small_messages = self.small_messages;
        if let Some(ms) = self.clock_skew_ms {
            cfg = cfg.with_clock_skew(ms);
        }
        if let Some(on) = self.short_dedup {
            cfg = cfg.with_short_dedup(on);
        }
        if let Some(on) = self.deletions {
            cfg = cfg.with_deletions(on);
        }
        if self.embedded {
            cfg = cfg.embedded();
        }
        if let Some(c) = self.clients {
            cfg.clients = c;
        }
        if let Some(ms) = self.chaos_ms {
            cfg.chaos_ms = ms;
        }
        if let Some(t) = self.transitions {
            cfg.transitions = t;
        }
        #[cfg(feature = "planted-bugs")]
        {
            cfg.plant = self.plant;
        }
        cfg
    }
}

fn parse_range(s: &str) -> Result<(u64, u64)> {
    let (a, b) = s.split_once("..").context("--seeds takes START..END")?;
    let (a, b): (u64, u64) = (a.parse().context("seed range start")?, b.parse().context("seed range end")?);
    if b <= a {
        bail!("empty seed range {s}");
    }
    Ok((a, b))
}

/// Totals over many runs.
#[derive(Default)]
struct Totals {
    seeds: u64,
    sim_ms: u64,
    events: u64,
    ops: u64,
    faults: BTreeMap<FaultKind, u64>,
    violations: u64,
    failures: Vec<RunReport>,
    failing_seeds: u64,
}

impl Totals {
    fn add(&mut self, mut r: RunReport) {
        self.seeds += 1;
        self.sim_ms += r.sim_ms;
        self.events += r.events;
        self.ops += r.ops;
        for (k, v) in &r.faults {
            *self.faults.entry(*k).or_default() += v;
        }
        if !r.violations.is_empty() {
            self.violations += r.violations.len() as u64;
            self.failing_seeds += 1;
            if self.failures.len() < FAILURES_SHOWN_MAX {
                r.history = Default::default();
                self.failures.push(r);
            }
        }
    }
}

fn print_failure(r: &RunReport) {
    println!("seed {} violated {} invariant check(s):", r.config.seed, r.violations.len());
    for v in r.violations.iter().take(VIOLATIONS_SHOWN_MAX) {
        println!("  {v}");
    }
    println!("  reproduce: {}", r.config.reproduce_command());
}

/// Prints one counter's history, in time order.
fn dump(r: &RunReport, name: &str) {
    let h = &r.history;
    let Some(c) = h.counters.iter().position(|c| c.name == name) else {
        println!("  no counter {name}");
        return;
    };
    println!("  {name}: {:?}", h.counters[c].spec);
    let mut lines: Vec<(u64, String)> = Vec::new();
    for (i, op) in h.incrs.iter().enumerate().filter(|(_, o)| o.counter == c) {
        for a in &op.attempts {
            lines.push((
                a.sent_ms,
                format!(
                    "incr #{i} delta {} id {:?} -> {:?} [{:?}]",
                    op.delta,
                    a.event_id,
                    a.answers,
                    op.status()
                ),
            ));
        }
    }
    for rd in h.reads.iter().filter(|x| x.counter == c) {
        lines.push((
            rd.invoked_ms,
            format!("read {:?} done {:?} -> {:?}", rd.consistency, rd.done_ms, rd.value),
        ));
    }
    for (t, n) in &h.crashes {
        lines.push((*t, format!("crash node{}", n + 1)));
    }
    lines.sort_by_key(|l| l.0);
    for (t, l) in lines {
        println!("  {t:>6} {l}");
    }
}

fn reproduce(args: &Args, seed: u64) -> Result<bool> {
    let started = Instant::now();
    let r = run(args.config(seed));
    println!("seed {seed}: {} nodes, faults {}, tier {}", r.config.nodes, r.config.faults, r.config.tier);
    println!("  simulated time   {} ms", r.sim_ms);
    println!("  events           {}", r.events);
    println!("  operations       {}", r.ops);
    for (k, v) in &r.faults {
        println!("  {:<16} {v}", k.as_str());
    }
    println!("  trace hash       {:016x}", r.trace_hash);
    if let Some(name) = &args.dump {
        dump(&r, name);
    }
    println!("  wall time        {:.3} s", started.elapsed().as_secs_f64());
    if r.violations.is_empty() {
        println!("  no violations");
        return Ok(true);
    }
    for v in &r.violations {
        println!("  {v}");
    }
    println!("  reproduce: {}", r.config.reproduce_command());
    Ok(false)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !(1..=tally_sim::config::REPLICAS_MAX).contains(&args.replicas) {
        bail!("--replicas must be 1..={}", tally_sim::config::REPLICAS_MAX);
    }
    if args.short_dedup == Some(true)
        && args.clock_skew_ms.unwrap_or(0) > tally_sim::config::SHORT_DEDUP_SKEW_MS_MAX
    {
        bail!(
            "--short-dedup true needs clocks within {} ms of each other: a dedup record is only promised its window less the skew",
            tally_sim::config::SHORT_DEDUP_SKEW_MS_MAX
        );
    }
    if args.replicas > 1 && args.tier == Tier::Model {
        bail!("--replicas above 1 needs --tier engine or cluster (tier 1 models one copy per shard)");
    }
    // `TALLY_SIM_LOG=tally_engine=debug` prints the engines' own log lines (tier 2) on
    // stderr, beside `TALLY_SIM_DEBUG`'s events; output only, no influence on a run.
    if let Ok(filter) = std::env::var("TALLY_SIM_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .without_time()
            .with_ansi(false)
            .init();
    }
    if args.tier != Tier::Model && !tally_sim::config::TOKIO_SEEDED {
        eprintln!(
            "note: built without --cfg tokio_unstable, so tokio's own draws are not seeded and a tier-2 \
             run may not repeat exactly; build as `{} cargo run --release -p tally-sim -- …`",
            tally_sim::config::SEEDED_TOKIO_BUILD
        );
    }
    if let Some(seed) = args.reproduce {
        let ok = reproduce(&args, seed)?;
        std::process::exit(if ok { 0 } else { 1 });
    }
    let (start, end) = parse_range(&args.seeds)?;
    let threads =
        args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let bar = ProgressBar::new(end - start);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} seeds  {elapsed_precise} (eta {eta})  {msg}")
            .context("progress template")?,
    );
    let next = AtomicU64::new(start);
    let totals = Mutex::new(Totals::default());
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::SeqCst);
                if seed >= end {
                    break;
                }
                let r = run(args.config(seed));
                let mut t = totals.lock().expect("no worker panics while holding the lock");
                t.add(r);
                if t.violations > 0 {
                    bar.set_message(format!("{} failing seeds", t.failing_seeds));
                }
                bar.inc(1);
            });
        }
    });
    bar.finish();
    let t = totals.into_inner().expect("workers are done");
    let wall = started.elapsed().as_secs_f64();
    for f in &t.failures {
        print_failure(f);
    }
    println!();
    println!("| measure | value |");
    println!("| --- | --- |");
    println!("| seeds | {} ({start}..{end}) |", t.seeds);
    println!("| nodes, faults, tier | {}, {}, {} |", args.nodes, args.faults, args.tier);
    if args.replicas > 1 {
        println!("| copies of every shard | {} |", args.replicas);
    }
    println!(
        "| simulated time | {:.1} s total, {:.2} s per seed |",
        t.sim_ms as f64 / 1e3,
        t.sim_ms as f64 / 1e3 / t.seeds as f64
    );
    println!("| events applied | {} |", t.events);
    println!("| operations | {} |", t.ops);
    for k in FaultKind::ALL {
        println!("| faults: {} | {} |", k.as_str(), t.faults.get(&k).copied().unwrap_or(0));
    }
    println!("| violations | {} in {} seeds |", t.violations, t.failing_seeds);
    println!(
        "| wall time | {wall:.1} s on {threads} threads ({:.1} ms per seed) |",
        wall * 1e3 / t.seeds as f64
    );
    if t.failing_seeds > 0 {
        std::process::exit(1);
    }
    Ok(())
}
