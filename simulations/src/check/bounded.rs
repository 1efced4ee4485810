//! A bounded counter never goes beyond its bound (`min`, `max`; tier 2's `stock:0`
//! and `quota:0`), nor a limited one beyond its limit per window (`rate:0`).
//!
//! * **Its value** (`bound-crossed`): at no instant do the increments acknowledged
//!   by then put it past a bound. At an instant `t`, the highest value the counter
//!   can have is every increment counted by `t` plus every increase in doubt then
//!   (invoked before `t`, not acknowledged before it, not surely refused), without
//!   the decreases in doubt; if even that is below `min`, acknowledged decreases
//!   took it below (likewise the lowest value and `max`). The highest value is
//!   lowest just after a decrease is acknowledged and the lowest highest just after
//!   an increase is, so the check looks just after every acknowledgement, and at the
//!   end of the run with every outcome the history knows.
//! * **Its reads** (`read-beyond-bound`): every complete read — fresh or cached, of
//!   the total or of a window that holds every increment of the run — lies within
//!   the bounds, widened only by the increments that may have been applied while the
//!   read was taken (between its start, or a cached read's `as_of`, and its answer):
//!   a read sums its shards at different instants, and between two of them
//!   headroom may move from one shard to another and be spent there (`Σ` of the
//!   shards' values as read is at least the value when the read began plus every
//!   decrease applied meanwhile). A read nothing was in flight for is held to the
//!   bounds exactly, and so is the final fresh read taken after healing, when every
//!   outcome is resolved. An incomplete read is not checked: one shard's value alone
//!   is not bounded.
//! * **Its window** (`limit-crossed`): increments invoked at or after `t` and
//!   acknowledged by `t + window − bucket` were all stamped inside that span, so
//!   every shard still kept them in its buckets at its end: together they never sum
//!   above the limit. With nodes' clocks up to `s` off true time (two of them up
//!   to `2s` apart), spent headroom may come back `2s` early: the span shrinks by
//!   that much, and nothing is checked once it is gone.

use super::{bounds, name, Violation};
use crate::history::{History, Role, Status};
use crate::msg::Consistency;
use tally_core::spec::WindowLimit;

/// The name of a breach of the counter's value.
pub const CROSSED: &str = "bound-crossed";
/// The name of a read beyond a bound.
pub const READ: &str = "read-beyond-bound";
/// The name of a window holding more than its limit.
pub const LIMIT: &str = "limit-crossed";

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for (c, info) in h.counters.iter().enumerate() {
        if info.role != Role::Bounded || !info.spec.bounded() {
            continue;
        }
        let (min, max) = (info.spec.min.map(i128::from), info.spec.max.map(i128::from));
        crossed(h, c, min, max, out);
        reads(h, c, min, max, out);
        if let Some(limit) = info.spec.limit {
            limit_crossed(h, c, limit, out);
        }
    }
}

fn limit_crossed(h: &History, c: usize, limit: WindowLimit, out: &mut Vec<Violation>) {
    let skew = 2 * h.clock_skew_ms;
    let Some(span) = (limit.window.ms() - limit.window.bucket_ms()).checked_sub(skew).filter(|&s| s > 0)
    else {
        return;
    };
    let mut acked: Vec<(u64, u64, i128)> = h
        .incrs
        .iter()
        .filter(|o| o.counter == c)
        .filter_map(|o| match o.status() {
            Status::Applied { ack_ms } => Some((o.invoked_ms, ack_ms, i128::from(o.delta))),
            _ => None,
        })
        .collect();
    acked.sort_unstable();
    for (i, &(from, _, _)) in acked.iter().enumerate() {
        let inside = acked[i..].iter().filter(|(_, ack, _)| *ack <= from.saturating_add(span));
        let (count, sum) = inside.fold((0, 0i128), |(n, s), (_, _, d)| (n + 1, s + d));
        if sum > i128::from(limit.max) {
            out.push(Violation {
                invariant: LIMIT,
                detail: format!(
                    "{}: {count} increments invoked from {from} ms and acknowledged within {span} ms sum to {sum}, above its limit of {} per {}",
                    name(h, c),
                    limit.max,
                    limit.window
                ),
            });
            return;
        }
    }
}

/// Where `v` lies beyond `[min + below, max + above]`, as text.
fn beyond(v: i128, min: Option<i128>, max: Option<i128>, below: i128, above: i128) -> Option<String> {
    match (min, max) {
        (Some(m), _) if v < m + below => Some(format!("below min {m}")),
        (_, Some(m)) if v > m + above => Some(format!("above max {m}")),
        _ => None,
    }
}

