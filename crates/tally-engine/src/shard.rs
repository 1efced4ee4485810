//! The shard actor: the only writer of one shard.
//!
//! It collects submissions while a commit is pending, so one store commit (and, for
//! `sync` counters, one fsync shared with every other shard) serves many increments.
//! The decisions are [`tally_core::shard::decide`]'s; this actor only gathers inputs
//! (dedup records from the store), hands what was decided to the commit path
//! (`flusher.rs`), waits until it is applied and sends the answers — after the flush
//! for `sync` counters, at once for `batched` ones.
//!
//! A shard of a generation being resharded is *sealed*: it answers every later
//! submission with [`ShardReply::Sealed`] and the caller retries on the new layout.
//! The seal is durable (a marker in the store, flushed before the seal is answered),
//! because the sealed value is counted in the next generation's `base`: a copy that
//! restarts — on metadata that has not caught up, say — must still refuse writes.

use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::flusher::Waiter;
use crate::supervisor::SupervisorMsg;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tally_core::dedup::{expired_ids, DedupRecord};
use tally_core::meta::{CounterMeta, SEALED_GENERATIONS_MAX};
use tally_core::router::shard_of_event;
use tally_core::shard::{decide, window_for, Outcome, ShardState, Submission, COMMIT_SUBMISSIONS_MAX};
use tally_core::sketch::DistinctSketch;
use tally_core::spec::Durability;
use tally_core::ShardId;
use tally_store::{ShardImage, ShardWrite, StoreError};

/// How often a shard checks for idleness and expired dedup records.
pub const SHARD_TICK_MS: u64 = 1_000;

/// Messages a shard takes.
pub(crate) enum ShardMsg {
    /// Count something; the answer follows the commit (and the flush, for `sync`).
    Submit { sub: Submission, reply: RpcReplyPort<ShardReply> },
    /// Commit what is pending (sent to itself).
    Commit,
    /// Stop taking writes; answer with the final state.
    Seal { reply: RpcReplyPort<Result<ShardImage, TallyError>> },
    /// Merge an encoded sketch into this shard's (a resharding carries the sealed
    /// generation's members into the next one); answered once durable.
    MergeSketch { sketch: Vec<u8>, reply: RpcReplyPort<Result<(), TallyError>> },
    /// The counter's metadata changed.
    MetaChanged(Arc<CounterMeta>),
    /// Periodic housekeeping.
    Tick,
}

impl ractor::Message for ShardMsg {}

pub use tally_core::shard::ShardReply;

/// The shard actor; its identity and engine are its arguments.
pub(crate) struct ShardActor;

/// Arguments of a shard actor.
pub(crate) struct ShardArgs {
    pub(crate) id: ShardId,
    pub(crate) meta: Arc<CounterMeta>,
    pub(crate) ctx: Arc<Ctx>,
}

type Pending = (Submission, RpcReplyPort<ShardReply>);

/// A shard actor's state.
pub(crate) struct ShardActorState {
    id: ShardId,
    ctx: Arc<Ctx>,
    meta: Arc<CounterMeta>,
    core: ShardState,
    /// The encoded sketch, rewritten only when the sketch changes.
    sketch_bytes: Option<Vec<u8>>,
    pending: Vec<Pending>,
    commit_scheduled: bool,
    sealed: bool,
    last_active_ms: u64,
    last_sweep_ms: u64,
    sweep_after: Option<String>,
    /// A failed commit left the in-memory state ahead of the store and it could not
    /// be reloaded: the actor answers nothing more and stops.
    broken: bool,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

/// The store key of shard `id`'s seal marker.
pub(crate) fn seal_key(id: &ShardId) -> Vec<u8> {
    let mut key = b"sealed:".to_vec();
    key.extend_from_slice(id.to_string().as_bytes());
    key
}

fn corrupt_sketch(id: &ShardId, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        location: format!("sketch of shard {id}"),
        source: tally_core::codec::DecodeError { what: "sketch", reason: e.to_string() },
    }
}

