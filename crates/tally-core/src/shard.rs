//! A shard's decision function.
//!
//! The shard actor gathers submissions, looks up the dedup records of their event ids,
//! and calls [`decide`]. The result says everything the actor must then do: the value
//! and records to commit atomically, whether the sketch must be rewritten, and the
//! outcome to answer for every submission. The actor adds no logic of its own.

use crate::dedup::{judge, judge_seq, DedupRecord, SeqVerdict, Verdict, WriterMark, WRITERS_PER_SHARD_MAX};
use crate::frequency::{FrequencyError, FrequencySketch};
use crate::limits::{apply_buffered, check_direct, Overflow};
use crate::sketch::DistinctSketch;
use crate::window::WindowState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How long a shard remembers the id of a drained sum sent from another node: far
/// longer than any retry of it, far shorter than a counter's dedup window, because
/// every drain of every node writes one.
pub const DRAIN_DEDUP_WINDOW_MS: u64 = 10 * 60 * 1000;
/// Prefix of drain ids (outside the client alphabet, so never an event id).
pub const DRAIN_ID_PREFIX: &str = "~drain:";

/// The dedup window that applies to a record id: drain ids have their own.
pub fn window_for(id: &str, counter_window_ms: u64) -> u64 {
    if id.starts_with(DRAIN_ID_PREFIX) {
        DRAIN_DEDUP_WINDOW_MS
    } else {
        counter_window_ms
    }
}

/// Most submissions one shard commit takes; the rest wait for the next commit.
pub const COMMIT_SUBMISSIONS_MAX: usize = 4096;

/// One unit of work for a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Submission {
    /// A drained accumulator sum. Its increments were acknowledged when buffered, so
    /// it cannot be refused (see [`crate::limits`]).
    Buffered {
        /// The sum of the drained increments.
        sum: i64,
        /// How many increments it sums.
        increments: u64,
        /// Hashes of the distinct-count members they carried.
        members: Vec<u64>,
        /// Its drain id: a retry after an unanswered attempt carries the same id, and
        /// the shard counts it once (remembered for [`DRAIN_DEDUP_WINDOW_MS`]). Every
        /// drain carries one — a local shard's answer can time out too, while the
        /// submission is still queued — except in simulations of older builds.
        drain_id: Option<String>,
    },
    /// One increment that waits for its outcome.
    Single {
        /// The delta.
        delta: i64,
        /// Its event id, when it has one: it is deduplicated.
        event_id: Option<String>,
        /// Hash of its distinct-count member.
        member: Option<u64>,
        /// The item whose frequency it adds to (counters with `frequency`): its
        /// `item`, or its member when it names no item. Its delta is the weight.
        item: Option<String>,
        /// Its writer's sequence number, for a sequenced increment; `event_id` then
        /// holds the writer's mark id ([`crate::dedup::mark_id`]), under which the
        /// shard keeps the writer's high-water mark instead of one record per
        /// increment.
        seq: Option<u64>,
    },
}

impl Submission {
    /// The id its dedup record is kept under: its event id, or its drain id.
    pub fn record_id(&self) -> Option<&str> {
        match self {
            Self::Single { event_id, .. } => event_id.as_deref(),
            Self::Buffered { drain_id, .. } => drain_id.as_deref(),
        }
    }

    /// Its drain id, for a drained sum that has one.
    pub fn drain_id(&self) -> Option<&str> {
        match self {
            Self::Buffered { drain_id, .. } => drain_id.as_deref(),
            Self::Single { .. } => None,
        }
    }

    /// What it adds to the shard's value when applied.
    pub fn delta(&self) -> i64 {
        match self {
            Self::Buffered { sum, .. } => *sum,
            Self::Single { delta, .. } => *delta,
        }
    }

    /// How many acknowledged or waiting increments it carries.
    pub fn increments(&self) -> u64 {
        match self {
            Self::Buffered { increments, .. } => *increments,
            Self::Single { .. } => 1,
        }
    }
}

