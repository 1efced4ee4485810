//! The shell of [`tally_core::autoshard`]: samples every auto counter's own signals on
//! a timer, feeds them to its machine, and carries out what the machine proposes
//! through the ordinary resharding (the same `Put` of a shard count a `PATCH` makes,
//! resumed by `reshard.rs`).
//!
//! The signals, per shard of the generation taking writes, all kept by this node's
//! runtime of the counter: the increments routed to it (`Slot::writes`, the same
//! count `GET …/shards` reports as skew) and the deepest queue of increments waiting
//! for its answer (`Slot::in_flight_peak`). Nothing is read from the store or the
//! network to sample, except the counter's metadata from the local catalog.
//!
//! One proposer per engine: this task is the only one that proposes an auto change
//! on this node, and its proposal is applied only if the counter's metadata is still
//! the version it sampled ([`Catalog::auto_reshard`]): a proposal crossing a `PATCH`
//! by hand, or another node's proposal, is refused, never undoes it.
//!
//! In a cluster every node follows every auto counter the (replicated) catalog
//! lists, each sampling the increments it routes. A node whose own view is hot
//! raises a counter; a lowering, and a raise that only the nodes' summed rates would
//! justify, are first confirmed by asking every other node for its view
//! ([`ShardRequest::AutoView`], answered by [`view`]): see
//! [`tally_core::autoshard`].
//!
//! [`ShardRequest::AutoView`]: crate::placement::ShardRequest::AutoView
//! [`Catalog::auto_reshard`]: crate::catalog::Catalog::auto_reshard

use crate::auto_book::Tracked;
use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::placement::{ShardRequest, ShardResponse};
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::Duration;
use tally_core::autoshard::{
    AutoEffect, AutoInput, AutoShardMachine, AutoStatus, Change, NodeView, PeerView, Sample,
};
use tally_core::meta::CounterMeta;
use tally_core::spec::AutoShards;
use tally_core::CounterName;

/// Most auto counters one node samples: every sample visits each of them.
pub const AUTO_COUNTERS_MAX: usize = 10_000;

/// Starts following the auto counters the catalog holds, and the sampling task (one
/// per engine). The task ends when the engine is gone or closing.
pub(crate) fn start(ctx: &Arc<Ctx>) -> Result<(), TallyError> {
    let now = ctx.now_ms();
    for (name, bounds) in ctx.catalog.auto_counters()? {
        if let Some(meta) = ctx.catalog.get(name.as_str())? {
            follow(ctx, &name, bounds, &meta, now);
        }
    }
    let weak = Arc::downgrade(ctx);
    let every = Duration::from_millis(ctx.config.autoshard.sample_ms);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(ctx) = weak.upgrade() else { return };
            if ctx.closing.load(SeqCst) {
                return;
            }
            sample_all(&ctx).await;
        }
    });
    Ok(())
}

/// Starts following `name` (or keeps following it) with `bounds`.
fn follow(ctx: &Ctx, name: &CounterName, bounds: AutoShards, meta: &CounterMeta, now_ms: u64) {
    let mut book = ctx.auto.0.lock();
    book.entry(name.clone()).or_insert_with(|| Tracked {
        machine: AutoShardMachine::new(ctx.config.autoshard, bounds, meta.layout.shards),
        baseline: None,
        sampled_at_ms: now_ms,
    });
}

/// Refuses a new auto counter beyond [`AUTO_COUNTERS_MAX`].
pub(crate) fn admit(ctx: &Ctx, name: &CounterName) -> Result<(), TallyError> {
    let book = ctx.auto.0.lock();
    if book.len() >= AUTO_COUNTERS_MAX && !book.contains_key(name) {
        return Err(TallyError::AutoCountersFull { max: AUTO_COUNTERS_MAX });
    }
    Ok(())
}

/// The counter's bounds were set (`Some`) or it became fixed (`None`): follow it, tell
/// its machine, and carry out a clamp into the new bounds at once.
pub(crate) async fn bounds_set(
    ctx: &Arc<Ctx>,
    name: &CounterName,
    bounds: Option<AutoShards>,
    meta: &CounterMeta,
) {
    let Some(bounds) = bounds else {
        forget(ctx, name);
        return;
    };
    let now = ctx.now_ms();
    follow(ctx, name, bounds, meta, now);
    let effects = step(ctx, name, now, AutoInput::Bounds(bounds));
    execute(ctx, name, meta.version, effects).await;
}

/// Stops following `name` (deleted, or fixed).
pub(crate) fn forget(ctx: &Ctx, name: &CounterName) {
    ctx.auto.0.lock().remove(name);
}

