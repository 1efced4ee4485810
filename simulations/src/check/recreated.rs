//! A counter deleted and created again under its name holds exactly its own
//! increments: never one of the deleted counter's, never fewer than were
//! acknowledged to it. A deletion may take effect at any moment between its sending
//! and its answer (or, when the answer says nothing, until the cluster settles), and
//! one answered "not found" deleted nothing. For a complete read of such a counter:
//!
//! * an increment acknowledged before the read began, with no deletion that may
//!   have taken effect between its sending and the read's end, must be counted;
//! * an increment whose every attempt was answered before a deletion that surely
//!   took effect was sent, that deletion answered before the read began, cannot be
//!   (it was applied, if at all, to the deleted counter);
//! * any other increment may or may not be.
//!
//! A read of a counter that does not exist is a complete read of 0. The final read
//! after settling must be complete, and exact when no increment is in doubt. A
//! deletion answered "not found" must not have found a counter that surely existed:
//! one acknowledged an increment before the deletion was sent, with no other
//! deletion that may have applied in between.

use super::{name, surely_refused, Violation};
use crate::history::{DeleteOp, Deleted, History, IncrOp, Role, Status};
use crate::msg::{Answer, Consistency};

/// The invariant's name.
pub const NAME: &str = "recreated";

/// What a read of a re-created counter may return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    low: i128,
    high: i128,
    in_doubt: usize,
}

/// Whether deletion `d` may have deleted something between `from` and `to`.
fn may_delete_between(h: &History, d: &DeleteOp, from: u64, to: u64) -> bool {
    d.outcome != Deleted::NotFound && d.invoked_ms < to && d.may_apply_until(h) > from
}

/// Whether every attempt of `op` had a definite answer (anything but unavailable)
/// before `t`: nothing of it can be applied after `t`.
fn finished_before(op: &IncrOp, t: u64) -> bool {
    op.attempts.iter().all(|a| a.answers.iter().any(|&(at, ans)| at < t && ans != Answer::Unavailable))
}

/// Whether some deletion of `counter` may have taken effect between `from` and `to`
/// (for other checks: a second count of one event id across it is the new
/// counter's).
pub fn deleted_between(h: &History, counter: usize, from: u64, to: u64) -> bool {
    h.deletions.iter().any(|d| d.counter == counter && may_delete_between(h, d, from, to))
}

