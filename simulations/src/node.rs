//! A node's shells, as state machines driven by the simulator: the gateway (routing
//! every client request with `tally_core::router`), the shard shells (batching
//! submissions, deciding with `tally_core::shard::decide`, committing to the node's
//! `MemStore`, group-committing flushes and answering `sync` increments only after
//! the flush), the aggregator (accumulators drained every `flush_ms`, remote drains
//! resent under their drain id until answered), the rollup (refreshed by
//! `tally_core::rollup::refresh_due`), the reconciler (idempotent correction ids) and
//! the control-plane handlers (seal, merge sketch), and the membership hand-off: the
//! new owner's adoption, the previous owner's answers to its pulls and its hand-off
//! passes, each carrying out `tally_core::handoff_machine`'s effects as the engine's
//! `handoff.rs` does, over simulated messages.
//!
//! Volatile state is everything in [`Node`] except `store`: a crash drops it, and the
//! store loses its unflushed suffix ([`MemStore::restart`]). A failed flush poisons
//! the node: it acknowledges nothing more until restarted.

use crate::config::*;
use crate::history::FaultKind;
use crate::msg::{Addr, Answer, Consistency, Msg, ReadValue, ShardAnswer, SubmitCtx};
use crate::sim::{NodeTimer, Phase, Sim};
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use tally_core::dedup::DedupRecord;
use tally_core::drain_book::DrainBook;
use tally_core::frequency::FrequencySketch;
use tally_core::handoff_machine::{
    admit, seal_marker, shard_of_seal_marker, Admission, AdoptEffect, AdoptInput, Adoption, HandOffPass,
    PassEffect, PassInput, PullAnswer, PullEffect, PullInput, SEAL_MARKER_PREFIX,
};
use tally_core::limits::bufferable;
use tally_core::meta::CounterMeta;
use tally_core::reconcile::{correction_delta, CorrectionIds};
use tally_core::rollup::refresh_due;
use tally_core::router::{route, shard_of_event, RouteKey};
use tally_core::shard::{Outcome, ShardReply, Submission, COMMIT_SUBMISSIONS_MAX};
use tally_core::shard_machine::{Effect, Input, ShardMachine, ShardParams};
use tally_core::sketch::{member_hash, DistinctSketch};
use tally_core::spec::Durability;
use tally_core::{CounterName, ShardId};
use tally_store::{MemStore, ShardImage, Store};

/// A submission waiting for its shard's next commit.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    sub: Submission,
    ctx: SubmitCtx,
    reply_to: Addr,
}

/// One accumulator slot: buffered, acknowledged increments of one shard.
#[derive(Debug, Clone, Default)]
pub(crate) struct Acc {
    sum: i64,
    increments: u64,
    members: Vec<u64>,
    due_ms: u64,
}

/// A cached total.
#[derive(Debug, Clone)]
pub(crate) struct Cached {
    read: ReadValue,
    rollup_ms: u32,
}

/// One simulated node.
pub(crate) struct Node {
    /// Its index.
    pub(crate) idx: u8,
    /// Its store: survives crashes, minus the unflushed suffix.
    pub(crate) store: MemStore,
    /// Running (not crashed).
    pub(crate) up: bool,
    /// Bumped by every crash; timers of earlier incarnations are void.
    pub(crate) incarnation: u64,
    /// Processes nothing before this time.
    pub(crate) paused_until: u64,
    /// A flush failed: refuses writes until restarted.
    pub(crate) poisoned: bool,
    pending: BTreeMap<ShardId, Vec<Pending>>,
    commit_scheduled: BTreeSet<ShardId>,
    flush_waiters: Vec<(Addr, Msg)>,
    flush_at: Option<u64>,
    acc: BTreeMap<(CounterName, u16), Acc>,
    /// Drained sums not yet answered (the engine's drain book).
    drains: DrainBook,
    /// The event ids of this life's reconciliation runs (the engine's reconciler's).
    corrections: CorrectionIds,
    rollup: BTreeMap<CounterName, Cached>,
    changed: BTreeMap<CounterName, u64>,
    sequence: BTreeMap<CounterName, u64>,
    /// Adoptions in flight, each with the previous owners waiting for its end.
    adoptions: BTreeMap<ShardId, (Adoption<u8>, BTreeSet<u8>)>,
    /// Shards adopted, by membership epoch.
    adopted: BTreeSet<(u64, ShardId)>,
    /// The hand-off pass in flight and when it started.
    pass: Option<(HandOffPass<u8>, u64)>,
}

impl Node {
    pub(crate) fn new(idx: u8) -> Self {
        Self {
            idx,
            store: MemStore::new(),
            up: true,
            incarnation: 0,
            paused_until: 0,
            poisoned: false,
            pending: BTreeMap::new(),
            commit_scheduled: BTreeSet::new(),
            flush_waiters: Vec::new(),
            flush_at: None,
            acc: BTreeMap::new(),
            drains: DrainBook::new(&idx.to_string(), 0),
            corrections: CorrectionIds::new(&idx.to_string(), 0),
            rollup: BTreeMap::new(),
            changed: BTreeMap::new(),
            sequence: BTreeMap::new(),
            adoptions: BTreeMap::new(),
            adopted: BTreeSet::new(),
            pass: None,
        }
    }

    /// Drops every piece of volatile state, as a crash does.
    fn forget(&mut self) {
        let (idx, store, incarnation) = (self.idx, self.store.clone(), self.incarnation);
        *self = Node::new(idx);
        self.store = store;
        self.incarnation = incarnation;
        self.drains = DrainBook::new(&idx.to_string(), incarnation);
        self.corrections = CorrectionIds::new(&idx.to_string(), incarnation);
    }
}

