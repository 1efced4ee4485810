//! Every bug planted in the cluster layer (`tally-cluster`, `tally-raft`) is caught
//! by tier 3 (whole nodes) within 200 seeds, each switched on alone; the catching
//! seed must pass with the bug off, so the violation is the bug's and not the
//! checker's. One test per bug.
//!
//! Run with `cargo test -p tally-sim --features planted-bugs`.
#![cfg(feature = "planted-bugs")]

use tally_core::planted::Bug;
use tally_sim::{run, FaultLevel, SimConfig, Tier};

/// Seeds tried per bug before giving up.
const SEEDS_MAX: u64 = 200;

/// A standard heavy run of five whole nodes with three copies of every shard:
/// crashes lose disks, faults aim at range leaders and at the metadata leader.
fn replicated(seed: u64, bug: Option<Bug>) -> SimConfig {
    SimConfig {
        plant: bug,
        ..SimConfig::standard(seed, 5, FaultLevel::Heavy).on(Tier::Cluster).replicated(3)
    }
}

fn caught(bug: Bug) {
    let found = (0..SEEDS_MAX).find_map(|seed| {
        let r = run(replicated(seed, Some(bug)));
        (!r.violations.is_empty()).then_some((seed, r))
    });
    let Some((seed, r)) = found else { panic!("{bug} not caught within {SEEDS_MAX} seeds") };
    println!("{bug}: caught by seed {seed}: {}", r.violations[0]);
    let clean = run(replicated(seed, None));
    assert!(clean.violations.is_empty(), "seed {seed} fails without {bug} too: {:?}", clean.violations);
}

#[test]
fn replica_id_from_raft_id_is_caught() {
    caught(Bug::ReplicaIdFromRaftId);
}

#[test]
fn every_cluster_bug_has_a_test() {
    assert_eq!(Bug::CLUSTER.len(), 1, "a new cluster-layer bug needs its own test above");
}
