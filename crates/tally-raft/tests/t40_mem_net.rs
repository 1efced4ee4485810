//! Metadata groups on an in-memory network ([`MemRaftNet`]): one process, one
//! current-thread runtime on paused time, no sockets, each message as a test's
//! [`RaftLinks`] says.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tally_raft::{LinkFate, MemRaftNet, MetaRaft, MetaRaftConfig, NodeId, RaftLinks, RaftStorage};

/// Longest a test waits for something on its virtual clock.
const SETTLE: Duration = Duration::from_secs(60);

/// Links with one fixed delay, that lose every message to or from the nodes in
/// `cut`, and remember every fate they were asked.
struct Links {
    delay: Duration,
    cut: Mutex<BTreeSet<NodeId>>,
    asked: Mutex<Vec<(NodeId, NodeId)>>,
}

impl Links {
    fn new(delay_ms: u64) -> Arc<Self> {
        Arc::new(Self {
            delay: Duration::from_millis(delay_ms),
            cut: Default::default(),
            asked: Default::default(),
        })
    }

    fn cut(&self, node: NodeId) {
        self.cut.lock().unwrap().insert(node);
    }

    fn heal(&self) {
        self.cut.lock().unwrap().clear();
    }
}

impl RaftLinks for Links {
    fn fate(&self, from: NodeId, to: NodeId, _: tally_raft::RaftMessage<'_>) -> LinkFate {
        self.asked.lock().unwrap().push((from, to));
        let cut = self.cut.lock().unwrap();
        if cut.contains(&from) || cut.contains(&to) {
            LinkFate::Lose
        } else {
            LinkFate::Deliver(self.delay)
        }
    }
}

/// Nodes 1..=n of one group on one network, each on a temporary sled database it
/// keeps across restarts.
struct Group {
    net: MemRaftNet,
    voters: BTreeMap<NodeId, String>,
    dbs: BTreeMap<NodeId, sled::Db>,
    nodes: BTreeMap<NodeId, MetaRaft>,
    secret: bool,
}

impl Group {
    async fn start(n: u64, links: Arc<dyn RaftLinks>, secret: bool) -> Self {
        let voters = (1..=n).map(|id| (id, format!("10.0.0.{id}:7100"))).collect();
        let dbs =
            (1..=n).map(|id| (id, sled::Config::new().temporary(true).open().expect("temp db"))).collect();
        let mut group = Self { net: MemRaftNet::new(links), voters, dbs, nodes: BTreeMap::new(), secret };
        for id in 1..=n {
            group.restart(id).await;
        }
        group
    }

    fn config(&self, id: NodeId) -> MetaRaftConfig {
        let mut cfg = MetaRaftConfig::new(id, self.voters.clone(), RaftStorage::Db(self.dbs[&id].clone()));
        if self.secret {
            cfg.secret = Some(tally_raft::RaftSecret::new("mem-net-test-secret"));
        }
        cfg
    }

    async fn restart(&mut self, id: NodeId) {
        let node = MetaRaft::start_in(self.config(id), self.net.clone()).await.expect("node starts");
        self.nodes.insert(id, node);
    }

    async fn stop(&mut self, id: NodeId) {
        self.nodes.remove(&id).expect("running").shutdown().await;
    }

    async fn stop_all(&mut self) {
        for (_, node) in std::mem::take(&mut self.nodes) {
            node.shutdown().await;
        }
    }

    fn node(&self, id: NodeId) -> &MetaRaft {
        &self.nodes[&id]
    }

    /// The leader every running node agrees on.
    async fn leader(&self) -> NodeId {
        settle("an agreed leader", || {
            let leaders: BTreeSet<_> = self.nodes.values().map(MetaRaft::leader).collect();
            match leaders.into_iter().collect::<Vec<_>>()[..] {
                [Some(l)] if self.nodes.contains_key(&l) => Some(l),
                _ => None,
            }
        })
        .await
    }

    fn follower(&self, leader: NodeId) -> NodeId {
        *self.nodes.keys().find(|id| **id != leader).expect("a follower")
    }

    /// Waits until every running node has applied range `range`'s formation.
    async fn applied_everywhere(&self, range: u32) {
        settle("the write applied everywhere", || {
            self.nodes.values().all(|n| n.formation(range).is_some()).then_some(())
        })
        .await;
    }
}

