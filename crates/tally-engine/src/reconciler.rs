//! The reconciler: compares a counter's sum of shards with an authoritative total
//! and writes the difference to one shard as a correction.
//!
//! A correction is an increment whose event id is derived from (counter,
//! authoritative total, total found), so a correction that is retried or delivered
//! twice is deduplicated like any other increment, and reconciling again against the
//! same total finds no drift. Totals are `i128`; a drift beyond one `i64` is written as
//! several corrections.

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
use tally_core::{CounterName, ShardId};

/// Messages the reconciler takes.
pub(crate) enum ReconcilerMsg {
    /// Reconcile against a caller's authoritative total.
    Reconcile {
        name: CounterName,
        authoritative: i128,
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
            ReconcilerMsg::Reconcile { name, authoritative, reply } => {
                let _ = reply.send(reconcile(&ctx, &name, authoritative).await);
            }
            ReconcilerMsg::Tick => {
                let Some(authority) = ctx.config.authority.clone() else { return Ok(()) };
                for counter in authority.counters() {
                    let Ok(name) = CounterName::new(counter) else { continue };
                    let Some(total) = authority.total(name.as_str()) else { continue };
                    match reconcile(&ctx, &name, total).await {
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

/// Largest drift one reconciliation corrects, in counter units: one correction, to
/// one shard, always fits that shard's range alongside what it holds, so it applies
/// whole or not at all.
pub const RECONCILE_DRIFT_ABS_MAX: i128 = 1 << 61;

/// Largest magnitude of one correction: a quarter of a shard's range, so a large
/// drift spreads over several shards instead of overflowing one.
const CORRECTION_ABS_MAX: i64 = 1 << 61;

/// The event id of the `part`-th correction bringing `name` from `before` to
/// `authoritative`, chosen so that it routes to shard `part % shards` (parts spread
/// over shards, and a retry finds its record like any event id). Deterministic: the
/// same correction always gets the same id. `~` is outside the client alphabet.
fn correction_id(name: &CounterName, authoritative: i128, before: i128, part: u32, shards: u16) -> String {
    let mut key = name.as_str().as_bytes().to_vec();
    key.extend_from_slice(&authoritative.to_be_bytes());
    key.extend_from_slice(&before.to_be_bytes());
    let base = hash64(0x7265_636f_6e63_696c, &key);
    let want = (part % u32::from(shards)) as u16;
    (0u32..)
        .map(|salt| format!("~reconcile:{base:016x}:{part}:{salt}"))
        .find(|id| shard_of_event(id, shards) == want)
        .expect("some salt routes to every shard")
}

/// Splits a drift into non-zero deltas of at most [`CORRECTION_ABS_MAX`].
fn parts(mut drift: i128) -> Vec<i64> {
    let mut out = Vec::new();
    while drift != 0 {
        let max = i128::from(CORRECTION_ABS_MAX);
        let step = drift.clamp(-max, max) as i64;
        out.push(step);
        drift -= i128::from(step);
    }
    out
}

pub(crate) async fn reconcile(
    ctx: &Arc<Ctx>,
    name: &CounterName,
    authoritative: i128,
) -> Result<ReconcileReport, TallyError> {
    let rt = ctx.runtime(name.as_str(), false).await?;
    ctx.drain(&rt).await;
    ctx.settle_drains(&rt).await;
    let before = crate::read::sum_shards(ctx, &rt.meta, name).await?.value;
    let drift = authoritative - before;
    ctx.stats
        .drift_last
        .store(i64::try_from(drift).unwrap_or(if drift > 0 { i64::MAX } else { i64::MIN }), Relaxed);
    if drift == 0 {
        return Ok(ReconcileReport { before, drift, corrected: false });
    }
    for (part, delta) in parts(drift).into_iter().enumerate() {
        let mut rt = ctx.runtime(name.as_str(), false).await?;
        loop {
            let event_id = correction_id(name, authoritative, before, part as u32, rt.meta.layout.shards);
            let index = shard_of_event(&event_id, rt.meta.layout.shards);
            let id = ShardId::new(name.clone(), rt.meta.layout.generation, index);
            let sub = Submission::Single { delta, event_id: Some(event_id.clone()), member: None };
            match ctx.submit(&id, &rt.meta, sub).await? {
                ShardReply::Done { outcome: Outcome::Applied | Outcome::Duplicate, .. } => break,
                ShardReply::Done { outcome: Outcome::Overflow(o), .. } => {
                    return Err(TallyError::Overflow(o))
                }
                ShardReply::Done { outcome: Outcome::Conflict { recorded_delta }, .. } => {
                    return Err(TallyError::EventIdConflict { event_id, recorded_delta, delta })
                }
                ShardReply::Sealed => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    rt = ctx.refresh(&rt).await?;
                }
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
    fn drift_splits_into_i64_parts() {
        assert_eq!(parts(0), Vec::<i64>::new());
        assert_eq!(parts(-5), vec![-5]);
        let big = i128::from(i64::MAX) * 2 + 3;
        let p = parts(big);
        assert_eq!(p.iter().map(|&d| i128::from(d)).sum::<i128>(), big);
        assert!(p.iter().all(|&d| d != 0 && d.abs() <= CORRECTION_ABS_MAX));
        let neg = i128::from(i64::MIN) * 3;
        assert_eq!(parts(neg).iter().map(|&d| i128::from(d)).sum::<i128>(), neg);
    }

    #[test]
    fn correction_ids_are_stable_and_distinct() {
        let n = CounterName::new("c").unwrap();
        assert_eq!(correction_id(&n, 10, 5, 0, 8), correction_id(&n, 10, 5, 0, 8));
        assert_ne!(correction_id(&n, 10, 5, 0, 8), correction_id(&n, 10, 6, 0, 8));
        assert_ne!(correction_id(&n, 10, 5, 0, 8), correction_id(&n, 10, 5, 1, 8));
        assert!(correction_id(&n, 10, 5, 0, 8).starts_with('~'));
        for part in 0..16 {
            assert_eq!(shard_of_event(&correction_id(&n, 1, 2, part, 8), 8), (part % 8) as u16);
        }
    }
}
