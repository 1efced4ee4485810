//! The control plane: drives reshardings and membership changes one at a time.
//!
//! A resharding proposes the new shard count (`MetaCommand::Put`), seals every shard
//! of the current generation (each owner flushes and reports its final image), merges
//! the sealed sketches into the next generation's first shard, and opens the next
//! generation (`MetaCommand::CompleteReshard`) — the engine's `reshard.rs`, as
//! messages. A membership change is only proposed here, as `tally-cluster` proposes
//! it to the metadata group: the new members own their shards at once, the nodes move
//! the shards themselves with `tally_core::handoff_machine` (the new owner adopts by
//! pulling from the previous one, each previous member hands off what it no longer
//! owns and reports when nothing is left), and the change is over once every
//! previous member has reported. Every step is resent until answered and every
//! handler is idempotent.
//!
//! The control plane itself does not crash (it stands for a task on the metadata
//! leader, whose failover shows as metadata unavailability).

use crate::config::{COORD_RESEND_MS, NODES_MIN};
use crate::history::Disturbance;
use crate::metalog::LogError;
use crate::msg::{Addr, Msg};
use crate::sim::Sim;
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use tally_core::meta::{MetaCommand, MetaEffect};
use tally_core::reshard_machine::{ReshardEffect, ReshardInput, ReshardMachine};
use tally_core::spec::SpecPatch;
use tally_core::CounterName;

/// A requested change.
#[derive(Debug, Clone)]
pub(crate) enum Transition {
    /// Change a counter's shard count.
    Reshard { counter: CounterName, target: u16 },
    /// Change the membership to this set.
    Membership { members: BTreeSet<u8> },
}

/// The change in progress.
#[derive(Debug, Clone)]
pub(crate) enum Active {
    Reshard {
        counter: CounterName,
        /// The engine's reshard machine: what is sealed, what is outstanding.
        machine: ReshardMachine,
        /// When each shard's seal was last sent.
        sent: BTreeMap<u16, u64>,
        /// When the merge was last sent (0: never).
        merge_sent: u64,
    },
    /// A membership change, over once no previous member holds anything.
    Membership {
        /// When it began.
        since: u64,
    },
}

/// The control plane's state.
#[derive(Debug, Clone, Default)]
pub(crate) struct Coordinator {
    pub(crate) queue: VecDeque<Transition>,
    pub(crate) active: Option<Active>,
    /// Transitions completed, for the summary.
    pub(crate) completed: u64,
}

impl Coordinator {
    /// Nothing requested, nothing in progress.
    pub(crate) fn idle(&self) -> bool {
        self.queue.is_empty() && self.active.is_none()
    }
}

fn due(sent: Option<&u64>, now: u64) -> bool {
    sent.is_none_or(|&t| t + COORD_RESEND_MS <= now)
}

impl Sim {
    /// The workload asks for a resharding of a random counter or a membership change.
    pub(crate) fn request_transition(&mut self) {
        let nodes = self.cfg.nodes;
        if self.rng.random_range(0..10) < 6 || nodes <= NODES_MIN {
            let names: Vec<CounterName> =
                self.meta.counters.keys().filter(|c| !c.as_str().starts_with("big")).cloned().collect();
            let counter = names[self.rng.random_range(0..names.len())].clone();
            let target = self.rng.random_range(1..=8u16);
            self.coord.queue.push_back(Transition::Reshard { counter, target });
        } else {
            let mut members = self.meta.membership.members.clone();
            let outside: Vec<u8> = (0..nodes).filter(|n| !members.contains(n)).collect();
            if !outside.is_empty() && (members.len() <= usize::from(NODES_MIN) || self.rng.random::<bool>()) {
                members.insert(outside[self.rng.random_range(0..outside.len())]);
            } else {
                let inside: Vec<u8> = members.iter().copied().collect();
                members.remove(&inside[self.rng.random_range(0..inside.len())]);
            }
            self.coord.queue.push_back(Transition::Membership { members });
        }
    }