fn image_sketch(image: &ShardImage, meta: &CounterMeta) -> Option<DistinctSketch> {
    match (&image.sketch, meta.spec.distinct) {
        // A sketch that fails its checksum is a simulator bug: fail loudly.
        (Some(b), _) => Some(DistinctSketch::from_bytes(b).expect("stored sketches decode")),
        (None, true) => Some(DistinctSketch::new()),
        (None, false) => None,
    }
}

/// A shard machine's answer, as the simulated wire carries it.
fn answer_of(reply: ShardReply) -> ShardAnswer {
    match reply {
        ShardReply::Done { outcome, .. } => ShardAnswer::Done(outcome),
        ShardReply::Sealed => ShardAnswer::Sealed,
    }
}

impl Sim {
    fn node(&mut self, n: u8) -> &mut Node {
        &mut self.nodes[usize::from(n)]
    }

    pub(crate) fn start_node_timers(&mut self, n: u8) {
        self.timer(n, AGGREGATOR_TICK_MS, NodeTimer::Aggregator);
        self.timer(n, ROLLUP_TICK_MS, NodeTimer::Rollup);
        self.timer(n, HANDOFF_TICK_MS, NodeTimer::HandOff);
    }

    /// Crashes node `n`: volatile state gone, a random part of the unflushed writes lost.
    pub(crate) fn crash(&mut self, n: u8) {
        let unflushed = self.node(n).store.unflushed_ops();
        let keep = self.rng.random_range(0..=unflushed);
        let node = self.node(n);
        node.store = node.store.restart(keep);
        node.incarnation += 1;
        node.forget();
        node.up = false;
        node.poisoned = false;
        node.paused_until = 0;
        self.count(FaultKind::Crash);
        self.history.crashes.push((self.now, n));
        self.disturb(n);
    }

    /// Starts node `n` again on its store.
    pub(crate) fn restart(&mut self, n: u8) {
        let node = self.node(n);
        node.up = true;
        node.poisoned = false;
        self.count(FaultKind::Restart);
        self.start_node_timers(n);
        self.undisturb(n);
    }

    fn poison(&mut self, n: u8) {
        let node = self.node(n);
        node.poisoned = true;
        node.flush_waiters.clear();
        self.count(FaultKind::FsyncFailure);
        self.disturb(n);
        self.timer(n, POISON_RESTART_MS, NodeTimer::PoisonRestart);
    }

    pub(crate) fn node_deliver(&mut self, n: u8, from: Addr, msg: Msg) {
        match msg {
            Msg::Incr { client, op, attempt, counter, delta, event_id, member } => {
                self.gateway_incr(n, client, op, attempt, counter, delta, event_id, member)
            }
            Msg::Read { client, op, counter, consistency } => {
                let read = self.gateway_read(n, &counter, consistency);
                self.send(Addr::Node(n), Addr::Client(client), Msg::ReadReply { op, read });
            }
            Msg::Distinct { client, op, counter } => {
                let estimate = self.distinct_read(n, &counter);
                self.send(Addr::Node(n), Addr::Client(client), Msg::DistinctReply { op, estimate });
            }
            Msg::Reconcile { client, op, counter, authoritative } => {
                self.gateway_reconcile(n, client, op, counter, authoritative)
            }
            Msg::Submit { shard, sub, ctx } => self.owner_submit(n, shard, sub, ctx, from),
            Msg::SubmitReply { shard, sub, ctx, answer } => self.gateway_reply(n, shard, sub, ctx, answer),
            Msg::Seal { shard } => self.owner_seal(n, shard),
            Msg::MergeSketch { shard, sketch, frequency, windows } => {
                self.owner_merge(n, shard, [sketch.as_deref(), frequency.as_deref(), windows.as_deref()])
            }
            Msg::HandOff { shard, epoch, after } => self.answer_pull(n, from, shard, epoch, after),
            Msg::HandedOff { shard, epoch, after, page } => {
                if self.node(n).adoptions.get(&shard).is_some_and(|(a, _)| a.epoch() == epoch) {
                    let owns = self.meta.owner(&shard) == n;
                    self.adopt_step(n, &shard, AdoptInput::Page { after, page, owns });
                }
            }
            Msg::Adopt { shard, epoch } => self.adopt_request(n, from, shard, epoch),
            Msg::Adopted { shard, epoch } => {
                if self.node(n).pass.as_ref().is_some_and(|(p, _)| p.epoch() == epoch) {
                    self.pass_step(n, PassInput::Adopted { shard, ok: true });
                }
            }
            Msg::IncrReply { .. }
            | Msg::ReadReply { .. }
            | Msg::DistinctReply { .. }
            | Msg::ReconcileReply { .. }
            | Msg::Sealed { .. }
            | Msg::Merged { .. } => {}
        }
    }

    pub(crate) fn node_timer(&mut self, n: u8, timer: NodeTimer) {
        match timer {
            NodeTimer::Commit(shard) => self.commit_shard(n, shard),
            NodeTimer::Flush => {
                if self.node(n).flush_at.is_some_and(|t| t <= self.now) {
                    self.flush(n);
                }
            }
            NodeTimer::Aggregator => {
                self.aggregator_tick(n);
                self.timer(n, AGGREGATOR_TICK_MS, NodeTimer::Aggregator);
            }
            NodeTimer::Rollup => {
                self.rollup_tick(n);
                self.timer(n, ROLLUP_TICK_MS, NodeTimer::Rollup);
            }
            NodeTimer::Resubmit { counter, sub, ctx } => self.route_submission(n, &counter, None, sub, ctx),
            NodeTimer::PoisonRestart => {
                if self.node(n).poisoned {
                    self.crash(n);
                    self.restart(n);
                }
            }
            NodeTimer::AdoptResend(shard) => {
                if self.node(n).adoptions.contains_key(&shard) {
                    self.adopt_step(n, &shard, AdoptInput::Resend);
                }
            }
            NodeTimer::HandOff => {
                // The ticks run while this node is a previous member that has not
                // reported (the control plane starts them with the change).
                if self.meta.membership.handoff.contains(&n) {
                    self.handoff_tick(n);
                    self.timer(n, HANDOFF_TICK_MS, NodeTimer::HandOff);
                } else {
                    self.node(n).pass = None;
                }
            }
        }
    }

