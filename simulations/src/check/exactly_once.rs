//! Each event id is counted at most once: a second `Applied` answer for one id is a
//! double count, and is always fatal on a `sync` counter (the first answer came after
//! the flush). On a batched counter an acknowledged increment may be lost by a crash
//! and then counted again by a retry — that is one count, not two — so there a second
//! `Applied` is fatal only if no crash happened between the earliest of the counted
//! attempts' sending and the latest of their answers. On a `sync` counter, an attempt sent after
//! the increment was answered counted must find its dedup record: a refusal then
//! (overflow, conflict) means the record was lost. (A refusal *before* a count is
//! fine: a refused increment leaves no record and may succeed when retried later.)
//! A counter deleted between two counts of an id holds at most one of them: the
//! second belongs to the counter created anew (see [`super::recreated`]).

use super::{exact, name, Violation};
use crate::history::History;
use crate::msg::Answer;
use std::collections::BTreeMap;

/// The invariant's name.
pub const NAME: &str = "exactly-once";

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for (i, op) in h.incrs.iter().enumerate() {
        let role = h.counters[op.counter].role;
        let mut applied: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
        let mut counted_at: Option<u64> = None;
        let mut refused_after = false;
        for a in &op.attempts {
            for &(at, ans) in &a.answers {
                match ans {
                    Answer::Applied | Answer::Duplicate => {
                        counted_at = Some(counted_at.map_or(at, |c| c.min(at)));
                        if let (Answer::Applied, Some(id)) = (ans, a.event_id.as_deref()) {
                            applied.entry(id).or_default().push((a.sent_ms, at));
                        }
                    }
                    Answer::Conflict | Answer::Overflow | Answer::Refused => {}
                    Answer::Unavailable => {}
                }
            }
        }
        if let Some(c) = counted_at {
            refused_after = op.attempts.iter().any(|a| {
                a.sent_ms > c
                    && a.answers
                        .iter()
                        .any(|&(_, ans)| matches!(ans, Answer::Conflict | Answer::Overflow | Answer::Refused))
            });
        }
        for (id, mut times) in applied {
            if times.len() < 2 {
                continue;
            }
            times.sort_unstable_by_key(|&(_, at)| at);
            let (first, second) = (times[0].1, times[1].1);
            // Each count happened between its attempt's sending and its answer; a crash
            // anywhere between the earliest sending and the latest answer may have lost
            // the earlier count (answers can arrive out of order).
            let sent = times.iter().map(|&(s, _)| s).min().unwrap_or(first);
            let last = times.iter().map(|&(_, a)| a).max().unwrap_or(second);
            let crash_between = h.crashes.iter().any(|&(t, _)| sent <= t && t <= last);
            // A counter deleted in between was created anew, without the id's record.
            if super::recreated::deleted_between(h, op.counter, sent, last) {
                continue;
            }
            if exact(role) || !crash_between {
                out.push(Violation {
                    invariant: NAME,
                    detail: format!(
                        "event id {id} on {} was answered applied {} times (first at {first} ms, again at {second} ms): counted twice",
                        name(h, op.counter),
                        times.len()
                    ),
                });
            }
        }
        if refused_after && exact(role) {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "increment #{i} on {} was refused by an attempt sent after it was answered counted: its dedup record was lost",
                    name(h, op.counter)
                ),
            });
        }
    }
}
