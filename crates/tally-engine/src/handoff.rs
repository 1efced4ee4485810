//! Moving shards when the cluster's membership changes: the shell that carries out
//! `tally_core::handoff_machine`'s effects against this node's store, flusher,
//! supervisor and placement.
//!
//! The machines decide every step (see their module for why nothing is lost or
//! counted twice); this file adds what only a running node has: waiting until the
//! node has applied the change ([`EPOCH_WAIT_MS`]), one adoption of a shard at a
//! time (`Ctx::adopting`), and the shards adopted at each epoch (`Ctx::adopted`).

use crate::ctx::{seal_key, Ctx};
use crate::error::unavailable;
use crate::error::TallyError;
use crate::placement::{unexpected, ShardRequest, ShardResponse};
use std::collections::VecDeque;
use std::time::Duration;
use tally_core::handoff_machine::{
    admit, shard_of_seal_marker, Admission, AdoptEffect, AdoptInput, Adoption, HandOffPage, HandOffPass,
    PassEffect, PassInput, PullAnswer, PullEffect, PullInput, SEAL_MARKER_PREFIX,
};
use tally_core::{NodeId, ShardId};

pub use tally_core::handoff_machine::{HandoffReport, HANDOFF_RECORDS_MAX, HANDOFF_SCAN_PAGE};

/// How long a node waits to apply a membership change another node already knows.
pub const EPOCH_WAIT_MS: u64 = 10_000;

/// Makes sure this node holds shard `id` before serving it: during a membership
/// change, a shard that was owned elsewhere is adopted first.
pub(crate) async fn ensure_local(ctx: &Ctx, id: &ShardId) -> Result<(), TallyError> {
    let Some(placement) = &ctx.placement else { return Ok(()) };
    placement.confirm_local(id).await?;
    let previous = placement.previous_owner(id);
    let adopted = previous.as_ref().is_some_and(|(_, e)| ctx.adopted.contains(&(*e, id.clone())));
    let (from, epoch) = match admit(previous, adopted, ctx.adopting.contains_key(id)) {
        Admission::Serve => return Ok(()),
        Admission::AwaitInFlight => {
            let in_flight = ctx.adopting.get(id).map(|l| l.value().clone());
            if let Some(lock) = in_flight {
                drop(lock.lock().await);
            }
            return Ok(());
        }
        Admission::Adopt { from, epoch } => (from, epoch),
    };
    let lock = ctx.adopting.entry(id.clone()).or_default().clone();
    let held = lock.lock().await;
    // Looked again under the lock: another adoption may have finished, or the
    // change completed (a caller that saw it complete before this lock was taken
    // finds this adoption in `adopting` and waits for it).
    let begun = AdoptInput::Begun {
        adopted: ctx.adopted.contains(&(epoch, id.clone())),
        still_previous: placement.previous_owner(id).is_some(),
    };
    adopt_under_lock(ctx, id, Adoption::new(id.clone(), from, epoch), begun).await?;
    drop(held);
    // A failed adoption leaves its slot, so a retry queues behind its waiters.
    ctx.adopting.remove(id);
    Ok(())
}

/// Carries out one adoption's effects, one after another.
async fn adopt_under_lock(
    ctx: &Ctx,
    id: &ShardId,
    mut adoption: Adoption<NodeId>,
    first: AdoptInput,
) -> Result<(), TallyError> {
    let Some(placement) = &ctx.placement else { return Ok(()) };
    let mut effects: VecDeque<AdoptEffect<NodeId>> = adoption.step(first).into();
    while let Some(effect) = effects.pop_front() {
        let next = match effect {
            AdoptEffect::Skip => return Ok(()),
            AdoptEffect::ReadMarker(key) => {
                AdoptInput::Marker { present: ctx.store.meta_get(&key)?.is_some() }
            }
            AdoptEffect::DeleteShard => {
                ctx.store.delete_shard_async(id).await?;
                continue;
            }
            AdoptEffect::Pull { from, epoch, after } => {
                let request = ShardRequest::HandOff { id: id.clone(), epoch, after: after.clone() };
                match placement.call(&from, request).await? {
                    ShardResponse::HandedOff { image, records, more, sealed } => {
                        let page = HandOffPage { image, records, more, sealed };
                        AdoptInput::Page { after, page, owns: ctx.remote(id).is_none() }
                    }
                    other => return Err(unexpected(&from, id, other)),
                }
            }
            AdoptEffect::Import(write) => {
                ctx.flusher.commit(id.clone(), write, None).await?;
                continue;
            }
            AdoptEffect::Seal => {
                ctx.store.meta_put_async(&seal_key(id), b"").await?;
                continue;
            }
            AdoptEffect::Flush => {
                ctx.flusher.flush().await?;
                continue;
            }
            AdoptEffect::WriteMarker(key) => {
                ctx.store.meta_put_async(&key, &[]).await?;
                continue;
            }
            AdoptEffect::Adopted { imported } => {
                if imported {
                    ctx.stats.shards_adopted.inc();
                    tracing::debug!(shard = %id, epoch = adoption.epoch(), "shard adopted");
                }
                ctx.adopted.insert((adoption.epoch(), id.clone()));
                return Ok(());
            }
        };
        effects.extend(adoption.step(next));
    }
    Ok(())
}

