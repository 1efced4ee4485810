//! The reconciler: compares a counter's sum of shards with an authoritative total
//! and writes the difference to one shard as a correction.
//!
//! A correction is an increment whose event id is derived from (counter,
//! authoritative total, total found), so a correction that is retried or delivered
//! twice is deduplicated like any other increment, and reconciling again against the
//! same total finds no drift. A reconciliation corrects from a complete total only,
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
use tally_core::hash::hash64;
use tally_core::router::shard_of_event;
use tally_core::shard::{Outcome, Submission};
use tally_core::CounterName;

/// Messages the reconciler takes.
pub(crate) enum ReconcilerMsg {
    /// Reconcile against a caller's authoritative total.
    Reconcile {
        name: CounterName,
        authoritative: i128,
        /// What makes this correction's id its own (`SET`: a unique token); `None`
        /// for a reconciliation, whose id the totals alone decide.
        occasion: Option<String>,
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
}

impl Actor for Reconciler {
    type Msg = ReconcilerMsg;
    type State = ReconcilerState;
    type Arguments = Weak<Ctx>;

    async fn pre_start(
        &self,
        myself: ActorRef<ReconcilerMsg>,
        ctx: Weak<Ctx>,
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
        Ok(ReconcilerState { ctx, ticker })
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
            ReconcilerMsg::Reconcile { name, authoritative, occasion, reply } => {
                let _ = reply.send(guarded(&ctx, name, authoritative, occasion).await);
            }
            ReconcilerMsg::Tick => {
                let Some(authority) = ctx.config.authority.clone() else { return Ok(()) };
                for counter in authority.counters() {
                    let Ok(name) = CounterName::new(counter) else { continue };
                    let Some(total) = authority.total(name.as_str()) else { continue };
                    match guarded(&ctx, name.clone(), total, None).await {
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
    occasion: Option<String>,
) -> Result<ReconcileReport, TallyError> {
    let task = {
        let (ctx, name) = (ctx.clone(), name.clone());
        tokio::spawn(async move { reconcile(&ctx, &name, authoritative, occasion.as_deref()).await })
    };
    task.await.unwrap_or_else(|e| {
        tracing::error!(counter = %name, error = %e, "reconciliation task failed");
        Err(TallyError::Unavailable {
            shard: name.to_string(),
            reason: format!("the reconciliation failed: {e}"),
        })
    })
}

/// Largest drift one reconciliation corrects, in counter units. The correction is one
/// increment to one shard, and a quarter of a shard's range always fits beside what
/// the shard may hold, so a correction applies whole or is refused whole: it never
/// applies in part. A larger drift says the authoritative total is wrong, or that the
/// counter must be brought there in steps the caller chooses.
pub const RECONCILE_DRIFT_ABS_MAX: i128 = 1 << 61;

/// The event id of the correction bringing `name` from `before` to `authoritative`
/// (on `occasion`, when given). Deterministic, so a retried or duplicated correction
/// is deduplicated like any event id; `~` is outside the client alphabet, so no
/// client id can collide. An absolute write (`SET`) names a unique occasion: two
/// of them that find the same totals are still two corrections.
fn correction_id(name: &CounterName, authoritative: i128, before: i128, occasion: Option<&str>) -> String {
    let mut key = name.as_str().as_bytes().to_vec();
    key.extend_from_slice(&authoritative.to_be_bytes());
    key.extend_from_slice(&before.to_be_bytes());
    if let Some(o) = occasion {
        key.extend_from_slice(o.as_bytes());
    }
    format!("~reconcile:{:016x}", hash64(0x7265_636f_6e63_696c, &key))
}

/// The drift from `before` to `authoritative` as one correction's delta, if it is
/// within [`RECONCILE_DRIFT_ABS_MAX`] (and so within 128 bits and one `i64`).
fn correction(authoritative: i128, before: i128) -> Result<i64, TallyError> {
    let drift = authoritative.checked_sub(before);
    match drift.filter(|d| d.unsigned_abs() <= RECONCILE_DRIFT_ABS_MAX.unsigned_abs()) {
        Some(d) => Ok(i64::try_from(d).expect("the bound is inside i64")),
        None => Err(TallyError::DriftOutOfRange {
            authoritative,
            before,
            drift: drift.unwrap_or(if authoritative > before { i128::MAX } else { i128::MIN }),
            max: RECONCILE_DRIFT_ABS_MAX,
        }),
    }
}

pub(crate) async fn reconcile(
    ctx: &Arc<Ctx>,
    name: &CounterName,
    authoritative: i128,
    occasion: Option<&str>,
) -> Result<ReconcileReport, TallyError> {
    let rt = ctx.runtime(name.as_str(), false).await?;
    // Only a complete total may be corrected: a correction computed from part of the
    // shards would count the missing ones a second time once they answer again.
    let read = crate::read::fresh(ctx, &rt).await?;
    if !read.complete {
        return Err(TallyError::Unavailable {
            shard: name.to_string(),
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
    ctx.stats
        .drift_last
        .store(i64::try_from(drift).unwrap_or(if drift > 0 { i64::MAX } else { i64::MIN }), Relaxed);
    ctx.stats.drifts.record(name, drift, ctx.now_ms());
    let delta = delta?;
    if delta == 0 {
        return Ok(ReconcileReport { before, drift, corrected: false });
    }
    let event_id = correction_id(name, authoritative, before, occasion);
    let mut rt = rt;
    loop {
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
            ShardReply::Done { outcome: Outcome::Applied | Outcome::Duplicate, .. } => break,
            ShardReply::Done { outcome: Outcome::Overflow(o), .. } => return Err(TallyError::Overflow(o)),
            ShardReply::Done { outcome: Outcome::Conflict { recorded_delta }, .. } => {
                return Err(TallyError::EventIdConflict { event_id, recorded_delta, delta })
            }
            // A correction carries an event id, never a sequence.
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
    }
    ctx.flusher.flush().await?;
    ctx.stats.reconcile_corrections.inc();
    Ok(ReconcileReport { before, drift, corrected: true })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_correction_is_one_delta_within_the_bound() {
        assert_eq!(correction(100, 95), Ok(5));
        assert_eq!(correction(-7, 100), Ok(-107));
        assert_eq!(correction(RECONCILE_DRIFT_ABS_MAX, 0), Ok(1 << 61));
        assert_eq!(correction(-RECONCILE_DRIFT_ABS_MAX, 0), Ok(-(1 << 61)));
        for (a, b) in [(RECONCILE_DRIFT_ABS_MAX + 1, 0), (i128::MAX, -5), (i128::MIN, 1), (10i128.pow(30), 0)]
        {
            let Err(TallyError::DriftOutOfRange { drift, .. }) = correction(a, b) else { panic!("{a} {b}") };
            assert!(drift.unsigned_abs() > RECONCILE_DRIFT_ABS_MAX.unsigned_abs());
        }
    }

    #[test]
    fn correction_ids_are_stable_and_distinct() {
        let n = CounterName::new("c").unwrap();
        assert_eq!(correction_id(&n, 10, 5, None), correction_id(&n, 10, 5, None));
        assert_ne!(correction_id(&n, 10, 5, None), correction_id(&n, 10, 6, None));
        assert_ne!(correction_id(&n, 11, 5, None), correction_id(&n, 10, 5, None));
        assert!(correction_id(&n, 10, 5, None).starts_with('~'));
        assert_ne!(correction_id(&n, 10, 5, Some("a")), correction_id(&n, 10, 5, Some("b")));
        assert_ne!(correction_id(&n, 10, 5, Some("a")), correction_id(&n, 10, 5, None));
    }
}
