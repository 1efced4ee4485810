//! Tier 2: the real engine in simulation.
//!
//! A run is `nodes` real [`tally_engine::Tally`] engines — their shard, supervisor,
//! aggregator, rollup and reconciler actors, flusher, reads, resharding task — in one
//! process, on a current-thread tokio runtime whose time is paused (it jumps to the
//! next timer whenever every task waits). Each engine runs over its own
//! [`tally_engine::MemStore`], a clock that reads the runtime's paused time, a
//! simulated transport ([`net`]) and a shared metadata log with lagging per-node views
//! ([`catalog`]). Faults are drawn from the seed as in tier 1: crashes (the engine
//! aborted, cut off, its store's unflushed writes torn at a random point, a new
//! engine opened on the image later), partitions, pauses, lossy, slow and duplicating
//! links, failing fsyncs and metadata failovers. The workload, history and checker
//! are tier 1's.
//!
//! Tier 3 (`--tier cluster`, [`whole`]) runs the same world with whole cluster
//! nodes in place of bare engines: each node is a `tally_cluster::ClusterNode` with
//! the real metadata group, placement, range groups and transport contract.

mod catalog;
mod client;
mod net;
mod replica;
mod whole;
mod world;

use crate::check::{self, Violation};
use crate::config::*;
use crate::history::{FaultKind, History};
use crate::sim::RunReport;
use catalog::SimCatalog;
use net::{node_index, SimPlacement};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hasher;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tally_engine::{Clock, EngineParts, MemStore, Tally, TallyConfig};
use world::{lock, node_name, now_ms, Node, Shared, World, EPOCH_MS};
use xxhash_rust::xxh3::Xxh3;

/// Pause between a previous member's hand-off passes that left shards behind.
const HANDOFF_RETRY_MS: u64 = 50;
/// Fewest members a membership change leaves (a node removed needs others to take
/// its shards).
const MEMBERS_MIN: usize = 2;
/// Longest a node's metadata view lags the log, in milliseconds, by fault level.
const META_LAG_MS_MAX_LIGHT: u64 = 5;
/// See [`META_LAG_MS_MAX_LIGHT`].
const META_LAG_MS_MAX_HEAVY: u64 = 150;
/// After a restart a node may see metadata as of its crash for up to this long.
const META_STALE_AFTER_RESTART_MS_MAX: u64 = 300;
/// A node whose engine could not open is tried again after this.
const REOPEN_BACKOFF_MS: u64 = 50;
/// Attempts to open a node's engine before the run reports a failure.
const OPEN_ATTEMPTS_MAX: u32 = 20;
/// Flushes a busy node makes per second, to turn the per-flush fsync failure
/// probability of a fault level into a rate of failures.
const FLUSHES_PER_S: f64 = 30.0;
/// How often shards sweep expired dedup records in a run with short windows.
const SHORT_DEDUP_SWEEP_MS: u64 = 250;
/// Idle shard actors stop after this (so restarts of shard actors are exercised).
const SHARD_IDLE_STOP_MS: u64 = 1_000;

/// A node's wall clock: the runtime's paused time, from [`EPOCH_MS`], off by the
/// node's current offset (which a clock jump changes, backwards too).
struct SimClock {
    start: tokio::time::Instant,
    offset_ms: Arc<AtomicI64>,
}

impl Clock for SimClock {
    fn now_ms(&self) -> u64 {
        (EPOCH_MS + now_ms(self.start)).saturating_add_signed(self.offset_ms.load(Ordering::Relaxed))
    }
}

/// Seeds the generator of clock offsets and jumps, apart from the run's own so that
/// runs without skew draw as before.
const CLOCK_RNG_SALT: u64 = 0x000c_10c4_5eed;

/// Each node's first clock offset within ±`skew_ms`, and the jumps of the chaos
/// phase (time, node, new offset), in time order, from their own generator.
fn clock_plan(seed: u64, nodes: u8, skew_ms: u64, chaos_ms: u64) -> (Vec<i64>, Vec<(u64, u8, i64)>) {
    if skew_ms == 0 {
        return (vec![0; usize::from(nodes)], Vec::new());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ CLOCK_RNG_SALT);
    let skew = skew_ms.min(i64::MAX as u64) as i64;
    let offsets = (0..nodes).map(|_| rng.random_range(-skew..=skew)).collect();
    let mut jumps = Vec::new();
    for n in 0..nodes {
        for t in poisson(&mut rng, CLOCK_JUMPS_PER_S, chaos_ms) {
            jumps.push((t, n, rng.random_range(-skew..=skew)));
        }
    }
    jumps.sort_unstable();
    (offsets, jumps)
}

/// Auto-shard timers and thresholds scaled to a run's few simulated seconds and its
/// few clients, so the auto counter ([`client::AUTO_COUNTER`]) is resharded up and
/// down while faults strike.
const AUTO_TUNING: tally_core::autoshard::Tuning = tally_core::autoshard::Tuning {
    sample_ms: 50,
    change_interval_ms: 300,
    quiet_ms: 600,
    hot_samples: 2,
    rate_up_per_shard: 40,
    queue_up: 2,
};

/// The engine settings of node `n`.
fn engine_config(n: u8) -> TallyConfig {
    TallyConfig {
        node_id: node_name(n),
        aggregator_tick_ms: AGGREGATOR_TICK_MS,
        rollup_tick_ms: ROLLUP_TICK_MS,
        call_timeout_ms: net::CALL_TIMEOUT_MS,
        shard_idle_stop_ms: SHARD_IDLE_STOP_MS,
        autoshard: AUTO_TUNING,
        ..TallyConfig::default()
    }
}

