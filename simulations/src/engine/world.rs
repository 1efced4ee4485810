//! The shared state of a tier-2 run: the nodes (their stores and engines), the
//! network's faults, the metadata versions, the history and the trace. Every task of
//! the run reaches it through one mutex that is never held across an `await`.

use crate::config::{FaultRates, SimConfig};
use crate::history::{Disturbance, FaultKind, History};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use tally_core::meta::CounterMeta;
use tally_core::ring::Ring;
use tally_engine::{MemStore, Tally};
use xxhash_rust::xxh3::Xxh3;

/// The engines' clock reads this many milliseconds at the start of a run (a
/// plausible wall-clock reading, so nothing meets a zero time).
pub(crate) const EPOCH_MS: u64 = 1_700_000_000_000;

/// One simulated node.
pub(crate) struct Node {
    /// Up (its engine is open or opening) or crashed.
    pub(crate) up: bool,
    /// Bumped at every crash: calls and answers of an older incarnation are dropped.
    pub(crate) incarnation: u64,
    /// The node's store handle of the current incarnation.
    pub(crate) store: MemStore,
    /// The engine, once open.
    pub(crate) tally: Option<Tally>,
    /// Messages to and from the node wait until then (a stopped process).
    pub(crate) paused_until: u64,
    /// A flush was made to fail; the operator restarts the node.
    pub(crate) poisoned: bool,
    /// The node's metadata applies lag this much behind the log.
    pub(crate) meta_lag_ms: u64,
    /// After a restart: until the first time, the node's metadata is as of the second.
    pub(crate) meta_stale: Option<(u64, u64)>,
    /// Replicated runs: the store of the node's range groups (current incarnation).
    pub(crate) kv: tally_replica::MemKv,
    /// Replicated runs: which disk the node runs (bumped when one is lost).
    pub(crate) disk: u32,
    /// Replicated runs: the node's range groups and their driver, once open.
    pub(crate) replication: Option<Arc<tally_replica::Replication>>,
    /// Replicated runs: the task that forms groups and replaces replicas.
    pub(crate) tending: Option<tokio::task::JoinHandle<()>>,
    /// How far the node's wall clock is off true time, in milliseconds: kept across
    /// crashes (a machine's clock outlives its process) and changed by clock jumps.
    pub(crate) clock_offset_ms: Arc<std::sync::atomic::AtomicI64>,
    /// Tier 3: the node's whole cluster node, once started.
    pub(crate) cluster: Option<tally_cluster::ClusterNode>,
    /// Tier 3: the node's metadata database (its disk's identity), created at its
    /// first start and dropped with a lost disk.
    pub(crate) raft_db: Option<sled::Db>,
    /// Tier 3: the stop of the node's previous life, which its next start awaits.
    pub(crate) stopping: Option<tokio::task::JoinHandle<()>>,
    /// Tier 3: held by a start of the node from its beginning until it is the
    /// node's, or stopped again because the node crashed while it started (a start
    /// cannot be cut short: it ends first, then stops what it started). A later
    /// start waits for it, so no two lives of the node share its addresses.
    pub(crate) starting: std::sync::Arc<tokio::sync::Mutex<()>>,
}

/// One version of a counter's metadata, with the time the log committed it.
#[derive(Debug, Clone)]
pub(crate) struct MetaVersion {
    pub(crate) at_ms: u64,
    pub(crate) meta: CounterMeta,
}

/// Virtual nodes per node on the placement ring (as the cluster uses).
pub(crate) const VNODES_PER_NODE: u32 = 128;

/// The name of node `n`.
pub(crate) fn node_name(n: u8) -> tally_core::NodeId {
    tally_core::NodeId::new(format!("node{}", u16::from(n) + 1))
}

