//! First writes of just-created shards, without an actor.
//!
//! A counter created by its first increment holds nothing anywhere, and most such
//! counters (a key per user, per page) see a handful of increments in their life.
//! Starting a shard actor for the first drained sum — through the supervisor, loading
//! the empty shard from the store, a ticker, an idle stop half a minute later — cost
//! far more than the sum's write itself. So the first sum drained to a shard that
//! holds nothing is run through the shard's machine here, in the draining task:
//! the same step function an actor runs, the same commit path and flush, the same
//! answers; only the shell is not an actor. The machine is dropped afterwards; a later
//! write starts an actor, which loads what this wrote.
//!
//! One writer per shard still holds. A shard may be written this way only while
//!
//! * its slot is *cold*: set when this node created the counter with nothing in any
//!   shard, cleared by the first write here and by every actor start (the supervisor
//!   clears it before it starts one), so no actor has ever loaded the shard; and
//! * the store holds nothing for the shard when the write begins (a shard adopted
//!   from another node, or a replicated one another leader wrote, is not empty); and
//! * this node holds the shard's claim in [`Ctx::cold`]: the supervisor marks a shard
//!   it is starting ([`ColdMark::Spawning`]) in the same map, and a start that finds
//!   a cold write under way waits for it to end (the claim is a lock the writer holds).
//!
//! A claim is taken only where no start is under way, and a start is begun only where
//! no claim is held, so an actor never loads a shard while a cold write to it is in
//! flight, and a cold write never races an actor that loaded the shard before it.

use crate::ctx::Ctx;
use crate::runtime::CounterRuntime;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use tally_core::shard::{ShardReply, Submission};
use tally_core::ShardId;

/// What [`Ctx::cold`] holds for a shard.
pub(crate) enum ColdMark {
    /// A cold write is under way; the lock is held until it ends.
    Writing(Arc<tokio::sync::Mutex<()>>),
    /// The supervisor is starting the shard's actor.
    Spawning,
}

/// Writes `sub`, drained from slot `index` of `rt`, to its shard without an actor
/// if the shard is cold (see the module docs). `None` if it is not: the caller
/// sends `sub` to the shard's actor as usual. Otherwise the answer arrives on the
/// returned receiver (closed if the write failed: the sum is then in doubt and
/// resent to an actor).
pub(crate) async fn write(
    ctx: &Ctx,
    rt: &Arc<CounterRuntime>,
    index: u16,
    id: &ShardId,
    sub: &Submission,
) -> Option<ractor::concurrency::OneshotReceiver<ShardReply>> {
    let slot = &rt.slots[usize::from(index)];
    // A bounded counter is `sync`, so it drains nothing; its shards run in actors,
    // which hold waiting increments and take escrow messages.
    let bounded = rt.meta.spec.bounded();
    if bounded || !slot.cold.load(SeqCst) || ctx.remote(id).is_some() || ctx.directory.contains_key(id) {
        return None;
    }
    let lock = Arc::new(tokio::sync::Mutex::new(()));
    let held = lock.clone().try_lock_owned().ok()?;
    match ctx.cold.entry(id.clone()) {
        dashmap::Entry::Vacant(e) => {
            e.insert(ColdMark::Writing(lock));
        }
        dashmap::Entry::Occupied(_) => return None,
    }
    // Under the claim: still cold (no actor started since the counter was
    // created, and no other cold write), and no actor runs.
    let cold = slot.cold.swap(false, SeqCst) && !ctx.directory.contains_key(id);
    // And the shard holds nothing where it is stored now (`holds_nothing`).
    let local = cold
        && crate::handoff::ensure_local(ctx, id).await.is_ok()
        && ctx.catalog.creation_written(id.counter.as_str()).await.is_ok()
        && holds_nothing(ctx, id);
    let rx = if local {
        let (tx, rx) = ractor::concurrency::oneshot();
        crate::shard::run_cold(ctx, id, &rt.meta, submission(ctx, sub), tx.into()).await;
        ctx.stats.cold_writes.inc();
        Some(rx)
    } else {
        None
    };
    ctx.cold.remove(id);
    drop(held);
    rx
}

