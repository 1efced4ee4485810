//! Escrow for bounded counters: a bound (`min`, `max`) that holds exactly across a
//! counter's shards without a global lock.
//!
//! # The idea
//!
//! A counter with `min = L` and value `V` has `V − L` of *headroom* below it. That
//! headroom is split into *shares*, one per shard: a shard admits a decrease of `d`
//! only if its own share holds `d`, and then spends it. A shard's share grows by every
//! increase it applies (the value rose, so did the headroom). Headroom moves between
//! shards only through *transfers*, and every unit of it is at all times in exactly
//! one place — a share, or a transfer in flight — so
//!
//! ```text
//!   Σ shares + Σ in-flight transfers  =  V − L        (the escrow equation)
//! ```
//!
//! and since no share is ever negative, `V ≥ L` always. `max = U` is the mirror image,
//! with a second set of shares of the headroom `U − V` spent by increases. Each side
//! is a [`Side`]; a counter with both bounds keeps both.
//!
//! # Transfers
//!
//! A shard that runs short asks the others ([`Message::Borrow`]); a donor debits its
//! share, *persists* the debit with the transfer, and only then sends it
//! ([`Message::Grant`]); the recipient credits the transfer once (by donor and the
//! donor's transfer sequence), persists, and acknowledges ([`Message::Ack`]); the donor
//! forgets a transfer once acknowledged and resends it until then. A crash of either
//! side loses only what was not persisted, which was never sent; a lost, duplicated
//! or reordered message changes nothing. Under a partition a shard spends its own share
//! only, so the bound still holds; it may refuse while headroom exists elsewhere.
//!
//! A donor's grants carry `acked_below`, the lowest sequence it has not seen
//! acknowledged: every credit below it can never be resent, so the recipient forgets
//! it, and each recipient remembers at most [`TRANSFERS_IN_FLIGHT_MAX`] credits per
//! donor.
//!
//! # Spending and waiting
//!
//! The shard machine ([`crate::shard_machine`]) decides each fresh increment of a
//! bounded counter with [`Ledger::spend`]: covered, it is counted in the same batch
//! (and its share spent in the same write). A change the share cannot cover is
//! *parked* ([`Input::Park`]): the ledger asks the other shards for what is lacking,
//! hands the change back ([`Effect::Retry`]) once grants cover it, and refuses it
//! ([`Effect::Refuse`], with the headroom this shard saw) after
//! [`Tuning::borrow_wait_ms`] (at most [`WAITING_MAX`] wait per shard). It is never
//! admitted in part. A counter of one shard has no one to borrow from: it refuses at
//! once.
//!
//! [`Ledger::step`] takes one [`Input`] and returns the [`Effect`]s to carry out, in
//! order: a [`Effect::Persist`] must be durable before any message after it is sent,
//! and it writes the ledger ([`Ledger::durable`]) in the same atomic batch as the
//! shard's value, so a crash reverts both together.
//!
//! # Window limits
//!
//! A counter with a `limit` of `M` per window keeps the same ledger with `max = M`,
//! but what it bounds is the window's total, not the counter's value: each shard
//! keeps its own increments in time buckets ([`crate::window`]), and when a bucket
//! leaves the window at that shard, what it held is headroom again — for that shard
//! ([`Input::Release`]), since it was spent from that shard's share. So per shard
//! `share + what its kept buckets hold` only changes by transfers, and
//!
//! ```text
//!   Σ shares + Σ in-flight transfers + Σ kept buckets  =  M
//! ```
//!
//! which bounds any read of the window, each shard's span being within its kept
//! buckets. An increment that lands in no bucket (stamped a window behind the
//! shard's newest bucket) is released at once. Increments are positive: a negative
//! one would give headroom back that its bucket takes away again when it expires.
//!
//! # What is not carried
//!
//! Bounds are set when a counter is created and its shard count never changes
//! afterwards ([`crate::spec::CounterSpec::updated`]): a resharding would have to carry
//! shares and transfers in flight into a new generation, which this version does not.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Most transfers one shard has sent and not seen acknowledged. A donor with this many
/// grants nothing more until some are acknowledged.
pub const TRANSFERS_IN_FLIGHT_MAX: usize = 64;
/// Most increments waiting for headroom at one shard; one more is refused at once.
pub const WAITING_MAX: usize = 1_024;
/// A grant not acknowledged is sent again after [`Tuning::resend_ms`], then after
/// twice that, and so on up to this many times it.
pub const RESEND_BACKOFF_MAX: u64 = 16;

/// Timers of the escrow, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuning {
    /// How long an increment waits for headroom from other shards before it is
    /// refused.
    pub borrow_wait_ms: u64,
    /// Pause between two rounds of borrow requests of one shard.
    pub ask_every_ms: u64,
    /// Pause before a grant not acknowledged is sent again.
    pub resend_ms: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning { borrow_wait_ms: 200, ask_every_ms: 50, resend_ms: 100 }
    }
}

