//! Engine settings. Every limit the engine enforces is a field here, with its unit
//! last and a default that suits one node on a small machine.

use std::sync::Arc;
use tally_core::NodeId;

/// Answers "what should this counter's total be?" for periodic reconciliation, from
/// a source of truth outside Tally (an event log, a ledger). Calls must be quick: the
/// reconciler calls them from its own task.
pub trait AuthoritativeSource: Send + Sync + 'static {
    /// The counters this source can recount.
    fn counters(&self) -> Vec<String>;
    /// The authoritative total of `counter`, if known right now.
    fn total(&self, counter: &str) -> Option<i128>;
}

/// How an engine runs.
#[derive(Clone)]
pub struct TallyConfig {
    /// This node's name: reported as the owner of its shards.
    pub node_id: NodeId,
    /// How often the aggregator looks for due accumulators, in milliseconds. A
    /// `batched` counter's buffer reaches its shards within `flush_ms` plus this.
    pub aggregator_tick_ms: u64,
    /// An accumulator slot holding this many increments asks for an early flush.
    pub slot_flush_increments: u64,
    /// A shard actor with no work for this long stops; its state is in the store.
    pub shard_idle_stop_ms: u64,
    /// A counter's in-memory accumulators are dropped after this long unused.
    pub counter_idle_evict_ms: u64,
    /// How long a caller waits for a shard's answer before reporting it unavailable.
    /// A change of a bounded counter waits for headroom at most half of it.
    pub call_timeout_ms: u64,
    /// How often the rollup looks for due refreshes, in milliseconds.
    pub rollup_tick_ms: u64,
    /// Most counters whose totals the rollup caches at once.
    pub rollup_tracked_max: usize,
    /// A cached total not read for this long stops being refreshed.
    pub rollup_idle_evict_ms: u64,
    /// The least time between two sweep passes of a shard's expired dedup records
    /// (a pass starts once a record is due: [`tally_core::sweep`]).
    pub dedup_sweep_ms: u64,
    /// Most dedup records one sweep examines.
    pub dedup_sweep_records_max: usize,
    /// How often the reconciler asks the authoritative source; 0 disables.
    pub reconcile_interval_ms: u64,
    /// Where periodic reconciliation gets authoritative totals.
    pub authority: Option<Arc<dyn AuthoritativeSource>>,
    /// Most items in one `incr_many` batch.
    pub batch_items_max: usize,
    /// What a counter created implicitly (by its first increment, or a `SET`) takes
    /// when its name falls under no namespace: the node config's default spec
    /// (`[cluster] default_spec`). Carried in every creation command, so every
    /// replica applies the same.
    pub default_spec: tally_core::namespace::NamespaceSpec,
    /// How often expired counters are looked for and reclaimed, in milliseconds:
    /// how late after its deadline an expired counter's memory and disk may still
    /// be held (reads answer it missing from the deadline on regardless).
    pub expiry_sweep_ms: u64,
    /// Thresholds and timers of counters whose shard count follows contention
    /// (checked with [`tally_core::autoshard::Tuning::validate`] where configured).
    pub autoshard: tally_core::autoshard::Tuning,
    /// The most copies of each shard a counter may ask for (`replicas`): 1 where
    /// each shard has one copy (embedded, or a cluster without range groups); a
    /// node that runs range groups allows [`tally_core::ranges::REPLICAS_MAX`].
    pub replicas_max: u8,
    /// The copies of each shard of a counter that states none: the cluster's
    /// `replicas` (1 on a single node). What `WAIT` counts on.
    pub replicas_default: u8,
    /// Most counters on the node (a rule over every name); counted from the catalog
    /// (`crate::quota`), so in a cluster it bounds the cluster's counters as this
    /// node sees them. A creation beyond it answers 507 `quota_exceeded`.
    pub counters_max: u64,
    /// Most counters under a name prefix, per prefix (a token's prefixes, a tenant's).
    pub counter_quotas: Vec<crate::CounterQuota>,
    /// Most event ids a counter keeps (within its dedup window), split evenly over
    /// its shards: each costs a record on disk and some of the store's memory for
    /// the whole window. A new id beyond it answers 507 `quota_exceeded`.
    pub event_ids_per_counter_max: u64,
    /// Most bytes a counter's sketches may take (count-min tables of every shard, the
    /// distinct sketch, window buckets); a spec beyond it is refused with 507.
    pub sketch_bytes_per_counter_max: u64,
}

/// Counters a node holds at most by default: ten million counters' metadata, each a
/// few hundred bytes in the catalog and a raft log entry when created.
pub const COUNTERS_MAX_DEFAULT: u64 = 10_000_000;
/// Event ids a counter keeps at most by default: about 1.5 GB on disk at ~150 bytes
/// a record, and some 140 MB of the store's memory, for one counter's window.
pub const EVENT_IDS_PER_COUNTER_MAX_DEFAULT: u64 = 10_000_000;
/// Bytes a counter's sketches take at most by default (64 MiB): the largest
/// count-min table (1 MiB a shard) on 64 shards.
pub const SKETCH_BYTES_PER_COUNTER_MAX_DEFAULT: u64 = 64 << 20;

impl Default for TallyConfig {
    fn default() -> Self {
        Self {
            node_id: NodeId::new("local"),
            aggregator_tick_ms: 5,
            slot_flush_increments: 1 << 16,
            shard_idle_stop_ms: 30_000,
            counter_idle_evict_ms: 60_000,
            call_timeout_ms: 5_000,
            rollup_tick_ms: 10,
            rollup_tracked_max: 100_000,
            rollup_idle_evict_ms: 60_000,
            dedup_sweep_ms: 60_000,
            dedup_sweep_records_max: 10_000,
            reconcile_interval_ms: 0,
            authority: None,
            batch_items_max: 10_000,
            expiry_sweep_ms: 1_000,
            default_spec: tally_core::namespace::NamespaceSpec::default(),
            autoshard: tally_core::autoshard::Tuning::default(),
            replicas_max: 1,
            replicas_default: 1,
            counters_max: COUNTERS_MAX_DEFAULT,
            counter_quotas: Vec::new(),
            event_ids_per_counter_max: EVENT_IDS_PER_COUNTER_MAX_DEFAULT,
            sketch_bytes_per_counter_max: SKETCH_BYTES_PER_COUNTER_MAX_DEFAULT,
        }
    }
}

impl TallyConfig {
    /// The escrow timers of this node's bounded counters: a change at its bound waits
    /// for headroom only as long as its caller listens ([`tally_core::escrow::Tuning::within_call`]).
    pub fn escrow_tuning(&self) -> tally_core::escrow::Tuning {
        tally_core::escrow::Tuning::within_call(self.call_timeout_ms)
    }
}

impl std::fmt::Debug for TallyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TallyConfig")
            .field("node_id", &self.node_id)
            .field("aggregator_tick_ms", &self.aggregator_tick_ms)
            .field("shard_idle_stop_ms", &self.shard_idle_stop_ms)
            .field("counter_idle_evict_ms", &self.counter_idle_evict_ms)
            .field("call_timeout_ms", &self.call_timeout_ms)
            .field("authority", &self.authority.is_some())
            .finish_non_exhaustive()
    }
}