/// Whether shard `id`, whose slot is cold under this node's claim, holds nothing
/// where it is stored. An embedded engine's own store holds only what this node
/// wrote, and a cold slot says it wrote nothing since the counter was created
/// (what a deleted counter left is removed before it is created again), so there
/// is nothing to read. Otherwise the shard may have been adopted from another
/// node, or its range group led by another node, since the counter was created:
/// its stored image must be empty, and opening it also makes this node the
/// shard's writer for a replicated store.
fn holds_nothing(ctx: &Ctx, id: &ShardId) -> bool {
    if ctx.placement.is_none() && !ctx.store.waits() {
        return true;
    }
    ctx.store.open_shard(id).is_ok_and(|image| image == tally_core::shard::ShardImage::default())
}

/// Whether shard `id` holds nothing, known without reading it: its slot in `rt`,
/// the counter's runtime for `id`'s generation, is still cold (this node created
/// the counter with nothing in any shard, and neither a write nor an actor start
/// has touched the shard since: both clear the slot before they begin, and a
/// shard busy when the runtime was made never had it set: `Ctx::install`), no
/// actor runs for it, and no other node writes it (an embedded engine's own store; see
/// [`holds_nothing`]). A rollup pass over many counters created by one
/// increment each reads one shard of each instead of all of them.
pub(crate) fn known_empty(ctx: &Ctx, rt: &CounterRuntime, id: &ShardId) -> bool {
    ctx.placement.is_none()
        && !ctx.store.waits()
        && rt.meta.layout.generation == id.generation
        && rt.slots.get(usize::from(id.index)).is_some_and(|slot| slot.cold.load(SeqCst))
        && !ctx.directory.contains_key(id)
        && ctx.lost.check(id).is_ok()
}

/// What a cold write applies for `sub`. A store that does not replicate answers
/// every commit for certain (applied, or failed and not applied), and a cold write
/// is answered before [`write`] returns, so its sum is resent only if it
/// was not applied: it needs no drain record, and the write is one key (the
/// shard's value) instead of two. A replicated store's commit may be in doubt,
/// so there the sum keeps its drain id and its record.
fn submission(ctx: &Ctx, sub: &Submission) -> Submission {
    match sub {
        Submission::Buffered { sum, increments, members, drain_id: Some(_) } if !ctx.store.waits() => {
            Submission::Buffered {
                sum: *sum,
                increments: *increments,
                members: members.clone(),
                drain_id: None,
            }
        }
        other => other.clone(),
    }
}

/// The lock of the cold write under way to shard `id`, if one is.
pub(crate) fn writer(ctx: &Ctx, id: &ShardId) -> Option<Arc<tokio::sync::Mutex<()>>> {
    match ctx.cold.get(id).as_deref() {
        Some(ColdMark::Writing(lock)) => Some(lock.clone()),
        _ => None,
    }
}

/// The supervisor is about to start shard `id`'s actor: marks the start and clears
/// the shard's cold slot. `Err` with the claim's lock if a cold write is under way:
/// the start must wait for the lock and try again.
pub(crate) fn begin_spawn(ctx: &Ctx, id: &ShardId) -> Result<(), Arc<tokio::sync::Mutex<()>>> {
    match ctx.cold.entry(id.clone()) {
        dashmap::Entry::Occupied(e) => match e.get() {
            ColdMark::Writing(lock) => return Err(lock.clone()),
            ColdMark::Spawning => {}
        },
        dashmap::Entry::Vacant(e) => {
            e.insert(ColdMark::Spawning);
        }
    }
    if let Some(rt) = ctx.registry.get(id.counter.as_str()) {
        if let Some(slot) = rt.slots.get(usize::from(id.index)) {
            slot.cold.store(false, SeqCst);
        }
    }
    Ok(())
}

/// The start marked by [`begin_spawn`] is over (the actor is in the
/// directory, or it failed to start).
pub(crate) fn end_spawn(ctx: &Ctx, id: &ShardId) {
    ctx.cold.remove_if(id, |_, m| matches!(m, ColdMark::Spawning));
}