/// Opens node `n`'s engine on its current store; `None` if it crashed meanwhile.
async fn open_node(w: &Shared, n: u8) -> Option<Tally> {
    if lock(w).cfg.tier == Tier::Cluster {
        return open_whole_node(w, n).await;
    }
    for _ in 0..OPEN_ATTEMPTS_MAX {
        let (store, incarnation, start, replicated, kv, offset_ms, short_dedup, embedded) = {
            let w = lock(w);
            let node = &w.nodes[usize::from(n)];
            if !node.up {
                return None;
            }
            let offset = node.clock_offset_ms.clone();
            let short = w.cfg.short_dedup();
            (
                node.store.clone(),
                node.incarnation,
                w.start,
                w.cfg.replicas > 1,
                node.kv.clone(),
                offset,
                short,
                w.cfg.embedded,
            )
        };
        let (store, replication): (Arc<dyn tally_engine::Store>, _) = if replicated {
            match open_replication(w, n, incarnation, kv).await {
                Some(r) => {
                    let handle = tokio::runtime::Handle::current();
                    let ranges = tally_replica::RangeStore::new(r.groups().clone(), Arc::new(store), handle);
                    (Arc::new(ranges), Some(r))
                }
                None => return None,
            }
        } else {
            (Arc::new(store), None)
        };
        let parts = EngineParts {
            store,
            clock: Arc::new(SimClock { start, offset_ms }),
            config: TallyConfig {
                replicas_max: if replication.is_some() { tally_core::ranges::REPLICAS_MAX } else { 1 },
                // With `short:0`, shards sweep expired records many times a run.
                dedup_sweep_ms: if short_dedup {
                    SHORT_DEDUP_SWEEP_MS
                } else {
                    TallyConfig::default().dedup_sweep_ms
                },
                ..engine_config(n)
            },
            // An embedded engine keeps its metadata in its own store and places every
            // shard on itself.
            catalog: (!embedded).then(|| Arc::new(SimCatalog { world: w.clone(), node: n }) as _),
            placement: (!embedded)
                .then(|| Arc::new(SimPlacement { world: w.clone(), me: n, incarnation, replication }) as _),
        };
        let opened = Tally::open_parts(parts).await;
        let stray = {
            let mut g = lock(w);
            match opened {
                Ok(t) if g.alive(n, incarnation) => {
                    g.nodes[usize::from(n)].tally = Some(t.clone());
                    g.note("open", n);
                    g.undisturb(n);
                    return Some(t);
                }
                // The node crashed while it opened: that engine never serves.
                Ok(t) => Some(t),
                Err(e) => {
                    g.note("open-failed", (n, e.to_string()));
                    None
                }
            }
        };
        if let Some(t) = stray {
            t.abort();
            return None;
        }
        tokio::time::sleep(Duration::from_millis(REOPEN_BACKOFF_MS)).await;
    }
    None
}

/// Starts node `n` as a whole cluster node (tier 3) on its current stores; `None`
/// if it crashed meanwhile.
async fn open_whole_node(w: &Shared, n: u8) -> Option<Tally> {
    // This start is for the node's current life; a later restart starts the next.
    let (life, starting) = {
        let mut g = lock(w);
        let node = &g.nodes[usize::from(n)];
        let (life, starting) = (node.incarnation, node.starting.clone());
        g.note("starting", (n, life));
        (life, starting)
    };
    let _starting = starting.lock().await;
    let stopping = lock(w).nodes[usize::from(n)].stopping.take();
    if let Some(stopping) = stopping {
        let _ = stopping.await;
    }
    for _ in 0..OPEN_ATTEMPTS_MAX {
        let (store, incarnation, short_dedup) = {
            let g = lock(w);
            let node = &g.nodes[usize::from(n)];
            if !node.up || node.incarnation != life {
                return None;
            }
            (node.store.clone(), node.incarnation, g.cfg.short_dedup())
        };
        let engine = TallyConfig {
            dedup_sweep_ms: if short_dedup {
                SHORT_DEDUP_SWEEP_MS
            } else {
                TallyConfig::default().dedup_sweep_ms
            },
            ..engine_config(n)
        };
        let started = whole::start(w, n, store, engine).await;
        let stray = {
            let mut g = lock(w);
            match started {
                Ok(c) if g.alive(n, incarnation) => {
                    let tally = c.tally().clone();
                    let node = &mut g.nodes[usize::from(n)];
                    node.tally = Some(tally.clone());
                    node.replication = c.replication().cloned();
                    node.cluster = Some(c);
                    g.note("open", n);
                    g.undisturb(n);
                    return Some(tally);
                }
                Ok(c) => {
                    g.note("stray", (n, incarnation));
                    Some(c)
                }
                Err(tally_cluster::ClusterError::DataDir(why)) => {
                    // The node refuses to run on part of its data directory; its
                    // operator follows the advice and starts it on an empty one, as
                    // a new incarnation.
                    g.note("directory-refused", (n, &why));
                    g.count(FaultKind::DirectoryEmptied);
                    let node = &mut g.nodes[usize::from(n)];
                    node.store = MemStore::new();
                    node.kv = tally_replica::MemKv::new();
                    node.raft_db = None;
                    None
                }
                Err(e) => {
                    g.note("open-failed", (n, e.to_string()));
                    None
                }
            }
        };
        if let Some(c) = stray {
            // The node crashed while this start ran: it stops what it started
            // before any later start begins.
            let _ = whole::abort(c).await;
            return None;
        }
        tokio::time::sleep(Duration::from_millis(REOPEN_BACKOFF_MS)).await;
    }
    None
}

/// Node `m`'s current replica id: from its range groups in tier 3 (the cluster
/// derives it from the disk's identity), from the run's registry of disks in tier 2.
fn current_replica(g: &World, m: u8) -> Option<tally_replica::ReplicaId> {
    let node = &g.nodes[usize::from(m)];
    match g.cfg.tier {
        Tier::Cluster => node.replication.as_ref().map(|r| r.groups().replica_id()),
        _ => Some(replica::replica_id(m, node.disk)),
    }
}

/// The directory whose ranges the run's faults aim at: the run's own in tier 2, the
/// one the nodes' range groups follow in tier 3.
fn run_directory(g: &World) -> Option<tally_core::ranges::Directory> {
    match g.cfg.tier {
        Tier::Cluster => {
            g.nodes.iter().find_map(|n| n.replication.as_ref()).map(|r| r.directory().as_ref().clone())
        }
        _ => Some(replica::run_directory(g)),
    }
}

/// Share of the crashes of a replicated run that lose the node's disk. Such a crash
/// waits until the node's ranges can spare the copy ([`one_copy_may_go`]), up to
/// [`DISK_LOSS_WAIT_MS`], and keeps the disk if that moment does not come.
const DISK_LOSS_SHARE: f64 = 0.4;
/// Longest a crash that loses its disk waits for its ranges to spare the copy: a
/// new replica catches up and is promoted, and a joint change completes, within a
/// few elections.
const DISK_LOSS_WAIT_MS: u64 = 3_000;
/// How often that wait looks again.
const DISK_LOSS_POLL_MS: u64 = 50;
/// How long a leader fault (isolation, pause) lasts in replicated runs: longer than
/// an election takes (`tally_replica` draws its timeouts from 500–900 ms), shorter
/// than a run's chaos phase.
const LEADER_FAULT_MS: (u64, u64) = (1_000, 2_500);
/// Leader isolations, and leader pauses, per simulated second in replicated runs, by
/// fault level (the run draws its rate from the range).
const LEADER_FAULTS_PER_S_LIGHT: (f64, f64) = (0.0, 0.15);
const LEADER_FAULTS_PER_S_HEAVY: (f64, f64) = (0.1, 0.5);

