//! What Redis's `INCR` answers: a counter's total right after an increment, without
//! a read of its shards per increment.
//!
//! Each counter active on a node keeps a [`Ledger`], shared by every runtime the
//! counter has had here (a metadata change builds a new runtime; the ledger carries
//! over). It splits the counter's total in two:
//!
//! * **ours**: every delta this node acknowledged for the counter (buffered or
//!   written straight to a shard), summed in the accumulator slots as they are
//!   acknowledged (`Slot::acked`, beside the slot's sum: no extra cache line on the
//!   fast path), plus what replaced runtimes acknowledged (`carried`);
//! * **the rest**: everything else the shards hold — other nodes' increments,
//!   corrections, what this node counted before the ledger began — learnt from one
//!   sum of the shards (the *base*) and what of ours had reached them then.
//!
//! The answer to an increment is `base.read + (ours now − ours delivered at the
//! base)`. It includes this increment and every increment this node acknowledged
//! before it, each exactly once, and the rest as of the base.
//!
//! # Taking a base exactly
//!
//! A sum of the shards taken while some of this node's deliveries (a drained sum,
//! an increment written straight to its shard) are between being sent and being
//! confirmed may or may not include them, and nothing would tell which. So every
//! delivery holds the ledger's gate for reading from before it is sent until its
//! confirmation is counted in `delivered`, and a base is taken under the gate held
//! for writing: no delivery is in flight, none starts, and the sum holds exactly the
//! deliveries counted in `delivered`. (Sums whose answer was lost are in the drain
//! book, not under the gate: they are resent first; one still in doubt makes the
//! base inexact, which the answer says.) The writer waits for the deliveries in
//! flight, then holds new ones back for one read of the shards.
//!
//! A base is taken when the counter's first answer on this node needs one (a
//! counter this node creates starts with an exact empty base), again after this
//! node wrote a correction (`reconcile`, `SET`), and, in a cluster, in the
//! background once it is older than [`LEDGER_REFRESH_MS`], so other nodes'
//! increments show within about that long.

use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::runtime::CounterRuntime;
use crossbeam_utils::atomic::AtomicCell;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::SeqCst};
use std::sync::Arc;
use tally_core::CounterName;

/// How old a cluster node's base may grow while its counter answers increments
/// before it is taken again in the background: how long other nodes' increments
/// may be missing from this node's `INCR` answers (milliseconds). A base costs one
/// read of every shard, during which this node's deliveries for the counter wait.
pub const LEDGER_REFRESH_MS: u64 = 1_000;

/// One sum of the shards and what of this node's increments it held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Base {
    /// The counter's total as read (sealed generations' base included).
    read: i128,
    /// `delivered` when it was read: this node's increments the read holds.
    delivered: i64,
    /// Whether the read held exactly those (no sum in doubt).
    exact: bool,
    /// When it was read (0 when taken without a clock: a counter created here).
    at_ms: u64,
}

/// A counter's answer book on this node (see the module docs).
pub(crate) struct Ledger {
    /// What runtimes replaced since the ledger began acknowledged (wrapping).
    carried: AtomicI64,
    /// This node's acknowledged deltas confirmed in their shards (wrapping).
    delivered: AtomicI64,
    /// The last base, if one was taken.
    base: AtomicCell<Option<Base>>,
    /// Held for reading by every delivery in flight, for writing by a base read.
    gate: tokio::sync::RwLock<()>,
    /// One base read at a time.
    taking: tokio::sync::Mutex<()>,
    /// A background refresh is running.
    refreshing: AtomicBool,
}

/// An answer the ledger gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answer {
    /// The total.
    pub(crate) value: i128,
    /// Whether its base was read exactly.
    pub(crate) exact: bool,
}

/// A delivery of acknowledged increments to a shard, holding the gate for reading
/// until it is confirmed or given up (dropped).
pub(crate) struct Delivery<'a> {
    ledger: &'a Ledger,
    _gate: tokio::sync::RwLockReadGuard<'a, ()>,
}

impl Delivery<'_> {
    /// The shard holds `sum` of this node's acknowledged increments now (applied, or
    /// found applied before: a duplicate of a resent sum).
    pub(crate) fn confirm(&self, sum: i64) {
        self.ledger.delivered.fetch_add(sum, SeqCst);
    }
}

impl Ledger {
    /// A ledger with no base yet: the counter existed before this node knew it.
    pub(crate) fn new() -> Self {
        Self {
            carried: AtomicI64::new(0),
            delivered: AtomicI64::new(0),
            base: AtomicCell::new(None),
            gate: tokio::sync::RwLock::new(()),
            taking: tokio::sync::Mutex::new(()),
            refreshing: AtomicBool::new(false),
        }
    }

    /// The ledger of a counter this node created at `at_ms`: it held nothing
    /// anywhere then, so its base is an exact zero taken at its creation (and is due
    /// for a refresh no sooner than a base read then would be).
    pub(crate) fn empty(at_ms: u64) -> Self {
        let ledger = Self::new();
        ledger.base.store(Some(Base { read: 0, delivered: 0, exact: true, at_ms }));
        ledger
    }

