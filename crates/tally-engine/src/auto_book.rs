//! Every auto counter an engine follows, with its machine: the state the sampling
//! task of `autoshard.rs` steps, kept in the engine's environment.

use std::collections::BTreeMap;
use tally_core::autoshard::AutoShardMachine;
use tally_core::CounterName;

/// One auto counter being followed.
pub(crate) struct Tracked {
    pub(crate) machine: AutoShardMachine,
    /// The runtime sampled last (by address) and its slots' write counts then.
    pub(crate) baseline: Option<(usize, Vec<u64>)>,
    /// When it was sampled last.
    pub(crate) sampled_at_ms: u64,
}

/// Every auto counter this engine follows.
#[derive(Default)]
pub(crate) struct AutoBook(pub(crate) parking_lot::Mutex<BTreeMap<CounterName, Tracked>>);

impl AutoBook {
    /// The counters it follows.
    pub(crate) fn names(&self) -> Vec<CounterName> {
        self.0.lock().keys().cloned().collect()
    }
}