/// Whether node `n`'s disk may be lost now without losing what its ranges need:
/// every node is up with its groups open (each committed configuration is then in
/// some node's view), and every range group that has `n`'s replica among its
/// voters, as any node sees it, has one configuration (no joint change under way),
/// at least three voters, and no other voter on a disk that is gone (a replica of
/// an earlier loss not yet replaced). Every quorum then keeps a member that holds
/// each committed entry and the others still make one; a group of two voters (R = 2, or three copies with
/// only two members left) survives no lost disk, and a second loss before the
/// first is replaced is beyond what R = 3 survives.
fn one_copy_may_go(g: &World, n: u8) -> bool {
    let current = |id: tally_replica::ReplicaId| (0..g.cfg.nodes).any(|m| current_replica(g, m) == Some(id));
    if g.nodes.iter().any(|node| !node.up || node.replication.is_none()) {
        return false;
    }
    let Some(mine) = current_replica(g, n) else { return false };
    let views = g.nodes.iter().filter_map(|node| node.replication.as_ref());
    views
        .flat_map(|r| r.groups().ranges().into_iter().filter_map(|range| r.groups().members(range).ok()))
        .all(|m| {
            let keeps_quorum = !m.joint && m.voters.len() >= 3 && m.voters.iter().all(|&v| current(v));
            !m.voters.contains(&mine) || keeps_quorum
        })
}

/// Waits, up to [`DISK_LOSS_WAIT_MS`], until node `n`'s disk may be lost
/// ([`one_copy_may_go`]): `Some(true)` then, `Some(false)` if that moment did not
/// come (the node then crashes keeping its disk), `None` if the node went down, or
/// the run healed, first (no crash is left to inject).
async fn disk_may_be_lost(w: &Shared, n: u8) -> Option<bool> {
    let until = lock(w).now() + DISK_LOSS_WAIT_MS;
    loop {
        {
            let g = lock(w);
            if !g.nodes[usize::from(n)].up || g.healed {
                return None;
            }
            if g.now() >= until {
                return Some(false);
            }
            if one_copy_may_go(&g, n) {
                return Some(true);
            }
        }
        tokio::time::sleep(Duration::from_millis(DISK_LOSS_POLL_MS)).await;
    }
}

/// How long, in simulated milliseconds, the replicas of a settled run have to
/// hold everything their leaders applied.
const CATCH_UP_WAIT_MS: u64 = 20_000;
/// How often the catch-up check looks again, in simulated milliseconds.
const CATCH_UP_POLL_MS: u64 = 100;

/// The replicas that lack entries their range's leader applied: every voter and
/// learner of a range that a node up leads, whose replica is its node's current
/// one (a replica of a lost disk never catches up: it is replaced), with what it
/// holds and what it needs.
fn replicas_behind(g: &World) -> Vec<String> {
    let current = |id: tally_replica::ReplicaId| {
        (0..g.cfg.nodes).any(|m| g.nodes[usize::from(m)].up && current_replica(g, m) == Some(id))
    };
    let mut behind = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let (Some(r), true) = (&node.replication, node.up) else { continue };
        let groups = r.groups();
        for range in groups.ranges().into_iter().filter(|&range| groups.leads(range)) {
            let Ok(members) = groups.members(range) else { continue };
            let others =
                members.voters.iter().chain(&members.learners).filter(|&&id| id != groups.replica_id());
            for &id in others.filter(|&&id| current(id)) {
                if let Err(e) = groups.caught_up(range, id) {
                    behind.push(format!("{range} led by node{}: {e}", i + 1));
                }
            }
        }
    }
    behind
}

