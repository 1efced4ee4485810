//! Moving shards when the cluster's membership changes.
//!
//! A membership change gives some shards a new owner. Nothing moves by itself: the
//! new owner *adopts* a shard before it serves it for the first time, by pulling the
//! previous owner's copy — value, sketch and every dedup record — and the previous
//! owner hands off every shard it holds but no longer owns, by asking each new owner
//! to adopt it and deleting its own copy once the new owner has it durably.
//!
//! Why nothing is lost or counted twice:
//!
//! * The previous owner answers a hand-off only after it has applied the change
//!   itself ([`Placement::epoch`]), so from then on it refuses the shard's requests
//!   and cannot start its actor again; it stops the running actor, which commits
//!   everything it had taken, before reading the state it hands over.
//! * The new owner serves the shard only after the imported state (with the seal,
//!   if a resharding sealed the shard) and then a marker are durable. A crash before the marker repeats the import of the same, sealed
//!   state; a crash after it never imports again.
//! * The previous owner deletes its copy only after the new owner confirmed the
//!   adoption, and the metadata group refuses the next membership change until every
//!   previous member has handed everything off, so each shard has exactly one
//!   previous owner to pull from.

use crate::ctx::{seal_key, Ctx};
use crate::error::unavailable;
use crate::error::TallyError;
use crate::placement::{unexpected, ShardRequest, ShardResponse};
use std::time::Duration;
use tally_core::dedup::DedupRecord;
use tally_core::ShardId;
use tally_store::{ShardImage, ShardWrite};

/// Most dedup records one hand-off answer carries; larger shards take several pages.
pub const HANDOFF_RECORDS_MAX: usize = 4_096;

/// Most shard ids one pass of [`hand_off_foreign`] reads from the store at a time.
pub const HANDOFF_SCAN_PAGE: usize = 1_024;

/// How long a node waits to apply a membership change another node already knows.
pub const EPOCH_WAIT_MS: u64 = 10_000;

/// The metadata key that records the adoption of shard `id` at `epoch`.
fn marker(epoch: u64, id: &ShardId) -> Vec<u8> {
    let mut key = b"adopted:".to_vec();
    key.extend_from_slice(&epoch.to_be_bytes());
    key.extend_from_slice(id.to_string().as_bytes());
    key
}

impl Ctx {
    /// Makes sure this node holds shard `id` before serving it: during a membership
    /// change, a shard that was owned elsewhere is adopted first.
    pub(crate) async fn ensure_local(&self, id: &ShardId) -> Result<(), TallyError> {
        let Some(placement) = &self.placement else { return Ok(()) };
        let Some((previous, epoch)) = placement.previous_owner(id) else {
            // The change may have completed since an adoption of this shard began
            // (its previous owner held nothing of it, so it did not wait): let that
            // import land before an actor starts beside it and writes under it.
            let in_flight = self.adopting.get(id).map(|l| l.value().clone());
            if let Some(lock) = in_flight {
                drop(lock.lock().await);
            }
            return Ok(());
        };
        let key = (epoch, id.clone());
        if self.adopted.contains(&key) {
            return Ok(());
        }
        let lock = self.adopting.entry(id.clone()).or_default().clone();
        let _held = lock.lock().await;
        if self.adopted.contains(&key) {
            return Ok(());
        }
        // Looked again under the lock: if the change completed meanwhile, the previous
        // owner held nothing of this shard (it would have waited for this adoption),
        // and an actor may already serve it here — importing now would write under it.
        // A caller that saw the change complete before this lock was taken finds this
        // adoption in `adopting` and waits for it; one that saw it after skips it here.
        if placement.previous_owner(id).is_none() {
            drop(_held);
            self.adopting.remove(id);
            return Ok(());
        }
        let marker = marker(epoch, id);
        if self.store.meta_get(&marker)?.is_none() {
            // An import cut short by a crash may have left pages here: start clean,
            // so the shard becomes exactly what its previous owner answers.
            self.store.delete_shard(id)?;
            let mut after: Option<String> = None;
            loop {
                let request = ShardRequest::HandOff { id: id.clone(), epoch, after: after.clone() };
                let (image, records, more, sealed) = match placement.call(&previous, request).await? {
                    ShardResponse::HandedOff { image, records, more, sealed } => {
                        (image, records, more, sealed)
                    }
                    other => return Err(unexpected(&previous, id, other)),
                };
                after = records.last().map(|(event_id, _)| event_id.clone()).or(after);
                let write = ShardWrite { image, dedup_put: records, dedup_remove: Vec::new() };
                self.flusher.commit(id.clone(), write, None).await?;
                // A sealed shard stays sealed here: its value is in the resharding's
                // sealed sum, and a write it took now would be counted nowhere.
                if sealed && !bug!(HandoffForgetsSeal) {
                    self.store.meta_put(&seal_key(id), b"")?;
                }
                if !more {
                    break;
                }
            }
            // The state first, then the marker: a crash in between imports again.
            self.flusher.flush().await?;
            self.store.meta_put(&marker, &[])?;
            self.flusher.flush().await?;
            self.stats.shards_adopted.inc();
            tracing::debug!(shard = %id, from = %previous, epoch, "shard adopted");
        }
        self.adopted.insert(key);
        drop(_held);
        self.adopting.remove(id);
        Ok(())
    }

