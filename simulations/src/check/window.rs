//! A window read of a `sync` counter sums exactly the increments its buckets hold:
//! every complete read lies between the increments acknowledged before it began
//! that were surely applied inside the window (invoked at or after its start) and
//! that sum plus every increment that may have been applied inside it. A shard
//! files an increment in the bucket of its clock when it applies it, and a window
//! starts on a bucket's edge, so an increment is in the window exactly when it was
//! applied at or after the window's start. Once every outcome is known, the final
//! window read is exact.

use super::{bounds_since, exact, name, unknown_ops, Violation};
use crate::history::History;

/// The invariant's name.
pub const NAME: &str = "window-exact";

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
        let b = bounds_since(h, r.counter, v.start_ms, from, to, r.invoked_ms);
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