    pub(crate) fn coord_tick(&mut self) {
        if self.coord.active.is_none() {
            self.start_transition();
        }
        let now = self.now;
        match self.coord.active.clone() {
            None => {}
            Some(Active::Reshard { counter, mut machine, sent, merge_sent }) => {
                let outstanding = machine.step(ReshardInput::Outstanding).expect("stored sketches decode");
                for effect in outstanding {
                    match effect {
                        ReshardEffect::Seal(shard) => {
                            if due(sent.get(&shard.index), now) {
                                let owner = self.meta.owner(&shard);
                                let index = shard.index;
                                self.send(Addr::Control, Addr::Node(owner), Msg::Seal { shard });
                                if let Some(Active::Reshard { sent, .. }) = &mut self.coord.active {
                                    sent.insert(index, now);
                                }
                            }
                        }
                        ReshardEffect::MergeSketch { shard, sketch, frequency, windows } => {
                            if merge_sent == 0 || due(Some(&merge_sent), now) {
                                let owner = self.meta.owner(&shard);
                                self.send(
                                    Addr::Control,
                                    Addr::Node(owner),
                                    Msg::MergeSketch { shard, sketch, frequency, windows },
                                );
                                if let Some(Active::Reshard { merge_sent, .. }) = &mut self.coord.active {
                                    *merge_sent = now;
                                }
                            }
                        }
                        ReshardEffect::Complete { generation, sealed_sum } => {
                            let cmd = MetaCommand::CompleteReshard { generation, sealed_sum };
                            match self.meta.counter(&counter, &cmd, now) {
                                Err(LogError::Unavailable { .. }) => {}
                                Ok(_) | Err(_) => {
                                    self.coord.active = None;
                                    self.coord.completed += 1;
                                }
                            }
                        }
                    }
                }
            }
            Some(Active::Membership { since }) if self.meta.membership.previous.is_none() => {
                // A shard not yet adopted answers no read (the engine's read waits for
                // the adoption): the hand-off disturbs the cached totals.
                self.history.unanswered_calls.push(Disturbance { from_ms: since, to_ms: now });
                self.coord.active = None;
                self.coord.completed += 1;
            }
            Some(Active::Membership { .. }) => {}
        }
    }

    fn start_transition(&mut self) {
        let Some(next) = self.coord.queue.front().cloned() else { return };
        let now = self.now;
        match next {
            Transition::Reshard { counter, target } => {
                let patch = SpecPatch { shards: Some(target), ..SpecPatch::default() };
                match self.meta.counter(&counter, &MetaCommand::Put(patch), now) {
                    Err(LogError::Unavailable { .. }) => return,
                    Ok(MetaEffect::Updated) => {
                        let layout = &self.meta.counters[&counter].layout;
                        if let Some(machine) = ReshardMachine::new(counter.clone(), layout) {
                            let sent = BTreeMap::new();
                            self.coord.active =
                                Some(Active::Reshard { counter, machine, sent, merge_sent: 0 });
                        }
                    }
                    Ok(_) | Err(_) => {}
                }
            }
            Transition::Membership { members } => match self.meta.begin_membership(members, now) {
                Err(LogError::Unavailable { .. }) => return,
                Ok(_) => {
                    self.coord.active = Some(Active::Membership { since: now });
                    // Every previous member hands off until it reports nothing left.
                    let previous: Vec<u8> = self.meta.membership.handoff.iter().copied().collect();
                    for n in previous {
                        self.timer(n, crate::config::HANDOFF_TICK_MS, crate::sim::NodeTimer::HandOff);
                    }
                }
                Err(_) => {}
            },
        }
        self.coord.queue.pop_front();
    }

    pub(crate) fn coord_deliver(&mut self, _from: Addr, msg: Msg) {
        // Answers that belong to an earlier step or change are ignored.
        match (&mut self.coord.active, msg) {
            (Some(Active::Reshard { counter, machine, .. }), Msg::Sealed { shard, image })
                if shard.counter == *counter && shard.generation == machine.generation() =>
            {
                // What it makes due is sent by the next tick, with its resend timer.
                machine
                    .step(ReshardInput::Sealed { index: shard.index, image })
                    .expect("stored sketches decode");
            }
            (Some(Active::Reshard { counter, machine, .. }), Msg::Merged { shard })
                if shard.counter == *counter && shard.generation == machine.generation() + 1 =>
            {
                machine.step(ReshardInput::Merged).expect("stored sketches decode");
            }
            _ => {}
        }
    }
}
