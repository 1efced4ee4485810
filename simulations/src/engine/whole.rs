//! Tier 3: whole nodes. Each simulated node is a [`tally_cluster::ClusterNode`],
//! started through the constructor `tallyd` uses ([`ClusterNode::start_with`]), on
//! stores, a clock and two networks the run hands it:
//!
//! * the engine's store is a [`MemStore`] and the range replicas' a
//!   [`tally_replica::MemKv`], torn at a crash as in tier 2;
//! * the metadata group's database is a temporary sled database, kept whole across
//!   a crash (everything it wrote survives, which a crash allows) and replaced by a
//!   new one when the disk is lost;
//! * the metadata group's RPCs cross a [`tally_raft::MemRaftNet`]: the real raft
//!   router and client, without sockets;
//! * node-to-node sessions (shard requests, range groups) cross a
//!   [`tally_transport::MemNetwork`]: the real transport's calls, limits, failure
//!   detector and gateway, without sockets.
//!
//! Both networks ask [`SimLinks`] what becomes of every message, so partitions,
//! pauses, loss and delay strike the metadata group, the range groups and shard
//! requests alike. Everything else of tally-cluster, tally-raft, tally-replica,
//! tally-transport's contract and tally-engine is the code `tallyd` runs.

use super::world::{lock, node_name, Shared};
use super::SimClock;
use rand::Rng;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tally_cluster::{ClusterNode, ClusterNodeConfig, GroupsConfig, InMemoryWiring, Member, NodeWiring};
use tally_engine::{MemStore, TallyConfig};

/// Port of every simulated node's raft address (on an address of its own).
const RAFT_PORT: u16 = 7000;
/// Port of every simulated node's node-to-node address.
const PEER_PORT: u16 = 7100;
/// Port of every simulated node's HTTP address (nothing listens).
const HTTP_PORT: u16 = 8080;
/// The transport's heartbeat in a run, in milliseconds.
const HEARTBEAT_MS: u64 = 100;
/// Missed heartbeats before a peer is down.
const HEARTBEAT_MISSES_MAX: u32 = 3;
/// The metadata group's heartbeat in a run, in milliseconds.
const RAFT_HEARTBEAT_MS: u64 = 50;
/// The metadata group's election timeouts in a run, in milliseconds.
const RAFT_ELECTION_TIMEOUT_MS: (u64, u64) = (300, 600);
/// Ranges per member of replicated runs.
const RANGES_PER_NODE: u32 = 2;
/// How long setup waits for every node to be ready, in milliseconds.
pub(crate) const READY_WAIT_MS: u64 = 20_000;

/// The simulated address of node `n`, `10.77.0.(n+1)` (nothing is bound to it).
fn addr(n: u8, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 77, 0, n + 1)), port)
}

/// Every node of a run of `nodes`.
fn members(nodes: u8) -> Vec<Member> {
    (0..nodes)
        .map(|n| Member {
            id: node_name(n).to_string(),
            raft_id: u64::from(n) + 1,
            http: addr(n, HTTP_PORT),
            peer: addr(n, PEER_PORT),
            raft: addr(n, RAFT_PORT),
            initial: true,
        })
        .collect()
}

/// Node `n`'s config, as a cluster config file would give it.
fn config(n: u8, nodes: u8, replicas: u8, engine: TallyConfig, groups: GroupsConfig) -> ClusterNodeConfig {
    ClusterNodeConfig {
        node_id: node_name(n).to_string(),
        data_dir: format!("/simulated/node{}", u16::from(n) + 1).into(),
        members: members(nodes),
        secret: "simulated cluster: no sockets, no other party".into(),
        fingerprint: 0x51_4d_75_1a_7e,
        vnodes_per_node: super::world::VNODES_PER_NODE,
        heartbeat_ms: HEARTBEAT_MS,
        heartbeat_misses_max: HEARTBEAT_MISSES_MAX,
        raft_heartbeat_ms: RAFT_HEARTBEAT_MS,
        raft_election_timeout_ms: RAFT_ELECTION_TIMEOUT_MS,
        engine,
        tls: None,
        replicas,
        ranges_per_node: RANGES_PER_NODE,
        groups,
    }
}

/// The run's say over every message of both networks. It holds the world weakly:
/// the networks live in it.
pub(crate) struct SimLinks {
    pub(crate) world: std::sync::Weak<std::sync::Mutex<super::world::World>>,
}

