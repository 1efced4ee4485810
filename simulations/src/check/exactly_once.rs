//! Each event id is counted at most once: a second `Applied` answer for one id is a
//! double count, and is always fatal on a `sync` counter (the first answer came after
//! the flush). On a batched counter an acknowledged increment may be lost by a crash
//! and then counted again by a retry — that is one count, not two — so there a second
//! `Applied` is fatal only if no crash happened between the two answers. An increment
//! answered both counted and refused is fatal everywhere.

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
        let mut applied: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        let (mut counted, mut refused) = (false, false);
        for a in &op.attempts {
            for &(at, ans) in &a.answers {
                match ans {
                    Answer::Applied => {
                        counted = true;
                        if let Some(id) = a.event_id.as_deref() {
                            applied.entry(id).or_default().push(at);
                        }
                    }
                    Answer::Duplicate => counted = true,
                    Answer::Conflict | Answer::Overflow => refused = true,
                    Answer::Unavailable => {}
                }
            }
        }
        for (id, mut times) in applied {
            if times.len() < 2 {
                continue;
            }
            times.sort_unstable();
            let (first, second) = (times[0], times[1]);
            let crash_between = h.crashes.iter().any(|&(t, _)| first <= t && t <= second);
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
        if counted && refused {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "increment #{i} on {} was answered both counted and refused",
                    name(h, op.counter)
                ),
            });
        }
    }
}