/// The span of a read of `counter` that began at `from` and ended at `to`.
fn span(h: &History, counter: usize, from: u64, to: u64) -> Span {
    let deletions: Vec<&DeleteOp> = h.deletions.iter().filter(|d| d.counter == counter).collect();
    let mut s = Span { low: 0, high: 0, in_doubt: 0 };
    for op in h.incrs.iter().filter(|o| o.counter == counter) {
        if op.invoked_ms >= to || surely_refused(h, op) {
            continue;
        }
        let d = i128::from(op.delta);
        let acked = matches!(op.status_at(from), Status::Applied { .. });
        if acked && !deletions.iter().any(|x| may_delete_between(h, x, op.invoked_ms, to)) {
            s.low += d;
            s.high += d;
            continue;
        }
        let wiped = deletions.iter().any(|x| {
            x.outcome == Deleted::Yes
                && x.done_ms.is_some_and(|done| done <= from)
                && finished_before(op, x.invoked_ms)
        });
        if wiped {
            continue;
        }
        s.in_doubt += 1;
        if d < 0 {
            s.low += d;
        } else {
            s.high += d;
        }
    }
    s
}

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for r in &h.reads {
        let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
        if h.counters[r.counter].role != Role::Recreated || r.consistency != Consistency::Fresh || !v.complete
        {
            continue;
        }
        let s = span(h, r.counter, r.invoked_ms, done);
        if v.value < s.low || v.value > s.high {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "fresh read of {} at {}..{done} ms returned {}, outside [{}, {}] ({} in doubt, {} deletions){}",
                    name(h, r.counter),
                    r.invoked_ms,
                    v.value,
                    s.low,
                    s.high,
                    s.in_doubt,
                    h.deletions.iter().filter(|d| d.counter == r.counter).count(),
                    if r.settled { ", after settling" } else { "" }
                ),
            });
        }
    }
    // A deletion answered "not found" must have found no counter: none may have
    // been acknowledged an increment, before it was sent, that no other deletion
    // may have removed by its answer.
    for (i, d) in h.deletions.iter().enumerate() {
        let (Deleted::NotFound, Some(done)) = (d.outcome, d.done_ms) else { continue };
        let others = || h.deletions.iter().enumerate().filter(|&(j, x)| j != i && x.counter == d.counter);
        let existed = h.incrs.iter().filter(|o| o.counter == d.counter).find(|o| {
            matches!(o.status_at(d.invoked_ms), Status::Applied { .. })
                && !others().any(|(_, x)| may_delete_between(h, x, o.invoked_ms, done))
        });
        if let Some(op) = existed {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "deleting {} at {}..{done} ms answered not found, but an increment invoked at {} ms was acknowledged to it before, and no other deletion may have applied since",
                    name(h, d.counter),
                    d.invoked_ms,
                    op.invoked_ms
                ),
            });
        }
    }
    for (c, info) in h.counters.iter().enumerate().filter(|(_, i)| i.role == Role::Recreated) {
        let last = h.reads.iter().rev().find(|r| {
            r.settled
                && r.consistency == Consistency::Fresh
                && r.counter == c
                && r.value.is_some_and(|v| v.complete)
        });
        if last.is_none() {
            out.push(Violation {
                invariant: NAME,
                detail: format!("no complete final read of {}", info.name),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::ReadOp;
    use crate::msg::ReadValue;

    fn history() -> History {
        History::of_one("del:0", Role::Recreated)
    }

    fn incr(h: &mut History, sent: u64, answered: Option<u64>) {
        h.push_one(sent, None, answered);
    }

    fn read(h: &mut History, from: u64, to: u64, value: i128) -> Vec<Violation> {
        let value = Some(ReadValue { value, as_of_ms: to, staleness_ms: 0, complete: true });
        h.reads.push(ReadOp {
            counter: 0,
            consistency: Consistency::Fresh,
            invoked_ms: from,
            done_ms: Some(to),
            value,
            settled: true,
        });
        let mut v = Vec::new();
        check(h, &mut v);
        h.reads.pop();
        v
    }

    #[test]
    fn a_deletion_bounds_what_a_read_may_hold() {
        let mut h = history();
        incr(&mut h, 10, Some(20));
        incr(&mut h, 30, Some(40));
        // Deleted between 100 and 150; then two increments of the new counter.
        h.deletions.push(DeleteOp { counter: 0, invoked_ms: 100, done_ms: Some(150), outcome: Deleted::Yes });
        incr(&mut h, 200, Some(210));
        incr(&mut h, 220, Some(230));
        assert!(read(&mut h, 300, 310, 2).is_empty());
        // The old counter's increments are not the new one's.
        assert_eq!(read(&mut h, 300, 310, 3)[0].invariant, NAME);
        // An acknowledged increment of the new counter is never lost.
        assert_eq!(read(&mut h, 300, 310, 1)[0].invariant, NAME);
        // Before the deletion was sent: the old counter, whole.
        assert!(read(&mut h, 50, 60, 2).is_empty());
        assert_eq!(read(&mut h, 50, 60, 0)[0].invariant, NAME);
        // While it may apply: anything from 0 to 2.
        assert!(read(&mut h, 120, 130, 0).is_empty());
    }

    #[test]
    fn a_deletion_answered_not_found_deleted_nothing_and_an_unknown_one_may_apply_until_settling() {
        let mut h = history();
        // Acknowledged only once the deletion was sent: it may have created the
        // counter after the deletion found none.
        incr(&mut h, 10, Some(120));
        h.deletions.push(DeleteOp {
            counter: 0,
            invoked_ms: 100,
            done_ms: Some(150),
            outcome: Deleted::NotFound,
        });
        assert!(read(&mut h, 300, 310, 1).is_empty());
        assert_eq!(read(&mut h, 300, 310, 0)[0].invariant, NAME);
        // The counter existed when this deletion was sent: "not found" is wrong.
        incr(&mut h, 125, Some(130));
        h.deletions.push(DeleteOp {
            counter: 0,
            invoked_ms: 140,
            done_ms: Some(160),
            outcome: Deleted::NotFound,
        });
        let found = read(&mut h, 300, 310, 2);
        assert!(found.len() == 1 && found[0].detail.contains("answered not found"), "{found:?}");
        h.deletions.pop();
        h.incrs.pop();
        h.deletions[0].outcome = Deleted::Unknown;
        assert!(read(&mut h, 300, 310, 0).is_empty());
        assert!(read(&mut h, 300, 310, 1).is_empty());
        // An increment still unanswered when a deletion surely applied may reach
        // the new counter.
        let mut h = history();
        incr(&mut h, 10, None);
        h.deletions.push(DeleteOp { counter: 0, invoked_ms: 100, done_ms: Some(150), outcome: Deleted::Yes });
        assert!(read(&mut h, 300, 310, 1).is_empty());
        assert!(read(&mut h, 300, 310, 0).is_empty());
        assert_eq!(read(&mut h, 300, 310, 2)[0].invariant, NAME);
    }
}