fn load(ctx: &Ctx, id: &ShardId, meta: &CounterMeta) -> Result<(ShardState, Option<Vec<u8>>), StoreError> {
    let image = ctx.store.load_shard(id)?;
    let sketch = match (&image.sketch, meta.spec.distinct) {
        (Some(b), _) => Some(DistinctSketch::from_bytes(b).map_err(|e| corrupt_sketch(id, e))?),
        (None, true) => Some(DistinctSketch::new()),
        (None, false) => None,
    };
    Ok((ShardState { value: image.value, sketch }, image.sketch))
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
        let (core, sketch_bytes) = load(&ctx, &id, &meta)?;
        let sealed = id.generation < meta.layout.generation || ctx.store.meta_get(&seal_key(&id))?.is_some();
        ctx.stats.shard_activations.inc();
        let now = ctx.now_ms();
        let ticker = myself.send_interval(Duration::from_millis(SHARD_TICK_MS), || ShardMsg::Tick);
        Ok(ShardActorState {
            sealed,
            id,
            ctx,
            meta,
            core,
            sketch_bytes,
            pending: Vec::new(),
            commit_scheduled: false,
            last_active_ms: now,
            last_sweep_ms: now,
            sweep_after: None,
            broken: false,
            ticker: Some(ticker),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ShardMsg>,
        state: &mut ShardActorState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        // Anything still pending was admitted before the drain: commit it (unless
        // this copy is broken: its callers then hear nothing and retry).
        while !state.pending.is_empty() && !state.broken {
            state.commit().await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ShardMsg>,
        msg: ShardMsg,
        state: &mut ShardActorState,
    ) -> Result<(), ActorProcessingErr> {
        if state.broken {
            // Dropping the message drops its reply port: the caller hears that the
            // shard stopped, and retries against the copy that replaces this one.
            return Ok(());
        }
        state.handle(&myself, msg).await;
        if state.broken {
            state.pending.clear();
            myself.stop(Some("its values could not be reloaded after a failed commit".into()));
        }
        Ok(())
    }
}

impl ShardActorState {
    async fn handle(&mut self, myself: &ActorRef<ShardMsg>, msg: ShardMsg) {
        let state = self;
        match msg {
            ShardMsg::Submit { sub, reply } => {
                if state.sealed {
                    let _ = reply.send(ShardReply::Sealed);
                    return;
                }
                state.pending.push((sub, reply));
                state.schedule_commit(myself).await;
            }
            ShardMsg::Commit => {
                state.commit_scheduled = false;
                state.commit().await;
                state.schedule_commit(myself).await;
            }
            ShardMsg::Seal { reply } => {
                while !state.pending.is_empty() && !state.broken {
                    state.commit().await;
                }
                if state.broken {
                    return;
                }
                // From here on this copy refuses writes, and so does any copy that
                // starts later: the marker is durable before the answer.
                state.sealed = true;
                let _ = reply.send(state.seal().await);
            }
            ShardMsg::MergeSketch { sketch, reply } => {
                while !state.pending.is_empty() && !state.broken {
                    state.commit().await;
                }
                if state.broken {
                    return;
                }
                let _ = reply.send(state.merge_sketch(&sketch).await);
            }
            ShardMsg::MetaChanged(meta) => {
                if meta.version > state.meta.version {
                    if meta.spec.distinct && state.core.sketch.is_none() {
                        state.core.sketch = Some(DistinctSketch::new());
                    }
                    state.sealed |= state.id.generation < meta.layout.generation;
                    state.meta = meta;
                }
            }
            ShardMsg::Tick => state.tick(myself).await,
        }
    }

    /// Makes the seal and the sealed value durable, and answers that value: it goes
    /// into the layout's base and must not be lost (with its dedup records) by a crash
    /// after the answer.
    async fn seal(&mut self) -> Result<ShardImage, TallyError> {
        if self.ctx.flusher.poisoned() {
            return Err(StoreError::Io { op: "flush", message: "an earlier flush failed".into() }.into());
        }
        self.ctx.store.meta_put(&seal_key(&self.id), b"")?;
        self.ctx.flusher.flush().await?;
        Ok(ShardImage { value: self.core.value, sketch: self.sketch_bytes.clone() })
    }

    /// Merges `bytes` into this shard's sketch through the commit path (this actor is
    /// the shard's only writer, so the merge can never write back an older value),
    /// and returns once it is durable. Merging twice changes nothing.
    async fn merge_sketch(&mut self, bytes: &[u8]) -> Result<(), TallyError> {
        let incoming = DistinctSketch::from_bytes(bytes).map_err(|e| corrupt_sketch(&self.id, e))?;
        let mut merged = self.core.sketch.clone().unwrap_or_default();
        merged.merge(&incoming);
        let sketch_bytes = Some(merged.to_bytes());
        if sketch_bytes != self.sketch_bytes {
            let write = ShardWrite {
                image: ShardImage { value: self.core.value, sketch: sketch_bytes.clone() },
                ..Default::default()
            };
            self.ctx.flusher.commit(self.id.clone(), write, None).await?;
            self.core.sketch = Some(merged);
            self.sketch_bytes = sketch_bytes;
        }
        self.ctx.flusher.flush().await?;
        Ok(())
    }

    /// Makes sure a `Commit` follows the pending submissions. Submissions that arrive
    /// before it is handled join the same commit: that is the batching.
    async fn schedule_commit(&mut self, myself: &ActorRef<ShardMsg>) {
        if self.pending.is_empty() || self.commit_scheduled {
            return;
        }
        self.commit_scheduled = true;
        if myself.send_message(ShardMsg::Commit).is_err() {
            // Draining: no new messages are admitted, so commit now.
            self.commit_scheduled = false;
            while !self.pending.is_empty() && !self.broken {
                self.commit().await;
            }
        }
    }

    async fn tick(&mut self, myself: &ActorRef<ShardMsg>) {
        let now = self.ctx.now_ms();
        if now.saturating_sub(self.last_sweep_ms) >= self.ctx.config.dedup_sweep_ms && !self.sealed {
            self.last_sweep_ms = now;
            if let Err(e) = self.sweep(now).await {
                tracing::warn!(shard = %self.id, error = %e, "dedup sweep failed");
            }
        }
        let idle = now.saturating_sub(self.last_active_ms) >= self.ctx.config.shard_idle_stop_ms;
        if idle && self.pending.is_empty() {
            if let Some(sup) = self.ctx.supervisor.get() {
                let _ =
                    sup.send_message(SupervisorMsg::Retire { id: self.id.clone(), actor: myself.get_id() });
            }
        }
    }

    /// Removes one page of expired dedup records.
    async fn sweep(&mut self, now: u64) -> Result<(), StoreError> {
        let page = self.ctx.store.dedup_scan(
            &self.id,
            self.sweep_after.as_deref(),
            self.ctx.config.dedup_sweep_records_max,
        )?;
        self.sweep_after = if page.len() < self.ctx.config.dedup_sweep_records_max {
            None
        } else {
            page.last().map(|(k, _)| k.clone())
        };
        let window = self.meta.spec.dedup_window_ms();
        let gone = expired_ids(&page, now, |id| window_for(id, window));
        if gone.is_empty() {
            return Ok(());
        }
        let write = ShardWrite {
            image: ShardImage { value: self.core.value, sketch: self.sketch_bytes.clone() },
            dedup_put: Vec::new(),
            dedup_remove: gone,
        };
        self.ctx.flusher.commit(self.id.clone(), write, None).await
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
                let id =
                    ShardId::new(self.id.counter.clone(), g.generation, shard_of_event(event_id, g.shards));
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

    /// Decides, writes and answers one batch of pending submissions.
    #[tracing::instrument(level = "debug", skip_all, fields(shard = %self.id, pending = self.pending.len()))]
    async fn commit(&mut self) {
        let take = self.pending.len().min(COMMIT_SUBMISSIONS_MAX);
        let batch: Vec<Pending> = self.pending.drain(..take).collect();
        if batch.is_empty() {
            return;
        }
        let now = self.ctx.now_ms();
        self.last_active_ms = now;
        // On an error the replies are dropped: the caller reports the shard
        // unavailable, and a retry with the same event id is safe. Acknowledged
        // buffered sums are not lost: their caller gives them back to its
        // accumulator and delivers them again.
        if let Err(e) = self.try_commit(batch, now).await {
            tracing::error!(shard = %self.id, error = %e, "shard commit failed");
            // The failed commit changed nothing in the store; forget what we decided.
            match load(&self.ctx, &self.id, &self.meta) {
                Ok((core, bytes)) => (self.core, self.sketch_bytes) = (core, bytes),
                Err(e2) => {
                    // This copy's values are ahead of the store and cannot be put
                    // back: it must not decide again. It stops; the next request
                    // starts a copy from the store.
                    tracing::error!(shard = %self.id, error = %e2, "cannot reload shard; stopping it");
                    self.broken = true;
                }
            }
        }
    }

    async fn try_commit(&mut self, batch: Vec<Pending>, now: u64) -> Result<(), TallyError> {
        if self.ctx.flusher.poisoned() {
            return Err(StoreError::Io { op: "flush", message: "an earlier flush failed".into() }.into());
        }
        let mut prior = BTreeMap::new();
        for (sub, _) in &batch {
            let id = match sub {
                Submission::Single { event_id: Some(id), .. } => Some(id),
                Submission::Buffered { drain_id: Some(id), .. } => Some(id),
                _ => None,
            };
            if let Some(id) = id {
                if !prior.contains_key(id) {
                    if let Some(r) = self.prior(id, now).await? {
                        prior.insert(id.clone(), r);
                    }
                }
            }
        }
        let subs: Vec<Submission> = batch.iter().map(|(s, _)| s.clone()).collect();
        let before = self.core.value;
        let decision = decide(&mut self.core, &subs, &prior, now, self.meta.spec.dedup_window_ms());
        let value = decision.value;
        let writes = decision.writes(before);

        // Buffered sums were acknowledged already (the aggregator flushes after its
        // drain), so they are answered once the write is applied. `sync` answers wait
        // for the flush: a duplicate's too, since the record it matched may not be
        // durable yet.
        let sync = self.meta.spec.durability == Durability::Sync;
        let (mut now_replies, mut later) = (Vec::new(), Vec::new());
        for ((sub, reply), outcome) in batch.into_iter().zip(decision.outcomes) {
            let done = ShardReply::Done { outcome, value };
            if sync && matches!(sub, Submission::Single { .. }) {
                later.push((reply, done));
            } else {
                now_replies.push((reply, done));
            }
        }
        let durable: Option<Waiter> = (!later.is_empty()).then(|| -> Waiter {
            Box::new(move |r: Result<(), StoreError>| {
                if r.is_ok() {
                    for (reply, done) in later {
                        let _ = reply.send(done);
                    }
                }
            })
        });

        // Counted before the write is applied, so a rollup that finds no change knows
        // no write is on its way either.
        if decision.change_abs > 0 {
            if let Some(rt) = self.ctx.registry.get(self.id.counter.as_str()) {
                rt.changed.fetch_add(decision.change_abs, Relaxed);
            }
        }
        if writes {
            if decision.sketch_changed {
                self.sketch_bytes = self.core.sketch.as_ref().map(DistinctSketch::to_bytes);
            }
            let write = ShardWrite {
                image: ShardImage { value, sketch: self.sketch_bytes.clone() },
                dedup_put: decision.dedup_put,
                dedup_remove: Vec::new(),
            };
            // The commit path applies it (and runs `durable` after the flush that
            // follows); meanwhile this actor's mailbox fills the next batch.
            self.ctx.flusher.commit(self.id.clone(), write, durable).await?;
            self.ctx.stats.commits.inc();
            self.ctx.stats.commit_submissions.record(subs.len() as u64);
        } else if let Some(w) = durable {
            self.ctx.flusher.after_flush(w);
        }
        for (reply, done) in now_replies {
            let _ = reply.send(done);
        }
        Ok(())
    }
}
