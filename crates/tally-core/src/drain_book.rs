//! A node's drained sums between its accumulators and their shards.
//!
//! The aggregator drains an accumulator slot into one submission, a *drained sum*.
//! Its increments were acknowledged already, so it must reach its shard exactly once.
//! Every drained sum therefore carries a drain id (routing to the shard it was drained
//! for, so that after a resharding its record is found in the sealed generation), and
//! stays in this book from the moment it is sent until its shard answers:
//!
//! * answered (applied, or a duplicate of an earlier attempt): it leaves the book;
//! * refused at the door (the shard was sealed) or never sent: it leaves the book and
//!   its sum goes back to the accumulator (nothing was applied);
//! * not answered (a lost answer, a timeout, a node that is down): it is *in doubt*
//!   and is resent unchanged — same id, so it counts once — every
//!   [`DRAIN_RESEND_MS`];
//! * in doubt for longer than [`IN_DOUBT_RETRY_MS_MAX`]: it is given up and reported,
//!   never resent, because the record of its id lives only [`DRAIN_DEDUP_WINDOW_MS`]
//!   after it was applied and a later resend could count it twice.
//!
//! A drain id names its sender (node and incarnation), its number and, after `@`,
//! the sender's clock when it was first sent: `~drain:{node}:{incarnation}:{seq}:
//! {salt}@{sent_at_ms}`. A shard ages a sender's drain records against the newest
//! first send of that sender it holds, so whether a record has lived its window is
//! measured in the sender's clock alone, the clock that also decides when the sender
//! stops resending: a shard whose leader's clock runs ahead of the sender's (after a
//! failover, say) never forgets a record early ([`crate::sweep`]).
//!
//! The engine's aggregator and the simulator's both keep their drained sums here.

use crate::router::shard_of_event;
use crate::shard::{Submission, DRAIN_DEDUP_WINDOW_MS, DRAIN_ID_PREFIX};
use crate::CounterName;
use std::collections::BTreeMap;

/// How long after its last send a drained sum in doubt is sent again, in ms.
pub const DRAIN_RESEND_MS: u64 = 40;

/// How long a drained sum in doubt is resent, in milliseconds. A resend is
/// deduplicated by the drain id's record only while that record lives
/// ([`DRAIN_DEDUP_WINDOW_MS`] after the first attempt that applied it, which came after
/// the first send); half of it leaves the other half for the resend itself to arrive.
pub const IN_DOUBT_RETRY_MS_MAX: u64 = DRAIN_DEDUP_WINDOW_MS / 2;

/// The sender (`~drain:{node}:{incarnation}`) and the sender's clock at its first
/// send, of a drain id that names them; `None` for an id written before drain ids
/// carried the time.
pub fn drain_sender_and_time(id: &str) -> Option<(&str, u64)> {
    let (rest, sent) = id.rsplit_once('@')?;
    let sent_at_ms = sent.parse().ok()?;
    let (rest, _salt) = rest.rsplit_once(':')?;
    let (sender, _seq) = rest.rsplit_once(':')?;
    sender.starts_with(DRAIN_ID_PREFIX).then_some((sender, sent_at_ms))
}

/// One drained sum not yet answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenDrain {
    /// Its counter.
    pub counter: CounterName,
    /// When the counter it was drained for was created (`CounterMeta::created_at_ms`):
    /// its incarnation. A counter deleted and created again under the same name is
    /// another one, and a sum of the first is never resent to the second.
    pub born_ms: u64,
    /// The submission, with its drain id.
    pub sub: Submission,
    /// When it was first sent.
    pub first_sent_ms: u64,
    /// When it was last sent, once it is in doubt (`None` while its first send is
    /// still waiting for an answer).
    pub in_doubt_since_ms: Option<u64>,
}

/// A node's drained sums that are not answered yet, by drain id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainBook {
    /// `~drain:{node}:{incarnation}:` — ids never repeat across a node's lives.
    prefix: String,
    seq: u64,
    open: BTreeMap<String, OpenDrain>,
}

impl DrainBook {
    /// The book of `node` in its `incarnation` (never repeated by any store the node
    /// runs).
    pub fn new(node: &str, incarnation: impl std::fmt::Display) -> Self {
        Self { prefix: format!("{DRAIN_ID_PREFIX}{node}:{incarnation}:"), seq: 0, open: BTreeMap::new() }
    }