/// What this node has seen of `name`, for a node about to lower it (`None`: not
/// followed here).
pub(crate) fn view(ctx: &Ctx, name: &str) -> Option<PeerView> {
    let now = ctx.now_ms();
    ctx.auto.0.lock().get(name).map(|t| t.machine.view(now))
}

/// The machine's view of `name`, if it is an auto counter followed here; in a
/// cluster its last change is the newest any node that answers decided (each node's
/// machine records only its own).
pub(crate) async fn status(ctx: &Ctx, name: &CounterName) -> Option<AutoStatus> {
    let mut status = ctx.auto.0.lock().get(name).map(|t| t.machine.status())?;
    for view in ask_peers(ctx, name).await.into_iter().filter_map(|v| v.view) {
        let newest = |c: &Change| c.completed_at_ms.unwrap_or(0);
        if view.last_change.is_some_and(|c| status.last_change.is_none_or(|mine| newest(&c) > newest(&mine)))
        {
            status.last_change = view.last_change;
        }
    }
    Some(status)
}

fn step(ctx: &Ctx, name: &CounterName, now_ms: u64, input: AutoInput) -> Vec<AutoEffect> {
    ctx.auto.0.lock().get_mut(name).map(|t| t.machine.step(now_ms, input)).unwrap_or_default()
}

/// Follows what the catalog lists now: a counter made auto, or given new bounds, on
/// another node (a replicated catalog), and stops following those no longer listed.
async fn refresh(ctx: &Arc<Ctx>) {
    let listed: std::collections::HashMap<CounterName, AutoShards> = match ctx.catalog.auto_counters() {
        Ok(listed) => listed.into_iter().collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the auto counters");
            return;
        }
    };
    let now = ctx.now_ms();
    let (stale, known): (Vec<_>, Vec<_>) = {
        let book = ctx.auto.0.lock();
        book.iter()
            .map(|(name, t)| (name.clone(), t.machine.bounds()))
            .partition(|(name, _)| !listed.contains_key(name))
    };
    for (name, _) in stale {
        forget(ctx, &name);
    }
    let known: std::collections::HashMap<CounterName, AutoShards> = known.into_iter().collect();
    for (name, bounds) in listed {
        if known.get(&name) == Some(&bounds) {
            continue;
        }
        let Ok(Some(meta)) = ctx.catalog.get(name.as_str()) else { continue };
        if known.contains_key(&name) {
            let effects = step(ctx, &name, now, AutoInput::Bounds(bounds));
            execute(ctx, &name, meta.version, effects).await;
        } else if ctx.auto.0.lock().len() < AUTO_COUNTERS_MAX {
            follow(ctx, &name, bounds, &meta, now);
        }
    }
}

/// Asks every other node what it has seen of `name`; those that do not answer are
/// left out (a node that cannot be reached routes nothing this one could count).
async fn ask_peers(ctx: &Ctx, name: &CounterName) -> Vec<NodeView> {
    let Some(placement) = ctx.placement.clone() else { return Vec::new() };
    let asks = placement.peers().into_iter().map(|node| {
        let placement = placement.clone();
        let request = ShardRequest::AutoView { counter: name.clone() };
        async move {
            match placement.call(&node, request).await {
                Ok(ShardResponse::AutoView(view)) => Some(NodeView { node: node.to_string(), view }),
                other => {
                    tracing::debug!(counter = %name, %node, answer = ?other, "no auto view from a node");
                    None
                }
            }
        }
    });
    futures::future::join_all(asks).await.into_iter().flatten().collect()
}

/// One sample of every followed counter, each fed to its machine.
async fn sample_all(ctx: &Arc<Ctx>) {
    refresh(ctx).await;
    let nodes = ctx.placement.as_ref().map_or(1, |p| p.peers().len() + 1);
    let nodes = u16::try_from(nodes).unwrap_or(u16::MAX);
    let names: Vec<CounterName> = ctx.auto.0.lock().keys().cloned().collect();
    for name in names {
        let meta = match ctx.catalog.get(name.as_str()) {
            Ok(Some(meta)) => meta,
            Ok(None) => {
                forget(ctx, &name);
                continue;
            }
            Err(e) => {
                tracing::warn!(counter = %name, error = %e, "cannot read an auto counter's metadata");
                continue;
            }
        };
        let now = ctx.now_ms();
        let Some(mut sample) = take_sample(ctx, &name, &meta, now) else { continue };
        sample.nodes = nodes;
        let effects = step(ctx, &name, now, AutoInput::Sample(sample));
        execute(ctx, &name, meta.version, effects).await;
    }
}