impl Tuning {
    /// The timers for callers that give up after `call_timeout_ms`: a change waits
    /// for headroom at most half of it (and never longer than the default), so its
    /// refusal reaches a caller on another node before that caller stops listening;
    /// borrow requests go out at least twice within the wait.
    pub fn within_call(call_timeout_ms: u64) -> Tuning {
        let d = Tuning::default();
        let borrow_wait_ms = d.borrow_wait_ms.min(call_timeout_ms / 2).max(1);
        let ask_every_ms = d.ask_every_ms.min(borrow_wait_ms / 2).max(1);
        Tuning { borrow_wait_ms, ask_every_ms, resend_ms: d.resend_ms }
    }
}

/// Which bound a share guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Side {
    /// Headroom above `min`, spent by decreases.
    Down,
    /// Headroom below `max`, spent by increases.
    Up,
}

impl Side {
    const ALL: [Side; 2] = [Side::Down, Side::Up];

    fn slot(self) -> usize {
        match self {
            Side::Down => 0,
            Side::Up => 1,
        }
    }

    /// The side a change of `delta` spends from (`None` for zero).
    pub fn spent_by(delta: i64) -> Option<Side> {
        match delta.signum() {
            -1 => Some(Side::Down),
            1 => Some(Side::Up),
            _ => None,
        }
    }

    fn other(self) -> Side {
        match self {
            Side::Down => Side::Up,
            Side::Up => Side::Down,
        }
    }
}

/// A counter's bounds: `min ≤ value ≤ max`, either or both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bounds {
    /// The lowest value the counter may take.
    pub min: Option<i64>,
    /// The highest value the counter may take.
    pub max: Option<i64>,
}

/// Why bounds cannot be set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BoundsError {
    /// `min` is above `max`.
    #[error("min {min} is above max {max}")]
    Inverted {
        /// The lower bound.
        min: i64,
        /// The upper bound.
        max: i64,
    },
    /// The counter's value is already outside the bounds.
    #[error("the value {value} is outside the bounds {min:?}..={max:?}")]
    Outside {
        /// The counter's value.
        value: i64,
        /// The lower bound.
        min: Option<i64>,
        /// The upper bound.
        max: Option<i64>,
    },
}

impl Bounds {
    /// Whether either bound is set.
    pub fn any(&self) -> bool {
        self.min.is_some() || self.max.is_some()
    }

    fn guards(&self, side: Side) -> bool {
        match side {
            Side::Down => self.min.is_some(),
            Side::Up => self.max.is_some(),
        }
    }

    /// The headroom on each side of `value`, split as evenly as possible among
    /// `shards` shares (the first shards take the remainder). Refused when the bounds
    /// are inverted or `value` is outside them: a counter takes bounds only while it
    /// satisfies them, so the escrow equation holds from the first share on.
    pub fn initial_shares(&self, value: i64, shards: u16) -> Result<Vec<[u64; 2]>, BoundsError> {
        if let (Some(min), Some(max)) = (self.min, self.max) {
            if min > max {
                return Err(BoundsError::Inverted { min, max });
            }
        }
        let outside = self.min.is_some_and(|m| value < m) || self.max.is_some_and(|m| value > m);
        if outside {
            return Err(BoundsError::Outside { value, min: self.min, max: self.max });
        }
        let headroom = [
            self.min.map_or(0, |m| (i128::from(value) - i128::from(m)) as u64),
            self.max.map_or(0, |m| (i128::from(m) - i128::from(value)) as u64),
        ];
        let n = u64::from(shards.max(1));
        Ok((0..n).map(|i| headroom.map(|h| h / n + u64::from(i < h % n))).collect())
    }
}

/// A transfer this shard sent and has not seen acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outgoing {
    /// Which share it moves.
    pub side: Side,
    /// How much headroom.
    pub amount: u64,
}

/// What a recipient remembers of one donor's transfers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Credits {
    /// Every transfer below this was acknowledged to the donor: never resent.
    below: u64,
    /// Transfers at or above `below` already credited.
    seen: BTreeSet<u64>,
}

/// A message between two shards of the same counter and generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// `from` is short of `amount` on `side`.
    Borrow {
        /// The shard asking.
        from: u16,
        /// Which share it needs.
        side: Side,
        /// How much it needs.
        amount: u64,
    },
    /// Transfer `seq` of donor `from`: `amount` of headroom on `side`.
    Grant {
        /// The donor.
        from: u16,
        /// The donor's sequence of the transfer.
        seq: u64,
        /// Which share it moves.
        side: Side,
        /// How much headroom.
        amount: u64,
        /// The donor's lowest transfer not acknowledged yet.
        acked_below: u64,
    },
    /// The recipient `from` credited transfer `seq`.
    Ack {
        /// The recipient.
        from: u16,
        /// The donor's sequence of the transfer.
        seq: u64,
    },
}