/// Waits, up to [`CATCH_UP_WAIT_MS`], until every replica of every range holds
/// what its leader applied ([`replicas_behind`]): once the faults stopped and
/// every node is back, a range whose replicas can all talk replicates to all of
/// them, however far one fell behind.
async fn replicas_catch_up(w: &Shared) -> Result<(), String> {
    let until = lock(w).now() + CATCH_UP_WAIT_MS;
    loop {
        let behind = replicas_behind(&lock(w));
        if behind.is_empty() {
            return Ok(());
        }
        if lock(w).now() >= until {
            return Err(format!(
                "replicas still behind their leaders {CATCH_UP_WAIT_MS} ms after the run settled: {}",
                behind.join("; ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(CATCH_UP_POLL_MS)).await;
    }
}

/// The range groups that stopped on their own in the nodes up at the end of a run
/// (a fatal storage error, or a panic of openraft's core: that replica is lost to
/// its group until the node restarts), each described.
fn stopped_groups(g: &World) -> Vec<String> {
    let groups = g.nodes.iter().enumerate().filter_map(|(i, n)| Some((i, n.replication.as_ref()?)));
    groups
        .flat_map(|(i, r)| {
            r.groups()
                .stopped()
                .into_iter()
                .map(move |(range, e)| format!("node{}: {range} stopped: {e}", i + 1))
        })
        .collect()
}

/// Counts, at the end of a replicated run, the replicas of emptied disks that are
/// voters of their ranges now (each promoted in place of the node's old replica),
/// and the ranges whose voters sit on other nodes than at the start.
fn count_replica_changes(w: &Shared) {
    let mut g = lock(w);
    let Some(initial) = run_directory(&g) else { return };
    let mut moved = 0;
    for range in initial.all_ranges() {
        let leader = g.nodes.iter().filter_map(|n| n.replication.as_ref()).find(|r| r.groups().leads(range));
        let Some(held) = leader.and_then(|r| r.groups().replica_nodes(range).ok()) else { continue };
        let Ok(members) = leader.expect("a leader").groups().members(range) else { continue };
        let nodes: BTreeSet<&str> =
            members.voters.iter().filter_map(|id| held.get(id)).map(|n| n.node.as_str()).collect();
        if nodes != initial.replicas(range).iter().map(|n| n.as_str()).collect() {
            moved += 1;
        }
    }
    for _ in 0..moved {
        g.count(FaultKind::RangeMoved);
    }
    let mut replaced = 0;
    for (i, node) in g.nodes.iter().enumerate() {
        let (Some(r), true) = (&node.replication, node.disk > 0) else { continue };
        let Some(me) = current_replica(&g, i as u8) else { continue };
        for range in r.groups().ranges() {
            if r.groups().members(range).is_ok_and(|m| m.voters.contains(&me)) {
                replaced += 1;
            }
        }
    }
    for _ in 0..replaced {
        g.count(FaultKind::ReplicaReplaced);
    }
    let installed: u64 = g
        .nodes
        .iter()
        .filter_map(|n| n.replication.as_ref())
        .flat_map(|r| {
            r.groups().ranges().into_iter().map(|range| r.groups().snapshots_installed(range).unwrap_or(0))
        })
        .sum();
    for _ in 0..installed {
        g.count(FaultKind::SnapshotInstalled);
    }
}

/// Opens node `n`'s range groups for its incarnation, once; `None` if the node
/// crashed meanwhile or they cannot open.
async fn open_replication(
    w: &Shared,
    n: u8,
    incarnation: u64,
    kv: tally_replica::MemKv,
) -> Option<Arc<tally_replica::Replication>> {
    if let Some(r) = lock(w).nodes[usize::from(n)].replication.clone() {
        return Some(r);
    }
    let opened = replica::open(w, n, incarnation, kv).await;
    let mut g = lock(w);
    match opened {
        Ok((r, tending)) if g.alive(n, incarnation) => {
            let node = &mut g.nodes[usize::from(n)];
            node.replication = Some(r.clone());
            node.tending = Some(tending);
            Some(r)
        }
        Ok((r, tending)) => {
            tending.abort();
            drop(g);
            stop_groups(r);
            None
        }
        Err(e) => {
            g.note("groups-failed", (n, e));
            None
        }
    }
}

/// Stops a crashed node's range groups (their store is closed already: nothing
/// they do reaches the next incarnation).
fn stop_groups(r: Arc<tally_replica::Replication>) {
    tokio::spawn(async move { r.groups().shutdown().await });
}

/// Crashes node `n` now: its engine is aborted and cut off, and its store keeps its
/// flushed state plus a random prefix of the rest.
fn crash(w: &Shared, n: u8) {
    crash_losing(w, n, false);
}

/// Crashes node `n`; with `disk_lost` it comes back on empty stores (a new disk).
fn crash_losing(w: &Shared, n: u8, disk_lost: bool) {
    let tally = {
        let mut g = lock(w);
        if !g.nodes[usize::from(n)].up {
            return;
        }
        let unflushed = g.nodes[usize::from(n)].store.unflushed_ops();
        let keep = g.rng.random_range(0..=unflushed);
        let now = g.now();
        let view = g.view_time(n);
        let stale = g.rng.random::<bool>();
        // Tier 3: half the lost disks lose only the range replicas' store, the
        // metadata database (the directory's identity) kept; the node must refuse to
        // start on part of its directory, and its operator then empties the rest.
        let part_only = disk_lost && g.cfg.tier == Tier::Cluster && g.rng.random::<bool>();
        let node = &mut g.nodes[usize::from(n)];
        node.up = false;
        node.poisoned = false;
        node.incarnation += 1;
        node.store = node.store.restart(keep);
        node.kv = node.kv.restart();
        if disk_lost {
            if !part_only {
                node.store = MemStore::new();
            }
            node.kv = tally_replica::MemKv::new();
            // The new disk is a new replica, unless a bug makes the node rejoin as
            // the one it was.
            #[cfg(feature = "planted-bugs")]
            let same = tally_core::planted::active(tally_core::planted::Bug::CatchUpSkipped);
            #[cfg(not(feature = "planted-bugs"))]
            let same = false;
            if !same {
                node.disk += 1;
            }
        }
        let groups = node.replication.take();
        if let Some(t) = node.tending.take() {
            t.abort();
        }
        // A whole node stops as one; a lost disk takes its metadata database too.
        let whole = node.cluster.take();
        if disk_lost && !part_only {
            node.raft_db = None;
        }
        // Whether the node comes back on the metadata it had when it crashed.
        node.meta_stale = stale.then_some((0, view));
        let tally = node.tally.take();
        g.history.crashes.push((now, n));
        g.count(if disk_lost { FaultKind::DiskLost } else { FaultKind::Crash });
        if part_only {
            g.count(FaultKind::ReplicaStoreLost);
        }
        g.note("crash", (n, keep, unflushed, disk_lost, part_only));
        g.disturb(n);
        (tally, groups, whole)
    };
    let (tally, groups, whole) = tally;
    if let Some(c) = whole {
        let stopping = whole::abort(c);
        lock(w).nodes[usize::from(n)].stopping = Some(stopping);
        return;
    }
    if let Some(t) = tally {
        t.abort();
    }
    if let Some(r) = groups {
        stop_groups(r);
    }
}

/// Brings node `n` back up on its store image.
async fn restart(w: Shared, n: u8) {
    {
        let mut g = lock(&w);
        if g.nodes[usize::from(n)].up {
            return;
        }
        let now = g.now();
        let stale_for = g.rng.random_range(0..=META_STALE_AFTER_RESTART_MS_MAX);
        let node = &mut g.nodes[usize::from(n)];
        node.up = true;
        if let Some((_, as_of)) = node.meta_stale {
            node.meta_stale = Some((now + stale_for, as_of));
        }
        g.count(FaultKind::Restart);
        g.note("restart", n);
    }
    let Some(tally) = open_node(&w, n).await else { return };
    if lock(&w).cfg.tier == Tier::Cluster {
        // A whole node's metadata feed tells its engine of every change.
        return;
    }
    // When the node's view catches up with the log, it learns of every change it
    // missed, as the cluster's metadata apply loop tells its engine.
    let wait = {
        let g = lock(&w);
        let now = g.now();
        g.nodes[usize::from(n)].meta_stale.map_or(0, |(until, _)| until.saturating_sub(now))
            + g.nodes[usize::from(n)].meta_lag_ms
            + 1
    };
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let names: Vec<String> = lock(&w).meta.keys().cloned().collect();
        for name in names {
            let _ = tally.metadata_changed(&name).await;
        }
    });
}

/// Links cut by one partition: a node isolated, the cluster split in two, or one
/// direction of one link.
fn draw_partition(rng: &mut ChaCha8Rng, nodes: u8) -> (Vec<(u8, u8)>, bool) {
    let mut links = Vec::new();
    match rng.random_range(0..3u8) {
        0 => {
            let a = rng.random_range(0..nodes);
            for b in (0..nodes).filter(|&b| b != a) {
                links.push((a, b));
                links.push((b, a));
            }
            (links, false)
        }
        1 => {
            let side: Vec<bool> = (0..nodes).map(|_| rng.random::<bool>()).collect();
            for a in 0..nodes {
                for b in 0..nodes {
                    if side[usize::from(a)] != side[usize::from(b)] {
                        links.push((a, b));
                    }
                }
            }
            (links, false)
        }
        _ => {
            let a = rng.random_range(0..nodes);
            let b = (a + rng.random_range(1..nodes)) % nodes;
            links.push((a, b));
            (links, true)
        }
    }
}

/// Draws the times of a Poisson process of `rate_per_s` over `span_ms`.
pub(crate) fn poisson(rng: &mut ChaCha8Rng, rate_per_s: f64, span_ms: u64) -> Vec<u64> {
    let mut out = Vec::new();
    if rate_per_s <= 0.0 {
        return out;
    }
    let mut t = 0.0f64;
    loop {
        let u: f64 = rng.random::<f64>().max(1e-12);
        t += -u.ln() / rate_per_s * 1000.0;
        if t as u64 >= span_ms {
            return out;
        }
        out.push(t as u64);
    }
}

/// One fault, scheduled up front.
#[derive(Debug, Clone)]
enum Fault {
    Crash(u8, u64),
    Partition(Vec<(u8, u8)>, bool, u64),
    Pause(u8, u64),
    /// Isolate (or, `paused`, stop) the leader of a range, for `len` ms.
    Leader {
        range: u32,
        paused: bool,
        len: u64,
    },
    Fsync(u8),
    MetaOutage(u64),
    Reshard(usize, u16),
    Membership,
    /// Node `n`'s wall clock jumps to the offset.
    ClockJump(u8, i64),
}

/// Draws every fault of the chaos phase, in time order.
fn schedule(g: &mut World) -> Vec<(u64, Fault)> {
    let nodes = g.cfg.nodes;
    let span = g.cfg.chaos_ms;
    let rates = g.rates.clone();
    let mut out = Vec::new();
    for t in poisson(&mut g.rng, rates.crash_per_s, span) {
        let n = g.rng.random_range(0..nodes);
        let down = g.uniform(rates.down_ms);
        out.push((t, Fault::Crash(n, down)));
    }
    for t in poisson(&mut g.rng, rates.partition_per_s, span) {
        // A lone (embedded) node has no link to cut.
        if nodes < 2 {
            continue;
        }
        let (links, one_way) = draw_partition(&mut g.rng, nodes);
        let len = g.uniform(rates.partition_ms);
        out.push((t, Fault::Partition(links, one_way, len)));
    }
    for t in poisson(&mut g.rng, rates.pause_per_s, span) {
        let n = g.rng.random_range(0..nodes);
        let len = g.uniform(rates.pause_ms);
        out.push((t, Fault::Pause(n, len)));
    }
    for t in poisson(&mut g.rng, rates.meta_outage_per_s, span) {
        let len = g.uniform(rates.meta_outage_ms);
        out.push((t, Fault::MetaOutage(len)));
    }
    // Fsync failures: the level's per-flush probability at FLUSHES_PER_S flushes per
    // node and second, as a rate.
    let fsync_per_s = rates.fsync_fail * f64::from(nodes) * FLUSHES_PER_S;
    for t in poisson(&mut g.rng, fsync_per_s, span) {
        let n = g.rng.random_range(0..nodes);
        out.push((t, Fault::Fsync(n)));
    }
    // The auto counter is left to its machine (a number would make it fixed), and a
    // bounded counter's shard count never changes.
    let reshardable: Vec<usize> = (0..g.history.counters.len())
        .filter(|&i| {
            !g.history.counters[i].name.starts_with("big")
                && g.history.counters[i].name != client::AUTO_COUNTER
                && !g.history.counters[i].spec.bounded()
        })
        .collect();
    // Six in ten transitions reshard a counter, the others change the membership
    // (which members, drawn when it happens: it depends on the changes before it).
    for _ in 0..g.cfg.transitions {
        let t = g.rng.random_range(span / 10..span * 8 / 10);
        if g.rng.random_range(0..10) < 6 || nodes <= NODES_MIN {
            let c = reshardable[g.rng.random_range(0..reshardable.len())];
            let target = g.rng.random_range(1..=8u16);
            out.push((t, Fault::Reshard(c, target)));
        } else {
            out.push((t, Fault::Membership));
        }
    }
    // Replicated runs also aim at range leaders: cut one off, or stop it, for longer
    // than an election takes. Drawn last, so runs with one copy are unchanged.
    if g.cfg.replicas > 1 {
        let (lo, hi) = match g.cfg.faults {
            FaultLevel::Light => LEADER_FAULTS_PER_S_LIGHT,
            FaultLevel::Heavy => LEADER_FAULTS_PER_S_HEAVY,
        };
        for paused in [false, true] {
            let per_s = lo + (hi - lo) * g.rng.random::<f64>();
            for t in poisson(&mut g.rng, per_s, span) {
                let range = g.rng.random::<u32>();
                let len = g.uniform(LEADER_FAULT_MS);
                out.push((t, Fault::Leader { range, paused, len }));
            }
        }
    }
    out.sort_by_key(|(t, _)| *t);
    out
}

/// The node leading the `pick`-th range of the run's classes (modulo their count),
/// as the first node that is up and knows a leader sees it.
fn range_leader(g: &World, pick: u32) -> Option<u8> {
    let ranges: Vec<_> = run_directory(g)?.all_ranges().collect();
    let range = *ranges.get(pick as usize % ranges.len().max(1))?;
    g.nodes.iter().filter(|n| n.up).find_map(|n| {
        let leader = n.replication.as_ref()?.groups().leader_node(range)?;
        node_index(&tally_core::NodeId::new(&leader))
    })
}

/// Cuts `links` for `len` ms.
fn cut(w: &Shared, links: Vec<(u8, u8)>, kind: FaultKind, len: u64) {
    {
        let mut g = lock(w);
        g.count(kind);
        g.note("partition", (&links, len));
        for l in &links {
            *g.cut.entry(*l).or_default() += 1;
        }
        g.disturbance(len);
    }
    let w = w.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(len)).await;
        let mut g = lock(&w);
        for l in &links {
            if let Some(c) = g.cut.get_mut(l) {
                *c -= 1;
                if *c == 0 {
                    g.cut.remove(l);
                }
            }
        }
    });
}

