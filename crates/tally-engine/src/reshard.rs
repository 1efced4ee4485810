//! Resharding a live counter: seal the current generation, carry its sum and sketch
//! into the next one, and open it (see [`tally_core::meta`] for why this loses and
//! doubles nothing). The task is idempotent: after a crash it runs again from the
//! start and reaches the same result.
//!
//! Sealed generations are pruned once every record in them has expired
//! ([`CounterMeta::sealed_retention_ms`]): their shards' data is deleted first, then
//! the metadata drops them. Deleting first is safe — a lookup in an expired
//! generation finds nothing that still counts — and a deletion that fails leaves the
//! generation listed, so the next sweep retries it.
//!
//! [`CounterMeta::sealed_retention_ms`]: tally_core::meta::CounterMeta::sealed_retention_ms

use crate::ctx::Ctx;
use crate::error::unavailable;
use crate::error::TallyError;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tally_core::meta::{MetaCommand, MetaEffect};
use tally_core::reshard_machine::{ReshardEffect, ReshardInput, ReshardMachine};
use tally_core::CounterName;

/// Pause before retrying a resharding that failed (a store error, say).
const RESHARD_RETRY_BACKOFF_MS: u64 = 100;

/// Starts the task that resumes reshardings: whenever the engine installs metadata
/// of a counter with a resharding in progress, it queues the counter and wakes this
/// task, which runs the resharding (one task per counter, until it completes). Ends
/// when the engine is gone or closing.
pub(crate) fn watch(ctx: &Arc<Ctx>) {
    let wake = ctx.reshard_wake.clone();
    let weak = Arc::downgrade(ctx);
    tokio::spawn(async move {
        loop {
            wake.notified().await;
            let Some(ctx) = weak.upgrade() else { return };
            if ctx.closing.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let names = std::mem::take(&mut *ctx.reshard_queue.lock());
            for name in names {
                spawn_resharding(ctx.clone(), name);
            }
        }
    });
}

/// Runs `name`'s resharding until it completes (or the engine closes).
fn spawn_resharding(ctx: Arc<Ctx>, name: CounterName) {
    tokio::spawn(async move {
        while !ctx.closing.load(std::sync::atomic::Ordering::SeqCst) {
            match run(&ctx, &name).await {
                Ok(()) => break,
                Err(TallyError::ShuttingDown) => break,
                Err(e) => {
                    tracing::warn!(counter = %name, error = %e, "resharding failed; retrying");
                    tokio::time::sleep(Duration::from_millis(RESHARD_RETRY_BACKOFF_MS)).await;
                }
            }
        }
        ctx.resharding.remove(&name);
    });
}

/// One pass of `name`'s resharding: the machine says what to do, this task does it,
/// one step after another. Every step may repeat after a crash or a failed pass.
async fn run(ctx: &Arc<Ctx>, name: &CounterName) -> Result<(), TallyError> {
    let Some(meta) = ctx.catalog.get(name.as_str())? else { return Ok(()) };
    let Some(machine) = ReshardMachine::new(name.clone(), &meta.layout) else { return Ok(()) };
    let mut machine = machine.in_class(meta.spec.replica_class());
    let meta = Arc::new(meta);
    // Buffered increments go out first; what arrives later finds sealed shards and
    // waits in its accumulator for the new generation.
    if let Some(rt) = ctx.registry.get(name.as_str()).map(|r| r.clone()) {
        ctx.drain(&rt).await;
    }
    let mut effects: VecDeque<ReshardEffect> = step(&mut machine, ReshardInput::Outstanding)?.into();
    while let Some(effect) = effects.pop_front() {
        let next = match effect {
            ReshardEffect::Seal(id) => {
                let image = ctx.seal_shard(&id, &meta).await?;
                ReshardInput::Sealed { index: id.index, image }
            }
            ReshardEffect::MergeSketch { shard, sketch, frequency, windows } => {
                // The next generation takes no writes until the metadata opens it;
                // merging again after a crash is harmless.
                ctx.merge_sketch(&shard, sketch, frequency, windows).await?;
                ReshardInput::Merged
            }
            ReshardEffect::Complete { generation, sealed_sum } => {
                ctx.apply_meta(name, &MetaCommand::CompleteReshard { generation, sealed_sum }).await?;
                tracing::info!(counter = %name, generation = generation + 1, "resharding complete");
                return Ok(());
            }
        };
        effects.extend(step(&mut machine, next)?);
    }
    Ok(())
}

fn step(machine: &mut ReshardMachine, input: ReshardInput) -> Result<Vec<ReshardEffect>, TallyError> {
    machine.step(input).map_err(|e| unavailable(&machine.shard(machine.generation(), 0), &e.to_string()))
}

/// Starts pruning `name`'s expired sealed generations unless that is running.
pub(crate) fn ensure_pruned(ctx: &Arc<Ctx>, name: &CounterName) {
    if ctx.pruning.insert(name.clone(), ()).is_some() {
        return;
    }
    let ctx = ctx.clone();
    let name = name.clone();
    tokio::spawn(async move {
        if let Err(e) = prune(&ctx, &name).await {
            tracing::warn!(counter = %name, error = %e, "pruning sealed generations failed; the next sweep retries");
        }
        ctx.pruning.remove(&name);
    });
}

/// Deletes the data of `name`'s sealed generations whose records have all expired,
/// then drops them from the metadata.
pub(crate) async fn prune(ctx: &Arc<Ctx>, name: &CounterName) -> Result<(), TallyError> {
    let Some(meta) = ctx.catalog.get(name.as_str())? else { return Ok(()) };
    let now = ctx.now_ms();
    if !meta.prune_due(now) {
        return Ok(());
    }
    let retention_ms = meta.sealed_retention_ms();
    for g in
        meta.layout.sealed.iter().filter(|g| tally_core::dedup::expired(g.sealed_at_ms, now, retention_ms))
    {
        for index in 0..g.shards {
            ctx.delete_shard_anywhere(&meta.shard_id(name, g.generation, index), Some(meta.created_at_ms))
                .await?;
        }
    }
    ctx.flusher.flush().await?;
    let (_, effect) = ctx.apply_meta(name, &MetaCommand::PruneSealed).await?;
    if let MetaEffect::Pruned(gone) = effect {
        tracing::info!(counter = %name, generations = gone.len(), "pruned sealed generations");
    }
    Ok(())
}
