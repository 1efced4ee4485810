//! [`Tally`]: the embedded engine's handle.

use crate::aggregator::Aggregator;
use crate::api::*;
use crate::catalog::Catalog;
use crate::catalog::LocalCatalog;
use crate::clock::{Clock, SystemClock};
use crate::config::TallyConfig;
use crate::ctx::Ctx;
use crate::error::TallyError;
use crate::flusher::Flusher;
use crate::handle::CounterHandle;
use crate::handoff::HandoffReport;
use crate::messages::{AggregatorMsg, SupervisorMsg};
use crate::placement::{Placement, ShardRequest, ShardResponse};
use crate::reconciler::{Reconciler, ReconcilerMsg};
use crate::rollup::{Rollup, RollupMsg};
use crate::stats::Stats;
use crate::supervisor::Supervisor;
use ractor::{Actor, ActorRef};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tally_core::frequency::TOP_K_MAX;
use tally_core::meta::{MetaCommand, MetaEffect};
use tally_core::name::{check_len, MEMBER_LEN_MAX};
use tally_core::spec::{AutoPatch, AutoShards, Durability, SpecPatch};
use tally_core::CounterName;
use tally_store::{SledConfig, SledStore, Store};

/// How long shutdown waits for the actors to stop.
const SHUTDOWN_WAIT_MS: u64 = 10_000;

/// Everything an engine is built from.
pub struct EngineParts {
    /// Where shard data lives.
    pub store: Arc<dyn Store>,
    /// Where time comes from.
    pub clock: Arc<dyn Clock>,
    /// Limits and timers.
    pub config: TallyConfig,
    /// Counter metadata; `None` keeps it in `store`.
    pub catalog: Option<Arc<dyn Catalog>>,
    /// Shard ownership; `None` owns every shard.
    pub placement: Option<Arc<dyn Placement>>,
}

/// An embedded Tally engine. Cheap to clone; every clone drives the same engine.
///
/// ```no_run
/// # async fn demo() -> Result<(), tally_engine::TallyError> {
/// use tally_engine::{Consistency, Increment, Tally, TallyConfig};
/// let tally = Tally::open("./data", TallyConfig::default()).await?;
/// tally.incr("likes:42", Increment::new(1).writer("w-7")).await?;
/// let read = tally.read("likes:42", Consistency::Fresh).await?;
/// assert_eq!(read.value, 1);
/// tally.shutdown().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Tally {
    ctx: Arc<Ctx>,
    actors: Arc<Actors>,
}

struct Actors {
    supervisor: ActorRef<SupervisorMsg>,
    aggregator: ActorRef<AggregatorMsg>,
    rollup: ActorRef<RollupMsg>,
    reconciler: ActorRef<ReconcilerMsg>,
}

fn spawn_err(e: impl std::fmt::Display) -> TallyError {
    TallyError::Unavailable { shard: "engine".into(), reason: format!("cannot start an actor: {e}") }
}

impl Tally {
    /// Opens (or creates) an engine whose data lives in a sled database at `dir`.
    pub async fn open(dir: impl AsRef<Path>, config: TallyConfig) -> Result<Self, TallyError> {
        let store = SledStore::open(&SledConfig::new(dir.as_ref()))?;
        Self::open_with(Arc::new(store), Arc::new(SystemClock), config).await
    }

    /// Opens an engine over any store and clock (the in-memory store in tests and
    /// simulations, a manual clock for windows and expiry).
    pub async fn open_with(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        config: TallyConfig,
    ) -> Result<Self, TallyError> {
        Self::open_parts(EngineParts { store, clock, config, catalog: None, placement: None }).await
    }

    /// Opens an engine from its parts. A cluster passes its replicated catalog and its
    /// placement; without them the engine keeps metadata in its store and owns every
    /// shard.
    pub async fn open_parts(parts: EngineParts) -> Result<Self, TallyError> {
        let EngineParts { store, clock, config, catalog, placement } = parts;
        open_format(&*store)?;
        let incarnation = next_incarnation(&*store, clock.now_ms())?;
        let corrections = tally_core::reconcile::CorrectionIds::new(config.node_id.as_str(), &incarnation);
        let drains = tally_core::drain_book::DrainBook::new(config.node_id.as_str(), incarnation);
        let stats = Arc::new(Stats::default());
        let flusher = Flusher::start(store.clone(), stats.clone());
        let catalog: Arc<dyn Catalog> = match catalog {
            Some(c) => c,
            None => Arc::new(LocalCatalog::new(store.clone(), flusher.clone())?),
        };
        let creator = crate::create::Creator::new(catalog.clone(), clock.clone(), config.default_spec);
        let quotas = Arc::new(crate::quota::Quotas::new(&config));
        quotas.recount(&*catalog, clock.now_ms())?;
        let ctx = Arc::new(Ctx {
            engine_id: crate::ctx::next_engine_id(),
            catalog,
            config,
            store,
            clock,
            flusher,
            stats,
            registry: Default::default(),
            rollup_view: Default::default(),
            directory: Default::default(),
            cold: Default::default(),
            dirty: Default::default(),
            resharding: Default::default(),
            reshard_queue: Default::default(),
            reshard_wake: Default::default(),
            placement,
            drains: parking_lot::Mutex::new(drains),
            resending: Default::default(),
            pruning: Default::default(),
            supervisor: OnceLock::new(),
            aggregator: OnceLock::new(),
            rollup: OnceLock::new(),
            closing: Default::default(),
            adopted: Default::default(),
            adopting: Default::default(),
            lost: Default::default(),
            creator,
            quotas,
            created_undrained: Arc::new(tokio::sync::Semaphore::new(crate::ctx::CREATED_UNDRAINED_MAX)),
            auto: Default::default(),
            within_turns: Default::default(),
        });
        crate::reshard::watch(&ctx);
        crate::quota::recount_every_interval(&ctx);
        crate::autoshard::start(&ctx)?;
        let weak = Arc::downgrade(&ctx);
        let (supervisor, _) = Actor::spawn(None, Supervisor, weak.clone()).await.map_err(spawn_err)?;
        let (aggregator, _) = Actor::spawn(None, Aggregator, weak.clone()).await.map_err(spawn_err)?;
        let (rollup, _) = Actor::spawn(None, Rollup, weak.clone()).await.map_err(spawn_err)?;
        let (reconciler, _) = Actor::spawn(None, Reconciler, (weak, corrections)).await.map_err(spawn_err)?;
        let _ = ctx.supervisor.set(supervisor.clone());
        let _ = ctx.aggregator.set(aggregator.clone());
        let _ = ctx.rollup.set(rollup.clone());
        crate::expire::watch(&ctx);
        // Finish what a crash interrupted: deletions, then reshardings.
        // (In a cluster other nodes may not be up yet: what fails here is finished
        // later, by the next write to the counter or the next restart.)
        for (name, _) in ctx.catalog.tombstones()? {
            if let Err(e) = ctx.finish_delete(&name).await {
                tracing::warn!(counter = %name, error = %e, "deleting a counter's data is still pending");
            }
        }
        for name in ctx.catalog.pending_reshards()? {
            if let Err(e) = ctx.runtime(name.as_str(), false).await {
                tracing::warn!(counter = %name, error = %e, "cannot resume a resharding yet");
            }
        }
        Ok(Self { ctx, actors: Arc::new(Actors { supervisor, aggregator, rollup, reconciler }) })
    }

    /// Creates the counter (defaults plus `patch`) or updates the fields `patch`
    /// names. A changed shard count reshards the live counter in the background.
    #[tracing::instrument(level = "debug", skip_all, fields(counter = name))]
    pub async fn put_counter(&self, name: &str, patch: SpecPatch) -> Result<PutOutcome, TallyError> {
        self.put_counter_auto(name, patch, AutoPatch::default()).await
    }

