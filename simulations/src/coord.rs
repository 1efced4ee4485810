//! The control plane: drives reshardings and membership changes one at a time.
//!
//! A resharding proposes the new shard count (`MetaCommand::Put`), seals every shard
//! of the current generation (each owner flushes and reports its final image), merges
//! the sealed sketches into the next generation's first shard, and opens the next
//! generation (`MetaCommand::CompleteReshard`) — the engine's `reshard.rs`, as
//! messages. A membership change logs the new membership as pending, moves every
//! shard whose owner changes (`tally_core::ring::moved`: export image and dedup records
//! from the old owner, import and flush at the new one) and then completes. Every step
//! is resent until answered and every handler is idempotent.
//!
//! The control plane itself does not crash (it stands for a task on the metadata
//! leader, whose failover shows as metadata unavailability).

use crate::config::{COORD_RESEND_MS, NODES_MIN};
use crate::metalog::LogError;
use crate::msg::{Addr, Msg};
use crate::sim::Sim;
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use tally_core::dedup::DedupRecord;
use tally_core::meta::{MetaCommand, MetaEffect};
use tally_core::reshard_machine::{ReshardEffect, ReshardInput, ReshardMachine};
use tally_core::spec::SpecPatch;
use tally_core::{CounterName, ShardId};
use tally_store::ShardImage;

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
    Membership {
        epoch: u64,
        moves: Vec<(ShardId, u8, u8)>,
        exported: BTreeMap<ShardId, (ShardImage, Vec<(String, DedupRecord)>)>,
        imported: BTreeSet<ShardId>,
        sent: BTreeMap<ShardId, u64>,
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
                        ReshardEffect::MergeSketch { shard, sketch, frequency } => {
                            if merge_sent == 0 || due(Some(&merge_sent), now) {
                                let owner = self.meta.owner(&shard);
                                self.send(
                                    Addr::Control,
                                    Addr::Node(owner),
                                    Msg::MergeSketch { shard, sketch, frequency },
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
            Some(Active::Membership { epoch, moves, exported, imported, sent }) => {
                for (shard, from, to) in &moves {
                    if imported.contains(shard) || !due(sent.get(shard), now) {
                        continue;
                    }
                    match exported.get(shard) {
                        None => self.send(
                            Addr::Control,
                            Addr::Node(*from),
                            Msg::Export { shard: shard.clone(), epoch },
                        ),
                        Some((image, dedup)) => {
                            let msg = Msg::Import {
                                shard: shard.clone(),
                                epoch,
                                image: image.clone(),
                                dedup: dedup.clone(),
                            };
                            self.send(Addr::Control, Addr::Node(*to), msg);
                        }
                    }
                    if let Some(Active::Membership { sent, .. }) = &mut self.coord.active {
                        sent.insert(shard.clone(), now);
                    }
                }
                if imported.len() == moves.len() && self.meta.complete_membership(now).is_ok() {
                    self.coord.active = None;
                    self.coord.completed += 1;
                }
            }
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
            Transition::Membership { members } => {
                let before = self.meta.membership.ring.clone();
                match self.meta.begin_membership(members, now) {
                    Err(LogError::Unavailable { .. }) => return,
                    Ok(()) => {
                        let (_, after) = self.meta.membership.pending.clone().expect("just begun");
                        let shards = self.meta.all_shards();
                        let moves = tally_core::ring::moved(&before, &after, &shards)
                            .into_iter()
                            .map(|(s, f, t)| {
                                (s, crate::metalog::node_index(&f), crate::metalog::node_index(&t))
                            })
                            .collect();
                        self.coord.active = Some(Active::Membership {
                            epoch: self.meta.membership.epoch,
                            moves,
                            exported: BTreeMap::new(),
                            imported: BTreeSet::new(),
                            sent: BTreeMap::new(),
                        });
                    }
                    Err(_) => {}
                }
            }
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
            (
                Some(Active::Membership { epoch, exported, sent, .. }),
                Msg::Exported { shard, epoch: e, image, dedup },
            ) if e == *epoch && !exported.contains_key(&shard) => {
                exported.insert(shard.clone(), (image, dedup));
                // Import at the next tick.
                sent.remove(&shard);
            }
            (Some(Active::Membership { epoch, imported, .. }), Msg::Imported { shard, epoch: e })
                if e == *epoch =>
            {
                imported.insert(shard);
            }
            _ => {}
        }
    }
}
