//! The read path: summing shards and merging sketches.

use crate::api::{Consistency, DistinctRead, ShardReport, ShardsReport, ValueRead};
use crate::ctx::Ctx;
use crate::error::TallyError;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tally_core::meta::CounterMeta;
use tally_core::sketch::DistinctSketch;
use tally_core::{CounterName, ShardId};

/// The counter's total: the sealed generations' `base` plus every current shard's
/// committed value. Each shard's value is read once from the store, where its actor
/// commits before it answers, so every acknowledged increment is included.
pub(crate) async fn sum_shards(
    ctx: &Arc<Ctx>,
    meta: &CounterMeta,
    name: &CounterName,
) -> Result<ValueRead, TallyError> {
    let mut total = meta.layout.base;
    for index in 0..meta.layout.shards {
        let id = ShardId::new(name.clone(), meta.layout.generation, index);
        total += i128::from(ctx.store.load_shard(&id)?.value);
    }
    let now = ctx.now_ms();
    Ok(ValueRead {
        value: total,
        consistency: Consistency::Fresh,
        as_of_ms: now,
        staleness_ms: 0,
        complete: true,
        missing_shards: Vec::new(),
    })
}

/// The merged distinct-count estimate of the current generation (a resharding merges
/// the sealed generation's sketches into the new one).
pub(crate) fn distinct(
    ctx: &Ctx,
    meta: &CounterMeta,
    name: &CounterName,
) -> Result<DistinctRead, TallyError> {
    let mut merged = DistinctSketch::new();
    for index in 0..meta.layout.shards {
        let id = ShardId::new(name.clone(), meta.layout.generation, index);
        if let Some(bytes) = ctx.store.load_shard(&id)?.sketch {
            let s = DistinctSketch::from_bytes(&bytes).map_err(|e| tally_store::StoreError::Corrupt {
                location: format!("sketch of shard {id}"),
                source: tally_core::codec::DecodeError { what: "sketch", reason: e.to_string() },
            })?;
            merged.merge(&s);
        }
    }
    Ok(DistinctRead {
        estimate: merged.estimate(),
        relative_error: DistinctSketch::relative_error(),
        complete: true,
        missing_shards: Vec::new(),
    })
}

/// Per-shard values and write skew.
pub(crate) fn shards(ctx: &Ctx, rt: &crate::runtime::CounterRuntime) -> Result<ShardsReport, TallyError> {
    let meta = &rt.meta;
    let mut shards = Vec::with_capacity(usize::from(meta.layout.shards));
    for index in 0..meta.layout.shards {
        let id = ShardId::new(rt.name.clone(), meta.layout.generation, index);
        shards.push(ShardReport {
            index,
            node: ctx.config.node_id.to_string(),
            value: ctx.store.load_shard(&id)?.value,
            writes: rt.slots[usize::from(index)].writes.load(Relaxed),
        });
    }
    Ok(ShardsReport {
        generation: meta.layout.generation,
        base: meta.layout.base,
        skew: skew(shards.iter().map(|s| s.writes)),
        shards,
    })
}

/// Hottest ÷ mean; 0 when nothing was written.
pub fn skew(writes: impl Iterator<Item = u64>) -> f64 {
    let (mut n, mut sum, mut max) = (0u64, 0u128, 0u64);
    for w in writes {
        n += 1;
        sum += u128::from(w);
        max = max.max(w);
    }
    if sum == 0 {
        return 0.0;
    }
    max as f64 / (sum as f64 / n as f64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn skew_is_hottest_over_mean() {
        assert_eq!(super::skew([0u64, 0].into_iter()), 0.0);
        assert_eq!(super::skew([5u64, 5, 5, 5].into_iter()), 1.0);
        assert_eq!(super::skew([8u64, 0, 0, 0].into_iter()), 4.0);
    }
}
