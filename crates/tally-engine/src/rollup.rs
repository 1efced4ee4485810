//! The rollup: one per node. It caches counter totals so hot reads cost one message
//! instead of a fan-out over every shard. A cached total is refreshed every
//! `rollup_ms`, or sooner once enough change has accumulated
//! ([`tally_core::rollup::refresh_due`]); each answer states its age.

use crate::api::{Consistency, ValueRead};
use crate::ctx::Ctx;
use crate::error::TallyError;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::HashMap;
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tally_core::rollup::refresh_due;
use tally_core::CounterName;

/// Messages the rollup takes.
pub(crate) enum RollupMsg {
    /// The cached total of a counter (computed now if not cached yet).
    Get { name: CounterName, reply: RpcReplyPort<Result<ValueRead, TallyError>> },
    /// Refresh what is due.
    Tick,
    /// Forget a counter (deleted).
    Forget(CounterName),
}

impl ractor::Message for RollupMsg {}

/// The rollup actor.
pub(crate) struct Rollup;

struct Cached {
    read: ValueRead,
    rollup_ms: u32,
    last_read_ms: u64,
}

/// Cached totals by counter.
pub(crate) struct RollupState {
    ctx: Weak<Ctx>,
    cache: HashMap<CounterName, Cached>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl Actor for Rollup {
    type Msg = RollupMsg;
    type State = RollupState;
    type Arguments = Weak<Ctx>;

    async fn pre_start(
        &self,
        myself: ActorRef<RollupMsg>,
        ctx: Weak<Ctx>,
    ) -> Result<RollupState, ActorProcessingErr> {
        let tick_ms = ctx.upgrade().map(|c| c.config.rollup_tick_ms).unwrap_or(10);
        let ticker = myself.send_interval(Duration::from_millis(tick_ms), || RollupMsg::Tick);
        Ok(RollupState { ctx, cache: HashMap::new(), ticker: Some(ticker) })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RollupMsg>,
        state: &mut RollupState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<RollupMsg>,
        msg: RollupMsg,
        state: &mut RollupState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(ctx) = state.ctx.upgrade() else { return Ok(()) };
        match msg {
            RollupMsg::Get { name, reply } => {
                let now = ctx.now_ms();
                let answer = match state.cache.get_mut(&name) {
                    Some(c) => {
                        c.last_read_ms = now;
                        Ok(aged(&c.read, now))
                    }
                    None => state.load(&ctx, name).await,
                };
                let _ = reply.send(answer);
            }
            RollupMsg::Tick => state.refresh_due(&ctx).await,
            RollupMsg::Forget(name) => {
                state.cache.remove(&name);
            }
        }
        Ok(())
    }
}

fn aged(read: &ValueRead, now: u64) -> ValueRead {
    ValueRead {
        staleness_ms: now.saturating_sub(read.as_of_ms),
        consistency: Consistency::Cached,
        ..read.clone()
    }
}

impl RollupState {
    async fn load(&mut self, ctx: &Arc<Ctx>, name: CounterName) -> Result<ValueRead, TallyError> {
        let rt = ctx.runtime(name.as_str(), false).await?;
        rt.changed.store(0, SeqCst);
        let mut read = crate::read::sum_shards(ctx, &rt.meta, &name).await?;
        read.consistency = Consistency::Cached;
        if self.cache.len() >= ctx.config.rollup_tracked_max {
            // Full: serve this read uncached rather than evict a hot entry.
            return Ok(read);
        }
        let now = ctx.now_ms();
        self.cache.insert(
            name,
            Cached { read: read.clone(), rollup_ms: rt.meta.spec.rollup_ms, last_read_ms: now },
        );
        Ok(aged(&read, now))
    }

    async fn refresh_due(&mut self, ctx: &Arc<Ctx>) {
        let now = ctx.now_ms();
        let idle_ms = ctx.config.rollup_idle_evict_ms;
        self.cache.retain(|_, c| now.saturating_sub(c.last_read_ms) < idle_ms);
        let names: Vec<CounterName> = self.cache.keys().cloned().collect();
        for name in names {
            let Some(c) = self.cache.get(&name) else { continue };
            let rt = ctx.registry.get(name.as_str()).map(|r| r.clone());
            let changed = rt.as_ref().map_or(0, |r| r.changed.load(Relaxed));
            if !refresh_due(now, c.read.as_of_ms, c.rollup_ms, c.read.value, changed) {
                continue;
            }
            let meta = match rt {
                Some(rt) => {
                    rt.changed.store(0, SeqCst);
                    rt.meta.clone()
                }
                None => match ctx.catalog.get(name.as_str()) {
                    Ok(Some(m)) => Arc::new(m),
                    _ => {
                        self.cache.remove(&name);
                        continue;
                    }
                },
            };
            match crate::read::sum_shards(ctx, &meta, &name).await {
                Ok(read) => {
                    if let Some(c) = self.cache.get_mut(&name) {
                        c.read = read;
                        c.rollup_ms = meta.spec.rollup_ms;
                    }
                }
                Err(e) => {
                    tracing::warn!(counter = %name, error = %e, "rollup refresh failed; serving the last total")
                }
            }
        }
    }
}
