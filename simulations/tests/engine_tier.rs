//! Tier 2, the real engine in simulation: a fixed short set of seeds per fault level
//! must run with no violation, and a seed must replay exactly (same trace hash, same
//! history) while different seeds differ.

use tally_sim::{run, FaultLevel, SimConfig, Tier};

/// Seeds per fault level (kept small: each is a whole cluster of real engines).
const SEEDS: u64 = 12;
/// Nodes per cluster.
const NODES: u8 = 5;

fn config(seed: u64, faults: FaultLevel) -> SimConfig {
    SimConfig::short(seed, NODES, faults).on(Tier::Engine)
}

fn gate(faults: FaultLevel) {
    gate_with(faults, config);
}

fn gate_with(faults: FaultLevel, config: impl Fn(u64, FaultLevel) -> SimConfig) {
    let mut failures = Vec::new();
    for seed in 0..SEEDS {
        let r = run(config(seed, faults));
        assert!(r.ops > 0, "seed {seed} ran no operation");
        assert!(r.history.incrs.iter().any(|o| !o.attempts.is_empty()), "seed {seed} sent no increment");
        if !r.violations.is_empty() {
            let first: Vec<String> = r.violations.iter().take(3).map(|v| v.to_string()).collect();
            failures.push(format!("{}\n    {}", r.config.reproduce_command(), first.join("\n    ")));
        }
    }
    assert!(failures.is_empty(), "{} seeds violated invariants:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn engine_tier_light_faults_violate_nothing() {
    gate(FaultLevel::Light);
}

#[test]
fn engine_tier_heavy_faults_violate_nothing() {
    gate(FaultLevel::Heavy);
}

/// One engine embedded as a library: its metadata in its own store (the local
/// catalog), crashed and torn, with `del:0` deleted and re-created under it.
fn embedded(seed: u64, faults: FaultLevel) -> SimConfig {
    SimConfig::short(seed, NODES, faults).embedded()
}

#[test]
fn an_embedded_engine_violates_nothing() {
    for faults in [FaultLevel::Light, FaultLevel::Heavy] {
        gate_with(faults, embedded);
    }
    let r = run(embedded(3, FaultLevel::Heavy));
    assert_eq!(r.config.nodes, 1);
    assert!(r.history.deletions.iter().any(|d| d.done_ms.is_some()), "no deletion was answered");
    assert!(r.config.reproduce_command().contains("--embedded"));
}

/// Light embedded seeds that found a re-created counter's acknowledged increments
/// missing from fresh reads: a request still under way for the deleted namesake
/// kept a shard's actor running, and the new counter's runtime took the shard for
/// one that holds nothing, so reads skipped it (`Ctx::known_empty`).
#[test]
fn embedded_found_seeds_violate_nothing() {
    for seed in [228, 482, 554, 635] {
        let r = run(SimConfig::standard(seed, 1, FaultLevel::Light).embedded());
        let first: Vec<String> = r.violations.iter().take(3).map(|v| v.to_string()).collect();
        assert!(r.violations.is_empty(), "{}\n    {}", r.config.reproduce_command(), first.join("\n    "));
    }
}

#[test]
fn engine_tier_seed_replays_exactly() {
    for (seed, faults) in [(7, FaultLevel::Heavy), (8, FaultLevel::Light)] {
        let cfg = config(seed, faults);
        let (a, b) = (run(cfg.clone()), run(cfg));
        assert!(a.events > 0, "seed {seed} traced nothing");
        assert_eq!(a.trace_hash, b.trace_hash, "seed {seed}: trace hashes differ");
        assert_eq!((a.events, a.sim_ms, a.ops), (b.events, b.sim_ms, b.ops), "seed {seed}");
        assert_eq!(a.faults, b.faults, "seed {seed}");
        assert_eq!(format!("{:?}", a.history), format!("{:?}", b.history), "seed {seed}: histories differ");
    }
}

#[test]
fn engine_tier_different_seeds_differ() {
    let hashes: std::collections::BTreeSet<u64> =
        (0..4).map(|seed| run(config(seed, FaultLevel::Heavy)).trace_hash).collect();
    assert_eq!(hashes.len(), 4, "four seeds gave only {} distinct traces", hashes.len());
    let model = run(SimConfig::short(0, NODES, FaultLevel::Heavy)).trace_hash;
    assert!(!hashes.contains(&model), "the tier must change the run");
}

/// Seeds a long run found violating, kept as regressions once fixed: 102 (a shard
/// handed off lost its seal at its new owner) and 57 with 16 transitions (an
/// adoption still importing when its membership change completed landed over a
/// write served beside it), 3176 (a previous owner poisoned by a failed flush
/// handed off a state it then lost; the new owner's interrupted import kept a dedup
/// record whose value the next import no longer had), 1218 (a shard sealed before
/// its first write held only a seal marker, which its previous owner's hand-off did
/// not move: the new owner took writes the sealed sum had not counted, and a window
/// read missed one). (The read on lagging metadata that seed 858 found under an
/// earlier schedule is kept by the planted bug `read-ignores-seal`.)
#[test]
fn engine_tier_found_seeds_violate_nothing() {
    for (seed, transitions) in [(102, 4), (57, 16), (3176, 4), (1218, 4)] {
        let cfg =
            SimConfig { transitions, ..SimConfig::standard(seed, NODES, FaultLevel::Heavy).on(Tier::Engine) };
        let r = run(cfg);
        let first: Vec<String> = r.violations.iter().take(3).map(|v| v.to_string()).collect();
        assert!(r.violations.is_empty(), "{}\n    {}", r.config.reproduce_command(), first.join("\n    "));
    }
}
