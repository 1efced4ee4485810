//! A distinct estimate stays within the HyperLogLog's error: between the members of
//! increments acknowledged before the read began and the members of every increment
//! that may have been counted by its end, widened by [`ERROR_MULTIPLE`] standard
//! errors (`1.04 / sqrt(2^14)` ≈ 0.81 % each, so ≈ 3.25 %) plus one member.

use super::{name, surely_refused, Violation};
use crate::history::{History, Status};
use std::collections::BTreeSet;

/// The invariant's name.
pub const NAME: &str = "distinct-error";

/// Standard errors of tolerance: the estimate of a dense sketch is within four of the
/// truth with overwhelming probability; sparse sketches (small sets) are near exact.
pub const ERROR_MULTIPLE: f64 = 4.0;

/// HyperLogLog precision of the core's sketch.
pub const HLL_PRECISION: u32 = 14;

/// The tolerated relative error.
pub fn tolerance() -> f64 {
    ERROR_MULTIPLE * 1.04 / f64::from(1u32 << HLL_PRECISION).sqrt()
}

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    let eps = tolerance();
    for d in &h.distincts {
        let (Some(done), Some((estimate, complete))) = (d.done_ms, d.estimate) else { continue };
        if !complete {
            continue;
        }
        let mut must = BTreeSet::new();
        let mut may = BTreeSet::new();
        for op in h.incrs.iter().filter(|o| o.counter == d.counter) {
            let Some(m) = op.member else { continue };
            if let Status::Applied { .. } = op.status_at(d.invoked_ms) {
                must.insert(m);
                may.insert(m);
            } else if op.invoked_ms < done && !surely_refused(h, op) {
                may.insert(m);
            }
        }
        let low = ((must.len() as f64) * (1.0 - eps)).floor() as u64;
        let high = ((may.len() as f64) * (1.0 + eps)).ceil() as u64 + 1;
        if estimate < low.saturating_sub(1) || estimate > high {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "distinct estimate of {} at {done} ms is {estimate}; members counted {}..{} allow [{}, {high}]",
                    name(h, d.counter),
                    must.len(),
                    may.len(),
                    low.saturating_sub(1)
                ),
            });
        }
    }
}
