//! A counter's in-memory presence on a node: its metadata snapshot and one
//! accumulator slot per shard.
//!
//! This is the one place where writers share memory instead of sending messages:
//! a `batched` increment without an event id is added to its shard's slot with a
//! few atomic instructions and acknowledged at once; the aggregator drains the slots
//! into shard messages on its timer. [`tally_core::limits`] explains why an
//! acknowledged buffered increment can never be refused later.
//!
//! # The drain protocol
//!
//! A writer adds to `sum`, *then* reads `dirty`; if it is clear, it sets it and queues
//! the counter for draining. A drain clears `dirty`, *then* swaps `sum` to zero. Every
//! add either lands before the swap (this drain carries it) or after it, in which case
//! its writer sees `dirty` clear (or someone else re-set it after the drain) and the
//! counter is queued again. So no add is ever stranded, even in a runtime that was
//! replaced or evicted: the queue holds the runtime itself.

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering::*};
use std::sync::Arc;
use tally_core::meta::CounterMeta;
use tally_core::CounterName;

/// One shard's accumulator on this node.
#[derive(Default)]
pub(crate) struct Slot {
    /// Sum of buffered deltas since the last drain.
    pub(crate) sum: AtomicI64,
    /// Every delta this runtime acknowledged through this slot, buffered or written
    /// to the shard directly (wrapping): this node's part of the answers to `INCR`
    /// (`ledger.rs`). On the same cache line as `sum`, so the fast path touches no
    /// other line for it.
    pub(crate) acked: AtomicI64,
    /// Increments buffered since the last drain (for the size threshold and the
    /// bound of [`tally_core::limits::SLOT_INCREMENTS_MAX`]).
    pub(crate) count: AtomicU64,
    /// Whether the shard's last known value lets the slot take increments.
    pub(crate) open: AtomicBool,
    /// Increments routed to this shard while the counter has been active here (skew).
    pub(crate) writes: AtomicU64,
    /// Member hashes of buffered increments, for counters with `distinct`.
    pub(crate) members: Mutex<Vec<u64>>,
    /// Increments sent to this shard directly and not yet answered: its queue.
    pub(crate) in_flight: AtomicU32,
    /// The deepest `in_flight` since the auto-shard sampler last took it.
    pub(crate) in_flight_peak: AtomicU32,
    /// The shard holds nothing and no actor has started for it since the counter
    /// was created here: its first drained sum may be written without one
    /// (`cold.rs`). Cleared by that write and by every actor start.
    pub(crate) cold: AtomicBool,
}

/// One increment waiting at a shard: counted into the slot's queue while it lives.
pub(crate) struct InFlight<'a>(&'a Slot);

