//! The rollup: one per node. It caches counter totals so hot reads cost a map
//! lookup instead of a fan-out over every shard. A cached total is refreshed every
//! `rollup_ms`, or sooner once enough change has accumulated and it is read
//! ([`tally_core::rollup::refresh_due`]); each answer states its age, counted from a
//! time taken before the shards were asked.
//!
//! The actor owns the cache and publishes each total it takes into a [`RollupView`]
//! that readers consult directly: a cached read is a lookup and a copy, without a
//! message, and only a counter's first read (not cached yet) goes through the actor.
//! A reader marks an entry read; the actor collects the marks on its next tick (for
//! idle eviction and for hurrying a changed counter's refresh).
//!
//! The actor never reads shards itself: refresh passes and first reads run in tasks
//! of their own and send their totals back, so no read waits for a pass. A pass
//! visits only the counters that are due (a schedule keyed by due time), reads
//! them together, sharing waits for durability, and hands each total back as soon
//! as it is read, so a counter whose shard is slow to answer holds up only itself;
//! a few passes may run at once. It skips the read of a counter that nothing can
//! have changed since its total was taken.

use crate::api::{Consistency, ValueRead};
use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::runtime::CounterRuntime;
use dashmap::DashMap;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tally_core::meta::CounterMeta;
use tally_core::rollup::refresh_due;
use tally_core::CounterName;

/// Most counters one refresh pass reads; the rest wait for the next pass.
pub const ROLLUP_REFRESH_BATCH_MAX: usize = 4_096;
/// Most refresh passes running at once: a pass whose last counters wait on an
/// unreachable shard does not keep the other counters from being refreshed.
pub const ROLLUP_PASSES_MAX: usize = 4;

/// Messages the rollup takes.
pub(crate) enum RollupMsg {
    /// The cached total of a counter (computed now if not cached yet).
    Get { name: CounterName, reply: RpcReplyPort<Result<ValueRead, TallyError>> },
    /// Refresh what is due.
    Tick,
    /// Forget a counter (deleted).
    Forget(CounterName),
    /// Totals a refresh pass read (from its task, as they come).
    Refreshed(Vec<Fetched>),
    /// A refresh pass read every counter it took.
    PassDone,
    /// A first read of a counter not cached yet (from its task).
    Loaded(Fetched),
}

impl ractor::Message for RollupMsg {}

/// A total read for the cache.
pub(crate) struct Fetched {
    name: CounterName,
    read: ValueRead,
    /// When the read began, on the runtime's monotonic clock: what orders two totals
    /// of one counter, since `read.as_of_ms` is the wall clock's, which can step back.
    taken: tokio::time::Instant,
    rollup_ms: u32,
    /// The runtime whose change count the read started from.
    runtime: Weak<CounterRuntime>,
}

/// The rollup actor.
pub(crate) struct Rollup;

/// A cached total as readers see it ([`RollupView`]).
pub(crate) struct Published {
    read: parking_lot::Mutex<ValueRead>,
    /// Set by the first read since the rollup's last tick, which also queues the
    /// counter's name in [`RollupView::read`]; cleared when the tick takes it.
    read_since_tick: AtomicBool,
}

/// The cached totals, readable without a message to the rollup; only the rollup
/// writes them.
#[derive(Default)]
pub(crate) struct RollupView {
    totals: DashMap<CounterName, Arc<Published>>,
    /// Counters read since the last tick, one entry each at most (so at most
    /// `rollup_tracked_max`, the bound of the cache).
    read: parking_lot::Mutex<Vec<CounterName>>,
}

impl RollupView {
    /// The cached total of `name`, aged to `now`, if the rollup holds one.
    pub(crate) fn get(&self, name: &CounterName, now: u64) -> Option<ValueRead> {
        self.with_published(name, |read| aged(read, now))
    }

    /// Answers `f` of `name`'s published total, and notes the read for the rollup's
    /// next tick.
    fn with_published<T>(&self, name: &CounterName, f: impl FnOnce(&ValueRead) -> T) -> Option<T> {
        let published = self.totals.get(name)?;
        let answer = f(&published.read.lock());
        if !published.read_since_tick.load(Relaxed) && !published.read_since_tick.swap(true, SeqCst) {
            self.read.lock().push(name.clone());
        }
        Some(answer)
    }