/// One committed placement: the ring's members and, while a membership change is
/// handed off, the members before it and those that have not finished handing off.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PlacementVersion {
    pub(crate) at_ms: u64,
    pub(crate) epoch: u64,
    pub(crate) members: Vec<u8>,
    pub(crate) previous: Vec<u8>,
    pub(crate) handoff: BTreeSet<u8>,
}

/// Everything a run shares.
pub(crate) struct World {
    pub(crate) cfg: SimConfig,
    pub(crate) start: tokio::time::Instant,
    pub(crate) rng: ChaCha8Rng,
    pub(crate) rates: FaultRates,
    pub(crate) history: History,
    pub(crate) faults: BTreeMap<FaultKind, u64>,
    pub(crate) nodes: Vec<Node>,
    /// Directed links that carry nothing (partitions).
    pub(crate) cut: BTreeMap<(u8, u8), u32>,
    /// Once healed the network neither loses, duplicates nor delays beyond the base.
    pub(crate) healed: bool,
    /// Metadata writes fail until then (a leader failover).
    pub(crate) meta_down_until: u64,
    /// Every committed version of every counter's metadata, oldest first.
    pub(crate) meta: BTreeMap<String, Vec<MetaVersion>>,
    /// The bounds of counters whose shard count follows contention, as committed.
    pub(crate) auto: BTreeMap<String, tally_core::spec::AutoShards>,
    /// The replica classes of counters that state their own replica count, each
    /// with the members of its first creation, as committed.
    pub(crate) classes: BTreeMap<u8, Vec<u8>>,
    /// The first voters of those classes' range groups, as committed.
    pub(crate) formations: BTreeMap<u32, Vec<(u64, String)>>,
    /// Start of each node's current disturbance.
    pub(crate) disturbed_since: BTreeMap<u8, u64>,
    /// Transitions (reshardings) requested and not known to be finished.
    pub(crate) reshards_requested: BTreeSet<String>,
    /// Every committed placement, oldest first (the metadata group's membership).
    pub(crate) placements: Vec<PlacementVersion>,
    /// The ring of each member set met so far.
    pub(crate) rings: BTreeMap<Vec<u8>, Arc<Ring>>,
    /// The clock jumps of the chaos phase (time, node, new offset), until scheduled.
    pub(crate) clock_jumps: Vec<(u64, u8, i64)>,
    pub(crate) trace: Xxh3,
    pub(crate) events: u64,
    /// Node-to-node calls sent so far: each call's number labels its answer.
    pub(crate) calls: u64,
    /// The simulated time the run ended at.
    pub(crate) end_ms: u64,
    /// Print every event to stderr (`TALLY_SIM_DEBUG=1`; output only, no influence).
    pub(crate) debug: bool,
    /// Tier 3: the networks of the metadata group and of node-to-node sessions.
    pub(crate) nets: Option<super::whole::Nets>,
    /// When the chaos phase began: after setup, whose length is the metadata
    /// group's first election in tier 3 (0 in tier 2, whose setup is quick).
    pub(crate) chaos_from_ms: u64,
}

/// The handle every task holds.
pub(crate) type Shared = Arc<Mutex<World>>;

/// Locks the world. A panicking task leaves it usable: the run reports the panic.
pub(crate) fn lock(w: &Shared) -> MutexGuard<'_, World> {
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// Simulated milliseconds since the run started.
pub(crate) fn now_ms(start: tokio::time::Instant) -> u64 {
    tokio::time::Instant::now().duration_since(start).as_millis() as u64
}

impl World {
    /// Simulated milliseconds since the run started.
    pub(crate) fn now(&self) -> u64 {
        now_ms(self.start)
    }

    /// Hashes one event into the trace.
    pub(crate) fn note(&mut self, what: &str, detail: impl Hash + std::fmt::Debug) {
        let now = self.now();
        if self.debug {
            eprintln!("{now:>6} {what} {detail:?}");
        }
        (now, what, detail).hash(&mut self.trace);
        self.events += 1;
    }