/// Stops node `n` for `len` ms.
fn pause(g: &mut World, n: u8, kind: FaultKind, len: u64) {
    let now = g.now();
    g.count(kind);
    g.note("pause", (n, len));
    let node = &mut g.nodes[usize::from(n)];
    node.paused_until = node.paused_until.max(now + len);
    g.disturbance(len);
}

/// Carries out one scheduled fault.
fn inject(w: &Shared, fault: Fault) {
    match fault {
        Fault::Crash(n, down) => {
            if !lock(w).nodes[usize::from(n)].up {
                return;
            }
            let loses_disk = {
                let mut g = lock(w);
                g.cfg.replicas > 1 && g.rng.random::<f64>() < DISK_LOSS_SHARE
            };
            let w = w.clone();
            if !loses_disk {
                crash(&w, n);
            }
            tokio::spawn(async move {
                if loses_disk {
                    let Some(disk_lost) = disk_may_be_lost(&w, n).await else { return };
                    crash_losing(&w, n, disk_lost);
                }
                tokio::time::sleep(Duration::from_millis(down)).await;
                if lock(&w).healed {
                    return;
                }
                restart(w, n).await;
            });
        }
        Fault::Partition(links, one_way, len) => {
            let kind = if one_way { FaultKind::PartitionOneWay } else { FaultKind::PartitionSymmetric };
            cut(w, links, kind, len);
        }
        Fault::Pause(n, len) => pause(&mut lock(w), n, FaultKind::Pause, len),
        Fault::Leader { range, paused, len } => {
            let Some(n) = range_leader(&lock(w), range) else { return };
            if paused {
                pause(&mut lock(w), n, FaultKind::LeaderPaused, len);
            } else {
                let others = (0..lock(w).cfg.nodes).filter(|&b| b != n);
                let links = others.flat_map(|b| [(n, b), (b, n)]).collect();
                cut(w, links, FaultKind::LeaderIsolated, len);
            }
        }
        Fault::Fsync(n) => {
            {
                let mut g = lock(w);
                if !g.nodes[usize::from(n)].up || g.nodes[usize::from(n)].poisoned {
                    return;
                }
                g.count(FaultKind::FsyncFailure);
                g.note("fsync-fail", n);
                g.nodes[usize::from(n)].poisoned = true;
                g.nodes[usize::from(n)].store.fail_next_flushes(1);
                g.disturb(n);
            }
            // The operator restarts a node whose flush failed.
            let w = w.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(POISON_RESTART_MS)).await;
                if !lock(&w).nodes[usize::from(n)].poisoned {
                    return;
                }
                crash(&w, n);
                restart(w, n).await;
            });
        }
        Fault::MetaOutage(len) if lock(w).cfg.tier == Tier::Cluster => {
            // A real failover: the metadata group's leader is cut off past an election.
            let Some(n) = whole::meta_leader(&lock(w)) else { return };
            let others = (0..lock(w).cfg.nodes).filter(|&b| b != n);
            let links = others.flat_map(|b| [(n, b), (b, n)]).collect();
            cut(w, links, FaultKind::MetaOutage, len + whole::ELECTION_MS_MAX);
        }
        Fault::MetaOutage(len) => {
            let mut g = lock(w);
            let now = g.now();
            g.count(FaultKind::MetaOutage);
            g.note("meta-outage", len);
            g.meta_down_until = g.meta_down_until.max(now + len);
            g.disturbance(len);
        }
        Fault::Reshard(c, target) => {
            let (name, node, tally) = {
                let mut g = lock(w);
                let name = g.history.counters[c].name.clone();
                let nodes = g.cfg.nodes;
                let node = g.rng.random_range(0..nodes);
                g.note("reshard", (&name, target, node));
                g.reshards_requested.insert(name.clone());
                let tally = g.nodes[usize::from(node)].tally.clone();
                (name, node, tally)
            };
            let Some(t) = tally else { return };
            let _ = node;
            tokio::spawn(async move {
                let patch = tally_core::spec::SpecPatch { shards: Some(target), ..Default::default() };
                let _ = t.put_counter(&name, patch).await;
            });
        }
        Fault::Membership if lock(w).cfg.tier == Tier::Cluster => {
            tokio::spawn(whole::change_membership(w.clone()));
        }
        Fault::Membership => {
            if let Some(epoch) = begin_membership(w) {
                tokio::spawn(hand_off(w.clone(), epoch));
            }
        }
        Fault::ClockJump(n, offset) => {
            let mut g = lock(w);
            g.count(FaultKind::ClockJump);
            g.note("clock-jump", (n, offset));
            g.nodes[usize::from(n)].clock_offset_ms.store(offset, Ordering::Relaxed);
        }
    }
}

