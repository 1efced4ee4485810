//! The same seed gives the same run: every event applied is hashed into the trace
//! hash, so two runs of one seed must agree on it (and on the history they recorded),
//! and different seeds must differ.

use tally_sim::{run, FaultLevel, SimConfig};

#[test]
fn a_seed_replays_exactly() {
    for (seed, faults) in [(7, FaultLevel::Heavy), (8, FaultLevel::Light)] {
        let cfg = SimConfig::short(seed, 5, faults);
        let (a, b) = (run(cfg.clone()), run(cfg));
        assert_eq!(a.trace_hash, b.trace_hash, "seed {seed}: trace hashes differ");
        assert_eq!((a.events, a.sim_ms, a.ops), (b.events, b.sim_ms, b.ops), "seed {seed}");
        assert_eq!(a.faults, b.faults, "seed {seed}");
        assert_eq!(format!("{:?}", a.history), format!("{:?}", b.history), "seed {seed}: histories differ");
    }
}

#[test]
fn different_seeds_differ() {
    let hashes: std::collections::BTreeSet<u64> =
        (0..6).map(|seed| run(SimConfig::short(seed, 5, FaultLevel::Heavy)).trace_hash).collect();
    assert_eq!(hashes.len(), 6, "six seeds gave only {} distinct traces", hashes.len());
    let light = run(SimConfig::short(0, 5, FaultLevel::Light)).trace_hash;
    assert!(!hashes.contains(&light), "fault level must change the run");
}