fn crossed(h: &History, c: usize, min: Option<i128>, max: Option<i128>, out: &mut Vec<Violation>) {
    // Just after each acknowledgement, then at the end.
    let mut at: Vec<u64> = h
        .incrs
        .iter()
        .filter(|o| o.counter == c)
        .filter_map(|o| match o.status() {
            Status::Applied { ack_ms } => Some(ack_ms.saturating_add(1)),
            _ => None,
        })
        .collect();
    at.sort_unstable();
    at.dedup();
    at.push(u64::MAX);
    let (mut below, mut above) = (false, false);
    for t in at {
        let b = bounds(h, c, t, t);
        let when = if t == u64::MAX { "at the end".to_owned() } else { format!("at {t} ms") };
        if let Some(m) = min.filter(|&m| !below && b.high < m) {
            below = true;
            out.push(Violation {
                invariant: CROSSED,
                detail: format!(
                    "{} is below its min {m} {when}: acknowledged increments sum to {}, and with every increase in doubt ({} in doubt) at most {}",
                    name(h, c),
                    b.acked,
                    b.in_doubt,
                    b.high
                ),
            });
        }
        if let Some(m) = max.filter(|&m| !above && b.low > m) {
            above = true;
            out.push(Violation {
                invariant: CROSSED,
                detail: format!(
                    "{} is above its max {m} {when}: acknowledged increments sum to {}, and with every decrease in doubt ({} in doubt) at least {}",
                    name(h, c),
                    b.acked,
                    b.in_doubt,
                    b.low
                ),
            });
        }
    }
}

fn reads(h: &History, c: usize, min: Option<i128>, max: Option<i128>, out: &mut Vec<Violation>) {
    // The final complete fresh read after healing: held to the bounds exactly.
    let last = h.reads.iter().rposition(|r| {
        r.settled
            && r.counter == c
            && r.consistency == Consistency::Fresh
            && r.value.is_some_and(|v| v.complete)
    });
    if let Some(v) = last.and_then(|i| h.reads[i].value) {
        if let Some(side) = beyond(v.value, min, max, 0, 0) {
            out.push(Violation {
                invariant: READ,
                detail: format!("final read of {} after healing returned {}, {side}", name(h, c), v.value),
            });
        }
    }
    let mut one = |kind: &str, from: u64, invoked: u64, done: u64, value: i128| {
        let b = bounds(h, c, from, done);
        if let Some(side) = beyond(value, min, max, b.low - b.acked, b.high - b.acked) {
            out.push(Violation {
                invariant: READ,
                detail: format!(
                    "{kind} read of {} at {invoked}..{done} ms returned {value}, {side} (beyond it by more than the {} increments in doubt meanwhile could explain)",
                    name(h, c),
                    b.in_doubt
                ),
            });
        }
    };
    for (i, r) in h.reads.iter().enumerate() {
        let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
        if r.counter != c || !v.complete || Some(i) == last {
            continue;
        }
        let (kind, from) = match r.consistency {
            Consistency::Fresh => ("Fresh", r.invoked_ms),
            Consistency::Cached => ("Cached", super::as_of(h, v.as_of_ms).min(r.invoked_ms)),
        };
        one(kind, from, r.invoked_ms, done, v.value);
    }
    // A window that starts no later than the counter's first increment holds them all.
    let first = h.incrs.iter().filter(|o| o.counter == c).map(|o| o.invoked_ms).min().unwrap_or(u64::MAX);
    for r in h.windows.iter().filter(|r| r.counter == c) {
        let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
        // With skewed clocks, an increment acknowledged shortly before the read may
        // sit in a bucket ahead of the reader's clock, outside the read.
        let skew = 2 * h.clock_skew_ms;
        let recent = h.incrs.iter().filter(|o| o.counter == c).any(|o| match o.status() {
            Status::Applied { ack_ms } => ack_ms <= r.invoked_ms && ack_ms + skew > r.invoked_ms,
            _ => false,
        });
        if v.complete
            && !(skew > 0 && recent)
            && i128::from(v.start_ms) + i128::from(h.clock_skew_ms) <= i128::from(first)
        {
            one("Window", r.invoked_ms, r.invoked_ms, done, v.value);
        }
    }
}
