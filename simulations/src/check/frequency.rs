//! A frequency read is bounded by what was counted: a count-min estimate never falls
//! below the member's weight acknowledged before the read began (when every shard
//! answered), and never exceeds the weight of every increment that may have been
//! counted by its end; a certain lower bound never exceeds the member's weight that
//! may have been counted; the top members' merged total lies between the counter's
//! acknowledged weight and all it may hold.

use super::{name, standing, Standing, Violation};
use crate::history::History;
use std::collections::BTreeMap;

/// The invariant's name.
pub const NAME: &str = "frequency-bounds";

/// What a read begun at `from_ms` and ended at `to_ms` of `counter` must count and
/// may count: per member, and over all members.
struct Weights {
    must: BTreeMap<u32, u64>,
    may: BTreeMap<u32, u64>,
    must_total: u64,
    may_total: u64,
}

fn weights(h: &History, counter: usize, from_ms: u64, to_ms: u64) -> Weights {
    let mut w = Weights { must: BTreeMap::new(), may: BTreeMap::new(), must_total: 0, may_total: 0 };
    for op in h.incrs.iter().filter(|o| o.counter == counter) {
        let Some(m) = op.member else { continue };
        let weight = op.delta.unsigned_abs();
        match standing(h, op, i64::MIN, from_ms, to_ms, from_ms) {
            Standing::Counted => {
                *w.must.entry(m).or_default() += weight;
                w.must_total += weight;
                *w.may.entry(m).or_default() += weight;
                w.may_total += weight;
            }
            Standing::InDoubt => {
                *w.may.entry(m).or_default() += weight;
                w.may_total += weight;
            }
            Standing::Excluded => {}
        }
    }
    w
}

/// Runs the check.
pub fn check(h: &History, out: &mut Vec<Violation>) {
    for f in &h.frequencies {
        let (Some(done), Some(a)) = (f.done_ms, f.answer.as_ref()) else { continue };
        let w = weights(h, f.counter, f.invoked_ms, done);
        let must = |m: u32| w.must.get(&m).copied().unwrap_or(0);
        let may = |m: u32| w.may.get(&m).copied().unwrap_or(0);
        let mut broken = Vec::new();
        if a.complete && a.estimate < must(f.member) {
            broken.push(format!(
                "estimate {} of m-{} below its acknowledged {}",
                a.estimate,
                f.member,
                must(f.member)
            ));
        }
        if a.estimate > w.may_total {
            broken.push(format!(
                "estimate {} of m-{} above all weight sent, {}",
                a.estimate, f.member, w.may_total
            ));
        }
        if a.lower_bound > may(f.member) {
            broken.push(format!(
                "lower bound {} of m-{} above its weight sent, {}",
                a.lower_bound,
                f.member,
                may(f.member)
            ));
        }
        for &(m, estimate, lower_bound) in &a.top {
            if lower_bound > may(m) || estimate < lower_bound {
                broken.push(format!(
                    "top member m-{m} at {estimate} (at least {lower_bound}); its weight sent {}",
                    may(m)
                ));
            }
        }
        if a.total > w.may_total || (a.complete && a.total < w.must_total) {
            broken.push(format!("top total {} outside [{}, {}]", a.total, w.must_total, w.may_total));
        }
        for b in broken {
            out.push(Violation {
                invariant: NAME,
                detail: format!(
                    "frequency read of {} at {}..{done} ms: {b}",
                    name(h, f.counter),
                    f.invoked_ms
                ),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{FrequencyAnswer, FrequencyOp, Role};

    fn history() -> History {
        let mut h = History::of_one("distinct:0", Role::Distinct);
        // Member 7 twice and member 8 once, acknowledged; member 9 never answered.
        for (sent, member, answered) in
            [(10, 7, Some(20)), (30, 7, Some(40)), (50, 8, Some(60)), (70, 9, None)]
        {
            h.push_one(sent, Some(member), answered);
        }
        h
    }

    fn read(estimate: u64, lower_bound: u64, top: Vec<(u32, u64, u64)>, total: u64) -> Vec<Violation> {
        let mut h = history();
        let answer = FrequencyAnswer { estimate, lower_bound, top, total, complete: true };
        h.frequencies.push(FrequencyOp {
            counter: 0,
            member: 7,
            invoked_ms: 100,
            done_ms: Some(110),
            answer: Some(answer),
        });
        let mut v = Vec::new();
        check(&h, &mut v);
        v
    }

    #[test]
    fn a_frequency_read_lies_between_what_was_acknowledged_and_what_was_sent() {
        assert!(read(2, 2, vec![(7, 2, 2), (8, 1, 1)], 3).is_empty());
        // The member unanswered may be counted: a total of 4 and an estimate of 4.
        assert!(read(4, 2, vec![(7, 2, 2), (9, 1, 1)], 4).is_empty());
        // An acknowledged increment lost.
        assert_eq!(read(1, 1, vec![(7, 1, 1)], 3)[0].invariant, NAME);
        // More than was ever sent.
        assert_eq!(read(5, 2, vec![], 4).len(), 1);
        assert_eq!(read(2, 3, vec![], 3).len(), 1);
        assert_eq!(read(2, 2, vec![(8, 2, 2)], 3).len(), 1);
        assert_eq!(read(2, 2, vec![], 5).len(), 1);
        assert_eq!(read(2, 2, vec![], 2).len(), 1, "a total below what was acknowledged");
    }
}
