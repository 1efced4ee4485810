//! A window read of a `sync` counter sums exactly the increments its buckets hold:
//! every complete read lies between the increments acknowledged before it began
//! that were surely applied inside the window (invoked at or after its start) and
//! that sum plus every increment that may have been applied inside it. A shard
//! files an increment in the bucket of its clock when it applies it, and a window
//! starts on a bucket's edge, so an increment is in the window exactly when it was
//! applied at or after the window's start. Once every outcome is known, the final
//! window read is exact.

use super::{exact, name, surely_refused, unknown_ops, Bounds, Violation};
use crate::history::{History, Status};

/// The invariant's name.
pub const NAME: &str = "window-exact";

/// Bounds for a read of `counter`'s window starting at `start_ms` (run time) that
/// began at `from_ms` and ended at `to_ms`.
pub fn window_bounds(h: &History, counter: usize, start_ms: i64, from_ms: u64, to_ms: u64) -> Bounds {
    let mut b = Bounds { acked: 0, low: 0, high: 0, in_doubt: 0 };
    let at_or_after_start = |t: u64| i128::from(t) >= i128::from(start_ms);
    for op in h.incrs.iter().filter(|o| o.counter == counter) {
        let d = i128::from(op.delta);
        match op.status_at(from_ms) {
            // Applied between its invocation and its acknowledgement.
            Status::Applied { .. } if at_or_after_start(op.invoked_ms) => {
                b.acked += d;
                continue;
            }
            Status::Applied { ack_ms } if !at_or_after_start(ack_ms) => continue,
            Status::Applied { .. } => {}
            _ if op.invoked_ms >= to_ms || surely_refused(h, op) => continue,
            _ => {}
        }
        b.in_doubt += 1;
        if d < 0 {
            b.low += d;
        } else {
            b.high += d;
        }
    }
    b.low += b.acked;
    b.high += b.acked;
    b
}

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for r in &h.windows {
        let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
        if !exact(h.counters[r.counter].role) || !v.complete {
            continue;
        }
        // The final read, every outcome known, is held to what every increment did.
        let last = r.settled && unknown_ops(h, r.counter) == 0;
        let (from, to) = if last { (u64::MAX, u64::MAX) } else { (r.invoked_ms, done) };
        let b = window_bounds(h, r.counter, v.start_ms, from, to);
        if v.value < b.low || v.value > b.high {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "window read of {} from {} ms at {}..{} ms returned {}, outside [{}, {}] (acknowledged {}, {} in doubt){}",
                    name(h, r.counter),
                    v.start_ms,
                    r.invoked_ms,
                    done,
                    v.value,
                    b.low,
                    b.high,
                    b.acked,
                    b.in_doubt,
                    if last { ", every outcome known" } else { "" }
                ),
            });
        }
    }
    // Every counter with windows has a complete final window read (in a tier that
    // reads windows: tier 1 does not).
    if h.windows.is_empty() {
        return;
    }
    for (c, info) in h.counters.iter().enumerate() {
        if info.spec.windows.is_empty() || !exact(info.role) {
            continue;
        }
        if !h.windows.iter().any(|r| r.counter == c && r.settled && r.value.is_some_and(|v| v.complete)) {
            out.push(Violation {
                invariant: NAME,
                detail: format!("no complete final window read of {}", info.name),
            });
        }
    }
}
