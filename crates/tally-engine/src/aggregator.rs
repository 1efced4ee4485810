//! The aggregator: one per node. It drains accumulator slots into shard messages —
//! each counter once per `flush_ms`, or sooner when a slot fills — then asks for one
//! flush, so a `batched` counter loses at most one window (plus the flush in flight)
//! when the node crashes. Deliveries run beside the actor and many at once, so a
//! slow node delays only the sums bound for it; a sum whose answer is lost is in
//! doubt and is resent with its drain id (see `tally_core::drain_book`).
//! It also evicts counters that went idle and prunes old sealed generations.
//!
//! Windows are timed on the runtime's monotonic clock, not the wall clock: a wall
//! clock stepped back (NTP correcting a clock that ran ahead) would otherwise hold
//! every buffer for the step's length, a loss window of minutes where `flush_ms`
//! was promised.

use crate::ctx::Ctx;
use crate::messages::AggregatorMsg;
use crate::runtime::CounterRuntime;
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often idle counters are looked for, in milliseconds.
pub const EVICTION_SWEEP_MS: u64 = 1_000;
/// Most counters one drain round delivers at once, so a slow or unreachable node
/// holds back only the sums bound for it, not every counter's.
pub const DRAINS_CONCURRENT_MAX: usize = 64;
/// How long a shutdown keeps trying to deliver buffered and in-doubt sums, in
/// milliseconds, before it reports what it could not deliver.
pub const SHUTDOWN_DELIVER_MS: u64 = 5_000;
/// Pause between a shutdown's delivery rounds, in milliseconds.
const SHUTDOWN_ROUND_PAUSE_MS: u64 = 50;

/// The aggregator actor.
pub(crate) struct Aggregator;