/// Reads `name`'s signals since its previous sample and moves the baseline on.
fn take_sample(ctx: &Ctx, name: &CounterName, meta: &CounterMeta, now_ms: u64) -> Option<Sample> {
    let rt = ctx.registry.get(name.as_str()).map(|r| r.clone());
    let mut book = ctx.auto.0.lock();
    let tracked = book.get_mut(name)?;
    let elapsed_ms = now_ms.saturating_sub(tracked.sampled_at_ms);
    tracked.sampled_at_ms = now_ms;
    let mut sample = Sample {
        shards: meta.layout.shards,
        resharding: meta.layout.resharding.is_some(),
        elapsed_ms,
        ..Default::default()
    };
    // Only a runtime of the generation taking writes says anything about it.
    let Some(rt) = rt.filter(|rt| rt.meta.layout.generation == meta.layout.generation) else {
        tracked.baseline = None;
        return Some(sample);
    };
    let address = Arc::as_ptr(&rt) as usize;
    let writes: Vec<u64> = rt.slots.iter().map(|s| s.writes.load(Relaxed)).collect();
    let before = match &tracked.baseline {
        Some((a, w)) if *a == address && w.len() == writes.len() => w.clone(),
        // A runtime built since the last sample: everything it counted is new.
        _ => vec![0; writes.len()],
    };
    for (now, then) in writes.iter().zip(&before) {
        let delta = now.saturating_sub(*then);
        sample.writes = sample.writes.saturating_add(delta);
        sample.hottest_writes = sample.hottest_writes.max(delta);
    }
    for slot in rt.slots.iter() {
        // The peak restarts from what is waiting now, so a queue that stays full
        // shows in every sample.
        let peak = slot.in_flight_peak.swap(slot.in_flight.load(Relaxed), Relaxed);
        sample.queue_depth_max = sample.queue_depth_max.max(peak);
    }
    tracked.baseline = Some((address, writes));
    Some(sample)
}

/// Carries out the machine's effects; `version` is the metadata version they were
/// decided from.
async fn execute(ctx: &Arc<Ctx>, name: &CounterName, version: u64, effects: Vec<AutoEffect>) {
    let mut effects: std::collections::VecDeque<AutoEffect> = effects.into();
    while let Some(effect) = effects.pop_front() {
        match effect {
            AutoEffect::Propose(change) => {
                ctx.stats.auto_proposals.inc();
                tracing::info!(
                    counter = %name, from = change.from, to = change.to, reason = change.reason.as_str(),
                    "proposing an auto resharding"
                );
                if let Err(e) = propose(ctx, name, version, change.to).await {
                    let now = ctx.now_ms();
                    effects.extend(step(ctx, name, now, AutoInput::Refused { reason: e.to_string() }));
                }
            }
            AutoEffect::Confirm(change) => {
                tracing::debug!(counter = %name, from = change.from, to = change.to, "asking the other nodes before lowering");
                let views = ask_peers(ctx, name).await;
                let now = ctx.now_ms();
                effects.extend(step(ctx, name, now, AutoInput::Views(views)));
            }
            AutoEffect::Changed(change) => {
                ctx.stats.auto_changes.record(change.is_up(), change.reason);
                tracing::info!(
                    counter = %name, from = change.from, to = change.to, reason = change.reason.as_str(),
                    "auto resharding complete"
                );
            }
            AutoEffect::Dropped { change, reason } => {
                ctx.stats.auto_dropped.inc();
                tracing::info!(counter = %name, to = change.to, %reason, "auto resharding dropped");
            }
        }
    }
}

/// Reshards `name` to `shards` through the ordinary path, if its metadata is still
/// at `version` (or moved only by pruning expired sealed generations, done here
/// first as a `PATCH` does to make room).
async fn propose(ctx: &Arc<Ctx>, name: &CounterName, version: u64, shards: u16) -> Result<(), TallyError> {
    let mut version = version;
    if let Some(meta) = ctx.catalog.get(name.as_str())? {
        if meta.version == version && meta.prune_due(ctx.now_ms()) {
            crate::reshard::prune(ctx, name).await?;
            if let Some(after) = ctx.catalog.get(name.as_str())? {
                if after.spec == meta.spec && after.layout.shards == meta.layout.shards {
                    version = after.version;
                }
            }
        }
    }
    let (meta, _) = ctx.catalog.auto_reshard(name, version, shards, ctx.now_ms()).await?;
    if let Some(meta) = meta {
        // Installing the new metadata wakes the resharding task.
        ctx.install(name.clone(), meta);
    }
    Ok(())
}
