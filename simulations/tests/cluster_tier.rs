//! Tier 3, whole nodes: each simulated node is a `tally_cluster::ClusterNode` with
//! the real metadata group, placement, range groups and transport contract. A fixed
//! short set of seeds must run with no violation, with one copy and with three, and
//! a seed must replay exactly.

use tally_sim::history::FaultKind;
use tally_sim::{run, FaultLevel, RunReport, SimConfig, Tier};

/// Seeds per fault level with one copy (kept small: each is a cluster of whole
/// nodes, metadata group included).
const SEEDS: u64 = 4;
/// Nodes of the runs with one copy.
const NODES: u8 = 3;
/// Seeds with three copies searched for a lost disk and a metadata failover, and
/// their nodes: more than the copies, so some nodes replicate a range and others
/// only route to it.
const REPLICATED_SEEDS_MAX: u64 = 8;
const REPLICATED_NODES: u8 = 5;

fn config(seed: u64, faults: FaultLevel) -> SimConfig {
    SimConfig::short(seed, NODES, faults).on(Tier::Cluster)
}

fn failures(runs: impl IntoIterator<Item = RunReport>) -> Vec<String> {
    let mut failures = Vec::new();
    for r in runs {
        assert!(r.ops > 0, "seed {} ran no operation", r.config.seed);
        assert!(
            r.history.incrs.iter().any(|o| !o.attempts.is_empty()),
            "seed {} sent no increment",
            r.config.seed
        );
        if !r.violations.is_empty() {
            let first: Vec<String> = r.violations.iter().take(3).map(|v| v.to_string()).collect();
            failures.push(format!("{}\n    {}", r.config.reproduce_command(), first.join("\n    ")));
        }
    }
    failures
}

fn gate(faults: FaultLevel) {
    let runs: Vec<RunReport> = (0..SEEDS).map(|seed| run(config(seed, faults))).collect();
    let count = |kind| runs.iter().map(|r| r.faults.get(&kind).copied().unwrap_or(0)).sum::<u64>();
    let (deleted, resets) = (count(FaultKind::CounterDeleted), count(FaultKind::MetaReset));
    let found = failures(runs);
    assert!(found.is_empty(), "{} seeds violated invariants:\n{}", found.len(), found.join("\n"));
    // Tier 3 deletes and re-creates a counter, and breaks metadata RPCs off.
    assert!(deleted > 0 && resets > 0, "{deleted} deletions answered, {resets} metadata RPCs reset");
}

#[test]
fn whole_nodes_light_faults_violate_nothing() {
    gate(FaultLevel::Light);
}

#[test]
fn whole_nodes_heavy_faults_violate_nothing() {
    gate(FaultLevel::Heavy);
}

/// Three copies on five whole nodes: disks are lost (a node comes back with a new
/// metadata database, so a new identity the metadata group must take as a new
/// incarnation, and new range replicas its groups must catch up and promote), and
/// faults aim at range leaders and at the metadata group's leader. Without
/// deletions (the gates above run them), which keep the metadata group busy and
/// leave fewer moments when a disk may go.
#[test]
fn whole_nodes_with_three_copies_violate_nothing_through_lost_disks() {
    let (mut lost, mut failovers, mut runs) = (0, 0, Vec::new());
    for seed in 0..REPLICATED_SEEDS_MAX {
        let cfg = SimConfig::short(seed, REPLICATED_NODES, FaultLevel::Heavy).on(Tier::Cluster);
        let r = run(cfg.replicated(3).with_deletions(false));
        lost += r.faults.get(&FaultKind::DiskLost).copied().unwrap_or(0);
        failovers += r.faults.get(&FaultKind::MetaOutage).copied().unwrap_or(0);
        runs.push(r);
        if lost > 0 && failovers > 0 {
            break;
        }
    }
    let n = runs.len();
    let found = failures(runs);
    assert!(found.is_empty(), "{} seeds violated invariants:\n{}", found.len(), found.join("\n"));
    assert!(lost > 0, "no disk was lost in {n} runs");
    assert!(failovers > 0, "no metadata leader was cut off in {n} runs");
}

/// Whole nodes whose range groups snapshot every ten entries, in 512-byte frames
/// (`ClusterNodeConfig::groups`): replicas that fall behind or come back with an
/// empty disk catch up by snapshots of many frames, through the cluster's own
/// transport, and break nothing.
#[test]
fn whole_nodes_catch_up_through_snapshots_of_many_frames() {
    let (mut installed, mut runs) = (0, Vec::new());
    for seed in 0..REPLICATED_SEEDS_MAX {
        let cfg = SimConfig::standard(seed, REPLICATED_NODES, FaultLevel::Heavy).on(Tier::Cluster);
        let r = run(cfg.replicated(3).with_small_snapshots().with_deletions(false));
        installed += r.faults.get(&FaultKind::SnapshotInstalled).copied().unwrap_or(0);
        runs.push(r);
        if installed > 0 {
            break;
        }
    }
    let n = runs.len();
    let found = failures(runs);
    assert!(found.is_empty(), "{} seeds violated invariants:\n{}", found.len(), found.join("\n"));
    assert!(installed > 0, "no snapshot was installed in {n} runs");
}

/// Seeds that found defects, replayed as they ran.
///
/// Seed 182 with small snapshots: a range leader deposed while its replication
/// stream to a new learner was under way read, for that stream, a log purged (by a
/// snapshot) and refilled by the new leader since the stream planned the read. The
/// log answered the entries past the purged ones, openraft sent them to the
/// learner as the first of the log, and the learner's group stopped applying a
/// log with a hole (`no-fatal`: "try to get log at index 0"; and `liveness`: the
/// replica never caught up).
#[test]
fn whole_nodes_found_seeds_violate_nothing() {
    let small_snapshots = [182];
    let runs = small_snapshots.into_iter().map(|seed| {
        let cfg = SimConfig::standard(seed, REPLICATED_NODES, FaultLevel::Heavy).on(Tier::Cluster);
        run(cfg.replicated(3).with_small_snapshots())
    });
    let found = failures(runs);
    assert!(found.is_empty(), "{} seeds violated invariants:\n{}", found.len(), found.join("\n"));
}

/// Exact replays need tokio's generator seeded (`--cfg tokio_unstable`, as `.ci/run`
/// builds the simulator): the metadata group's openraft orders ready branches and
/// watch wakers with it, and a run of whole nodes meets such ties.
#[test]
fn whole_node_seed_replays_exactly() {
    if !tally_sim::config::TOKIO_SEEDED {
        eprintln!(
            "not checked: this build does not seed tokio's generator ({})",
            tally_sim::config::SEEDED_TOKIO_BUILD
        );
        return;
    }
    let cfg = config(1, FaultLevel::Heavy);
    let (a, b) = (run(cfg.clone()), run(cfg));
    assert!(a.events > 0, "the seed traced nothing");
    assert_eq!(a.trace_hash, b.trace_hash, "trace hashes differ");
    assert_eq!((a.events, a.sim_ms, a.ops), (b.events, b.sim_ms, b.ops));
    assert_eq!(format!("{:?}", a.history), format!("{:?}", b.history), "histories differ");
    let engines = run(SimConfig::short(1, NODES, FaultLevel::Heavy).on(Tier::Engine));
    assert_ne!(engines.trace_hash, a.trace_hash, "whole nodes must change the run");
}
