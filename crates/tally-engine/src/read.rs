//! The read path: summing shards and merging sketches.

use crate::api::{
    Consistency, DistinctRead, FrequencyRead, ShardReport, ShardsReport, TopEntry, TopRead, ValueRead,
    WindowRead,
};
use crate::ctx::{Ctx, ShardRead};
use crate::error::TallyError;
use crate::runtime::CounterRuntime;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tally_core::frequency::{FrequencySketch, FrequencySpec};
use tally_core::meta::CounterMeta;
use tally_core::sketch::DistinctSketch;
use tally_core::{CounterName, ShardId};
use tally_store::ShardImage;

/// Every current shard's committed state as applied (not yet made durable), fetched
/// concurrently (remote shards from their owners, which answer durable values);
/// `None` where a shard could not be reached.
/// A shard this node knows to hold nothing ([`crate::cold::known_empty`]) is not read.
async fn reads_applied(ctx: &Arc<Ctx>, meta: &CounterMeta, name: &CounterName) -> Vec<Option<ShardRead>> {
    let rt = ctx.registry.get(name.as_str()).map(|r| r.clone());
    let reads = (0..meta.layout.shards).map(|index| {
        let id = meta.shard_id(name, meta.layout.generation, index);
        let empty = rt.as_ref().is_some_and(|rt| crate::cold::known_empty(ctx, rt, &id));
        async move {
            if empty {
                return Some(ShardRead { image: ShardImage::default(), sealed: false });
            }
            match ctx.read_shard(&id, meta.created_at_ms).await {
                Ok(read) => Some(read),
                Err(e) => {
                    tracing::warn!(shard = %id, error = %e, "shard missing from a read");
                    None
                }
            }
        }
    });
    futures::future::join_all(reads).await
}

/// Whether the generation read may have been superseded by the time of the read:
/// some shard answered sealed and none answered unsealed. A shard that answered
/// unsealed proves that no resharding of this generation had completed when it
/// answered (completion needs every shard sealed), hence none before the read began,
/// so no increment can have been acknowledged in a newer generation before then.
fn maybe_superseded(reads: &[Option<ShardRead>]) -> bool {
    let answered = || reads.iter().flatten();
    answered().any(|r| r.sealed) && answered().all(|r| r.sealed)
}

/// Most times one read moves to a newer generation it learns of (each move means
/// a resharding completed during the read).
pub const READ_GENERATION_MOVES_MAX: usize = 3;

/// What a read summed: the metadata whose generation it read (newer than the
/// caller's when that one turned out superseded), each shard's image, and whether
/// the generation is known to be the current one.
struct Snapshot {
    meta: Arc<CounterMeta>,
    images: Vec<Option<ShardImage>>,
    current: bool,
}

/// The committed images of the counter's current generation, as applied. When every
/// shard that answered is sealed, this node's metadata may lag a resharding that
/// completed: the catalog is asked for its current metadata, and a newer generation
/// is installed here and read instead. A read that cannot tell says so
/// (`current: false`), rather than passing off the sealed generation's total.
async fn snapshot_applied(ctx: &Arc<Ctx>, meta: &Arc<CounterMeta>, name: &CounterName) -> Snapshot {
    let mut meta = meta.clone();
    let mut moves = 0;
    loop {
        let reads = reads_applied(ctx, &meta, name).await;
        let current = if !maybe_superseded(&reads) || bug!(ReadIgnoresSeal) {
            true
        } else {
            match ctx.catalog.current(name.as_str()).await {
                Ok(Some(now)) if now.layout.generation > meta.layout.generation => {
                    if moves < READ_GENERATION_MOVES_MAX {
                        moves += 1;
                        meta = ctx.install(name.clone(), now).meta.clone();
                        continue;
                    }
                    false
                }
                // The resharding has not completed: nothing was counted in a newer
                // generation yet. (A deleted counter reads as it was.)
                Ok(_) => true,
                Err(e) => {
                    tracing::warn!(counter = %name, error = %e, "cannot tell whether the generation read is current");
                    false
                }
            }
        };
        let images = reads.into_iter().map(|r| r.map(|r| r.image)).collect();
        return Snapshot { meta, images, current };
    }
}

/// Every current shard's image, made durable before it is answered: this node's
/// shards were read as applied, and a read must never show what a crash could still
/// take back. (Other owners do the same before answering a `Read`.)
async fn snapshot(ctx: &Arc<Ctx>, meta: &Arc<CounterMeta>, name: &CounterName) -> Snapshot {
    let mut snap = snapshot_applied(ctx, meta, name).await;
    if let Err(e) = ctx.flusher.make_durable().await {
        tracing::warn!(counter = %name, error = %e, "cannot make the values read durable");
        snap.images.iter_mut().for_each(|i| *i = None);
    }
    snap
}