    /// [`Tally::put_counter`], also setting whether the shard count follows
    /// contention: `auto` names `shards: "auto"` and its bounds (a new auto counter
    /// starts at `min_shards`; an existing one is brought into its bounds by its
    /// machine at once, see [`tally_core::autoshard`]); a numeric `patch.shards` makes
    /// an auto counter fixed again.
    #[tracing::instrument(level = "debug", skip_all, fields(counter = name))]
    pub async fn put_counter_auto(
        &self,
        name: &str,
        patch: SpecPatch,
        auto: AutoPatch,
    ) -> Result<PutOutcome, TallyError> {
        let name = CounterName::new(name)?;
        self.reap_if_expired(&name).await?;
        if let Some(asked) = patch.replicas.filter(|r| *r > self.ctx.config.replicas_max) {
            // A count out of 1..=REPLICAS_MAX gets the spec's own answer.
            if asked <= tally_core::ranges::REPLICAS_MAX {
                return Err(TallyError::InvalidSpec(tally_core::spec::SpecError::Unreplicated { asked }));
            }
        }
        self.ctx.finish_delete(&name).await?;
        let current_auto = self.ctx.catalog.auto_shards(name.as_str())?;
        let next_auto = auto.resolve(current_auto, patch.shards)?;
        // Quotas: one more counter, and sketches of the size the spec asks for.
        let current = self.ctx.catalog.get(name.as_str())?;
        let stats = &self.ctx.stats;
        if current.is_none() {
            self.ctx.quotas.admit_counter(&name).inspect_err(|_| stats.quota_counters_refused.inc())?;
        }
        let spec = current.map(|m| m.spec).unwrap_or_default();
        let shards_max = next_auto.map_or(0, |b| b.max_shards);
        let quota = self.ctx.quotas.admit_spec(&name, &spec, &patch, shards_max);
        quota.inspect_err(|_| stats.quota_sketch_bytes_refused.inc())?;
        let put = self.put_checked(name.clone(), patch, current_auto, next_auto).await?;
        if put.created {
            self.ctx.quotas.created(&name);
        }
        Ok(put)
    }

    /// [`Tally::put_counter_auto`] once the quotas let it through.
    async fn put_checked(
        &self,
        name: CounterName,
        patch: SpecPatch,
        current_auto: Option<tally_core::spec::AutoShards>,
        next_auto: Option<tally_core::spec::AutoShards>,
    ) -> Result<PutOutcome, TallyError> {
        if next_auto.is_none() && current_auto.is_none() {
            return self.put_fixed(name, patch).await;
        }
        if next_auto.is_some() {
            let bounded = patch.min.is_some()
                || patch.max.is_some()
                || patch.limit.is_some()
                || self.ctx.catalog.get(name.as_str())?.is_some_and(|m| m.spec.bounded());
            if bounded {
                return Err(TallyError::InvalidSpec(tally_core::spec::SpecError::BoundedAuto));
            }
            crate::autoshard::admit(&self.ctx, &name)?;
        }
        let mut patch = patch;
        if let Some(bounds) = next_auto {
            if self.ctx.catalog.get(name.as_str())?.is_none() {
                patch.shards = Some(bounds.min_shards);
            }
        }
        let (meta, effect) = self
            .ctx
            .catalog
            .apply_auto(&name, &MetaCommand::Put(patch), next_auto, self.ctx.now_ms())
            .await?;
        let meta = meta.expect("a put always leaves a counter");
        let rt = self.ctx.install(name.clone(), meta);
        crate::autoshard::bounds_set(&self.ctx, &name, next_auto, &rt.meta).await;
        // A clamp into new bounds may have started a resharding: report it.
        let meta = self.ctx.catalog.get(name.as_str())?.unwrap_or_else(|| (*rt.meta).clone());
        Ok(PutOutcome { created: effect == MetaEffect::Created, counter: info(&name, &meta, next_auto) })
    }

    async fn put_fixed(&self, name: CounterName, patch: SpecPatch) -> Result<PutOutcome, TallyError> {
        // Sealed generations past their retention make room for a resharding.
        if patch.shards.is_some() {
            if let Some(meta) = self.ctx.catalog.get(name.as_str())? {
                if meta.prune_due(self.ctx.now_ms()) {
                    // Best effort: a node that is down keeps its old shards listed,
                    // and the change below is refused only if no room was made.
                    if let Err(e) = crate::reshard::prune(&self.ctx, &name).await {
                        tracing::warn!(counter = %name, error = %e, "pruning sealed generations failed");
                    }
                }
            }
        }
        let (rt, effect) = self.ctx.apply_meta(&name, &MetaCommand::Put(patch)).await?;
        let rt = rt.expect("a put always leaves a counter");
        Ok(PutOutcome { created: effect == MetaEffect::Created, counter: info(&name, &rt.meta, None) })
    }

    /// The counter's spec and layout (and deadline, if it expires).
    pub async fn counter(&self, name: &str) -> Result<CounterInfo, TallyError> {
        let name = CounterName::new(name)?;
        match self.ctx.catalog.get(name.as_str())? {
            Some(meta) if !self.ctx.expired(&meta) => {
                Ok(info(&name, &meta, self.ctx.catalog.auto_shards(name.as_str())?))
            }
            _ => Err(TallyError::NotFound(name.to_string())),
        }
    }

    /// Reclaims `name` now if it has expired, so a change made next applies to a
    /// counter that exists (or creates it anew).
    async fn reap_if_expired(&self, name: &CounterName) -> Result<(), TallyError> {
        if self.ctx.catalog.get(name.as_str())?.is_some_and(|m| self.ctx.expired(&m)) {
            crate::expire::reap(&self.ctx, name).await?;
        }
        Ok(())
    }

    /// Deletes the counter and all its data. A counter that expired is reclaimed and
    /// answered missing, as Redis's `DEL` answers for an expired key.
    pub async fn delete_counter(&self, name: &str) -> Result<(), TallyError> {
        let name = CounterName::new(name)?;
        if self.ctx.catalog.get(name.as_str())?.is_some_and(|m| self.ctx.expired(&m)) {
            crate::expire::reap(&self.ctx, &name).await?;
            return Err(TallyError::NotFound(name.to_string()));
        }
        let (_, effect) = self.ctx.catalog.apply(&name, &MetaCommand::Delete, self.ctx.now_ms()).await?;
        if effect == MetaEffect::Missing {
            return Err(TallyError::NotFound(name.to_string()));
        }
        self.ctx.forget_deleted(&name);
        self.ctx.finish_delete(&name).await
    }

    /// Sets the counter's deadline to `at_ms` (milliseconds since the Unix epoch) if
    /// `when` allows it, as Redis's `EXPIRE` family does: true if the deadline was
    /// set (a deadline at or before now deletes the counter at once), false if
    /// `when` kept the current one. A missing (or expired) counter is
    /// [`TallyError::NotFound`]. The deadline is counter metadata: replicated and
    /// durable like its spec.
    pub async fn expire(
        &self,
        name: &str,
        at_ms: u64,
        when: tally_core::expiry::Condition,
    ) -> Result<bool, TallyError> {
        let name = CounterName::new(name)?;
        let current = match self.ctx.catalog.get(name.as_str())? {
            Some(m) if !self.ctx.expired(&m) => m,
            Some(_) => {
                crate::expire::reap(&self.ctx, &name).await?;
                return Err(TallyError::NotFound(name.to_string()));
            }
            None => return Err(TallyError::NotFound(name.to_string())),
        };
        if !when.allows(current.expires_at_ms, at_ms) {
            return Ok(false);
        }
        let cmd = MetaCommand::Expire { at_ms, when };
        let (meta, effect) = self.ctx.catalog.apply(&name, &cmd, self.ctx.now_ms()).await?;
        match (meta, effect) {
            (_, MetaEffect::Missing) => Err(TallyError::NotFound(name.to_string())),
            (_, MetaEffect::Deleted(_)) => {
                self.ctx.forget_deleted(&name);
                self.ctx.finish_delete(&name).await?;
                Ok(true)
            }
            (Some(meta), MetaEffect::Updated) => {
                self.ctx.install(name, meta);
                Ok(true)
            }
            // Unchanged: the same deadline (set, as Redis answers), or a change that
            // crossed this one made `when` false.
            (meta, _) => Ok(meta.and_then(|m| m.expires_at_ms) == Some(at_ms)),
        }
    }

