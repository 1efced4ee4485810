//! A `sync` counter's reads are exact within what is in doubt: every complete read lies
//! between the acknowledged sum (increments answered before the read began) and that
//! sum plus every increment still in doubt, and a cached read at least includes what
//! was acknowledged before its `as_of`. Once the cluster has healed and every outcome
//! is known, the final fresh read equals the acknowledged sum exactly.

use super::{bounds, exact, name, unknown_ops, Violation};
use crate::history::History;
use crate::msg::Consistency;

/// The invariant's name.
pub const NAME: &str = "sync-exact";

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for r in &h.reads {
        let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
        if !exact(h.counters[r.counter].role) || !v.complete {
            continue;
        }
        let from = match r.consistency {
            Consistency::Fresh => r.invoked_ms,
            Consistency::Cached => super::as_of(h, v.as_of_ms).min(r.invoked_ms),
        };
        let b = bounds(h, r.counter, from, done);
        if v.value < b.low || v.value > b.high {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "{:?} read of {} at {}..{} ms returned {}, outside [{}, {}] (acknowledged {}, {} in doubt){}",
                    r.consistency,
                    name(h, r.counter),
                    r.invoked_ms,
                    done,
                    v.value,
                    b.low,
                    b.high,
                    b.acked,
                    b.in_doubt,
                    if r.settled { ", after settling" } else { "" }
                ),
            });
        }
    }
    // The final read of each counter, when every outcome is known, is exact.
    for (c, info) in h.counters.iter().enumerate() {
        if !exact(info.role) {
            continue;
        }
        let last = h.reads.iter().rev().find(|r| {
            r.settled
                && r.consistency == Consistency::Fresh
                && r.counter == c
                && r.value.is_some_and(|v| v.complete)
        });
        let Some(r) = last else {
            out.push(Violation {
                invariant: NAME,
                detail: format!("no complete final read of {}", info.name),
            });
            continue;
        };
        if unknown_ops(h, c) > 0 {
            continue;
        }
        let b = bounds(h, c, u64::MAX, u64::MAX);
        let v = r.value.expect("filtered above").value;
        if v != b.acked {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "final read of {} is {v}, but the acknowledged increments sum to {} (every outcome known)",
                    info.name, b.acked
                ),
            });
        }
    }
}