/// Polls `done` every 10 ms of virtual time until it answers, for up to [`SETTLE`].
async fn settle<T>(what: &str, mut done: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        if let Some(v) = done() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within {SETTLE:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn formation(id: NodeId) -> Vec<(u64, String)> {
    vec![(id, format!("node-{id}"))]
}

/// Elects, writes on a follower (forwarded to the leader), and brings a node that
/// was down during a write back on its own database.
async fn elect_forward_restart(n: u64, secret: bool) {
    let mut group = Group::start(n, Links::new(2), secret).await;
    let leader = group.leader().await;
    let follower = group.follower(leader);
    let answer = group.node(follower).form_range(1, formation(1)).await.expect("forwarded write");
    assert_eq!(answer, formation(1));
    group.applied_everywhere(1).await;

    group.stop(follower).await;
    let writer = group.leader().await;
    group.node(writer).form_range(2, formation(2)).await.expect("write without the stopped node");
    assert_eq!(group.node(writer).formation(2), Some(formation(2)));
    group.restart(follower).await;
    group.applied_everywhere(2).await;
    let want = group.node(writer).state();
    settle("the restarted node caught up", || (group.node(follower).state() == want).then_some(())).await;
    group.stop_all().await;
}

#[tokio::test(start_paused = true)]
async fn three_nodes_elect_forward_a_write_and_a_restarted_node_catches_up() {
    elect_forward_restart(3, false).await;
}

#[tokio::test(start_paused = true)]
async fn five_nodes_elect_forward_a_write_and_a_restarted_node_catches_up() {
    elect_forward_restart(5, false).await;
}

#[tokio::test(start_paused = true)]
async fn in_memory_calls_prove_the_secret_as_socket_calls_do() {
    elect_forward_restart(3, true).await;
}

#[tokio::test(start_paused = true)]
async fn a_cut_node_misses_commits_and_catches_up_once_healed() {
    let links = Links::new(2);
    let mut group = Group::start(3, links.clone(), false).await;
    let leader = group.leader().await;
    let cut = group.follower(leader);
    links.cut(cut);
    let writer = *group.nodes.keys().find(|id| **id != cut && **id != leader).expect("the other follower");
    group.node(writer).form_range(1, formation(1)).await.expect("two of three commit");
    for id in [leader, writer] {
        assert_eq!(group.node(id).formation(1), Some(formation(1)), "node {id}");
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(group.node(cut).formation(1), None, "the cut node saw the write");

    links.heal();
    group.applied_everywhere(1).await;
    let leader = group.leader().await;
    let want = group.node(leader).state();
    settle("the healed node caught up", || (group.node(cut).state() == want).then_some(())).await;
    group.stop_all().await;
}

/// One node at one instant: its leader, term, last log index and last applied index.
type Sample = (Option<NodeId>, u64, Option<u64>, Option<u64>);

/// What one run of the determinism scenario saw.
#[derive(Debug, PartialEq, Eq)]
struct Trace {
    stores: Vec<(NodeId, u128)>,
    /// Every 50 ms of virtual time, per node.
    samples: Vec<Vec<Sample>>,
    fates: Vec<(NodeId, NodeId)>,
}

async fn scenario(seed: u64) -> Trace {
    tally_raft_kit::seed_thread_rng(seed);
    let links = Links::new(3);
    let mut group = Group::start(3, links.clone(), false).await;
    let stores = group.nodes.iter().map(|(id, n)| (*id, n.store_id().0)).collect();
    let mut samples = Vec::new();
    let mut writes = Vec::new();
    for tick in 0..200 {
        if tick == 80 {
            let node = group.node(2).clone();
            writes.push(tokio::spawn(async move { node.form_range(1, formation(1)).await }));
        }
        if tick == 120 {
            links.cut(3);
        }
        if tick == 160 {
            links.heal();
        }
        samples.push(
            group
                .nodes
                .values()
                .map(|n| {
                    let m = n.raft().metrics().borrow().clone();
                    (m.current_leader, m.current_term, m.last_log_index, m.last_applied.map(|l| l.index))
                })
                .collect(),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for w in writes {
        w.await.expect("write task").expect("write");
    }
    group.stop_all().await;
    // Let what the nodes left running (answers in flight) finish before the next run.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let fates = links.asked.lock().unwrap().clone();
    Trace { stores, samples, fates }
}

#[tokio::test(start_paused = true)]
async fn one_seed_runs_the_same_twice() {
    let first = scenario(7).await;
    assert!(first.samples.last().unwrap().iter().all(|s| s.0.is_some()), "no leader: {:?}", first.samples);
    let again = scenario(7).await;
    assert_eq!(first.stores, again.stores);
    assert_eq!(first.samples, again.samples);
    assert_eq!(first.fates.len(), again.fates.len());
    assert_eq!(first.fates, again.fates);
    let other = scenario(8).await;
    assert_ne!(first.stores, other.stores);
}