/// Counters waiting for their window to end.
pub(crate) struct AggregatorState {
    ctx: Weak<Ctx>,
    /// What the monotonic times below count from.
    started: tokio::time::Instant,
    /// (runtime, due time in monotonic ms), in arrival order.
    pending: Vec<(Arc<CounterRuntime>, u64)>,
    /// When the last housekeeping ran, in monotonic ms.
    last_sweep_ms: u64,
    dormant: crate::dormant::DormantSweep,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl Actor for Aggregator {
    type Msg = AggregatorMsg;
    type State = AggregatorState;
    type Arguments = Weak<Ctx>;

    async fn pre_start(
        &self,
        myself: ActorRef<AggregatorMsg>,
        ctx: Weak<Ctx>,
    ) -> Result<AggregatorState, ActorProcessingErr> {
        let tick_ms = ctx.upgrade().map(|c| c.config.aggregator_tick_ms).unwrap_or(5);
        let ticker = myself.send_interval(Duration::from_millis(tick_ms), || AggregatorMsg::Tick);
        Ok(AggregatorState {
            ctx,
            started: tokio::time::Instant::now(),
            pending: Vec::new(),
            last_sweep_ms: 0,
            dormant: Default::default(),
            ticker: Some(ticker),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<AggregatorMsg>,
        state: &mut AggregatorState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<AggregatorMsg>,
        msg: AggregatorMsg,
        state: &mut AggregatorState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(ctx) = state.ctx.upgrade() else { return Ok(()) };
        match msg {
            AggregatorMsg::Tick | AggregatorMsg::FlushNow => {
                state.collect(&ctx);
                let elapsed = state.elapsed_ms();
                let due = state.take_due(elapsed, false);
                // Deliveries run beside the actor: a shard that answers slowly delays
                // the sums bound for it, never the next window of other counters.
                if !due.is_empty() {
                    let ctx = ctx.clone();
                    tokio::spawn(async move { drain_and_flush(&ctx, due).await });
                }
                if ctx.drains.lock().in_doubt_increments() > 0 && !ctx.resending.swap(true, SeqCst) {
                    let ctx = ctx.clone();
                    tokio::spawn(async move {
                        ctx.resend_in_doubt(None).await;
                        ctx.resending.store(false, SeqCst);
                    });
                }
                if elapsed.saturating_sub(state.last_sweep_ms) >= EVICTION_SWEEP_MS {
                    state.last_sweep_ms = elapsed;
                    let now = ctx.now_ms();
                    sweep(&ctx, now);
                    state.dormant.tick(&ctx, now);
                }
            }
            AggregatorMsg::FlushAll { reply } => {
                let _ = reply.send(state.deliver_everything(&ctx).await);
            }
        }
        Ok(())
    }
}

impl AggregatorState {
    /// Monotonic milliseconds since the aggregator started.
    fn elapsed_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Delivers every buffered and in-doubt sum, in rounds until nothing is left or
    /// [`SHUTDOWN_DELIVER_MS`] has passed; then flushes. Answers how many acknowledged
    /// increments are still undelivered (0 when the shutdown loses nothing).
    async fn deliver_everything(&mut self, ctx: &Arc<Ctx>) -> u64 {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(SHUTDOWN_DELIVER_MS);
        loop {
            // In name order, not the map's: the same state drains in the same order.
            let mut runtimes: Vec<Arc<CounterRuntime>> =
                ctx.registry.iter().map(|rt| rt.value().clone()).collect();
            runtimes.sort_by(|a, b| a.name.cmp(&b.name));
            for rt in runtimes {
                if rt.holds_buffered() && rt.claim_dirty() {
                    ctx.queue_dirty(&rt);
                }
            }
            self.collect(ctx);
            let all = self.take_due(u64::MAX, true);
            drain_and_flush(ctx, all).await;
            ctx.resend_in_doubt(None).await;
            let left = undelivered(ctx);
            // A drain started by an earlier tick may still be delivering: its sum is
            // neither buffered nor in doubt yet, so wait for it too.
            let in_flight = ctx
                .registry
                .iter()
                .flat_map(|rt| rt.lineage(crate::ctx::PREDECESSORS_MAX))
                .any(|rt| rt.drains_in_flight.load(SeqCst) > 0);
            if (left == 0 && !in_flight) || tokio::time::Instant::now() >= deadline {
                let _ = ctx.flusher.flush().await;
                if left > 0 {
                    ctx.stats.buffered_lost.add(left);
                    tracing::error!(
                        increments = left,
                        "shutting down with acknowledged buffered increments undelivered"
                    );
                }
                return left;
            }
            tokio::time::sleep(Duration::from_millis(SHUTDOWN_ROUND_PAUSE_MS)).await;
        }
    }

    /// Moves newly dirty counters into the pending list with their due times.
    fn collect(&mut self, ctx: &Ctx) {
        let fresh = std::mem::take(&mut *ctx.dirty.lock());
        let now = self.elapsed_ms();
        for rt in fresh {
            let due = now + u64::from(rt.meta.spec.flush_ms);
            self.pending.push((rt, due));
        }
    }

    /// Takes the runtimes due now out of `pending`, in place: a tick with thousands
    /// of new counters pending allocated two lists of all of them.
    fn take_due(&mut self, now: u64, all: bool) -> Vec<Arc<CounterRuntime>> {
        let mut due = Vec::new();
        self.pending.retain(|(rt, at)| {
            let take = all || *at <= now || rt.flush_requested.load(SeqCst) || rt.retired.load(SeqCst);
            if take {
                due.push(rt.clone());
            }
            !take
        });
        due
    }
}

/// Acknowledged increments this node still holds: buffered in a runtime, or in a
/// sum whose delivery is in doubt.
fn undelivered(ctx: &Ctx) -> u64 {
    let buffered: u64 = ctx
        .registry
        .iter()
        .flat_map(|rt| rt.lineage(crate::ctx::PREDECESSORS_MAX))
        .map(|rt| rt.slots.iter().map(|s| s.count.load(SeqCst)).sum::<u64>())
        .sum();
    buffered + ctx.drains.lock().increments()
}

async fn drain_and_flush(ctx: &Arc<Ctx>, due: Vec<Arc<CounterRuntime>>) {
    if due.is_empty() {
        return;
    }
    futures::stream::iter(due)
        .for_each_concurrent(DRAINS_CONCURRENT_MAX, |rt| async move {
            ctx.drain(&rt).await;
        })
        .await;
    if let Err(e) = ctx.flusher.flush().await {
        tracing::error!(error = %e, "flush after drain failed");
    }
}

/// Housekeeping once per [`EVICTION_SWEEP_MS`]: idle runtimes go, replaced runtimes
/// that hold nothing are forgotten, and counters whose sealed generations have left
/// their dedup window are pruned.
fn sweep(ctx: &Arc<Ctx>, now: u64) {
    evict_idle(ctx, now);
    let mut prune = Vec::new();
    for rt in ctx.registry.iter() {
        rt.forget_quiet_predecessors();
        if rt.meta.prune_due(now) {
            prune.push(rt.name.clone());
        }
    }
    prune.sort();
    for name in prune {
        crate::reshard::ensure_pruned(ctx, &name);
    }
}

/// Drops runtimes unused for the configured time. A dropped runtime is queued once
/// more, so anything a late writer added still drains.
fn evict_idle(ctx: &Ctx, now: u64) {
    let limit = ctx.config.counter_idle_evict_ms;
    let mut gone = Vec::new();
    ctx.registry.retain(|_, rt| {
        let idle = now.saturating_sub(rt.last_used_ms.load(Relaxed)) >= limit && !rt.holds_buffered();
        if idle {
            gone.push(rt.clone());
        }
        !idle
    });
    gone.sort_by(|a, b| a.name.cmp(&b.name));
    for rt in gone {
        rt.retired.store(true, SeqCst);
        if rt.holds_buffered() {
            ctx.queue_dirty(&rt);
        }
    }
}