    /// Stops answering `name`'s total (the counter was deleted); the rollup forgets
    /// it on its next message.
    pub(crate) fn forget(&self, name: &CounterName) {
        self.totals.remove(name);
    }
}

struct Cached {
    /// The total, as published to readers.
    shared: Arc<Published>,
    rollup_ms: u32,
    last_read_ms: u64,
    /// When the total published began to be read ([`Fetched::taken`]).
    taken: tokio::time::Instant,
    /// When the next refresh is due (its key in the schedule).
    due_ms: u64,
    /// The runtime whose change count was reset when `read` was taken: while it is
    /// still the counter's runtime and counts no change, nothing was written since.
    runtime: Weak<CounterRuntime>,
}

/// Cached totals by counter, and when each is due.
pub(crate) struct RollupState {
    ctx: Weak<Ctx>,
    cache: HashMap<CounterName, Cached>,
    /// Refresh schedule: one (due time, counter) per cached counter, so a pass looks
    /// only at what is due, however many counters are cached.
    due: BTreeSet<(u64, CounterName)>,
    /// Refresh passes running (at most [`ROLLUP_PASSES_MAX`]); a counter being read
    /// by one is out of the schedule until its total comes back.
    passes: usize,
    /// The latest wall-clock time a pass saw: a later pass that sees an earlier one
    /// finds the clock stepped back, and brings due times within reach again.
    clock_ms: u64,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl Actor for Rollup {
    type Msg = RollupMsg;
    type State = RollupState;
    type Arguments = Weak<Ctx>;

    async fn pre_start(
        &self,
        myself: ActorRef<RollupMsg>,
        ctx: Weak<Ctx>,
    ) -> Result<RollupState, ActorProcessingErr> {
        let tick_ms = ctx.upgrade().map(|c| c.config.rollup_tick_ms).unwrap_or(10);
        let ticker = myself.send_interval(Duration::from_millis(tick_ms), || RollupMsg::Tick);
        Ok(RollupState {
            ctx,
            cache: HashMap::new(),
            due: BTreeSet::new(),
            passes: 0,
            clock_ms: 0,
            ticker: Some(ticker),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RollupMsg>,
        state: &mut RollupState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<RollupMsg>,
        msg: RollupMsg,
        state: &mut RollupState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(ctx) = state.ctx.upgrade() else { return Ok(()) };
        match msg {
            RollupMsg::Get { name, reply } => {
                let now = ctx.now_ms();
                match state.cache.get_mut(&name) {
                    Some(c) => {
                        c.last_read_ms = now;
                        let _ = reply.send(Ok(aged(&c.shared.read.lock(), now)));
                        state.hurry_if_changed(&ctx, &name, now);
                    }
                    // A first read fans out beside the actor: it never waits behind a
                    // refresh pass, and no pass waits behind it.
                    None => {
                        tokio::spawn(load(ctx.clone(), myself.clone(), name, reply));
                    }
                }
            }
            RollupMsg::Tick => {
                state.take_reads(&ctx);
                state.refresh_due(&ctx, &myself);
            }
            RollupMsg::Forget(name) => state.forget(&ctx, &name),
            RollupMsg::PassDone => state.passes = state.passes.saturating_sub(1),
            RollupMsg::Refreshed(fetched) => {
                for f in fetched {
                    state.store(&ctx, f, false);
                }
            }
            RollupMsg::Loaded(f) => state.store(&ctx, f, true),
        }
        Ok(())
    }
}

/// Whether the runtime a total was read through belongs to a deleted counter.
fn deleted(runtime: &Weak<CounterRuntime>) -> bool {
    runtime.upgrade().is_some_and(|rt| rt.deleted.load(SeqCst))
}

fn aged(read: &ValueRead, now: u64) -> ValueRead {
    ValueRead {
        staleness_ms: now.saturating_sub(read.as_of_ms),
        consistency: Consistency::Cached,
        ..read.clone()
    }
}

/// Reads a counter's total for a first cached read — fresh, this node's buffered
/// increments delivered first, so the `INCR` that created a counter answers a total
/// that includes it — answers the caller, then hands the total to the rollup to cache.
/// A counter this node created and still holds whole in its slots
/// ([`CounterRuntime::pristine_total`]) is summed from them instead.
async fn load(
    ctx: Arc<Ctx>,
    rollup: ActorRef<RollupMsg>,
    name: CounterName,
    reply: RpcReplyPort<Result<ValueRead, TallyError>>,
) {
    let rt = match ctx.runtime(name.as_str(), false).await {
        Ok(rt) => rt,
        Err(e) => {
            let _ = reply.send(Err(e));
            return;
        }
    };
    rt.changed.store(0, SeqCst);
    let taken = tokio::time::Instant::now();
    // A counter this node just created, whose increments are all still in its
    // slots, has its exact total there: no drain, no store read, no flush to wait for.
    let read = match rt.pristine_total(ctx.now_ms()) {
        Some(read) => Ok(read),
        None => crate::read::fresh(&ctx, &rt).await,
    };
    match read {
        Ok(read) => {
            let _ = reply.send(Ok(aged(&read, ctx.now_ms())));
            let fetched = Fetched {
                name,
                read,
                taken,
                rollup_ms: rt.meta.spec.rollup_ms,
                runtime: Arc::downgrade(&rt),
            };
            let _ = rollup.send_message(RollupMsg::Loaded(fetched));
        }
        Err(e) => {
            let _ = reply.send(Err(e));
        }
    }
}

impl RollupState {
    /// Caches a total read by a pass or a first read, and schedules its refresh.
    fn store(&mut self, ctx: &Ctx, f: Fetched, first: bool) {
        // A total read before its counter was deleted must not outlive the deletion:
        // its `Forget` may have come first (a first read answers its caller, then
        // sends the total here), and a counter created anew under the name would
        // answer it.
        if deleted(&f.runtime) {
            return;
        }
        let now = ctx.now_ms();
        // Due an interval after the total was taken, or after now if the clock went
        // back while it was read.
        let due_ms = f.read.as_of_ms.min(now).saturating_add(u64::from(f.rollup_ms));
        let full = self.cache.len() >= ctx.config.rollup_tracked_max;
        match self.cache.get_mut(&f.name) {
            Some(c) => {
                if f.taken < c.taken {
                    // An older total than the one cached: keep the entry scheduled.
                    self.due.insert((c.due_ms, f.name));
                    return;
                }
                *c.shared.read.lock() = f.read;
                self.due.remove(&(c.due_ms, f.name.clone()));
                c.taken = f.taken;
                c.rollup_ms = f.rollup_ms;
                c.runtime = f.runtime;
                c.due_ms = due_ms;
            }
            // A pass's result for a counter forgotten meanwhile is dropped; a full
            // cache serves further first reads uncached rather than evict a hot entry.
            None if !first || full => return,
            None => {
                let shared = Arc::new(Published {
                    read: parking_lot::Mutex::new(f.read),
                    read_since_tick: AtomicBool::new(false),
                });
                ctx.rollup_view.totals.insert(f.name.clone(), shared.clone());
                if deleted(&f.runtime) {
                    // Deleted meanwhile: the deletion marks the runtime before it
                    // clears the view, so one of the two sees the other.
                    ctx.rollup_view.forget(&f.name);
                    return;
                }
                let cached = Cached {
                    shared,
                    rollup_ms: f.rollup_ms,
                    last_read_ms: now,
                    taken: f.taken,
                    due_ms,
                    runtime: f.runtime,
                };
                self.cache.insert(f.name.clone(), cached);
            }
        }
        self.due.insert((due_ms, f.name));
    }

    fn forget(&mut self, ctx: &Ctx, name: &CounterName) {
        if let Some(c) = self.cache.remove(name) {
            ctx.rollup_view.forget(name);
            self.due.remove(&(c.due_ms, name.clone()));
        }
    }

    /// Takes the counters readers marked read since the last tick: each counts as
    /// read now (for idle eviction), and one that changed enough is hurried.
    fn take_reads(&mut self, ctx: &Ctx) {
        let read = std::mem::take(&mut *ctx.rollup_view.read.lock());
        let now = ctx.now_ms();
        for name in read {
            if let Some(c) = self.cache.get_mut(&name) {
                c.shared.read_since_tick.store(false, SeqCst);
                c.last_read_ms = now;
                self.hurry_if_changed(ctx, &name, now);
            }
        }
    }

    /// A cached counter that changed enough since its total was taken is refreshed at
    /// the next pass instead of at its due time ([`tally_core::rollup::refresh_due`]).
    fn hurry_if_changed(&mut self, ctx: &Ctx, name: &CounterName, now: u64) {
        let Some(c) = self.cache.get_mut(name) else { return };
        let changed = ctx.registry.get(name.as_str()).map_or(0, |rt| rt.changed.load(Relaxed));
        let (as_of_ms, value) = {
            let read = c.shared.read.lock();
            (read.as_of_ms, read.value)
        };
        if c.due_ms > now && refresh_due(now, as_of_ms, c.rollup_ms, value, changed) {
            self.due.remove(&(c.due_ms, name.clone()));
            c.due_ms = now;
            self.due.insert((now, name.clone()));
        }
    }

    /// The wall clock went back to `now`: every total is due within its interval
    /// of `now`, as if taken now, not when the clock is back where it was; and the
    /// reads that keep an entry cached count from `now`.
    fn clock_stepped_back(&mut self, now: u64) {
        tracing::warn!(
            by_ms = self.clock_ms - now,
            "the wall clock stepped back; rescheduling cached totals"
        );
        self.due.clear();
        for (name, c) in &mut self.cache {
            c.due_ms = c.due_ms.min(now.saturating_add(u64::from(c.rollup_ms)));
            c.last_read_ms = c.last_read_ms.min(now);
            self.due.insert((c.due_ms, name.clone()));
        }
    }

    /// Starts a pass over what is due, unless one is running. A counter that nothing
    /// can have changed since its total was taken (every shard is on this node, its
    /// runtime is the same, and it counts no change) only has its `as_of` moved on;
    /// the others are read in one batch by a task of their own.
    fn refresh_due(&mut self, ctx: &Arc<Ctx>, myself: &ActorRef<RollupMsg>) {
        if self.passes >= ROLLUP_PASSES_MAX {
            return;
        }
        let now = ctx.now_ms();
        if now < self.clock_ms {
            self.clock_stepped_back(now);
        }
        self.clock_ms = now;
        let idle_ms = ctx.config.rollup_idle_evict_ms;
        let mut batch = Vec::new();
        while batch.len() < ROLLUP_REFRESH_BATCH_MAX {
            let Some(first) = self.due.first().cloned() else { break };
            if first.0 > now {
                break;
            }
            self.due.pop_first();
            let name = first.1;
            let Some(c) = self.cache.get_mut(&name) else { continue };
            if now.saturating_sub(c.last_read_ms) >= idle_ms {
                self.forget(ctx, &name);
                continue;
            }
            let rt = ctx.registry.get(name.as_str()).map(|r| r.clone());
            let same =
                rt.as_ref().is_some_and(|rt| c.runtime.upgrade().is_some_and(|old| Arc::ptr_eq(&old, rt)));
            if ctx.placement.is_none() && same && rt.as_ref().is_some_and(|rt| rt.changed.load(SeqCst) == 0) {
                c.shared.read.lock().as_of_ms = now;
                c.due_ms = now.saturating_add(u64::from(c.rollup_ms));
                self.due.insert((c.due_ms, name));
                continue;
            }
            let meta = match &rt {
                Some(rt) => {
                    rt.changed.store(0, SeqCst);
                    rt.meta.clone()
                }
                None => match ctx.catalog.get(name.as_str()) {
                    Ok(Some(m)) => Arc::new(m),
                    _ => {
                        self.forget(ctx, &name);
                        continue;
                    }
                },
            };
            // Until the pass answers, the entry is due at once again if the pass is
            // lost (its task ends without a message only when the engine stops).
            c.due_ms = now;
            let runtime = rt.as_ref().map(Arc::downgrade).unwrap_or_default();
            batch.push((name, meta, runtime));
        }
        if batch.is_empty() {
            return;
        }
        self.passes += 1;
        let (ctx, myself) = (ctx.clone(), myself.clone());
        tokio::spawn(async move {
            let counters: Vec<(CounterName, Arc<CounterMeta>)> =
                batch.iter().map(|(n, m, _)| (n.clone(), m.clone())).collect();
            let taken = tokio::time::Instant::now();
            crate::read::sum_each(&ctx, &counters, |reads| {
                let fetched = reads
                    .into_iter()
                    .map(|(i, read)| {
                        let (name, meta, runtime) = &batch[i];
                        Fetched {
                            name: name.clone(),
                            read,
                            taken,
                            rollup_ms: meta.spec.rollup_ms,
                            runtime: runtime.clone(),
                        }
                    })
                    .collect();
                let _ = myself.send_message(RollupMsg::Refreshed(fetched));
            })
            .await;
            let _ = myself.send_message(RollupMsg::PassDone);
        });
    }
}
