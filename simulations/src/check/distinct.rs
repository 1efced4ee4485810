//! A distinct estimate stays within the HyperLogLog's error: between the members of
//! increments acknowledged before the read began and the members of every increment
//! that may have been counted by its end, widened by [`ERROR_MULTIPLE`] standard
//! errors (`1.04 / sqrt(2^14)` ≈ 0.81 % each, so ≈ 3.25 %) plus one member.

use super::{name, standing, Standing, Violation};
use crate::history::History;
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

/// The members of `counter`'s increments applied at or after `start_ms` (run
/// time) that a read begun at `from_ms` and ended at `to_ms` must count, and those
/// it may count ([`standing`]).
pub fn members_since(
    h: &History,
    counter: usize,
    start_ms: i64,
    from_ms: u64,
    to_ms: u64,
) -> (BTreeSet<u32>, BTreeSet<u32>) {
    let (mut must, mut may) = (BTreeSet::new(), BTreeSet::new());
    for op in h.incrs.iter().filter(|o| o.counter == counter) {
        let Some(m) = op.member else { continue };
        match standing(h, op, start_ms, from_ms, to_ms, from_ms) {
            Standing::Counted => {
                must.insert(m);
                may.insert(m);
            }
            Standing::InDoubt => {
                may.insert(m);
            }
            Standing::Excluded => {}
        }
    }
    (must, may)
}

/// The estimates the error allows for `must`..`may` members counted, if `estimate`
/// is not among them.
pub fn outside(estimate: u64, must: usize, may: usize) -> Option<(u64, u64)> {
    let eps = tolerance();
    let low = (((must as f64) * (1.0 - eps)).floor() as u64).saturating_sub(1);
    let high = ((may as f64) * (1.0 + eps)).ceil() as u64 + 1;
    (estimate < low || estimate > high).then_some((low, high))
}

/// Runs the check: distinct reads, and the distinct estimates of window reads.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for d in &h.distincts {
        let (Some(done), Some((estimate, complete))) = (d.done_ms, d.estimate) else { continue };
        if !complete {
            continue;
        }
        let (must, may) = members_since(h, d.counter, i64::MIN, d.invoked_ms, done);
        if let Some((low, high)) = outside(estimate, must.len(), may.len()) {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "distinct estimate of {} at {done} ms is {estimate}; members counted {}..{} allow [{low}, {high}]",
                    name(h, d.counter),
                    must.len(),
                    may.len(),
                ),
            });
        }
    }
    for r in &h.windows {
        let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
        let Some(estimate) = v.estimate.filter(|_| v.complete) else { continue };
        let (must, may) = members_since(h, r.counter, v.start_ms, r.invoked_ms, done);
        if let Some((low, high)) = outside(estimate, must.len(), may.len()) {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "window distinct estimate of {} from {} ms at {done} ms is {estimate}; members counted {}..{} allow [{low}, {high}]",
                    name(h, r.counter),
                    v.start_ms,
                    must.len(),
                    may.len(),
                ),
            });
        }
    }
}