/// One thing that happened to a shard's ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input<T> {
    /// A change of `delta` that [`Ledger::spend`] could not cover waits for headroom,
    /// since `since_ms` (when it first asked); `token` is handed back by
    /// [`Effect::Retry`] or [`Effect::Refuse`].
    Park {
        /// How much the value would change.
        delta: i64,
        /// The shell's handle for this change.
        token: T,
        /// When the change first found the share short.
        since_ms: u64,
    },
    /// A message from another shard.
    Receive(Message),
    /// `amount` of headroom on `side` came back to this shard without a change it
    /// applied: under a window limit, buckets of its own increments left the window
    /// (see *Window limits* above).
    Release {
        /// Which share grows.
        side: Side,
        /// By how much.
        amount: u64,
    },
    /// Time passed: waiting changes may expire, grants be resent, requests repeated.
    Tick,
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect<T> {
    /// The share may now cover the change of `token`: try it again with
    /// [`Ledger::spend`] (and park it again, with its first `since_ms`, if it is still
    /// short).
    Retry(T),
    /// Refuse the change of `token`: this shard had only `headroom` on its side.
    Refuse {
        /// The shell's handle.
        token: T,
        /// The share this shard held when it gave up.
        headroom: u64,
    },
    /// Make the ledger durable ([`Ledger::durable`]) before any message after this.
    Persist,
    /// Send `message` to shard `to`.
    Send {
        /// The recipient.
        to: u16,
        /// What to send.
        message: Message,
    },
}

/// The durable part of a shard's ledger: what [`Effect::Persist`] writes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Durable {
    /// This shard's share on each side (indexed by [`Side`]).
    pub shares: [u64; 2],
    /// The sequence of this shard's next transfer to each recipient.
    pub next_seq: BTreeMap<u16, u64>,
    /// Transfers sent and not acknowledged, by recipient and sequence.
    pub outgoing: BTreeMap<(u16, u64), Outgoing>,
    credits: BTreeMap<u16, Credits>,
}

impl Durable {
    /// A ledger holding `shares` and no transfer.
    pub fn with_shares(shares: [u64; 2]) -> Self {
        Durable { shares, ..Default::default() }
    }

    /// The ledger of shard `index` of `shards` that never wrote one: its part of the
    /// headroom around the counter's first value, 0.
    pub fn initial(bounds: Bounds, index: u16, shards: u16) -> Result<Self, BoundsError> {
        let shares = bounds.initial_shares(0, shards)?;
        let share = shares.get(usize::from(index)).copied().unwrap_or_default();
        Ok(Durable { shares: share, ..Default::default() })
    }

    /// The encoding kept in a shard image ([`crate::shard::ShardImage::escrow`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        crate::codec::encode(self)
    }

    /// Decodes what [`Durable::to_bytes`] wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, crate::codec::DecodeError> {
        crate::codec::decode("escrow ledger", bytes)
    }
}

/// One shard's escrow: its shares, its transfers, the changes waiting for headroom.
#[derive(Debug, Clone)]
pub struct Ledger<T> {
    index: u16,
    shards: u16,
    bounds: Bounds,
    tuning: Tuning,
    durable: Durable,
    waiting: VecDeque<(T, i64, u64)>,
    asked_at_ms: [Option<u64>; 2],
    /// When each unacknowledged transfer is sent again, and the pause after that
    /// (doubling up to [`RESEND_BACKOFF_MAX`] times [`Tuning::resend_ms`]). Not
    /// durable: after a restart every transfer is sent again at the first tick.
    resend: BTreeMap<(u16, u64), (u64, u64)>,
}

impl<T> Ledger<T> {
    /// The ledger of shard `index` of a counter with `shards` shards and `bounds`, as
    /// last persisted.
    pub fn new(index: u16, shards: u16, bounds: Bounds, tuning: Tuning, durable: Durable) -> Self {
        Ledger {
            index,
            shards,
            bounds,
            tuning,
            durable,
            waiting: VecDeque::new(),
            asked_at_ms: [None; 2],
            resend: BTreeMap::new(),
        }
    }

    /// What [`Effect::Persist`] must make durable.
    pub fn durable(&self) -> &Durable {
        &self.durable
    }

    /// This shard's share on `side`.
    pub fn share(&self, side: Side) -> u64 {
        self.durable.shares[side.slot()]
    }

    /// Headroom this shard sent that is not acknowledged yet, on `side`.
    pub fn in_flight(&self, side: Side) -> u64 {
        self.durable.outgoing.values().filter(|o| o.side == side).map(|o| o.amount).sum()
    }

    /// Changes waiting for headroom.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The changes waiting for headroom, in arrival order, leaving none.
    pub fn into_waiting(self) -> Vec<T> {
        self.waiting.into_iter().map(|(token, _, _)| token).collect()
    }

    /// Whether nothing waits and no transfer is unacknowledged: no tick is needed.
    pub fn settled(&self) -> bool {
        self.waiting.is_empty() && self.durable.outgoing.is_empty()
    }

    /// Spends a change of `delta` from its side's share (and adds it to the other
    /// side's), or refuses it with the share held. A change that spends no guarded
    /// side always passes. A small change may pass while a larger one waits: each is
    /// admitted whole or not at all, never in part.
    pub fn spend(&mut self, delta: i64) -> Result<(), u64> {
        if let Some(side) = Side::spent_by(delta).filter(|s| self.bounds.guards(*s)) {
            if self.share(side) < delta.unsigned_abs() {
                #[cfg(feature = "planted-bugs")]
                if crate::planted::active(crate::planted::Bug::EscrowOverspend) {
                    self.durable.shares[side.slot()] = delta.unsigned_abs();
                    self.apply(delta);
                    return Ok(());
                }
                return Err(self.share(side));
            }
        }
        self.apply(delta);
        Ok(())
    }

