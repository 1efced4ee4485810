//! The reconciler: compares a counter's sum of shards with an authoritative total
//! and writes the difference to one shard as a correction.
//!
//! A correction is an increment under an event id of its own run
//! (`~reconcile:{node}:{incarnation}:{run}`: never repeated by this node in this or
//! any later life), so a correction resent within its run (a resharding sealed its
//! shard meanwhile) is deduplicated like any other increment, while a later run is a
//! new correction even when it finds the same total against the same authority (the
//! counter may have moved away and back since). Runs on one node go one at a time,
//! so a run reads the total after the previous run's correction; reconciling again
//! against the same total finds no drift. In a cluster every node sends its runs of
//! a counter to the owner of the counter's first shard ([`crate::Tally::reconcile`]),
//! so the runs of one counter go one at a time across the cluster. A reconciliation corrects from a complete total only,
//! and at most [`RECONCILE_DRIFT_ABS_MAX`] at a time, as one increment that applies
//! whole or not at all.

use crate::api::ReconcileReport;
use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::shard::ShardReply;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;
pub use tally_core::reconcile::RECONCILE_DRIFT_ABS_MAX;
use tally_core::reconcile::{correction_delta, CorrectionIds};
use tally_core::router::shard_of_event;
use tally_core::shard::{Outcome, Submission};
use tally_core::CounterName;

/// Messages the reconciler takes.
pub(crate) enum ReconcilerMsg {
    /// Reconcile against a caller's authoritative total.
    Reconcile {
        name: CounterName,
        authoritative: i128,
        /// The run's correction id when the caller names the run (a scheduled
        /// instant every node computes alike); `None` for a run of its own.
        event_id: Option<String>,
        reply: RpcReplyPort<Result<ReconcileReport, TallyError>>,
    },
    /// Reconcile every counter the configured authority knows.
    Tick,
}

impl ractor::Message for ReconcilerMsg {}

/// The reconciler actor.
pub(crate) struct Reconciler;

/// The reconciler's state.
pub(crate) struct ReconcilerState {
    ctx: Weak<Ctx>,
    ticker: Option<tokio::task::JoinHandle<()>>,
    /// The event ids of this node's corrections.
    ids: CorrectionIds,
}

impl Actor for Reconciler {
    type Msg = ReconcilerMsg;
    type State = ReconcilerState;
    type Arguments = (Weak<Ctx>, CorrectionIds);