    // ---------------------------------------------------------------- gateway

    #[allow(clippy::too_many_arguments)]
    fn gateway_incr(
        &mut self,
        n: u8,
        client: u16,
        op: u32,
        attempt: u32,
        counter: CounterName,
        delta: i64,
        event_id: Option<String>,
        member: Option<String>,
    ) {
        let reply = |sim: &mut Sim, answer| {
            sim.send(Addr::Node(n), Addr::Client(client), Msg::IncrReply { op, attempt, answer })
        };
        let Some(meta) = self.meta.counters.get(&counter).cloned() else {
            return reply(self, Answer::Unavailable);
        };
        if self.node(n).poisoned || delta == 0 {
            return reply(self, Answer::Unavailable);
        }
        let member = member.filter(|_| meta.spec.distinct).map(|m| member_hash(&m));
        let writer = format!("w{client}");
        let sequence = {
            let s = self.node(n).sequence.entry(counter.clone()).or_default();
            *s += 1;
            *s
        };
        let key = RouteKey {
            event_id: event_id.as_deref(),
            writer: Some(&writer),
            affinity: u64::from(client),
            sequence,
            random: self.rng.random(),
        };
        let index = route(meta.spec.router, meta.layout.shards, &key);
        let changed = self.node(n).changed.entry(counter.clone()).or_default();
        *changed = changed.saturating_add(delta.unsigned_abs());
        if meta.spec.durability == Durability::Batched && event_id.is_none() && bufferable(delta) {
            // Acknowledged once buffered; the aggregator delivers it within flush_ms.
            let due_ms = self.now + u64::from(meta.spec.flush_ms);
            let acc =
                self.node(n).acc.entry((counter, index)).or_insert_with(|| Acc { due_ms, ..Acc::default() });
            acc.sum += delta;
            acc.increments += 1;
            acc.members.extend(member);
            return reply(self, Answer::Applied);
        }
        let sub = Submission::Single { delta, event_id, member, item: None, seq: None };
        let ctx = SubmitCtx::Client { client, op, attempt, hops: 0 };
        self.route_submission(n, &counter, Some(index), sub, ctx);
    }

    /// Sends a submission to its shard on the counter's current layout. Submissions with
    /// an event or drain id route by it; others keep `index` (taken modulo the layout).
    fn route_submission(
        &mut self,
        n: u8,
        counter: &CounterName,
        index: Option<u16>,
        sub: Submission,
        ctx: SubmitCtx,
    ) {
        let Some(meta) = self.meta.counters.get(counter) else { return };
        let shards = meta.layout.shards;
        let index = match (sub.record_id(), index, &ctx) {
            (Some(id), _, _) => shard_of_event(id, shards),
            (None, Some(i), _) => i % shards,
            (None, None, SubmitCtx::LocalDrain { index }) => index % shards,
            (None, None, _) => 0,
        };
        let shard = ShardId::new(counter.clone(), meta.layout.generation, index);
        let owner = self.meta.owner(&shard);
        let ctx = match ctx {
            SubmitCtx::LocalDrain { .. } => SubmitCtx::LocalDrain { index },
            other => other,
        };
        self.send(Addr::Node(n), Addr::Node(owner), Msg::Submit { shard, sub, ctx });
    }

    fn gateway_reply(&mut self, n: u8, shard: ShardId, sub: Submission, ctx: SubmitCtx, answer: ShardAnswer) {
        let retry = matches!(answer, ShardAnswer::Sealed | ShardAnswer::Moved);
        match ctx {
            SubmitCtx::Client { client, op, attempt, hops } => {
                let answer = match answer {
                    ShardAnswer::Done(o) => Answer::of(o),
                    _ if hops < GATEWAY_HOPS_MAX => {
                        let ctx = SubmitCtx::Client { client, op, attempt, hops: hops + 1 };
                        let counter = shard.counter.clone();
                        return self.timer(n, RESUBMIT_BACKOFF_MS, NodeTimer::Resubmit { counter, sub, ctx });
                    }
                    _ => Answer::Unavailable,
                };
                self.send(Addr::Node(n), Addr::Client(client), Msg::IncrReply { op, attempt, answer });
            }
            SubmitCtx::RemoteDrain => {
                if !retry {
                    if let Some(id) = sub.record_id() {
                        self.node(n).drains.close(id);
                    }
                }
            }
            SubmitCtx::LocalDrain { index } => {
                if retry {
                    self.give_back(n, &shard.counter, index, sub);
                } else if let Some(id) = sub.record_id() {
                    self.node(n).drains.close(id);
                }
            }
            SubmitCtx::Reconcile { client, op, before, drift, authoritative, hops } => {
                let result = match answer {
                    ShardAnswer::Done(Outcome::Applied | Outcome::Duplicate) => Some((before, drift)),
                    ShardAnswer::Done(_) => None,
                    _ if hops < GATEWAY_HOPS_MAX => {
                        let ctx =
                            SubmitCtx::Reconcile { client, op, before, drift, authoritative, hops: hops + 1 };
                        let counter = shard.counter.clone();
                        return self.timer(n, RESUBMIT_BACKOFF_MS, NodeTimer::Resubmit { counter, sub, ctx });
                    }
                    _ => None,
                };
                self.send(Addr::Node(n), Addr::Client(client), Msg::ReconcileReply { op, result });
            }
        }
    }