    /// Counts a fault.
    pub(crate) fn count(&mut self, kind: FaultKind) {
        *self.faults.entry(kind).or_default() += 1;
    }

    /// A uniform draw in `lo..=hi`.
    pub(crate) fn uniform(&mut self, (lo, hi): (u64, u64)) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// One-way delay of a message: the base plus, before healing, the run's extra.
    pub(crate) fn delay(&mut self) -> u64 {
        let base = self.rng.random_range(crate::config::NET_DELAY_MS_MIN..=crate::config::NET_DELAY_MS_MAX);
        let extra = if self.healed { 0 } else { self.rng.random_range(0..=self.rates.delay_extra_ms_max) };
        base + extra
    }

    /// Whether this message is lost.
    pub(crate) fn lost(&mut self) -> bool {
        !self.healed && self.rng.random::<f64>() < self.rates.loss
    }

    /// Whether this node-to-node message is delivered twice.
    pub(crate) fn duplicated(&mut self) -> bool {
        !self.healed && self.rng.random::<f64>() < self.rates.duplicate
    }

    /// Whether node `n`'s incarnation `inc` is the live one.
    pub(crate) fn alive(&self, n: u8, inc: u64) -> bool {
        let node = &self.nodes[usize::from(n)];
        node.up && node.incarnation == inc
    }

    /// Marks node `n` disturbed from now.
    pub(crate) fn disturb(&mut self, n: u8) {
        let now = self.now();
        self.disturbed_since.entry(n).or_insert(now);
    }

    /// Ends node `n`'s disturbance if it is healthy again.
    pub(crate) fn undisturb(&mut self, n: u8) {
        let now = self.now();
        let node = &self.nodes[usize::from(n)];
        if node.up && !node.poisoned && node.paused_until <= now && node.tally.is_some() {
            if let Some(from) = self.disturbed_since.remove(&n) {
                self.history.disturbances.push(Disturbance { from_ms: from, to_ms: now });
            }
        }
    }

    /// Records a disturbance of the whole cluster from now for `ms`.
    pub(crate) fn disturbance(&mut self, ms: u64) {
        let now = self.now();
        self.history.disturbances.push(Disturbance { from_ms: now, to_ms: now + ms });
    }

    /// The metadata node `n` has applied: the newest version committed before its
    /// view's time.
    pub(crate) fn meta_view(&self, n: u8, name: &str) -> Option<CounterMeta> {
        let at = self.view_time(n);
        self.meta.get(name)?.iter().rev().find(|v| v.at_ms <= at).map(|v| v.meta.clone())
    }

    /// The log time up to which node `n` has applied metadata.
    pub(crate) fn view_time(&self, n: u8) -> u64 {
        let now = self.now();
        let node = &self.nodes[usize::from(n)];
        let lagging = now.saturating_sub(node.meta_lag_ms);
        match node.meta_stale {
            Some((until, as_of)) if now < until => lagging.min(as_of),
            _ => lagging,
        }
    }

    /// The newest committed metadata of `name` (the log's leader).
    pub(crate) fn meta_latest(&self, name: &str) -> Option<CounterMeta> {
        self.meta.get(name)?.last().map(|v| v.meta.clone())
    }

    /// The placement node `n` has applied: the newest committed before its view's
    /// time (placement is metadata: it lags, and may be stale after a restart, alike).
    pub(crate) fn placement_view(&self, n: u8) -> &PlacementVersion {
        let at = self.view_time(n);
        self.placements.iter().rev().find(|v| v.at_ms <= at).unwrap_or(&self.placements[0])
    }

    /// The ring over `members`.
    pub(crate) fn ring(&mut self, members: &[u8]) -> Arc<Ring> {
        self.rings
            .entry(members.to_vec())
            .or_insert_with(|| Arc::new(Ring::new(members.iter().map(|&m| node_name(m)), VNODES_PER_NODE)))
            .clone()
    }
}