    /// Carries out `input` at `now_ms`.
    pub fn step(&mut self, now_ms: u64, input: Input<T>) -> Vec<Effect<T>> {
        let mut effects = Vec::new();
        match input {
            Input::Park { delta, token, since_ms } => self.park(now_ms, delta, token, since_ms, &mut effects),
            Input::Receive(message) => self.receive(now_ms, message, &mut effects),
            Input::Release { side, amount } => {
                if self.bounds.guards(side) && amount > 0 {
                    let share = &mut self.durable.shares[side.slot()];
                    *share = share.saturating_add(amount);
                    self.retry_covered(&mut effects);
                }
            }
            Input::Tick => self.tick(now_ms, &mut effects),
        }
        effects
    }

    fn park(&mut self, now_ms: u64, delta: i64, token: T, since_ms: u64, effects: &mut Vec<Effect<T>>) {
        let Some(side) = Side::spent_by(delta).filter(|s| self.bounds.guards(*s)) else {
            effects.push(Effect::Retry(token));
            return;
        };
        // A lone shard has no one to borrow from; a full queue takes no more; a change
        // that waited its time already is refused.
        let expired = now_ms >= since_ms.saturating_add(self.tuning.borrow_wait_ms);
        if self.shards <= 1 || self.waiting.len() >= WAITING_MAX || expired {
            effects.push(Effect::Refuse { token, headroom: self.share(side) });
            return;
        }
        self.waiting.push_back((token, delta, since_ms));
        self.retry_covered(effects);
        self.ask(now_ms, side, effects);
    }

    /// Spends `delta` from its side's share and adds it to the other side's.
    fn apply(&mut self, delta: i64) {
        let amount = delta.unsigned_abs();
        if let Some(side) = Side::spent_by(delta) {
            if self.bounds.guards(side) {
                let share = &mut self.durable.shares[side.slot()];
                assert!(
                    *share >= amount,
                    "escrow: shard {} spends {amount} of a share of {share}",
                    self.index
                );
                *share -= amount;
            }
            if self.bounds.guards(side.other()) {
                let other = &mut self.durable.shares[side.other().slot()];
                *other = other.saturating_add(amount);
            }
        }
    }

    /// What the changes waiting here would spend on `side`.
    fn waiting_on(&self, side: Side) -> u64 {
        let on_side = self.waiting.iter().filter(|(_, d, _)| Side::spent_by(*d) == Some(side));
        on_side.map(|(_, d, _)| d.unsigned_abs()).sum()
    }

    /// Asks the other shards for what the waiting changes on `side` lack, at most
    /// once per [`Tuning::ask_every_ms`].
    fn ask(&mut self, now_ms: u64, side: Side, effects: &mut Vec<Effect<T>>) {
        let due = self.asked_at_ms[side.slot()].is_none_or(|at| now_ms >= at + self.tuning.ask_every_ms);
        let lacking = self.waiting_on(side).saturating_sub(self.share(side));
        if due && lacking > 0 {
            self.asked_at_ms[side.slot()] = Some(now_ms);
            let message = Message::Borrow { from: self.index, side, amount: lacking };
            for to in (0..self.shards).filter(|to| *to != self.index) {
                effects.push(Effect::Send { to, message });
            }
        }
    }

    /// Hands back, in arrival order, the waiting changes the shares now cover (each
    /// side's queue stops at its first change not covered).
    fn retry_covered(&mut self, effects: &mut Vec<Effect<T>>) {
        let mut budget = self.durable.shares;
        let mut blocked = [false; 2];
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        for (token, delta, since) in std::mem::take(&mut self.waiting) {
            let side = Side::spent_by(delta).expect("only a spending change waits");
            let amount = delta.unsigned_abs();
            if !blocked[side.slot()] && budget[side.slot()] >= amount {
                budget[side.slot()] -= amount;
                effects.push(Effect::Retry(token));
            } else {
                blocked[side.slot()] = true;
                kept.push_back((token, delta, since));
            }
        }
        self.waiting = kept;
    }

    fn next_seq(&self, to: u16) -> u64 {
        self.durable.next_seq.get(&to).copied().unwrap_or(0)
    }

    /// The lowest transfer to `to` not acknowledged yet (its next one if none).
    fn lowest_unacked(&self, to: u16) -> u64 {
        let pending = self.durable.outgoing.range((to, 0)..=(to, u64::MAX)).next();
        pending.map_or_else(|| self.next_seq(to), |((_, seq), _)| *seq)
    }

    fn grant(&self, to: u16, seq: u64, o: &Outgoing) -> Message {
        Message::Grant {
            from: self.index,
            seq,
            side: o.side,
            amount: o.amount,
            acked_below: self.lowest_unacked(to),
        }
    }