    /// Puts a drained sum that was not applied (refused at the door, or never taken)
    /// back into its accumulator; it leaves the drain book, and is drained again
    /// under a new id.
    fn give_back(&mut self, n: u8, counter: &CounterName, index: u16, sub: Submission) {
        if let Some(id) = sub.record_id() {
            self.node(n).drains.close(id);
        }
        let Submission::Buffered { sum, increments, members, .. } = sub else { return };
        let now = self.now;
        let acc = self
            .node(n)
            .acc
            .entry((counter.clone(), index))
            .or_insert_with(|| Acc { due_ms: now, ..Acc::default() });
        acc.sum += sum;
        acc.increments += increments;
        acc.members.extend(members);
    }

    /// Every current shard's committed image, read from its owner as node `n` reaches
    /// it; `None` where the owner cannot answer.
    fn current_images(
        &self,
        n: u8,
        counter: &CounterName,
    ) -> Option<(&CounterMeta, Vec<Option<ShardImage>>)> {
        let meta = self.meta.counters.get(counter)?;
        let images = (0..meta.layout.shards)
            .map(|index| {
                let shard = ShardId::new(counter.clone(), meta.layout.generation, index);
                let owner = self.meta.owner(&shard);
                (self.reachable(n, owner) && self.serves(owner, &shard)).then(|| {
                    self.nodes[usize::from(owner)]
                        .store
                        .load_shard(&shard)
                        .expect("a running node's store is open")
                })
            })
            .collect();
        Some((meta, images))
    }

    /// A fresh read: `base` plus every current shard's committed value, read from its
    /// owner. A shard whose owner cannot answer makes the read incomplete.
    pub(crate) fn fresh_read(&self, n: u8, counter: &CounterName) -> Option<ReadValue> {
        let (meta, images) = self.current_images(n, counter)?;
        let value = meta.layout.base + images.iter().flatten().map(|i| i128::from(i.value)).sum::<i128>();
        let complete = images.iter().all(Option::is_some);
        Some(ReadValue { value, as_of_ms: self.now, staleness_ms: 0, complete })
    }

    fn gateway_read(&mut self, n: u8, counter: &CounterName, consistency: Consistency) -> Option<ReadValue> {
        let meta = self.meta.counters.get(counter)?;
        let rollup_ms = meta.spec.rollup_ms;
        if consistency == Consistency::Fresh || rollup_ms == 0 {
            return self.fresh_read(n, counter);
        }
        if let Some(c) = self.node(n).rollup.get(counter) {
            let mut read = c.read;
            read.staleness_ms = self.now.saturating_sub(read.as_of_ms);
            return Some(read);
        }
        let read = self.fresh_read(n, counter)?;
        if read.complete {
            self.node(n).rollup.insert(counter.clone(), Cached { read, rollup_ms });
            self.node(n).changed.insert(counter.clone(), 0);
        }
        Some(read)
    }

    fn distinct_read(&self, n: u8, counter: &CounterName) -> Option<(u64, bool)> {
        let (meta, images) = self.current_images(n, counter)?;
        let mut merged = DistinctSketch::new();
        for image in images.iter().flatten() {
            if let Some(s) = image_sketch(image, meta) {
                merged.merge(&s);
            }
        }
        Some((merged.estimate(), images.iter().all(Option::is_some)))
    }

    fn gateway_reconcile(&mut self, n: u8, client: u16, op: u32, counter: CounterName, authoritative: i128) {
        let reply = |sim: &mut Sim, result| {
            sim.send(Addr::Node(n), Addr::Client(client), Msg::ReconcileReply { op, result })
        };
        if self.node(n).poisoned {
            return reply(self, None);
        }
        let Some(read) = self.fresh_read(n, &counter).filter(|r| r.complete) else {
            return reply(self, None);
        };
        let before = read.value;
        let drift = authoritative - before;
        if drift == 0 {
            return reply(self, Some((before, 0)));
        }
        let Some(delta) = correction_delta(authoritative, before) else { return reply(self, None) };
        // The run's own id: a resent or duplicated correction is deduplicated like
        // any event id, and a later run is a correction of its own.
        let id = self.node(n).corrections.next_run();
        let ctx = SubmitCtx::Reconcile { client, op, before, drift, authoritative, hops: 0 };
        if bug!(ReconcileTwice) {
            let sub = Submission::Single {
                delta,
                event_id: Some(format!("{id}:again")),
                member: None,
                item: None,
                seq: None,
            };
            self.route_submission(n, &counter, None, sub, ctx.clone());
        }
        let sub = Submission::Single { delta, event_id: Some(id), member: None, item: None, seq: None };
        self.route_submission(n, &counter, None, sub, ctx);
    }

    // ------------------------------------------------------------- aggregator

    fn aggregator_tick(&mut self, n: u8) {
        let now = self.now;
        let due: Vec<(CounterName, u16)> =
            self.node(n).acc.iter().filter(|(_, a)| a.due_ms <= now).map(|(k, _)| k.clone()).collect();
        for key in due {
            let acc = self.node(n).acc.remove(&key).expect("listed just now");
            let (counter, index) = key;
            let Some(meta) = self.meta.counters.get(&counter) else { continue };
            let (shards, generation) = (meta.layout.shards, meta.layout.generation);
            if acc.increments == 0 {
                continue;
            }
            let target = index % shards;
            let shard = ShardId::new(counter.clone(), generation, target);
            let owner = self.meta.owner(&shard);
            // Every drained sum carries an id and stays in the book until answered,
            // as in the engine; a remote one is in doubt at once (its answer may be
            // lost) and resent unchanged until answered.
            let born = meta.created_at_ms;
            let sub = self.node(n).drains.open(
                now,
                (&counter, born),
                target,
                shards,
                (acc.sum, acc.increments, acc.members),
            );
            if owner == n {
                let ctx = SubmitCtx::LocalDrain { index: target };
                self.send(Addr::Node(n), Addr::Node(n), Msg::Submit { shard, sub, ctx });
            } else {
                self.node(n).drains.unanswered(sub.drain_id().expect("drained sums carry ids"), now);
                self.send(
                    Addr::Node(n),
                    Addr::Node(owner),
                    Msg::Submit { shard, sub, ctx: SubmitCtx::RemoteDrain },
                );
            }
        }
        let (resend, lost) = self.node(n).drains.due(now, None);
        assert!(lost.is_empty(), "a simulated drain stayed in doubt past the resend limit");
        for (counter, born, sub) in resend {
            // A sum of a counter since deleted is never resent to its namesake.
            if self.meta.counters.get(&counter).is_some_and(|m| m.created_at_ms == born) {
                self.route_submission(n, &counter, None, sub, SubmitCtx::RemoteDrain);
            } else if let Some(id) = sub.drain_id() {
                self.node(n).drains.close(id);
            }
        }
    }

