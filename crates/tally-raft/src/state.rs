//! The replicated state itself, as plain data with a pure transition function.
//!
//! `MetaState::apply` never reads a clock, a random number or the environment: it
//! is a function of the state and the [`Request`], so every replica that applies the
//! same log ends in the same state. The sled-backed state machine wraps it with
//! persistence; unit tests drive it directly.

use crate::types::{
    CounterAnswer, Effect, MemberRejection, MembersView, MetaChange, NodeId, ProposalId, Rejection, Request,
    Response, StoreRecord, StoreRejection,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use tally_core::meta::MetaCommand;
use tally_core::meta::{apply_command_in, CounterMeta, MetaEffect, MetaError};
use tally_core::name::CounterName;
use tally_core::namespace::Namespaces;
use tally_core::ring::RING_NODES_MAX;
use tally_core::spec::SpecError;
use tally_core::spec::{AutoShards, SpecPatch};

/// Longest accepted data-plane node id, in bytes.
pub const NODE_ID_LEN_MAX: usize = 255;

/// Answers the proposal book keeps per proposer: its latest proposals'. A proposer
/// resends one only while it waits for it (a few seconds), and has at most a few
/// hundred in flight at once (its grouped creations, its resharding steps), so a
/// resend that finds its proposal forgotten is one that waited behind this many
/// later ones of the same proposer.
pub const PROPOSALS_REMEMBERED_MAX: usize = 1024;

/// Proposers the book keeps: the most recently heard from. A proposer is one run
/// of one node's metadata member, so a node that restarts is a new one and its
/// earlier runs fall out of the book after this many newer proposers were heard.
pub const PROPOSERS_REMEMBERED_MAX: usize = 64;

/// What the book remembers of one proposer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposer {
    /// The answers of its latest proposals, by number.
    pub answered: BTreeMap<u64, Response>,
    /// Proposals numbered below this were forgotten (their answers dropped).
    pub forgotten_below: u64,
    /// The state's request count when it was last heard from (which proposer to
    /// forget first).
    pub heard_at: u64,
}

/// Everything the metadata group agrees on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaState {
    /// Every live counter's metadata.
    pub counters: BTreeMap<CounterName, CounterMeta>,
    /// Deleted counters whose shard data may still exist: name → every
    /// `(generation, shards)` to delete. Kept until a `ClearTombstone`.
    pub tombstones: BTreeMap<CounterName, Vec<(u32, u16)>>,
    /// Data-plane member node ids, sorted and unique.
    pub members: Vec<String>,
    /// Bumped by every change of `members`.
    pub placement_epoch: u64,
    /// The members before the last change, while `handoff` is not empty.
    pub previous: Vec<String>,
    /// Nodes of `previous` still handing off shards they no longer own.
    pub handoff: Vec<String>,
    /// Every raft node's data directory as it registered it: raft id → record.
    pub stores: BTreeMap<NodeId, StoreRecord>,
    /// How many [`Request`]s were applied in total. Not used by any transition; it
    /// lets tests prove that no entry is applied twice (across restarts too).
    pub applied_requests: u64,
    /// The bounds of every counter whose shard count follows contention.
    pub auto: BTreeMap<CounterName, AutoShards>,
    /// The replica classes of counters that state their own replica count, each
    /// with the data-plane members when its first counter was created (none: the
    /// configured members, before any change): every node assigns the class's
    /// ranges on them ([`tally_core::ranges::record_class`]).
    pub classes: BTreeMap<u8, Vec<String>>,
    /// The voters each range group of those classes started with
    /// ([`Request::FormRange`]), by range number.
    pub formations: BTreeMap<u32, Vec<(u64, String)>>,
    /// The proposal book: per proposer, the answers of its latest proposals, so a
    /// proposal resent after an unknown outcome is applied once
    /// ([`Request::Proposal`]).
    pub proposals: BTreeMap<u128, Proposer>,
    /// The namespaces, by prefix: the spec counters created implicitly under each
    /// take ([`tally_core::namespace`]).
    pub namespaces: Namespaces,
    /// Every counter with a deadline, by deadline: what the reclaim of expired
    /// counters walks. Derived from `counters` (never stored or sent; rebuilt by
    /// [`MetaState::reindex`] when a state is loaded or installed).
    #[serde(skip)]
    pub expiring: BTreeSet<(u64, CounterName)>,
}

/// One item of the state, as persisted under its own key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Touched {
    /// A counter's metadata.
    Counter(CounterName),
    /// A counter's tombstone.
    Tombstone(CounterName),
    /// The member list and placement epoch.
    Members,
    /// The store records.
    Stores,
    /// A counter's auto bounds.
    Auto(CounterName),
    /// The replica classes in use.
    Classes,
    /// The first voters of the classes' range groups.
    Formations,
    /// One proposer's entry in the proposal book: when it was last heard from and
    /// what it forgot (its answers are items of their own).
    Proposer(u128),
    /// One answer in the proposal book: the proposer, and the proposal's number.
    Answer(u128, u64),
    /// A namespace, by prefix.
    Namespace(String),
}

