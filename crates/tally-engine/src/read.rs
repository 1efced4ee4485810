//! The read path: summing shards and merging sketches.

use crate::api::{Consistency, DistinctRead, ShardReport, ShardsReport, ValueRead};
use crate::ctx::Ctx;
use crate::error::TallyError;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tally_core::meta::CounterMeta;
use tally_core::sketch::DistinctSketch;
use tally_core::{CounterName, ShardId};
use tally_store::ShardImage;

/// The committed image of every current shard, fetched concurrently (remote shards
/// from their owners); `None` where a shard could not be reached.
async fn images(ctx: &Arc<Ctx>, meta: &CounterMeta, name: &CounterName) -> Vec<Option<ShardImage>> {
    let reads = (0..meta.layout.shards).map(|index| {
        let id = ShardId::new(name.clone(), meta.layout.generation, index);
        async move {
            match ctx.read_shard(&id).await {
                Ok(image) => Some(image),
                Err(e) => {
                    tracing::warn!(shard = %id, error = %e, "shard missing from a read");
                    None
                }
            }
        }
    });
    let images = futures::future::join_all(reads).await;
    // This node's shards were read as applied; they are answered once durable, so a
    // read never shows what a crash could still take back. (Other owners do the same
    // before answering a `Read`.)
    if let Err(e) = ctx.flusher.make_durable().await {
        tracing::warn!(counter = %name, error = %e, "cannot make the values read durable");
        return images.into_iter().map(|_| None).collect();
    }
    images
}

fn missing(images: &[Option<ShardImage>]) -> Vec<u16> {
    images.iter().enumerate().filter(|(_, i)| i.is_none()).map(|(i, _)| i as u16).collect()
}

/// The counter's total: the sealed generations' `base` plus every current shard's
/// committed value, made durable before it is answered. A shard's actor commits
/// before it answers, so every acknowledged increment is included. A shard that cannot be reached is listed in
/// `missing_shards` and the read says `complete: false` — never a silent partial sum.
pub(crate) async fn sum_shards(
    ctx: &Arc<Ctx>,
    meta: &CounterMeta,
    name: &CounterName,
) -> Result<ValueRead, TallyError> {
    let images = images(ctx, meta, name).await;
    let total = meta.layout.base + images.iter().flatten().map(|i| i128::from(i.value)).sum::<i128>();
    let missing_shards = missing(&images);
    Ok(ValueRead {
        value: total,
        consistency: Consistency::Fresh,
        as_of_ms: ctx.now_ms(),
        staleness_ms: 0,
        complete: missing_shards.is_empty(),
        missing_shards,
    })
}

/// The merged distinct-count estimate of the current generation (a resharding merges
/// the sealed generation's sketches into the new one).
pub(crate) async fn distinct(
    ctx: &Arc<Ctx>,
    meta: &CounterMeta,
    name: &CounterName,
) -> Result<DistinctRead, TallyError> {
    let images = images(ctx, meta, name).await;
    let mut merged = DistinctSketch::new();
    for (index, image) in images.iter().enumerate() {
        let id = ShardId::new(name.clone(), meta.layout.generation, index as u16);
        if let Some(bytes) = image.as_ref().and_then(|i| i.sketch.as_ref()) {
            let s = DistinctSketch::from_bytes(bytes).map_err(|e| tally_store::StoreError::Corrupt {
                location: format!("sketch of shard {id}"),
                source: tally_core::codec::DecodeError { what: "sketch", reason: e.to_string() },
            })?;
            merged.merge(&s);
        }
    }
    let missing_shards = missing(&images);
    Ok(DistinctRead {
        estimate: merged.estimate(),
        relative_error: DistinctSketch::relative_error(),
        complete: missing_shards.is_empty(),
        missing_shards,
    })
}

/// Per-shard values and write skew.
pub(crate) async fn shards(
    ctx: &Arc<Ctx>,
    rt: &crate::runtime::CounterRuntime,
) -> Result<ShardsReport, TallyError> {
    let meta = &rt.meta;
    let images = images(ctx, meta, &rt.name).await;
    let mut shards = Vec::with_capacity(usize::from(meta.layout.shards));
    for (index, image) in images.iter().enumerate() {
        let id = ShardId::new(rt.name.clone(), meta.layout.generation, index as u16);
        let Some(image) = image else {
            return Err(TallyError::Unavailable { shard: id.to_string(), reason: "did not answer".into() });
        };
        shards.push(ShardReport {
            index: index as u16,
            node: ctx.owner_name(&id),
            value: image.value,
            writes: rt.slots[index].writes.load(Relaxed),
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
