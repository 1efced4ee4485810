//! The engine's shared internals: what every actor and the public handle reach.
//!
//! Actors hold an `Arc<Ctx>`; it owns no task of its own. The write path's
//! shared-memory fast path lives here ([`Ctx::incr`]), and so do the two helpers every
//! actor needs: reaching a shard ([`Ctx::submit`]) and draining accumulators
//! ([`Ctx::drain`]).

use crate::api::{IncrOutcome, Increment};
use crate::catalog::Catalog;
use crate::clock::Clock;
use crate::config::TallyConfig;
use crate::error::{unavailable, TallyError};
use crate::flusher::Flusher;
use crate::messages::{AggregatorMsg, ShardMsg, SupervisorMsg};
use crate::placement::{unexpected, Placement, ShardRequest, ShardResponse};
use crate::runtime::{CounterRuntime, Drained};
use crate::stats::Stats;
use dashmap::DashMap;
use futures::StreamExt;
use ractor::{ActorRef, MessagingErr, RpcReplyPort};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tally_core::dedup::SEQ_MAX;
use tally_core::drain_book::DrainBook;
use tally_core::limits::{bufferable, slot_open, SLOT_INCREMENTS_MAX};
use tally_core::meta::{CounterMeta, MetaCommand, MetaEffect};
use tally_core::name::{check_len, check_token, EVENT_ID_LEN_MAX, MEMBER_LEN_MAX, WRITER_LEN_MAX};
use tally_core::router::{route_with_member, RouteKey};
use tally_core::shard::ShardReply;
use tally_core::shard::{Outcome, Submission};
use tally_core::shard_machine::EscrowSend;
use tally_core::sketch::member_hash;
use tally_core::spec::{Durability, RouterPolicy};
use tally_core::{CounterName, ShardId};
use tally_store::Store;

/// How many times a call re-resolves a shard that stopped or was sealed under it.
const SHARD_CALL_ATTEMPTS_MAX: u32 = 64;
/// How often a node re-reads its catalog while waiting for newer metadata.
const META_CATCH_UP_POLL_MS: u64 = 5;
/// Pause between attempts while a resharding seals a generation.
const RESHARD_RETRY_MS: u64 = 2;
pub use tally_core::drain_book::IN_DOUBT_RETRY_MS_MAX;
/// Most in-doubt sums resent at once.
pub const IN_DOUBT_RESENDS_CONCURRENT_MAX: usize = 64;
/// Most predecessors a fresh read follows from a counter's current runtime.
pub const PREDECESSORS_MAX: usize = 64;
/// Most counters created on this node whose first drain has not run yet. A
/// first increment is acknowledged before its counter's creation is written, so
/// without a bound writers of new counters could outrun the drains that write them,
/// and what a crash loses would grow without limit. A creation beyond the bound
/// waits for a place (at most `call_timeout_ms`, then it is refused as unavailable);
/// while fewer than half are free, created counters drain at the next aggregator tick
/// instead of at the end of their window. A place is freed by the counter's first
/// drain, delivered or not.
pub const CREATED_UNDRAINED_MAX: usize = 16_384;

/// Hands out per-thread routing tokens.
static NEXT_THREAD_TOKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// The runtime this thread used last, with the engine it belongs to. Hot counters
    /// are written by the same threads over and over; this spares each increment a
    /// shared-map lookup and a reference-count bump, both contended cache lines.
    static LAST_RUNTIME: std::cell::RefCell<Option<(u64, Arc<CounterRuntime>)>> = const { std::cell::RefCell::new(None) };
    /// Per-thread routing token for the `writer` policy without a writer id, and the
    /// state of the per-thread generator for the `random` policy.
    static THREAD_ROUTE: Cell<(u64, u64)> = Cell::new({
        // Threads take affinity tokens in turn, spread by the golden ratio, so the
        // first few threads land on different shards instead of colliding by hash.
        let k = NEXT_THREAD_TOKEN.fetch_add(1, Relaxed);
        let token = k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (token, tally_core::hash::hash64(0x5eed, &k.to_le_bytes()) | 1)
    });
}

/// Restarts this thread's routing token and `random`-policy generator from `seed`,
/// and forgets its cached runtime. A deterministic simulation runs every engine of
/// a run on one thread and calls this at the start of each run, so the routing
/// draws of a run depend on its seed alone, not on the runs the thread made before.
pub fn seed_thread_routing(seed: u64) {
    let token = seed.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    THREAD_ROUTE.with(|c| c.set((token, tally_core::hash::hash64(0x5eed, &seed.to_le_bytes()) | 1)));
    LAST_RUNTIME.with(|c| *c.borrow_mut() = None);
}

fn next_random() -> u64 {
    THREAD_ROUTE.with(|c| {
        let (aff, mut x) = c.get();
        // xorshift64*: quick and good enough to spread shards.
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        c.set((aff, x));
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

/// An increment the write path counted.
pub(crate) struct Written {
    /// Applied or duplicate.
    pub(crate) outcome: IncrOutcome,
    /// The runtime it went through, when asked for.
    pub(crate) rt: Option<Arc<CounterRuntime>>,
    /// The value its shard was left at right after it, when it was written to its
    /// shard directly ([`ShardReply::Done`]'s `after`).
    pub(crate) after: Option<i64>,
}

/// What the per-thread fast path did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fast {
    /// Buffered and acknowledged.
    Applied,
    /// Routed to `index` of the runtime at `engine_rt`, whose slot refused it: the
    /// general path must use the same shard (a second routing decision would skew
    /// round-robin and random placement).
    Refused { engine_rt: usize, index: u16 },
    /// Not eligible, or no cached runtime.
    Miss,
}

/// Whether an increment may be acknowledged from an accumulator slot.
/// An increment whose item a frequency counter counts takes the direct path: an
/// accumulator slot sums deltas and would lose which item each belonged to.
fn fast_eligible(rt: &CounterRuntime, inc: &Increment) -> bool {
    rt.meta.spec.durability == Durability::Batched
        && inc.event_id.is_none()
        && inc.seq.is_none()
        && bufferable(inc.delta)
        && frequency_item(rt, inc).is_none()
}

/// The item a frequency counter counts for `inc`: its item, or its member.
fn frequency_item<'a>(rt: &CounterRuntime, inc: &'a Increment) -> Option<&'a str> {
    rt.meta.spec.frequency.and(inc.frequency_key())
}

/// The routing inputs of an increment whose dedup record (if any) is kept under
/// `record_id` ([`Increment::record_id`]): an event id, or a sequenced writer's mark
/// id, so all of a writer's sequenced increments reach the shard holding its mark, in
/// every layout. Shared counters are touched only by the policy that needs them, so
/// other policies add no contended write to the hot path.
fn route_key<'a>(rt: &CounterRuntime, inc: &'a Increment, record_id: Option<&'a str>) -> RouteKey<'a> {
    let policy = rt.meta.spec.router;
    RouteKey {
        event_id: record_id,
        writer: inc.writer.as_deref(),
        affinity: affinity(),
        sequence: if policy == RouterPolicy::RoundRobin { rt.sequence.fetch_add(1, Relaxed) } else { 0 },
        random: if policy == RouterPolicy::Random { next_random() } else { 0 },
    }
}

fn affinity() -> u64 {
    THREAD_ROUTE.with(|c| c.get().0)
}

/// Everything shared by the engine's actors and handles.
/// Source of engine identities; never reused within a process.
static NEXT_ENGINE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh engine identity.
/// Rounds a fresh read delivers buffered sums in, learning newer metadata between
/// rounds when a sealed shard sent a sum back; after that the read says incomplete.
pub const READ_DELIVERY_ROUNDS_MAX: usize = 3;

pub(crate) fn next_engine_id() -> u64 {
    NEXT_ENGINE_ID.fetch_add(1, Relaxed)
}

