//! The local catalog: counter metadata kept in the node's own store.
//!
//! Every change goes through [`tally_core::meta::apply_command`], the same pure
//! transition a replicated catalog applies, and is durable before it is reported.
//! Changes are serialized by one lock (they are rare); reads take no lock.

use crate::error::TallyError;
use crate::flusher::Flusher;
use std::sync::Arc;
use tally_core::codec;
use tally_core::meta::{apply_command, CounterMeta, MetaCommand, MetaEffect};
use tally_core::CounterName;
use tally_store::{Store, StoreError};
use tokio::sync::Mutex;

const COUNTER_PREFIX: &[u8] = b"counter/";
const RESHARD_PREFIX: &[u8] = b"reshard/";
const TOMBSTONE_PREFIX: &[u8] = b"tombstone/";
/// Most keys one catalog scan returns per page.
const SCAN_PAGE_KEYS: usize = 1024;

fn key(prefix: &[u8], name: &str) -> Vec<u8> {
    [prefix, name.as_bytes()].concat()
}

/// The (generation, shard count) pairs whose data a deleted counter left behind.
pub(crate) type Generations = Vec<(u32, u16)>;

/// Counter metadata backed by the store's metadata space.
pub(crate) struct Catalog {
    store: Arc<dyn Store>,
    flusher: Flusher,
    write: Mutex<()>,
}

impl Catalog {
    pub(crate) fn new(store: Arc<dyn Store>, flusher: Flusher) -> Self {
        Self { store, flusher, write: Mutex::new(()) }
    }

    /// The counter's metadata, if it exists.
    pub(crate) fn get(&self, name: &str) -> Result<Option<CounterMeta>, TallyError> {
        match self.store.meta_get(&key(COUNTER_PREFIX, name))? {
            None => Ok(None),
            Some(bytes) => {
                let meta = codec::decode("counter metadata", &bytes).map_err(|source| {
                    StoreError::Corrupt { location: format!("catalog entry {name:?}"), source }
                })?;
                Ok(Some(meta))
            }
        }
    }

    /// Applies `cmd` to the counter and makes the result durable.
    pub(crate) async fn apply(
        &self,
        name: &CounterName,
        cmd: &MetaCommand,
        now_ms: u64,
    ) -> Result<(Option<CounterMeta>, MetaEffect), TallyError> {
        let _guard = self.write.lock().await;
        let current = self.get(name.as_str())?;
        let (next, effect) = apply_command(current, cmd, now_ms)?;
        let ck = key(COUNTER_PREFIX, name.as_str());
        let rk = key(RESHARD_PREFIX, name.as_str());
        match (&next, &effect) {
            (_, MetaEffect::Unchanged | MetaEffect::Missing) => return Ok((next, effect)),
            (None, MetaEffect::Deleted(generations)) => {
                // The tombstone lists the data to delete; it outlives a crash mid-cleanup.
                self.store.meta_put(&key(TOMBSTONE_PREFIX, name.as_str()), &codec::encode(generations))?;
                self.store.meta_delete(&ck)?;
                self.store.meta_delete(&rk)?;
            }
            (Some(meta), _) => {
                self.store.meta_put(&ck, &codec::encode(meta))?;
                if meta.layout.resharding.is_some() {
                    self.store.meta_put(&rk, b"")?;
                } else {
                    self.store.meta_delete(&rk)?;
                }
            }
            (None, _) => unreachable!("only a delete removes a counter"),
        }
        self.flusher.flush().await?;
        Ok((next, effect))
    }

    /// Counters with a resharding that has not completed (after a crash, say).
    pub(crate) fn pending_reshards(&self) -> Result<Vec<CounterName>, TallyError> {
        self.names(RESHARD_PREFIX)
    }

    /// Deleted counters whose data may still be in the store, with the generations
    /// (generation, shards) to delete.
    pub(crate) fn tombstones(&self) -> Result<Vec<(CounterName, Generations)>, TallyError> {
        let mut out = Vec::new();
        for name in self.names(TOMBSTONE_PREFIX)? {
            if let Some(gens) = self.tombstone(name.as_str())? {
                out.push((name, gens));
            }
        }
        Ok(out)
    }

    /// The generations a deleted counter left behind, if its cleanup is pending.
    pub(crate) fn tombstone(&self, name: &str) -> Result<Option<Generations>, TallyError> {
        match self.store.meta_get(&key(TOMBSTONE_PREFIX, name))? {
            None => Ok(None),
            Some(b) => Ok(Some(codec::decode("tombstone", &b).map_err(|source| StoreError::Corrupt {
                location: format!("tombstone {name:?}"),
                source,
            })?)),
        }
    }

    /// Forgets a tombstone once its data is gone.
    pub(crate) fn clear_tombstone(&self, name: &str) -> Result<(), TallyError> {
        Ok(self.store.meta_delete(&key(TOMBSTONE_PREFIX, name))?)
    }

    fn names(&self, prefix: &[u8]) -> Result<Vec<CounterName>, TallyError> {
        let mut out = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let page = self.store.meta_scan(prefix, after.as_deref(), SCAN_PAGE_KEYS)?;
            let done = page.len() < SCAN_PAGE_KEYS;
            for (k, _) in &page {
                let name = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                if let Ok(n) = CounterName::new(name) {
                    out.push(n);
                }
            }
            after = page.last().map(|(k, _)| k.clone());
            if done || after.is_none() {
                return Ok(out);
            }
        }
    }
}