    /// Removes the counter's deadline (Redis's `PERSIST`): true if it had one.
    pub async fn persist(&self, name: &str) -> Result<bool, TallyError> {
        let name = CounterName::new(name)?;
        self.reap_if_expired(&name).await?;
        let (meta, effect) = self.ctx.catalog.apply(&name, &MetaCommand::Persist, self.ctx.now_ms()).await?;
        match (meta, effect) {
            (_, MetaEffect::Missing) => Err(TallyError::NotFound(name.to_string())),
            (Some(meta), MetaEffect::Updated) => {
                self.ctx.install(name, meta);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The counter's deadline, if it has one (missing and expired counters are
    /// [`TallyError::NotFound`]), with the time it was read at.
    pub async fn expiry(&self, name: &str) -> Result<(Option<u64>, u64), TallyError> {
        let name = CounterName::new(name)?;
        let now = self.ctx.now_ms();
        match self.ctx.catalog.get(name.as_str())? {
            Some(m) if !tally_core::expiry::expired(m.expires_at_ms, now) => Ok((m.expires_at_ms, now)),
            _ => Err(TallyError::NotFound(name.to_string())),
        }
    }

    /// Delivers what this node buffers for the counter to its shards (Redis's `WAIT`):
    /// whether everything this node acknowledged for it is in its shards now, and
    /// how many copies each of its shards has ([`Tally::copies_of`]).
    pub async fn settle_counter(&self, name: &str) -> Result<(bool, u8), TallyError> {
        let rt = self.ctx.runtime(name, false).await?;
        let settled = self.ctx.deliver_for_read(&rt).await;
        Ok((settled, self.copies_of(rt.meta.spec.replicas)))
    }

    /// How many copies a shard of a counter stating `replicas` has: its own count or
    /// the cluster's (`TallyConfig::replicas_default`), at most one per node.
    pub fn copies_of(&self, replicas: Option<u8>) -> u8 {
        let nodes = self.ctx.placement.as_ref().map_or(1, |p| p.peers().len() + 1);
        let wanted = replicas.unwrap_or(self.ctx.config.replicas_default).max(1);
        wanted.min(u8::try_from(nodes).unwrap_or(u8::MAX))
    }

    /// How many counters exist, and how many of them have a deadline (Redis's
    /// `DBSIZE` and `INFO keyspace`). Expired counters not yet reclaimed are counted
    /// until the sweep reclaims them (within `expiry_sweep_ms`).
    pub fn count_counters(&self) -> Result<(u64, u64), TallyError> {
        self.ctx.catalog.count()
    }

    /// Declares (or replaces) the namespace `prefix`: counters created implicitly
    /// from now on under it (their first increment, a `SET`, after a `DEL` too)
    /// take `spec` (`tally_core::namespace`); the longest matching prefix wins.
    /// Counters that exist keep their specs. True if it was created. Checked as a
    /// creation would check it; replicated and durable like counter metadata.
    pub async fn put_namespace(
        &self,
        prefix: &str,
        spec: tally_core::namespace::NamespaceSpec,
    ) -> Result<bool, TallyError> {
        tally_core::namespace::check_prefix(prefix)?;
        spec.counter_spec()?;
        if let Some(asked) = spec.patch.replicas.filter(|r| *r > self.ctx.config.replicas_max) {
            return Err(TallyError::InvalidSpec(tally_core::spec::SpecError::Unreplicated { asked }));
        }
        let existed = self.ctx.catalog.put_namespace(prefix, spec).await?;
        Ok(!existed)
    }

    /// The namespace `prefix`'s spec.
    pub fn namespace(&self, prefix: &str) -> Result<tally_core::namespace::NamespaceSpec, TallyError> {
        self.ctx
            .catalog
            .namespaces()?
            .get(prefix)
            .copied()
            .ok_or_else(|| TallyError::NamespaceNotFound(prefix.to_owned()))
    }

    /// Every namespace, by prefix.
    pub fn namespaces(&self) -> Result<tally_core::namespace::Namespaces, TallyError> {
        self.ctx.catalog.namespaces()
    }

    /// Drops the namespace `prefix`; counters created under it keep their specs.
    pub async fn delete_namespace(&self, prefix: &str) -> Result<(), TallyError> {
        match self.ctx.catalog.delete_namespace(prefix).await? {
            true => Ok(()),
            false => Err(TallyError::NamespaceNotFound(prefix.to_owned())),
        }
    }

    /// This engine's clock, in milliseconds since the Unix epoch: what deadlines
    /// given as spans (`EXPIRE key 60`) count from.
    pub fn now_ms(&self) -> u64 {
        self.ctx.now_ms()
    }

    /// Counts one increment. An unknown counter is created with the defaults.
    #[tracing::instrument(level = "trace", skip_all, fields(counter = name, delta = inc.delta))]
    pub async fn incr(&self, name: &str, inc: Increment) -> Result<IncrOutcome, TallyError> {
        self.ctx.incr(name, inc).await
    }

    /// Counts many increments, possibly on different counters; one result per item,
    /// in order. Items are independent: one failing does not stop the others.
    pub async fn incr_many(
        &self,
        items: Vec<(String, Increment)>,
    ) -> Result<Vec<Result<IncrOutcome, TallyError>>, TallyError> {
        let max = self.ctx.config.batch_items_max;
        if items.len() > max {
            return Err(TallyError::BatchTooLarge { got: items.len(), max });
        }
        let mut out: Vec<Option<Result<IncrOutcome, TallyError>>> = Vec::with_capacity(items.len());
        let mut tasks = Vec::new();
        // A writer's sequenced items must reach its shard in order, so each writer's
        // (per counter) run one after another in one task.
        let mut sequenced: BTreeMap<(String, String), Vec<(usize, Increment)>> = BTreeMap::new();
        for (i, (name, inc)) in items.into_iter().enumerate() {
            out.push(None);
            if let (Some(_), Some(w)) = (inc.seq, &inc.writer) {
                sequenced.entry((name, w.clone())).or_default().push((i, inc));
                continue;
            }
            let ctx = self.ctx.clone();
            // Items that wait for a shard (sync, event ids) run concurrently, so one
            // group commit serves the whole batch.
            let task = tokio::spawn(async move { vec![ctx.incr(&name, inc).await] });
            tasks.push((vec![i], task));
        }
        for ((name, _), run) in sequenced {
            let ctx = self.ctx.clone();
            let slots = run.iter().map(|(i, _)| *i).collect();
            let task = tokio::spawn(async move {
                let mut answers = Vec::with_capacity(run.len());
                for (_, inc) in run {
                    answers.push(ctx.incr(&name, inc).await);
                }
                answers
            });
            tasks.push((slots, task));
        }
        for (slots, t) in tasks {
            let answers = t.await.unwrap_or_default();
            let mut answers = answers.into_iter();
            for i in slots {
                out[i] = Some(answers.next().unwrap_or(Err(TallyError::ShuttingDown)));
            }
        }
        Ok(out.into_iter().map(|r| r.unwrap_or(Err(TallyError::ShuttingDown))).collect())
    }

    /// The counter's total. `Fresh` first delivers this node's buffered increments,
    /// then sums every shard; `Cached` answers from the rollup.
    #[tracing::instrument(level = "debug", skip_all, fields(counter = name, consistency = ?consistency))]
    pub async fn read(&self, name: &str, consistency: Consistency) -> Result<ValueRead, TallyError> {
        let started = Instant::now();
        let rt = self.ctx.runtime(name, false).await?;
        self.read_rt(name, &rt, consistency, started).await
    }

    /// Counts one increment and reads the counter's total after it, through the
    /// runtime the increment went through (no second lookup of the name or of the
    /// spec): a `sync` counter's fresh total, read once the increment is durable; a
    /// `batched` counter's cached total (fresh without a rollup), which may or may not
    /// include this increment yet. For what Redis's `INCR` answers, see
    /// [`Tally::incr_value`].
    #[tracing::instrument(level = "trace", skip_all, fields(counter = name, delta = inc.delta))]
    pub async fn incr_total(
        &self,
        name: &str,
        inc: Increment,
    ) -> Result<(IncrOutcome, ValueRead), TallyError> {
        let written = self.ctx.write(name, inc, true).await?;
        let started = Instant::now();
        // Buffered: the cached total, if one is at hand, without a message.
        let buffered = written
            .rt
            .as_ref()
            .filter(|rt| written.after.is_none() && rt.meta.spec.durability == Durability::Batched);
        if let Some(read) = buffered.and_then(|rt| self.cached_now(rt)) {
            return Ok((written.outcome, read));
        }
        // Boxed, as the write path is: an answer from memory builds a small future.
        Box::pin(async move {
            let rt = match written.rt {
                Some(rt) => rt,
                None => self.ctx.runtime(name, false).await?,
            };
            let consistency = match rt.meta.spec.durability {
                Durability::Sync => Consistency::Fresh,
                Durability::Batched => Consistency::Cached,
            };
            let read = self.read_rt(name, &rt, consistency, started).await?;
            Ok((written.outcome, read))
        })
        .await
    }

    /// Counts one increment and answers the counter's total right after it: what
    /// Redis's `INCR` answers. The total includes this increment and every increment
    /// this node acknowledged before it, each once, so one client's increments on
    /// one node answer 1, 2, 3, … (`docs/SEMANTICS.md`, "What INCR returns"):
    ///
    /// * a `sync` counter of one shard answers the value the shard's commit gave
    ///   this increment: exact, and unique and gap-free across concurrent increments
    ///   of 1 from any node (ids may be issued from it);
    /// * any other counter answers from this node's ledger (`ledger.rs`): what this
    ///   node acknowledged, over one sum of the shards taken when the counter first
    ///   answered here (and again in the background, in a cluster, while it is older
    ///   than [`crate::LEDGER_REFRESH_MS`]). It costs no read per increment: a
    ///   buffered increment answers from memory.
    pub async fn incr_value(
        &self,
        name: &str,
        inc: Increment,
    ) -> Result<(IncrOutcome, IncrTotal), TallyError> {
        let written = self.ctx.write(name, inc, true).await?;
        if let Some(total) = written.rt.as_ref().and_then(|rt| self.answer(rt, written.after)) {
            return Ok((written.outcome, total));
        }
        // Boxed, as the write path is: an answer from memory builds a small future.
        Box::pin(async move {
            let rt = match written.rt {
                Some(rt) => rt,
                None => self.ctx.runtime(name, false).await?,
            };
            Ok((written.outcome, self.answer_or_read(&rt, written.after).await?))
        })
        .await
    }

    /// The counter's total as this node's `INCR` answers would see it now (Redis's
    /// `GET`): every increment this node acknowledged, each once, over the ledger's
    /// base (read first if the counter has none here yet). Exact on a single node;
    /// in a cluster, other nodes' increments show as of the base, which is read
    /// again in the background while it is older than [`crate::LEDGER_REFRESH_MS`].
    /// Unlike a cached read it never misses an increment this node acknowledged
    /// before it, so a client that increments and then reads sees its increment.
    pub async fn current_total(&self, name: &str) -> Result<IncrTotal, TallyError> {
        let rt = self.ctx.runtime(name, false).await?;
        self.answer_or_read(&rt, None).await
    }

    /// [`Tally::answer`], reading the ledger's base first when it has none.
    async fn answer_or_read(
        &self,
        rt: &Arc<crate::runtime::CounterRuntime>,
        after: Option<i64>,
    ) -> Result<IncrTotal, TallyError> {
        if let Some(total) = self.answer(rt, after) {
            return Ok(total);
        }
        if let Err(missing) = rt.ledger.take_base(&self.ctx, rt, false).await? {
            return Ok(IncrTotal::Incomplete(missing));
        }
        Ok(self.answer(rt, after).expect("a base was just taken"))
    }

    /// The total right after an increment through `rt` whose shard was left at
    /// `after` (when it was written directly): the shard's own value on a `sync`
    /// counter of one shard, else the ledger's answer; `None` while the ledger has
    /// no base.
    fn answer(&self, rt: &Arc<crate::runtime::CounterRuntime>, after: Option<i64>) -> Option<IncrTotal> {
        let meta = &rt.meta;
        let one_shard = meta.layout.shards == 1 && meta.layout.resharding.is_none();
        if let Some(after) = after.filter(|_| one_shard && meta.spec.durability == Durability::Sync) {
            let value = meta.spec.clamp(meta.layout.base + i128::from(after));
            return Some(IncrTotal::Total(Total { value, exact: true }));
        }
        // What a replaced runtime acknowledged is in the ledger; the current one's
        // slots hold the rest.
        let current = if rt.carried.load(SeqCst) {
            self.ctx
                .registry
                .get(rt.name.as_str())
                .map(|r| r.clone())
                .filter(|r| Arc::ptr_eq(&r.ledger, &rt.ledger))
                .unwrap_or_else(|| rt.clone())
        } else {
            rt.clone()
        };
        let answer = rt.ledger.answer(rt.ledger.acked(&current))?;
        let alone = self.ctx.placement.is_none();
        if !alone && rt.ledger.claim_refresh(self.ctx.now_ms()) {
            crate::ledger::Ledger::refresh(&self.ctx, &current);
        }
        let value = meta.spec.clamp(answer.value);
        Some(IncrTotal::Total(Total { value, exact: answer.exact && alone }))
    }

    /// A resolved handle on the counter (created with the defaults if unknown, like a
    /// first increment): increments through it skip the name lookup. See
    /// [`CounterHandle`].
    pub async fn handle(&self, name: &str) -> Result<CounterHandle, TallyError> {
        let rt = self.ctx.runtime(name, true).await?;
        Ok(CounterHandle { ctx: self.ctx.clone(), rt })
    }

    /// Drops a deleted counter's cached total: at once from what readers see, so no
    /// read after the deletion answers it, then from the rollup.
    fn forget_cached(&self, name: CounterName) {
        self.ctx.rollup_view.forget(&name);
        let _ = self.actors.rollup.send_message(RollupMsg::Forget(name));
    }

    /// The rollup's cached total of `rt`'s counter, if it has a rollup and the total
    /// is cached: read without a message or a wait. Its latency is recorded as 0 µs
    /// without timing it: a lookup and a copy take well under a microsecond, and two
    /// clock reads would cost more than the read.
    fn cached_now(&self, rt: &crate::runtime::CounterRuntime) -> Option<ValueRead> {
        self.cached(rt, |view, name| view.get(name, self.ctx.now_ms()))
    }

    /// `answer` of the rollup's view, if `rt`'s counter has a rollup and its total
    /// is cached; counted as a cached read.
    fn cached<T>(
        &self,
        rt: &crate::runtime::CounterRuntime,
        answer: impl FnOnce(&crate::rollup::RollupView, &CounterName) -> Option<T>,
    ) -> Option<T> {
        if rt.meta.spec.rollup_ms == 0 {
            return None;
        }
        let found = answer(&self.ctx.rollup_view, &rt.name)?;
        self.ctx.stats.reads_cached.inc();
        self.ctx.stats.read_cached_us.record(0);
        Some(found)
    }

    async fn read_rt(
        &self,
        name: &str,
        rt: &Arc<crate::runtime::CounterRuntime>,
        consistency: Consistency,
        started: Instant,
    ) -> Result<ValueRead, TallyError> {
        let read = if consistency == Consistency::Cached && rt.meta.spec.rollup_ms > 0 {
            if let Some(read) = self.cached_now(rt) {
                return Ok(read);
            }
            // Not cached yet: the rollup reads it (once) and caches it.
            let (tx, rx) = ractor::concurrency::oneshot();
            self.actors
                .rollup
                .send_message(RollupMsg::Get { name: rt.name.clone(), reply: tx.into() })
                .map_err(|_| TallyError::ShuttingDown)?;
            let r = tokio::time::timeout(Duration::from_millis(self.ctx.config.call_timeout_ms), rx)
                .await
                .map_err(|_| TallyError::Unavailable {
                    shard: tally_core::name::quoted(name),
                    reason: "rollup timed out".into(),
                })?
                .map_err(|_| TallyError::ShuttingDown)??;
            self.ctx.stats.reads_cached.inc();
            self.ctx.stats.read_cached_us.record(started.elapsed().as_micros() as u64);
            r
        } else {
            let r = crate::read::fresh_shared(&self.ctx, rt).await?;
            self.ctx.stats.reads_fresh.inc();
            self.ctx.stats.read_fresh_us.record(started.elapsed().as_micros() as u64);
            r
        };
        Ok(read)
    }

    /// The estimated number of distinct members (counters with `distinct`).
    pub async fn distinct(&self, name: &str) -> Result<DistinctRead, TallyError> {
        let rt = self.ctx.runtime(name, false).await?;
        let settled = self.ctx.deliver_for_read(&rt).await;
        let mut read = crate::read::distinct(&self.ctx, &rt.meta, &rt.name).await?;
        read.complete &= settled;
        Ok(read)
    }

    /// The distinct-member estimate of the union of several counters' members (Redis's
    /// `PFCOUNT` of several keys): their sketches merged register by register, which
    /// loses nothing. A counter that does not exist adds no member; one without
    /// `distinct` is [`TallyError::NotDistinct`].
    pub async fn distinct_union(&self, names: &[String]) -> Result<DistinctRead, TallyError> {
        let mut union = tally_core::sketch::DistinctSketch::new();
        let (mut complete, mut missing_shards, mut counter_bytes) = (true, Vec::new(), 0);
        for name in names {
            let rt = match self.ctx.runtime(name, false).await {
                Ok(rt) => rt,
                Err(TallyError::NotFound(_)) => continue,
                Err(e) => return Err(e),
            };
            if !rt.meta.spec.distinct {
                return Err(TallyError::NotDistinct(name.clone()));
            }
            let settled = self.ctx.deliver_for_read(&rt).await;
            let (sketch, bytes, missing, current) =
                crate::read::distinct_sketch(&self.ctx, &rt.meta, &rt.name).await?;
            union.merge(&sketch);
            counter_bytes += bytes;
            complete &= settled && current && missing.is_empty();
            missing_shards.extend(missing);
        }
        Ok(DistinctRead {
            estimate: union.estimate(),
            relative_error: tally_core::sketch::DistinctSketch::relative_error(),
            sketch_bytes: union.encoded_len() as u64,
            counter_bytes,
            complete,
            missing_shards,
        })
    }

    /// Merges the distinct members of `sources` into `dest` (Redis's `PFMERGE`): the
    /// union of their sketches is merged into one shard of `dest`'s current
    /// generation (register-wise, so merging again changes nothing). `dest` must keep
    /// distinct members. Answers whether every source's shards answered.
    pub async fn merge_distinct(&self, dest: &str, sources: &[String]) -> Result<bool, TallyError> {
        let union = self.distinct_union(sources).await?;
        let complete = union.complete;
        let mut merged = tally_core::sketch::DistinctSketch::new();
        for name in sources {
            if let Ok(rt) = self.ctx.runtime(name, false).await {
                merged.merge(&crate::read::distinct_sketch(&self.ctx, &rt.meta, &rt.name).await?.0);
            }
        }
        let rt = self.ctx.runtime(dest, false).await?;
        if !rt.meta.spec.distinct {
            return Err(TallyError::NotDistinct(dest.to_owned()));
        }
        if merged.estimate() == 0 {
            return Ok(complete);
        }
        let id = rt.meta.shard_id(&rt.name, rt.meta.layout.generation, 0);
        self.ctx.merge_sketch(&id, Some(merged.to_bytes()), None, None).await?;
        Ok(complete)
    }

    /// Replaces `dest`'s frequencies with the sum of `sources`' (each counted `weight`
    /// times), as RedisBloom's `CMS.MERGE`: every counter must keep frequencies of
    /// `dest`'s shape. `dest` is deleted and created anew with its spec, then the sum
    /// is carried into one of its shards, so its earlier frequencies (and total) are
    /// gone unless it is among the sources. Not atomic: a crash between the two
    /// steps leaves `dest` empty.
    pub async fn merge_frequencies(&self, dest: &str, sources: &[(String, u64)]) -> Result<(), TallyError> {
        let target = self.ctx.runtime(dest, false).await?;
        let Some(shape) = target.meta.spec.frequency else {
            return Err(TallyError::FrequencyOff(dest.to_owned()));
        };
        let mut sum = tally_core::frequency::FrequencySketch::new(&shape)
            .map_err(|e| TallyError::InvalidSpec(e.into()))?;
        for (name, weight) in sources {
            let rt = self.ctx.runtime(name, false).await?;
            if rt.meta.spec.frequency != Some(shape) {
                return Err(TallyError::Namespace(format!(
                    "CMS: {} keeps frequencies of another shape than {}: only sketches of one width and depth merge",
                    tally_core::name::quoted(name),
                    tally_core::name::quoted(dest)
                )));
            }
            self.ctx.deliver_for_read(&rt).await;
            let (sketch, _, missing, _) = crate::read::frequencies(&self.ctx, &rt.meta, &rt.name).await?;
            if !missing.is_empty() {
                return Err(TallyError::Unavailable {
                    shard: tally_core::name::quoted(name),
                    reason: format!("shards {missing:?} did not answer: a partial sketch would be merged"),
                });
            }
            sum.merge(&sketch.scaled(*weight)).map_err(|e| TallyError::InvalidSpec(e.into()))?;
        }
        let spec = target.meta.spec;
        let patch = SpecPatch {
            shards: Some(spec.shards),
            durability: Some(spec.durability),
            flush_ms: Some(spec.flush_ms),
            rollup_ms: Some(spec.rollup_ms),
            router: Some(spec.router),
            distinct: Some(spec.distinct),
            dedup_window_s: Some(spec.dedup_window_s),
            frequency: spec.frequency,
            windows: Some(spec.windows),
            min: spec.min,
            max: spec.max,
            limit: spec.limit,
            replicas: spec.replicas,
        };
        self.delete_counter(dest).await?;
        self.put_counter(dest, patch).await?;
        let rt = self.ctx.runtime(dest, false).await?;
        let id = rt.meta.shard_id(&rt.name, rt.meta.layout.generation, 0);
        self.ctx.merge_sketch(&id, None, Some(sum.to_bytes()), None).await
    }

    /// One of the counter's sliding windows (`"1h"`, `"60m"`: any spelling of a kept
    /// window), merged over every shard at this node's clock, with its bucket width and
    /// span. Like every fresh read, this node's buffered increments for the counter are
    /// delivered first, and shards that did not answer are listed. A window the counter
    /// does not keep is refused ([`TallyError::Window`], `unknown_window`).
    pub async fn window(&self, name: &str, window: &str) -> Result<WindowRead, TallyError> {
        let rt = self.ctx.runtime(name, false).await?;
        rt.meta.spec.windows.find(window)?;
        let settled = self.ctx.deliver_for_read(&rt).await;
        let mut read = crate::read::window(&self.ctx, &rt.meta, &rt.name, window).await?;
        read.complete &= settled;
        Ok(read)
    }

    /// `item`'s estimated frequency — the summed deltas of the increments that named it
    /// — merged over every shard, with its error bound and confidence (counters with
    /// `frequency`). Like every fresh read, this node's buffered increments for the
    /// counter are delivered first, and shards that did not answer are listed.
    pub async fn frequency(&self, name: &str, item: &str) -> Result<FrequencyRead, TallyError> {
        check_len("item", item, MEMBER_LEN_MAX)?;
        let rt = self.ctx.runtime(name, false).await?;
        let settled = self.ctx.deliver_for_read(&rt).await;
        let mut read = crate::read::frequency(&self.ctx, &rt.meta, &rt.name, item).await?;
        read.complete &= settled;
        Ok(read)
    }

    /// The `k` (1 to [`tally_core::frequency::TOP_K_MAX`]) heaviest items, merged over
    /// every shard, each with its estimate and a certain lower bound.
    pub async fn top(&self, name: &str, k: u32) -> Result<TopRead, TallyError> {
        if k == 0 || k > TOP_K_MAX {
            return Err(TallyError::TopK { got: u64::from(k), max: TOP_K_MAX });
        }
        let rt = self.ctx.runtime(name, false).await?;
        let settled = self.ctx.deliver_for_read(&rt).await;
        let mut read = crate::read::top(&self.ctx, &rt.meta, &rt.name, k).await?;
        read.complete &= settled;
        Ok(read)
    }

    /// How many counters with `shards: "auto"` this engine follows, and their
    /// current shard counts summed (bounded metrics, whatever the number of counters).
    pub fn auto_totals(&self) -> (u64, u64) {
        let names = self.ctx.auto.names();
        let shards = names
            .iter()
            .filter_map(|n| self.ctx.catalog.get(n.as_str()).ok().flatten())
            .map(|m| u64::from(m.layout.shards))
            .sum();
        (names.len() as u64, shards)
    }

    /// Per-shard values and write skew.
    pub async fn shards(&self, name: &str) -> Result<ShardsReport, TallyError> {
        let rt = self.ctx.runtime(name, false).await?;
        self.ctx.deliver_for_read(&rt).await;
        crate::read::shards(&self.ctx, &rt).await
    }

    /// Write skew (hottest shard ÷ mean, see [`crate::skew`]) of the counters active on
    /// this node, from the increments routed here while each has been active: the
    /// `limit` busiest counters, busiest first. Costs no store or network access.
    pub fn write_skews(&self, limit: usize) -> Vec<(CounterName, f64, u64)> {
        let mut all: Vec<(CounterName, f64, u64)> = self
            .ctx
            .registry
            .iter()
            .filter_map(|rt| {
                let writes: Vec<u64> = rt.slots.iter().map(|s| s.writes.load(Relaxed)).collect();
                let total: u64 = writes.iter().sum();
                (total > 0).then(|| (rt.name.clone(), crate::read::skew(writes.into_iter()), total))
            })
            .collect();
        all.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        all.truncate(limit);
        all
    }

    /// One page of the counters whose names start with `prefix`, after the cursor
    /// `after` (the `next` of the previous page), at most `limit` (1 to
    /// [`crate::LIST_PAGE_COUNTERS_MAX`]) names in byte order. Reads this node's
    /// applied metadata only, so its cost is bounded by `limit`.
    pub fn list_counters(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<crate::CounterPage, TallyError> {
        crate::list::list(self.ctx.catalog.as_ref(), prefix, after, limit, self.ctx.now_ms())
    }

    /// Brings the counter to `authoritative` by writing the drift as a correction,
    /// a run of its own (`tally_core::reconcile`).
    #[tracing::instrument(level = "debug", skip_all, fields(counter = name, authoritative))]
    pub async fn reconcile(&self, name: &str, authoritative: i128) -> Result<ReconcileReport, TallyError> {
        self.reconcile_as(name, authoritative, None).await
    }

    /// Sets the counter's total to `value` (Redis's `SET key value`): an absolute
    /// write, made as a reconciliation run of its own (its correction's id is the
    /// run's, so a second `SET` that finds the same totals is a second correction,
    /// never a duplicate of the first). Writing it again leaves the same total, so a
    /// `SET` retried after a lost answer is safe; increments that race with it count
    /// after it or are absorbed by it, as with Redis. Creates an unknown counter
    /// first, as an increment would (its namespace's spec).
    pub async fn set_total(&self, name: &str, value: i128) -> Result<ReconcileReport, TallyError> {
        self.ctx.runtime(name, true).await?;
        self.reconcile_as(name, value, None).await
    }

    /// Creates the counter as its first increment would (its namespace's spec, or
    /// the node's default), unless it exists.
    pub async fn ensure(&self, name: &str) -> Result<(), TallyError> {
        self.ctx.runtime(name, true).await.map(|_| ())
    }

    /// [`Tally::reconcile`] as the run of a scheduled `source` at `instant_ms`: every
    /// node that runs that instant writes the same correction, so two of them write
    /// it once ([`tally_core::reconcile::scheduled_correction_id`]).
    pub async fn reconcile_scheduled(
        &self,
        name: &str,
        authoritative: i128,
        source: &str,
        instant_ms: u64,
    ) -> Result<ReconcileReport, TallyError> {
        let id = tally_core::reconcile::scheduled_correction_id(source, instant_ms);
        self.reconcile_as(name, authoritative, Some(id)).await
    }

    async fn reconcile_as(
        &self,
        name: &str,
        authoritative: i128,
        event_id: Option<String>,
    ) -> Result<ReconcileReport, TallyError> {
        let name = CounterName::new(name)?;
        // A run of its own goes to the owner of the counter's first shard, where the
        // runs of the counter go one at a time: two runs here and there would each
        // correct from the same total. A scheduled run is named by its instant, so
        // its correction counts once wherever it runs.
        if event_id.is_none() {
            let rt = self.ctx.runtime(name.as_str(), false).await?;
            let id = rt.meta.shard_id(&name, rt.meta.layout.generation, 0);
            if let Some((placement, owner)) = self.ctx.remote(&id) {
                let request =
                    ShardRequest::Reconcile { id: id.clone(), meta_version: rt.meta.version, authoritative };
                let report = match placement.call(&owner, request).await? {
                    ShardResponse::Reconciled(report) => report,
                    ShardResponse::DriftOutOfRange { before } => {
                        let drift = authoritative.saturating_sub(before);
                        crate::reconciler::record_drift(&self.ctx, &name, drift);
                        return Err(crate::reconciler::correction(authoritative, before)
                            .expect_err("the owner found the drift beyond one correction"));
                    }
                    other => return Err(crate::placement::unexpected(&owner, &id, other)),
                };
                crate::reconciler::record_drift(&self.ctx, &name, report.drift);
                self.forget_base(&name, &report);
                return Ok(report);
            }
        }
        self.reconcile_here(name, authoritative, event_id).await
    }

    /// Runs a reconciliation on this node's reconciler.
    async fn reconcile_here(
        &self,
        name: CounterName,
        authoritative: i128,
        event_id: Option<String>,
    ) -> Result<ReconcileReport, TallyError> {
        let (tx, rx) = ractor::concurrency::oneshot();
        let msg = ReconcilerMsg::Reconcile { name: name.clone(), authoritative, event_id, reply: tx.into() };
        self.actors.reconciler.send_message(msg).map_err(|_| TallyError::ShuttingDown)?;
        let report = rx.await.map_err(|_| TallyError::ShuttingDown)?;
        if let Ok(r) = &report {
            self.forget_base(&name, r);
        }
        report
    }

    /// After a correction, which is no increment of this node's, `INCR` answers read
    /// the shards again before they count on.
    fn forget_base(&self, name: &CounterName, report: &ReconcileReport) {
        if report.corrected {
            if let Some(rt) = self.ctx.registry.get(name.as_str()) {
                rt.ledger.forget_base();
            }
        }
    }

    /// The engine's shared state, for the `impl Tally` blocks of other modules.
    pub(crate) fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// Waits until every resharding in progress on this node has completed.
    pub async fn settle(&self) {
        while !self.ctx.resharding.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The engine's operational signals.
    pub fn stats(&self) -> &Stats {
        &self.ctx.stats
    }

    /// Acknowledged batched increments in sums drained towards their shards and not
    /// yet confirmed (they are resent until they are).
    pub fn in_doubt_increments(&self) -> u64 {
        self.ctx.drains.lock().in_doubt_increments()
    }

    /// Counters with in-memory state on this node, and running shard actors.
    pub fn active(&self) -> (usize, usize) {
        (self.ctx.registry.len(), self.ctx.directory.len())
    }

    /// The store this engine writes to.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.ctx.store
    }

    /// Stops taking writes, delivers every buffered increment, flushes the store and
    /// stops the actors. If some acknowledged buffered increments could not be
    /// delivered (their shards' nodes did not answer), everything else still shuts
    /// down and the answer is an error that says how many.
    pub async fn shutdown(&self) -> Result<(), TallyError> {
        if self.ctx.closing.swap(true, SeqCst) {
            return Ok(());
        }
        self.ctx.reshard_wake.notify_one();
        let (tx, rx) = ractor::concurrency::oneshot();
        let mut undelivered = 0;
        if self.actors.aggregator.send_message(AggregatorMsg::FlushAll { reply: tx.into() }).is_ok() {
            undelivered = rx.await.unwrap_or(0);
        }
        let wait = Some(Duration::from_millis(SHUTDOWN_WAIT_MS));
        self.actors.supervisor.drain_children_and_wait(wait).await;
        // A creation no drain wrote (its increment took another path) is written and
        // made durable too.
        self.ctx.catalog.write_deferred().await?;
        self.ctx.flusher.flush().await?;
        // Wait for the actors to end, so their references to the engine (and so to
        // the store) are gone when this returns: dropping the last handle then
        // closes the store, and it can be reopened at once.
        for cell in [
            self.actors.aggregator.get_cell(),
            self.actors.rollup.get_cell(),
            self.actors.reconciler.get_cell(),
            self.actors.supervisor.get_cell(),
        ] {
            let _ = cell.stop_and_wait(None, wait).await;
        }
        if undelivered > 0 {
            return Err(TallyError::Unavailable {
                shard: "engine".into(),
                reason: format!(
                    "{undelivered} acknowledged buffered increments undelivered: their shards did not answer \
                     within {}ms of the shutdown",
                    crate::aggregator::SHUTDOWN_DELIVER_MS
                ),
            });
        }
        Ok(())
    }
}

impl Tally {
    /// Serves a request another node sent to this node's shards (the cluster layer
    /// carries it here). Errors travel back as [`ShardResponse::Failed`].
    pub async fn serve_shard_request(&self, request: ShardRequest) -> ShardResponse {
        // Hand-offs go between a shard's previous and new owners; every other request
        // is for its owner, and a sender with an older view learns the owner here
        // (as data, so that it can go there next) and retries.
        let for_owner = !matches!(request, ShardRequest::HandOff { .. } | ShardRequest::Adopt { .. });
        if let Some(id) = request.shard().filter(|_| for_owner) {
            if let Some((_, owner)) = self.ctx.remote(id) {
                let reason = format!("{owner} owns it now (this node has applied a newer membership)");
                return crate::placement::failed(&crate::error::unavailable(id, &reason), Some(owner));
            }
        }
        match self.serve(request).await {
            Ok(r) => r,
            Err(e) => crate::placement::failed(&e, None),
        }
    }

    async fn serve(&self, request: ShardRequest) -> Result<ShardResponse, TallyError> {
        let ctx = &self.ctx;
        match request {
            ShardRequest::HandOff { id, epoch, after } => {
                let handed = crate::handoff::hand_off(ctx, &id, epoch, after.as_deref()).await?;
                let tally_core::handoff_machine::HandOffPage { image, records, more, sealed } = handed;
                Ok(ShardResponse::HandedOff { image, records, more, sealed })
            }
            ShardRequest::Adopt { id, epoch } => {
                crate::handoff::adopt(ctx, &id, epoch).await?;
                Ok(ShardResponse::Done)
            }
            ShardRequest::Submit { id, meta_version, born_ms, sub } => {
                let rt = ctx.meta_at_least(&id.counter, meta_version).await?;
                let rt = ctx.check_serves(&id, born_ms, Some(&rt.meta)).await?.unwrap_or(rt);
                if rt.meta.created_at_ms != born_ms {
                    // The group's latest names the sender's counter, which this node
                    // has not applied yet: decided here, it would follow the other's spec.
                    return Err(crate::error::unavailable(
                        &id,
                        "this node has not applied the counter's creation yet",
                    ));
                }
                let rx = ctx.send(&id, &rt.meta, sub, crate::ctx::Sender::Peer).await?;
                Ok(ShardResponse::Reply(ctx.await_reply(&id, rx).await?))
            }
            ShardRequest::Read { id, born_ms } => {
                ctx.check_serves(&id, born_ms, None).await?;
                let read = ctx.read_shard(&id, born_ms).await?;
                ctx.flusher.make_durable().await?;
                Ok(ShardResponse::Read { image: read.image, sealed: read.sealed })
            }
            ShardRequest::Seal { id, meta_version } => {
                let rt = ctx.meta_at_least(&id.counter, meta_version).await?;
                Ok(ShardResponse::Image(ctx.seal_local(&id, &rt.meta).await?))
            }
            ShardRequest::DedupGet { id, event_id } => {
                Ok(ShardResponse::Record(ctx.dedup_get(&id, &event_id).await?))
            }
            ShardRequest::Delete { id, prune_of } => {
                if ctx.check_deletable(&id, prune_of).is_err() {
                    // This node's view may lag the sender's (a deletion it has not
                    // applied yet): judge by the group's latest metadata instead.
                    let latest = ctx.catalog.current(id.counter.as_str()).await?;
                    ctx.check_deletable_by(&id, prune_of, latest.as_ref())?;
                }
                ctx.delete_local(&id).await?;
                ctx.flusher.flush().await?;
                Ok(ShardResponse::Done)
            }
            ShardRequest::MergeSketch { id, sketch, frequency, windows } => {
                ctx.merge_sketch_local(&id, sketch, frequency, windows).await?;
                Ok(ShardResponse::Done)
            }
            ShardRequest::Escrow { id, meta_version, message } => {
                let rt = ctx.meta_at_least(&id.counter, meta_version).await?;
                ctx.escrow_local(&id, &rt.meta, message).await?;
                Ok(ShardResponse::Done)
            }
            ShardRequest::AutoView { counter } => {
                Ok(ShardResponse::AutoView(crate::autoshard::view(ctx, counter.as_str())))
            }
            ShardRequest::Reconcile { id, meta_version, authoritative } => {
                ctx.meta_at_least(&id.counter, meta_version).await?;
                match self.reconcile_here(id.counter, authoritative, None).await {
                    Ok(report) => Ok(ShardResponse::Reconciled(report)),
                    Err(TallyError::DriftOutOfRange { before, .. }) => {
                        Ok(ShardResponse::DriftOutOfRange { before })
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Marks whether this node's shards may lack values it lost (a replaced disk):
    /// while set, reads of them are refused, so reads report them missing.
    pub fn set_data_lost(&self, lost: bool) {
        self.ctx.lost.set(lost);
    }

    /// Whether this node's shards are marked as having lost data.
    pub fn data_lost(&self) -> bool {
        self.ctx.lost.get()
    }

    /// Hands every shard this node holds but no longer owns at placement epoch
    /// `epoch` to its new owner, deleting each copy once the owner has it durably.
    /// A report with failures is retried by calling again.
    pub async fn hand_off_foreign(&self, epoch: u64) -> Result<HandoffReport, TallyError> {
        crate::handoff::hand_off_foreign(&self.ctx, epoch).await
    }

    /// Tells the engine that a counter's metadata changed in a replicated catalog (on
    /// another node, say): its runtime is rebuilt from the new metadata, or dropped if
    /// the counter was deleted.
    pub async fn metadata_changed(&self, name: &str) -> Result<(), TallyError> {
        let name = CounterName::new(name)?;
        match self.ctx.catalog.get(name.as_str())? {
            Some(meta) => {
                if self.ctx.registry.contains_key(name.as_str()) || meta.layout.resharding.is_some() {
                    self.ctx.install(name, meta);
                }
            }
            None => {
                if let Some((_, rt)) = self.ctx.registry.remove(name.as_str()) {
                    rt.retired.store(true, SeqCst);
                }
                self.forget_cached(name);
            }
        }
        Ok(())
    }

    /// Stops the engine at once, as a crash would: buffered increments are dropped,
    /// nothing more is written or flushed, and waiting callers see errors. For crash
    /// tests and simulations; production code calls [`Tally::shutdown`].
    pub fn abort(&self) {
        self.ctx.closing.store(true, SeqCst);
        self.ctx.reshard_wake.notify_one();
        let mut shards: Vec<(tally_core::ShardId, ActorRef<crate::messages::ShardMsg>)> =
            self.ctx.directory.iter().map(|e| (e.key().clone(), e.value().clone())).collect();
        shards.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, actor) in shards {
            actor.stop(None);
        }
        for cell in [
            self.actors.aggregator.get_cell(),
            self.actors.rollup.get_cell(),
            self.actors.reconciler.get_cell(),
            self.actors.supervisor.get_cell(),
        ] {
            cell.stop(None);
        }
    }
}

/// The store key of the number of times an engine opened this store.
const OPENS_KEY: &[u8] = b"engine:opens";

/// The store key of the store's format marker ([`tally_core::format`]).
pub const STORE_FORMAT_KEY: &[u8] = b"store:format";

/// Refuses a store of a format this release does not read, upgrades one of an older
/// format in place (one atomic rewrite of the records whose layout changed, marker
/// included), and marks a new or unmarked one with this release's format, before
/// anything else is written. A store that an engine opened before holds data, so its
/// missing marker means the first format.
fn open_format(store: &dyn Store) -> Result<(), TallyError> {
    use tally_core::format::{
        encode_version, judge_store, v1, v2, v3, v4, v5, v6, v8, STORE_FORMAT, STORE_FORMATS_READABLE,
    };
    let marker = store.meta_get(STORE_FORMAT_KEY)?;
    let holds_data = store.meta_get(OPENS_KEY)?.is_some();
    let verdict = judge_store("engine store", marker.as_deref(), holds_data, STORE_FORMATS_READABLE)
        .map_err(tally_store::StoreError::from)?;
    if !verdict.write_marker {
        return Ok(());
    }
    let current = encode_version(STORE_FORMAT);
    if !holds_data {
        // Made durable by the flush that follows in `next_incarnation`.
        store.meta_put(STORE_FORMAT_KEY, &current)?;
        return Ok(());
    }
    // Format 1's images and catalog entries lack format 2's fields; the sketches in
    // the images of formats 1 and 2 are in format 2's encoding; the images and
    // catalog entries of formats 2 and 3 lack format 4's windows; those of format 4
    // lack format 5's bounds and escrow ledger; format 5's catalog entries lack format
    // 6's window limit (its shard images are today's); the catalog entries of formats
    // 6 and 7 lack format 8's replica count (format 7 only let an image carry records;
    // their images are today's); those of format 8 lack format 9's expiry. Each
    // rewrite goes straight to today's records.
    let plan = match verdict.found {
        1 => tally_store::Upgrade {
            shard_image: Some(&v2::upgrade_shard_image_from_v1),
            meta: vec![(crate::catalog::COUNTER_PREFIX, &v1::upgrade_counter_meta)],
            marker: (STORE_FORMAT_KEY, &current),
        },
        2 => tally_store::Upgrade {
            shard_image: Some(&v2::upgrade_shard_image),
            meta: vec![(crate::catalog::COUNTER_PREFIX, &v3::upgrade_counter_meta)],
            marker: (STORE_FORMAT_KEY, &current),
        },
        3 => tally_store::Upgrade {
            shard_image: Some(&v3::upgrade_shard_image),
            meta: vec![(crate::catalog::COUNTER_PREFIX, &v3::upgrade_counter_meta)],
            marker: (STORE_FORMAT_KEY, &current),
        },
        4 => tally_store::Upgrade {
            shard_image: Some(&v4::upgrade_shard_image),
            meta: vec![(crate::catalog::COUNTER_PREFIX, &v4::upgrade_counter_meta)],
            marker: (STORE_FORMAT_KEY, &current),
        },
        5 => tally_store::Upgrade {
            shard_image: None,
            meta: vec![(crate::catalog::COUNTER_PREFIX, &v5::upgrade_counter_meta)],
            marker: (STORE_FORMAT_KEY, &current),
        },
        6 | 7 => tally_store::Upgrade {
            shard_image: None,
            meta: vec![(crate::catalog::COUNTER_PREFIX, &v6::upgrade_counter_meta)],
            marker: (STORE_FORMAT_KEY, &current),
        },
        found => {
            assert_eq!(found, 8, "readable formats are 1..={STORE_FORMAT}");
            tally_store::Upgrade {
                shard_image: None,
                meta: vec![(crate::catalog::COUNTER_PREFIX, &v8::upgrade_counter_meta)],
                marker: (STORE_FORMAT_KEY, &current),
            }
        }
    };
    let rewritten = store.upgrade(&plan)?;
    tracing::info!(from = verdict.found, to = STORE_FORMAT, rewritten, "upgraded the store's format");
    Ok(())
}

/// The store key of the clock reading at which an engine first opened this store.
const BORN_KEY: &[u8] = b"engine:born_ms";

fn read_u64(store: &dyn Store, key: &'static [u8], what: &'static str) -> Result<Option<u64>, TallyError> {
    let Some(b) = store.meta_get(key)? else { return Ok(None) };
    let bytes: [u8; 8] = b.as_slice().try_into().map_err(|_| tally_store::StoreError::Corrupt {
        location: String::from_utf8_lossy(key).into_owned(),
        source: tally_core::codec::DecodeError { what, reason: format!("{} bytes", b.len()) },
    })?;
    Ok(Some(u64::from_be_bytes(bytes)))
}

/// Counts this opening of `store` and returns this life's incarnation, made durable
/// before any drain id that carries it is sent: the clock reading at which the store
/// was created and the number of times it was opened. The count alone never repeats
/// for one store; the birth keeps a node that comes back with an empty data
/// directory (a new store, counting from 1 again) from sending drain ids its earlier
/// store sent, which shards elsewhere still remember and would drop as repeats.
fn next_incarnation(store: &dyn Store, now_ms: u64) -> Result<String, TallyError> {
    let next = read_u64(store, OPENS_KEY, "open count")?.unwrap_or(0) + 1;
    let born = match read_u64(store, BORN_KEY, "birth time")? {
        Some(born) => born,
        None if next == 1 => {
            store.meta_put(BORN_KEY, &now_ms.to_be_bytes())?;
            now_ms
        }
        // A store first opened before the birth was recorded.
        None => 0,
    };
    store.meta_put(OPENS_KEY, &next.to_be_bytes())?;
    store.flush()?;
    Ok(format!("{born}.{next}"))
}

fn info(name: &CounterName, meta: &tally_core::meta::CounterMeta, auto: Option<AutoShards>) -> CounterInfo {
    CounterInfo {
        name: name.to_string(),
        spec: meta.spec,
        generation: meta.layout.generation,
        layout_shards: meta.layout.shards,
        resharding: meta.layout.resharding,
        created_at_ms: meta.created_at_ms,
        auto,
        expires_at_ms: meta.expires_at_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_back_with_an_empty_disk_never_repeats_an_incarnation() {
        let first = tally_store::MemStore::new();
        let one = next_incarnation(&first, 1_000).unwrap();
        let two = next_incarnation(&first, 5_000).unwrap();
        assert_ne!(one, two, "each opening of one store is a new life");
        // The same node on a new, empty store later: its drain ids must not be the
        // first store's, which other nodes' shards still remember.
        let emptied = tally_store::MemStore::new();
        let again = next_incarnation(&emptied, 9_000).unwrap();
        assert_ne!(again, one);
        assert_ne!(again, two);
        assert_eq!(two, "1000.2");
    }

    /// A shard of the generation a resharding opens may start before it opens (a
    /// sketch merge starts it, and a late or repeated merge can start it again) on
    /// the metadata of the resharding, which does not list the generation being
    /// sealed yet. Once that generation is sealed and the next one open, the shard
    /// must look for earlier records in the sealed one, or a retried event id counts
    /// twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shard_started_before_its_generation_opened_still_finds_earlier_records() {
        use tally_core::meta::apply_command;
        use tally_core::shard::{Outcome, ShardReply, Submission};
        use tally_core::ShardId;
        let store = tally_store::MemStore::new();
        let config = TallyConfig { call_timeout_ms: 10_000, ..TallyConfig::default() };
        let tally = Tally::open_with(Arc::new(store), Arc::new(SystemClock), config).await.unwrap();
        let spec = SpecPatch { shards: Some(2), durability: Some(Durability::Sync), ..Default::default() };
        tally.put_counter("c", spec).await.unwrap();
        for i in 0..40 {
            tally.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
        }
        let ctx = &tally.ctx;
        let name = CounterName::new("c").unwrap();
        let now = ctx.now_ms();
        let v1 = ctx.catalog.get("c").unwrap().unwrap();
        let reshard = MetaCommand::Put(SpecPatch { shards: Some(8), ..Default::default() });
        let v2 = apply_command(Some(v1), &reshard, now).unwrap().0.unwrap();
        // The next generation's shard 0 starts on the resharding's metadata.
        let early = ShardId::new(name.clone(), 1, 0);
        ctx.shard(&early, &Arc::new(v2.clone())).await.unwrap();
        // The old generation is sealed and the next one opens.
        for index in 0..2 {
            let id = ShardId::new(name.clone(), 0, index);
            ctx.seal_shard(&id, &Arc::new(v2.clone())).await.unwrap();
        }
        let open = MetaCommand::CompleteReshard { generation: 0, sealed_sum: 40 };
        let v3 = apply_command(Some(v2), &open, now).unwrap().0.unwrap();
        let rt = ctx.install(name.clone(), v3);
        let retried = (0..40)
            .map(|i| format!("e{i}"))
            .find(|e| tally_core::router::shard_of_event(e, 8) == 0)
            .expect("an event id of shard 0 among 40");
        let sub = Submission::Single {
            delta: 1,
            event_id: Some(retried.clone()),
            member: None,
            item: None,
            seq: None,
        };
        let rx = ctx.send(&early, &rt.meta, sub, crate::ctx::Sender::Peer).await.unwrap();
        match rx.await.unwrap() {
            ShardReply::Done { outcome, .. } => {
                assert_eq!(
                    outcome,
                    Outcome::Duplicate,
                    "{retried}, applied before the resharding, counted again"
                )
            }
            other => panic!("{other:?}"),
        }
        tally.shutdown().await.unwrap();
    }
}
