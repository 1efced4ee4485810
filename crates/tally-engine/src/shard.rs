//! The shard actor: the only writer of one shard, and a shell around its machine.
//!
//! Every decision is [`tally_core::shard_machine`]'s — batching, dedup, the write and
//! the answers, sealing, merging, sweeping, forgetting a failed write. This actor
//! carries out the machine's effects: it looks up dedup records (in the store, and in
//! sealed generations wherever they live), hands writes to the commit path
//! (`flusher.rs`) and waits until they are applied, sends answers — `sync` ones after
//! the flush that follows their write — and makes seals and merges durable.
//!
//! A shard of a generation being resharded is *sealed*: it answers every later
//! submission with [`ShardReply::Sealed`] and the caller retries on the new layout.
//! The seal is durable (a marker in the store, flushed before the seal is answered),
//! because the sealed value is counted in the next generation's `base`: a copy that
//! restarts — on metadata that has not caught up, say — must still refuse writes.

use crate::ctx::{seal_key, Ctx};
use crate::error::TallyError;
use crate::flusher::Waiter;
use crate::messages::{ShardMsg, SupervisorMsg};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tally_core::dedup::{is_mark_id, DedupRecord, MARK_ID_PREFIX, WRITERS_PER_SHARD_MAX};
use tally_core::frequency::FrequencySketch;
use tally_core::meta::{CounterMeta, SEALED_GENERATIONS_MAX};
use tally_core::router::shard_of_event;
use tally_core::shard::window_for;
use tally_core::shard::Submission;
use tally_core::shard_machine::{Effect, EscrowSend, Input, ShardMachine, ShardParams, ESCROW_TICK_MS};
use tally_core::sketch::DistinctSketch;
use tally_core::sweep::Sweeper;
use tally_core::window::WindowState;
use tally_core::ShardId;
use tally_store::{ShardImage, StoreError};

/// How often a shard checks for idleness and expired dedup records.
pub const SHARD_TICK_MS: u64 = 1_000;

pub use tally_core::shard::ShardReply;

/// The shard actor; its identity and engine are its arguments.
pub(crate) struct ShardActor;

/// Arguments of a shard actor.
pub(crate) struct ShardArgs {
    pub(crate) id: ShardId,
    pub(crate) meta: Arc<CounterMeta>,
    pub(crate) ctx: Arc<Ctx>,
}

/// A shard actor's state: the machine, and the answers its shell still owes.
pub(crate) struct ShardActorState {
    id: ShardId,
    ctx: Arc<Ctx>,
    meta: Arc<CounterMeta>,
    machine: ShardMachine<RpcReplyPort<ShardReply>>,
    /// Sealers waiting for [`Effect::Sealed`].
    sealers: Vec<RpcReplyPort<Result<ShardImage, TallyError>>>,
    /// Mergers waiting for [`Effect::Merged`].
    mergers: Vec<RpcReplyPort<Result<(), TallyError>>>,
    last_active_ms: u64,
    /// When this shard sweeps its expired dedup records, and where a pass stands.
    sweeper: Sweeper,
    ticker: Option<tokio::task::JoinHandle<()>>,
    /// An escrow tick is on its way (see [`ShardMachine::escrow_settled`]).
    escrow_tick_due: bool,
}

fn corrupt_sketch(id: &ShardId, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        location: format!("sketch of shard {id}"),
        source: tally_core::codec::DecodeError { what: "sketch", reason: e.to_string() },
    }
}

/// The shard as the store holds it, its sketch decoded.
fn load(ctx: &Ctx, id: &ShardId) -> Result<(ShardImage, Option<DistinctSketch>), StoreError> {
    let image = ctx.store.open_shard(id)?;
    let sketch = match &image.sketch {
        Some(b) => Some(DistinctSketch::from_bytes(b).map_err(|e| corrupt_sketch(id, e))?),
        None => None,
    };
    // The machine decodes the frequency sketch itself; one that does not decode makes
    // the shard corrupt here, as a distinct sketch does.
    image.decode_frequency().map_err(|e| corrupt_sketch(id, e))?;
    image.decode_windows().map_err(|e| corrupt_sketch(id, e))?;
    Ok((image, sketch))
}

