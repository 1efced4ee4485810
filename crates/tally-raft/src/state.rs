//! The replicated state itself, as plain data with a pure transition function.
//!
//! `MetaState::apply` never reads a clock, a random number or the environment: it
//! is a function of the state and the [`Request`], so every replica that applies the
//! same log ends in the same state. The sled-backed state machine wraps it with
//! persistence; unit tests drive it directly.

use crate::types::{Effect, MemberRejection, MembersView, MetaChange, Rejection, Request, Response};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tally_core::meta::{apply_command, CounterMeta, MetaEffect};
use tally_core::name::CounterName;
use tally_core::ring::RING_NODES_MAX;

/// Longest accepted data-plane node id, in bytes.
pub const NODE_ID_LEN_MAX: usize = 255;

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
    /// How many [`Request`]s were applied in total. Not used by any transition; it
    /// lets tests prove that no entry is applied twice (across restarts too).
    pub applied_requests: u64,
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
}

impl MetaState {
    /// Applies one request, returning its answer, the items it changed (for
    /// persistence) and the changes to announce.
    pub(crate) fn apply(&mut self, req: &Request) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        self.applied_requests += 1;
        match req {
            Request::Counter { name, cmd, now_ms } => {
                let current = self.counters.get(name).cloned();
                match apply_command(current, cmd, *now_ms) {
                    Err(e) => (Response::Counter(Err(Rejection::from(e))), vec![], vec![]),
                    Ok((next, effect)) => {
                        let mut touched = vec![];
                        if !matches!(effect, MetaEffect::Unchanged | MetaEffect::Missing) {
                            touched.push(Touched::Counter(name.clone()));
                            match &next {
                                Some(meta) => self.counters.insert(name.clone(), meta.clone()),
                                None => self.counters.remove(name),
                            };
                        }
                        if let MetaEffect::Deleted(generations) = &effect {
                            let tomb = self.tombstones.entry(name.clone()).or_default();
                            tomb.extend(generations.iter().copied());
                            tomb.sort_unstable();
                            tomb.dedup();
                            touched.push(Touched::Tombstone(name.clone()));
                        }
                        let changes =
                            if touched.is_empty() { vec![] } else { vec![MetaChange::Counter(name.clone())] };
                        (Response::Counter(Ok((next, Effect::from(effect)))), touched, changes)
                    }
                }
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
            Request::AddMember { node } => {
                if let Err(e) = tally_core::name::check_token("node id", node, NODE_ID_LEN_MAX) {
                    let reason = e.to_string();
                    return (Response::Members(Err(MemberRejection::InvalidNode { reason })), vec![], vec![]);
                }
                match self.members.binary_search(node) {
                    Ok(_) => (Response::Members(Ok(self.view(false))), vec![], vec![]),
                    Err(_) if self.members.len() >= RING_NODES_MAX => {
                        let e = MemberRejection::TooManyMembers {
                            count: self.members.len(),
                            max: RING_NODES_MAX,
                        };
                        (Response::Members(Err(e)), vec![], vec![])
                    }
                    Err(at) => {
                        self.members.insert(at, node.clone());
                        self.members_changed()
                    }
                }
            }
            Request::RemoveMember { node } => match self.members.binary_search(node) {
                Ok(at) => {
                    self.members.remove(at);
                    self.members_changed()
                }
                Err(_) => (Response::Members(Ok(self.view(false))), vec![], vec![]),
            },
        }
    }

    fn view(&self, changed: bool) -> MembersView {
        MembersView { members: self.members.clone(), placement_epoch: self.placement_epoch, changed }
    }

    fn members_changed(&mut self) -> (Response, Vec<Touched>, Vec<MetaChange>) {
        self.placement_epoch += 1;
        let change =
            MetaChange::Members { members: self.members.clone(), placement_epoch: self.placement_epoch };
        (Response::Members(Ok(self.view(true))), vec![Touched::Members], vec![change])
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

    #[test]
    fn membership_changes_bump_the_epoch_once() {
        let mut s = MetaState::default();
        s.apply(&Request::AddMember { node: "node2".into() });
        s.apply(&Request::AddMember { node: "node1".into() });
        let (r, _, _) = s.apply(&Request::AddMember { node: "node1".into() });
        let view =
            MembersView { members: vec!["node1".into(), "node2".into()], placement_epoch: 2, changed: false };
        assert_eq!(r, Response::Members(Ok(view)));
        s.apply(&Request::RemoveMember { node: "node2".into() });
        s.apply(&Request::RemoveMember { node: "node2".into() });
        assert_eq!((s.members.clone(), s.placement_epoch), (vec!["node1".to_string()], 3));
        let (r, _, _) = s.apply(&Request::AddMember { node: "no spaces".into() });
        assert!(matches!(r, Response::Members(Err(MemberRejection::InvalidNode { .. }))));
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
            names.prop_map(|n| Request::ClearTombstone { name: name(n) }),
            nodes.clone().prop_map(|n| Request::AddMember { node: n.into() }),
            nodes.prop_map(|n| Request::RemoveMember { node: n.into() }),
        ]
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
            prop_assert_eq!(tally_core::codec::decode::<MetaState>("state", &bytes).unwrap(), a);
        }
    }
}