/// Waits until this node has applied placement epoch `epoch`.
async fn wait_epoch(ctx: &Ctx, id: &ShardId, epoch: u64) -> Result<(), TallyError> {
    let Some(placement) = &ctx.placement else { return Ok(()) };
    let deadline = tokio::time::Instant::now() + Duration::from_millis(EPOCH_WAIT_MS);
    while placement.epoch() < epoch {
        if tokio::time::Instant::now() >= deadline {
            return Err(unavailable(id, &format!("placement epoch {epoch} not applied here yet")));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Answers the new owner of `id`: stops serving the shard, then hands over its
/// state, whether it is sealed, and one page of its dedup records.
pub(crate) async fn hand_off(
    ctx: &Ctx,
    id: &ShardId,
    epoch: u64,
    after: Option<&str>,
) -> Result<HandOffPage, TallyError> {
    wait_epoch(ctx, id, epoch).await?;
    let mut answer = PullAnswer::new(after.map(str::to_owned));
    let mut not_durable = None;
    let (owns, lost) = (ctx.remote(id).is_none(), ctx.lost.get());
    let mut effects: VecDeque<PullEffect> = answer.step(PullInput::Asked { owns, lost }).into();
    while let Some(effect) = effects.pop_front() {
        let next = match effect {
            PullEffect::Refuse => {
                return Err(match not_durable.take() {
                    Some(e) => TallyError::from(e),
                    None if lost => ctx.lost.check(id).expect_err("marked lost"),
                    None => unavailable(id, "this node still owns the shard"),
                });
            }
            PullEffect::StopShard => {
                ctx.stop_local(id).await;
                continue;
            }
            PullEffect::MakeDurable => match ctx.flusher.make_durable().await {
                Ok(()) => PullInput::Durable { ok: true },
                Err(e) => {
                    not_durable = Some(e);
                    PullInput::Durable { ok: false }
                }
            },
            PullEffect::Read { after, limit } => PullInput::Read {
                image: ctx.store.load_shard(id)?,
                sealed: ctx.store.meta_get(&seal_key(id))?.is_some(),
                records: ctx.store.dedup_scan(id, after.as_deref(), limit)?,
            },
            PullEffect::Answer(page) => return Ok(page),
        };
        effects.extend(answer.step(next));
    }
    Err(unavailable(id, "the hand-off answered nothing"))
}

/// Adopts `id` now, at the previous owner's request.
pub(crate) async fn adopt(ctx: &Ctx, id: &ShardId, epoch: u64) -> Result<(), TallyError> {
    wait_epoch(ctx, id, epoch).await?;
    let Some(placement) = &ctx.placement else {
        return Err(unavailable(id, "not a cluster node"));
    };
    match placement.previous_owner(id) {
        Some((_, e)) if e == epoch => ensure_local(ctx, id).await,
        _ => Err(unavailable(id, &format!("this node does not take the shard over at epoch {epoch}"))),
    }
}

/// Hands every shard this node holds but no longer owns at `epoch` to its owner.
pub(crate) async fn hand_off_foreign(ctx: &Ctx, epoch: u64) -> Result<HandoffReport, TallyError> {
    let Some(placement) = &ctx.placement else { return Ok(HandoffReport::default()) };
    let running: Vec<(ShardId, Option<NodeId>)> =
        ctx.directory.iter().map(|e| (e.key().clone(), placement.remote_owner(e.key()))).collect();
    let mut pass = HandOffPass::new(epoch);
    let mut effects: VecDeque<PassEffect<NodeId>> =
        pass.step(PassInput::Start { applied: placement.epoch(), running }).into();
    // Depth first: what an answer makes due runs before the next request.
    while let Some(effect) = effects.pop_front() {
        let next = match effect {
            PassEffect::NotApplied => {
                let id = ShardId::new(tally_core::CounterName::new("handoff").expect("a valid name"), 0, 0);
                return Err(unavailable(&id, &format!("placement epoch {epoch} not applied here yet")));
            }
            PassEffect::Stop(id) => {
                ctx.stop_local(&id).await;
                continue;
            }
            PassEffect::Scan { after, limit } => {
                let page = ctx.store.shard_ids(after.as_ref(), limit)?;
                PassInput::Scanned(
                    page.into_iter()
                        .map(|id| {
                            let owner = placement.remote_owner(&id);
                            (id, owner)
                        })
                        .collect(),
                )
            }
            PassEffect::ScanSeals { after, limit } => {
                let after = after.as_ref().map(seal_key);
                let page = ctx.store.meta_scan(SEAL_MARKER_PREFIX, after.as_deref(), limit)?;
                PassInput::ScannedSeals(
                    page.iter()
                        .filter_map(|(key, _)| shard_of_seal_marker(key))
                        .map(|id| {
                            let owner = placement.remote_owner(&id);
                            (id, owner)
                        })
                        .collect(),
                )
            }
            PassEffect::AskAdopt { shard, owner, epoch } => {
                let request = ShardRequest::Adopt { id: shard.clone(), epoch };
                let ok = match placement.call(&owner, request).await {
                    Ok(ShardResponse::Done) => true,
                    Ok(other) => {
                        tracing::warn!(shard = %shard, "{}", unexpected(&owner, &shard, other));
                        false
                    }
                    Err(e) => {
                        tracing::warn!(shard = %shard, owner = %owner, error = %e, "hand-off failed; will retry");
                        false
                    }
                };
                PassInput::Adopted { shard, ok }
            }
            PassEffect::Delete(id) => {
                ctx.drop_shard_data(&id).await?;
                continue;
            }
            PassEffect::Flush => {
                ctx.flusher.flush().await?;
                continue;
            }
            PassEffect::Report(report) => return Ok(report),
        };
        for e in pass.step(next).into_iter().rev() {
            effects.push_front(e);
        }
    }
    Err(TallyError::ShuttingDown)
}