impl SimLinks {
    /// What becomes of one message from node `from` to node `to`: cut and lost
    /// messages are lost; a delivered one leaves once its sender is not paused and
    /// arrives after the link's delay, once its receiver is not paused.
    fn fate(&self, from: u8, to: u8) -> Duration {
        // A run that ended carries nothing.
        let Some(world) = self.world.upgrade() else { return Duration::MAX };
        let (now, from_paused, to_paused) = {
            let g = lock(&world);
            let paused = |n: u8| g.nodes.get(usize::from(n)).map_or(0, |node| node.paused_until);
            (g.now(), paused(from), paused(to))
        };
        let d = match super::net::fate(&world, from, to) {
            super::net::Fate::Deliver(d) => d,
            super::net::Fate::Lost | super::net::Fate::Cut => return Duration::MAX,
        };
        let leaves = now.max(from_paused);
        let arrives = (leaves + d).max(to_paused);
        Duration::from_millis(arrives - now)
    }
}

impl SimLinks {
    /// Whether a metadata RPC that would arrive breaks off instead (runs with
    /// deletions): its caller learns at once that it failed, and resends. A
    /// forwarded proposal's answer breaks off more often than the rest, so that
    /// proposals the leader applied are resent.
    fn reset(&self, message: tally_raft::RaftMessage<'_>) -> bool {
        let Some(world) = self.world.upgrade() else { return false };
        let mut g = lock(&world);
        let share = match message.answer && message.rpc == tally_raft::rpc::PATH_CLIENT_WRITE {
            true => crate::config::META_PROPOSAL_RESET_SHARE,
            false => crate::config::META_RESET_SHARE,
        };
        if g.healed || !g.cfg.deletions() || g.rng.random::<f64>() >= share {
            return false;
        }
        g.count(crate::history::FaultKind::MetaReset);
        true
    }
}

impl tally_raft::RaftLinks for SimLinks {
    fn fate(&self, from: u64, to: u64, message: tally_raft::RaftMessage<'_>) -> tally_raft::LinkFate {
        let index = |id: u64| u8::try_from(id.saturating_sub(1)).unwrap_or(u8::MAX);
        match SimLinks::fate(self, index(from), index(to)) {
            Duration::MAX => tally_raft::LinkFate::Lose,
            _ if self.reset(message) => tally_raft::LinkFate::Reset,
            d => tally_raft::LinkFate::Deliver(d),
        }
    }
}

impl tally_transport::Links for SimLinks {
    fn fate(&self, from: &str, to: &str) -> tally_transport::LinkFate {
        let index = |name: &str| super::net::node_index(&tally_core::NodeId::new(name)).unwrap_or(u8::MAX);
        match SimLinks::fate(self, index(from), index(to)) {
            Duration::MAX => tally_transport::LinkFate::Lose,
            d => tally_transport::LinkFate::Deliver(d),
        }
    }
}

/// The two networks of a run.
#[derive(Clone)]
pub(crate) struct Nets {
    pub(crate) raft: tally_raft::MemRaftNet,
    pub(crate) peers: tally_transport::MemNetwork,
}

impl Nets {
    pub(crate) fn new(world: &Shared) -> Self {
        Self {
            raft: tally_raft::MemRaftNet::new(Arc::new(SimLinks { world: Arc::downgrade(world) })),
            peers: tally_transport::MemNetwork::new(Arc::new(SimLinks { world: Arc::downgrade(world) })),
        }
    }
}

/// A new metadata database: a new disk.
pub(crate) fn new_raft_db() -> sled::Db {
    sled::Config::new().temporary(true).flush_every_ms(None).open().expect("a temporary sled database opens")
}

