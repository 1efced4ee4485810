//! The aggregator: one per node. It drains accumulator slots into shard messages —
//! each counter once per `flush_ms`, or sooner when a slot fills — then asks for one
//! flush, so a `batched` counter loses at most one window (plus the flush in flight)
//! when the node crashes. It also evicts counters that went idle.

use crate::ctx::Ctx;
use crate::runtime::CounterRuntime;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often idle counters are looked for, in milliseconds.
pub const EVICTION_SWEEP_MS: u64 = 1_000;

/// Messages the aggregator takes.
pub(crate) enum AggregatorMsg {
    /// Drain what is due.
    Tick,
    /// A slot filled up: drain early.
    FlushNow,
    /// Drain everything now and flush; answer when durable (shutdown).
    FlushAll { reply: RpcReplyPort<()> },
}

impl ractor::Message for AggregatorMsg {}

/// The aggregator actor.
pub(crate) struct Aggregator;

/// Counters waiting for their window to end.
pub(crate) struct AggregatorState {
    ctx: Weak<Ctx>,
    /// (runtime, due time in ms), in arrival order.
    pending: Vec<(Arc<CounterRuntime>, u64)>,
    last_sweep_ms: u64,
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
        Ok(AggregatorState { ctx, pending: Vec::new(), last_sweep_ms: 0, ticker: Some(ticker) })
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
                let now = ctx.now_ms();
                let due = state.take_due(now, false);
                drain_and_flush(&ctx, due).await;
                ctx.retry_in_doubt().await;
                if now.saturating_sub(state.last_sweep_ms) >= EVICTION_SWEEP_MS {
                    state.last_sweep_ms = now;
                    evict_idle(&ctx, now);
                }
            }
            AggregatorMsg::FlushAll { reply } => {
                // Several rounds: a drain may give back sums it could not deliver.
                for _ in 0..3 {
                    for rt in ctx.registry.iter() {
                        if rt.holds_buffered() && rt.claim_dirty() {
                            ctx.queue_dirty(&rt);
                        }
                    }
                    state.collect(&ctx);
                    let all = state.take_due(u64::MAX, true);
                    ctx.retry_in_doubt().await;
                    if all.is_empty() && ctx.in_doubt.lock().is_empty() {
                        break;
                    }
                    drain_and_flush(&ctx, all).await;
                }
                let _ = ctx.flusher.flush().await;
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

impl AggregatorState {
    /// Moves newly dirty counters into the pending list with their due times.
    fn collect(&mut self, ctx: &Ctx) {
        let fresh = std::mem::take(&mut *ctx.dirty.lock());
        let now = ctx.now_ms();
        for rt in fresh {
            let due = now + u64::from(rt.meta.spec.flush_ms);
            self.pending.push((rt, due));
        }
    }

    fn take_due(&mut self, now: u64, all: bool) -> Vec<Arc<CounterRuntime>> {
        let (due, keep): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.pending).into_iter().partition(|(rt, due)| {
                all || *due <= now || rt.flush_requested.load(SeqCst) || rt.retired.load(SeqCst)
            });
        self.pending = keep;
        due.into_iter().map(|(rt, _)| rt).collect()
    }
}

async fn drain_and_flush(ctx: &Arc<Ctx>, due: Vec<Arc<CounterRuntime>>) {
    if due.is_empty() {
        return;
    }
    for rt in &due {
        ctx.drain(rt).await;
    }
    if let Err(e) = ctx.flusher.flush().await {
        tracing::error!(error = %e, "flush after drain failed");
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
    for rt in gone {
        rt.retired.store(true, SeqCst);
        if rt.holds_buffered() {
            ctx.queue_dirty(&rt);
        }
    }
}