impl<'a> InFlight<'a> {
    pub(crate) fn enter(slot: &'a Slot) -> Self {
        let depth = slot.in_flight.fetch_add(1, Relaxed).saturating_add(1);
        slot.in_flight_peak.fetch_max(depth, Relaxed);
        Self(slot)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

/// What a drain took out of one slot.
pub(crate) struct Drained {
    pub(crate) index: u16,
    pub(crate) sum: i64,
    pub(crate) increments: u64,
    pub(crate) members: Vec<u64>,
}

/// A counter active on this node.
pub(crate) struct CounterRuntime {
    pub(crate) name: CounterName,
    /// The metadata this runtime was built from. A change builds a new runtime.
    pub(crate) meta: Arc<CounterMeta>,
    /// One slot per shard of `meta.layout`.
    pub(crate) slots: Box<[CachePadded<Slot>]>,
    /// Set while the counter is queued for draining (see the module docs).
    pub(crate) dirty: CachePadded<AtomicBool>,
    /// A writer hit the size threshold: drain before the window ends.
    pub(crate) flush_requested: AtomicBool,
    /// Round-robin position.
    pub(crate) sequence: CachePadded<AtomicU64>,
    /// When the counter was last drained or written directly (for eviction).
    pub(crate) last_used_ms: AtomicU64,
    /// Absolute change applied since the rollup last refreshed this counter.
    pub(crate) changed: AtomicU64,
    /// Replaced by a newer runtime or evicted; it still drains what it holds.
    pub(crate) retired: AtomicBool,
    /// The counter was deleted while this runtime was current (or replaced): what it
    /// still buffers belongs to no counter, not to one created anew under the name.
    pub(crate) deleted: AtomicBool,
    /// Held from the counter's creation here until its first drain has run: a place
    /// among [`crate::ctx::CREATED_UNDRAINED_MAX`].
    pub(crate) undrained: Mutex<Option<tokio::sync::OwnedSemaphorePermit>>,
    /// Drains of this runtime whose sums have left the slots but not yet been
    /// answered by their shards; a fresh read waits for them.
    pub(crate) drains_in_flight: AtomicU64,
    /// Woken when `drains_in_flight` falls to zero.
    pub(crate) drains_settled: tokio::sync::Notify,
    /// The runtime this one replaced, while it may still hold buffered increments: a
    /// fresh read delivers them too. Dropped once it (and its own predecessors) are
    /// quiet.
    pub(crate) predecessor: Mutex<Option<Arc<CounterRuntime>>>,
    /// Every increment the counter has taken since this node created it is still in
    /// these slots: nothing was in any shard at creation, no other node takes its
    /// increments (no placement), and since then no sum has left a slot and no write
    /// has reached one of its shards. While set, the slots' sum is the counter's
    /// exact total ([`CounterRuntime::pristine_total`]). Cleared before anything
    /// leaves a slot (`Ctx::drain`) and before any shard write of the counter is
    /// applied (`shard::write_through`), so before either is acknowledged.
    pub(crate) pristine: AtomicBool,
    /// Fresh reads of the counter waiting for the next shared round
    /// ([`crate::read::fresh_shared`]).
    pub(crate) fresh_rounds: Mutex<crate::read::FreshRounds>,
    /// The counter's answer book on this node, shared with the runtimes it replaced
    /// and the one that replaces it (`ledger.rs`).
    pub(crate) ledger: Arc<crate::ledger::Ledger>,
    /// Set once a newer runtime took over the ledger: what the slots acknowledged is
    /// carried into it, and a late writer carries its own delta.
    pub(crate) carried: AtomicBool,
}

impl CounterRuntime {
    pub(crate) fn new(
        name: CounterName,
        meta: Arc<CounterMeta>,
        now_ms: u64,
        ledger: Arc<crate::ledger::Ledger>,
    ) -> Self {
        let slots = (0..meta.layout.shards).map(|_| CachePadded::new(Slot::default())).collect();
        Self {
            name,
            meta,
            slots,
            dirty: CachePadded::new(AtomicBool::new(false)),
            flush_requested: AtomicBool::new(false),
            sequence: CachePadded::new(AtomicU64::new(0)),
            last_used_ms: AtomicU64::new(now_ms),
            changed: AtomicU64::new(0),
            retired: AtomicBool::new(false),
            deleted: AtomicBool::new(false),
            undrained: Mutex::new(None),
            drains_in_flight: AtomicU64::new(0),
            drains_settled: tokio::sync::Notify::new(),
            predecessor: Mutex::new(None),
            pristine: AtomicBool::new(false),
            fresh_rounds: Mutex::new(crate::read::FreshRounds::default()),
            ledger,
            carried: AtomicBool::new(false),
        }
    }

    /// Counts `delta` as acknowledged through slot `index`. A writer that acknowledged
    /// on this runtime after a newer one took its ledger over carries its own delta
    /// (the slot's `acked` is swapped out, so each delta is carried exactly once:
    /// by [`CounterRuntime::hand_over_ledger`] or here).
    pub(crate) fn ack(&self, index: u16, delta: i64) {
        let slot = &self.slots[usize::from(index) % self.slots.len()];
        slot.acked.fetch_add(delta, SeqCst);
        if self.carried.load(SeqCst) {
            self.ledger.carry(slot.acked.swap(0, SeqCst));
        }
    }

    /// Hands the ledger over to the runtime replacing this one: what the slots
    /// acknowledged moves into the ledger's carried sum.
    pub(crate) fn hand_over_ledger(&self) {
        self.carried.store(true, SeqCst);
        for slot in self.slots.iter() {
            self.ledger.carry(slot.acked.swap(0, SeqCst));
        }
    }

    /// The counter's exact total while the runtime is [`pristine`](Self::pristine),
    /// read from its slots without a message or a store read; `None` once it is not.
    ///
    /// A drain clears the flag before it takes a sum and a shard write before it is
    /// applied, all `SeqCst`: if the flag still reads set after the slots were
    /// summed, no sum had left them while they were read, and every increment
    /// acknowledged before the read began was in them. Increments added while they
    /// were read may or may not be counted, as in any read they are concurrent with.
    pub(crate) fn pristine_total(&self, as_of_ms: u64) -> Option<crate::api::ValueRead> {
        if !self.pristine.load(SeqCst) {
            return None;
        }
        let buffered: i128 = self.slots.iter().map(|s| i128::from(s.sum.load(SeqCst))).sum();
        if !self.pristine.load(SeqCst) {
            return None;
        }
        Some(crate::api::ValueRead {
            value: self.meta.spec.clamp(self.meta.layout.base + buffered),
            consistency: crate::api::Consistency::Fresh,
            as_of_ms,
            staleness_ms: 0,
            complete: true,
            missing_shards: Vec::new(),
        })
    }

    /// Opens every slot of a counter known to hold nothing (just created): a value
    /// of 0 leaves every slot its full room ([`tally_core::limits::slot_open`]).
    pub(crate) fn open_empty_slots(&self) {
        let open = tally_core::limits::slot_open(0);
        for slot in self.slots.iter() {
            slot.open.store(open, SeqCst);
            slot.cold.store(true, SeqCst);
        }
    }

    /// Stops answering totals from the slots: a sum is about to leave one, or a
    /// write to reach a shard ([`CounterRuntime::pristine`]).
    pub(crate) fn touch(&self) {
        // A `SeqCst` load: one that finds the flag already clear is ordered after
        // the store that cleared it, and so before what this caller does next.
        if self.pristine.load(SeqCst) {
            self.pristine.store(false, SeqCst);
        }
    }

    /// This runtime and the ones it replaced, newest first (at most `max`).
    pub(crate) fn lineage(self: &Arc<Self>, max: usize) -> Vec<Arc<CounterRuntime>> {
        let mut out = vec![self.clone()];
        while out.len() < max {
            let Some(older) = out.last().and_then(|r| r.predecessor.lock().clone()) else { break };
            out.push(older);
        }
        out
    }

    /// Forgets the replaced runtimes once none of them holds or delivers anything.
    pub(crate) fn forget_quiet_predecessors(&self) {
        let mut next = self.predecessor.lock().clone();
        while let Some(r) = next {
            if r.holds_buffered() || r.drains_in_flight.load(SeqCst) > 0 {
                return;
            }
            next = r.predecessor.lock().clone();
        }
        *self.predecessor.lock() = None;
    }

    /// Adds to slot `index` unconditionally (used to give back a drained sum that could
    /// not be delivered). Returns whether the caller must queue the counter.
    pub(crate) fn give_back(&self, index: u16, sum: i64, increments: u64, members: Vec<u64>) -> bool {
        let slot = &self.slots[usize::from(index) % self.slots.len()];
        if !members.is_empty() {
            slot.members.lock().extend(members);
        }
        slot.count.fetch_add(increments, SeqCst);
        slot.sum.fetch_add(sum, SeqCst);
        self.claim_dirty()
    }

    /// Sets `dirty`; true if it was clear, meaning the caller must queue the counter.
    pub(crate) fn claim_dirty(&self) -> bool {
        !self.dirty.load(SeqCst) && !self.dirty.swap(true, SeqCst)
    }

    /// Takes everything buffered (see the module docs for the ordering).
    pub(crate) fn drain(&self) -> Vec<Drained> {
        self.dirty.store(false, SeqCst);
        self.flush_requested.store(false, SeqCst);
        let mut out = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let increments = slot.count.swap(0, SeqCst);
            let sum = slot.sum.swap(0, SeqCst);
            let members = if increments > 0 { std::mem::take(&mut *slot.members.lock()) } else { Vec::new() };
            if sum != 0 || !members.is_empty() || increments > 0 {
                out.push(Drained { index: i as u16, sum, increments, members });
            }
        }
        out
    }

    /// Whether anything is buffered.
    pub(crate) fn holds_buffered(&self) -> bool {
        self.slots.iter().any(|s| s.sum.load(SeqCst) != 0 || s.count.load(SeqCst) != 0)
    }
}