/// What happened to one submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Counted.
    Applied,
    /// Its event id was applied before with the same delta: not counted again.
    Duplicate,
    /// Its event id was applied before with another delta: refused.
    Conflict {
        /// The delta first applied under that event id.
        recorded_delta: i64,
    },
    /// Counting it would overflow the shard: refused.
    Overflow(Overflow),
    /// A sequenced increment beyond its writer's next sequence: refused, nothing
    /// counted; the writer retries once the earlier sequences are answered.
    OutOfOrder {
        /// The sequence the shard takes next for this writer.
        expected: u64,
    },
    /// A sequenced increment from a writer with no mark in a shard that keeps
    /// [`crate::dedup::WRITERS_PER_SHARD_MAX`] marks already: refused, nothing counted.
    TooManyWriters,
    /// An increment with a new event id in a shard that keeps its share of the
    /// counter's event-id quota already ([`ShardState::event_ids_max`]): refused,
    /// nothing counted (an id seen before is still judged).
    TooManyEventIds,
    /// Counting it would take a bounded counter past its bound, as far as this shard
    /// could tell within its wait for headroom: refused, nothing counted.
    BoundExceeded {
        /// The headroom on the increment's side this shard held when it gave up.
        headroom: u64,
    },
}

/// The persisted state of one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardImage {
    /// The shard's partial sum.
    pub value: i64,
    /// The shard's distinct-count sketch, encoded by [`crate::sketch`]; `None` for
    /// counters without `distinct`.
    pub sketch: Option<Vec<u8>>,
    /// The shard's frequency sketch, encoded by [`crate::frequency`]; `None` for
    /// counters without `frequency`.
    pub frequency: Option<Vec<u8>>,
    /// The shard's window buckets, encoded by [`crate::window::WindowState::to_bytes`];
    /// `None` for counters without `windows`.
    pub windows: Option<Vec<u8>>,
    /// The shard's escrow ledger (its shares of a bounded counter's headroom and its
    /// transfers), encoded by [`crate::escrow::Durable::to_bytes`]; `None` for
    /// counters without bounds, and for a bounded counter's shard that never wrote.
    pub escrow: Option<Vec<u8>>,
}

impl ShardImage {
    /// The frequency sketch, decoded: a shell checks it when it loads a shard (a
    /// sketch that does not decode makes the shard's data corrupt).
    pub fn decode_frequency(&self) -> Result<Option<FrequencySketch>, FrequencyError> {
        self.frequency.as_deref().map(FrequencySketch::from_bytes).transpose()
    }

    /// The window buckets, decoded (checked like the frequency sketch when a shell
    /// loads a shard).
    pub fn decode_windows(&self) -> Result<Option<WindowState>, crate::codec::DecodeError> {
        self.windows.as_deref().map(WindowState::from_bytes).transpose()
    }
}

/// Everything one shard commit changes, applied atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardWrite {
    /// The shard's new state.
    pub image: ShardImage,
    /// Dedup records to insert (or overwrite), keyed by event id.
    pub dedup_put: Vec<(String, DedupRecord)>,
    /// Event ids whose records are removed (expired).
    pub dedup_remove: Vec<String>,
}

/// A shard's answer to a submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ShardReply {
    /// Decided and written.
    Done {
        /// What became of the submission.
        outcome: Outcome,
        /// The shard's value after the commit (it opens or closes accumulator slots).
        value: i64,
        /// The shard's value right after this submission within the commit: for an
        /// applied increment, the value it produced, whatever else the commit held.
        /// On a counter of one shard that is the counter's total after it, so these
        /// are unique and gap-free across concurrent increments of 1 (Redis's `INCR`
        /// answers them: `docs/SEMANTICS.md`, "The Redis protocol").
        after: i64,
    },
    /// This shard's generation is sealed; resubmit on the current layout.
    Sealed,
}

/// The part of a shard's state that decisions read and change.
#[derive(Debug, Clone, Default)]
pub struct ShardState {
    /// The shard's partial sum.
    pub value: i64,
    /// The distinct-count sketch, for counters with `distinct`.
    pub sketch: Option<DistinctSketch>,
    /// The frequency sketch, for counters with `frequency`.
    pub frequency: Option<FrequencySketch>,
    /// The window buckets, for counters with `windows`: every applied submission is
    /// added to the bucket of the batch's `now_ms`.
    pub windows: Option<WindowState>,
    /// How many writer marks the shard's store holds (live or not yet swept), as far
    /// as this copy knows; bounds new writers at
    /// [`crate::dedup::WRITERS_PER_SHARD_MAX`].
    pub writer_marks: u64,
    /// How many event-id records the shard's store holds (live or not yet swept), as
    /// far as this copy knows.
    pub event_ids: u64,
    /// The most event-id records the shard may hold (its share of the counter's
    /// quota); `None` for no bound.
    pub event_ids_max: Option<u64>,
}

