//! Reconciliation brings drift to zero: after a reconciliation against an
//! authoritative total succeeds (and with every increment's outcome known), the final
//! fresh read equals that total; a second reconciliation against the same total finds
//! no drift, so applying a correction twice changes nothing.

use super::{name, unknown_ops, Violation};
use crate::history::{History, Role};
use crate::msg::Consistency;

/// The invariant's name.
pub const NAME: &str = "reconcile";

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for (c, info) in h.counters.iter().enumerate() {
        if info.role != Role::Recon {
            continue;
        }
        let done: Vec<_> = h.reconciles.iter().filter(|r| r.counter == c && r.result.is_some()).collect();
        if done.is_empty() {
            out.push(Violation { invariant: NAME, detail: format!("{} was never reconciled", info.name) });
            continue;
        }
        if unknown_ops(h, c) > 0 {
            // The authority cannot be exact while some increment's outcome is unknown.
            continue;
        }
        let last = done.last().expect("not empty");
        let authoritative = last.authoritative;
        for r in &done {
            let (before, drift) = r.result.expect("filtered above");
            if before + drift != r.authoritative {
                out.push(Violation {
                    invariant: NAME,
                    detail: format!(
                        "{}: before {before} + drift {drift} != authoritative {}",
                        info.name, r.authoritative
                    ),
                });
            }
        }
        if done.len() >= 2 && last.result.is_some_and(|(_, drift)| drift != 0) {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "{}: a second reconciliation against {authoritative} found drift {} (the first should have removed it)",
                    info.name,
                    last.result.expect("filtered above").1
                ),
            });
        }
        let final_read = h.reads.iter().rev().find(|r| {
            r.settled
                && r.consistency == Consistency::Fresh
                && r.counter == c
                && r.invoked_ms > last.done_ms.unwrap_or(u64::MAX)
                && r.value.is_some_and(|v| v.complete)
        });
        match final_read {
            Some(r) => {
                let v = r.value.expect("filtered above").value;
                if v != authoritative {
                    out.push(Violation {
                        invariant: NAME,
                        detail: format!(
                            "after reconciling {} against {authoritative}, a fresh read returned {v} (drift {})",
                            name(h, c),
                            authoritative - v
                        ),
                    });
                }
            }
            None => out.push(Violation {
                invariant: NAME,
                detail: format!("no complete fresh read of {} after its reconciliation", info.name),
            }),
        }
    }
}