/// Starts node `n` as a whole cluster node on its current stores.
pub(crate) async fn start(
    w: &Shared,
    n: u8,
    store: MemStore,
    engine: TallyConfig,
) -> Result<ClusterNode, tally_cluster::ClusterError> {
    let (wiring, cfg) = {
        let mut g = lock(w);
        let nodes = g.cfg.nodes;
        let replicas = g.cfg.replicas;
        let groups = g.cfg.groups_config();
        let start = g.start;
        let nets = g
            .nets
            .clone()
            .ok_or_else(|| tally_cluster::ClusterError::Config("the run has no networks".into()))?;
        let node = &mut g.nodes[usize::from(n)];
        let raft_db = node.raft_db.get_or_insert_with(new_raft_db).clone();
        let replica: Option<Arc<dyn tally_replica::storage::KvStore>> =
            (replicas > 1).then(|| Arc::new(node.kv.clone()) as Arc<dyn tally_replica::storage::KvStore>);
        let wiring = InMemoryWiring {
            raft_db,
            store: Arc::new(store),
            replica,
            clock: Arc::new(SimClock { start, offset_ms: node.clock_offset_ms.clone() }),
            raft_net: nets.raft,
            peers: nets.peers,
        };
        (wiring, config(n, nodes, replicas, engine, groups))
    };
    ClusterNode::start_with(cfg, NodeWiring::InMemory(wiring)).await
}

/// Stops a crashed node's cluster node (its stores are closed already). The node
/// starts again only once this ends: two metadata members must never share one
/// database.
pub(crate) fn abort(node: ClusterNode) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move { node.abort().await })
}

/// Waits until every node has been ready (a metadata leader, caught up, its store
/// registered, its sessions and groups up) at least once, or `READY_WAIT_MS`
/// passed. Not all at one instant: over lossy links a node's readiness flickers as
/// its failure detector suspects a peer.
pub(crate) async fn wait_ready(w: &Shared) -> Result<(), String> {
    let start = lock(w).now();
    let mut was_ready = vec![false; usize::from(lock(w).cfg.nodes)];
    loop {
        let now = {
            let g = lock(w);
            for (i, n) in g.nodes.iter().enumerate() {
                was_ready[i] |= n.cluster.as_ref().is_some_and(ClusterNode::ready);
            }
            g.now()
        };
        if was_ready.iter().all(|r| *r) {
            return Ok(());
        }
        if now - start > READY_WAIT_MS {
            let never: Vec<String> = (0..was_ready.len())
                .filter(|&i| !was_ready[i])
                .map(|i| node_name(i as u8).to_string())
                .collect();
            return Err(format!("nodes never ready within {READY_WAIT_MS} ms: {never:?}"));
        }
        tokio::time::sleep(Duration::from_millis(tally_cluster::READY_POLL_MS)).await;
    }
}

/// How long a metadata failover fault outlasts its drawn length: the longest
/// election timeout, so the group elects another leader.
pub(crate) const ELECTION_MS_MAX: u64 = RAFT_ELECTION_TIMEOUT_MS.1;

/// The metadata group's leader, as the first node that is up and knows one sees it.
pub(crate) fn meta_leader(g: &super::world::World) -> Option<u8> {
    g.nodes.iter().filter(|n| n.up).find_map(|n| {
        let leader = n.cluster.as_ref()?.leader()?;
        super::net::node_index(&tally_core::NodeId::new(&leader))
    })
}

/// A membership change through a node that is up, as an operator makes it: a node
/// outside the ring joins, or a member leaves. The cluster refuses it while the
/// last change is still handed off, or when it would leave range groups of two.
pub(crate) async fn change_membership(w: Shared) {
    use rand::Rng;
    let (node, change) = {
        let mut g = lock(&w);
        let up: Vec<usize> = (0..g.nodes.len()).filter(|&i| g.nodes[i].cluster.is_some()).collect();
        if up.is_empty() {
            return;
        }
        let via = up[g.rng.random_range(0..up.len())];
        let node = g.nodes[via].cluster.clone().expect("an up node");
        let (members, epoch, handoff) = node.placement();
        let nodes = g.cfg.nodes;
        let outside: Vec<String> =
            (0..nodes).map(|n| node_name(n).to_string()).filter(|n| !members.contains(n)).collect();
        let join = !outside.is_empty() && (members.len() <= 2 || g.rng.random::<bool>());
        let change = if join {
            (true, outside[g.rng.random_range(0..outside.len())].clone())
        } else {
            (false, members[g.rng.random_range(0..members.len())].clone())
        };
        g.note("membership", (via, epoch, &handoff, &change));
        (node, change)
    };
    let answer = match &change {
        (true, id) => node.add_member(id).await,
        (false, id) => node.remove_member(id).await,
    };
    let mut g = lock(&w);
    match answer {
        Ok(view) => {
            g.count(crate::history::FaultKind::MembershipChange);
            g.note("membership-done", format!("{view:?}"));
        }
        Err(e) => g.note("membership-refused", e.to_string()),
    }
}