fn missing(images: &[Option<ShardImage>]) -> Vec<u16> {
    images.iter().enumerate().filter(|(_, i)| i.is_none()).map(|(i, _)| i as u16).collect()
}

/// The total of a snapshot, as of `as_of_ms`.
fn total(snap: &Snapshot, as_of_ms: u64) -> ValueRead {
    let value =
        snap.meta.layout.base + snap.images.iter().flatten().map(|i| i128::from(i.value)).sum::<i128>();
    let value = snap.meta.spec.clamp(value);
    let missing_shards = missing(&snap.images);
    ValueRead {
        value,
        consistency: Consistency::Fresh,
        as_of_ms,
        staleness_ms: 0,
        complete: missing_shards.is_empty() && snap.current,
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
    meta: &Arc<CounterMeta>,
    name: &CounterName,
) -> Result<ValueRead, TallyError> {
    let as_of_ms = ctx.now_ms();
    Ok(total(&snapshot(ctx, meta, name).await, as_of_ms))
}

/// The totals of many counters (a rollup pass), handed to `emit` as they are read
/// (by index into `counters`), so a slow counter holds up only itself: the reads
/// that completed together share one wait for durability. Every total's `as_of` is
/// the time the pass began.
pub(crate) async fn sum_each(
    ctx: &Arc<Ctx>,
    counters: &[(CounterName, Arc<CounterMeta>)],
    mut emit: impl FnMut(Vec<(usize, ValueRead)>),
) {
    use futures::{FutureExt, StreamExt};
    let as_of_ms = ctx.now_ms();
    // Each read is made when a place among the running ones frees up, so a pass holds
    // at most `SUM_MANY_CONCURRENT_MAX` of them, not one per counter. (A stream
    // mapping the counters to reads is not `Send` for every lifetime, as
    // `tokio::spawn` needs; a loop that pushes them is.)
    let mut next = counters.iter().enumerate();
    let mut reads = futures::stream::FuturesUnordered::new();
    let mut done = Vec::new();
    loop {
        // Every read that completes without waiting joins `done`, places refilled
        // as they free up; then one wait for durability serves them all.
        loop {
            while reads.len() < SUM_MANY_CONCURRENT_MAX {
                let Some((i, (name, meta))) = next.next() else { break };
                reads.push(numbered(i, snapshot_applied(ctx, meta, name)));
            }
            match reads.next().now_or_never() {
                Some(Some(read)) => done.push(read),
                _ => break,
            }
        }
        if done.is_empty() {
            match reads.next().await {
                Some(read) => done.push(read),
                None => break,
            }
            continue;
        }
        let batch = std::mem::take(&mut done);
        let durable = ctx.flusher.make_durable().await;
        emit(
            batch
                .into_iter()
                .map(|(i, mut snap)| {
                    if let Err(e) = &durable {
                        tracing::warn!(counter = %counters[i].0, error = %e, "cannot make the values read durable");
                        snap.images.iter_mut().for_each(|i| *i = None);
                    }
                    (i, total(&snap, as_of_ms))
                })
                .collect(),
        );
    }
}

async fn numbered<T>(i: usize, f: impl Future<Output = T>) -> (usize, T) {
    (i, f.await)
}

/// Most counters whose shards `sum_each` reads at once.
pub const SUM_MANY_CONCURRENT_MAX: usize = 64;

/// Where a reader waiting for a shared round is answered.
type Reader = tokio::sync::oneshot::Sender<Result<ValueRead, TallyError>>;

/// Fresh reads of one counter waiting for a round of their own
/// ([`fresh_shared`]).
#[derive(Default)]
pub(crate) struct FreshRounds {
    /// A round is under way (or about to start for the readers waiting).
    running: bool,
    /// Readers that asked while a round was under way: the next round, which begins
    /// after they asked, answers them all.
    waiting: Vec<Reader>,
}

/// A fresh read ([`fresh`]) shared with the other fresh reads of the counter that
/// ask at the same time. A reader that finds no round under way reads at once. One
/// that asks while a round is under way cannot take that round's answer (it began
/// before the reader asked, so it may miss what was acknowledged just before), and
/// waits for the next round instead, which begins once that one ends and answers
/// every reader that asked meanwhile. So a total includes every increment
/// acknowledged before its reader asked, as a read of its own would, and many
/// concurrent readers (every `INCR` of a `sync` counter reads its total) cost a
/// round or two of shard reads instead of one each.
pub(crate) async fn fresh_shared(ctx: &Arc<Ctx>, rt: &Arc<CounterRuntime>) -> Result<ValueRead, TallyError> {
    let waiting = {
        let mut rounds = rt.fresh_rounds.lock();
        if rounds.running {
            let (tx, rx) = tokio::sync::oneshot::channel();
            rounds.waiting.push(tx);
            Some(rx)
        } else {
            rounds.running = true;
            None
        }
    };
    if let Some(rx) = waiting {
        return rx.await.unwrap_or(Err(TallyError::ShuttingDown));
    }
    // This reader's own round; the guard starts the next one, for the readers who
    // asked meanwhile, also when this reader stops waiting.
    let _next = NextRound { ctx: ctx.clone(), rt: rt.clone() };
    fresh(ctx, rt).await
}

/// Ends a round of [`fresh_shared`] when dropped, however the round ends: starts the
/// next one in a task of its own for the readers who asked during this one, or
/// marks that no round runs.
struct NextRound {
    ctx: Arc<Ctx>,
    rt: Arc<CounterRuntime>,
}

impl Drop for NextRound {
    fn drop(&mut self) {
        let mut rounds = self.rt.fresh_rounds.lock();
        if rounds.waiting.is_empty() {
            rounds.running = false;
            return;
        }
        let waiting = std::mem::take(&mut rounds.waiting);
        drop(rounds);
        let next = NextRound { ctx: self.ctx.clone(), rt: self.rt.clone() };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn(waited_round(next, waiting))),
            // The engine's runtime is gone: the waiting readers hear that it shut
            // down (their senders drop), and `next` marks that no round runs.
            Err(_) => drop((next, waiting)),
        }
    }
}

