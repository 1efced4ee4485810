//! The checker: invariants over the recorded history, one file each.
//!
//! Every check reads only the [`History`]: what clients invoked, what they were
//! answered and when, and which faults were injected. An increment whose every
//! attempt timed out is *unknown* — it may or may not have been counted — never
//! *absent*.
//!
//! | file | invariant |
//! | --- | --- |
//! | [`exactly_once`] | an event id is counted at most once; answers never contradict |
//! | [`sync_bounds`] | a `sync` total lies between acknowledged and acknowledged-plus-unknown, and equals it once every outcome is known |
//! | [`batched`] | a batched total never over counts and loses at most the stated window per crash |
//! | [`reconcile`] | reconciliation brings drift to zero, and a second one finds none |
//! | [`staleness`] | a cached read is never staler than `rollup_ms` plus one refresh while the cluster is healthy |
//! | [`distinct`] | a distinct estimate (of the whole counter, or of a window) stays within a stated multiple of HyperLogLog's standard error |
//! | [`frequency`] | a frequency estimate lies between the member's acknowledged weight and all the weight sent; a certain lower bound never exceeds the member's weight sent (tiers 2 and 3) |
//! | [`window`] | a `sync` counter's window sums exactly what was applied in its buckets (tier 2) |
//! | [`bounded`] | a bounded counter's value never crosses its bound, no read reports it beyond, and no window holds more than its limit (tier 2) |
//! | [`recreated`] | a counter deleted and created again holds exactly its own increments, never the deleted one's (tier 3) |

use crate::history::{Disturbance, History, IncrOp, Role, Status};
use std::fmt;

pub mod batched;
pub mod bounded;
pub mod distinct;
pub mod exactly_once;
pub mod frequency;
pub mod reconcile;
pub mod recreated;
pub mod staleness;
pub mod sync_bounds;
pub mod window;

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which invariant (the check's name).
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.invariant, self.detail)
    }
}

/// Runs every check.
pub fn check_all(h: &History) -> Vec<Violation> {
    let mut v = Vec::new();
    exactly_once::check(h, &mut v);
    sync_bounds::check(h, &mut v);
    batched::check(h, &mut v);
    reconcile::check(h, &mut v);
    staleness::check(h, &mut v);
    distinct::check(h, &mut v);
    frequency::check(h, &mut v);
    window::check(h, &mut v);
    bounded::check(h, &mut v);
    recreated::check(h, &mut v);
    v
}

/// What a read of a counter may return, from the increments alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Sum of increments acknowledged before the read began: they must be included.
    pub acked: i128,
    /// Lowest value the increments in doubt can take the total to.
    pub low: i128,
    /// Highest value.
    pub high: i128,
    /// Increments in doubt (invoked before the read ended, not surely refused,
    /// acknowledged after it began or never).
    pub in_doubt: usize,
}

/// Bounds for a read of `counter` that began at `from_ms` and ended at `to_ms`.
pub fn bounds(h: &History, counter: usize, from_ms: u64, to_ms: u64) -> Bounds {
    bounds_since(h, counter, i64::MIN, from_ms, to_ms, from_ms)
}

/// The history's earliest time a node's `as_of` stamp may stand for: the stamping
/// clock may run up to `h.clock_skew_ms` ahead of true time.
pub fn as_of(h: &History, as_of_ms: u64) -> u64 {
    as_of_ms.saturating_sub(h.clock_skew_ms)
}

/// Where an increment stands for a read of what was applied at or after `start_ms`
/// (run time; `i64::MIN` for the whole counter) that began at `from_ms` and ended
/// at `to_ms`. An increment is applied between its invocation and its
/// acknowledgement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Acknowledged before the read began and invoked at or after the start: the
    /// read must include it.
    Counted,
    /// It may or may not be included.
    InDoubt,
    /// The read cannot include it: acknowledged before the start, invoked after the
    /// read ended, or surely refused.
    Excluded,
}