    // ----------------------------------------------------------------- rollup

    fn rollup_tick(&mut self, n: u8) {
        let names: Vec<CounterName> = self.node(n).rollup.keys().cloned().collect();
        for name in names {
            let c = self.node(n).rollup[&name].clone();
            let changed = self.node(n).changed.get(&name).copied().unwrap_or(0);
            if !refresh_due(self.now, c.read.as_of_ms, c.rollup_ms, c.read.value, changed) {
                continue;
            }
            match self.fresh_read(n, &name) {
                Some(read) if read.complete => {
                    self.node(n).rollup.insert(name.clone(), Cached { read, rollup_ms: c.rollup_ms });
                    self.node(n).changed.insert(name, 0);
                }
                // Unreachable shards: keep serving the last total with its staleness.
                _ => {}
            }
        }
    }

    // ------------------------------------------------------------ shard shells

    fn owner_submit(&mut self, n: u8, shard: ShardId, sub: Submission, ctx: SubmitCtx, reply_to: Addr) {
        let node = self.node(n);
        node.pending.entry(shard.clone()).or_default().push(Pending { sub, ctx, reply_to });
        if node.commit_scheduled.insert(shard.clone()) {
            self.timer(n, COMMIT_DELAY_MS, NodeTimer::Commit(shard));
        }
    }

    fn answer(&mut self, n: u8, shard: &ShardId, p: Pending, answer: ShardAnswer) {
        let msg = Msg::SubmitReply { shard: shard.clone(), sub: p.sub, ctx: p.ctx, answer };
        self.send(Addr::Node(n), p.reply_to, msg);
    }

    /// Why this node may not commit to `shard` now, if it may not.
    fn refusal(&self, n: u8, shard: &ShardId) -> Option<ShardAnswer> {
        let Some(meta) = self.meta.counters.get(&shard.counter) else { return Some(ShardAnswer::Moved) };
        if self.meta.owner(shard) != n || !self.serves(n, shard) {
            return Some(ShardAnswer::Moved);
        }
        // A seal handed off with the shard refuses as the layout does.
        if self.nodes[usize::from(n)].store.meta_get(&seal_marker(shard)).ok().flatten().is_some() {
            return Some(ShardAnswer::Sealed);
        }
        let layout = &meta.layout;
        if shard.generation < layout.generation
            || (shard.generation == layout.generation && layout.resharding.is_some())
        {
            return Some(ShardAnswer::Sealed);
        }
        None
    }

    /// The dedup records of `ids`: this shard's, then its shard's in each sealed
    /// generation (`None` if one of those cannot be asked now).
    fn lookup_prior(
        &self,
        n: u8,
        shard: &ShardId,
        meta: &CounterMeta,
        ids: &[String],
    ) -> Option<BTreeMap<String, DedupRecord>> {
        let mut prior = BTreeMap::new();
        for id in ids {
            let store = &self.nodes[usize::from(n)].store;
            if let Some(r) = store.dedup_get(shard, id).expect("a running node's store is open") {
                prior.insert(id.clone(), r);
                continue;
            }
            if bug!(DedupLostOnReshard) {
                continue;
            }
            for g in meta.layout.sealed.iter().rev() {
                let sid = ShardId::new(shard.counter.clone(), g.generation, shard_of_event(id, g.shards));
                let owner = self.meta.owner(&sid);
                if !self.reachable(n, owner) || !self.serves(owner, &sid) {
                    return None;
                }
                let store = &self.nodes[usize::from(owner)].store;
                if let Some(r) = store.dedup_get(&sid, id).expect("a running node's store is open") {
                    prior.insert(id.clone(), r);
                    break;
                }
            }
        }
        Some(prior)
    }