/// Commits a membership change, as the metadata group does: a node outside the ring
/// joins it, or a member leaves, and every previous member must hand off. `None`
/// while another change is still handed off (the group refuses it).
fn begin_membership(w: &Shared) -> Option<u64> {
    let mut g = lock(w);
    let last = g.placements.last().expect("the initial placement").clone();
    if !last.handoff.is_empty() {
        g.note("membership-refused", last.epoch);
        return None;
    }
    let nodes = g.cfg.nodes;
    let mut members: BTreeSet<u8> = last.members.iter().copied().collect();
    let outside: Vec<u8> = (0..nodes).filter(|n| !members.contains(n)).collect();
    if !outside.is_empty() && (members.len() <= MEMBERS_MIN || g.rng.random::<bool>()) {
        let n = outside[g.rng.random_range(0..outside.len())];
        members.insert(n);
    } else {
        let inside: Vec<u8> = members.iter().copied().collect();
        let n = inside[g.rng.random_range(0..inside.len())];
        members.remove(&n);
    }
    let next = world::PlacementVersion {
        at_ms: g.now(),
        epoch: last.epoch + 1,
        members: members.into_iter().collect(),
        handoff: last.members.iter().copied().collect(),
        previous: last.members,
    };
    g.note("membership", &next);
    let epoch = next.epoch;
    let members: Vec<tally_core::NodeId> = next.members.iter().map(|m| world::node_name(*m)).collect();
    g.placements.push(next);
    // The cluster layer of every node that is up applies the change to its range
    // directory; one that is down applies the latest when it starts.
    for node in g.nodes.iter().filter(|n| n.up) {
        if let Some(r) = &node.replication {
            r.set_members(members.iter().cloned()).expect("the run's members make a directory");
        }
    }
    Some(epoch)
}

/// Drives the hand-off of placement epoch `epoch`, as each previous member's cluster
/// layer does: it runs the engine's hand-off pass until nothing is left behind and
/// then reports itself done; the change completes when every previous member has.
async fn hand_off(w: Shared, epoch: u64) {
    loop {
        let pending: Vec<u8> = {
            let g = lock(&w);
            let last = g.placements.last().expect("the initial placement");
            if last.epoch != epoch || last.handoff.is_empty() {
                return;
            }
            last.handoff.iter().copied().collect()
        };
        for p in pending {
            let Some(tally) = lock(&w).nodes[usize::from(p)].tally.clone() else { continue };
            // Replicated shards stay in their range groups, which follow the
            // directory by themselves: nothing is handed off.
            let replicated = lock(&w).cfg.replicas > 1;
            let report = match replicated {
                true => Ok(tally_engine::HandoffReport::default()),
                false => tally.hand_off_foreign(epoch).await,
            };
            let mut g = lock(&w);
            g.note("hand-off", (p, epoch, format!("{report:?}")));
            let Ok(report) = report else { continue };
            for _ in 0..report.moved {
                g.count(FaultKind::ShardMoved);
            }
            if report.failed == 0 {
                let mut next = g.placements.last().expect("the initial placement").clone();
                next.handoff.remove(&p);
                next.at_ms = g.now();
                if next.handoff.is_empty() {
                    next.previous.clear();
                }
                g.note("hand-off-done", (p, epoch));
                g.placements.push(next);
            }
        }
        sleep_ms(HANDOFF_RETRY_MS).await;
    }
}

