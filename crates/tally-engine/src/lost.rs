//! Shards whose earlier values this node lost.
//!
//! Each shard has one copy, on its owner. A node whose disk was replaced comes back
//! with empty shards: reading them would count as zero what was acknowledged before.
//! Until an operator accepts the loss, such a node refuses to read its shards, so
//! every fresh read that includes one lists it in `missing_shards` with
//! `complete: false` (DESIGN invariant 5) instead of returning a short total as
//! complete. Writes are still accepted; they count once the loss is accepted.

use crate::error::TallyError;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use tally_core::ShardId;

/// Whether this node's shards may lack values they had before (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct LostData {
    lost: AtomicBool,
}

impl LostData {
    /// Marks this node's shards as lost (`true`) or whole again.
    pub(crate) fn set(&self, lost: bool) {
        let was = self.lost.swap(lost, SeqCst);
        if was != lost {
            tracing::warn!(
                lost,
                "reads of this node's shards are {}",
                if lost { "refused" } else { "served" }
            );
        }
    }

    /// Whether the shards are marked lost.
    pub(crate) fn get(&self) -> bool {
        self.lost.load(SeqCst)
    }

    /// Refuses a read of `id` while the shards are marked lost.
    pub(crate) fn check(&self, id: &ShardId) -> Result<(), TallyError> {
        if self.get() {
            return Err(crate::error::unavailable(
                id,
                "this node's store was replaced and the shard's earlier value is lost; \
                 an operator must accept the loss (tally cluster accept-loss NODE)",
            ));
        }
        Ok(())
    }
}