/// Where `op` stands for such a read (see [`Standing`]). `start_ms` is a node's
/// stamp, and the shard that filed the increment judged it by its own clock: with
/// clocks up to `h.clock_skew_ms` off true time, an increment is surely inside only
/// if applied that much after the start, surely outside only if that much before.
/// A window read also leaves out buckets ahead of the reader's clock, so an
/// increment acknowledged less than twice the skew before the read was sent, at
/// `read_ms`, may be missing from it.
pub fn standing(h: &History, op: &IncrOp, start_ms: i64, from_ms: u64, to_ms: u64, read_ms: u64) -> Standing {
    let skew = i128::from(h.clock_skew_ms);
    let surely_after = |t: u64| i128::from(t) >= i128::from(start_ms) + skew;
    let surely_before = |t: u64| i128::from(t) < i128::from(start_ms) - skew;
    let windowed = start_ms != i64::MIN;
    let surely_stamped_before_read =
        |ack: u64| !windowed || i128::from(ack) + 2 * skew <= i128::from(read_ms);
    match op.status_at(from_ms) {
        Status::Applied { ack_ms } if surely_after(op.invoked_ms) && surely_stamped_before_read(ack_ms) => {
            Standing::Counted
        }
        Status::Applied { ack_ms } if surely_before(ack_ms) => Standing::Excluded,
        Status::Applied { .. } => Standing::InDoubt,
        _ if op.invoked_ms >= to_ms || surely_refused(h, op) => Standing::Excluded,
        _ => Standing::InDoubt,
    }
}

/// Bounds for a read of what `counter`'s increments applied at or after `start_ms`
/// (run time) add up to — a window's — that began at `from_ms` and ended at `to_ms`.
pub fn bounds_since(
    h: &History,
    counter: usize,
    start_ms: i64,
    from_ms: u64,
    to_ms: u64,
    read_ms: u64,
) -> Bounds {
    let mut b = Bounds { acked: 0, low: 0, high: 0, in_doubt: 0 };
    for op in h.incrs.iter().filter(|o| o.counter == counter) {
        let d = i128::from(op.delta);
        match standing(h, op, start_ms, from_ms, to_ms, read_ms) {
            Standing::Counted => b.acked += d,
            Standing::Excluded => {}
            Standing::InDoubt => {
                b.in_doubt += 1;
                if d < 0 {
                    b.low += d;
                } else {
                    b.high += d;
                }
            }
        }
    }
    b.low += b.acked;
    b.high += b.acked;
    b
}

/// Whether an increment is surely not counted: every attempt was refused, the last
/// one after the cluster settled. Before that, a refused increment may still be counted
/// by another attempt or by a duplicated copy of a refused submission arriving when
/// the shard has room again.
pub fn surely_refused(h: &History, op: &IncrOp) -> bool {
    op.status() == Status::Refused && op.attempts.last().is_some_and(|a| a.sent_ms >= h.settle_ms)
}

/// Increments of `counter` whose final status is not known: unknown, or refused only
/// before the cluster settled.
pub fn unknown_ops(h: &History, counter: usize) -> usize {
    h.incrs
        .iter()
        .filter(|o| o.counter == counter)
        .filter(|o| o.status() == Status::Unknown || (o.status() == Status::Refused && !surely_refused(h, o)))
        .count()
}

/// Disturbances, each extended by the run's recovery time, merged into disjoint,
/// sorted periods.
pub fn merged_disturbances(h: &History) -> Vec<Disturbance> {
    let mut d = h.disturbances.clone();
    for x in &mut d {
        x.to_ms = x.to_ms.saturating_add(h.recovery_ms);
    }
    d.sort_by_key(|x| (x.from_ms, x.to_ms));
    let mut out: Vec<Disturbance> = Vec::new();
    for x in d {
        match out.last_mut() {
            Some(last) if x.from_ms <= last.to_ms => last.to_ms = last.to_ms.max(x.to_ms),
            _ => out.push(x),
        }
    }
    out
}

/// The counter's name, for messages.
pub fn name(h: &History, counter: usize) -> &str {
    &h.counters[counter].name
}

/// Whether the counter's reads are checked exactly (`sync` roles).
pub fn exact(role: Role) -> bool {
    matches!(role, Role::Sync | Role::Distinct | Role::Big | Role::Bounded)
}

/// The event ids an increment was sent under.
pub fn ids(op: &IncrOp) -> impl Iterator<Item = &str> {
    op.attempts.iter().filter_map(|a| a.event_id.as_deref())
}
