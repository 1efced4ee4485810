//! Increments kept within bounds named with each increment (Redis's `INCREX`,
//! [`Tally::incr_within`]).
//!
//! Two ways, chosen per call:
//!
//! * **The counter's own bounds are the call's** (its spec's `min`/`max`, from a
//!   `PUT`, its namespace, or an earlier bounded `INCREX` that created it): the
//!   increment goes to the shards as it is, and the counter's escrow refuses it if
//!   it would cross a bound. That holds against every writer on every node. A new
//!   counter whose namespace (or the node default) names no bounds of its own is
//!   created this way, `sync` with the call's bounds, when they include 0.
//! * **Otherwise** the node reads the counter's total as its `INCR` answers see it
//!   ([`Tally::current_total`]), decides with [`tally_core::within`], and counts
//!   what it decided. The bounds then hold among this node's bounded increments of
//!   the counter (they take turns, [`WITHIN_TURNS`]), not against increments made
//!   at the same time without them or on other nodes.

use crate::api::{IncrTotal, Increment, Total};
use crate::error::TallyError;
use crate::tally::Tally;
use std::hash::{Hash, Hasher};
use tally_core::spec::{Durability, SpecError};
use tally_core::within::{Step, Within};

/// How many turn locks serialize a node's bounded increments decided from the
/// total (each counter takes the one its name hashes to). A fixed table keeps the
/// memory constant whatever the number of counters; two counters that share a
/// lock only wait for each other's read and increment.
pub const WITHIN_TURNS: usize = 1024;

/// How many times an increment on a counter whose escrow refused it reads the
/// total again and asks for what now fits (all of it again, if the total says it
/// fits; what is left of it, saturating), before it answers that nothing was
/// added. Each retry follows a refusal caused by other increments that took the
/// headroom meanwhile, or by grants from other shards that came after the shard
/// stopped waiting for them, so a few are enough.
pub const SATURATE_ATTEMPTS_MAX: usize = 4;

/// The turn locks ([`WITHIN_TURNS`]).
pub(crate) struct Turns(Box<[tokio::sync::Mutex<()>]>);

impl Default for Turns {
    fn default() -> Self {
        Self((0..WITHIN_TURNS).map(|_| tokio::sync::Mutex::new(())).collect())
    }
}

impl Turns {
    fn of(&self, name: &str) -> &tokio::sync::Mutex<()> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        &self.0[(h.finish() % WITHIN_TURNS as u64) as usize]
    }
}

/// What a bounded increment did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithinOutcome {
    /// The total after it (the total it found, when it added nothing).
    pub total: IncrTotal,
    /// What was added: the increment asked for, the saturating one, or 0 when it
    /// was skipped.
    pub applied: i64,
    /// Whether the counter's own bounds are the call's, so its escrow kept them
    /// against every writer (see the module docs).
    pub kept_by_counter: bool,
    /// Whether the counter exists after the call (a skipped increment of a counter
    /// that did not exist creates nothing).
    pub exists: bool,
    /// Whether it was skipped: its result would have left the bounds. A saturating
    /// increment at the bound already adds 0 without being skipped.
    pub skipped: bool,
}

impl Tally {
    /// Adds `delta` to the counter if its total stays within `within` (or, with
    /// `within.saturate`, what takes it to the bound it would cross); otherwise adds
    /// nothing and reports the total as it is. An unknown counter starts at 0: it is
    /// created with the call's bounds as its own when its namespace (or the node
    /// default) names none and they include 0, else as an increment creates it.
    /// See the module docs for what holds against concurrent writers.
    pub async fn incr_within(
        &self,
        name: &str,
        delta: i64,
        within: Within,
    ) -> Result<WithinOutcome, TallyError> {
        let ctx = self.ctx();
        let mut meta = match ctx.runtime(name, false).await {
            Ok(rt) => Some(rt.meta.clone()),
            Err(TallyError::NotFound(_)) => None,
            Err(e) => return Err(e),
        };
        if meta.is_none() {
            match within.step(0, delta)? {
                Step::Skip => return Ok(skipped(Total { value: 0, exact: true }, false, false)),
                Step::Apply(_) if within.fit_a_new_counter() => {
                    if self.create_bounded(name, within).await? {
                        meta = ctx.runtime(name, false).await.ok().map(|rt| rt.meta.clone());
                    }
                }
                Step::Apply(_) => {}
            }
        }
        if meta.as_ref().is_some_and(|m| m.spec.limit.is_none() && within.kept_by(m.spec.bounds())) {
            return self.escrowed(name, delta, within).await;
        }
        let own = meta.as_ref().map(|m| m.spec.bounds()).unwrap_or_default();
        let _turn = ctx.within_turns.of(name).lock().await;
        let found = match self.current_total(name).await {
            Ok(IncrTotal::Total(t)) => Some(t),
            Ok(IncrTotal::Incomplete(missing)) => {
                return Ok(WithinOutcome { total: IncrTotal::Incomplete(missing), ..skipped_at(false) })
            }
            Err(TallyError::NotFound(_)) => None,
            Err(e) => return Err(e),
        };
        let now = found.unwrap_or(Total { value: 0, exact: true });
        match within.narrowed(own).step(now.value, delta)? {
            Step::Skip => Ok(skipped(now, found.is_some(), false)),
            Step::Apply(0) => {
                self.ensure(name).await?;
                Ok(WithinOutcome { skipped: false, ..skipped(now, true, false) })
            }
            Step::Apply(d) => match self.incr_value(name, Increment::new(d)).await {
                Ok((_, total)) => Ok(WithinOutcome {
                    total,
                    applied: d,
                    kept_by_counter: false,
                    exists: true,
                    skipped: false,
                }),
                // The counter's own bound, crossed by an increment made meanwhile.
                Err(TallyError::BoundExceeded { .. }) => Ok(skipped(now, true, false)),
                Err(e) => Err(e),
            },
        }
    }