    /// One commit of `shard`: the engine's shard machine decides the batch, this
    /// shell carries out its effects against the node's store. The shard keeps no
    /// state between commits here (it is read from the store each time), so the
    /// machine lives for one batch.
    fn commit_shard(&mut self, n: u8, shard: ShardId) {
        self.node(n).commit_scheduled.remove(&shard);
        self.ensure_local(n, &shard);
        let Some(mut queue) = self.node(n).pending.remove(&shard) else { return };
        let rest = if queue.len() > COMMIT_SUBMISSIONS_MAX {
            queue.split_off(COMMIT_SUBMISSIONS_MAX)
        } else {
            Vec::new()
        };
        if !rest.is_empty() {
            self.node(n).pending.insert(shard.clone(), rest);
            self.node(n).commit_scheduled.insert(shard.clone());
            self.timer(n, COMMIT_DELAY_MS, NodeTimer::Commit(shard.clone()));
        }
        if let Some(refusal) = self.refusal(n, &shard) {
            for p in queue {
                self.answer(n, &shard, p, refusal);
            }
            return;
        }
        if self.node(n).poisoned {
            // Nothing more is acknowledged; a local drain goes back to its accumulator.
            for p in queue {
                if let SubmitCtx::LocalDrain { index } = p.ctx {
                    self.give_back(n, &shard.counter, index, p.sub);
                }
            }
            return;
        }
        let meta = self.meta.counters[&shard.counter].clone();
        let store = self.nodes[usize::from(n)].store.clone();
        let mut machine = Self::machine(&store, &shard, &meta);
        for p in &queue {
            machine.step(self.now, Input::Submit { sub: p.sub.clone(), reply: p.clone() });
        }
        let mut effects: VecDeque<Effect<Pending>> =
            machine.step(self.now, Input::CommitDue { writable: true }).into();
        let (mut wrote, mut waiting) = (false, false);
        while let Some(effect) = effects.pop_front() {
            let next = match effect {
                Effect::LookUpPriors { ids } => match self.lookup_prior(n, &shard, &meta, &ids) {
                    Some(prior) => Input::Priors(Some(prior)),
                    None => {
                        // A sealed generation's shard cannot be asked: try the whole
                        // batch again shortly.
                        let node = self.node(n);
                        let mut back = queue;
                        back.extend(node.pending.remove(&shard).unwrap_or_default());
                        node.pending.insert(shard.clone(), back);
                        if node.commit_scheduled.insert(shard.clone()) {
                            self.timer(n, RESUBMIT_BACKOFF_MS, NodeTimer::Commit(shard));
                        }
                        return;
                    }
                },
                Effect::Write { write, durable, sends, .. } => {
                    debug_assert!(sends.is_empty(), "tier 1 has no bounded counter");
                    store.commit(&shard, &write).expect("a running node's store is open");
                    wrote = true;
                    for (p, reply) in durable {
                        self.wait_for_flush(n, &shard, p, reply);
                        waiting = true;
                    }
                    Input::Applied { ok: true }
                }
                Effect::Reply { to, reply } => {
                    self.answer(n, &shard, to, answer_of(reply));
                    continue;
                }
                Effect::ReplyAfterFlush(answers) => {
                    for (p, reply) in answers {
                        self.wait_for_flush(n, &shard, p, reply);
                        waiting = true;
                    }
                    continue;
                }
                // One batch, all of it taken, from a machine that is not sealed and
                // whose writes are applied: nothing else can follow. Tier 1 has no
                // bounded counter, so no escrow messages either.
                Effect::ScheduleCommit
                | Effect::Reload
                | Effect::Sealed(_)
                | Effect::Merged
                | Effect::Escrow { .. }
                | Effect::Stop => unreachable!("a one-batch shard machine asked for {effect:?}"),
            };
            effects.extend(machine.step(self.now, next));
        }
        let sync = meta.spec.durability == Durability::Sync;
        if waiting || (sync && wrote) {
            self.schedule_flush(n, FSYNC_MS);
        } else if wrote {
            self.schedule_flush(n, u64::from(meta.spec.flush_ms));
        }
    }

    /// The shard machine of `shard` as `store` holds it.
    fn machine(store: &MemStore, shard: &ShardId, meta: &CounterMeta) -> ShardMachine<Pending> {
        let image = store.load_shard(shard).expect("a running node's store is open");
        let sketch = image_sketch(&image, meta);
        let params = ShardParams::of(meta, shard, tally_core::escrow::Tuning::default());
        ShardMachine::new(params, image, sketch, false)
    }

    /// Answers `p` after the flush that follows (a `sync` increment's answer).
    fn wait_for_flush(&mut self, n: u8, shard: &ShardId, p: Pending, reply: ShardReply) {
        let msg = Msg::SubmitReply { shard: shard.clone(), sub: p.sub, ctx: p.ctx, answer: answer_of(reply) };
        self.node(n).flush_waiters.push((p.reply_to, msg));
    }

    fn schedule_flush(&mut self, n: u8, delay_ms: u64) {
        let at = self.now + delay_ms;
        let node = self.node(n);
        if node.flush_at.is_none_or(|t| at < t) {
            node.flush_at = Some(at);
            self.timer(n, delay_ms, NodeTimer::Flush);
        }
    }

    /// The group commit: one flush, then every waiting answer. A failed flush poisons
    /// the node and its waiters are never answered. Returns whether it succeeded.
    fn flush(&mut self, n: u8) -> bool {
        self.node(n).flush_at = None;
        if self.node(n).poisoned {
            return false;
        }
        if self.phase == Phase::Chaos
            && self.rates.fsync_fail > 0.0
            && self.rng.random::<f64>() < self.rates.fsync_fail
        {
            self.node(n).store.fail_next_flushes(1);
        }
        match self.node(n).store.flush() {
            Ok(()) => {
                let waiters = std::mem::take(&mut self.node(n).flush_waiters);
                for (to, msg) in waiters {
                    self.send(Addr::Node(n), to, msg);
                }
                true
            }
            Err(_) => {
                self.poison(n);
                false
            }
        }
    }

    // ------------------------------------------------- control-plane handlers

    fn owner_seal(&mut self, n: u8, shard: ShardId) {
        if self.meta.owner(&shard) != n || self.node(n).poisoned || !self.ensure_local(n, &shard) {
            return;
        }
        // Pending submissions are refused now (the layout is resharding).
        if self.node(n).pending.contains_key(&shard) {
            self.commit_shard(n, shard.clone());
        }
        // The seal marker travels with the shard if a membership change moves it.
        let marker = seal_marker(&shard);
        self.node(n).store.meta_put(&marker, b"").expect("a running node's store is open");
        // The final image is reported only once durable: its dedup records must
        // outlive any crash, or a retry after the resharding would count again.
        if !self.flush(n) {
            return;
        }
        let image = self.node(n).store.load_shard(&shard).expect("a running node's store is open");
        self.send(Addr::Node(n), Addr::Control, Msg::Sealed { shard, image });
    }