/// How many writer marks the store holds for shard `id`, counted up to one past
/// [`WRITERS_PER_SHARD_MAX`] (marks sort together, after every event id and drain id).
fn count_marks(ctx: &Ctx, id: &ShardId) -> Result<u64, StoreError> {
    let limit = usize::try_from(WRITERS_PER_SHARD_MAX + 1).unwrap_or(usize::MAX);
    let page = ctx.store.dedup_scan(id, Some(MARK_ID_PREFIX), limit)?;
    Ok(page.iter().take_while(|(k, _)| is_mark_id(k)).count() as u64)
}

/// Dedup records one page of [`count_event_ids`] reads.
const EVENT_ID_COUNT_PAGE: usize = 4096;

/// The shard's records of clients' event ids, counted up to `max` (a shard that
/// holds that many refuses new ids anyway, so counting further is wasted).
fn count_event_ids(ctx: &Ctx, id: &ShardId, max: u64) -> Result<u64, StoreError> {
    let mut count = 0u64;
    let mut after: Option<String> = None;
    loop {
        let page = ctx.store.dedup_scan(id, after.as_deref(), EVENT_ID_COUNT_PAGE)?;
        count += page.iter().filter(|(k, _)| tally_core::dedup::is_client_event_id(k)).count() as u64;
        if page.len() < EVENT_ID_COUNT_PAGE || count >= max {
            return Ok(count);
        }
        after = page.last().map(|(k, _)| k.clone());
    }
}

fn store_failure(what: &str) -> TallyError {
    StoreError::Io { op: "flush", message: what.into() }.into()
}

