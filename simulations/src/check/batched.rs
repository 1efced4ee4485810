//! A batched counter never over counts, and loses at most its stated window per crash.
//!
//! The window of a crash at `t` reaches back `2 × flush_ms` (buffered at the gateway,
//! then unflushed at the shard's owner) plus a flush in flight
//! ([`FLUSH_IN_FLIGHT_MS`]) plus the time a drained sum needs to reach its shard while
//! the network works ([`DELIVERY_SLACK_MS`]); while the cluster is disturbed (a node
//! down, paused or poisoned, a partition, a metadata failover) sums cannot be
//! delivered, so the window also reaches back over the disturbance that covers its
//! start. An increment acknowledged inside some crash's window (or sent before the
//! crash and acknowledged after it: the answer was in flight) may be lost; every other
//! acknowledged one must be in the final total.
//!
//! Upper bounds hold for every complete read: the total never exceeds the sum of every
//! positive delta that may have been counted (an acknowledged negative increment may
//! still be buffered, or lost, and then the total is higher by its size).

use super::{bounds, merged_disturbances, name, surely_refused, Violation};
use crate::config::{DELIVERY_SLACK_MS, FLUSH_IN_FLIGHT_MS};
use crate::history::{Disturbance, History, Role, Status};
use crate::msg::Consistency;

/// The invariant's name.
pub const NAME: &str = "batched-bounded-loss";

/// The loss window `[from, to]` of a crash at `t_ms` for a counter with `flush_ms`.
pub fn loss_window(t_ms: u64, flush_ms: u64, disturbed: &[Disturbance]) -> (u64, u64) {
    let reach = 2 * flush_ms + FLUSH_IN_FLIGHT_MS + DELIVERY_SLACK_MS;
    let mut from = t_ms.saturating_sub(reach);
    // Extend over disturbances covering the start (sorted, disjoint): walk backwards.
    for d in disturbed.iter().rev() {
        if d.from_ms <= from && from < d.to_ms + reach {
            from = d.from_ms.saturating_sub(reach);
        }
    }
    (from, t_ms)
}

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    let disturbed = merged_disturbances(h);
    for (c, info) in h.counters.iter().enumerate() {
        if !matches!(info.role, Role::Batched | Role::Recon) {
            continue;
        }
        let flush_ms = u64::from(info.spec.flush_ms);
        let windows: Vec<(u64, u64)> =
            h.crashes.iter().map(|&(t, _)| loss_window(t, flush_ms, &disturbed)).collect();
        // Acknowledged increments that a crash may have lost.
        let mut lost_pos = 0i128;
        for op in h.incrs.iter().filter(|o| o.counter == c) {
            if let Status::Applied { ack_ms } = op.status() {
                // The count happened after its attempt was sent and before the answer,
                // which may arrive after the crash that loses it.
                let sent_ms = op
                    .attempts
                    .iter()
                    .filter(|a| a.answers.iter().any(|&(at, _)| at == ack_ms))
                    .map(|a| a.sent_ms)
                    .min()
                    .unwrap_or(ack_ms);
                if windows.iter().any(|&(a, b)| a <= ack_ms && sent_ms <= b) {
                    lost_pos += i128::from(op.delta.max(0));
                }
            }
        }
        // Reconciliation corrections are writes too: check reads before the first one.
        let first_reconcile = h.reconciles.iter().filter(|r| r.counter == c).map(|r| r.invoked_ms).min();
        for r in &h.reads {
            let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
            if r.counter != c || !v.complete || first_reconcile.is_some_and(|t| done >= t) {
                continue;
            }
            // Acknowledged increments may still be buffered (or lost): a read may lack
            // any of them, so the total can reach the sum of every positive delta.
            let b = bounds(h, c, r.invoked_ms, done);
            let high: i128 = h
                .incrs
                .iter()
                .filter(|o| o.counter == c && o.invoked_ms < done && !surely_refused(h, o))
                .map(|o| i128::from(o.delta.max(0)))
                .sum();
            if v.value > high {
                out.push(Violation {
                    invariant: NAME,
                    detail: format!(
                        "{:?} read of {} at {}..{done} ms returned {}, above {high}: more than was ever sent (acknowledged {}, {} in doubt)",
                        r.consistency, info.name, r.invoked_ms, v.value, b.acked, b.in_doubt
                    ),
                });
            }
        }
        // The final read before any reconciliation: at least what was acknowledged,
        // minus what crashes may have lost.
        let last = h.reads.iter().rev().find(|r| {
            r.settled
                && r.consistency == Consistency::Fresh
                && r.counter == c
                && r.value.is_some_and(|v| v.complete)
                && first_reconcile.is_none_or(|t| r.invoked_ms < t)
        });
        let Some(r) = last else { continue };
        let v = r.value.expect("filtered above").value;
        let b = bounds(h, c, u64::MAX, u64::MAX);
        let low = b.low - lost_pos;
        if v < low {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "final read of {} is {v}, below {low}: acknowledged {} minus at most {lost_pos} lost to {} crashes",
                    name(h, c),
                    b.acked,
                    h.crashes.len()
                ),
            });
        }
    }
}
