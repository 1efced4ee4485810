//! A fixed short set of seeds — 32 per fault level on a 5-node cluster — must run
//! with no violation. This is the simulation's regression gate: any change to the
//! core, the store or the shells that breaks an invariant on these histories fails
//! here, with the command that reproduces the failing seed.

use tally_sim::{run, FaultLevel, SimConfig};

/// Seeds per fault level.
const SEEDS: u64 = 32;
/// Nodes per cluster.
const NODES: u8 = 5;

fn gate(faults: FaultLevel) {
    let mut failures = Vec::new();
    for seed in 0..SEEDS {
        let r = run(SimConfig::short(seed, NODES, faults));
        assert!(r.ops > 0, "seed {seed} ran no operation");
        if !r.violations.is_empty() {
            let first: Vec<String> = r.violations.iter().take(3).map(|v| v.to_string()).collect();
            failures.push(format!("{}\n    {}", r.config.reproduce_command(), first.join("\n    ")));
        }
    }
    assert!(failures.is_empty(), "{} seeds violated invariants:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn light_faults_violate_nothing() {
    gate(FaultLevel::Light);
}

#[test]
fn heavy_faults_violate_nothing() {
    gate(FaultLevel::Heavy);
}

/// Seeds that long tier-1 runs found, each failing before its fix: 7203 (heavy) — an
/// adoption still in flight when its change completed imported its page after the
/// next change had taken the shard away, and that node's hand-off could then never
/// report the copy gone (the run did not settle).
const FOUND: [u64; 1] = [7203];

#[test]
fn found_seeds_violate_nothing() {
    for seed in FOUND {
        let r = run(SimConfig::standard(seed, NODES, FaultLevel::Heavy));
        let first: Vec<String> = r.violations.iter().take(3).map(|v| v.to_string()).collect();
        assert!(r.violations.is_empty(), "{}\n    {}", r.config.reproduce_command(), first.join("\n    "));
    }
}
