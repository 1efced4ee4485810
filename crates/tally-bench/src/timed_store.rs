//! A [`Store`] that times the sled store's commits and flushes, to see where a hot
//! counter's time goes. Every call is passed through unchanged.

use hdrhistogram::Histogram;
use std::sync::Mutex;
use std::time::Instant;
use tally_core::ShardId;
use tally_engine::{SledConfig, SledStore, Store, StoreError};
use tally_store::{DedupRecord, ShardImage, ShardWrite};

/// Thread-name prefix of the runtime's threads (see [`crate::runtime`]).
pub const WORKER_THREAD_NAME: &str = "bench-worker";

/// The sled store [`tally_engine::Tally::open`] would open, with timing.
pub struct TimedStore {
    inner: SledStore,
    commit_ns: Mutex<Histogram<u64>>,
    flush_ns: Mutex<Histogram<u64>>,
}

/// What a [`TimedStore`] saw.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreTimes {
    /// Shard commits.
    pub commits: u64,
    /// Commit latency quantiles p50, p99, max, in microseconds.
    pub commit_us: (f64, f64, f64),
    /// Flushes.
    pub flushes: u64,
    /// Flush latency quantiles p50, p99, max, in microseconds.
    pub flush_us: (f64, f64, f64),
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds")
}

fn quantiles(h: &Histogram<u64>) -> (f64, f64, f64) {
    let us = |v: u64| v as f64 / 1000.0;
    (us(h.value_at_quantile(0.5)), us(h.value_at_quantile(0.99)), us(h.max()))
}

impl TimedStore {
    /// Opens the sled store at `dir` with [`SledConfig::new`]'s defaults.
    pub fn open(dir: &std::path::Path) -> Result<Self, StoreError> {
        Ok(Self {
            inner: SledStore::open(&SledConfig::new(dir))?,
            commit_ns: Mutex::new(histogram()),
            flush_ns: Mutex::new(histogram()),
        })
    }

    /// What was timed so far.
    pub fn times(&self) -> StoreTimes {
        let c = self.commit_ns.lock().expect("not poisoned");
        let f = self.flush_ns.lock().expect("not poisoned");
        StoreTimes { commits: c.len(), commit_us: quantiles(&c), flushes: f.len(), flush_us: quantiles(&f) }
    }

    fn record(h: &Mutex<Histogram<u64>>, started: Instant) {
        let ns = started.elapsed().as_nanos() as u64;
        h.lock().expect("not poisoned").saturating_record(ns);
    }
}

impl Store for TimedStore {
    fn load_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        self.inner.load_shard(id)
    }

    fn open_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        self.inner.open_shard(id)
    }

    fn dedup_get(&self, id: &ShardId, event_id: &str) -> Result<Option<DedupRecord>, StoreError> {
        self.inner.dedup_get(id, event_id)
    }

    fn dedup_scan(
        &self,
        id: &ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, DedupRecord)>, StoreError> {
        self.inner.dedup_scan(id, after, limit)
    }

    fn shard_ids(&self, after: Option<&ShardId>, limit: usize) -> Result<Vec<ShardId>, StoreError> {
        self.inner.shard_ids(after, limit)
    }

    fn commit_many(&self, writes: &[(ShardId, ShardWrite)]) -> Vec<Result<(), StoreError>> {
        let started = Instant::now();
        let r = self.inner.commit_many(writes);
        Self::record(&self.commit_ns, started);
        r
    }

    fn commit(&self, id: &ShardId, write: &ShardWrite) -> Result<(), StoreError> {
        let started = Instant::now();
        let r = self.inner.commit(id, write);
        Self::record(&self.commit_ns, started);
        r
    }

    fn delete_shard(&self, id: &ShardId) -> Result<(), StoreError> {
        self.inner.delete_shard(id)
    }

    fn flush(&self) -> Result<(), StoreError> {
        let started = Instant::now();
        let r = self.inner.flush();
        Self::record(&self.flush_ns, started);
        r
    }

    fn meta_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.meta_get(key)
    }

    fn meta_put(&self, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        self.inner.meta_put(key, value)
    }

    fn meta_delete(&self, key: &[u8]) -> Result<(), StoreError> {
        self.inner.meta_delete(key)
    }

    fn meta_batch(&self, puts: &[(Vec<u8>, Vec<u8>)], deletes: &[Vec<u8>]) -> Result<(), StoreError> {
        self.inner.meta_batch(puts, deletes)
    }

    fn meta_put_each(&self, puts: &[(Vec<u8>, Vec<u8>)]) -> Result<(), StoreError> {
        self.inner.meta_put_each(puts)
    }

    fn meta_scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        self.inner.meta_scan(prefix, after, limit)
    }

    fn upgrade(&self, plan: &tally_store::Upgrade<'_>) -> Result<u64, StoreError> {
        self.inner.upgrade(plan)
    }

    fn size_on_disk(&self) -> Result<u64, StoreError> {
        self.inner.size_on_disk()
    }
}