/// A round for readers who asked before it began; `next` (part of the task from
/// its creation, so also if the task never runs) ends it.
async fn waited_round(next: NextRound, waiting: Vec<Reader>) {
    let read = fresh(&next.ctx, &next.rt).await;
    for reader in waiting {
        let _ = reader.send(read.clone());
    }
}

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
    meta: &Arc<CounterMeta>,
    name: &CounterName,
) -> Result<DistinctRead, TallyError> {
    let (merged, counter_bytes, missing_shards, current) = distinct_sketch(ctx, meta, name).await?;
    Ok(DistinctRead {
        estimate: merged.estimate(),
        relative_error: DistinctSketch::relative_error(),
        sketch_bytes: merged.encoded_len() as u64,
        counter_bytes,
        complete: missing_shards.is_empty() && current,
        missing_shards,
    })
}

/// Every current shard's distinct sketch merged, the bytes the shards' sketches
/// take, the shards that did not answer, and whether the generation read is current.
pub(crate) async fn distinct_sketch(
    ctx: &Arc<Ctx>,
    meta: &Arc<CounterMeta>,
    name: &CounterName,
) -> Result<(DistinctSketch, u64, Vec<u16>, bool), TallyError> {
    let Snapshot { meta, images, current } = snapshot(ctx, meta, name).await;
    let mut merged = DistinctSketch::new();
    let mut counter_bytes = 0u64;
    for (index, image) in images.iter().enumerate() {
        let id = meta.shard_id(name, meta.layout.generation, index as u16);
        if let Some(bytes) = image.as_ref().and_then(|i| i.sketch.as_ref()) {
            counter_bytes += bytes.len() as u64;
            let s = DistinctSketch::from_bytes(bytes).map_err(|e| tally_store::StoreError::Corrupt {
                location: format!("sketch of shard {id}"),
                source: tally_core::codec::DecodeError { what: "sketch", reason: e.to_string() },
            })?;
            merged.merge(&s);
        }
    }
    Ok((merged, counter_bytes, missing(&images), current))
}

/// One window of the current generation, merged over every shard at this node's
/// clock (a resharding carried the sealed generation's buckets into the new one).
pub(crate) async fn window(
    ctx: &Arc<Ctx>,
    meta: &Arc<CounterMeta>,
    name: &CounterName,
    asked: &str,
) -> Result<WindowRead, TallyError> {
    use tally_core::window::{span, WindowRead as Merged, WindowState};
    let window = meta.spec.windows.find(asked)?;
    let Snapshot { meta, images, current } = snapshot(ctx, meta, name).await;
    let now_ms = ctx.now_ms();
    let distinct = meta.spec.distinct;
    let mut merged = Merged::empty(span(window, now_ms), distinct);
    let mut window_bytes = 0u64;
    for (index, image) in images.iter().enumerate() {
        let id = meta.shard_id(name, meta.layout.generation, index as u16);
        let state = image.as_ref().map(ShardImage::decode_windows).transpose().map_err(|source| {
            tally_store::StoreError::Corrupt { location: format!("window buckets of shard {id}"), source }
        })?;
        if let Some(state) = state.flatten() {
            window_bytes += state.size_bytes() as u64;
            if let Some(read) = state.read(window, now_ms) {
                merged.merge(&read);
            }
        }
    }
    let s = merged.span;
    let bound = WindowState::bound_bytes(meta.spec.windows.len(), distinct) as u64;
    let missing_shards = missing(&images);
    let limit = meta.spec.limit.filter(|l| l.window == window).map(|l| l.max);
    let value = limit.map_or(merged.total, |max| merged.total.min(i128::from(max)));
    Ok(WindowRead {
        window: window.to_string(),
        window_ms: window.ms(),
        bucket_ms: s.bucket_ms,
        start_ms: s.start_ms,
        end_ms: s.end_ms,
        value,
        limit,
        remaining: limit.map(|max| u64::try_from(i128::from(max) - value.max(0)).unwrap_or(0)),
        estimate: merged.sketch.as_ref().map(DistinctSketch::estimate),
        relative_error: distinct.then(DistinctSketch::relative_error),
        window_bytes,
        window_bytes_bound: bound * u64::from(meta.layout.shards),
        complete: missing_shards.is_empty() && current,
        missing_shards,
    })
}

