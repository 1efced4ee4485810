//! The read path: summing shards and merging sketches.

use crate::api::{
    Consistency, DistinctRead, FrequencyRead, ShardReport, ShardsReport, TopEntry, TopRead, ValueRead,
};
use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::runtime::CounterRuntime;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tally_core::frequency::{FrequencySketch, FrequencySpec};
use tally_core::meta::CounterMeta;
use tally_core::sketch::DistinctSketch;
use tally_core::{CounterName, ShardId};
use tally_store::ShardImage;

/// The committed image of every current shard as applied (not yet made durable),
/// fetched concurrently (remote shards from their owners, which answer durable
/// values); `None` where a shard could not be reached.
async fn images_applied(ctx: &Arc<Ctx>, meta: &CounterMeta, name: &CounterName) -> Vec<Option<ShardImage>> {
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
    futures::future::join_all(reads).await
}

/// Every current shard's image, made durable before it is answered: this node's
/// shards were read as applied, and a read must never show what a crash could still
/// take back. (Other owners do the same before answering a `Read`.)
async fn images(ctx: &Arc<Ctx>, meta: &CounterMeta, name: &CounterName) -> Vec<Option<ShardImage>> {
    let images = images_applied(ctx, meta, name).await;
    durable(ctx, name, images).await
}

/// `images` once every write applied so far is durable; all missing if it cannot be.
async fn durable(ctx: &Ctx, name: &CounterName, images: Vec<Option<ShardImage>>) -> Vec<Option<ShardImage>> {
    if let Err(e) = ctx.flusher.make_durable().await {
        tracing::warn!(counter = %name, error = %e, "cannot make the values read durable");
        return images.into_iter().map(|_| None).collect();
    }
    images
}

fn missing(images: &[Option<ShardImage>]) -> Vec<u16> {
    images.iter().enumerate().filter(|(_, i)| i.is_none()).map(|(i, _)| i as u16).collect()
}

/// The total of `images` over `meta`'s layout, as of `as_of_ms`.
fn total(meta: &CounterMeta, images: &[Option<ShardImage>], as_of_ms: u64) -> ValueRead {
    let value = meta.layout.base + images.iter().flatten().map(|i| i128::from(i.value)).sum::<i128>();
    let missing_shards = missing(images);
    ValueRead {
        value,
        consistency: Consistency::Fresh,
        as_of_ms,
        staleness_ms: 0,
        complete: missing_shards.is_empty(),
        missing_shards,
    }
}

/// The counter's total: the sealed generations' `base` plus every current shard's
/// committed value, made durable before it is answered. A shard's actor commits
/// before it answers, so every acknowledged increment is included. A shard that cannot be reached is listed in
/// `missing_shards` and the read says `complete: false` — never a silent partial sum.
/// `as_of_ms` is taken before the shards are asked: every value read is at least
/// that new, so the staleness a cached copy reports is never understated.
pub(crate) async fn sum_shards(
    ctx: &Arc<Ctx>,
    meta: &CounterMeta,
    name: &CounterName,
) -> Result<ValueRead, TallyError> {
    let as_of_ms = ctx.now_ms();
    let images = images(ctx, meta, name).await;
    Ok(total(meta, &images, as_of_ms))
}

/// The totals of many counters (a rollup pass), with one wait for durability for all
/// of them instead of one per counter.
pub(crate) async fn sum_many(ctx: &Arc<Ctx>, counters: &[(CounterName, Arc<CounterMeta>)]) -> Vec<ValueRead> {
    let as_of_ms = ctx.now_ms();
    let mut all = Vec::with_capacity(counters.len());
    for chunk in counters.chunks(SUM_MANY_CONCURRENT_MAX) {
        all.extend(
            futures::future::join_all(chunk.iter().map(|(name, meta)| images_applied(ctx, meta, name))).await,
        );
    }
    let durable = ctx.flusher.make_durable().await;
    counters
        .iter()
        .zip(all)
        .map(|((name, meta), images)| {
            let images = match &durable {
                Ok(()) => images,
                Err(e) => {
                    tracing::warn!(counter = %name, error = %e, "cannot make the values read durable");
                    images.into_iter().map(|_| None).collect()
                }
            };
            total(meta, &images, as_of_ms)
        })
        .collect()
}