impl Actor for ShardActor {
    type Msg = ShardMsg;
    type State = ShardActorState;
    type Arguments = ShardArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ShardMsg>,
        args: ShardArgs,
    ) -> Result<ShardActorState, ActorProcessingErr> {
        let ShardArgs { id, meta, ctx } = args;
        let (image, sketch) = load(&ctx, &id)?;
        let sealed = id.generation < meta.layout.generation
            || (!bug!(SealForgottenOnRestart) && ctx.store.meta_get(&seal_key(&id))?.is_some());
        ctx.stats.shard_activations.inc();
        let now = ctx.now_ms();
        let sweeper = Sweeper::new(now, ctx.config.dedup_sweep_ms);
        let ticker = myself.send_interval(Duration::from_millis(SHARD_TICK_MS), || ShardMsg::Tick);
        let mut machine = ShardMachine::new(params(&ctx, &meta, &id), image, sketch, sealed);
        machine.set_writer_marks(count_marks(&ctx, &id)?);
        // Its share of the counter's event-id quota, and what it holds of it.
        let ids_max = ctx.quotas.event_ids_per_shard(meta.layout.shards);
        let ids = match ids_max {
            Some(max) => count_event_ids(&ctx, &id, max)?,
            None => 0,
        };
        machine.set_event_ids(ids, ids_max);
        Ok(ShardActorState {
            machine,
            id,
            ctx,
            meta,
            sealers: Vec::new(),
            mergers: Vec::new(),
            last_active_ms: now,
            // A started shard sweeps a pass at its first tick: a shard that is
            // written to less often than it retires would never sweep otherwise, and
            // `dormant.rs` starts shards only for that.
            sweeper,
            ticker: Some(ticker),
            escrow_tick_due: false,
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<ShardMsg>,
        state: &mut ShardActorState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        // Anything still queued was admitted before the drain: commit it. Each round
        // takes a batch (or drops it, if the store takes no writes), so this ends; it
        // does not wait for the escrow to settle, which needs other shards.
        while !state.machine.drained() && !state.machine.broken() {
            let writable = !state.ctx.flusher.poisoned();
            state.run(&myself, Input::CommitDue { writable }).await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ShardMsg>,
        msg: ShardMsg,
        state: &mut ShardActorState,
    ) -> Result<(), ActorProcessingErr> {
        // A broken copy drops every message, and so its reply port: the caller hears
        // that the shard stopped and retries against the copy that replaces this one.
        if state.machine.broken() {
            return Ok(());
        }
        let input = match msg {
            ShardMsg::Submit { sub, reply } => {
                if state.id.generation > state.meta.layout.generation {
                    // Started before its generation opened (see `catch_up_meta`).
                    if !state.catch_up_meta(&myself).await {
                        tracing::warn!(shard = %state.id, "a submission reached a generation this node has not opened; the caller retries");
                        return Ok(());
                    }
                }
                Input::Submit { sub, reply }
            }
            ShardMsg::Commit => {
                state.last_active_ms = state.ctx.now_ms();
                Input::CommitDue { writable: !state.ctx.flusher.poisoned() }
            }
            ShardMsg::Seal { reply } => {
                state.sealers.push(reply);
                Input::Seal
            }
            ShardMsg::MergeSketch { sketch, frequency, windows, reply } => {
                let distinct = sketch.as_deref().map(DistinctSketch::from_bytes).transpose();
                let frequency = frequency.as_deref().map(FrequencySketch::from_bytes).transpose();
                let windows = match windows.as_deref().map(WindowState::from_bytes).transpose() {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = reply.send(Err(corrupt_sketch(&state.id, e).into()));
                        return Ok(());
                    }
                };
                match (distinct, frequency) {
                    (Ok(distinct), Ok(frequency)) => {
                        state.mergers.push(reply);
                        Input::MergeSketch { distinct, frequency, windows }
                    }
                    (Err(e), _) => {
                        let _ = reply.send(Err(corrupt_sketch(&state.id, e).into()));
                        return Ok(());
                    }
                    (_, Err(e)) => {
                        let _ = reply.send(Err(corrupt_sketch(&state.id, e).into()));
                        return Ok(());
                    }
                }
            }
            ShardMsg::MetaChanged(meta) => {
                if meta.version <= state.meta.version {
                    return Ok(());
                }
                let sealed = state.id.generation < meta.layout.generation;
                state.meta = meta;
                Input::MetaChanged { params: params(&state.ctx, &state.meta, &state.id), sealed }
            }
            ShardMsg::Tick => match state.tick(&myself).await {
                Some(input) => input,
                None => return Ok(()),
            },
            ShardMsg::Escrow(message) => {
                state.last_active_ms = state.ctx.now_ms();
                Input::Escrow(message)
            }
            ShardMsg::EscrowTick => {
                state.escrow_tick_due = false;
                Input::EscrowTick
            }
        };
        state.run(&myself, input).await;
        if !state.machine.escrow_settled() && !state.escrow_tick_due {
            state.escrow_tick_due = true;
            myself.send_after(Duration::from_millis(ESCROW_TICK_MS), || ShardMsg::EscrowTick);
        }
        Ok(())
    }
}

impl ShardActorState {
    /// A shard started before its generation opened (a resharding's sketch merge
    /// starts it) holds the resharding's metadata, which does not list the generation
    /// being sealed, where earlier records of its event ids are. A submission reaches
    /// it only once its generation is open on this node (the sender's metadata
    /// version is installed first), so it takes the newest metadata the node has;
    /// false if that still does not open its generation.
    async fn catch_up_meta(&mut self, myself: &ActorRef<ShardMsg>) -> bool {
        let name = self.id.counter.as_str();
        let mut newest = self.ctx.registry.get(name).map(|rt| rt.meta.clone());
        if newest.as_ref().is_none_or(|m| m.layout.generation < self.id.generation) {
            // The runtime may have been evicted meanwhile: the catalog has it too.
            if let Ok(Some(meta)) = self.ctx.catalog.get(name) {
                if newest.as_ref().is_none_or(|m| meta.version > m.version) {
                    newest = Some(Arc::new(meta));
                }
            }
        }
        if let Some(meta) = newest.filter(|m| m.version > self.meta.version) {
            let sealed = self.id.generation < meta.layout.generation;
            self.meta = meta;
            let input = Input::MetaChanged { params: params(&self.ctx, &self.meta, &self.id), sealed };
            self.run(myself, input).await;
        }
        self.id.generation <= self.meta.layout.generation
    }

    /// Steps the machine with `input` and carries out its effects ([`execute`]).
    async fn run(&mut self, myself: &ActorRef<ShardMsg>, input: Input<RpcReplyPort<ShardReply>>) {
        execute(&mut Warm { state: self, myself }, input).await;
    }

    /// What waits for the flush after a write: `sync` answers, and escrow messages
    /// whose ledger state the write carries. Dropped if the flush fails.
    fn after_flush(
        &self,
        durable: Vec<(RpcReplyPort<ShardReply>, ShardReply)>,
        sends: Vec<EscrowSend>,
    ) -> Option<Waiter> {
        if sends.is_empty() {
            return (!durable.is_empty()).then(|| answers_after(durable));
        }
        let (ctx, id, meta) = (self.ctx.clone(), self.id.clone(), self.meta.clone());
        let answers = answers_after(durable);
        // A store that blocks runs its flushes on a thread of its own, outside the
        // runtime the messages are sent on.
        let runtime = tokio::runtime::Handle::current();
        Some(Box::new(move |r: Result<(), StoreError>| {
            if r.is_ok() {
                let _inside = runtime.enter();
                ctx.send_escrow(&id, &meta, sends);
            }
            answers(r);
        }))
    }

    /// Makes the seal and the sealed value durable, and answers that value: it goes
    /// into the layout's base and must not be lost (with its dedup records) by a crash
    /// after the answer.
    async fn persist_seal(&self, image: ShardImage) -> Result<ShardImage, TallyError> {
        if self.ctx.flusher.poisoned() {
            return Err(store_failure("an earlier flush failed"));
        }
        self.ctx.store.meta_put_async(&seal_key(&self.id), b"").await?;
        self.ctx.flusher.flush().await?;
        Ok(image)
    }

    /// Housekeeping: asks the supervisor to retire an idle shard, and gives the
    /// machine a page of expired dedup records to remove when a sweep is due.
    async fn tick(&mut self, myself: &ActorRef<ShardMsg>) -> Option<Input<RpcReplyPort<ShardReply>>> {
        let now = self.ctx.now_ms();
        let idle = now.saturating_sub(self.last_active_ms) >= self.ctx.config.shard_idle_stop_ms;
        // Not while a sweep pass is under way: it would start over from its first page.
        if idle && self.machine.quiet() && !self.sweeper.passing() {
            if let Some(sup) = self.ctx.supervisor.get() {
                let _ =
                    sup.send_message(SupervisorMsg::Retire { id: self.id.clone(), actor: myself.get_id() });
            }
        }
        // A pass over the records starts once one of them is due ([`Sweeper`]: not
        // every `dedup_sweep_ms`, which would read every live record each time); once
        // started, it goes on a page per tick until it reaches the end, so expiry
        // keeps up with shards that take more than a page of records per period. The
        // machine writes a page's removals between commits, before the next batch;
        // the next page is read once it took the last one.
        if !self.machine.sweepable() {
            return None;
        }
        let scan = self.sweeper.due(now)?;
        let max = self.ctx.config.dedup_sweep_records_max;
        let page = match self.ctx.store.dedup_scan(&self.id, scan.after.as_deref(), max) {
            Ok(page) => page,
            Err(e) => {
                // The pass stays where it is: the next tick reads the page again.
                tracing::warn!(shard = %self.id, error = %e, "dedup sweep failed");
                return None;
            }
        };
        self.ctx.stats.dedup_sweep_reads.add(page.len() as u64);
        let expired = self.sweeper.take(now, scan.lane, &page, max, self.meta.spec.dedup_window_ms());
        (!expired.is_empty()).then_some(Input::Sweep { expired })
    }

    /// The record for `event_id` in this shard or, failing that, in its shard of a
    /// sealed generation (they never change again, so reading them needs no lock).
    /// Only generations sealed within the id's window are asked — a record older than
    /// its window no longer counts — at most [`SEALED_GENERATIONS_MAX`] of them, all
    /// at once; the newest record found wins.
    async fn prior(&self, event_id: &str, now: u64) -> Result<Option<DedupRecord>, TallyError> {
        if let Some(r) = self.ctx.store.dedup_get(&self.id, event_id)? {
            return Ok(Some(r));
        }
        let window = window_for(event_id, self.meta.spec.dedup_window_ms());
        let lookups = self
            .meta
            .layout
            .sealed
            .iter()
            .rev()
            .take(SEALED_GENERATIONS_MAX)
            .filter(|g| !tally_core::dedup::expired(g.sealed_at_ms, now, window))
            .map(|g| {
                let id = self.id.sibling(g.generation, shard_of_event(event_id, g.shards));
                async move { self.ctx.dedup_get(&id, event_id).await }
            });
        let found = futures::future::join_all(lookups).await;
        let mut newest: Option<DedupRecord> = None;
        for r in found {
            if let Some(r) = r? {
                if newest.as_ref().is_none_or(|n| r.applied_at_ms > n.applied_at_ms) {
                    newest = Some(r);
                }
            }
        }
        Ok(newest)
    }
}

/// Carries out [`Effect::Write`]: hands the write to the commit path, with the
/// answers that wait for the flush after it; true once it is applied.
async fn write_through(
    ctx: &Ctx,
    id: &ShardId,
    write: tally_store::ShardWrite,
    waiter: Option<Waiter>,
    change_abs: u64,
    submissions: usize,
) -> bool {
    // Counted before the write is applied, so a rollup that finds no change knows no
    // write is on its way either; and from now on the counter's slots no longer hold
    // its whole total.
    if let Some(rt) = ctx.registry.get(id.counter.as_str()) {
        rt.touch();
        if change_abs > 0 {
            rt.changed.fetch_add(change_abs, Relaxed);
        }
    }
    let (waiter, early) = if bug!(EngineAckBeforeFlush) { (None, waiter) } else { (waiter, None) };
    let result = ctx.flusher.commit(id.clone(), write, waiter).await;
    if let (Ok(()), Some(early)) = (&result, early) {
        early(Ok(()));
    }
    if let Err(e) = &result {
        tracing::error!(shard = %id, error = %e, "shard commit failed");
    } else if submissions > 0 {
        ctx.stats.commits.inc();
        ctx.stats.commit_submissions.record(submissions as u64);
    }
    result.is_ok()
}

/// What shard `id`'s machine needs of its counter's metadata, with the engine's
/// escrow timing.
fn params(ctx: &Ctx, meta: &CounterMeta, id: &ShardId) -> ShardParams {
    ShardParams::of(meta, id, ctx.config.escrow_tuning())
}

/// Runs one submission through the machine of a shard that holds nothing and has no
/// actor (`cold.rs` holds the shard's claim meanwhile, so nothing else decides for
/// it): the same steps an actor would take ([`execute`]), carried out here and then
/// forgotten — the next actor of the shard starts from what this wrote.
pub(crate) async fn run_cold(
    ctx: &Ctx,
    id: &ShardId,
    meta: &CounterMeta,
    sub: Submission,
    reply: RpcReplyPort<ShardReply>,
) {
    let machine = ShardMachine::new(params(ctx, meta, id), ShardImage::default(), None, false);
    execute(&mut Cold { ctx, id, machine }, Input::Submit { sub, reply }).await;
}

/// A shard machine's answers go to reply ports.
type Machine = ShardMachine<RpcReplyPort<ShardReply>>;

/// What carrying out a shard machine's effects needs of the shell around it: a
/// shard actor ([`Warm`]) or a one-off run for a shard that has none ([`Cold`]).
/// Everything else is [`execute`]'s, the same for both.
trait Shell {
    fn ctx(&self) -> &Ctx;
    fn id(&self) -> &ShardId;
    fn machine(&mut self) -> &mut Machine;
    /// Asks for a commit later ([`Effect::ScheduleCommit`]); false if it must run now.
    fn schedule_commit(&self) -> bool;
    /// The dedup record of `event_id` as of `now` ([`Effect::LookUpPriors`]).
    async fn prior(&self, event_id: &str, now: u64) -> Result<Option<DedupRecord>, TallyError>;
    /// What waits for the flush after a write: `sync` answers, and escrow messages
    /// whose ledger state the write carries.
    fn after_flush(
        &self,
        durable: Vec<(RpcReplyPort<ShardReply>, ShardReply)>,
        sends: Vec<EscrowSend>,
    ) -> Option<Waiter>;
    /// Sends escrow messages now.
    fn send_escrow(&self, sends: Vec<EscrowSend>);
    /// Makes a seal durable and answers its sealers ([`Effect::Sealed`]).
    async fn sealed(&mut self, image: ShardImage);
    /// Makes a merge durable and answers its mergers ([`Effect::Merged`]).
    async fn merged(&mut self);
    /// Stops the shard ([`Effect::Stop`]).
    fn stop(&self);
}

/// Steps the machine with `input` and carries out its effects, feeding back what
/// they produce, until none is left: the one interpreter of a shard machine's
/// effects, for warm and cold shards alike.
async fn execute(shell: &mut impl Shell, input: Input<RpcReplyPort<ShardReply>>) {
    let now = shell.ctx().now_ms();
    let mut effects: VecDeque<_> = shell.machine().step(now, input).into();
    while let Some(effect) = effects.pop_front() {
        let next = match effect {
            Effect::ScheduleCommit => {
                if shell.schedule_commit() {
                    continue;
                }
                Input::CommitDue { writable: !shell.ctx().flusher.poisoned() }
            }
            Effect::LookUpPriors { ids } => Input::Priors(priors(shell, &ids).await),
            Effect::Write { write, durable, sends, change_abs, submissions } => {
                let waiter = shell.after_flush(durable, sends);
                let ok = write_through(shell.ctx(), shell.id(), write, waiter, change_abs, submissions).await;
                Input::Applied { ok }
            }
            Effect::Escrow { sends, after_flush: false } => {
                shell.send_escrow(sends);
                continue;
            }
            Effect::Escrow { sends, after_flush: true } => {
                if let Some(waiter) = shell.after_flush(Vec::new(), sends) {
                    shell.ctx().flusher.after_flush(waiter);
                }
                continue;
            }
            Effect::Reply { to, reply } => {
                let _ = to.send(reply);
                continue;
            }
            Effect::ReplyAfterFlush(answers) => {
                shell.ctx().flusher.after_flush(answers_after(answers));
                continue;
            }
            Effect::Reload => {
                let image = load(shell.ctx(), shell.id());
                if let Err(e) = &image {
                    tracing::error!(shard = %shell.id(), error = %e, "cannot reload shard; stopping it");
                }
                Input::Reloaded(image.ok())
            }
            Effect::Sealed(image) => {
                shell.sealed(image).await;
                continue;
            }
            Effect::Merged => {
                shell.merged().await;
                continue;
            }
            Effect::Stop => {
                shell.stop();
                continue;
            }
        };
        let now = shell.ctx().now_ms();
        effects.extend(shell.machine().step(now, next));
    }
}

/// The records of `ids`, or `None` if one could not be read (the batch is then
/// retried).
async fn priors(shell: &impl Shell, ids: &[String]) -> Option<BTreeMap<String, DedupRecord>> {
    let now = shell.ctx().now_ms();
    let mut found = BTreeMap::new();
    for id in ids {
        match shell.prior(id, now).await {
            Ok(Some(r)) => {
                found.insert(id.clone(), r);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(shard = %shell.id(), error = %e, "cannot read dedup records; the batch is retried");
                return None;
            }
        }
    }
    Some(found)
}

/// The shell of a shard actor.
struct Warm<'a> {
    state: &'a mut ShardActorState,
    myself: &'a ActorRef<ShardMsg>,
}

