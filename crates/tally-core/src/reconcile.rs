//! A reconciliation's correction: its event id and its delta.
//!
//! A correction is one increment to one shard. Its event id belongs to its *run*:
//! resent within the run (its shard was sealed meanwhile, its answer was lost), it
//! is deduplicated like any event id; a later run is a new correction even when it
//! finds the same total against the same authority, because the counter may have
//! moved away from that total and back since.

/// Largest drift one reconciliation corrects, in counter units. The correction is one
/// increment to one shard, and a quarter of a shard's range always fits beside what
/// the shard may hold, so a correction applies whole or is refused whole: it never
/// applies in part. A larger drift says the authoritative total is wrong, or that the
/// counter must be brought there in steps the caller chooses.
pub const RECONCILE_DRIFT_ABS_MAX: i128 = 1 << 61;

/// The delta that brings a counter from `before` to `authoritative`, if the drift is
/// within [`RECONCILE_DRIFT_ABS_MAX`] (and so within one `i64`).
pub fn correction_delta(authoritative: i128, before: i128) -> Option<i64> {
    let drift = authoritative.checked_sub(before)?;
    (drift.unsigned_abs() <= RECONCILE_DRIFT_ABS_MAX.unsigned_abs())
        .then(|| i64::try_from(drift).expect("the bound is inside i64"))
}

/// The event ids of one node's corrections, one per run: `{prefix}{run}`, where the
/// prefix names the node and its store's incarnation, so no id repeats within the
/// node's life, across its lives, or between nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorrectionIds {
    prefix: String,
    runs: u64,
}

impl CorrectionIds {
    /// The ids of `node` in its store's `incarnation` (never repeated by any store
    /// the node runs). `~` is outside the client alphabet, so no client id can
    /// collide with one.
    pub fn new(node: &str, incarnation: impl std::fmt::Display) -> Self {
        Self { prefix: format!("~reconcile:{node}:{incarnation}:"), runs: 0 }
    }

    /// The id of the next run's correction.
    pub fn next_run(&mut self) -> String {
        self.runs += 1;
        format!("{}{}", self.prefix, self.runs)
    }
}

/// The event id of the correction of a run that every node names alike: a scheduled
/// source's `instant_ms`. Two nodes that both run that instant (a metadata leader
/// change between them) write one correction if they read the same total; the next
/// instant is a correction of its own.
pub fn scheduled_correction_id(source: &str, instant_ms: u64) -> String {
    format!("~reconcile:at:{:016x}:{instant_ms}", crate::hash::hash64(SOURCE_NAME_SEED, source.as_bytes()))
}

/// Seed of the hash that shortens a source's name in its corrections' ids.
const SOURCE_NAME_SEED: u64 = 0x7265_636f_6e63_696c;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_correction_is_one_delta_within_the_bound() {
        assert_eq!(correction_delta(100, 95), Some(5));
        assert_eq!(correction_delta(-7, 100), Some(-107));
        assert_eq!(correction_delta(RECONCILE_DRIFT_ABS_MAX, 0), Some(1 << 61));
        assert_eq!(correction_delta(-RECONCILE_DRIFT_ABS_MAX, 0), Some(-(1 << 61)));
        for (a, b) in [(RECONCILE_DRIFT_ABS_MAX + 1, 0), (i128::MAX, -5), (i128::MIN, 1), (10i128.pow(30), 0)]
        {
            assert_eq!(correction_delta(a, b), None, "{a} {b}");
        }
    }

    #[test]
    fn correction_ids_never_repeat_within_a_life_across_lives_or_between_nodes() {
        let mut first = CorrectionIds::new("node1", "1000.1");
        let (a, b) = (first.next_run(), first.next_run());
        assert_ne!(a, b);
        let mut next_life = CorrectionIds::new("node1", "1000.2");
        assert!(![a.clone(), b].contains(&next_life.next_run()));
        assert_ne!(CorrectionIds::new("node2", "1000.1").next_run(), a, "another node");
        assert!(a.starts_with('~'));
    }

    #[test]
    fn a_scheduled_instant_names_one_correction_on_every_node() {
        assert_eq!(scheduled_correction_id("ledger", 60_000), scheduled_correction_id("ledger", 60_000));
        assert_ne!(scheduled_correction_id("ledger", 60_000), scheduled_correction_id("ledger", 120_000));
        assert_ne!(scheduled_correction_id("ledger", 60_000), scheduled_correction_id("events", 60_000));
        assert!(!scheduled_correction_id("ledger", 0).starts_with("~reconcile:ledger"), "no raw name");
    }
}
