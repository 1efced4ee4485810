//! Expiry for shards that no actor runs.
//!
//! A shard actor sweeps its expired dedup records while it runs, and an idle one
//! retires long before a day-long window ends, so the records of a shard nobody
//! writes to again would stay on disk for ever. Once per `dedup_sweep_ms` this pass
//! walks the shards in the store, [`DORMANT_SHARDS_PER_TICK`] per housekeeping tick,
//! and starts the actor of each local shard of a live generation whose first page
//! of records holds one due for a sweep ([`tally_core::sweep`]: past its window by an
//! eighth of it): an actor sweeps a whole pass when it starts, then retires again
//! when idle. A shard nobody writes to takes no new records, so every record of it
//! is, in time, among the due ones of its first page.
//! The store decides nothing here; only the shard (its machine) deletes records.

use crate::ctx::Ctx;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use tally_core::ShardId;

/// Stored shards one housekeeping tick looks at, at most.
pub const DORMANT_SHARDS_PER_TICK: usize = 64;

/// Where the pass over the stored shards is.
#[derive(Default)]
pub(crate) struct DormantSweep {
    /// The last shard looked at, while a pass is under way.
    after: Option<ShardId>,
    passing: bool,
    last_pass_ms: u64,
    /// A page is being looked at (one at a time).
    busy: Arc<AtomicBool>,
}

impl DormantSweep {
    /// Looks at the next page of stored shards when a pass is under way or due.
    pub(crate) fn tick(&mut self, ctx: &Arc<Ctx>, now_ms: u64) {
        if !self.passing {
            if now_ms.saturating_sub(self.last_pass_ms) < ctx.config.dedup_sweep_ms {
                return;
            }
            self.passing = true;
            self.last_pass_ms = now_ms;
            self.after = None;
        }
        if self.busy.swap(true, SeqCst) {
            return;
        }
        let page = match ctx.store.shard_ids(self.after.as_ref(), DORMANT_SHARDS_PER_TICK) {
            Ok(page) => page,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list stored shards for expiry");
                self.busy.store(false, SeqCst);
                return;
            }
        };
        if page.len() < DORMANT_SHARDS_PER_TICK {
            self.passing = false;
        }
        self.after = page.last().cloned();
        let (ctx, busy) = (ctx.clone(), self.busy.clone());
        tokio::spawn(async move {
            for id in page {
                wake_if_expired(&ctx, &id, now_ms).await;
            }
            busy.store(false, SeqCst);
        });
    }
}

/// Starts `id`'s actor if no actor runs it, this node owns it, its generation takes
/// writes and its first page of records holds one due for a sweep.
async fn wake_if_expired(ctx: &Arc<Ctx>, id: &ShardId, now_ms: u64) {
    if ctx.directory.contains_key(id) || ctx.remote(id).is_some() {
        return;
    }
    let meta = match ctx.catalog.get(id.counter.as_str()) {
        Ok(Some(meta)) if meta.layout.generation == id.generation => meta,
        _ => return,
    };
    let window = meta.spec.dedup_window_ms();
    let page = match ctx.store.dedup_scan(id, None, ctx.config.dedup_sweep_records_max) {
        Ok(page) => page,
        Err(e) => {
            tracing::warn!(shard = %id, error = %e, "cannot read a dormant shard's dedup records");
            return;
        }
    };
    if !tally_core::sweep::any_due(&page, now_ms, window) {
        return;
    }
    ctx.stats.dormant_wakes.inc();
    if let Err(e) = ctx.shard(id, &Arc::new(meta)).await {
        tracing::warn!(shard = %id, error = %e, "cannot start a dormant shard to sweep it");
    }
}