    /// Waits until this node has applied placement epoch `epoch`.
    async fn wait_epoch(&self, id: &ShardId, epoch: u64) -> Result<(), TallyError> {
        let Some(placement) = &self.placement else { return Ok(()) };
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
        &self,
        id: &ShardId,
        epoch: u64,
        after: Option<&str>,
    ) -> Result<HandedOff, TallyError> {
        self.wait_epoch(id, epoch).await?;
        if self.remote(id).is_none() {
            return Err(unavailable(id, "this node still owns the shard"));
        }
        if after.is_none() {
            // No new actor can start now (this node no longer owns the shard); stop
            // the running one, which commits what it had taken.
            self.stop_local(id).await;
        }
        // Only what a crash cannot take back leaves this node: the new owner keeps
        // what it imports, while a state this node then lost would differ from it.
        self.flusher.make_durable().await?;
        let image = self.store.load_shard(id)?;
        let sealed = self.store.meta_get(&seal_key(id))?.is_some();
        let records = self.store.dedup_scan(id, after, HANDOFF_RECORDS_MAX)?;
        let more = records.len() == HANDOFF_RECORDS_MAX;
        Ok(HandedOff { image, records, more, sealed })
    }

    /// Adopts `id` now, at the previous owner's request.
    pub(crate) async fn adopt(&self, id: &ShardId, epoch: u64) -> Result<(), TallyError> {
        self.wait_epoch(id, epoch).await?;
        let Some(placement) = &self.placement else {
            return Err(unavailable(id, "not a cluster node"));
        };
        match placement.previous_owner(id) {
            Some((_, e)) if e == epoch => self.ensure_local(id).await,
            _ => Err(unavailable(id, &format!("this node does not take the shard over at epoch {epoch}"))),
        }
    }
}

/// One page of a shard handed off.
pub(crate) struct HandedOff {
    /// The shard's state.
    pub(crate) image: ShardImage,
    /// A page of its dedup records, in event-id order.
    pub(crate) records: Vec<(String, DedupRecord)>,
    /// Whether more records follow.
    pub(crate) more: bool,
    /// Whether the shard is sealed.
    pub(crate) sealed: bool,
}

/// What one hand-off pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandoffReport {
    /// Shards adopted by their new owners and deleted here.
    pub moved: u64,
    /// Shards whose new owner did not confirm; a later pass retries them.
    pub failed: u64,
}

/// Hands every shard this node holds but no longer owns at `epoch` to its owner.
pub(crate) async fn hand_off_foreign(ctx: &Ctx, epoch: u64) -> Result<HandoffReport, TallyError> {
    let mut report = HandoffReport::default();
    let Some(placement) = &ctx.placement else { return Ok(report) };
    if placement.epoch() < epoch {
        let id = ShardId::new(tally_core::CounterName::new("handoff").expect("a valid name"), 0, 0);
        return Err(unavailable(&id, &format!("placement epoch {epoch} not applied here yet")));
    }
    // The store lists only shards with a committed write. A shard whose first write
    // is still with its actor (or on its way to the disk) would be missed, and its
    // new owner would serve it from nothing once the next change makes this node no
    // longer its previous owner. So first stop every actor of a shard this node no
    // longer owns: each commits what it took before it ends, and none can start
    // again here (the supervisor starts owned shards only).
    let mut foreign: Vec<ShardId> = ctx
        .directory
        .iter()
        .map(|e| e.key().clone())
        .filter(|id| placement.remote_owner(id).is_some())
        .collect();
    foreign.sort();
    for id in foreign {
        ctx.stop_local(&id).await;
    }
    let mut after: Option<ShardId> = None;
    loop {
        let page = ctx.store.shard_ids(after.as_ref(), HANDOFF_SCAN_PAGE)?;
        let last_page = page.len() < HANDOFF_SCAN_PAGE;
        for id in page {
            after = Some(id.clone());
            let Some(owner) = placement.remote_owner(&id) else { continue };
            if bug!(HandoffDeletesEarly) {
                ctx.drop_shard_data(&id)?;
            }
            match placement.call(&owner, ShardRequest::Adopt { id: id.clone(), epoch }).await {
                Ok(ShardResponse::Done) => {
                    ctx.drop_shard_data(&id)?;
                    report.moved += 1;
                }
                Ok(other) => {
                    tracing::warn!(shard = %id, "{}", unexpected(&owner, &id, other));
                    report.failed += 1;
                }
                Err(e) => {
                    tracing::warn!(shard = %id, owner = %owner, error = %e, "hand-off failed; will retry");
                    report.failed += 1;
                }
            }
        }
        if last_page {
            break;
        }
    }
    ctx.flusher.flush().await?;
    Ok(report)
}