pub(crate) struct Ctx {
    /// Unique per engine in this process (keys the per-thread runtime cache).
    pub(crate) engine_id: u64,
    pub(crate) config: TallyConfig,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) flusher: Flusher,
    pub(crate) stats: Arc<Stats>,
    pub(crate) catalog: Arc<dyn Catalog>,
    /// Active counters by name.
    pub(crate) registry: DashMap<CounterName, Arc<CounterRuntime>>,
    /// Running shard actors. Only the supervisor inserts and removes.
    pub(crate) directory: DashMap<ShardId, ActorRef<ShardMsg>>,
    /// Shards written without an actor right now, or being started (`cold.rs`).
    pub(crate) cold: DashMap<ShardId, crate::cold::ColdMark>,
    /// Counters with buffered increments, waiting for the aggregator.
    pub(crate) dirty: parking_lot::Mutex<Vec<Arc<CounterRuntime>>>,
    /// Counters whose resharding task is running or about to start.
    pub(crate) resharding: DashMap<CounterName, ()>,
    /// Counters whose resharding task must start; `reshard.rs` starts them.
    pub(crate) reshard_queue: parking_lot::Mutex<Vec<CounterName>>,
    /// Wakes `reshard.rs` when `reshard_queue` has names.
    pub(crate) reshard_wake: Arc<tokio::sync::Notify>,
    /// Counters whose expired sealed generations are being pruned.
    pub(crate) pruning: DashMap<CounterName, ()>,
    /// Where shards live; `None` for an embedded engine that owns every shard.
    pub(crate) placement: Option<Arc<dyn Placement>>,
    pub(crate) supervisor: OnceLock<ActorRef<SupervisorMsg>>,
    /// Drained sums sent and not answered yet (`tally_core::drain_book`): in flight,
    /// or in doubt and resent until answered.
    pub(crate) drains: parking_lot::Mutex<DrainBook>,
    /// Whether a resend of in-doubt sums is running (one at a time).
    pub(crate) resending: AtomicBool,
    pub(crate) aggregator: OnceLock<ActorRef<AggregatorMsg>>,
    /// The rollup actor, told when a counter is deleted.
    pub(crate) rollup: OnceLock<ActorRef<crate::rollup::RollupMsg>>,
    pub(crate) closing: AtomicBool,
    /// Shards adopted after a membership change, by placement epoch.
    pub(crate) adopted: dashmap::DashSet<(u64, ShardId)>,
    /// One adoption at a time per shard.
    pub(crate) adopting: DashMap<ShardId, Arc<tokio::sync::Mutex<()>>>,
    /// Set while this node's shards may lack values it lost (`lost.rs`).
    pub(crate) lost: crate::lost::LostData,
    /// Creations of counters by their first increment, batched into shared commits.
    pub(crate) creator: Arc<crate::create::Creator>,
    /// The node's quotas and their counts (`crate::quota`).
    pub(crate) quotas: Arc<crate::quota::Quotas>,
    /// Places for created counters not drained yet ([`CREATED_UNDRAINED_MAX`]).
    pub(crate) created_undrained: Arc<tokio::sync::Semaphore>,
    /// The auto counters this engine follows (`autoshard.rs`).
    pub(crate) auto: crate::auto_book::AutoBook,
    /// The rollup's cached totals, read without a message to it (`rollup.rs`).
    pub(crate) rollup_view: crate::rollup::RollupView,
    /// Turns taken by this node's bounded increments decided from the total
    /// (`within.rs`).
    pub(crate) within_turns: crate::within::Turns,
}

/// A shard's committed state as a read sees it.
#[derive(Debug, Clone)]
pub(crate) struct ShardRead {
    /// Its committed image.
    pub(crate) image: tally_store::ShardImage,
    /// Whether it is sealed: its generation is being (or has been) resharded away,
    /// so a reader whose metadata still names it may be behind (see `read.rs`).
    pub(crate) sealed: bool,
}

/// The store key of shard `id`'s seal marker.
pub(crate) fn seal_key(id: &ShardId) -> Vec<u8> {
    tally_core::handoff_machine::seal_marker(id)
}

/// Who sent a submission to [`Ctx::send`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sender {
    /// A caller on this node: the submission goes to the shard's owner, wherever it is.
    Here,
    /// Another node, which found this node the shard's owner: it is served here or
    /// refused.
    Peer,
}