/// Most counters whose shards [`sum_many`] reads at once.
pub const SUM_MANY_CONCURRENT_MAX: usize = 64;

/// A fresh read: first this node's buffered increments for the counter (its current
/// runtime's and those of runtimes it replaced) are delivered, then every shard is
/// summed. The read says `complete: false` if a shard did not answer, or if a sum
/// this node drained is still in doubt (sent, not yet answered): it cannot know
/// whether that sum is in the total.
pub(crate) async fn fresh(ctx: &Arc<Ctx>, rt: &Arc<CounterRuntime>) -> Result<ValueRead, TallyError> {
    let settled = ctx.deliver_for_read(rt).await;
    let mut read = sum_shards(ctx, &rt.meta, &rt.name).await?;
    read.complete &= settled;
    Ok(read)
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
    let mut counter_bytes = 0u64;
    for (index, image) in images.iter().enumerate() {
        let id = ShardId::new(name.clone(), meta.layout.generation, index as u16);
        if let Some(bytes) = image.as_ref().and_then(|i| i.sketch.as_ref()) {
            counter_bytes += bytes.len() as u64;
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
        sketch_bytes: merged.encoded_len() as u64,
        counter_bytes,
        complete: missing_shards.is_empty(),
        missing_shards,
    })
}

/// Every current shard's frequency sketch merged: count-min tables add, heavy-hitter
/// summaries merge with their bounds (a resharding carried the sealed generation's
/// into the new one). Shards that did not answer are listed as missing.
pub(crate) async fn frequencies(
    ctx: &Arc<Ctx>,
    meta: &CounterMeta,
    name: &CounterName,
) -> Result<(FrequencySketch, FrequencySpec, Vec<u16>), TallyError> {
    let Some(spec) = meta.spec.frequency else { return Err(TallyError::FrequencyOff(name.to_string())) };
    let images = images(ctx, meta, name).await;
    let corrupt = |id: &ShardId, e: &dyn std::fmt::Display| tally_store::StoreError::Corrupt {
        location: format!("frequency sketch of shard {id}"),
        source: tally_core::codec::DecodeError { what: "frequency sketch", reason: e.to_string() },
    };
    let mut merged = FrequencySketch::new(&spec).map_err(|e| TallyError::InvalidSpec(e.into()))?;
    for (index, image) in images.iter().enumerate() {
        let id = ShardId::new(name.clone(), meta.layout.generation, index as u16);
        if let Some(image) = image {
            if let Some(f) = image.decode_frequency().map_err(|e| corrupt(&id, &e))? {
                merged.merge(&f).map_err(|e| corrupt(&id, &e))?;
            }
        }
    }
    Ok((merged, spec, missing(&images)))
}

/// `item`'s merged estimate.
pub(crate) async fn frequency(
    ctx: &Arc<Ctx>,
    meta: &CounterMeta,
    name: &CounterName,
    item: &str,
) -> Result<FrequencyRead, TallyError> {
    let (merged, spec, missing_shards) = frequencies(ctx, meta, name).await?;
    let e = merged.estimate(item, &spec);
    Ok(FrequencyRead {
        item: item.to_owned(),
        estimate: e.estimate,
        lower_bound: e.lower_bound,
        error_bound: e.error_bound,
        confidence: 1.0 - spec.delta,
        epsilon: spec.epsilon,
        total: merged.total(),
        complete: missing_shards.is_empty(),
        missing_shards,
    })
}

/// The `k` heaviest items of the merged summaries.
pub(crate) async fn top(
    ctx: &Arc<Ctx>,
    meta: &CounterMeta,
    name: &CounterName,
    k: u32,
) -> Result<TopRead, TallyError> {
    let (merged, spec, missing_shards) = frequencies(ctx, meta, name).await?;
    let items = merged
        .top(k, &spec)
        .into_iter()
        .map(|t| TopEntry {
            item: t.item,
            estimate: t.estimate.estimate,
            lower_bound: t.estimate.lower_bound,
        })
        .collect();
    Ok(TopRead {
        k,
        items,
        error_bound: merged.error_bound(&spec),
        confidence: 1.0 - spec.delta,
        undercount: merged.top_undercount(),
        total: merged.total(),
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
