//! Shard replication in a tier-2 run (`--replicas R`): every node runs the real
//! range groups of `tally-replica` (openraft over [`tally_replica::MemKv`]) and the
//! real [`tally_replica::Replication`] driver, whose raft messages and questions
//! cross the run's simulated links with their faults; the engine's store is the
//! real [`tally_replica::RangeStore`] over them.
//!
//! A replica's raft id belongs to its node's disk: a node whose disk was lost comes
//! back as a new replica that the range's leader must add, catch up and promote.
//! The registry of disks ([`SimPeers::replica_of`]) stands for the metadata group's
//! record of each node's store.

use super::net::{cross, node_index, wait_unpaused};
use super::world::{lock, node_name, Shared, World};
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;
use tally_core::ranges::{Directory, RangeId};
use tally_core::NodeId;
use tally_replica::network::{decode_envelope, encode_envelope};
use tally_replica::{
    MemKv, NetError, Peers, RangeEnvelope, RangeGroups, RangeInbound, RangeNetwork, RangeReply, ReplicaId,
    ReplicaNode, Replication,
};

/// A question to a peer (is your group of this range formed? do you, its leader,
/// list this replica?) left unanswered is
/// given up after this, as the cluster's is.
pub(crate) const FORMED_ASK_TIMEOUT_MS: u64 = 1_000;

/// The raft id of node `n`'s replicas on its `disk`-th disk.
pub(crate) fn replica_id(n: u8, disk: u32) -> ReplicaId {
    1 + u64::from(n) * 1_000_000 + u64::from(disk)
}

/// The directory of a run: every node an initial member, `replicas` copies.
pub(crate) fn directory(nodes: u8, replicas: u8) -> Directory {
    Directory::new((0..nodes).map(node_name), Some(replicas)).expect("a valid directory of the run")
}

/// The run's initial directory with the replica classes its metadata recorded
/// (counters that state their own replica count), as every node assigns them.
pub(crate) fn run_directory(g: &World) -> Directory {
    g.classes.iter().fold(directory(g.cfg.nodes, g.cfg.replicas), |d, (class, members)| {
        d.with_class(*class, members.iter().map(|m| node_name(*m))).expect("a recorded class")
    })
}

/// Range messages of one incarnation of node `me`, over the run's links.
pub(crate) struct SimRangeNet {
    pub(crate) world: Shared,
    pub(crate) me: u8,
    pub(crate) incarnation: u64,
}

/// A peer that cannot be reached answers as a call that timed out, never as
/// [`NetError::Unreachable`]: openraft backs off after an unreachable peer in an
/// unbiased `tokio::select!`, whose branch order tokio draws from a generator a run
/// cannot seed, so a run with it would not repeat. (Without the back-off, openraft
/// tries the peer again at its next heartbeat.)
fn unreachable(to: ReplicaId) -> NetError {
    NetError::Timeout(to)
}

impl SimRangeNet {
    async fn carry(&self, to: u8, envelope: RangeEnvelope) -> Result<RangeReply, NetError> {
        let target = envelope.to;
        let bytes = encode_envelope(&envelope);
        {
            let mut w = lock(&self.world);
            if !w.alive(self.me, self.incarnation) {
                return Err(unreachable(target));
            }
            w.note("range", (self.me, to, envelope.range.0, xxhash_rust::xxh3::xxh3_64(&bytes)));
        }
        cross(&self.world, self.me, to).await;
        wait_unpaused(&self.world, to).await;
        let (replication, to_inc) = {
            let w = lock(&self.world);
            let node = &w.nodes[usize::from(to)];
            (node.replication.clone().filter(|_| node.up), node.incarnation)
        };
        // Nothing listens on a crashed node.
        let Some(replication) = replication else { return Err(unreachable(target)) };
        let envelope = decode_envelope(&bytes)?;
        let reply = match RangeInbound::handle(&**replication.groups(), envelope).await {
            // No such replica or group there: as unreachable (see `unreachable`).
            Err(NetError::NotThisReplica { .. } | NetError::NoGroup { .. }) => Err(unreachable(target)),
            other => other,
        };
        if !lock(&self.world).alive(to, to_inc) {
            return std::future::pending().await;
        }
        cross(&self.world, to, self.me).await;
        if !lock(&self.world).alive(self.me, self.incarnation) {
            return Err(unreachable(target));
        }
        reply
    }
}

impl RangeNetwork for SimRangeNet {
    fn call(
        &self,
        node: &ReplicaNode,
        envelope: RangeEnvelope,
    ) -> BoxFuture<'static, Result<RangeReply, NetError>> {
        let net = SimRangeNet { world: self.world.clone(), me: self.me, incarnation: self.incarnation };
        let to = node_index(&NodeId::new(&node.node));
        Box::pin(async move {
            let Some(to) = to else { return Err(unreachable(envelope.to)) };
            net.carry(to, envelope).await
        })
    }
}

/// What node `me` knows of its peers: their disks, and their answers over the
/// run's links.
pub(crate) struct SimPeers {
    pub(crate) world: Shared,
    pub(crate) me: u8,
    pub(crate) incarnation: u64,
}

