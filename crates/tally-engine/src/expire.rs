//! Expired counters: gone for reads at once, reclaimed soon after.
//!
//! A counter's deadline (`CounterMeta::expires_at_ms`, [`tally_core::expiry`]) is
//! checked wherever its metadata is used: from that instant on a read answers it
//! missing, and a write deletes it first and creates it anew (Redis's `INCR` on an
//! expired key counts from 1). Only counters with a deadline read the clock for it.
//!
//! Its memory and disk are reclaimed by deleting it as `DEL` does
//! (`MetaCommand::DeleteExpired`, which deletes only a counter still expired when it
//! is applied, so a deadline moved meanwhile keeps it): a task here asks the catalog
//! every [`TallyConfig::expiry_sweep_ms`](crate::TallyConfig) for the counters due
//! and reclaims up to [`EXPIRED_RECLAIMS_PER_SWEEP_MAX`] of them, so a counter is
//! reclaimed within one sweep interval of its deadline, plus its deletion's time,
//! while no more than that many expire per interval (a larger burst is reclaimed at
//! that rate). In a cluster only the metadata leader sweeps; a write that meets an
//! expired counter reclaims it on any node.

use crate::ctx::Ctx;
use crate::error::TallyError;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;
use tally_core::meta::{MetaCommand, MetaEffect};
use tally_core::CounterName;

/// Most expired counters one sweep reclaims: each costs a metadata change and the
/// deletion of its shards, so a burst of expiries is spread over several sweeps
/// instead of one long pass.
pub const EXPIRED_RECLAIMS_PER_SWEEP_MAX: usize = 1_024;

/// Most reclaims of one sweep that run at once.
const RECLAIMS_CONCURRENT_MAX: usize = 16;

/// Deletes `name` if it has expired: its metadata, its shards' data everywhere, and
/// what this node keeps of it in memory. True if this call deleted it.
pub(crate) async fn reap(ctx: &Arc<Ctx>, name: &CounterName) -> Result<bool, TallyError> {
    let (_, effect) = ctx.catalog.apply(name, &MetaCommand::DeleteExpired, ctx.now_ms()).await?;
    if !matches!(effect, MetaEffect::Deleted(_)) {
        return Ok(false);
    }
    ctx.stats.expired_reclaimed.inc();
    ctx.forget_deleted(name);
    ctx.finish_delete(name).await?;
    Ok(true)
}

/// Starts the task that reclaims expired counters; it ends when the engine is gone
/// or closing.
pub(crate) fn watch(ctx: &Arc<Ctx>) {
    let every = Duration::from_millis(ctx.config.expiry_sweep_ms.max(1));
    let weak = Arc::downgrade(ctx);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let Some(ctx) = weak.upgrade() else { return };
            if ctx.closing.load(SeqCst) {
                return;
            }
            sweep(&ctx).await;
        }
    });
}

/// One sweep: reclaims the counters whose deadline has passed.
async fn sweep(ctx: &Arc<Ctx>) {
    if !ctx.catalog.reclaims_expired() {
        return;
    }
    let due = match ctx.catalog.expired(ctx.now_ms(), EXPIRED_RECLAIMS_PER_SWEEP_MAX) {
        Ok(due) => due,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list expired counters");
            return;
        }
    };
    use futures::StreamExt;
    futures::stream::iter(due)
        .for_each_concurrent(RECLAIMS_CONCURRENT_MAX, |name| async move {
            if let Err(e) = reap(ctx, &name).await {
                tracing::warn!(counter = %name, error = %e, "reclaiming an expired counter failed; retrying later");
            }
        })
        .await;
}