impl Shell for Warm<'_> {
    fn ctx(&self) -> &Ctx {
        &self.state.ctx
    }

    fn id(&self) -> &ShardId {
        &self.state.id
    }

    fn machine(&mut self) -> &mut Machine {
        &mut self.state.machine
    }

    fn schedule_commit(&self) -> bool {
        // Draining, no new messages are admitted: the commit runs now.
        self.myself.send_message(ShardMsg::Commit).is_ok()
    }

    async fn prior(&self, event_id: &str, now: u64) -> Result<Option<DedupRecord>, TallyError> {
        self.state.prior(event_id, now).await
    }

    fn after_flush(
        &self,
        durable: Vec<(RpcReplyPort<ShardReply>, ShardReply)>,
        sends: Vec<EscrowSend>,
    ) -> Option<Waiter> {
        self.state.after_flush(durable, sends)
    }

    fn send_escrow(&self, sends: Vec<EscrowSend>) {
        self.state.ctx.send_escrow(&self.state.id, &self.state.meta, sends);
    }

    async fn sealed(&mut self, image: ShardImage) {
        let result = self.state.persist_seal(image).await;
        if let Err(e) = &result {
            // The seal is not stored: a new actor starts from what is stored (a
            // replicated store refuses the seal of a writer that missed a commit) and
            // seals that.
            tracing::warn!(shard = %self.state.id, error = %e, "cannot persist a seal; stopping the shard");
            self.myself.stop(Some("its seal could not be stored".into()));
        }
        for sealer in self.state.sealers.drain(..) {
            let _ = sealer.send(result.clone());
        }
    }

    async fn merged(&mut self) {
        let result = self.state.ctx.flusher.flush().await.map_err(TallyError::from);
        for merger in self.state.mergers.drain(..) {
            let _ = merger.send(result.clone());
        }
    }

    fn stop(&self) {
        self.myself.stop(Some("its values could not be reloaded after a failed commit".into()));
    }
}