/// Every current shard's frequency sketch merged: count-min tables add, heavy-hitter
/// summaries merge with their bounds (a resharding carried the sealed generation's
/// into the new one). Shards that did not answer are listed as missing.
pub(crate) async fn frequencies(
    ctx: &Arc<Ctx>,
    meta: &Arc<CounterMeta>,
    name: &CounterName,
) -> Result<(FrequencySketch, FrequencySpec, Vec<u16>, bool), TallyError> {
    let Some(spec) = meta.spec.frequency else { return Err(TallyError::FrequencyOff(name.to_string())) };
    let Snapshot { meta, images, current } = snapshot(ctx, meta, name).await;
    let corrupt = |id: &ShardId, e: &dyn std::fmt::Display| tally_store::StoreError::Corrupt {
        location: format!("frequency sketch of shard {id}"),
        source: tally_core::codec::DecodeError { what: "frequency sketch", reason: e.to_string() },
    };
    let mut merged = FrequencySketch::new(&spec).map_err(|e| TallyError::InvalidSpec(e.into()))?;
    for (index, image) in images.iter().enumerate() {
        let id = meta.shard_id(name, meta.layout.generation, index as u16);
        if let Some(image) = image {
            if let Some(f) = image.decode_frequency().map_err(|e| corrupt(&id, &e))? {
                merged.merge(&f).map_err(|e| corrupt(&id, &e))?;
            }
        }
    }
    Ok((merged, spec, missing(&images), current))
}

/// `item`'s merged estimate.
pub(crate) async fn frequency(
    ctx: &Arc<Ctx>,
    meta: &Arc<CounterMeta>,
    name: &CounterName,
    item: &str,
) -> Result<FrequencyRead, TallyError> {
    let (merged, spec, missing_shards, current) = frequencies(ctx, meta, name).await?;
    let e = merged.estimate(item, &spec);
    Ok(FrequencyRead {
        item: item.to_owned(),
        estimate: e.estimate,
        lower_bound: e.lower_bound,
        error_bound: e.error_bound,
        confidence: 1.0 - spec.delta,
        epsilon: spec.epsilon,
        total: merged.total(),
        complete: missing_shards.is_empty() && current,
        missing_shards,
    })
}

/// The `k` heaviest items of the merged summaries.
pub(crate) async fn top(
    ctx: &Arc<Ctx>,
    meta: &Arc<CounterMeta>,
    name: &CounterName,
    k: u32,
) -> Result<TopRead, TallyError> {
    let (merged, spec, missing_shards, current) = frequencies(ctx, meta, name).await?;
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
        complete: missing_shards.is_empty() && current,
        missing_shards,
    })
}

/// Per-shard values and write skew.
pub(crate) async fn shards(
    ctx: &Arc<Ctx>,
    rt: &crate::runtime::CounterRuntime,
) -> Result<ShardsReport, TallyError> {
    let Snapshot { meta, images, .. } = snapshot(ctx, &rt.meta, &rt.name).await;
    let mut shards = Vec::with_capacity(usize::from(meta.layout.shards));
    for (index, image) in images.iter().enumerate() {
        let id = meta.shard_id(&rt.name, meta.layout.generation, index as u16);
        let Some(image) = image else {
            return Err(TallyError::Unavailable { shard: id.shown(), reason: "did not answer".into() });
        };
        shards.push(ShardReport {
            index: index as u16,
            node: ctx.owner_name(&id),
            value: image.value,
            // Writes this runtime routed; a generation learnt during the read has none yet.
            writes: if meta.layout.generation == rt.meta.layout.generation {
                rt.slots.get(index).map_or(0, |s| s.writes.load(Relaxed))
            } else {
                0
            },
            replication: None,
        });
    }
    Ok(ShardsReport {
        generation: meta.layout.generation,
        base: meta.layout.base,
        skew: skew(shards.iter().map(|s| s.writes)),
        shards,
        auto: crate::autoshard::status(ctx, &rt.name).await,
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
