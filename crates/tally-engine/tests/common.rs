//! Shared fixtures for the engine's tests.
#![allow(dead_code)]

use std::sync::Arc;
use tally_engine::{Clock, ManualClock, MemStore, SpecPatch, SystemClock, Tally, TallyConfig};

/// A config with short timers so tests run quickly.
pub fn quick_config() -> TallyConfig {
    TallyConfig { call_timeout_ms: 10_000, ..TallyConfig::default() }
}

/// An engine over an in-memory store and the system clock.
pub async fn mem_engine() -> (Tally, MemStore) {
    let store = MemStore::new();
    let tally =
        Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), quick_config()).await.unwrap();
    (tally, store)
}

/// An engine over an in-memory store and a manual clock.
pub async fn manual_engine(start_ms: u64) -> (Tally, MemStore, ManualClock) {
    let store = MemStore::new();
    let clock = ManualClock::new(start_ms);
    let c: Arc<dyn Clock> = Arc::new(clock.clone());
    let tally = Tally::open_with(Arc::new(store.clone()), c, quick_config()).await.unwrap();
    (tally, store, clock)
}

/// The clock of a runtime whose time is paused: milliseconds of tokio time since it
/// was made, from `start_ms`. Timers then fire exactly when due, however loaded the
/// machine is, so a bound on time can be checked without slack for the machine.
#[derive(Clone)]
pub struct PausedClock {
    start: tokio::time::Instant,
    start_ms: u64,
}

impl Clock for PausedClock {
    fn now_ms(&self) -> u64 {
        self.start_ms + self.start.elapsed().as_millis() as u64
    }
}

/// An engine over an in-memory store and a [`PausedClock`]; call it on a runtime
/// whose time is paused (`#[tokio::test(start_paused = true)]`).
pub async fn paused_engine(start_ms: u64) -> (Tally, MemStore) {
    let (tally, store, _) = paused_engine_clock(start_ms).await;
    (tally, store)
}

/// [`paused_engine`], with the engine's clock.
pub async fn paused_engine_clock(start_ms: u64) -> (Tally, MemStore, PausedClock) {
    let store = MemStore::new();
    let clock = PausedClock { start: tokio::time::Instant::now(), start_ms };
    let c: Arc<dyn Clock> = Arc::new(clock.clone());
    let tally = Tally::open_with(Arc::new(store.clone()), c, quick_config()).await.unwrap();
    (tally, store, clock)
}

/// The system's wall clock, which a test can step back (as NTP steps a clock that ran
/// ahead): reads `SystemClock` minus the steps so far.
#[derive(Clone, Default)]
pub struct SteppedClock {
    back_ms: Arc<std::sync::atomic::AtomicU64>,
}

