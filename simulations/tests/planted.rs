//! Every planted bug is caught within 100 seeds — the checker can fail. Each bug is
//! switched on alone; the seed that catches it must pass with the bug switched off, so
//! the violation is the bug's and not the checker's.
//!
//! Run with `cargo test -p tally-sim --features planted-bugs`.
#![cfg(feature = "planted-bugs")]

use tally_core::planted::Bug;
use tally_sim::{run, FaultLevel, SimConfig};

/// Seeds tried per bug before giving up.
const SEEDS_MAX: u64 = 100;

fn config(seed: u64, bug: Option<Bug>) -> SimConfig {
    // Alternate fault levels so each bug meets both.
    let faults = if seed % 2 == 0 { FaultLevel::Heavy } else { FaultLevel::Light };
    SimConfig { plant: bug, ..SimConfig::short(seed, 5, faults) }
}

#[test]
fn every_planted_bug_is_caught() {
    let mut missed = Vec::new();
    for bug in Bug::ALL {
        let caught = (0..SEEDS_MAX).find_map(|seed| {
            let r = run(config(seed, Some(bug)));
            (!r.violations.is_empty()).then_some((seed, r))
        });
        match caught {
            Some((seed, r)) => {
                println!("{bug}: caught by seed {seed}: {}", r.violations[0]);
                let clean = run(config(seed, None));
                assert!(
                    clean.violations.is_empty(),
                    "seed {seed} fails without {bug} too: {:?}",
                    clean.violations
                );
            }
            None => missed.push(bug),
        }
    }
    assert!(missed.is_empty(), "not caught within {SEEDS_MAX} seeds: {missed:?}");
}