/// Everything a batch of submissions changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    /// The shard's value after the batch.
    pub value: i64,
    /// Dedup records to write with the value.
    pub dedup_put: Vec<(String, DedupRecord)>,
    /// One outcome per submission, in order.
    pub outcomes: Vec<Outcome>,
    /// The shard's value right after each submission was decided, in order (for one
    /// that was not applied, the value it found): each applied increment's own place
    /// in the shard's history, which the answer carries ([`ShardReply::Done`]).
    pub values: Vec<i64>,
    /// Whether the sketch changed and must be written.
    pub sketch_changed: bool,
    /// Whether the frequency sketch changed and must be written.
    pub frequency_changed: bool,
    /// Whether the window buckets changed and must be written.
    pub windows_changed: bool,
    /// How many increments were counted.
    pub applied_increments: u64,
    /// The absolute change of the value, summed over applied submissions.
    pub change_abs: u64,
    /// How many submissions were duplicates.
    pub duplicates: u64,
}

impl Decision {
    /// Whether anything must be written.
    pub fn writes(&self, before: i64) -> bool {
        self.value != before
            || !self.dedup_put.is_empty()
            || self.sketch_changed
            || self.frequency_changed
            || self.windows_changed
    }
}

/// Decides a batch. `prior` holds, for event ids in the batch, the record found in the
/// store (current generation first, then sealed generations). Records created earlier
/// in the same batch take precedence, so a batch holding one event id twice counts it
/// once. `state` is updated in place to the post-batch state.
///
/// `spend` is asked for every fresh single increment that would be counted: a bounded
/// counter's escrow ([`crate::escrow::Ledger::spend`]) answers the headroom it holds
/// when it cannot cover the delta, and the increment is then
/// [`Outcome::BoundExceeded`], counted nowhere. (Drained sums are never asked: they
/// were acknowledged already, and a bounded counter is `sync`, so it has none.)
pub fn decide(
    state: &mut ShardState,
    batch: &[Submission],
    prior: &BTreeMap<String, DedupRecord>,
    now_ms: u64,
    window_ms: u64,
    spend: &mut dyn FnMut(i64) -> Result<(), u64>,
) -> Decision {
    let before = state.value;
    let mut d = Decision { value: state.value, ..Decision::default() };
    let mut created: BTreeMap<&str, DedupRecord> = BTreeMap::new();
    let add_member = |sketch: &mut Option<DistinctSketch>, h: u64, changed: &mut bool| {
        if let Some(s) = sketch.as_mut() {
            *changed |= s.insert_hash(h);
        }
    };
    for sub in batch {
        let outcome = match sub {
            // A drain id never repeats, so a record found for one is always its
            // earlier delivery, however old: only a sweep retires drain records, by
            // the sender's clock (`crate::sweep`), never a look at this node's.
            Submission::Buffered { drain_id: Some(id), sum, .. }
                if judge(created.get(id.as_str()).or_else(|| prior.get(id)), *sum, now_ms, u64::MAX)
                    != Verdict::Fresh =>
            {
                // Delivered before and retried after a lost answer: counted once.
                Outcome::Duplicate
            }
            Submission::Buffered { sum, increments, members, drain_id } => {
                d.value = apply_buffered(d.value, *sum);
                if let Some(id) = drain_id {
                    created.insert(id, DedupRecord { delta: *sum, applied_at_ms: now_ms });
                }
                d.applied_increments += increments;
                d.change_abs = d.change_abs.saturating_add(sum.unsigned_abs());
                for &h in members {
                    add_member(&mut state.sketch, h, &mut d.sketch_changed);
                }
                if let Some(w) = state.windows.as_mut() {
                    w.add(now_ms, *sum, members);
                    d.windows_changed = true;
                }
                Outcome::Applied
            }
            Submission::Single { delta, event_id, member, item, seq } => {
                let verdict = match (event_id, seq) {
                    (None, _) => Verdict::Fresh,
                    (Some(id), None) => {
                        let rec = created.get(id.as_str()).or_else(|| prior.get(id));
                        // A new id is one more record to keep: the shard's bound applies.
                        let bounded = state.event_ids_max.is_some_and(|max| state.event_ids >= max);
                        if rec.is_none() && bounded && crate::dedup::is_client_event_id(id) {
                            d.outcomes.push(Outcome::TooManyEventIds);
                            d.values.push(d.value);
                            continue;
                        }
                        judge(rec, *delta, now_ms, window_ms)
                    }
                    (Some(id), Some(seq)) => {
                        let rec = created.get(id.as_str()).or_else(|| prior.get(id));
                        match judge_seq(rec, *seq, now_ms, window_ms) {
                            SeqVerdict::Duplicate => Verdict::Duplicate,
                            SeqVerdict::OutOfOrder { expected } => {
                                d.outcomes.push(Outcome::OutOfOrder { expected });
                                d.values.push(d.value);
                                continue;
                            }
                            // A writer with no record at all is a new mark: the
                            // bound applies. (A mark found only in a sealed
                            // generation is rewritten here uncounted; the shell
                            // recounts from the store when the shard starts.)
                            SeqVerdict::Fresh
                                if !created.contains_key(id.as_str())
                                    && !prior.contains_key(id.as_str())
                                    && state.writer_marks >= WRITERS_PER_SHARD_MAX =>
                            {
                                d.outcomes.push(Outcome::TooManyWriters);
                                d.values.push(d.value);
                                continue;
                            }
                            SeqVerdict::Fresh => Verdict::Fresh,
                        }
                    }
                };
                match verdict {
                    Verdict::Duplicate => {
                        d.duplicates += 1;
                        Outcome::Duplicate
                    }
                    Verdict::Conflict { recorded_delta } => Outcome::Conflict { recorded_delta },
                    Verdict::Fresh => match check_direct(d.value, *delta).map(|next| (next, spend(*delta))) {
                        Err(o) => Outcome::Overflow(o),
                        Ok((_, Err(headroom))) => Outcome::BoundExceeded { headroom },
                        Ok((next, Ok(()))) => {
                            d.value = next;
                            d.applied_increments += 1;
                            d.change_abs = d.change_abs.saturating_add(delta.unsigned_abs());
                            match (event_id, seq) {
                                (Some(id), None) => {
                                    if crate::dedup::is_client_event_id(id)
                                        && !prior.contains_key(id.as_str())
                                    {
                                        state.event_ids += 1;
                                    }
                                    created.insert(id, DedupRecord { delta: *delta, applied_at_ms: now_ms });
                                }
                                (Some(id), Some(seq)) => {
                                    let new = !created.contains_key(id.as_str())
                                        && !prior.contains_key(id.as_str());
                                    if new {
                                        state.writer_marks += 1;
                                    }
                                    let mark = WriterMark { seq: *seq, applied_at_ms: now_ms };
                                    created.insert(id, mark.to_record());
                                }
                                (None, _) => {}
                            }
                            if let Some(h) = member {
                                add_member(&mut state.sketch, *h, &mut d.sketch_changed);
                            }
                            if let Some(w) = state.windows.as_mut() {
                                w.add(now_ms, *delta, member.as_slice());
                                d.windows_changed = true;
                            }
                            if let (Some(f), Some(item)) = (state.frequency.as_mut(), item) {
                                // Only positive weights count (see crate::frequency).
                                if *delta > 0 {
                                    f.add(item, *delta);
                                    d.frequency_changed = true;
                                }
                            }
                            Outcome::Applied
                        }
                    },
                }
            }
        };
        d.outcomes.push(outcome);
        d.values.push(d.value);
    }
    assert_eq!(d.values.len(), d.outcomes.len(), "every outcome has the value it left the shard at");
    check_decision(batch, before, &d, &created);
    d.dedup_put = created.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    state.value = d.value;
    debug_assert!(d.writes(before) || d.applied_increments == 0 || d.change_abs == 0);
    d
}