    fn owner_merge(&mut self, n: u8, shard: ShardId, [sketch, frequency, windows]: [Option<&[u8]>; 3]) {
        if self.meta.owner(&shard) != n || self.node(n).poisoned || !self.ensure_local(n, &shard) {
            return;
        }
        let distinct = sketch.map(|s| DistinctSketch::from_bytes(s).expect("sent sketches decode"));
        let frequency = frequency.map(|f| FrequencySketch::from_bytes(f).expect("sent sketches decode"));
        let windows =
            windows.map(|w| tally_core::window::WindowState::from_bytes(w).expect("sent windows decode"));
        let meta = self.meta.counters[&shard.counter].clone();
        let store = self.node(n).store.clone();
        let mut machine = Self::machine(&store, &shard, &meta);
        let mut effects: VecDeque<Effect<Pending>> =
            machine.step(self.now, Input::MergeSketch { distinct, frequency, windows }).into();
        while let Some(effect) = effects.pop_front() {
            match effect {
                Effect::Write { write, .. } => {
                    store.commit(&shard, &write).expect("a running node's store is open");
                    effects.extend(machine.step(self.now, Input::Applied { ok: true }));
                }
                Effect::Merged => {
                    if self.flush(n) {
                        self.send(Addr::Node(n), Addr::Control, Msg::Merged { shard: shard.clone() });
                    }
                }
                other => unreachable!("a merge asked for {other:?}"),
            }
        }
    }

    // ---------------------------------------------------------------- hand-off

    /// Whether node `n` serves `shard` now: no adoption of it is due or in flight
    /// (`tally_core::handoff_machine::admit`).
    fn serves(&self, n: u8, shard: &ShardId) -> bool {
        let node = &self.nodes[usize::from(n)];
        let previous = self.meta.previous_owner(n, shard);
        let adopted = previous.is_some_and(|(_, e)| node.adopted.contains(&(e, shard.clone())));
        admit(previous, adopted, node.adoptions.contains_key(shard)) == Admission::Serve
    }

    /// Whether node `n` serves `shard` now; if the shard must be adopted first, the
    /// adoption starts (the engine's `ensure_local`, without its waiting: the caller
    /// is refused and retries).
    fn ensure_local(&mut self, n: u8, shard: &ShardId) -> bool {
        let previous = self.meta.previous_owner(n, shard);
        let node = self.node(n);
        let adopted = previous.is_some_and(|(_, e)| node.adopted.contains(&(e, shard.clone())));
        let in_flight = node.adoptions.contains_key(shard);
        match admit(previous, adopted, in_flight) {
            Admission::Serve => true,
            Admission::AwaitInFlight => false,
            Admission::Adopt { from, epoch } => {
                if !in_flight && !node.poisoned {
                    let adoption = Adoption::new(shard.clone(), from, epoch);
                    node.adoptions.insert(shard.clone(), (adoption, BTreeSet::new()));
                    // One simulated step: nothing can change between the check and here.
                    self.adopt_step(n, shard, AdoptInput::Begun { adopted, still_previous: true });
                }
                false
            }
        }
    }

    /// The previous owner asks node `n` to adopt `shard` at `epoch`.
    fn adopt_request(&mut self, n: u8, from: Addr, shard: ShardId, epoch: u64) {
        let Addr::Node(previous) = from else { return };
        if self.meta.previous_owner(n, &shard) != Some((previous, epoch)) {
            return;
        }
        if self.ensure_local(n, &shard) {
            self.send(Addr::Node(n), from, Msg::Adopted { shard, epoch });
        } else if let Some((_, waiting)) = self.node(n).adoptions.get_mut(&shard) {
            waiting.insert(previous);
        }
    }

    /// Feeds `input` to node `n`'s adoption of `shard` and carries out its effects.
    fn adopt_step(&mut self, n: u8, shard: &ShardId, input: AdoptInput) {
        let Some((adoption, _)) = self.node(n).adoptions.get_mut(shard) else { return };
        let epoch = adoption.epoch();
        let mut effects: VecDeque<AdoptEffect<u8>> = adoption.step(input).into();
        let store = self.node(n).store.clone();
        while let Some(effect) = effects.pop_front() {
            let next = match effect {
                AdoptEffect::Skip => {
                    self.node(n).adoptions.remove(shard);
                    return;
                }
                AdoptEffect::ReadMarker(key) => AdoptInput::Marker {
                    present: store.meta_get(&key).expect("a running node's store is open").is_some(),
                },
                AdoptEffect::DeleteShard => {
                    store.delete_shard(shard).expect("a running node's store is open");
                    store.meta_delete(&seal_marker(shard)).expect("a running node's store is open");
                    continue;
                }
                AdoptEffect::Pull { from, epoch, after } => {
                    let msg = Msg::HandOff { shard: shard.clone(), epoch, after };
                    self.send(Addr::Node(n), Addr::Node(from), msg);
                    self.timer(n, ADOPT_RESEND_MS, NodeTimer::AdoptResend(shard.clone()));
                    continue;
                }
                AdoptEffect::Import(write) => {
                    store.commit(shard, &write).expect("a running node's store is open");
                    continue;
                }
                AdoptEffect::Seal => {
                    store.meta_put(&seal_marker(shard), b"").expect("a running node's store is open");
                    continue;
                }
                AdoptEffect::Flush => {
                    if !self.flush(n) {
                        // Poisoned: abandoned; after the restart it starts again.
                        self.node(n).adoptions.remove(shard);
                        return;
                    }
                    continue;
                }
                AdoptEffect::WriteMarker(key) => {
                    store.meta_put(&key, &[]).expect("a running node's store is open");
                    continue;
                }
                AdoptEffect::Adopted { imported } => {
                    if imported {
                        self.count(FaultKind::ShardMoved);
                    }
                    let node = self.node(n);
                    node.adopted.insert((epoch, shard.clone()));
                    let (_, waiting) = node.adoptions.remove(shard).expect("in flight");
                    for to in waiting {
                        self.send(
                            Addr::Node(n),
                            Addr::Node(to),
                            Msg::Adopted { shard: shard.clone(), epoch },
                        );
                    }
                    return;
                }
            };
            let Some((adoption, _)) = self.node(n).adoptions.get_mut(shard) else { return };
            effects.extend(adoption.step(next));
        }
    }