    /// Starts a delivery: waits while a base is being read.
    pub(crate) async fn deliver(&self) -> Delivery<'_> {
        Delivery { ledger: self, _gate: self.gate.read().await }
    }

    /// Adds what a replaced runtime acknowledged.
    pub(crate) fn carry(&self, acked: i64) {
        if acked != 0 {
            self.carried.fetch_add(acked, SeqCst);
        }
    }

    /// Everything this node acknowledged through runtimes of the counter, `rt` being
    /// the current one (wrapping).
    pub(crate) fn acked(&self, rt: &CounterRuntime) -> i64 {
        let mut sum = self.carried.load(SeqCst);
        for slot in rt.slots.iter() {
            sum = sum.wrapping_add(slot.acked.load(SeqCst));
        }
        sum
    }

    /// The total once `acked` is what this node acknowledged; `None` without a base.
    pub(crate) fn answer(&self, acked: i64) -> Option<Answer> {
        let base = self.base.load()?;
        let since = i128::from(acked.wrapping_sub(base.delivered));
        Some(Answer { value: base.read + since, exact: base.exact })
    }

    /// Forgets the base: this node changed the counter outside its increments (a
    /// correction), so the next answer reads the shards again.
    pub(crate) fn forget_base(&self) {
        self.base.store(None);
    }

    /// Whether a background refresh is due at `now_ms`, claiming it if so.
    pub(crate) fn claim_refresh(&self, now_ms: u64) -> bool {
        let due = self.base.load().is_none_or(|b| now_ms.saturating_sub(b.at_ms) >= LEDGER_REFRESH_MS);
        due && !self.refreshing.swap(true, SeqCst)
    }

    /// Reads a base for `name`, whose current runtime is `rt`, unless one exists and
    /// `again` is false. No delivery of this node's increments is in flight while
    /// the shards are read (see the module docs). `Ok(Err(missing))`: shards that did
    /// not answer, so no base was taken (a partial sum is never one).
    pub(crate) async fn take_base(
        &self,
        ctx: &Arc<Ctx>,
        rt: &Arc<CounterRuntime>,
        again: bool,
    ) -> Result<Result<(), Vec<u16>>, TallyError> {
        let _one = self.taking.lock().await;
        if !again && self.base.load().is_some() {
            return Ok(Ok(()));
        }
        let name: &CounterName = &rt.name;
        if ctx.in_doubt_of(name) > 0 {
            ctx.resend_in_doubt(Some(name)).await;
        }
        let gate = self.gate.write().await;
        let delivered = self.delivered.load(SeqCst);
        let exact = ctx.in_doubt_of(name) == 0;
        let meta = ctx.registry.get(name.as_str()).map_or_else(|| rt.meta.clone(), |r| r.meta.clone());
        let at_ms = ctx.now_ms();
        let read = crate::read::sum_shards(ctx, &meta, name).await;
        drop(gate);
        let read = read?;
        if !read.complete {
            return Ok(Err(read.missing_shards));
        }
        self.base.store(Some(Base { read: read.value, delivered, exact, at_ms }));
        Ok(Ok(()))
    }

    /// Takes a base again in the background (a cluster node: other nodes' increments
    /// show in this node's answers from then on); the caller claimed it
    /// ([`Ledger::claim_refresh`]).
    pub(crate) fn refresh(ctx: &Arc<Ctx>, rt: &Arc<CounterRuntime>) {
        let (ctx, rt) = (ctx.clone(), rt.clone());
        tokio::spawn(async move {
            match rt.ledger.take_base(&ctx, &rt, true).await {
                Ok(Ok(())) => {}
                Ok(Err(missing)) => {
                    tracing::debug!(counter = %rt.name, ?missing, "cannot refresh the INCR answer's base yet")
                }
                Err(e) => {
                    tracing::debug!(counter = %rt.name, error = %e, "cannot refresh the INCR answer's base")
                }
            }
            rt.ledger.refreshing.store(false, SeqCst);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_counts_what_was_acknowledged_since_the_base() {
        let ledger = Ledger::new();
        assert_eq!(ledger.answer(5), None, "no base, no answer");
        // A base read 100 while 30 of this node's increments were in the shards.
        ledger.base.store(Some(Base { read: 100, delivered: 30, exact: true, at_ms: 7 }));
        assert_eq!(ledger.answer(30), Some(Answer { value: 100, exact: true }));
        assert_eq!(ledger.answer(31), Some(Answer { value: 101, exact: true }));
        assert_eq!(ledger.answer(20), Some(Answer { value: 90, exact: true }), "decrements count down");
        // The sums wrap; their differences stay right.
        ledger.base.store(Some(Base { read: 0, delivered: i64::MAX, exact: false, at_ms: 7 }));
        assert_eq!(ledger.answer(i64::MIN), Some(Answer { value: 1, exact: false }));
        ledger.forget_base();
        assert_eq!(ledger.answer(1), None);
        assert_eq!(Ledger::empty(7).answer(3), Some(Answer { value: 3, exact: true }));
    }

    /// Fixed defect: a counter's empty base was stamped at time 0, so in a cluster
    /// the first `INCR` of every counter a node created claimed a refresh at once:
    /// a fresh read of every new counter's shards, which at thousands of new
    /// counters a second flooded the range groups with leadership confirmations.
    #[test]
    fn a_created_counters_empty_base_is_as_fresh_as_its_creation() {
        let now = 1_800_000_000_000;
        let ledger = Ledger::empty(now);
        assert!(!ledger.claim_refresh(now), "no read right after the creation");
        assert!(!ledger.claim_refresh(now + LEDGER_REFRESH_MS - 1));
        assert!(ledger.claim_refresh(now + LEDGER_REFRESH_MS), "refreshed like any base");
    }

    #[test]
    fn a_refresh_is_claimed_once_its_base_is_old() {
        let ledger = Ledger::new();
        ledger.base.store(Some(Base { read: 0, delivered: 0, exact: true, at_ms: 1_000 }));
        assert!(!ledger.claim_refresh(1_000 + LEDGER_REFRESH_MS - 1));
        assert!(ledger.claim_refresh(1_000 + LEDGER_REFRESH_MS));
        assert!(!ledger.claim_refresh(1_000 + 2 * LEDGER_REFRESH_MS), "one refresh at a time");
    }
}