    /// The escrow way: the increment as it is, then (saturating) what the total
    /// read after a refusal says fits.
    async fn escrowed(&self, name: &str, delta: i64, within: Within) -> Result<WithinOutcome, TallyError> {
        let mut ask = delta;
        for _ in 0..SATURATE_ATTEMPTS_MAX {
            if ask != 0 {
                match self.incr_value(name, Increment::new(ask)).await {
                    Ok((_, total)) => {
                        return Ok(WithinOutcome {
                            total,
                            applied: ask,
                            kept_by_counter: true,
                            exists: true,
                            skipped: false,
                        })
                    }
                    Err(TallyError::BoundExceeded { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            let now = match self.current_total(name).await? {
                IncrTotal::Total(t) => t,
                missing => return Ok(WithinOutcome { total: missing, ..skipped_at(true) }),
            };
            match within.step(now.value, delta)? {
                // Saturating at the bound already: nothing to add, nothing skipped.
                Step::Apply(0) => return Ok(WithinOutcome { skipped: false, ..skipped(now, true, true) }),
                Step::Skip => return Ok(skipped(now, true, true)),
                // The total says the increment fits, yet its shard lacked the
                // headroom: the rest sits on other shards, and the grants it asked
                // them for came too late (a loaded node) or went to other
                // increments. What came late stays with the shard: ask again.
                Step::Apply(d) if d == ask => continue,
                Step::Apply(d) if within.saturate => ask = d,
                Step::Apply(_) => return Ok(skipped(now, true, true)),
            }
        }
        match self.current_total(name).await? {
            IncrTotal::Total(now) => Ok(skipped(now, true, true)),
            missing => Ok(WithinOutcome { total: missing, ..skipped_at(true) }),
        }
    }

    /// Creates `name` with `within`'s bounds as its own, over the spec its
    /// namespace (or the node default) gives, unless that names bounds or a limit
    /// of its own: true if it now has them (created here or by a racing caller).
    async fn create_bounded(&self, name: &str, within: Within) -> Result<bool, TallyError> {
        let ctx = self.ctx();
        let table = self.namespaces()?;
        let ns = *tally_core::namespace::spec_for(&table, name, &ctx.config.default_spec);
        if ns.patch.min.is_some() || ns.patch.max.is_some() || ns.patch.limit.is_some() {
            return Ok(false);
        }
        let mut patch = ns.patch;
        if let Some(auto) = ns.auto {
            patch.shards = Some(auto.min_shards);
        }
        patch.min = within.min;
        patch.max = within.max;
        patch.durability = Some(Durability::Sync);
        match self.put_counter(name, patch).await {
            Ok(_) => {}
            // Created meanwhile with other bounds, or a spec bounds cannot go with:
            // the total decides instead.
            Err(TallyError::InvalidSpec(
                SpecError::BoundsFixed { .. } | SpecError::BoundedNeedsSync | SpecError::LimitWithBounds,
            )) => return Ok(false),
            Err(e) => return Err(e),
        }
        if let Some(ttl) = ns.ttl_ms {
            let at = ctx.now_ms().saturating_add(ttl);
            self.expire(name, at, tally_core::expiry::Condition::Nx).await?;
        }
        Ok(true)
    }
}

/// Nothing added, the counter at `now`.
fn skipped(now: Total, exists: bool, kept_by_counter: bool) -> WithinOutcome {
    WithinOutcome { total: IncrTotal::Total(now), applied: 0, kept_by_counter, exists, skipped: true }
}

/// Nothing added to an existing counter whose total could not be read.
fn skipped_at(kept_by_counter: bool) -> WithinOutcome {
    skipped(Total { value: 0, exact: false }, true, kept_by_counter)
}
