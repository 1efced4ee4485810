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

/// Reopens an engine over `store` after a crash or shutdown.
pub async fn reopen(store: &MemStore) -> Tally {
    Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), quick_config()).await.unwrap()
}

/// A spec patch for a counter with `shards` shards and the given durability.
pub fn spec(shards: u16, durability: tally_engine::Durability) -> SpecPatch {
    SpecPatch { shards: Some(shards), durability: Some(durability), ..SpecPatch::default() }
}