impl Ctx {
    pub(crate) fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.config.call_timeout_ms)
    }

    /// Queues a runtime for the aggregator.
    pub(crate) fn queue_dirty(&self, rt: &Arc<CounterRuntime>) {
        self.dirty.lock().push(rt.clone());
    }

    /// The counter's runtime, activating it (and creating the counter with the
    /// defaults when `create`) if needed.
    pub(crate) async fn runtime(
        self: &Arc<Self>,
        name: &str,
        create: bool,
    ) -> Result<Arc<CounterRuntime>, TallyError> {
        if let Some(rt) = self.registry.get(name) {
            if !self.expired(&rt.meta) {
                return Ok(rt.clone());
            }
        }
        let name = CounterName::new(name)?;
        let mut found = self.catalog.get(name.as_str())?;
        if found.as_ref().is_some_and(|m| self.expired(m)) {
            // Gone for reads from its deadline on; a write deletes it first and
            // creates it anew, as Redis's `INCR` does with a key that expired.
            if !create {
                return Err(TallyError::NotFound(name.to_string()));
            }
            crate::expire::reap(self, &name).await?;
            found = self.catalog.get(name.as_str())?;
        }
        // This node's metadata may not have applied a creation made elsewhere
        // (whose increments were acknowledged): a counter is missing only if the
        // metadata group's latest says so (a read index on the leader).
        if found.is_none() && !create {
            found = self.catalog.current(name.as_str()).await?.filter(|m| !self.expired(m));
        }
        let meta = match found {
            Some(m) => m,
            None if !create => return Err(TallyError::NotFound(name.to_string())),
            None => {
                self.finish_delete(&name).await?;
                let wait = self.created_undrained.clone().acquire_owned();
                let place = match tokio::time::timeout(self.timeout(), wait).await {
                    Ok(Ok(place)) => place,
                    Ok(Err(_)) => return Err(TallyError::ShuttingDown),
                    Err(_) => {
                        return Err(TallyError::Unavailable {
                            shard: tally_core::name::quoted(name.as_str()),
                            reason: format!(
                            "{CREATED_UNDRAINED_MAX} counters created here wait for their first drain; retry"
                        ),
                        })
                    }
                };
                // Shares one metadata commit with the creations queued meanwhile
                // (or, with a local catalog, is answered before it is written). A
                // counter that expired meanwhile is reclaimed, then created.
                self.quotas.admit_counter(&name).inspect_err(|_| self.stats.quota_counters_refused.inc())?;
                let (meta, effect, _) = match self.creator.ensure(name.clone()).await {
                    Err(TallyError::Meta(tally_core::meta::MetaError::Expired { .. })) => {
                        crate::expire::reap(self, &name).await?;
                        self.creator.ensure(name.clone()).await?
                    }
                    other => other?,
                };
                if effect == MetaEffect::Created {
                    self.quotas.created(&name);
                }
                // A counter this call created holds nothing anywhere (a deleted one's
                // data is gone: `finish_delete`), so its slots may take increments at
                // once instead of waiting for a first direct write to learn the value.
                // Its first cached read reads it fresh, buffers delivered first
                // (`rollup::load`), so an `INCR` that created it counts itself.
                let created = effect == MetaEffect::Created;
                let rt = self.install_with(name, meta, created);
                if created {
                    let mut held = rt.undrained.lock();
                    if held.is_none() {
                        *held = Some(place);
                    }
                    if self.created_undrained.available_permits() < CREATED_UNDRAINED_MAX / 2 {
                        rt.flush_requested.store(true, SeqCst);
                    }
                }
                return Ok(rt);
            }
        };
        Ok(self.install(name, meta))
    }

    /// Whether a counter of `meta` has expired now. Reads the clock only for a
    /// counter with a deadline.
    pub(crate) fn expired(&self, meta: &CounterMeta) -> bool {
        meta.expires_at_ms.is_some_and(|at| at <= self.now_ms())
    }

    /// Forgets what this node holds in memory of a counter the catalog deleted: its
    /// runtimes (whose buffered increments are dropped at their next drain, so a
    /// counter created anew under the name starts from zero), its auto state and its
    /// cached total (at once from what readers see, then from the rollup).
    pub(crate) fn forget_deleted(&self, name: &CounterName) {
        crate::autoshard::forget(self, name);
        if let Some((_, rt)) = self.registry.remove(name.as_str()) {
            for r in rt.lineage(PREDECESSORS_MAX) {
                r.deleted.store(true, SeqCst);
            }
            rt.retired.store(true, SeqCst);
        }
        self.rollup_view.forget(name);
        if let Some(rollup) = self.rollup.get() {
            let _ = rollup.send_message(crate::rollup::RollupMsg::Forget(name.clone()));
        }
    }

    /// Makes `meta` the counter's current metadata on this node: a new runtime if it
    /// changed, the old one retired (it still drains what it holds).
    pub(crate) fn install(self: &Arc<Self>, name: CounterName, meta: CounterMeta) -> Arc<CounterRuntime> {
        self.install_with(name, meta, false)
    }

    /// A runtime of its own for `meta`, where this node held none of its incarnation.
    /// `created`: this node just created it, so it holds nothing anywhere.
    fn fresh_runtime(
        &self,
        name: &CounterName,
        meta: CounterMeta,
        created: bool,
        now: u64,
    ) -> Arc<CounterRuntime> {
        // A counter this call created holds nothing anywhere: its answers start from
        // an exact zero; any other reads its shards first.
        let ledger = if created { crate::ledger::Ledger::empty(now) } else { crate::ledger::Ledger::new() };
        let rt = CounterRuntime::new(name.clone(), Arc::new(meta), now, Arc::new(ledger));
        if created {
            rt.open_empty_slots();
            // Every increment it takes lands here first, and no other node
            // takes any: its total is in these slots until one leaves them.
            if self.placement.is_none() {
                rt.pristine.store(true, SeqCst);
            }
        }
        Arc::new(rt)
    }

    /// [`Ctx::install`]; `created`: the counter was just created with nothing in any
    /// shard, so a runtime this call inserts where none was opens its slots.
    fn install_with(
        self: &Arc<Self>,
        name: CounterName,
        meta: CounterMeta,
        created: bool,
    ) -> Arc<CounterRuntime> {
        let now = self.now_ms();
        let mut replaced = None;
        let mut reborn = None;
        let rt = match self.registry.entry(name.clone()) {
            // Another incarnation: the counter this node held was deleted and created
            // anew under the name, and this node learns of both at once (it lagged, or
            // its feed of changes did). Versions start again with each incarnation, so
            // only the metadata applied here says which one is current.
            dashmap::Entry::Occupied(mut e) if e.get().meta.created_at_ms != meta.created_at_ms => {
                let current = self.catalog.get(name.as_str()).ok().flatten();
                if current.is_some_and(|m| m.created_at_ms == meta.created_at_ms) {
                    let rt = self.fresh_runtime(&name, meta, created, now);
                    reborn = Some(e.insert(rt.clone()));
                    rt
                } else {
                    e.get().clone()
                }
            }
            dashmap::Entry::Occupied(e) if e.get().meta.version >= meta.version => e.get().clone(),
            dashmap::Entry::Occupied(mut e) => {
                let ledger = e.get().ledger.clone();
                let rt = Arc::new(CounterRuntime::new(name.clone(), Arc::new(meta), now, ledger));
                // The old runtime may still buffer acknowledged increments: a fresh
                // read must find it.
                *rt.predecessor.lock() = Some(e.get().clone());
                // What it acknowledged stays in the answers to `INCR` (`ledger.rs`).
                e.get().hand_over_ledger();
                replaced = Some(e.insert(rt.clone()));
                rt
            }
            dashmap::Entry::Vacant(e) => e.insert(self.fresh_runtime(&name, meta, created, now)).clone(),
        };
        if let Some(old) = reborn {
            // What the deleted counter's runtimes buffer is dropped at their next
            // drain, as for a deletion this node made (`forget_deleted`): never
            // counted in the namesake.
            for r in old.lineage(PREDECESSORS_MAX) {
                r.deleted.store(true, SeqCst);
            }
            old.retired.store(true, SeqCst);
            self.queue_dirty(&old);
        }
        if created {
            self.unmark_busy_shards(&name, &rt);
        }
        if let Some(old) = replaced {
            old.retired.store(true, SeqCst);
            self.queue_dirty(&old);
            // Tell the running shards of every generation, the one a resharding was
            // opening included (a sketch merge started them); sealed ones may now stop.
            for (generation, shards) in old.meta.generations().chain(old.meta.opening()) {
                for index in 0..shards {
                    let id = old.meta.shard_id(&name, generation, index);
                    if let Some(a) = self.directory.get(&id) {
                        let _ = a.send_message(ShardMsg::MetaChanged(rt.meta.clone()));
                    }
                }
            }
        }
        // A resharding in progress is resumed by its task (`reshard.rs`), woken here.
        if rt.meta.layout.resharding.is_some() && self.resharding.insert(name.clone(), ()).is_none() {
            self.reshard_queue.lock().push(name);
            self.reshard_wake.notify_one();
        }
        rt
    }

    /// A counter just created holds nothing in its shards, and its runtime says so
    /// (cold slots, answers from the slots). Yet a shard of the name may already
    /// have an actor, or one being started or written cold: a request that resolved
    /// a deleted namesake's runtime before its deletion, still under way. Writes to
    /// such a shard do not pass through this runtime's slots, so it is not known to
    /// hold nothing, and totals are no longer in the slots alone.
    fn unmark_busy_shards(&self, name: &CounterName, rt: &CounterRuntime) {
        let generation = rt.meta.layout.generation;
        let mut unmarked = false;
        for (index, slot) in rt.slots.iter().enumerate() {
            let Ok(index) = u16::try_from(index) else { break };
            let id = rt.meta.shard_id(name, generation, index);
            if self.directory.contains_key(&id) || self.cold.contains_key(&id) {
                slot.cold.store(false, SeqCst);
                unmarked = true;
            }
        }
        if unmarked {
            rt.touch();
        }
    }

    /// Validates an increment's client-chosen fields.
    pub(crate) fn validate(inc: &Increment) -> Result<(), TallyError> {
        if inc.delta == 0 {
            return Err(TallyError::ZeroDelta);
        }
        if let Some(id) = &inc.event_id {
            check_token("event id", id, EVENT_ID_LEN_MAX)?;
        }
        if let Some(seq) = inc.seq {
            if inc.writer.is_none() {
                return Err(TallyError::InvalidSequence("a sequenced increment needs a writer"));
            }
            if inc.event_id.is_some() {
                return Err(TallyError::InvalidSequence(
                    "an increment carries an event id or a writer sequence, not both",
                ));
            }
            if seq > SEQ_MAX {
                return Err(TallyError::InvalidSequence("seq must be at most 9223372036854775807"));
            }
        }
        if let Some(w) = &inc.writer {
            check_len("writer", w, WRITER_LEN_MAX)?;
        }
        if let Some(m) = &inc.member {
            check_len("member", m, MEMBER_LEN_MAX)?;
        }
        if let Some(i) = &inc.item {
            check_len("item", i, MEMBER_LEN_MAX)?;
        }
        Ok(())
    }

    /// What every increment checks before it counts: its fields, and that the engine
    /// takes writes.
    pub(crate) fn admit(&self, inc: &Increment) -> Result<(), TallyError> {
        Self::validate(inc)?;
        if self.closing.load(Relaxed) {
            return Err(TallyError::ShuttingDown);
        }
        if self.flusher.poisoned() {
            return Err(TallyError::Store(tally_store::StoreError::Io {
                op: "flush",
                message: "an earlier flush failed; reopen the store".into(),
            }));
        }
        Ok(())
    }

    /// Counts one increment: [`Ctx::write`], for its outcome alone.
    pub(crate) async fn incr(
        self: &Arc<Self>,
        name: &str,
        inc: Increment,
    ) -> Result<IncrOutcome, TallyError> {
        self.write(name, inc, false).await.map(|w| w.outcome)
    }

    /// The write path: the one door of every increment by name (`Tally::incr`,
    /// `incr_total`, `incr_value`, and a handle's whose runtime was replaced). The
    /// increment is admitted, offered to the thread's last runtime's accumulator,
    /// and otherwise routed and sent ([`Ctx::incr_after`]). With `want_rt` it answers
    /// the runtime the increment went through, for a front end that reports the total
    /// after it.
    pub(crate) async fn write(
        self: &Arc<Self>,
        name: &str,
        inc: Increment,
        want_rt: bool,
    ) -> Result<Written, TallyError> {
        self.admit(&inc)?;
        let fast = self.try_fast(name, &inc);
        if fast == Fast::Applied {
            let rt = if want_rt { Self::last_runtime() } else { None };
            // The fast path never waits, so a writer looping on it would never give
            // the runtime back to the aggregator and the other actors. Spend tokio's
            // cooperative budget like any other resource: every so often, yield.
            tokio::task::consume_budget().await;
            return Ok(Written { outcome: IncrOutcome::APPLIED, rt, after: None });
        }
        // Boxed: the future of a call that took the fast path stays a few words
        // instead of the general path's whole state, which callers would move.
        Box::pin(self.incr_after(name, inc, fast, want_rt)).await
    }

    /// The thread's last runtime: the one [`Ctx::try_fast`] counted on when it
    /// answered [`Fast::Applied`].
    fn last_runtime() -> Option<Arc<CounterRuntime>> {
        LAST_RUNTIME.with(|c| c.borrow().as_ref().map(|(_, rt)| rt.clone()))
    }

    /// The write path once `inc` was admitted and offered to the thread's last
    /// runtime, which did not take it (`fast`: a miss, or a refusal that says where it
    /// was routed); it answers the runtime the increment went through when `want_rt`
    /// (a front end that reports the total after the increment reads through it, so
    /// neither the name nor the spec is looked up again).
    async fn incr_after(
        self: &Arc<Self>,
        name: &str,
        inc: Increment,
        fast: Fast,
        want_rt: bool,
    ) -> Result<Written, TallyError> {
        debug_assert!(fast != Fast::Applied, "an increment the fast path counted is not written again");
        let mut rt = self.runtime(name, true).await?;
        LAST_RUNTIME.with(|c| *c.borrow_mut() = Some((self.id(), rt.clone())));
        let member = match (&inc.member, rt.meta.spec.distinct) {
            (Some(m), true) => Some(member_hash(m)),
            _ => None,
        };
        let item = frequency_item(&rt, &inc).map(str::to_owned);
        if item.is_some() && inc.delta < 0 {
            return Err(TallyError::NegativeWeight { counter: name.to_owned(), delta: inc.delta });
        }
        if rt.meta.spec.limit.is_some() && inc.delta < 0 {
            return Err(TallyError::LimitNegative { counter: name.to_owned(), delta: inc.delta });
        }
        // One routing decision per increment, reused by whichever path takes it.
        let record_id = inc.record_id();
        let key = route_key(&rt, &inc, record_id.as_deref());
        let mut index = match fast {
            Fast::Refused { engine_rt, index } if Arc::as_ptr(&rt) as usize == engine_rt => index,
            _ => route_with_member(rt.meta.spec.router, rt.meta.layout.shards, &key, member),
        };
        if fast_eligible(&rt, &inc) && self.try_buffer(&rt, index, inc.delta, member) {
            tokio::task::consume_budget().await;
            return Ok(Written { outcome: IncrOutcome::APPLIED, rt: want_rt.then_some(rt), after: None });
        }
        // The direct path: the shard decides, then answers.
        let sub =
            Submission::Single { delta: inc.delta, event_id: record_id.clone(), member, item, seq: inc.seq };
        for attempt in 0..SHARD_CALL_ATTEMPTS_MAX {
            if attempt > 0 {
                index = route_with_member(rt.meta.spec.router, rt.meta.layout.shards, &key, member);
            }
            rt.slots[usize::from(index)].writes.fetch_add(1, Relaxed);
            rt.last_used_ms.store(self.now_ms(), Relaxed);
            let id = rt.meta.shard_id(&rt.name, rt.meta.layout.generation, index);
            let queued = crate::runtime::InFlight::enter(&rt.slots[usize::from(index)]);
            // Until its answer is counted, a base of `INCR` answers waits (`ledger.rs`).
            let ledger = rt.ledger.clone();
            let delivery = ledger.deliver().await;
            let reply = self.submit(&id, &rt.meta, sub.clone()).await;
            drop(queued);
            match reply? {
                ShardReply::Done { outcome, value, after } => {
                    if outcome == Outcome::Applied {
                        rt.ack(index, inc.delta);
                        delivery.confirm(inc.delta);
                    }
                    drop(delivery);
                    rt.slots[usize::from(index)].open.store(slot_open(value), SeqCst);
                    // A batched commit is not flushed here; queueing the counter makes
                    // the aggregator flush within the window, as for buffered sums.
                    if rt.meta.spec.durability == Durability::Batched && rt.claim_dirty() {
                        self.queue_dirty(&rt);
                    }
                    let outcome = self.outcome(&rt, &inc, outcome)?;
                    return Ok(Written { outcome, rt: want_rt.then_some(rt), after: Some(after) });
                }
                ShardReply::Sealed => {
                    if attempt > 0 {
                        tokio::time::sleep(Duration::from_millis(RESHARD_RETRY_MS)).await;
                    }
                    rt = self.refresh(&rt).await?;
                }
            }
        }
        Err(TallyError::Unavailable {
            shard: tally_core::name::quoted(name),
            reason: "the counter is being resharded; retry with the same event id".into(),
        })
    }

    fn outcome(
        &self,
        rt: &CounterRuntime,
        inc: &Increment,
        outcome: Outcome,
    ) -> Result<IncrOutcome, TallyError> {
        match outcome {
            Outcome::Applied => {
                match rt.meta.spec.durability {
                    Durability::Sync => self.stats.increments_sync.inc(),
                    Durability::Batched => self.stats.increments_batched.inc(),
                }
                Ok(IncrOutcome::APPLIED)
            }
            Outcome::Duplicate => {
                self.stats.dedup_hits.inc();
                Ok(IncrOutcome::DUPLICATE)
            }
            Outcome::Conflict { recorded_delta } => {
                self.stats.conflicts.inc();
                Err(TallyError::EventIdConflict {
                    event_id: inc.event_id.clone().unwrap_or_default(),
                    recorded_delta,
                    delta: inc.delta,
                })
            }
            Outcome::Overflow(o) => Err(TallyError::Overflow(o)),
            Outcome::OutOfOrder { expected } => Err(TallyError::OutOfOrderSequence {
                writer: inc.writer.clone().unwrap_or_default(),
                seq: inc.seq.unwrap_or_default(),
                expected,
            }),
            Outcome::TooManyWriters => Err(TallyError::TooManyWriters {
                counter: rt.name.to_string(),
                writer: inc.writer.clone().unwrap_or_default(),
                max: tally_core::dedup::WRITERS_PER_SHARD_MAX,
            }),
            Outcome::TooManyEventIds => {
                self.stats.quota_event_ids_refused.inc();
                Err(TallyError::QuotaExceeded {
                    quota: "engine.event_ids_per_counter_max",
                    what: format!(
                        "event id {:?} would be one more than counter {} keeps ({} over its shards, each until \
                         its dedup window passes)",
                        inc.event_id.clone().unwrap_or_default(),
                        tally_core::name::quoted(rt.name.as_str()),
                        self.quotas.event_ids_per_counter()
                    ),
                })
            }
            Outcome::BoundExceeded { headroom } => {
                self.stats.bound_refusals.inc();
                Err(TallyError::bound_exceeded(&rt.name, &rt.meta.spec, inc.delta, headroom))
            }
        }
    }

    /// This engine's identity, for the per-thread runtime cache.
    fn id(&self) -> u64 {
        self.engine_id
    }

    /// The fast path without touching any shared map or reference count: this thread's
    /// last runtime, if it is this counter's current one. False if the increment must
    /// take the general path.
    pub(crate) fn try_fast(&self, name: &str, inc: &Increment) -> Fast {
        LAST_RUNTIME.with(|c| {
            let cached = c.borrow();
            let Some((engine, rt)) = cached.as_ref() else { return Fast::Miss };
            if *engine != self.id() || rt.name.as_str() != name {
                return Fast::Miss;
            }
            self.offer(rt, inc)
        })
    }

    /// The fast path of every door: counts `inc` on `rt`'s accumulator if `rt` is
    /// still its counter's current runtime, the counter has not expired, the
    /// increment may be buffered and its slot takes it.
    fn offer(&self, rt: &Arc<CounterRuntime>, inc: &Increment) -> Fast {
        if rt.retired.load(Relaxed) || self.expired(&rt.meta) || !fast_eligible(rt, inc) {
            return Fast::Miss;
        }
        let member = match (&inc.member, rt.meta.spec.distinct) {
            (Some(m), true) => Some(member_hash(m)),
            _ => None,
        };
        let index = route_with_member(
            rt.meta.spec.router,
            rt.meta.layout.shards,
            &route_key(rt, inc, inc.event_id.as_deref()),
            member,
        );
        if self.try_buffer(rt, index, inc.delta, member) {
            Fast::Applied
        } else {
            Fast::Refused { engine_rt: Arc::as_ptr(rt) as usize, index }
        }
    }

    /// An increment through a resolved handle: counted on `rt`'s accumulator if it is
    /// still the counter's current runtime and its slot takes it (true), otherwise
    /// left to the general path (false). Refuses what `incr` refuses.
    pub(crate) fn try_handle_fast(
        &self,
        rt: &Arc<CounterRuntime>,
        inc: &Increment,
    ) -> Result<bool, TallyError> {
        self.admit(inc)?;
        Ok(self.offer(rt, inc) == Fast::Applied)
    }

    /// The fast path: add to an accumulator slot. False if the slot cannot take it.
    fn try_buffer(&self, rt: &Arc<CounterRuntime>, index: u16, delta: i64, member: Option<u64>) -> bool {
        let slot = &rt.slots[usize::from(index)];
        if !slot.open.load(Relaxed) {
            return false;
        }
        let n = slot.count.fetch_add(1, SeqCst);
        if n >= SLOT_INCREMENTS_MAX {
            return false;
        }
        if let Some(h) = member {
            slot.members.lock().push(h);
        }
        slot.sum.fetch_add(delta, SeqCst);
        rt.ack(index, delta);
        slot.writes.fetch_add(1, Relaxed);
        if rt.claim_dirty() {
            self.queue_dirty(rt);
        }
        if n + 1 == self.config.slot_flush_increments && !rt.flush_requested.swap(true, SeqCst) {
            if let Some(a) = self.aggregator.get() {
                let _ = a.send_message(AggregatorMsg::FlushNow);
            }
        }
        true
    }

    /// The counter's current runtime, re-read from the catalog.
    pub(crate) async fn refresh(
        self: &Arc<Self>,
        rt: &Arc<CounterRuntime>,
    ) -> Result<Arc<CounterRuntime>, TallyError> {
        match self.catalog.get(rt.name.as_str())? {
            Some(meta) => Ok(self.install(rt.name.clone(), meta)),
            None => Err(TallyError::NotFound(rt.name.to_string())),
        }
    }

    /// A running shard actor for `id`, started if needed.
    pub(crate) async fn shard(
        &self,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
    ) -> Result<ActorRef<ShardMsg>, TallyError> {
        if let Some(a) = self.directory.get(id) {
            return Ok(a.clone());
        }
        crate::handoff::ensure_local(self, id).await?;
        // Nothing of a counter is written before its creation (a running actor was
        // started after this).
        self.catalog.creation_written(id.counter.as_str()).await?;
        let sup = self.supervisor.get().ok_or(TallyError::ShuttingDown)?;
        let (tx, rx) = ractor::concurrency::oneshot();
        sup.send_message(SupervisorMsg::Spawn { id: id.clone(), meta: meta.clone(), reply: tx.into() })
            .map_err(|_| TallyError::ShuttingDown)?;
        match tokio::time::timeout(self.timeout(), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(TallyError::ShuttingDown),
            Err(_) => Err(unavailable(id, "the shard did not start in time")),
        }
    }

    /// The placement and owner of `id` when another node owns it.
    pub(crate) fn remote(&self, id: &ShardId) -> Option<(Arc<dyn Placement>, tally_core::NodeId)> {
        let p = self.placement.as_ref()?;
        p.remote_owner(id).map(|node| (p.clone(), node))
    }

    /// The node that owns `id` (this one when it is local).
    pub(crate) fn owner_name(&self, id: &ShardId) -> String {
        match &self.placement {
            Some(p) => p.remote_owner(id).unwrap_or_else(|| p.local_node()).to_string(),
            None => self.config.node_id.to_string(),
        }
    }

    /// The committed state of a shard of the incarnation `born_ms` of its counter,
    /// wherever it lives, and whether it is sealed.
    pub(crate) async fn read_shard(&self, id: &ShardId, born_ms: u64) -> Result<ShardRead, TallyError> {
        match self.remote(id) {
            None => {
                self.lost.check(id)?;
                crate::handoff::ensure_local(self, id).await?;
                let image = self.store.load_shard(id)?;
                let sealed = self.store.meta_get(&seal_key(id))?.is_some();
                Ok(ShardRead { image, sealed })
            }
            Some((p, node)) => match p.call(&node, ShardRequest::Read { id: id.clone(), born_ms }).await? {
                ShardResponse::Read { image, sealed } => Ok(ShardRead { image, sealed }),
                other => Err(unexpected(&node, id, other)),
            },
        }
    }

    /// The dedup record of `event_id` in a shard, wherever it lives.
    pub(crate) async fn dedup_get(
        &self,
        id: &ShardId,
        event_id: &str,
    ) -> Result<Option<tally_core::dedup::DedupRecord>, TallyError> {
        match self.remote(id) {
            None => {
                crate::handoff::ensure_local(self, id).await?;
                Ok(self.store.dedup_get(id, event_id)?)
            }
            Some((p, node)) => {
                let request = ShardRequest::DedupGet { id: id.clone(), event_id: event_id.to_string() };
                match p.call(&node, request).await? {
                    ShardResponse::Record(r) => Ok(r),
                    other => Err(unexpected(&node, id, other)),
                }
            }
        }
    }

    /// Seals a shard for a resharding, wherever it lives; answers its final state.
    pub(crate) async fn seal_shard(
        &self,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
    ) -> Result<tally_store::ShardImage, TallyError> {
        if let Some((p, node)) = self.remote(id) {
            return match p
                .call(&node, ShardRequest::Seal { id: id.clone(), meta_version: meta.version })
                .await?
            {
                ShardResponse::Image(image) => Ok(image),
                other => Err(unexpected(&node, id, other)),
            };
        }
        self.seal_local(id, meta).await
    }

    /// Seals the local actor of shard `id`. Refused while this node's shards lack
    /// values they had (a replaced disk, its loss not accepted): the sealed value
    /// goes into the next generation's base, which no read checks again.
    pub(crate) async fn seal_local(
        &self,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
    ) -> Result<tally_store::ShardImage, TallyError> {
        self.lost.check(id)?;
        let actor = self.shard(id, meta).await?;
        let (tx, rx) = ractor::concurrency::oneshot();
        actor
            .send_message(ShardMsg::Seal { reply: tx.into() })
            .map_err(|e| unavailable(id, &e.to_string()))?;
        self.await_reply(id, rx).await?
    }

    /// Merges `sketch` into a shard of a generation that takes no writes yet (merging
    /// twice changes nothing, so a retried resharding may repeat it).
    /// The frequency sketch is carried once (the shard remembers it took it), so a
    /// repeat changes nothing either.
    pub(crate) async fn merge_sketch(
        self: &Arc<Self>,
        id: &ShardId,
        sketch: Option<Vec<u8>>,
        frequency: Option<Vec<u8>>,
        windows: Option<Vec<u8>>,
    ) -> Result<(), TallyError> {
        if let Some((p, node)) = self.remote(id) {
            return match p
                .call(&node, ShardRequest::MergeSketch { id: id.clone(), sketch, frequency, windows })
                .await?
            {
                ShardResponse::Done => Ok(()),
                other => Err(unexpected(&node, id, other)),
            };
        }
        self.merge_sketch_local(id, sketch, frequency, windows).await
    }

    /// Merges a sketch into shard `id` on this node, through its actor (the shard's
    /// only writer); returns once the merge is durable.
    pub(crate) async fn merge_sketch_local(
        self: &Arc<Self>,
        id: &ShardId,
        sketch: Option<Vec<u8>>,
        frequency: Option<Vec<u8>>,
        windows: Option<Vec<u8>>,
    ) -> Result<(), TallyError> {
        let rt = self.runtime(id.counter.as_str(), false).await?;
        #[cfg(feature = "planted-bugs")]
        if bug!(SketchMergeBesideLive) {
            return self.merge_sketch_in_store(id, sketch).await;
        }
        let actor = self.shard(id, &rt.meta).await?;
        let (tx, rx) = ractor::concurrency::oneshot();
        actor
            .send_message(ShardMsg::MergeSketch { sketch, frequency, windows, reply: tx.into() })
            .map_err(|e| unavailable(id, &e.to_string()))?;
        self.await_reply(id, rx).await??;
        // The shard belongs to a generation that opens later: its actor was started
        // with metadata that does not list the generation being sealed yet, and would
        // not look up event ids there. It stops now; the copy that serves the open
        // generation starts from the metadata that opened it.
        self.stop_local(id).await;
        Ok(())
    }

    /// The planted bug's merge: straight into the stored image, beside the actor.
    #[cfg(feature = "planted-bugs")]
    async fn merge_sketch_in_store(&self, id: &ShardId, sketch: Option<Vec<u8>>) -> Result<(), TallyError> {
        let mut image = self.store.load_shard(id)?;
        use tally_core::sketch::DistinctSketch;
        if let Some(incoming) = sketch.as_deref().and_then(|b| DistinctSketch::from_bytes(b).ok()) {
            let stored = image.sketch.as_deref().and_then(|b| DistinctSketch::from_bytes(b).ok());
            let mut merged = stored.unwrap_or_default();
            merged.merge(&incoming);
            image.sketch = Some(merged.to_bytes());
        }
        let write = tally_store::ShardWrite { image, ..Default::default() };
        self.flusher.commit(id.clone(), write, None).await?;
        self.flusher.flush().await?;
        Ok(())
    }

    /// Sends escrow messages from shard `from` to other shards of its counter and
    /// generation, wherever they live, without waiting for them: the escrow is built
    /// for lost messages (a grant is resent until acknowledged, a request repeated).
    pub(crate) fn send_escrow(
        self: &Arc<Self>,
        from: &ShardId,
        meta: &Arc<CounterMeta>,
        sends: Vec<EscrowSend>,
    ) {
        for (to, message) in sends {
            let id = from.sibling(from.generation, to);
            self.stats.escrow_messages.inc();
            if matches!(message, tally_core::escrow::Message::Grant { .. }) {
                self.stats.escrow_grants_sent.inc();
            }
            let (ctx, meta) = (self.clone(), meta.clone());
            tokio::spawn(async move {
                if let Err(e) = ctx.deliver_escrow(&id, &meta, message).await {
                    tracing::debug!(shard = %id, error = %e, "escrow message not delivered");
                }
            });
        }
    }

    async fn deliver_escrow(
        &self,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
        message: tally_core::escrow::Message,
    ) -> Result<(), TallyError> {
        if let Some((placement, node)) = self.remote(id) {
            let request = ShardRequest::Escrow { id: id.clone(), meta_version: meta.version, message };
            return match placement.call(&node, request).await? {
                ShardResponse::Done => Ok(()),
                other => Err(unexpected(&node, id, other)),
            };
        }
        self.escrow_local(id, meta, message).await
    }

    /// Hands an escrow message to the local actor of shard `id`.
    pub(crate) async fn escrow_local(
        &self,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
        message: tally_core::escrow::Message,
    ) -> Result<(), TallyError> {
        let actor = self.shard(id, meta).await?;
        actor.send_message(ShardMsg::Escrow(message)).map_err(|e| unavailable(id, &e.to_string()))
    }

    /// Sends a submission to its shard and waits for the answer.
    pub(crate) async fn submit(
        &self,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
        sub: Submission,
    ) -> Result<ShardReply, TallyError> {
        let rx = self.send(id, meta, sub, Sender::Here).await?;
        self.await_reply(id, rx).await
    }

    /// Sends a submission to shard `id`: the one dispatch of shard submissions, for
    /// this node's callers and for the ones another node sent (`serve_shard_request`).
    /// The answer arrives on the returned receiver, the same kind of channel whether
    /// the shard is an actor here or on another node.
    ///
    /// A shard another node owns is asked there when this node's caller sent it; a
    /// submission another node sent is served here or refused, never carried on (its
    /// sender asks the owner it is told of). A shard this node finds it cannot start
    /// because another node owns it now (its placement changed, or it learnt the
    /// shard's replica class only then) has this node's submission, which no actor
    /// took, carried to that owner.
    pub(crate) async fn send(
        &self,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
        mut sub: Submission,
        sender: Sender,
    ) -> Result<ractor::concurrency::OneshotReceiver<ShardReply>, TallyError> {
        let forward = sender == Sender::Here;
        if let Some((placement, node)) = self.remote(id).filter(|_| forward) {
            return Ok(self.send_remote(placement, node, id, meta, sub));
        }
        for _ in 0..SHARD_CALL_ATTEMPTS_MAX {
            let actor = match self.shard(id, meta).await {
                Ok(actor) => actor,
                Err(e) => match self.remote(id).filter(|_| forward) {
                    Some((placement, node)) => {
                        tracing::debug!(shard = %id, error = %e, "the shard's owner changed; sending it there");
                        return Ok(self.send_remote(placement, node, id, meta, sub));
                    }
                    None => return Err(e),
                },
            };
            let (tx, rx) = ractor::concurrency::oneshot();
            let reply: RpcReplyPort<ShardReply> = tx.into();
            match actor.send_message(ShardMsg::Submit { sub, reply }) {
                Ok(()) => return Ok(rx),
                // The shard stopped before taking the message: nothing was applied, so
                // resending is safe. The supervisor starts a fresh one once it is gone.
                Err(MessagingErr::SendErr(ShardMsg::Submit { sub: back, .. })) => {
                    sub = back;
                    tokio::task::yield_now().await;
                }
                Err(e) => return Err(unavailable(id, &e.to_string())),
            }
        }
        Err(unavailable(id, "the shard kept stopping"))
    }

    /// Carries a submission to shard `id`'s owner `node`, and hands the answer over
    /// on the same kind of channel as a local shard's.
    fn send_remote(
        &self,
        placement: Arc<dyn Placement>,
        node: tally_core::NodeId,
        id: &ShardId,
        meta: &Arc<CounterMeta>,
        sub: Submission,
    ) -> ractor::concurrency::OneshotReceiver<ShardReply> {
        let (tx, rx) = ractor::concurrency::oneshot();
        let request = ShardRequest::Submit {
            id: id.clone(),
            meta_version: meta.version,
            born_ms: meta.created_at_ms,
            sub,
        };
        let id = id.clone();
        tokio::spawn(async move {
            match placement.call(&node, request).await {
                Ok(ShardResponse::Reply(r)) => {
                    let _ = tx.send(r);
                }
                Ok(other) => tracing::warn!(shard = %id, "{}", unexpected(&node, &id, other)),
                Err(e) => tracing::debug!(shard = %id, error = %e, "remote submission failed"),
            }
        });
        rx
    }

    pub(crate) async fn await_reply<T>(
        &self,
        id: &ShardId,
        rx: ractor::concurrency::OneshotReceiver<T>,
    ) -> Result<T, TallyError> {
        match tokio::time::timeout(self.timeout(), rx).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) => {
                Err(unavailable(id, "the shard stopped while answering; retry with the same event id"))
            }
            Err(_) => Err(unavailable(id, "timed out; retry with the same event id")),
        }
    }

    /// Delivers everything `rt` buffers to the counter's current shards. Sums that
    /// cannot be delivered go back into the current runtime for the next drain, so an
    /// acknowledged increment is never dropped.
    ///
    /// False if a sum went back to a runtime's slots (its shard was sealed, or could
    /// not be reached): it is still counted, but not yet in any shard.
    ///
    /// The drain runs in a task of its own, so a caller that stops waiting (a client
    /// that gives up on its read) cannot cut it short: cut between taking the sums and
    /// booking them, it would lose them; cut while they are sent, it would leave them
    /// in the book neither answered nor in doubt, and the drain counted in flight, so
    /// every later fresh read of the counter on this node would be incomplete.
    pub(crate) async fn drain(self: &Arc<Self>, rt: &Arc<CounterRuntime>) -> bool {
        let (ctx, rt) = (self.clone(), rt.clone());
        // A join error means the task panicked or the runtime is stopping: either way
        // nothing says the sums arrived.
        tokio::spawn(async move { ctx.drain_whole(&rt).await }).await.unwrap_or(false)
    }

    async fn drain_whole(self: &Arc<Self>, rt: &Arc<CounterRuntime>) -> bool {
        rt.drains_in_flight.fetch_add(1, SeqCst);
        rt.touch();
        let drained = rt.drain();
        let delivered = drained.is_empty() || self.deliver(rt, drained).await;
        // Its first drain has been tried: the place goes. (A sum that could not be
        // delivered is back in the slots, as any counter's is whose shard is away, so
        // counters whose shards are down never keep creations of others waiting.)
        rt.undrained.lock().take();
        if rt.drains_in_flight.fetch_sub(1, SeqCst) == 1 {
            rt.drains_settled.notify_waiters();
        }
        delivered
    }

    /// Waits until no drain of `rt` is between its slots and its shards, bounded by
    /// the call timeout. False if one still is: its sum may be missing from a read.
    pub(crate) async fn settle_drains(&self, rt: &CounterRuntime) -> bool {
        let deadline = tokio::time::Instant::now() + self.timeout();
        loop {
            // Registered before the count is read, so a drain that ends in between
            // still wakes this wait (a 1 ms poll here cost reads under writers a
            // millisecond whenever the aggregator's drain of the counter was in flight).
            let settled = rt.drains_settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if rt.drains_in_flight.load(SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                return rt.drains_in_flight.load(SeqCst) == 0;
            }
        }
    }

    /// Before a read: delivers what this node buffers for the counter — in `rt` and
    /// in the runtimes it replaced — and resends the counter's in-doubt sums. True if
    /// everything this node acknowledged for the counter is now in its shards; false
    /// if a drain did not settle or a sum is still in doubt.
    pub(crate) async fn deliver_for_read(self: &Arc<Self>, rt: &Arc<CounterRuntime>) -> bool {
        let mut lineage = rt.lineage(PREDECESSORS_MAX);
        let mut delivered = false;
        for round in 0..READ_DELIVERY_ROUNDS_MAX {
            if round > 0 {
                // A sum came back from a sealed shard: the layout moved on. Learn the
                // newer metadata, so the runtime holding it becomes a predecessor of
                // one whose generation takes writes, and deliver again.
                if let Ok(Some(meta)) = self.catalog.current(rt.name.as_str()).await {
                    let newer = self.install(rt.name.clone(), meta);
                    lineage = newer.lineage(PREDECESSORS_MAX);
                }
            }
            delivered = true;
            for r in &lineage {
                delivered &= self.drain(r).await;
            }
            if delivered {
                break;
            }
        }
        if self.in_doubt_of(&rt.name) > 0 {
            self.resend_in_doubt(Some(&rt.name)).await;
        }
        let mut settled = true;
        for r in &lineage {
            settled &= self.settle_drains(r).await;
        }
        rt.forget_quiet_predecessors();
        delivered && settled && self.in_doubt_of(&rt.name) == 0
    }

    /// Increments of `name` in sums whose delivery is in doubt.
    pub(crate) fn in_doubt_of(&self, name: &CounterName) -> u64 {
        self.drains.lock().increments_of(name)
    }

    /// Delivers drained sums to the current layout; false if one went back to the
    /// slots instead (see [`Ctx::drain`]).
    async fn deliver(self: &Arc<Self>, rt: &Arc<CounterRuntime>, drained: Vec<Drained>) -> bool {
        if rt.deleted.load(SeqCst) {
            // Not to the counter a later increment created under the same name.
            tracing::warn!(counter = %rt.name, "dropping buffered increments of a deleted counter");
            return true;
        }
        rt.last_used_ms.store(self.now_ms(), Relaxed);
        let target = match self.registry.get(rt.name.as_str()).map(|r| r.clone()) {
            Some(t) => t,
            None => match self.runtime(rt.name.as_str(), false).await {
                Ok(t) => t,
                Err(TallyError::NotFound(_)) => {
                    tracing::warn!(counter = %rt.name, "dropping buffered increments of a deleted counter");
                    return true;
                }
                Err(e) => {
                    tracing::warn!(counter = %rt.name, error = %e, "cannot reach counter; keeping its buffer");
                    self.give_back(rt, drained);
                    return false;
                }
            },
        };
        // A namesake created since (its runtime found anew) is another counter.
        if target.meta.created_at_ms != rt.meta.created_at_ms {
            tracing::warn!(counter = %rt.name, "dropping buffered increments of a deleted counter");
            return true;
        }
        let mut delivered = true;
        let mut waiting = Vec::with_capacity(drained.len());
        // Until every answer is counted, a base of `INCR` answers waits (`ledger.rs`).
        // The sums are `rt`'s: its ledger acknowledged them.
        let delivery = rt.ledger.deliver().await;
        let now = self.now_ms();
        for d in drained {
            let index = d.index % target.meta.layout.shards;
            let id = target.meta.shard_id(&target.name, target.meta.layout.generation, index);
            // Every drained sum carries an id and stays in the book until answered:
            // its answer may be lost or late (a remote node, or a local disk that
            // stalls past the call timeout) while the shard still applies it, so it is
            // resent as it is, never merged into another sum.
            let sub = self.drains.lock().open(
                now,
                (&target.name, target.meta.created_at_ms),
                index,
                target.meta.layout.shards,
                (d.sum, d.increments, d.members.clone()),
            );
            self.stats.drain_increments.record(d.increments);
            // A shard that holds nothing and never ran takes its first sum without
            // an actor (`cold.rs`).
            let sent = match crate::cold::write(self, &target, index, &id, &sub).await {
                Some(rx) => Ok(rx),
                None => self.send(&id, &target.meta, sub.clone(), Sender::Here).await,
            };
            match sent {
                Ok(rx) => waiting.push((id, index, rx, d, sub)),
                // Never sent: nothing was applied, so it may merge with later sums.
                Err(_) => {
                    self.drains.lock().close(sub.drain_id().unwrap_or_default());
                    self.give_back(&target, vec![Drained { index, ..d }]);
                    delivered = false;
                }
            }
        }
        for (id, index, rx, d, sub) in waiting {
            let drain_id = sub.drain_id().unwrap_or_default();
            match self.await_reply(&id, rx).await {
                Ok(ShardReply::Done { value, .. }) => {
                    self.drains.lock().close(drain_id);
                    delivery.confirm(d.sum);
                    self.stats.increments_batched.add(d.increments);
                    target.slots[usize::from(index)].open.store(slot_open(value), SeqCst);
                }
                // Refused at the door: nothing was applied.
                Ok(ShardReply::Sealed) => {
                    self.drains.lock().close(drain_id);
                    self.give_back(&target, vec![Drained { index, ..d }]);
                    delivered = false;
                }
                // In the book of sums in doubt, which a read checks.
                Err(_) => self.drains.lock().unanswered(drain_id, self.now_ms()),
            }
        }
        delivered
    }

    /// Resends the drained sums in doubt that are due (all of them, or those of one
    /// counter), each with its own id, to the counter's current layout, several at
    /// once; reports those given up ([`IN_DOUBT_RETRY_MS_MAX`]).
    pub(crate) async fn resend_in_doubt(self: &Arc<Self>, only: Option<&CounterName>) {
        let now = self.now_ms();
        let (due, lost) = self.drains.lock().due(now, only);
        for d in lost {
            let increments = d.sub.increments();
            self.stats.buffered_lost.add(increments);
            tracing::error!(
                counter = %d.counter,
                increments,
                in_doubt_ms = now.saturating_sub(d.first_sent_ms),
                "acknowledged buffered increments given up: their shard did not answer within the resend limit"
            );
        }
        futures::stream::iter(due)
            .for_each_concurrent(IN_DOUBT_RESENDS_CONCURRENT_MAX, |(name, born_ms, sub)| async move {
                if self.resend(&name, born_ms, &sub).await {
                    self.drains.lock().close(sub.drain_id().unwrap_or_default());
                }
            })
            .await;
    }

    /// Resends one in-doubt sum of the incarnation of `name` created at `born_ms`;
    /// true once it is answered (or moot: that counter is gone, perhaps replaced by a
    /// namesake, which never counts another counter's sums).
    async fn resend(self: &Arc<Self>, name: &CounterName, born_ms: u64, sub: &Submission) -> bool {
        let Submission::Buffered { drain_id: Some(drain_id), increments, .. } = sub else { return true };
        let rt = match self.runtime(name.as_str(), false).await {
            Ok(rt) if rt.meta.created_at_ms == born_ms => rt,
            Ok(_) | Err(TallyError::NotFound(_)) => {
                tracing::warn!(counter = %name, "dropping a drained sum of a deleted counter");
                return true;
            }
            Err(_) => return false,
        };
        let index = tally_core::router::shard_of_event(drain_id, rt.meta.layout.shards);
        let id = rt.meta.shard_id(name, rt.meta.layout.generation, index);
        let delivery = rt.ledger.deliver().await;
        match self.submit(&id, &rt.meta, sub.clone()).await {
            Ok(ShardReply::Done { outcome, .. }) => {
                if outcome == Outcome::Applied {
                    self.stats.increments_batched.add(*increments);
                }
                if let Submission::Buffered { sum, .. } = sub {
                    delivery.confirm(*sum);
                }
                true
            }
            _ => false,
        }
    }

    fn give_back(&self, rt: &Arc<CounterRuntime>, drained: Vec<Drained>) {
        for d in drained {
            if rt.give_back(d.index, d.sum, d.increments, d.members) {
                self.queue_dirty(rt);
            }
        }
    }

    /// Stops the local actor of shard `id` and deletes its data.
    pub(crate) async fn delete_local(&self, id: &ShardId) -> Result<(), TallyError> {
        // Adopt first, so the previous owner deletes its copy in its hand-off.
        crate::handoff::ensure_local(self, id).await?;
        self.stop_local(id).await;
        self.drop_shard_data(id).await
    }

    /// Stops the local actor of shard `id`, if one runs, and returns once it has ended
    /// (it commits what it had taken first).
    pub(crate) async fn stop_local(&self, id: &ShardId) {
        if let Some(sup) = self.supervisor.get() {
            let (tx, rx) = ractor::concurrency::oneshot();
            if sup.send_message(SupervisorMsg::Stop { id: id.clone(), reply: tx.into() }).is_ok() {
                let _ = rx.await;
            }
        }
    }

    /// Removes shard `id`'s data from this node's store: value, sketch, dedup records
    /// and its seal.
    pub(crate) async fn drop_shard_data(&self, id: &ShardId) -> Result<(), TallyError> {
        self.store.delete_shard_async(id).await?;
        self.store.meta_delete_async(&seal_key(id)).await?;
        Ok(())
    }

    /// Refuses to delete shard `id` for another node while this node's metadata
    /// gives it to a live counter: for a deleted counter's cleanup (`prune_of` is
    /// `None`), unless a tombstone here lists its generation; for a prune, unless
    /// the live counter is the incarnation `prune_of` names and holds the generation
    /// sealed. The sender's view may lag this node's (see [`ShardRequest::Delete`]);
    /// a refusal is retried once the views agree.
    pub(crate) fn check_deletable(&self, id: &ShardId, prune_of: Option<u64>) -> Result<(), TallyError> {
        let live = self.catalog.get(id.counter.as_str())?;
        self.check_deletable_by(id, prune_of, live.as_ref())
    }

    /// [`Ctx::check_deletable`] against the metadata `live` (the latest, when this
    /// node's view refused a deletion its sender decided on a newer one).
    pub(crate) fn check_deletable_by(
        &self,
        id: &ShardId,
        prune_of: Option<u64>,
        live: Option<&CounterMeta>,
    ) -> Result<(), TallyError> {
        let Some(live) = live else { return Ok(()) };
        let layout = &live.layout;
        let sealed = layout.sealed.iter().any(|g| g.generation == id.generation);
        let allowed = match prune_of {
            Some(born) => live.created_at_ms == born && sealed,
            None => {
                let claimed = sealed
                    || id.generation == layout.generation
                    || (layout.resharding.is_some() && id.generation == layout.generation + 1);
                let listed = self.catalog.tombstone(id.counter.as_str())?.is_some_and(|t| {
                    t.iter().any(|(word, shards)| *word == id.generation_word() && id.index < *shards)
                });
                !claimed || listed
            }
        };
        if allowed {
            return Ok(());
        }
        Err(unavailable(
            id,
            "this node's metadata gives the shard to a live counter: the deletion was decided on an older \
             view, and is retried once the views agree",
        ))
    }

    /// Deletes shard `id`'s data wherever it lives (`prune_of`: see
    /// [`ShardRequest::Delete`]).
    pub(crate) async fn delete_shard_anywhere(
        &self,
        id: &ShardId,
        prune_of: Option<u64>,
    ) -> Result<(), TallyError> {
        match self.remote(id) {
            None => self.delete_local(id).await,
            Some((p, node)) => {
                match p.call(&node, ShardRequest::Delete { id: id.clone(), prune_of }).await? {
                    ShardResponse::Done => Ok(()),
                    other => Err(unexpected(&node, id, other)),
                }
            }
        }
    }

    /// Removes what a deleted counter left in the store, if its cleanup is pending.
    pub(crate) async fn finish_delete(&self, name: &CounterName) -> Result<(), TallyError> {
        let Some(generations) = self.catalog.tombstone(name.as_str())? else { return Ok(()) };
        // A tombstone names each generation by its word, which carries the class of
        // the counter's shards.
        for (word, shards) in generations {
            for index in 0..shards {
                self.delete_shard_anywhere(&ShardId::from_word(name.clone(), word, index), None).await?;
            }
        }
        self.flusher.flush().await?;
        self.catalog.clear_tombstone(name).await?;
        Ok(())
    }

    /// The counter's metadata, at least as new as `version` (a request from another
    /// node may carry metadata this node's catalog copy has not applied yet).
    pub(crate) async fn meta_at_least(
        self: &Arc<Self>,
        name: &CounterName,
        version: u64,
    ) -> Result<Arc<CounterRuntime>, TallyError> {
        let deadline = tokio::time::Instant::now() + self.timeout();
        loop {
            if let Some(rt) = self.registry.get(name.as_str()).map(|r| r.clone()) {
                if rt.meta.version >= version {
                    return Ok(rt);
                }
            }
            if let Some(meta) = self.catalog.get(name.as_str())? {
                if meta.version >= version {
                    return Ok(self.install(name.clone(), meta));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(TallyError::Unavailable {
                    shard: tally_core::name::quoted(name.as_str()),
                    reason: format!("metadata version {version} has not reached this node"),
                });
            }
            tokio::time::sleep(Duration::from_millis(META_CATCH_UP_POLL_MS)).await;
        }
    }

    /// Refuses to serve shard `id` to another node unless this node's metadata of
    /// its counter — or, where that disagrees, the metadata group's latest (a read
    /// index) — gives the shard to the counter's incarnation `born_ms`. `known` is
    /// this node's metadata, when the caller has it at hand. Answers the runtime of
    /// the latest metadata when it had to be asked for (and is installed now).
    ///
    /// The sender's view may lag a deletion, a re-creation under the same name, or
    /// the pruning of a sealed generation. Served anyway, its read would sum an
    /// emptied shard, or one of another layout, as a complete total, and its write
    /// would count where no read looks, or in the namesake. Refused, its read lists
    /// the shard as missing and its write stays unanswered, so nothing is claimed.
    pub(crate) async fn check_serves(
        self: &Arc<Self>,
        id: &ShardId,
        born_ms: u64,
        known: Option<&CounterMeta>,
    ) -> Result<Option<Arc<CounterRuntime>>, TallyError> {
        let serves = |meta: &CounterMeta| meta.created_at_ms == born_ms && meta.holds(id);
        if known.is_some_and(serves) {
            return Ok(None);
        }
        if known.is_none() && self.catalog.get(id.counter.as_str())?.as_ref().is_some_and(serves) {
            return Ok(None);
        }
        match self.catalog.current(id.counter.as_str()).await? {
            Some(latest) if serves(&latest) => Ok(Some(self.install(id.counter.clone(), latest))),
            _ => Err(unavailable(
                id,
                "the latest metadata gives this shard to no counter of the sender's incarnation: the \
                 sender's view lags a deletion, a re-creation or a resharding",
            )),
        }
    }

    /// Applies a metadata command and installs the result.
    pub(crate) async fn apply_meta(
        self: &Arc<Self>,
        name: &CounterName,
        cmd: &MetaCommand,
    ) -> Result<(Option<Arc<CounterRuntime>>, MetaEffect), TallyError> {
        let (meta, effect) = self.catalog.apply(name, cmd, self.now_ms()).await?;
        let rt = meta.map(|m| self.install(name.clone(), m));
        Ok((rt, effect))
    }
}