impl MetaState {
    /// Applies one request, returning its answer, the items it changed (for
    /// persistence) and the changes to announce.
    pub(crate) fn apply(&mut self, req: &Request) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        self.applied_requests += 1;
        match req {
            Request::Proposal { id, request } => self.proposal(*id, request),
            Request::Counter { name, cmd, now_ms } => self.counter(name, cmd, None, *now_ms),
            Request::CounterAuto { name, cmd, auto, now_ms } => self.counter(name, cmd, Some(*auto), *now_ms),
            Request::EnsureMany { names, default, now_ms } => {
                let cmd = MetaCommand::EnsureWith(*default);
                let (mut answers, mut touched, mut changes) =
                    (Vec::with_capacity(names.len()), vec![], vec![]);
                for name in names {
                    let (answer, t, c) = self.counter_answer(name, &cmd, None, *now_ms);
                    answers.push(answer);
                    touched.extend(t);
                    changes.extend(c);
                }
                (Response::Ensured(answers), touched, changes)
            }
            Request::AutoReshard { name, version, shards, now_ms } => {
                let found =
                    self.counters.get(name).map(|m| m.version).filter(|_| self.auto.contains_key(name));
                if found != Some(*version) {
                    let refused = Rejection::AutoStale { version: *version, found };
                    return (Response::Counter(Err(refused)), vec![], vec![]);
                }
                let cmd = MetaCommand::Put(SpecPatch { shards: Some(*shards), ..Default::default() });
                self.counter(name, &cmd, None, *now_ms)
            }
            Request::PutNamespace { prefix, spec } => {
                let existed = self.namespaces.contains_key(prefix);
                if !existed && self.namespaces.len() >= tally_core::namespace::NAMESPACES_MAX {
                    let refused = tally_core::namespace::NamespaceError::TooMany.to_string();
                    return (Response::Namespace(Err(refused)), vec![], vec![]);
                }
                if self.namespaces.get(prefix) == Some(spec) {
                    return (Response::Namespace(Ok(true)), vec![], vec![]);
                }
                self.namespaces.insert(prefix.clone(), *spec);
                (Response::Namespace(Ok(existed)), vec![Touched::Namespace(prefix.clone())], vec![])
            }
            Request::DeleteNamespace { prefix } => match self.namespaces.remove(prefix) {
                Some(_) => (Response::Namespace(Ok(true)), vec![Touched::Namespace(prefix.clone())], vec![]),
                None => (Response::Namespace(Ok(false)), vec![], vec![]),
            },
            Request::FormRange { range, voters } => {
                if voters.is_empty() || self.formations.contains_key(range) {
                    let first = self.formations.get(range).cloned().unwrap_or_default();
                    return (Response::Formation(first), vec![], vec![]);
                }
                self.formations.insert(*range, voters.clone());
                (Response::Formation(voters.clone()), vec![Touched::Formations], vec![])
            }
            Request::ClearTombstone { name } => {
                let existed = self.tombstones.remove(name).is_some();
                let (touched, changes) = if existed {
                    (vec![Touched::Tombstone(name.clone())], vec![MetaChange::TombstoneCleared(name.clone())])
                } else {
                    (vec![], vec![])
                };
                (Response::TombstoneCleared { existed }, touched, changes)
            }
            Request::SetMembers { from_epoch, previous, members } => {
                self.set_members(*from_epoch, previous, members)
            }
            Request::HandoffDone { node, epoch } => {
                if *epoch != self.placement_epoch {
                    return (Response::Members(Ok(self.view(false))), vec![], vec![]);
                }
                match self.handoff.binary_search(node) {
                    Ok(at) => {
                        self.handoff.remove(at);
                        if self.handoff.is_empty() {
                            self.previous.clear();
                        }
                        let view = self.view(true);
                        (
                            Response::Members(Ok(view.clone())),
                            vec![Touched::Members],
                            vec![MetaChange::Members(view)],
                        )
                    }
                    Err(_) => (Response::Members(Ok(self.view(false))), vec![], vec![]),
                }
            }
            Request::RegisterStore { node, store } => match self.stores.get(node) {
                None => self.set_store(*node, StoreRecord { store: *store, data_lost: false }),
                Some(r) if r.store == *store => (Response::Store(Ok(*r)), vec![], vec![]),
                Some(r) => {
                    let refused = StoreRejection::Replaced { node: *node, recorded: r.store, got: *store };
                    (Response::Store(Err(refused)), vec![], vec![])
                }
            },
            Request::ReplaceStore { node, store } => match self.stores.get(node) {
                Some(r) if r.store == *store => (Response::Store(Ok(*r)), vec![], vec![]),
                _ => self.set_store(*node, StoreRecord { store: *store, data_lost: true }),
            },
            Request::AcceptLoss { node, store } => match self.stores.get(node) {
                None => (Response::Store(Err(StoreRejection::Unknown { node: *node })), vec![], vec![]),
                Some(r) if r.store != *store => {
                    let refused = StoreRejection::Replaced { node: *node, recorded: r.store, got: *store };
                    (Response::Store(Err(refused)), vec![], vec![])
                }
                Some(r) if !r.data_lost => (Response::Store(Ok(*r)), vec![], vec![]),
                Some(_) => self.set_store(*node, StoreRecord { store: *store, data_lost: false }),
            },
        }
    }

    /// Applies a proposal once: a copy of one already applied answers what the first
    /// answered and changes nothing; one whose answer was forgotten is not applied.
    fn proposal(&mut self, id: ProposalId, request: &Request) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        let heard_at = self.applied_requests;
        #[cfg(feature = "planted-bugs")]
        let remembered = !tally_core::planted::active(tally_core::planted::Bug::ProposalAppliedTwice);
        #[cfg(not(feature = "planted-bugs"))]
        let remembered = true;
        if let Some(p) = self.proposals.get(&id.proposer) {
            if let Some(first) = p.answered.get(&id.seq).filter(|_| remembered) {
                return (first.clone(), vec![], vec![]);
            }
            if id.seq < p.forgotten_below {
                return (Response::Forgotten, vec![], vec![]);
            }
        }
        // A proposal wraps one request; should one wrap another, the inner one is
        // applied as itself (never recorded twice).
        let inner: &Request = match request {
            Request::Proposal { request, .. } => request,
            other => other,
        };
        let (response, mut touched, changes) = self.apply_unrecorded(inner);
        let proposer = self.proposals.entry(id.proposer).or_default();
        proposer.heard_at = heard_at;
        proposer.answered.insert(id.seq, response.clone());
        touched.push(Touched::Answer(id.proposer, id.seq));
        while proposer.answered.len() > PROPOSALS_REMEMBERED_MAX {
            let (oldest, _) = proposer.answered.pop_first().expect("over the bound, so not empty");
            proposer.forgotten_below = proposer.forgotten_below.max(oldest + 1);
            touched.push(Touched::Answer(id.proposer, oldest));
        }
        touched.push(Touched::Proposer(id.proposer));
        if self.proposals.len() > PROPOSERS_REMEMBERED_MAX {
            let quietest = self.proposals.iter().min_by_key(|(key, p)| (p.heard_at, **key)).map(|(k, _)| *k);
            if let Some(gone) = quietest.and_then(|key| self.proposals.remove(&key).map(|p| (key, p))) {
                let (key, p) = gone;
                touched.extend(p.answered.keys().map(|seq| Touched::Answer(key, *seq)));
                touched.push(Touched::Proposer(key));
            }
        }
        assert!(self.proposals.len() <= PROPOSERS_REMEMBERED_MAX, "the proposal book is bounded");
        (response, touched, changes)
    }

    /// [`MetaState::apply`] of the request inside a proposal: the request count was
    /// bumped once for the proposal.
    fn apply_unrecorded(&mut self, req: &Request) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        self.applied_requests -= 1;
        self.apply(req)
    }

    /// Applies `cmd` to counter `name` and, when `auto` is given, sets its auto
    /// bounds (`Some(None)`: fixed) in the same change. A deleted counter loses them.
    fn counter(
        &mut self,
        name: &CounterName,
        cmd: &MetaCommand,
        auto: Option<Option<AutoShards>>,
        now_ms: u64,
    ) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        let (answer, touched, changes) = self.counter_answer(name, cmd, auto, now_ms);
        (Response::Counter(answer), touched, changes)
    }

    /// [`MetaState::counter`]'s work, answered as one counter's result.
    fn counter_answer(
        &mut self,
        name: &CounterName,
        cmd: &MetaCommand,
        auto: Option<Option<AutoShards>>,
        now_ms: u64,
    ) -> (CounterAnswer, Vec<Touched>, Vec<MetaChange>) {
        let current = self.counters.get(name).cloned();
        let (mut next, effect) = match apply_command_in(name.as_str(), current, cmd, now_ms, &self.namespaces)
        {
            Err(e) => return (Err(Rejection::from(e)), vec![], vec![]),
            Ok(r) => r,
        };
        // A name whose deletion is not finished: the new counter's shards take
        // generations the old one never had, so its cleanup never meets them.
        if let (MetaEffect::Created, Some(tombstone)) = (&effect, self.tombstones.get(name)) {
            match next.take().and_then(|meta| meta.born_after(tombstone)) {
                Some(meta) => next = Some(meta),
                None => {
                    let max = tally_core::ids::GENERATION_MAX;
                    let refused = MetaError::Spec(SpecError::GenerationsExhausted { max });
                    return (Err(Rejection::from(refused)), vec![], vec![]);
                }
            }
        }
        // A counter created implicitly under an auto namespace follows contention.
        let auto = match (&effect, auto) {
            (MetaEffect::Created, None) => {
                tally_core::meta::creation_auto(name.as_str(), cmd, &self.namespaces).map(Some).or(auto)
            }
            _ => auto,
        };
        let mut touched = vec![];
        if !matches!(effect, MetaEffect::Unchanged | MetaEffect::Missing) {
            touched.push(Touched::Counter(name.clone()));
            let before = match &next {
                Some(meta) => self.counters.insert(name.clone(), meta.clone()),
                None => self.counters.remove(name),
            };
            if let Some(at) = before.and_then(|m| m.expires_at_ms) {
                self.expiring.remove(&(at, name.clone()));
            }
            if let Some(at) = next.as_ref().and_then(|m| m.expires_at_ms) {
                self.expiring.insert((at, name.clone()));
            }
        }
        if let MetaEffect::Deleted(generations) = &effect {
            let tomb = self.tombstones.entry(name.clone()).or_default();
            tomb.extend(generations.iter().copied());
            tomb.sort_unstable();
            tomb.dedup();
            touched.push(Touched::Tombstone(name.clone()));
        }
        let bounds = match (&next, auto) {
            (None, _) => None,
            (Some(_), Some(set)) => set,
            (Some(_), None) => self.auto.get(name).copied(),
        };
        if bounds != self.auto.get(name).copied() {
            match bounds {
                Some(b) => self.auto.insert(name.clone(), b),
                None => self.auto.remove(name),
            };
            touched.push(Touched::Auto(name.clone()));
        }
        if let (MetaEffect::Created, Some(meta)) = (&effect, &next) {
            let class = meta.spec.replica_class();
            if tally_core::ranges::record_class(&mut self.classes, class, &self.members) {
                touched.push(Touched::Classes);
            }
        }
        let changes = if touched.is_empty() { vec![] } else { vec![MetaChange::Counter(name.clone())] };
        (Ok((next, Effect::from(effect))), touched, changes)
    }

    fn set_store(&mut self, node: NodeId, record: StoreRecord) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        self.stores.insert(node, record);
        (Response::Store(Ok(record)), vec![Touched::Stores], vec![MetaChange::Store(node)])
    }

    fn set_members(
        &mut self,
        from_epoch: u64,
        previous: &[String],
        members: &[String],
    ) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        let refuse = |e| (Response::Members(Err(e)), vec![], vec![]);
        if from_epoch != self.placement_epoch {
            return refuse(MemberRejection::StaleEpoch { current: self.placement_epoch, got: from_epoch });
        }
        if !self.handoff.is_empty() {
            return refuse(MemberRejection::HandoffUnderWay { waiting: self.handoff.clone() });
        }
        // A shard sealed for a resharding keeps that only in its running actor; it
        // must not move before the resharding completes.
        let resharding = self.pending_reshards().len();
        if resharding > 0 {
            return refuse(MemberRejection::ReshardingUnderWay { count: resharding });
        }
        let sorted = |v: &[String]| {
            let mut v = v.to_vec();
            v.sort();
            v.dedup();
            v
        };
        let (previous, members) = (sorted(previous), sorted(members));
        for node in previous.iter().chain(&members) {
            if let Err(e) = tally_core::name::check_token("node id", node, NODE_ID_LEN_MAX) {
                return refuse(MemberRejection::InvalidNode { reason: e.to_string() });
            }
        }
        if members.is_empty() {
            return refuse(MemberRejection::NoMembers);
        }
        if members.len() > RING_NODES_MAX {
            return refuse(MemberRejection::TooManyMembers { count: members.len(), max: RING_NODES_MAX });
        }
        // After epoch 0 the state machine knows the members itself.
        let previous = if self.placement_epoch == 0 { previous } else { self.members.clone() };
        if members == previous {
            return (Response::Members(Ok(self.view(false))), vec![], vec![]);
        }
        self.members = members;
        self.handoff = previous.clone();
        self.previous = previous;
        self.members_changed()
    }

    /// The membership as the data plane needs it.
    pub fn view(&self, changed: bool) -> MembersView {
        MembersView {
            members: self.members.clone(),
            placement_epoch: self.placement_epoch,
            previous: self.previous.clone(),
            handoff: self.handoff.clone(),
            changed,
        }
    }

    fn members_changed(&mut self) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        self.placement_epoch += 1;
        let view = self.view(true);
        (Response::Members(Ok(view.clone())), vec![Touched::Members], vec![MetaChange::Members(view)])
    }

    /// Rebuilds what is derived from the counters (the deadlines' index) after the
    /// state was loaded or installed whole.
    pub fn reindex(&mut self) {
        self.expiring = self
            .counters
            .iter()
            .filter_map(|(name, m)| m.expires_at_ms.map(|at| (at, name.clone())))
            .collect();
    }

    /// Up to `limit` counters whose deadline is at or before `now_ms`, earliest first.
    pub fn expired(&self, now_ms: u64, limit: usize) -> Vec<CounterName> {
        self.expiring.iter().take_while(|(at, _)| *at <= now_ms).take(limit).map(|(_, n)| n.clone()).collect()
    }

    /// Counters with a resharding in progress (`layout.resharding` is set), which the
    /// data plane must drive to completion.
    pub fn pending_reshards(&self) -> Vec<CounterName> {
        self.counters.iter().filter(|(_, m)| m.layout.resharding.is_some()).map(|(n, _)| n.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tally_core::meta::MetaCommand;
    use tally_core::spec::SpecPatch;

    fn name(s: &str) -> CounterName {
        CounterName::new(s).unwrap()
    }

    fn counter(n: &str, cmd: MetaCommand, now_ms: u64) -> Request {
        Request::Counter { name: name(n), cmd, now_ms }
    }

    #[test]
    fn delete_leaves_a_tombstone_until_cleared() {
        let mut s = MetaState::default();
        s.apply(&counter("a", MetaCommand::Ensure, 1));
        let (r, touched, _) = s.apply(&counter("a", MetaCommand::Delete, 2));
        assert_eq!(r, Response::Counter(Ok((None, Effect::Deleted(vec![(0, 8)])))));
        assert_eq!(touched, vec![Touched::Counter(name("a")), Touched::Tombstone(name("a"))]);
        assert_eq!(s.tombstones.get("a"), Some(&vec![(0, 8)]));
        assert!(s.counters.is_empty());
        assert_eq!(
            s.apply(&Request::ClearTombstone { name: name("a") }).0,
            Response::TombstoneCleared { existed: true }
        );
        assert_eq!(
            s.apply(&Request::ClearTombstone { name: name("a") }).0,
            Response::TombstoneCleared { existed: false }
        );
        assert_eq!(s.applied_requests, 4);
    }

    /// Fixed defect: a counter created again while its deleted namesake's cleanup
    /// was still pending took generation 0 again, so the cleanup (run late by a
    /// node whose view lagged) deleted the new counter's shards, and the new
    /// counter read what the old one left.
    #[test]
    fn a_counter_created_while_its_namesakes_cleanup_is_pending_takes_new_generations() {
        let mut s = MetaState::default();
        let reshard = MetaCommand::Put(SpecPatch { shards: Some(4), ..Default::default() });
        s.apply(&counter("a", MetaCommand::Ensure, 1));
        s.apply(&counter("a", reshard, 2));
        s.apply(&counter("a", MetaCommand::CompleteReshard { generation: 0, sealed_sum: 0 }, 3));
        s.apply(&counter("a", MetaCommand::Delete, 4));
        let tombstone = s.tombstones["a"].clone();
        assert_eq!(tombstone.iter().map(|(w, _)| *w).max(), Some(1));
        let (r, _, _) = s.apply(&counter("a", MetaCommand::Ensure, 5));
        let Response::Counter(Ok((Some(meta), Effect::Created))) = r else { panic!("{r:?}") };
        assert_eq!(meta.layout.generation, 2, "past every generation the tombstone lists");
        assert_eq!(s.counters["a"].layout.generation, 2);
        // Once the cleanup is done, a later namesake starts at 0 again.
        s.apply(&counter("a", MetaCommand::Delete, 6));
        s.apply(&Request::ClearTombstone { name: name("a") });
        s.apply(&counter("a", MetaCommand::Ensure, 7));
        assert_eq!(s.counters["a"].layout.generation, 0);
    }

    fn proposal(proposer: u128, seq: u64, request: Request) -> Request {
        Request::Proposal { id: ProposalId { proposer, seq }, request: Box::new(request) }
    }

    /// Fixed defect: `MetaRaft::write` resends a request whose first attempt may
    /// still commit. A resent `Delete` answered `Missing` (its caller answered 404
    /// and skipped the deletion's cleanup), and a resent `ClearTombstone` cleared
    /// the tombstone of a later deletion of the same name, whose data was then
    /// never deleted.
    #[test]
    fn a_resent_proposal_is_applied_once_and_answered_as_the_first_time() {
        let mut s = MetaState::default();
        s.apply(&counter("a", MetaCommand::Ensure, 1));
        // The bare request, as resent before: the second answer differs.
        let mut bare = s.clone();
        let first = bare.apply(&counter("a", MetaCommand::Delete, 2)).0;
        assert_eq!(
            bare.apply(&counter("a", MetaCommand::Delete, 2)).0,
            Response::Counter(Ok((None, Effect::Missing)))
        );
        // Under one identity: the same answer, applied once.
        let delete = proposal(7, 1, counter("a", MetaCommand::Delete, 2));
        assert_eq!(s.apply(&delete).0, first);
        let before = s.clone();
        let (again, touched, changes) = s.apply(&delete);
        assert_eq!(again, first);
        assert!(touched.is_empty() && changes.is_empty());
        assert_eq!(s.counters, before.counters);
        assert_eq!(s.tombstones, before.tombstones);

        // A clear resent after the counter was created and deleted again leaves the
        // later tombstone.
        let clear = proposal(7, 2, Request::ClearTombstone { name: name("a") });
        assert_eq!(s.apply(&clear).0, Response::TombstoneCleared { existed: true });
        s.apply(&proposal(9, 1, counter("a", MetaCommand::Ensure, 3)));
        s.apply(&proposal(9, 2, counter("a", MetaCommand::Delete, 4)));
        assert_eq!(s.apply(&clear).0, Response::TombstoneCleared { existed: true });
        assert!(s.tombstones.contains_key("a"), "the later deletion's tombstone stays");
        assert_eq!(s.applied_requests, 7, "every copy counts as one request");
    }

    #[test]
    fn the_proposal_book_is_bounded_and_says_when_it_forgot() {
        let mut s = MetaState::default();
        let ensure = |seq: u64| proposal(1, seq, counter(&format!("c{seq}"), MetaCommand::Ensure, seq));
        for seq in 1..=(PROPOSALS_REMEMBERED_MAX as u64 + 10) {
            s.apply(&ensure(seq));
        }
        assert_eq!(s.proposals[&1].answered.len(), PROPOSALS_REMEMBERED_MAX);
        let counters = s.counters.len();
        assert_eq!(s.apply(&ensure(3)).0, Response::Forgotten);
        assert_eq!(s.counters.len(), counters, "a forgotten proposal is not applied");
        let last = PROPOSALS_REMEMBERED_MAX as u64 + 10;
        assert!(matches!(s.apply(&ensure(last)).0, Response::Counter(Ok(_))));
        // Proposers: the quietest is forgotten first.
        for proposer in 2..=(PROPOSERS_REMEMBERED_MAX as u128 + 1) {
            s.apply(&proposal(proposer, 1, counter("x", MetaCommand::Ensure, 1)));
        }
        assert_eq!(s.proposals.len(), PROPOSERS_REMEMBERED_MAX);
        assert!(!s.proposals.contains_key(&1), "the quietest proposer was forgotten");
    }

    #[test]
    fn a_counters_replica_class_is_recorded_with_the_members_of_its_first_creation() {
        let mut s = MetaState::default();
        let own = |r| MetaCommand::Put(SpecPatch { replicas: Some(r), ..Default::default() });
        // Created before any member change: recorded on the configured members.
        let (_, touched, _) = s.apply(&counter("early", own(5), 1));
        assert!(touched.contains(&Touched::Classes), "{touched:?}");
        assert_eq!(s.classes[&5], Vec::<String>::new());
        s.apply(&set(0, &[], &["n1", "n2", "n3"]));
        // A later member change keeps the record; a new class takes the members of
        // its first creation.
        s.apply(&set(1, &[], &["n1", "n2", "n3", "n4"]));
        let (_, touched, _) = s.apply(&counter("a", own(3), 2));
        assert!(touched.contains(&Touched::Classes));
        let (_, touched, _) = s.apply(&counter("b", own(3), 3));
        assert!(!touched.contains(&Touched::Classes), "recorded once");
        s.apply(&counter("plain", MetaCommand::Ensure, 4));
        assert_eq!(s.classes.keys().copied().collect::<Vec<_>>(), vec![3, 5], "the cluster's class is none");
        assert_eq!(s.classes[&3], vec!["n1", "n2", "n3", "n4"]);
        assert!(s.classes[&5].is_empty());
    }

    #[test]
    fn refusals_are_results_and_change_nothing() {
        let mut s = MetaState::default();
        let bad = MetaCommand::Put(SpecPatch { shards: Some(0), ..Default::default() });
        let (r, touched, changes) = s.apply(&counter("a", bad, 1));
        assert!(matches!(r, Response::Counter(Err(Rejection::OutOfRange { .. }))));
        assert!(touched.is_empty() && changes.is_empty());
        let twice = MetaCommand::CompleteReshard { generation: 0, sealed_sum: 5 };
        s.apply(&counter("b", MetaCommand::Put(SpecPatch { shards: Some(2), ..Default::default() }), 1));
        s.apply(&counter("b", MetaCommand::Put(SpecPatch { shards: Some(4), ..Default::default() }), 2));
        assert_eq!(s.pending_reshards(), vec![name("b")]);
        assert!(matches!(s.apply(&counter("b", twice.clone(), 3)).0, Response::Counter(Ok(_))));
        assert!(matches!(
            s.apply(&counter("b", twice, 4)).0,
            Response::Counter(Err(Rejection::StaleGeneration { current: 1, got: 0 }))
        ));
        assert_eq!(s.counters["b"].layout.base, 5);
        assert!(s.pending_reshards().is_empty());
    }

    fn set(from_epoch: u64, previous: &[&str], members: &[&str]) -> Request {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        Request::SetMembers { from_epoch, previous: v(previous), members: v(members) }
    }

    #[test]
    fn a_membership_change_waits_for_every_previous_member_to_hand_off() {
        let mut s = MetaState::default();
        // Epoch 0 takes the proposer's previous members (the shared config).
        let (r, _, _) = s.apply(&set(0, &["n1", "n2"], &["n2", "n1", "n3"]));
        let Response::Members(Ok(v)) = r else { panic!("{r:?}") };
        assert_eq!(
            (v.members.len(), v.placement_epoch, v.handoff.clone()),
            (3, 1, vec!["n1".into(), "n2".into()])
        );
        // No second change while shards move; a stale proposal is refused too.
        assert!(matches!(
            s.apply(&set(1, &[], &["n1"])).0,
            Response::Members(Err(MemberRejection::HandoffUnderWay { .. }))
        ));
        assert!(matches!(
            s.apply(&set(0, &[], &["n1"])).0,
            Response::Members(Err(MemberRejection::StaleEpoch { current: 1, got: 0 }))
        ));
        // A report for another epoch or from a node not handing off changes nothing.
        assert_eq!(s.apply(&Request::HandoffDone { node: "n1".into(), epoch: 0 }).1, vec![]);
        assert_eq!(s.apply(&Request::HandoffDone { node: "n3".into(), epoch: 1 }).1, vec![]);
        s.apply(&Request::HandoffDone { node: "n1".into(), epoch: 1 });
        assert_eq!(s.handoff, vec!["n2".to_string()]);
        s.apply(&Request::HandoffDone { node: "n2".into(), epoch: 1 });
        assert!(s.handoff.is_empty() && s.previous.is_empty());
        // After epoch 0 the state machine's own members are the previous ones.
        s.apply(&set(1, &["ignored"], &["n1", "n3"]));
        assert_eq!((s.previous.clone(), s.placement_epoch), (vec!["n1".into(), "n2".into(), "n3".into()], 2));
        // Not while a counter is being resharded.
        let mut r = MetaState::default();
        let put = |shards| MetaCommand::Put(SpecPatch { shards: Some(shards), ..Default::default() });
        r.apply(&counter("c", put(2), 1));
        r.apply(&counter("c", put(4), 2));
        assert!(matches!(
            r.apply(&set(0, &["a"], &["a", "b"])).0,
            Response::Members(Err(MemberRejection::ReshardingUnderWay { count: 1 }))
        ));
        r.apply(&counter("c", MetaCommand::CompleteReshard { generation: 0, sealed_sum: 0 }, 3));
        assert!(matches!(r.apply(&set(0, &["a"], &["a", "b"])).0, Response::Members(Ok(_))));
        // Retried or empty proposals.
        let mut t = MetaState::default();
        assert!(matches!(t.apply(&set(0, &["a"], &["a"])).0, Response::Members(Ok(ref v)) if !v.changed));
        assert!(matches!(
            t.apply(&set(0, &["a"], &[])).0,
            Response::Members(Err(MemberRejection::NoMembers))
        ));
        assert!(matches!(
            t.apply(&set(0, &[], &["no spaces"])).0,
            Response::Members(Err(MemberRejection::InvalidNode { .. }))
        ));
    }

    #[test]
    fn a_store_is_registered_once_replaced_explicitly_and_its_loss_accepted_once() {
        use crate::store_id::StoreId;
        let (old, new) = (StoreId(1), StoreId(2));
        let mut s = MetaState::default();
        let (r, touched, changes) = s.apply(&Request::RegisterStore { node: 3, store: old });
        assert_eq!(r, Response::Store(Ok(StoreRecord { store: old, data_lost: false })));
        assert_eq!((touched, changes), (vec![Touched::Stores], vec![MetaChange::Store(3)]));
        // A retry changes nothing; another disk under the same id is refused.
        assert_eq!(s.apply(&Request::RegisterStore { node: 3, store: old }).1, vec![]);
        assert_eq!(
            s.apply(&Request::RegisterStore { node: 3, store: new }).0,
            Response::Store(Err(StoreRejection::Replaced { node: 3, recorded: old, got: new }))
        );
        // Only a replacement records the new disk, and with its loss.
        let lost = StoreRecord { store: new, data_lost: true };
        assert_eq!(s.apply(&Request::ReplaceStore { node: 3, store: new }).0, Response::Store(Ok(lost)));
        assert_eq!(s.apply(&Request::ReplaceStore { node: 3, store: new }).1, vec![]);
        assert_eq!(s.apply(&Request::RegisterStore { node: 3, store: new }).0, Response::Store(Ok(lost)));
        // Accepting the loss of an older incarnation is refused; of this one, done once.
        assert!(matches!(
            s.apply(&Request::AcceptLoss { node: 3, store: old }).0,
            Response::Store(Err(StoreRejection::Replaced { .. }))
        ));
        assert!(matches!(
            s.apply(&Request::AcceptLoss { node: 9, store: old }).0,
            Response::Store(Err(StoreRejection::Unknown { node: 9 }))
        ));
        let accepted = StoreRecord { store: new, data_lost: false };
        assert_eq!(s.apply(&Request::AcceptLoss { node: 3, store: new }).0, Response::Store(Ok(accepted)));
        assert_eq!(s.apply(&Request::AcceptLoss { node: 3, store: new }).1, vec![]);
        assert_eq!(s.stores[&3], accepted);
    }

    #[test]
    fn auto_bounds_are_set_with_a_command_kept_until_fixed_or_deleted_and_guard_auto_reshards() {
        let bounds = AutoShards { min_shards: 1, max_shards: 8 };
        let put = |shards| MetaCommand::Put(SpecPatch { shards: Some(shards), ..Default::default() });
        let auto = |cmd, auto| Request::CounterAuto { name: name("a"), cmd, auto, now_ms: 1 };
        let reshard = |version, shards| Request::AutoReshard { name: name("a"), version, shards, now_ms: 2 };
        let mut s = MetaState::default();
        // A stale or non-auto proposal is refused and changes nothing.
        let (r, touched, _) = s.apply(&reshard(0, 2));
        assert_eq!(r, Response::Counter(Err(Rejection::AutoStale { version: 0, found: None })));
        assert!(touched.is_empty());
        let (_, touched, changes) = s.apply(&auto(put(1), Some(bounds)));
        assert_eq!(touched, vec![Touched::Counter(name("a")), Touched::Auto(name("a"))]);
        assert_eq!(changes, vec![MetaChange::Counter(name("a"))]);
        assert_eq!(s.auto.get("a"), Some(&bounds));
        let version = s.counters["a"].version;
        // Other commands leave the bounds; a proposal from the current version reshards.
        s.apply(&counter("a", MetaCommand::Ensure, 3));
        let (r, _, _) = s.apply(&reshard(version, 4));
        assert!(
            matches!(r, Response::Counter(Ok((Some(ref m), _))) if m.layout.resharding == Some(4)),
            "{r:?}"
        );
        assert_eq!(
            s.apply(&reshard(version, 8)).0,
            Response::Counter(Err(Rejection::AutoStale { version, found: Some(version + 1) }))
        );
        // New bounds alone are a change of their own.
        let wider = AutoShards { min_shards: 1, max_shards: 64 };
        let (_, touched, changes) = s.apply(&auto(MetaCommand::Ensure, Some(wider)));
        assert_eq!((touched, changes.len()), (vec![Touched::Auto(name("a"))], 1));
        // Fixed again: the bounds go, and a proposal is refused.
        s.apply(&counter("a", MetaCommand::CompleteReshard { generation: 0, sealed_sum: 0 }, 4));
        s.apply(&auto(put(2), None));
        assert!(s.auto.is_empty());
        let v = s.counters["a"].version;
        assert!(matches!(
            s.apply(&reshard(v, 4)).0,
            Response::Counter(Err(Rejection::AutoStale { found: None, .. }))
        ));
        // A deleted counter loses them.
        s.apply(&auto(MetaCommand::Ensure, Some(bounds)));
        let (_, touched, _) = s.apply(&counter("a", MetaCommand::Delete, 5));
        assert!(touched.contains(&Touched::Auto(name("a"))) && s.auto.is_empty(), "{touched:?}");
    }

    fn any_request() -> impl Strategy<Value = Request> {
        let names = prop::sample::select(vec!["a", "b", "c"]);
        let nodes = prop::sample::select(vec!["n1", "n2", "n3", ""]);
        prop_oneof![
            (names.clone(), 1u16..5, 0u64..1_000_000).prop_map(|(n, shards, t)| counter(
                n,
                MetaCommand::Put(SpecPatch { shards: Some(shards), ..Default::default() }),
                t
            )),
            (names.clone(), 0u64..1_000_000).prop_map(|(n, t)| counter(n, MetaCommand::Ensure, t)),
            (names.clone(), 0u32..3, -5i128..5, 0u64..1_000_000).prop_map(
                |(n, generation, sealed_sum, t)| {
                    counter(n, MetaCommand::CompleteReshard { generation, sealed_sum }, t)
                }
            ),
            (names.clone(), 0u64..1_000_000).prop_map(|(n, t)| counter(n, MetaCommand::Delete, t)),
            names.clone().prop_map(|n| Request::ClearTombstone { name: name(n) }),
            (0u64..3, nodes.clone(), nodes.clone()).prop_map(|(e, a, b)| set(e, &[a], &[a, b])),
            (nodes, 0u64..3).prop_map(|(n, epoch)| Request::HandoffDone { node: n.into(), epoch }),
            (1u64..4, 0u128..3)
                .prop_map(|(node, s)| Request::RegisterStore { node, store: crate::store_id::StoreId(s) }),
            (1u64..4, 0u128..3)
                .prop_map(|(node, s)| Request::ReplaceStore { node, store: crate::store_id::StoreId(s) }),
            (1u64..4, 0u128..3)
                .prop_map(|(node, s)| Request::AcceptLoss { node, store: crate::store_id::StoreId(s) }),
            (names.clone(), 1u16..5, prop::option::of((1u16..4, 4u16..9)), 0u64..1_000_000).prop_map(
                |(n, shards, auto, now_ms)| Request::CounterAuto {
                    name: name(n),
                    cmd: MetaCommand::Put(SpecPatch { shards: Some(shards), ..Default::default() }),
                    auto: auto.map(|(min_shards, max_shards)| AutoShards { min_shards, max_shards }),
                    now_ms,
                }
            ),
            (names.clone(), 0u64..6, 1u16..9, 0u64..1_000_000).prop_map(|(n, version, shards, now_ms)| {
                Request::AutoReshard { name: name(n), version, shards, now_ms }
            }),
            (names.clone(), 0u64..1_000_000, 0u64..1_000_000).prop_map(|(n, at_ms, t)| counter(
                n,
                MetaCommand::Expire { at_ms, when: tally_core::expiry::Condition::Always },
                t
            )),
            (names.clone(), 0u64..1_000_000).prop_map(|(n, t)| counter(n, MetaCommand::Persist, t)),
            (names, 0u64..1_000_000).prop_map(|(n, t)| counter(n, MetaCommand::DeleteExpired, t)),
        ]
    }

    #[test]
    fn expiring_counters_are_indexed_by_deadline_and_reclaimed_once_due() {
        let mut s = MetaState::default();
        let expire = |at_ms| MetaCommand::Expire { at_ms, when: tally_core::expiry::Condition::Always };
        for (n, at) in [("a", 5_000), ("b", 3_000), ("c", 9_000)] {
            s.apply(&counter(n, MetaCommand::Ensure, 1));
            s.apply(&counter(n, expire(at), 1));
        }
        s.apply(&counter("c", MetaCommand::Persist, 2));
        assert_eq!(s.expired(4_999, 10), vec![name("b")]);
        assert_eq!(s.expired(5_000, 10), vec![name("b"), name("a")]);
        assert_eq!(s.expired(5_000, 1), vec![name("b")], "at most the limit");
        let (r, _, _) = s.apply(&counter("b", MetaCommand::DeleteExpired, 4_000));
        assert_eq!(r, Response::Counter(Ok((None, Effect::Deleted(vec![(0, 8)])))));
        assert_eq!(s.expired(5_000, 10), vec![name("a")]);
        assert!(s.tombstones.contains_key("b"), "its data goes as a deleted counter's does");
    }

    proptest! {
        /// Replicas that apply the same log agree, and the state survives the
        /// snapshot encoding unchanged.
        #[test]
        fn replicas_agree_and_snapshots_round_trip(reqs in prop::collection::vec(any_request(), 0..60)) {
            let (mut a, mut b) = (MetaState::default(), MetaState::default());
            for r in &reqs {
                prop_assert_eq!(a.apply(r), b.apply(r));
            }
            prop_assert_eq!(&a, &b);
            let bytes = tally_core::codec::encode(&a);
            let mut back = tally_core::codec::decode::<MetaState>("state", &bytes).unwrap();
            back.reindex();
            prop_assert_eq!(back, a);
        }
    }
}