    /// Node `n` answers a new owner's pull of `shard` (the engine's `hand_off`).
    fn answer_pull(&mut self, n: u8, from: Addr, shard: ShardId, epoch: u64, after: Option<String>) {
        if self.meta.membership.epoch < epoch {
            return;
        }
        let mut answer = PullAnswer::new(after.clone());
        let owns = self.meta.owner(&shard) == n;
        // Tier 1 loses no disk, so no node's shards are ever marked lost.
        let mut effects: VecDeque<PullEffect> = answer.step(PullInput::Asked { owns, lost: false }).into();
        while let Some(effect) = effects.pop_front() {
            let next = match effect {
                PullEffect::Refuse => return,
                PullEffect::StopShard => {
                    // What is pending here is refused now (this node no longer owns it).
                    if self.node(n).pending.contains_key(&shard) {
                        self.commit_shard(n, shard.clone());
                    }
                    continue;
                }
                PullEffect::MakeDurable => PullInput::Durable { ok: self.flush(n) },
                PullEffect::Read { after, limit } => {
                    let store = &self.node(n).store;
                    let open = "a running node's store is open";
                    PullInput::Read {
                        image: store.load_shard(&shard).expect(open),
                        sealed: store.meta_get(&seal_marker(&shard)).expect(open).is_some(),
                        records: store.dedup_scan(&shard, after.as_deref(), limit).expect(open),
                    }
                }
                PullEffect::Answer(page) => {
                    let msg = Msg::HandedOff { shard, epoch, after, page };
                    return self.send(Addr::Node(n), from, msg);
                }
            };
            effects.extend(answer.step(next));
        }
    }

    /// Starts a hand-off pass if node `n` is a previous member that has not reported
    /// nothing left behind, and gives up on a pass that waited too long.
    fn handoff_tick(&mut self, n: u8) {
        let epoch = self.meta.membership.epoch;
        if self.node(n).poisoned {
            return;
        }
        match &self.node(n).pass {
            Some((p, started)) if p.epoch() == epoch && !p.finished() => {
                if started + HANDOFF_PASS_TIMEOUT_MS <= self.now {
                    self.pass_step(n, PassInput::GiveUp);
                }
                return;
            }
            _ => {}
        }
        let running: Vec<(ShardId, Option<u8>)> = self.nodes[usize::from(n)]
            .pending
            .keys()
            .map(|id| (id.clone(), Some(self.meta.owner(id)).filter(|&o| o != n)))
            .collect();
        self.node(n).pass = Some((HandOffPass::new(epoch), self.now));
        self.pass_step(n, PassInput::Start { applied: epoch, running });
    }

    /// Feeds `input` to node `n`'s hand-off pass and carries out its effects.
    fn pass_step(&mut self, n: u8, input: PassInput<u8>) {
        let Some((pass, _)) = self.node(n).pass.as_mut() else { return };
        let epoch = pass.epoch();
        let mut effects: VecDeque<PassEffect<u8>> = pass.step(input).into();
        let store = self.node(n).store.clone();
        while let Some(effect) = effects.pop_front() {
            let next = match effect {
                PassEffect::NotApplied => return,
                PassEffect::Stop(id) => {
                    if self.node(n).pending.contains_key(&id) {
                        self.commit_shard(n, id);
                    }
                    continue;
                }
                PassEffect::Scan { after, limit } => {
                    let ids = store.shard_ids(after.as_ref(), limit).expect("a running node's store is open");
                    PassInput::Scanned(
                        ids.into_iter()
                            .map(|id| {
                                let owner = Some(self.meta.owner(&id)).filter(|&o| o != n);
                                (id, owner)
                            })
                            .collect(),
                    )
                }
                PassEffect::ScanSeals { after, limit } => {
                    let after = after.as_ref().map(seal_marker);
                    let page = store
                        .meta_scan(SEAL_MARKER_PREFIX, after.as_deref(), limit)
                        .expect("a running node's store is open");
                    PassInput::ScannedSeals(
                        page.iter()
                            .filter_map(|(key, _)| shard_of_seal_marker(key))
                            .map(|id| {
                                let owner = Some(self.meta.owner(&id)).filter(|&o| o != n);
                                (id, owner)
                            })
                            .collect(),
                    )
                }
                PassEffect::AskAdopt { shard, owner, epoch } => {
                    self.send(Addr::Node(n), Addr::Node(owner), Msg::Adopt { shard, epoch });
                    continue;
                }
                PassEffect::Delete(id) => {
                    store.delete_shard(&id).expect("a running node's store is open");
                    store.meta_delete(&seal_marker(&id)).expect("a running node's store is open");
                    continue;
                }
                PassEffect::Flush => {
                    if !self.flush(n) {
                        self.node(n).pass = None;
                        return;
                    }
                    continue;
                }
                PassEffect::Report(report) => {
                    // Nothing left behind: the change may complete (a metadata outage
                    // refuses the report; the next pass makes it again).
                    if report.failed == 0 {
                        let _ = self.meta.handed_off(n, epoch, self.now);
                    }
                    continue;
                }
            };
            let Some((pass, _)) = self.node(n).pass.as_mut() else { return };
            effects.extend(pass.step(next));
        }
    }
}