/// The shell of a one-off run for a shard with no actor ([`run_cold`]).
struct Cold<'a> {
    ctx: &'a Ctx,
    id: &'a ShardId,
    machine: Machine,
}

impl Shell for Cold<'_> {
    fn ctx(&self) -> &Ctx {
        self.ctx
    }

    fn id(&self) -> &ShardId {
        self.id
    }

    fn machine(&mut self) -> &mut Machine {
        &mut self.machine
    }

    fn schedule_commit(&self) -> bool {
        false
    }

    async fn prior(&self, event_id: &str, _now: u64) -> Result<Option<DedupRecord>, TallyError> {
        // Only this shard's records: a just-created counter has no sealed generation
        // to look in.
        Ok(self.ctx.store.dedup_get(self.id, event_id)?)
    }

    fn after_flush(
        &self,
        durable: Vec<(RpcReplyPort<ShardReply>, ShardReply)>,
        sends: Vec<EscrowSend>,
    ) -> Option<Waiter> {
        // A cold shard is never a bounded counter's (`cold.rs`): it has no escrow
        // messages to send.
        debug_assert!(sends.is_empty());
        (!durable.is_empty()).then(|| answers_after(durable))
    }

    fn send_escrow(&self, sends: Vec<EscrowSend>) {
        debug_assert!(sends.is_empty());
    }

    // Neither a seal nor a merge is ever asked of this machine; a stop drops it, and
    // its answer with it (the caller resends to an actor).
    async fn sealed(&mut self, _image: ShardImage) {}

    async fn merged(&mut self) {}

    fn stop(&self) {}
}

/// A waiter that sends `answers` once the flush it waits for succeeded (and drops
/// them if it failed: their callers hear that the shard stopped, and retry).
fn answers_after(answers: Vec<(RpcReplyPort<ShardReply>, ShardReply)>) -> Waiter {
    Box::new(move |r: Result<(), StoreError>| {
        if r.is_ok() {
            for (reply, done) in answers {
                let _ = reply.send(done);
            }
        }
    })
}
