//! [`CounterHandle`]: a counter resolved once, so a hot loop skips the name lookup.
//!
//! [`crate::Tally::incr`] finds a counter by name on every call: a comparison with
//! the thread's last runtime, or a shared-map lookup. A handle keeps the counter's
//! runtime, so a batched increment through it is a route and an accumulator add.
//! Anything the accumulator cannot take (an event id, a `sync` counter, a frequency
//! item, a full or closed slot) and a runtime that was replaced (the counter was
//! resharded, changed, deleted or evicted) take the general path by name, with
//! exactly its semantics: a handle never counts differently from `incr`.

use crate::api::{IncrOutcome, Increment};
use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::runtime::CounterRuntime;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// A resolved counter: [`crate::Tally::handle`] makes one. Cheap to clone; every
/// clone counts into the same counter of the same engine.
#[derive(Clone)]
pub struct CounterHandle {
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) rt: Arc<CounterRuntime>,
}

impl std::fmt::Debug for CounterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CounterHandle").field("counter", &self.rt.name.as_str()).finish()
    }
}

impl CounterHandle {
    /// The counter's name.
    pub fn name(&self) -> &str {
        self.rt.name.as_str()
    }

    /// Counts one increment, as [`crate::Tally::incr`] does with this counter's name.
    pub async fn incr(&self, inc: Increment) -> Result<IncrOutcome, TallyError> {
        if self.ctx.try_handle_fast(&self.rt, &inc)? {
            drop(inc);
            // As on the named fast path: a writer that never waits must still give
            // its worker thread back now and then.
            tokio::task::consume_budget().await;
            return Ok(IncrOutcome::APPLIED);
        }
        self.ctx.incr(self.rt.name.as_str(), inc).await
    }

    /// Counts `delta` (no event id, writer or member): `incr(Increment::new(delta))`,
    /// the leanest call for a hot loop.
    pub async fn incr_by(&self, delta: i64) -> Result<IncrOutcome, TallyError> {
        // A temporary, built again below if needed (it allocates nothing): it is
        // never held across the yield, so the fast call's future stays small.
        if self.ctx.try_handle_fast(&self.rt, &Increment::new(delta))? {
            tokio::task::consume_budget().await;
            return Ok(IncrOutcome::APPLIED);
        }
        self.ctx.incr(self.rt.name.as_str(), Increment::new(delta)).await
    }

    /// Whether the runtime this handle resolved is still the counter's current one on
    /// this node. Once it is not (a resharding, a spec change, a deletion, or an
    /// idle eviction), every increment takes the general path by name; resolve the
    /// counter again (`Tally::handle`) to get the fast path back.
    pub fn is_current(&self) -> bool {
        !self.rt.retired.load(Relaxed)
    }
}