    fn receive(&mut self, now_ms: u64, message: Message, effects: &mut Vec<Effect<T>>) {
        match message {
            Message::Borrow { from, side, amount } => {
                if from == self.index || from >= self.shards || !self.bounds.guards(side) {
                    return;
                }
                // A recipient remembers the transfers from the lowest one it has not
                // acknowledged on: at most TRANSFERS_IN_FLIGHT_MAX of them.
                let window = self.next_seq(from) - self.lowest_unacked(from);
                if self.durable.outgoing.len() >= TRANSFERS_IN_FLIGHT_MAX
                    || window >= TRANSFERS_IN_FLIGHT_MAX as u64
                {
                    return;
                }
                // What waits here first, then at most half of the rest: a donor keeps
                // headroom for its own writers, and two short shards cannot drain each
                // other back and forth. Within that, what was asked or a fair slice
                // (the rest over the shard count), whichever is more: a borrower that
                // got only what waited would ask again at once for what arrives next.
                let spare = self.share(side).saturating_sub(self.waiting_on(side));
                let slice = spare / u64::from(self.shards.max(1));
                let amount = amount.max(slice).min(spare.div_ceil(2));
                if amount == 0 {
                    return;
                }
                self.durable.shares[side.slot()] -= amount;
                let seq = self.next_seq(from);
                self.durable.next_seq.insert(from, seq + 1);
                let o = Outgoing { side, amount };
                self.durable.outgoing.insert((from, seq), o);
                let first = self.tuning.resend_ms;
                self.resend.insert((from, seq), (now_ms + first, first.saturating_mul(2)));
                effects.push(Effect::Persist);
                effects.push(Effect::Send { to: from, message: self.grant(from, seq, &o) });
            }
            Message::Grant { from, seq, side, amount, acked_below } => {
                if from == self.index || from >= self.shards {
                    return;
                }
                let credits = self.durable.credits.entry(from).or_default();
                if acked_below > credits.below {
                    credits.below = acked_below;
                    credits.seen = credits.seen.split_off(&acked_below);
                }
                let fresh = seq >= credits.below && !credits.seen.contains(&seq);
                if fresh {
                    assert!(
                        credits.seen.len() < TRANSFERS_IN_FLIGHT_MAX,
                        "escrow: donor {from} has more than {TRANSFERS_IN_FLIGHT_MAX} transfers in flight"
                    );
                    credits.seen.insert(seq);
                    let share = &mut self.durable.shares[side.slot()];
                    *share = share.saturating_add(amount);
                    self.retry_covered(effects);
                }
                // A repeated grant is acknowledged again: the first ack may be lost.
                effects.push(Effect::Persist);
                effects.push(Effect::Send { to: from, message: Message::Ack { from: self.index, seq } });
            }
            Message::Ack { from, seq } => {
                if self.durable.outgoing.remove(&(from, seq)).is_some() {
                    self.resend.remove(&(from, seq));
                    effects.push(Effect::Persist);
                }
            }
        }
    }