impl SimPeers {
    /// Asks node `to`'s replication `question` over the run's links: `None` when
    /// this incarnation is gone, `to` is down, or no answer came within
    /// [`FORMED_ASK_TIMEOUT_MS`] (a message lost on the way).
    async fn ask<T: std::hash::Hash + std::fmt::Debug>(
        &self,
        node: &NodeId,
        what: &str,
        question: impl FnOnce(&Arc<Replication>) -> T,
    ) -> Option<T> {
        let to = node_index(node)?;
        let ask = async {
            if !lock(&self.world).alive(self.me, self.incarnation) {
                return None;
            }
            cross(&self.world, self.me, to).await;
            wait_unpaused(&self.world, to).await;
            let answer = {
                let w = lock(&self.world);
                let node = &w.nodes[usize::from(to)];
                node.replication.clone().filter(|_| node.up).map(|r| question(&r))
            }?;
            cross(&self.world, to, self.me).await;
            lock(&self.world).note(what, (self.me, to, &answer));
            Some(answer)
        };
        tokio::time::timeout(Duration::from_millis(FORMED_ASK_TIMEOUT_MS), ask).await.ok().flatten()
    }
}

impl Peers for SimPeers {
    fn replica_classes(&self) -> std::collections::BTreeMap<u8, Vec<NodeId>> {
        let w = lock(&self.world);
        w.classes
            .iter()
            .map(|(class, members)| (*class, members.iter().map(|m| node_name(*m)).collect()))
            .collect()
    }

    fn formation(&self, range: RangeId) -> Option<Vec<(ReplicaId, ReplicaNode)>> {
        let w = lock(&self.world);
        let first = w.formations.get(&range.0)?;
        Some(first.iter().map(|(id, node)| (*id, ReplicaNode { node: node.clone() })).collect())
    }

    /// The metadata group's write, as the run's catalog makes it: refused while
    /// the metadata leader fails over, and by a node that is gone.
    fn form_range(
        &self,
        range: RangeId,
        voters: Vec<(ReplicaId, ReplicaNode)>,
    ) -> BoxFuture<'_, Option<Vec<(ReplicaId, ReplicaNode)>>> {
        Box::pin(async move {
            {
                let mut w = lock(&self.world);
                if w.now() < w.meta_down_until || !w.alive(self.me, self.incarnation) {
                    return None;
                }
                let record = voters.iter().map(|(id, node)| (*id, node.node.clone())).collect();
                let first = w.formations.entry(range.0).or_insert(record).clone();
                w.note("meta-form", (self.me, range.0, &first));
            }
            self.formation(range)
        })
    }

    fn replica_of(&self, node: &NodeId) -> Option<ReplicaId> {
        let n = node_index(node)?;
        let w = lock(&self.world);
        let disk = w.nodes.get(usize::from(n))?.disk;
        Some(replica_id(n, disk))
    }

    fn formed<'a>(&'a self, node: &'a NodeId, range: RangeId) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async move {
            let answer = self.ask(node, "formed", |r| (range.0, r.formed(range))).await;
            answer.map(|(_, formed)| formed)
        })
    }

    fn lists<'a>(
        &'a self,
        node: &'a NodeId,
        range: RangeId,
        replica: ReplicaId,
    ) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async move {
            let answer = self.ask(node, "lists", |r| (range.0, replica, r.lists(range, replica))).await;
            answer.and_then(|(_, _, lists)| lists)
        })
    }

    fn campaign<'a>(&'a self, node: &'a NodeId, range: RangeId, departed: ReplicaId) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let stood = |r: &Arc<Replication>| {
                r.campaign(range, departed);
                (range.0, departed)
            };
            self.ask(node, "campaign", stood).await;
        })
    }
}

/// Opens node `n`'s range groups (incarnation `incarnation`) on `kv` and starts
/// tending them; answers the replication and the tending task.
pub(crate) async fn open(
    w: &Shared,
    n: u8,
    incarnation: u64,
    kv: MemKv,
) -> Result<(Arc<Replication>, tokio::task::JoinHandle<()>), String> {
    let (nodes, replicas, disk, config) = {
        let g = lock(w);
        (g.cfg.nodes, g.cfg.replicas, g.nodes[usize::from(n)].disk, g.cfg.groups_config())
    };
    let directory = directory(nodes, replicas);
    let net = Arc::new(SimRangeNet { world: w.clone(), me: n, incarnation });
    let name = node_name(n);
    let groups =
        RangeGroups::open(name.as_str(), replica_id(n, disk), Arc::new(kv), net, directory.layout(), config)
            .await
            .map_err(|e| e.to_string())?;
    for range in directory.ranges_of(&name) {
        groups.open_range(range).await.map_err(|e| e.to_string())?;
    }
    groups.open_stored().await.map_err(|e| e.to_string())?;
    let peers = Arc::new(SimPeers { world: w.clone(), me: n, incarnation });
    let replication = Arc::new(Replication::new(name, groups, directory, peers));
    let members: Vec<_> = {
        let g = lock(w);
        g.placements.last().expect("the initial placement").members.iter().map(|m| node_name(*m)).collect()
    };
    replication.set_members(members).map_err(|e| e.to_string())?;
    let tending = tokio::spawn(replication.clone().run());
    Ok((replication, tending))
}