    /// Opens a drained sum for shard `index` of a layout of `shards`: returns its
    /// submission, under a fresh id that routes to that shard.
    pub fn open(
        &mut self,
        now_ms: u64,
        (counter, born_ms): (&CounterName, u64),
        index: u16,
        shards: u16,
        (sum, increments, members): (i64, u64, Vec<u64>),
    ) -> Submission {
        self.seq += 1;
        let base = format!("{}{}", self.prefix, self.seq);
        let id = (0u32..)
            .map(|salt| format!("{base}:{salt}@{now_ms}"))
            .find(|id| shard_of_event(id, shards) == index)
            .expect("some salt routes to every shard");
        let sub = Submission::Buffered { sum, increments, members, drain_id: Some(id.clone()) };
        let entry = OpenDrain {
            counter: counter.clone(),
            born_ms,
            sub: sub.clone(),
            first_sent_ms: now_ms,
            in_doubt_since_ms: None,
        };
        self.open.insert(id, entry);
        sub
    }

    /// A token no other call on any node, in any of its lives, ever answers (it takes
    /// a number from the drain ids' sequence): what makes an absolute write of a
    /// counter (`SET`) a correction of its own, never deduplicated against an earlier
    /// one that happened to find the same totals.
    pub fn unique_token(&mut self) -> String {
        self.seq += 1;
        format!("{}{}", self.prefix, self.seq)
    }

    /// Its shard answered, refused it at the door, or it was never sent: it leaves
    /// the book.
    pub fn close(&mut self, drain_id: &str) -> Option<OpenDrain> {
        self.open.remove(drain_id)
    }

    /// It was sent and no answer came: it is in doubt (again) as of `now_ms`.
    pub fn unanswered(&mut self, drain_id: &str, now_ms: u64) {
        if let Some(d) = self.open.get_mut(drain_id) {
            d.in_doubt_since_ms = Some(now_ms);
        }
    }

    /// The sums to resend now (in doubt, last sent at least [`DRAIN_RESEND_MS`] ago, or
    /// "later" than now by a clock that went back),
    /// optionally of one counter only — each is counted as sent now, and comes with
    /// its counter's incarnation (`born_ms`), which the resend must still find — and
    /// the sums given up (in doubt past [`IN_DOUBT_RETRY_MS_MAX`]), which leave the
    /// book.
    pub fn due(
        &mut self,
        now_ms: u64,
        only: Option<&CounterName>,
    ) -> (Vec<(CounterName, u64, Submission)>, Vec<OpenDrain>) {
        let given_up: Vec<String> = self
            .open
            .iter()
            .filter(|(_, d)| d.in_doubt_since_ms.is_some())
            .filter(|(_, d)| now_ms.saturating_sub(d.first_sent_ms) > IN_DOUBT_RETRY_MS_MAX)
            .map(|(id, _)| id.clone())
            .collect();
        let lost = given_up.iter().filter_map(|id| self.open.remove(id)).collect();
        let mut resend = Vec::new();
        for d in self.open.values_mut() {
            let Some(since) = d.in_doubt_since_ms else { continue };
            // A clock stepped back since the last send makes it due at once: waiting
            // for the clock to reach that send again would hold the sum in doubt (and
            // every fresh read of its counter incomplete) for as long as the step.
            let due = since.saturating_add(DRAIN_RESEND_MS) <= now_ms || now_ms < since;
            if due && only.is_none_or(|c| &d.counter == c) {
                d.in_doubt_since_ms = Some(now_ms);
                resend.push((d.counter.clone(), d.born_ms, d.sub.clone()));
            }
        }
        (resend, lost)
    }

    /// Acknowledged increments in `counter`'s open sums (in flight or in doubt).
    pub fn increments_of(&self, counter: &CounterName) -> u64 {
        self.open.values().filter(|d| &d.counter == counter).map(|d| d.sub.increments()).sum()
    }

    /// Acknowledged increments in sums in doubt.
    pub fn in_doubt_increments(&self) -> u64 {
        self.open.values().filter(|d| d.in_doubt_since_ms.is_some()).map(|d| d.sub.increments()).sum()
    }