    fn tick(&mut self, now_ms: u64, effects: &mut Vec<Effect<T>>) {
        let wait = self.tuning.borrow_wait_ms;
        let (expired, kept): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.waiting).into_iter().partition(|(_, _, at)| now_ms >= at + wait);
        self.waiting = kept;
        for (token, delta, _) in expired {
            let side = Side::spent_by(delta).expect("only a spending change waits");
            effects.push(Effect::Refuse { token, headroom: self.share(side) });
        }
        // A change refused at the front may have held back smaller ones behind it.
        self.retry_covered(effects);
        for side in Side::ALL {
            if self.bounds.guards(side) {
                self.ask(now_ms, side, effects);
            }
        }
        let first = self.tuning.resend_ms.max(1);
        for (&(to, seq), o) in &self.durable.outgoing {
            let (at, pause) = *self.resend.entry((to, seq)).or_insert((now_ms, first));
            if now_ms >= at {
                let next = pause.saturating_mul(2).min(first.saturating_mul(RESEND_BACKOFF_MAX));
                self.resend.insert((to, seq), (now_ms + pause, next));
                effects.push(Effect::Send { to, message: self.grant(to, seq, o) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const T: Tuning = Tuning { borrow_wait_ms: 100, ask_every_ms: 10, resend_ms: 20 };

    #[test]
    fn the_wait_fits_inside_the_callers_timeout() {
        assert_eq!(Tuning::within_call(5_000), Tuning::default());
        let short = Tuning::within_call(150);
        assert_eq!((short.borrow_wait_ms, short.ask_every_ms), (75, 37));
        assert_eq!(Tuning::within_call(1).borrow_wait_ms, 1, "a wait is never zero");
    }
    const MIN0: Bounds = Bounds { min: Some(0), max: None };

    fn ledger(index: u16, bounds: Bounds, share: [u64; 2]) -> Ledger<u32> {
        Ledger::new(index, 3, bounds, T, Durable { shares: share, ..Default::default() })
    }

    fn borrow(from: u16, amount: u64) -> Message {
        Message::Borrow { from, side: Side::Down, amount }
    }

    #[test]
    fn initial_shares_split_the_headroom_and_refuse_a_value_outside() {
        let b = Bounds { min: Some(0), max: Some(10) };
        assert_eq!(b.initial_shares(3, 2).unwrap(), vec![[2, 4], [1, 3]]);
        assert_eq!(MIN0.initial_shares(1_000, 3).unwrap().iter().map(|s| s[0]).sum::<u64>(), 1_000);
        assert_eq!(
            MIN0.initial_shares(-1, 4),
            Err(BoundsError::Outside { value: -1, min: Some(0), max: None })
        );
        let inverted = Bounds { min: Some(5), max: Some(4) };
        assert_eq!(inverted.initial_shares(5, 1), Err(BoundsError::Inverted { min: 5, max: 4 }));
        let wide = Bounds { min: Some(i64::MIN), max: Some(i64::MAX) };
        assert_eq!(wide.initial_shares(0, 1).unwrap(), vec![[1 << 63, (1 << 63) - 1]]);
        let quota = Bounds { min: None, max: Some(10) };
        assert_eq!(Durable::initial(quota, 1, 4).unwrap().shares, [0, 3]);
        assert_eq!(Durable::initial(quota, 3, 4).unwrap().shares, [0, 2]);
        let d = Durable::initial(quota, 0, 4).unwrap();
        assert_eq!(Durable::from_bytes(&d.to_bytes()), Ok(d));
    }

    #[test]
    fn a_covered_change_is_spent_and_moves_headroom_to_the_other_side() {
        let mut l = ledger(0, Bounds { min: Some(0), max: Some(10) }, [5, 5]);
        assert_eq!(l.spend(-3), Ok(()));
        assert_eq!((l.share(Side::Down), l.share(Side::Up)), (2, 8));
        assert_eq!(l.spend(8), Ok(()));
        assert_eq!((l.share(Side::Down), l.share(Side::Up)), (10, 0));
        assert_eq!(l.spend(1), Err(0));
        // An unguarded side is never spent.
        let mut free = ledger(0, MIN0, [0, 0]);
        assert_eq!(free.spend(7), Ok(()));
        assert_eq!(free.share(Side::Down), 7);
    }

    #[test]
    fn a_short_change_waits_asks_and_is_refused_whole_after_the_wait() {
        let mut l = ledger(0, MIN0, [2, 0]);
        assert_eq!(l.spend(-5), Err(2));
        let e = l.step(0, Input::Park { delta: -5, token: 1, since_ms: 0 });
        let asks = [1, 2].map(|to| Effect::Send { to, message: borrow(0, 3) });
        assert_eq!(e, asks.to_vec());
        // A smaller change the share covers passes meanwhile; a second short one
        // waits behind the first, and is handed back once the first is refused and a
        // grant covers it.
        assert_eq!(l.spend(-1), Ok(()));
        assert_eq!(l.step(1, Input::Park { delta: -2, token: 2, since_ms: 1 }), vec![]);
        assert_eq!(l.waiting(), 2);
        let e = l.step(100, Input::Tick);
        assert_eq!(e[0], Effect::Refuse { token: 1, headroom: 1 });
        assert_eq!(l.waiting(), 1);
        let grant = Message::Grant { from: 2, seq: 0, side: Side::Down, amount: 1, acked_below: 0 };
        assert_eq!(l.step(101, Input::Receive(grant))[0], Effect::Retry(2));
        assert_eq!(l.spend(-2), Ok(()));
        assert_eq!(l.share(Side::Down), 0);
        // A change that already waited its time is refused at once when parked again.
        assert_eq!(
            l.step(300, Input::Park { delta: -4, token: 3, since_ms: 150 }),
            vec![Effect::Refuse { token: 3, headroom: 0 }]
        );
    }

    #[test]
    fn a_lone_shard_refuses_at_once() {
        let mut l: Ledger<u32> = Ledger::new(0, 1, MIN0, T, Durable { shares: [1, 0], ..Default::default() });
        assert_eq!(l.spend(-2), Err(1));
        assert_eq!(
            l.step(0, Input::Park { delta: -2, token: 9, since_ms: 0 }),
            vec![Effect::Refuse { token: 9, headroom: 1 }]
        );
        assert!(l.settled());
    }

    #[test]
    fn a_grant_is_persisted_before_it_is_sent_and_credited_once() {
        let mut donor = ledger(1, MIN0, [10, 0]);
        let mut short = ledger(0, MIN0, [0, 0]);
        assert_eq!(short.spend(-4), Err(0));
        let ask = short.step(0, Input::Park { delta: -4, token: 7, since_ms: 0 });
        let Effect::Send { to: 1, message: asked } = ask[0] else { panic!("{ask:?}") };
        let e = donor.step(1, Input::Receive(asked));
        assert_eq!(e[0], Effect::Persist);
        let Effect::Send { to: 0, message: grant } = e[1] else { panic!("{e:?}") };
        assert_eq!(grant, Message::Grant { from: 1, seq: 0, side: Side::Down, amount: 4, acked_below: 0 });
        assert_eq!((donor.share(Side::Down), donor.in_flight(Side::Down)), (6, 4));
        let e = short.step(2, Input::Receive(grant));
        assert_eq!(e[0], Effect::Retry(7));
        assert_eq!(e[1], Effect::Persist);
        assert_eq!(short.spend(-4), Ok(()));
        // The same grant again (a resend whose ack was lost): acknowledged, not credited.
        let again = short.step(3, Input::Receive(grant));
        assert_eq!(
            again,
            vec![Effect::Persist, Effect::Send { to: 1, message: Message::Ack { from: 0, seq: 0 } }]
        );
        assert_eq!(short.share(Side::Down), 0);
        donor.step(4, Input::Receive(Message::Ack { from: 0, seq: 0 }));
        assert_eq!(donor.in_flight(Side::Down), 0);
        // The donor's next grant says transfer 0 is settled: the recipient forgets it.
        // (Asked for 1, it grants a third of its 6: a fair slice.)
        let e = donor.step(5, Input::Receive(borrow(0, 1)));
        let Effect::Send { message: next, .. } = e[1] else { panic!("{e:?}") };
        assert_eq!(next, Message::Grant { from: 1, seq: 1, side: Side::Down, amount: 2, acked_below: 1 });
        short.step(6, Input::Receive(next));
        assert_eq!(short.durable().credits[&1], Credits { below: 1, seen: BTreeSet::from([1]) });
        // A stale resend of transfer 0 arriving late is not credited either.
        short.step(7, Input::Receive(grant));
        assert_eq!(short.share(Side::Down), 2);
    }

    #[test]
    fn a_donor_grants_a_fair_slice_when_less_is_asked() {
        // 3 shards: a third of the spare, so the borrower's next writers find it there.
        let mut donor = ledger(1, MIN0, [300, 0]);
        let e = donor.step(0, Input::Receive(borrow(0, 1)));
        assert!(matches!(e[1], Effect::Send { message: Message::Grant { amount: 100, .. }, .. }), "{e:?}");
        // What is asked, when more than a slice, up to half.
        let e = donor.step(1, Input::Receive(borrow(2, 150)));
        assert!(matches!(e[1], Effect::Send { message: Message::Grant { amount: 100, .. }, .. }), "{e:?}");
        assert_eq!(donor.share(Side::Down), 100);
    }

    #[test]
    fn a_donor_keeps_half_of_what_it_does_not_need_itself() {
        let mut donor = ledger(1, MIN0, [9, 0]);
        let e = donor.step(0, Input::Receive(borrow(0, 100)));
        assert!(matches!(e[1], Effect::Send { message: Message::Grant { amount: 5, .. }, .. }));
        assert_eq!(donor.share(Side::Down), 4);
        // A donor with changes of its own waiting grants nothing beyond them.
        let mut busy = ledger(2, MIN0, [3, 0]);
        busy.step(0, Input::Park { delta: -5, token: 1, since_ms: 0 });
        assert_eq!(busy.step(1, Input::Receive(borrow(0, 2))), vec![]);
        // Nor does anyone answer a shard that is not of this counter.
        assert_eq!(donor.step(2, Input::Receive(borrow(7, 1))), vec![]);
    }

    #[test]
    fn unacknowledged_grants_are_resent_until_acknowledged() {
        let mut donor = ledger(1, MIN0, [8, 0]);
        donor.step(0, Input::Receive(borrow(0, 2)));
        assert!(!donor.settled());
        let resent = donor.step(25, Input::Tick);
        assert_eq!(resent.len(), 1, "{resent:?}");
        assert_eq!(donor.step(30, Input::Tick), vec![], "resent again before resend_ms");
        donor.step(31, Input::Receive(Message::Ack { from: 0, seq: 0 }));
        assert_eq!(donor.step(60, Input::Tick), vec![]);
        assert!(donor.settled());
    }

    /// Messages a delivery step of the model run delivers, at most.
    const DELIVERIES_PER_STEP: usize = 4;

    /// A shard of the model run: its ledger, its value, and what it last persisted.
    struct ModelShard {
        ledger: Ledger<u64>,
        value: i64,
        persisted: (Durable, i64),
    }

    /// `shards` shards of a counter with `min = 0` and `max = cap`, random changes,
    /// a network that loses, duplicates and reorders, and crashes that lose what was
    /// not persisted. Checks the bound at every step and the escrow equation once the
    /// network is drained.
    fn model_run(seed: u64, shards: u16, cap: i64, steps: usize) -> (u64, u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let bounds = Bounds { min: Some(0), max: Some(cap) };
        let start = cap / 2;
        let shares = bounds.initial_shares(start, shards).unwrap();
        let mut s: Vec<ModelShard> = shares
            .iter()
            .enumerate()
            .map(|(i, sh)| {
                let value = if i == 0 { start } else { 0 };
                let durable = Durable { shares: *sh, ..Default::default() };
                ModelShard {
                    ledger: Ledger::new(i as u16, shards, bounds, T, durable.clone()),
                    value,
                    persisted: (durable, value),
                }
            })
            .collect();
        let mut net: Vec<(u16, Message)> = Vec::new();
        let mut now = 0;
        let mut token = 0;
        let (mut admitted, mut refused) = (0u64, 0u64);
        let mut pending: BTreeMap<u64, (usize, i64, u64)> = BTreeMap::new();
        let total = |s: &[ModelShard]| s.iter().map(|m| m.value).sum::<i64>();
        for step in 0..steps + 2_000 {
            let draining = step >= steps;
            now += rng.random_range(0..4);
            let at = rng.random_range(0..shards) as usize;
            let input = match rng.random_range(0..10) {
                0..=2 if !draining => {
                    token += 1;
                    let delta = rng.random_range(-6..=6);
                    pending.insert(token, (at, delta, now));
                    let effects = vec![Effect::Retry(token)];
                    carry_out(&mut s, at, now, effects, &mut net, &mut pending, &mut admitted, &mut refused);
                    let v = total(&s);
                    assert!(v >= 0 && v <= cap, "seed {seed}: total {v} outside 0..={cap}");
                    continue;
                }
                3..=8 if !net.is_empty() => {
                    // The network is as fast as the shards: a step of 0–3 ms delivers
                    // several messages, in any order.
                    for _ in 0..DELIVERIES_PER_STEP {
                        if net.is_empty() {
                            break;
                        }
                        let i = rng.random_range(0..net.len());
                        let (to, m) = net.swap_remove(i);
                        if rng.random_bool(0.1) && !draining {
                            net.push((to, m)); // duplicated
                        }
                        if rng.random_bool(0.1) && !draining {
                            continue; // lost
                        }
                        let to = usize::from(to);
                        let effects = s[to].ledger.step(now, Input::Receive(m));
                        carry_out(
                            &mut s,
                            to,
                            now,
                            effects,
                            &mut net,
                            &mut pending,
                            &mut admitted,
                            &mut refused,
                        );
                        let v = total(&s);
                        assert!(v >= 0 && v <= cap, "seed {seed}: total {v} outside 0..={cap}");
                    }
                    continue;
                }
                9 if !draining && rng.random_bool(0.05) => {
                    // A crash: back to what was persisted; waiting changes are lost
                    // unanswered (their callers retry).
                    let (durable, value) = s[at].persisted.clone();
                    s[at].ledger = Ledger::new(at as u16, shards, bounds, T, durable);
                    s[at].value = value;
                    pending.retain(|_, (shard, _, _)| *shard != at);
                    continue;
                }
                _ => Input::Tick,
            };
            let effects = s[at].ledger.step(now, input);
            carry_out(&mut s, at, now, effects, &mut net, &mut pending, &mut admitted, &mut refused);
            assert!(total(&s) >= 0 && total(&s) <= cap, "seed {seed}: total {} outside 0..={cap}", total(&s));
        }
        // Drained: no transfer left in flight and no message on the wire, so the
        // shares add up to the headroom on each side exactly.
        for _ in 0..200 {
            let settled = net.is_empty()
                && s.iter().all(|m| m.ledger.durable().outgoing.is_empty() && m.ledger.waiting() == 0);
            if settled {
                break;
            }
            now += T.resend_ms;
            for at in 0..s.len() {
                let effects = s[at].ledger.step(now, Input::Tick);
                carry_out(&mut s, at, now, effects, &mut net, &mut pending, &mut admitted, &mut refused);
            }
            while let Some((to, m)) = net.pop() {
                let to = usize::from(to);
                let effects = s[to].ledger.step(now, Input::Receive(m));
                carry_out(&mut s, to, now, effects, &mut net, &mut pending, &mut admitted, &mut refused);
            }
        }
        let v = total(&s);
        let in_flight: u64 = s.iter().map(|m| m.ledger.in_flight(Side::Down)).sum();
        assert_eq!(in_flight, 0, "seed {seed}");
        let down: u64 = s.iter().map(|m| m.ledger.share(Side::Down)).sum();
        let up: u64 = s.iter().map(|m| m.ledger.share(Side::Up)).sum();
        assert_eq!((down as i64, up as i64), (v, cap - v), "seed {seed}: the escrow equation");
        (admitted, refused)
    }

    /// The shell of the model run: what a shard machine does with the ledger's
    /// effects. A change handed back is spent if its share covers it, else parked
    /// again with its first `since_ms`.
    #[allow(clippy::too_many_arguments)]
    fn carry_out(
        s: &mut [ModelShard],
        at: usize,
        now: u64,
        effects: Vec<Effect<u64>>,
        net: &mut Vec<(u16, Message)>,
        pending: &mut BTreeMap<u64, (usize, i64, u64)>,
        admitted: &mut u64,
        refused: &mut u64,
    ) {
        let mut queue: VecDeque<Effect<u64>> = effects.into();
        while let Some(e) = queue.pop_front() {
            match e {
                Effect::Retry(token) => {
                    let (_, delta, since_ms) = pending[&token];
                    if s[at].ledger.spend(delta).is_ok() {
                        pending.remove(&token);
                        s[at].value += delta;
                        *admitted += 1;
                    } else {
                        queue.extend(s[at].ledger.step(now, Input::Park { delta, token, since_ms }));
                    }
                }
                Effect::Refuse { token, .. } => {
                    pending.remove(&token);
                    *refused += 1;
                }
                // The value is written with the ledger, as a shard writes both in one
                // batch.
                Effect::Persist => s[at].persisted = (s[at].ledger.durable().clone(), s[at].value),
                Effect::Send { to, message } => net.push((to, message)),
            }
        }
    }

    #[test]
    fn the_bound_holds_through_loss_duplication_reordering_and_crashes() {
        let (mut admitted, mut refused) = (0, 0);
        for seed in 0..200 {
            let (a, r) = model_run(seed, 1 + (seed % 8) as u16, 40 + seed as i64 % 60, 3_000);
            admitted += a;
            refused += r;
        }
        // Runs that never came near a bound would prove nothing.
        assert!(admitted > 10_000 && refused > 10_000, "admitted {admitted}, refused {refused}");
    }
}
