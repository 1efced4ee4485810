//! A cached read is never staler than `rollup_ms` plus one refresh while the rollup's
//! node and the shards it reads are healthy: the check applies to reads during which,
//! and for that long before which, nothing in the cluster was disturbed. Every cached
//! read's staleness must also be consistent with its `as_of`. With nodes' clocks
//! skewed, both are a node's stamps: each may be the skew off, and a staleness
//! measured across a clock jump or by another clock than `as_of`'s up to twice it. Where remote reads
//! cross a lossy network (tier 2), periods with an unanswered call count as
//! disturbed too (`History::unanswered_calls`).

use super::{merged_disturbances, Violation};
use crate::config::ROLLUP_TICK_MS;
use crate::history::History;
use crate::msg::Consistency;

/// The invariant's name.
pub const NAME: &str = "rollup-staleness";

/// How long one refresh may take beyond its tick, in the model: reads are synchronous,
/// so a refresh completes within the tick that starts it.
pub const ROLLUP_REFRESH_MS: u64 = ROLLUP_TICK_MS;

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    let mut disturbed = merged_disturbances(h);
    disturbed.extend(h.unanswered_calls.iter().copied());
    for r in &h.reads {
        let (Some(done), Some(v)) = (r.done_ms, r.value) else { continue };
        if r.consistency != Consistency::Cached {
            continue;
        }
        let info = &h.counters[r.counter];
        // A counter deleted and created anew starts its rollup over.
        if info.role == crate::history::Role::Recreated {
            continue;
        }
        // The stamps are a node's: with skewed clocks they may run ahead of true
        // time, and a clock jump between a refresh and a read stretches staleness.
        let skew = h.clock_skew_ms;
        if v.as_of_ms > done + skew || v.as_of_ms + v.staleness_ms > done + skew {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "cached read of {} answered at {done} ms claims as_of {} and staleness {}",
                    info.name, v.as_of_ms, v.staleness_ms
                ),
            });
            continue;
        }
        let bound = u64::from(info.spec.rollup_ms) + ROLLUP_REFRESH_MS + h.refresh_slack_ms + 2 * skew;
        let from = r.invoked_ms.saturating_sub(bound);
        if disturbed.iter().any(|d| d.from_ms < done && from < d.to_ms) {
            continue;
        }
        if v.staleness_ms > bound {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "cached read of {} at {done} ms is {} ms stale (as_of {}), beyond rollup_ms {} + refresh {} ms, with the cluster healthy",
                    info.name, v.staleness_ms, v.as_of_ms, info.spec.rollup_ms, ROLLUP_REFRESH_MS + h.refresh_slack_ms
                ),
            });
        }
    }
}