    /// Acknowledged increments in every open sum.
    pub fn increments(&self) -> u64 {
        self.open.values().map(|d| d.sub.increments()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> CounterName {
        CounterName::new(n).unwrap()
    }

    fn id_of(sub: &Submission) -> String {
        sub.drain_id().unwrap().to_owned()
    }

    #[test]
    fn ids_route_to_their_shard_and_never_repeat() {
        let mut book = DrainBook::new("node1", 7);
        let a = book.open(0, (&name("c"), 1), 3, 8, (5, 2, vec![]));
        let b = book.open(0, (&name("c"), 1), 3, 8, (5, 2, vec![]));
        assert_ne!(id_of(&a), id_of(&b));
        assert!(id_of(&a).starts_with("~drain:node1:7:"));
        assert_eq!(drain_sender_and_time(&id_of(&a)), Some(("~drain:node1:7", 0)));
        assert_eq!(drain_sender_and_time("~drain:n:1000.2:5:0"), None, "written before ids carried the time");
        assert_eq!(shard_of_event(&id_of(&a), 8), 3);
        assert_eq!(
            a,
            Submission::Buffered { sum: 5, increments: 2, members: vec![], drain_id: Some(id_of(&a)) }
        );
        assert_ne!(
            id_of(&DrainBook::new("node1", 8).open(0, (&name("c"), 1), 3, 8, (1, 1, vec![]))),
            id_of(&a)
        );
    }

    #[test]
    fn a_sum_in_flight_is_not_resent_until_it_is_in_doubt() {
        let mut book = DrainBook::new("n", 1);
        let sub = book.open(1_000, (&name("c"), 1), 0, 1, (4, 4, vec![]));
        assert_eq!(book.due(1_000 + DRAIN_RESEND_MS * 10, None), (vec![], vec![]));
        assert_eq!((book.increments(), book.in_doubt_increments()), (4, 0));
        book.unanswered(&id_of(&sub), 2_000);
        assert_eq!(book.in_doubt_increments(), 4);
        assert_eq!(book.due(2_000 + DRAIN_RESEND_MS - 1, None), (vec![], vec![]));
        let (resend, lost) = book.due(2_000 + DRAIN_RESEND_MS, None);
        assert_eq!((resend, lost), (vec![(name("c"), 1, sub.clone())], vec![]));
        assert_eq!(book.due(2_000 + DRAIN_RESEND_MS + 1, None), (vec![], vec![]), "just resent");
        assert!(book.close(&id_of(&sub)).is_some());
        assert_eq!(book.increments(), 0);
        assert!(book.close(&id_of(&sub)).is_none());
    }

    #[test]
    fn resends_can_be_asked_for_one_counter() {
        let mut book = DrainBook::new("n", 1);
        let a = book.open(0, (&name("a"), 1), 0, 1, (1, 1, vec![]));
        let b = book.open(0, (&name("b"), 1), 0, 1, (2, 2, vec![]));
        book.unanswered(&id_of(&a), 0);
        book.unanswered(&id_of(&b), 0);
        assert_eq!(book.increments_of(&name("b")), 2);
        let (resend, _) = book.due(DRAIN_RESEND_MS, Some(&name("b")));
        assert_eq!(resend, vec![(name("b"), 1, b)]);
        let (resend, _) = book.due(DRAIN_RESEND_MS, None);
        assert_eq!(resend, vec![(name("a"), 1, a)]);
    }

    #[test]
    fn a_resend_names_the_incarnation_its_sum_was_drained_for() {
        let mut book = DrainBook::new("n", 1);
        let old = book.open(0, (&name("c"), 1_000), 0, 1, (1, 1, vec![]));
        let new = book.open(5, (&name("c"), 2_000), 0, 1, (2, 2, vec![]));
        book.unanswered(&id_of(&old), 0);
        book.unanswered(&id_of(&new), 5);
        let (resend, _) = book.due(5 + DRAIN_RESEND_MS, None);
        assert_eq!(resend, vec![(name("c"), 1_000, old), (name("c"), 2_000, new)]);
    }

    #[test]
    fn a_clock_stepped_back_does_not_hold_a_sum_in_doubt_until_it_catches_up() {
        let mut book = DrainBook::new("node1", 1);
        let sub = book.open(120_000, (&name("c"), 1), 0, 1, (5, 2, vec![]));
        book.unanswered(&id_of(&sub), 120_010);
        // The clock went back two minutes: the sum is due now, not in two minutes.
        let (resend, lost) = book.due(10, None);
        assert_eq!((resend.len(), lost.len()), (1, 0));
        // … and then every DRAIN_RESEND_MS of the new clock.
        assert!(book.due(10 + DRAIN_RESEND_MS - 1, None).0.is_empty());
        assert_eq!(book.due(10 + DRAIN_RESEND_MS, None).0.len(), 1);
    }

    #[test]
    fn a_sum_in_doubt_past_the_limit_is_given_up_not_resent() {
        let mut book = DrainBook::new("n", 1);
        let sub = book.open(1_000, (&name("c"), 1), 0, 1, (3, 3, vec![]));
        book.unanswered(&id_of(&sub), 1_000);
        let (resend, lost) = book.due(1_000 + IN_DOUBT_RETRY_MS_MAX, None);
        assert_eq!((resend.len(), lost.len()), (1, 0));
        let (resend, lost) = book.due(1_000 + IN_DOUBT_RETRY_MS_MAX + 1, None);
        assert!(resend.is_empty());
        assert_eq!(lost.iter().map(|d| d.sub.increments()).sum::<u64>(), 3);
        assert_eq!(book.increments(), 0);
        // The limit leaves a resend at least half a record's life to arrive.
        assert_eq!(IN_DOUBT_RETRY_MS_MAX * 2, DRAIN_DEDUP_WINDOW_MS);
    }
}