/// The invariants of every decision, checked in production too (a broken one would
/// be written to the store and answered): the value moved by exactly what was
/// applied, each applied submission moved it by its own delta in order, and every
/// applied submission with an id left a record under it.
fn check_decision(batch: &[Submission], before: i64, d: &Decision, created: &BTreeMap<&str, DedupRecord>) {
    assert_eq!(d.outcomes.len(), batch.len(), "one outcome per submission");
    let mut value = i128::from(before);
    for ((sub, outcome), after) in batch.iter().zip(&d.outcomes).zip(&d.values) {
        if *outcome == Outcome::Applied {
            value += i128::from(sub.delta());
            if let Some(id) = sub.record_id() {
                assert!(created.contains_key(id), "applied submission {id:?} left no record");
            }
        }
        assert_eq!(
            i128::from(*after),
            value,
            "a submission left the shard at a value its deltas do not sum to"
        );
    }
    assert_eq!(i128::from(d.value), value, "the shard moved by other than what was applied");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::SHARD_VALUE_ABS_MAX;
    use crate::sketch::member_hash;

    const W: u64 = 1_000_000;

    fn single(delta: i64, id: Option<&str>) -> Submission {
        Submission::Single { delta, event_id: id.map(str::to_owned), member: None, item: None, seq: None }
    }

    #[test]
    #[should_panic(expected = "the shard moved by other than what was applied")]
    fn a_decision_whose_value_drifts_from_its_deltas_breaks_its_invariant() {
        let batch = [single(2, None), single(3, Some("e"))];
        let mut s = ShardState::default();
        let mut d = decide(&mut s, &batch, &BTreeMap::new(), 10, W, &mut |_| Ok(()));
        let records = BTreeMap::from([("e", DedupRecord { delta: 3, applied_at_ms: 10 })]);
        check_decision(&batch, 0, &d, &records);
        d.value += 1;
        check_decision(&batch, 0, &d, &records);
    }

    #[test]
    #[should_panic(expected = "left no record")]
    fn an_applied_increment_without_its_record_breaks_the_decisions_invariant() {
        let batch = [single(3, Some("e"))];
        let d = decide(&mut ShardState::default(), &batch, &BTreeMap::new(), 10, W, &mut |_| Ok(()));
        check_decision(&batch, 0, &d, &BTreeMap::new());
    }

    #[test]
    fn sums_buffered_and_single_increments() {
        let mut s = ShardState::default();
        let batch = [
            Submission::Buffered { sum: 300, increments: 300, members: vec![], drain_id: None },
            single(-5, None),
            single(7, Some("e-1")),
        ];
        let d = decide(&mut s, &batch, &BTreeMap::new(), 10, W, &mut |_| Ok(()));
        assert_eq!(d.value, 302);
        assert_eq!(s.value, 302);
        assert_eq!(d.outcomes, vec![Outcome::Applied; 3]);
        assert_eq!(d.applied_increments, 302);
        assert_eq!(d.dedup_put, vec![("e-1".to_string(), DedupRecord { delta: 7, applied_at_ms: 10 })]);
    }

    /// Concurrent increments of 1 committed together each learn their own place:
    /// on a one-shard counter these are the totals Redis's `INCR` would answer,
    /// unique and without gaps, whatever else the commit held.
    #[test]
    fn each_submission_learns_the_value_it_produced() {
        let mut s = ShardState { value: 10, ..ShardState::default() };
        let batch = [
            single(1, None),
            single(1, Some("e")),
            single(1, Some("e")),
            single(-3, None),
            Submission::Buffered { sum: 5, increments: 5, members: vec![], drain_id: None },
            single(i64::MAX, None),
        ];
        let d = decide(&mut s, &batch, &BTreeMap::new(), 10, W, &mut |_| Ok(()));
        assert_eq!(d.value, 14);
        assert_eq!(
            d.values,
            vec![11, 12, 12, 9, 14, 14],
            "a duplicate and an overflow name the value they found"
        );
        assert!(matches!(d.outcomes[5], Outcome::Overflow(_)));
    }

    #[test]
    fn an_event_id_counts_once_per_batch_and_across_batches() {
        let mut s = ShardState::default();
        let batch = [single(1, Some("e")), single(1, Some("e")), single(2, Some("e"))];
        let d = decide(&mut s, &batch, &BTreeMap::new(), 10, W, &mut |_| Ok(()));
        assert_eq!(d.value, 1);
        assert_eq!(
            d.outcomes,
            vec![Outcome::Applied, Outcome::Duplicate, Outcome::Conflict { recorded_delta: 1 }]
        );
        assert_eq!(d.duplicates, 1);
        let prior: BTreeMap<_, _> = d.dedup_put.into_iter().collect();
        let d2 = decide(&mut s, &[single(1, Some("e"))], &prior, 20, W, &mut |_| Ok(()));
        assert_eq!((d2.value, d2.outcomes[0]), (1, Outcome::Duplicate));
        assert!(!d2.writes(1), "a pure duplicate writes nothing");
        // After the window the same id counts again.
        let d3 = decide(&mut s, &[single(1, Some("e"))], &prior, 10 + W, W, &mut |_| Ok(()));
        assert_eq!((d3.value, d3.outcomes[0]), (2, Outcome::Applied));
    }

    #[test]
    fn a_retried_drain_counts_once() {
        let mut s = ShardState::default();
        let drain = |sum| Submission::Buffered {
            sum,
            increments: 3,
            members: vec![],
            drain_id: Some(format!("{DRAIN_ID_PREFIX}n1:7")),
        };
        let d = decide(&mut s, &[drain(30), drain(30)], &BTreeMap::new(), 10, W, &mut |_| Ok(()));
        assert_eq!((d.value, d.outcomes.clone()), (30, vec![Outcome::Applied, Outcome::Duplicate]));
        let prior: BTreeMap<_, _> = d.dedup_put.into_iter().collect();
        let d2 = decide(&mut s, &[drain(30)], &prior, 20, W, &mut |_| Ok(()));
        assert_eq!((d2.value, d2.outcomes[0]), (30, Outcome::Duplicate));
        assert_eq!(window_for("~drain:x", W), DRAIN_DEDUP_WINDOW_MS);
        assert_eq!(window_for("e-1", W), W);
    }

    #[test]
    fn overflow_is_refused_without_a_dedup_record() {
        let mut s = ShardState {
            value: SHARD_VALUE_ABS_MAX,
            sketch: None,
            frequency: None,
            writer_marks: 0,
            windows: None,
            event_ids: 0,
            event_ids_max: None,
        };
        let d = decide(
            &mut s,
            &[single(1, Some("e")), single(-1, None)],
            &BTreeMap::new(),
            0,
            W,
            &mut |_| Ok(()),
        );
        assert!(matches!(d.outcomes[0], Outcome::Overflow(_)));
        assert_eq!(d.outcomes[1], Outcome::Applied);
        assert!(d.dedup_put.is_empty(), "a refused increment must stay retryable");
        assert_eq!(d.value, SHARD_VALUE_ABS_MAX - 1);
    }

    #[test]
    fn members_reach_the_sketch_only_when_counted() {
        let mut s = ShardState {
            value: 0,
            sketch: Some(DistinctSketch::new()),
            frequency: None,
            writer_marks: 0,
            windows: None,
            event_ids: 0,
            event_ids_max: None,
        };
        let batch = [
            Submission::Single {
                delta: 1,
                event_id: Some("a".into()),
                member: Some(member_hash("a")),
                item: None,
                seq: None,
            },
            Submission::Single {
                delta: 1,
                event_id: Some("a".into()),
                member: Some(member_hash("b")),
                item: None,
                seq: None,
            },
            Submission::Buffered {
                sum: 2,
                increments: 2,
                members: vec![member_hash("c"), member_hash("c")],
                drain_id: None,
            },
        ];
        let d = decide(&mut s, &batch, &BTreeMap::new(), 0, W, &mut |_| Ok(()));
        assert!(d.sketch_changed);
        assert_eq!(s.sketch.as_ref().unwrap().estimate(), 2);
    }

    /// Fixed defect: a drain record found past its window by this node's clock
    /// (one ahead of the clock that stamped it) was judged fresh, and the resent sum
    /// counted twice. A drain id never repeats: a record found is its earlier
    /// delivery, whatever its age.
    #[test]
    fn a_drain_found_is_a_duplicate_however_old_its_record_looks() {
        let mut s = ShardState::default();
        let id = "~drain:n1:5.1:1:0@0";
        let prior = BTreeMap::from([(id.to_owned(), DedupRecord { delta: 4, applied_at_ms: 0 })]);
        let batch =
            [Submission::Buffered { sum: 4, increments: 4, members: vec![], drain_id: Some(id.into()) }];
        let d = decide(&mut s, &batch, &prior, 10 * DRAIN_DEDUP_WINDOW_MS, W, &mut |_| Ok(()));
        assert_eq!(d.outcomes, vec![Outcome::Duplicate]);
        assert_eq!(d.value, 0);
    }

    #[test]
    fn a_drain_id_lives_ten_minutes() {
        assert_eq!(DRAIN_DEDUP_WINDOW_MS, 600_000);
        assert_eq!(window_for("~drain:n:1:2:0", 5), 600_000);
        assert_eq!(window_for("e-1", 5), 5);
    }

    #[test]
    fn a_submission_names_its_record_and_counts_its_increments() {
        let b = Submission::Buffered {
            sum: 9,
            increments: 3,
            members: vec![],
            drain_id: Some("~drain:a".into()),
        };
        assert_eq!((b.record_id(), b.drain_id(), b.increments()), (Some("~drain:a"), Some("~drain:a"), 3));
        let s = single(2, Some("e"));
        assert_eq!((s.record_id(), s.drain_id(), s.increments()), (Some("e"), None, 1));
        let anonymous = Submission::Buffered { sum: 1, increments: 7, members: vec![], drain_id: None };
        assert_eq!((anonymous.record_id(), anonymous.drain_id(), anonymous.increments()), (None, None, 7));
    }

    #[test]
    fn a_decision_writes_when_anything_changed() {
        let base = Decision { value: 5, ..Decision::default() };
        assert!(!base.writes(5));
        assert!(base.writes(4), "the value changed");
        let records = Decision {
            dedup_put: vec![("e".into(), DedupRecord { delta: 0, applied_at_ms: 0 })],
            ..base.clone()
        };
        assert!(records.writes(5), "a record to keep");
        let sketch = Decision { sketch_changed: true, ..base };
        assert!(sketch.writes(5), "the sketch changed");
    }
    fn sequenced(delta: i64, writer: &str, seq: u64) -> Submission {
        Submission::Single {
            delta,
            event_id: Some(crate::dedup::mark_id(writer)),
            member: None,
            item: None,
            seq: Some(seq),
        }
    }

    #[test]
    fn sequenced_increments_keep_one_mark_per_writer() {
        let mut s = ShardState::default();
        let batch = [
            sequenced(1, "w", 1),
            sequenced(1, "w", 2),
            sequenced(1, "w", 2),
            sequenced(1, "w", 4),
            sequenced(5, "v", 10),
            sequenced(1, "w", 1),
        ];
        let d = decide(&mut s, &batch, &BTreeMap::new(), 7, W, &mut |_| Ok(()));
        assert_eq!(
            d.outcomes,
            vec![
                Outcome::Applied,
                Outcome::Applied,
                Outcome::Duplicate,
                Outcome::OutOfOrder { expected: 3 },
                Outcome::Applied,
                Outcome::Duplicate,
            ]
        );
        assert_eq!((d.value, d.duplicates, d.applied_increments), (7, 2, 3));
        assert_eq!(
            d.dedup_put,
            vec![
                ("~seq:v".to_owned(), DedupRecord { delta: 10, applied_at_ms: 7 }),
                ("~seq:w".to_owned(), DedupRecord { delta: 2, applied_at_ms: 7 }),
            ],
            "one record per writer, holding its highest sequence"
        );
        assert_eq!(s.writer_marks, 2);
        // The next batch finds w's mark in the store: 3 is next, 2 is a retry.
        let prior = BTreeMap::from([("~seq:w".to_owned(), DedupRecord { delta: 2, applied_at_ms: 7 })]);
        let d = decide(&mut s, &[sequenced(1, "w", 2), sequenced(1, "w", 3)], &prior, 8, W, &mut |_| Ok(()));
        assert_eq!(d.outcomes, vec![Outcome::Duplicate, Outcome::Applied]);
        assert_eq!(d.dedup_put, vec![("~seq:w".to_owned(), DedupRecord { delta: 3, applied_at_ms: 8 })]);
        assert_eq!((d.value, s.writer_marks), (8, 2), "a stored mark is not a new writer");
        // A refused or duplicate sequence writes nothing.
        let d = decide(&mut s, &[sequenced(1, "w", 9), sequenced(1, "w", 1)], &prior, 9, W, &mut |_| Ok(()));
        assert_eq!(d.outcomes, vec![Outcome::OutOfOrder { expected: 3 }, Outcome::Duplicate]);
        assert!(!d.writes(8));
    }

    #[test]
    fn a_shard_at_its_event_id_quota_refuses_new_ids_only() {
        let mut s = ShardState { event_ids: 1, event_ids_max: Some(2), ..ShardState::default() };
        let prior = BTreeMap::from([("seen".to_owned(), DedupRecord { delta: 1, applied_at_ms: 1 })]);
        let batch = [single(1, Some("a")), single(1, Some("b")), single(1, Some("seen")), single(1, None)];
        let d = decide(&mut s, &batch, &prior, 2, W, &mut |_| Ok(()));
        // "a" takes the last place; "b" is refused; a retry of a kept id is judged as
        // ever, and an increment without an id is counted.
        assert_eq!(
            d.outcomes,
            vec![Outcome::Applied, Outcome::TooManyEventIds, Outcome::Duplicate, Outcome::Applied]
        );
        assert_eq!((d.value, s.event_ids), (2, 2));
        assert_eq!(d.values, vec![1, 1, 1, 2], "each outcome with the value it left the shard at");
        assert!(d.dedup_put.iter().all(|(id, _)| id != "b"), "a refused id leaves no record");
        // Ids the node makes itself (drains) are not the client's and not bounded.
        let drain = Submission::Buffered {
            sum: 5,
            increments: 5,
            members: vec![],
            drain_id: Some("~drain:n:1:1:0".into()),
        };
        let d = decide(&mut s, &[drain], &prior, 3, W, &mut |_| Ok(()));
        assert_eq!((d.outcomes[0], s.event_ids), (Outcome::Applied, 2));
    }

    #[test]
    fn a_shard_full_of_writers_refuses_new_ones_only() {
        let mut s = ShardState { writer_marks: crate::dedup::WRITERS_PER_SHARD_MAX, ..ShardState::default() };
        let prior = BTreeMap::from([("~seq:old".to_owned(), DedupRecord { delta: 4, applied_at_ms: 1 })]);
        let d =
            decide(&mut s, &[sequenced(1, "new", 1), sequenced(1, "old", 5)], &prior, 2, W, &mut |_| Ok(()));
        assert_eq!(d.outcomes, vec![Outcome::TooManyWriters, Outcome::Applied]);
        assert_eq!((d.value, s.writer_marks), (1, crate::dedup::WRITERS_PER_SHARD_MAX));
        // An expired mark still in the store is overwritten, not counted again.
        let d = decide(&mut s, &[sequenced(1, "old", 99)], &prior, 2 + W, W, &mut |_| Ok(()));
        assert_eq!(d.outcomes, vec![Outcome::Applied]);
        assert_eq!(s.writer_marks, crate::dedup::WRITERS_PER_SHARD_MAX);
    }

    #[test]
    fn a_mark_and_an_event_id_never_share_a_record() {
        // An event id cannot spell a mark id, and a sequenced increment is judged by
        // its sequence alone (its delta is not recorded).
        let mut s = ShardState::default();
        let d = decide(
            &mut s,
            &[sequenced(3, "w", 1), sequenced(4, "w", 1), single(2, Some("w"))],
            &BTreeMap::new(),
            1,
            W,
            &mut |_| Ok(()),
        );
        assert_eq!(d.outcomes, vec![Outcome::Applied, Outcome::Duplicate, Outcome::Applied]);
        assert_eq!(d.dedup_put.len(), 2);
    }
}