/// How often the run looks for range leaders that left their range.
const HAND_OVER_POLL_MS: u64 = 10;

/// Counts the range groups nodes retired, and records every range leader that
/// left its range (in a membership change) as a period
/// in which reads of that range go unanswered: the remaining voters elect another
/// leader only once the lease of the one that left runs out, so the range is
/// without a leader for up to a failover. Runs until the run ends.
async fn watch_hand_overs(w: Shared) {
    // Per node: the incarnation watched, the hand-overs it had made and the
    // groups it had retired.
    let mut seen: BTreeMap<u8, (u64, u64, u64)> = BTreeMap::new();
    loop {
        sleep_ms(HAND_OVER_POLL_MS).await;
        let mut g = lock(&w);
        let start = g.start;
        for n in 0..g.cfg.nodes {
            let node = &g.nodes[usize::from(n)];
            let (Some(r), incarnation) = (node.replication.clone(), node.incarnation) else { continue };
            let (count, retired) = (r.hand_overs(), r.groups_retired());
            let (before, retired_before) = match seen.insert(n, (incarnation, count, retired)) {
                Some((i, c, f)) if i == incarnation => (c, f),
                _ => (0, 0),
            };
            for _ in retired_before..retired {
                g.count(FaultKind::GroupRetired);
            }
            if count <= before {
                continue;
            }
            let at =
                r.last_hand_over().map_or_else(|| g.now(), |t| t.duration_since(start).as_millis() as u64);
            g.note("hand-over", (n, count));
            for _ in before..count {
                g.count(FaultKind::LeaderHandedOver);
            }
            let to_ms = at + tally_replica::LEADER_WAIT_MS;
            g.history.unanswered_calls.push(crate::history::Disturbance { from_ms: at, to_ms });
        }
    }
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Every fault ends: partitions close, nodes restart and resume, metadata is
/// writable, the network stops losing, duplicating and delaying.
async fn heal(w: &Shared) {
    let down: Vec<u8> = {
        let mut g = lock(w);
        let now = g.now();
        g.healed = true;
        g.history.healed_ms = now;
        g.cut.clear();
        g.meta_down_until = 0;
        g.note("heal", ());
        for node in &mut g.nodes {
            node.paused_until = node.paused_until.min(now);
            node.meta_stale = None;
        }
        (0..g.cfg.nodes)
            .filter(|&n| !g.nodes[usize::from(n)].up || g.nodes[usize::from(n)].poisoned)
            .collect()
    };
    for n in down {
        if lock(w).nodes[usize::from(n)].poisoned {
            crash(w, n);
        }
        restart(w.clone(), n).await;
    }
    let mut g = lock(w);
    for n in 0..g.cfg.nodes {
        g.undisturb(n);
    }
    let now = g.now();
    let open: Vec<(u8, u64)> = std::mem::take(&mut g.disturbed_since).into_iter().collect();
    for (_, from) in open {
        g.history.disturbances.push(crate::history::Disturbance { from_ms: from, to_ms: now });
    }
}

/// The whole run, on the paused runtime. Answers whether it settled in time.
async fn drive(w: Shared) -> Result<(), String> {
    let nodes = lock(&w).cfg.nodes;
    for n in 0..nodes {
        if open_node(&w, n).await.is_none() {
            return Err(format!("node{} did not open", n + 1));
        }
    }
    if lock(&w).cfg.tier == Tier::Cluster {
        whole::wait_ready(&w).await?;
        lock(&w).note("ready", ());
    }
    client::create_counters(&w).await?;
    if lock(&w).cfg.tier == Tier::Cluster {
        // The chaos phase begins once the cluster formed and holds the counters.
        let mut g = lock(&w);
        g.chaos_from_ms = g.now();
        g.healed = false;
        g.note("chaos", ());
    }
    let faults = {
        let mut g = lock(&w);
        let mut faults = schedule(&mut g);
        let jumps = std::mem::take(&mut g.clock_jumps);
        faults.extend(jumps.into_iter().map(|(t, n, offset)| (t, Fault::ClockJump(n, offset))));
        faults.sort_by_key(|(t, _)| *t);
        faults
    };
    let (chaos_from, chaos_ms) = {
        let g = lock(&w);
        (g.chaos_from_ms, g.cfg.chaos_ms)
    };
    let mut clients = client::start(&w);
    clients.extend(client::start_recreating(&w));
    if lock(&w).cfg.replicas > 1 {
        tokio::spawn(watch_hand_overs(w.clone()));
    }
    let start = lock(&w).start;
    for (t, fault) in faults {
        let t = chaos_from + t;
        let now = now_ms(start);
        if t > now {
            tokio::time::sleep(Duration::from_millis(t - now)).await;
        }
        inject(&w, fault);
    }
    let now = now_ms(start);
    tokio::time::sleep(Duration::from_millis((chaos_from + chaos_ms).saturating_sub(now))).await;
    heal(&w).await;
    for c in clients {
        let _ = c.await;
    }
    tokio::time::sleep(Duration::from_millis(SETTLE_QUIET_MS)).await;
    client::settle(&w).await;
    if lock(&w).cfg.replicas > 1 {
        replicas_catch_up(&w).await?;
    }
    Ok(())
}

/// Runs one seeded tier-2 simulation. A panic (an assertion in the engine, the core
/// or the store) is reported as a violation.
pub(crate) fn run(cfg: SimConfig) -> RunReport {
    crate::sim::guarded(cfg, run_inner)
}

fn run_inner(cfg: SimConfig) -> RunReport {
    #[cfg(feature = "planted-bugs")]
    tally_core::planted::plant(cfg.plant);
    // Every engine of the run routes on this thread: start its draws from the seed.
    tally_engine::seed_thread_routing(cfg.seed);
    // … and every range group draws its election timeouts on it.
    tally_replica::runtime::seed_thread_rng(cfg.seed);
    // … and so does tokio's own generator, which orders the wakers of a `watch`
    // channel (openraft's metrics) and the ready branches of an unbiased `select!`,
    // in a build that can seed it (`config::SEEDED_TOKIO_BUILD`).
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&cfg.seed.to_le_bytes()));
    let runtime = builder.build().expect("a current-thread runtime builds");
    let (world, outcome, stopped) = runtime.block_on(async {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let rates = FaultRates::sample(cfg.faults, &mut rng);
        let lag_max = match cfg.faults {
            FaultLevel::Light => META_LAG_MS_MAX_LIGHT,
            FaultLevel::Heavy => META_LAG_MS_MAX_HEAVY,
        };
        let (offsets, clock_jumps) = clock_plan(cfg.seed, cfg.nodes, cfg.skew_ms(), cfg.chaos_ms);
        let nodes = offsets
            .into_iter()
            .map(|offset| Node {
                clock_offset_ms: Arc::new(AtomicI64::new(offset)),
                up: true,
                incarnation: 0,
                store: MemStore::new(),
                tally: None,
                paused_until: 0,
                poisoned: false,
                meta_lag_ms: rng.random_range(0..=lag_max),
                meta_stale: None,
                kv: tally_replica::MemKv::new(),
                disk: 0,
                replication: None,
                tending: None,
                cluster: None,
                raft_db: None,
                stopping: None,
                starting: Default::default(),
            })
            .collect();
        // A refresh reads remote shards over the simulated links: it takes up to the
        // slowest round trip (a call that goes unanswered is recorded apart); with
        // range groups, the shard's leader first confirms with a quorum that it still
        // leads (a read index): a second round trip.
        let round_trips = if cfg.replicas > 1 { 2 } else { 1 };
        let refresh_slack_ms = round_trips * 2 * (NET_DELAY_MS_MAX + rates.delay_extra_ms_max);
        let history = History {
            nodes: (0..cfg.nodes).collect(),
            settle_ms: u64::MAX,
            refresh_slack_ms,
            clock_skew_ms: cfg.skew_ms(),
            recovery_ms: if cfg.replicas > 1 { tally_replica::LEADER_WAIT_MS } else { 0 },
            ..History::default()
        };
        let world: Shared = Arc::new(Mutex::new(World {
            cfg: cfg.clone(),
            start: tokio::time::Instant::now(),
            rng,
            rates,
            history,
            faults: BTreeMap::new(),
            nodes,
            cut: BTreeMap::new(),
            healed: false,
            meta_down_until: 0,
            meta: BTreeMap::new(),
            auto: BTreeMap::new(),
            classes: BTreeMap::new(),
            formations: BTreeMap::new(),
            disturbed_since: BTreeMap::new(),
            reshards_requested: BTreeSet::new(),
            placements: vec![world::PlacementVersion {
                at_ms: 0,
                epoch: 0,
                members: (0..cfg.nodes).collect(),
                previous: Vec::new(),
                handoff: BTreeSet::new(),
            }],
            rings: BTreeMap::new(),
            clock_jumps,
            trace: Xxh3::new(),
            events: 0,
            calls: 0,
            end_ms: 0,
            debug: std::env::var_os("TALLY_SIM_DEBUG").is_some(),
            nets: None,
            chaos_from_ms: 0,
        }));
        if cfg.tier == Tier::Cluster {
            let nets = whole::Nets::new(&world);
            let mut g = lock(&world);
            g.nets = Some(nets);
            // The cluster forms on a calm network (as one is set up): links lose,
            // duplicate and slow nothing until the chaos phase.
            g.healed = true;
        }
        let setup_ms = if cfg.tier == Tier::Cluster { whole::READY_WAIT_MS } else { 0 };
        let limit = Duration::from_millis(setup_ms + cfg.chaos_ms + crate::sim::SETTLE_MS_MAX);
        let outcome = match tokio::time::timeout(limit, drive(world.clone())).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(format!(
                "the run did not settle within {} ms of simulated time after healing",
                crate::sim::SETTLE_MS_MAX
            )),
        };
        // Stop every engine before the runtime goes.
        let end = lock(&world).now();
        lock(&world).end_ms = end;
        let tallies: Vec<Tally> = lock(&world).nodes.iter_mut().filter_map(|n| n.tally.take()).collect();
        // Dedup records the nodes' last lives swept: with short windows, records
        // expired and were swept within the run.
        let swept: u64 = tallies.iter().map(|t| t.stats().dedup_sweep_reads.get()).sum();
        {
            *lock(&world).faults.entry(FaultKind::DedupRecordSwept).or_default() += swept;
        }
        for t in tallies {
            t.abort();
        }
        if std::env::var_os("TALLY_SIM_RANGES").is_some() {
            let g = lock(&world);
            for (i, n) in g.nodes.iter().enumerate() {
                let Some(r) = &n.replication else { continue };
                for range in r.groups().ranges() {
                    eprintln!(
                        "RANGES node{} {range} replica={} leader={:?} members={:?} dir={:?}",
                        i + 1,
                        r.groups().is_replica(range),
                        r.groups().leadership(range),
                        r.groups().members(range).map(|m| (m.voters, m.learners, m.joint)),
                        r.directory().replicas(range)
                    );
                }
            }
        }
        count_replica_changes(&world);
        let stopped = stopped_groups(&lock(&world));
        let tending: Vec<_> = lock(&world).nodes.iter_mut().filter_map(|n| n.tending.take()).collect();
        for t in tending {
            t.abort();
        }
        // Whole nodes stop as one (their groups with them).
        let wholes: Vec<_> = lock(&world).nodes.iter_mut().filter_map(|n| n.cluster.take()).collect();
        for c in wholes {
            c.abort().await;
        }
        // The groups hold the world through their network: shut them down and let
        // go of them, or every run would keep its whole world alive.
        let groups: Vec<_> = lock(&world).nodes.iter_mut().filter_map(|n| n.replication.take()).collect();
        for r in groups {
            r.groups().shutdown().await;
        }
        // Nodes still starting when the run ended are on the networks yet.
        if let Some(nets) = lock(&world).nets.take() {
            nets.raft.close();
            nets.peers.close();
        }
        (world, outcome, stopped)
    });
    drop(runtime);
    #[cfg(feature = "planted-bugs")]
    tally_core::planted::plant(None);
    let mut g = lock(&world);
    let sim_ms = g.end_ms;
    let mut violations = check::check_all(&g.history);
    if let Some(msg) = outcome {
        violations.push(Violation { invariant: "liveness", detail: msg });
    }
    violations.extend(stopped.into_iter().map(|detail| Violation { invariant: "no-fatal", detail }));
    let history = std::mem::take(&mut g.history);
    let ops = (history.incrs.len()
        + history.reads.len()
        + history.distincts.len()
        + history.frequencies.len()
        + history.windows.len()
        + history.reconciles.len()) as u64;
    let mut h = g.trace.clone();
    std::hash::Hash::hash(&format!("{history:?}"), &mut h);
    RunReport {
        config: cfg,
        trace_hash: h.finish(),
        sim_ms,
        events: g.events,
        faults: std::mem::take(&mut g.faults),
        ops,
        violations,
        history,
    }
}