    async fn pre_start(
        &self,
        myself: ActorRef<ReconcilerMsg>,
        (ctx, ids): (Weak<Ctx>, CorrectionIds),
    ) -> Result<ReconcilerState, ActorProcessingErr> {
        let interval = ctx.upgrade().map_or(0, |c| {
            if c.config.authority.is_some() {
                c.config.reconcile_interval_ms
            } else {
                0
            }
        });
        let ticker = (interval > 0)
            .then(|| myself.send_interval(Duration::from_millis(interval), || ReconcilerMsg::Tick));
        Ok(ReconcilerState { ctx, ticker, ids })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ReconcilerMsg>,
        state: &mut ReconcilerState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<ReconcilerMsg>,
        msg: ReconcilerMsg,
        state: &mut ReconcilerState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(ctx) = state.ctx.upgrade() else { return Ok(()) };
        match msg {
            ReconcilerMsg::Reconcile { name, authoritative, event_id, reply } => {
                let event_id = event_id.unwrap_or_else(|| state.ids.next_run());
                let _ = reply.send(guarded(&ctx, name, authoritative, event_id).await);
            }
            ReconcilerMsg::Tick => {
                let Some(authority) = ctx.config.authority.clone() else { return Ok(()) };
                for counter in authority.counters() {
                    let Ok(name) = CounterName::new(counter) else { continue };
                    let Some(total) = authority.total(name.as_str()) else { continue };
                    match guarded(&ctx, name.clone(), total, state.ids.next_run()).await {
                        Ok(r) if r.corrected => {
                            tracing::info!(counter = %name, drift = %r.drift, "corrected drift")
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::warn!(counter = %name, error = %e, "periodic reconciliation failed")
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Runs one reconciliation in a task of its own and waits for it: reconciliations
/// still run one at a time, and a failure inside one (an assertion, say) answers that
/// request with an error instead of stopping the reconciler for every later one.
async fn guarded(
    ctx: &Arc<Ctx>,
    name: CounterName,
    authoritative: i128,
    event_id: String,
) -> Result<ReconcileReport, TallyError> {
    let task = {
        let (ctx, name) = (ctx.clone(), name.clone());
        tokio::spawn(async move { reconcile(&ctx, &name, authoritative, event_id).await })
    };
    task.await.unwrap_or_else(|e| {
        tracing::error!(counter = %name, error = %e, "reconciliation task failed");
        Err(TallyError::Unavailable {
            shard: tally_core::name::quoted(name.as_str()),
            reason: format!("the reconciliation failed: {e}"),
        })
    })
}

/// Records the drift a reconciliation of `name` measured, in this node's figures
/// (the node that ran it, and the node a caller asked, which may be another).
pub(crate) fn record_drift(ctx: &Ctx, name: &CounterName, drift: i128) {
    ctx.stats
        .drift_last
        .store(i64::try_from(drift).unwrap_or(if drift > 0 { i64::MAX } else { i64::MIN }), Relaxed);
    ctx.stats.drifts.record(name, drift, ctx.now_ms());
}

/// The drift from `before` to `authoritative` as one correction's delta, if it is
/// within [`RECONCILE_DRIFT_ABS_MAX`] (and so within 128 bits and one `i64`).
pub(crate) fn correction(authoritative: i128, before: i128) -> Result<i64, TallyError> {
    correction_delta(authoritative, before).ok_or_else(|| {
        let drift = authoritative.checked_sub(before);
        TallyError::DriftOutOfRange {
            authoritative,
            before,
            drift: drift.unwrap_or(if authoritative > before { i128::MAX } else { i128::MIN }),
            max: RECONCILE_DRIFT_ABS_MAX,
        }
    })
}

/// One reconciliation run of `name`, whose correction (if any) is `event_id`.
pub(crate) async fn reconcile(
    ctx: &Arc<Ctx>,
    name: &CounterName,
    authoritative: i128,
    event_id: String,
) -> Result<ReconcileReport, TallyError> {
    let rt = ctx.runtime(name.as_str(), false).await?;
    // Only a complete total may be corrected: a correction computed from part of the
    // shards would count the missing ones a second time once they answer again.
    let read = crate::read::fresh(ctx, &rt).await?;
    if !read.complete {
        return Err(TallyError::Unavailable {
            shard: tally_core::name::quoted(name.as_str()),
            reason: format!(
                "the total cannot be read whole (shards {:?} did not answer, or buffered increments \
                 are still in doubt), and a correction from part of it would create drift; retry",
                read.missing_shards
            ),
        });
    }
    let before = read.value;
    let delta = correction(authoritative, before);
    let drift = authoritative.saturating_sub(before);
    record_drift(ctx, name, drift);
    let delta = delta?;
    if delta == 0 {
        return Ok(ReconcileReport { before, drift, corrected: false });
    }
    let mut rt = rt;
    // Whether this run's correction changed the value: a duplicate is another run's
    // correction under the same name (a scheduled instant run on two nodes), never an
    // earlier attempt of this one, which a sealed shard refused whole.
    let applied = loop {
        let index = shard_of_event(&event_id, rt.meta.layout.shards);
        let id = rt.meta.shard_id(name, rt.meta.layout.generation, index);
        let sub = Submission::Single {
            delta,
            event_id: Some(event_id.clone()),
            member: None,
            item: None,
            seq: None,
        };
        match ctx.submit(&id, &rt.meta, sub).await? {
            ShardReply::Done { outcome: Outcome::Applied, .. } => break true,
            ShardReply::Done { outcome: Outcome::Duplicate, .. } => break false,
            ShardReply::Done { outcome: Outcome::Overflow(o), .. } => return Err(TallyError::Overflow(o)),
            ShardReply::Done { outcome: Outcome::Conflict { recorded_delta }, .. } => {
                return Err(TallyError::EventIdConflict { event_id, recorded_delta, delta })
            }
            // A correction carries an event id, never a sequence.
            ShardReply::Done { outcome: Outcome::TooManyEventIds, .. } => {
                return Err(TallyError::QuotaExceeded {
                    quota: "engine.event_ids_per_counter_max",
                    what: format!(
                        "the correction of {} would be one event id too many",
                        tally_core::name::quoted(name.as_str())
                    ),
                })
            }
            ShardReply::Done { outcome: Outcome::OutOfOrder { .. } | Outcome::TooManyWriters, .. } => {
                return Err(TallyError::InvalidSequence("a correction carries no sequence"))
            }
            ShardReply::Done { outcome: Outcome::BoundExceeded { headroom }, .. } => {
                return Err(TallyError::bound_exceeded(name, &rt.meta.spec, delta, headroom));
            }
            ShardReply::Sealed => {
                tokio::time::sleep(Duration::from_millis(2)).await;
                rt = ctx.refresh(&rt).await?;
            }
        }
    };
    ctx.flusher.flush().await?;
    if applied {
        ctx.stats.reconcile_corrections.inc();
    }
    Ok(ReconcileReport { before, drift, corrected: applied })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drift_beyond_the_bound_is_refused_with_its_size() {
        assert_eq!(correction(-7, 100), Ok(-107));
        for (a, b) in [(RECONCILE_DRIFT_ABS_MAX + 1, 0), (i128::MAX, -5), (i128::MIN, 1), (10i128.pow(30), 0)]
        {
            let Err(TallyError::DriftOutOfRange { drift, .. }) = correction(a, b) else { panic!("{a} {b}") };
            assert!(drift.unsigned_abs() > RECONCILE_DRIFT_ABS_MAX.unsigned_abs());
        }
    }
}