impl SteppedClock {
    /// Steps the wall clock back by `ms`.
    pub fn step_back(&self, ms: u64) {
        self.back_ms.fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for SteppedClock {
    fn now_ms(&self) -> u64 {
        SystemClock.now_ms() - self.back_ms.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Reopens an engine over `store` after a crash or shutdown.
pub async fn reopen(store: &MemStore) -> Tally {
    Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), quick_config()).await.unwrap()
}

/// A spec patch for a counter with `shards` shards and the given durability.
pub fn spec(shards: u16, durability: tally_engine::Durability) -> SpecPatch {
    SpecPatch { shards: Some(shards), durability: Some(durability), ..SpecPatch::default() }
}

/// Code a [`HookStore`] runs on every shard load.
pub type LoadHook = Box<dyn Fn() + Send + Sync>;

/// A store that wraps a [`MemStore`] and can be told to misbehave: stall its commits
/// (an fsync or a disk that stalls), or run a hook on every shard load (a clock that
/// moves while a read fans out). Everything else is the in-memory store's.
#[derive(Clone)]
pub struct HookStore {
    /// The store underneath, with its own fault switches.
    pub inner: MemStore,
    /// Every `commit_many` (the commit path) sleeps this long first, in milliseconds.
    pub commit_many_stall_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Every single-shard `commit` (writes outside the commit path) sleeps this long
    /// first, in milliseconds.
    pub commit_stall_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Runs on every `load_shard`.
    pub on_load: Arc<std::sync::Mutex<Option<LoadHook>>>,
    /// While set, every `load_shard` fails.
    pub fail_loads: Arc<std::sync::atomic::AtomicBool>,
    /// How many metadata batches (catalog commits) were written.
    pub meta_batches: Arc<std::sync::atomic::AtomicU64>,
    /// Every metadata batch sleeps this long first, in milliseconds (a slow disk).
    pub meta_batch_stall_ms: Arc<std::sync::atomic::AtomicU64>,
    /// How many shard loads were asked for.
    pub loads: Arc<std::sync::atomic::AtomicU64>,
    /// How many flushes were started.
    pub flush_starts: Arc<std::sync::atomic::AtomicU64>,
    /// Every flush sleeps this long first, in milliseconds (a slow fsync).
    pub flush_stall_ms: Arc<std::sync::atomic::AtomicU64>,
}

impl HookStore {
    /// A store that behaves as `inner` until told otherwise.
    pub fn new(inner: MemStore) -> Self {
        Self {
            inner,
            commit_many_stall_ms: Default::default(),
            commit_stall_ms: Default::default(),
            on_load: Default::default(),
            fail_loads: Default::default(),
            meta_batches: Default::default(),
            meta_batch_stall_ms: Default::default(),
            flush_starts: Default::default(),
            flush_stall_ms: Default::default(),
            loads: Default::default(),
        }
    }

    /// Makes every commit of the commit path stall `ms` first (0: no stall).
    pub fn stall_commit_path(&self, ms: u64) {
        self.commit_many_stall_ms.store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// Makes every single-shard commit stall `ms` first (0: no stall).
    pub fn stall_direct_commits(&self, ms: u64) {
        self.commit_stall_ms.store(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

fn stall(ms: &std::sync::atomic::AtomicU64) {
    let ms = ms.load(std::sync::atomic::Ordering::SeqCst);
    if ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

impl tally_engine::Store for HookStore {
    fn load_shard(
        &self,
        id: &tally_core::ShardId,
    ) -> Result<tally_store::ShardImage, tally_engine::StoreError> {
        self.loads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(f) = self.on_load.lock().unwrap().as_ref() {
            f();
        }
        if self.fail_loads.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tally_engine::StoreError::Injected("load_shard"));
        }
        self.inner.load_shard(id)
    }
    fn dedup_get(
        &self,
        id: &tally_core::ShardId,
        event_id: &str,
    ) -> Result<Option<tally_core::dedup::DedupRecord>, tally_engine::StoreError> {
        self.inner.dedup_get(id, event_id)
    }
    fn dedup_scan(
        &self,
        id: &tally_core::ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, tally_core::dedup::DedupRecord)>, tally_engine::StoreError> {
        self.inner.dedup_scan(id, after, limit)
    }
    fn shard_ids(
        &self,
        after: Option<&tally_core::ShardId>,
        limit: usize,
    ) -> Result<Vec<tally_core::ShardId>, tally_engine::StoreError> {
        self.inner.shard_ids(after, limit)
    }
    fn commit(
        &self,
        id: &tally_core::ShardId,
        write: &tally_store::ShardWrite,
    ) -> Result<(), tally_engine::StoreError> {
        stall(&self.commit_stall_ms);
        self.inner.commit(id, write)
    }
    fn commit_many(
        &self,
        writes: &[(tally_core::ShardId, tally_store::ShardWrite)],
    ) -> Vec<Result<(), tally_engine::StoreError>> {
        stall(&self.commit_many_stall_ms);
        self.inner.commit_many(writes)
    }
    fn delete_shard(&self, id: &tally_core::ShardId) -> Result<(), tally_engine::StoreError> {
        self.inner.delete_shard(id)
    }
    fn flush(&self) -> Result<(), tally_engine::StoreError> {
        self.flush_starts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let stall = self.flush_stall_ms.load(std::sync::atomic::Ordering::SeqCst);
        if stall > 0 {
            std::thread::sleep(std::time::Duration::from_millis(stall));
        }
        self.inner.flush()
    }
    fn meta_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, tally_engine::StoreError> {
        self.inner.meta_get(key)
    }
    fn meta_put(&self, key: &[u8], value: &[u8]) -> Result<(), tally_engine::StoreError> {
        self.inner.meta_put(key, value)
    }
    fn meta_delete(&self, key: &[u8]) -> Result<(), tally_engine::StoreError> {
        self.inner.meta_delete(key)
    }
    fn meta_batch(
        &self,
        puts: &[(Vec<u8>, Vec<u8>)],
        deletes: &[Vec<u8>],
    ) -> Result<(), tally_engine::StoreError> {
        self.meta_batches.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        stall(&self.meta_batch_stall_ms);
        self.inner.meta_batch(puts, deletes)
    }
    fn meta_scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, tally_engine::StoreError> {
        self.inner.meta_scan(prefix, after, limit)
    }
    fn upgrade(&self, plan: &tally_store::Upgrade<'_>) -> Result<u64, tally_engine::StoreError> {
        self.inner.upgrade(plan)
    }
    fn size_on_disk(&self) -> Result<u64, tally_engine::StoreError> {
        Ok(0)
    }
    // Stalls must not block an async worker: run on blocking threads like sled.
    fn blocks(&self) -> bool {
        true
    }
}

/// Counter metadata shared by several engines in one process (a stand-in for the
/// replicated catalog; it tells no engine of changes). Each engine may see it through
/// its own gate, which can hold back the completion of a resharding on that engine.
#[derive(Clone, Default)]
pub struct SharedCatalog {
    map: Arc<std::sync::Mutex<std::collections::BTreeMap<String, tally_core::meta::CounterMeta>>>,
    /// While set, `CompleteReshard` through this view waits.
    pub hold_completions: Arc<std::sync::atomic::AtomicBool>,
    /// How many times any view read a counter's metadata.
    pub gets: Arc<std::sync::atomic::AtomicU64>,
    /// Counters this view has not applied yet: its own reads (`get`) miss them, as a
    /// node whose metadata lags misses a counter created elsewhere; a read of the
    /// latest metadata (`current`, a read index) finds them.
    pub unapplied: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

impl SharedCatalog {
    /// Another view of the same metadata, with a gate of its own.
    pub fn view(&self, hold_completions: Arc<std::sync::atomic::AtomicBool>) -> Self {
        Self {
            map: self.map.clone(),
            hold_completions,
            gets: self.gets.clone(),
            unapplied: Default::default(),
        }
    }
}

impl tally_engine::Catalog for SharedCatalog {
    fn get(&self, name: &str) -> Result<Option<tally_core::meta::CounterMeta>, tally_engine::TallyError> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.unapplied.lock().unwrap().contains(name) {
            return Ok(None);
        }
        Ok(self.map.lock().unwrap().get(name).cloned())
    }
    fn current<'a>(
        &'a self,
        name: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<Option<tally_core::meta::CounterMeta>, tally_engine::TallyError>>
    {
        Box::pin(async move { Ok(self.map.lock().unwrap().get(name).cloned()) })
    }
    fn apply<'a>(
        &'a self,
        name: &'a tally_core::CounterName,
        cmd: &'a tally_core::meta::MetaCommand,
        now_ms: u64,
    ) -> futures::future::BoxFuture<
        'a,
        Result<
            (Option<tally_core::meta::CounterMeta>, tally_core::meta::MetaEffect),
            tally_engine::TallyError,
        >,
    > {
        Box::pin(async move {
            if matches!(cmd, tally_core::meta::MetaCommand::CompleteReshard { .. }) {
                while self.hold_completions.load(std::sync::atomic::Ordering::SeqCst) {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            }
            let mut map = self.map.lock().unwrap();
            let (next, effect) =
                tally_core::meta::apply_command(map.get(name.as_str()).cloned(), cmd, now_ms)?;
            match &next {
                Some(m) => map.insert(name.to_string(), m.clone()),
                None => map.remove(name.as_str()),
            };
            Ok((next, effect))
        })
    }
    // A node that restarts does not learn of reshardings in progress from this
    // catalog: it stands for a node whose metadata log has not caught up.
    fn pending_reshards(&self) -> Result<Vec<tally_core::CounterName>, tally_engine::TallyError> {
        Ok(Vec::new())
    }
    fn tombstones(
        &self,
    ) -> Result<Vec<(tally_core::CounterName, tally_engine::Generations)>, tally_engine::TallyError> {
        Ok(Vec::new())
    }
    fn tombstone(&self, _name: &str) -> Result<Option<tally_engine::Generations>, tally_engine::TallyError> {
        Ok(None)
    }
    fn clear_tombstone<'a>(
        &'a self,
        _name: &'a tally_core::CounterName,
    ) -> futures::future::BoxFuture<'a, Result<(), tally_engine::TallyError>> {
        Box::pin(async { Ok(()) })
    }
    fn list(
        &self,
        prefix: &str,
        after: Option<&tally_core::CounterName>,
        limit: usize,
    ) -> Result<Vec<tally_core::CounterName>, tally_engine::TallyError> {
        let map = self.map.lock().unwrap();
        Ok(map
            .keys()
            .filter(|n| n.starts_with(prefix) && after.is_none_or(|a| n.as_str() > a.as_str()))
            .take(limit)
            .filter_map(|n| tally_core::CounterName::new(n.as_str()).ok())
            .collect())
    }
}
