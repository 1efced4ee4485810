//! `TestCluster`: a metadata group of in-process nodes on 127.0.0.1, each with its
//! own sled directory, that tests kill and restart by id.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tally_core::meta::MetaCommand;
use tally_core::name::CounterName;
use tally_raft::{MetaRaft, MetaRaftConfig, MetaState, RaftStorage, Request};
use tempfile::TempDir;
use tokio::net::TcpListener;

/// Heartbeat of test clusters, in milliseconds (tighter than production's 250 to
/// keep failover tests short, still loose enough for a loaded 2-core machine).
pub const TEST_HEARTBEAT_MS: u64 = 150;
/// Election timeouts of test clusters, in milliseconds.
pub const TEST_ELECTION_MIN_MS: u64 = 750;
/// See [`TEST_ELECTION_MIN_MS`].
pub const TEST_ELECTION_MAX_MS: u64 = 1_500;
/// How long tests wait for a leader or for replicas to converge, in milliseconds.
pub const SETTLE_TIMEOUT_MS: u64 = 15_000;

/// Serializes the cluster tests of one binary: clusters running side by side on
/// two cores would steal each other's heartbeats.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Prints a phase marker, so a failing test shows how far it got.
pub fn phase(what: &str) {
    eprintln!("--- {what}");
}

/// A cluster of nodes 1..=n.
pub struct TestCluster {
    voters: BTreeMap<u64, String>,
    dirs: BTreeMap<u64, TempDir>,
    nodes: BTreeMap<u64, MetaRaft>,
    tune: fn(&mut MetaRaftConfig),
}

impl TestCluster {
    /// Reserves addresses for nodes 1..=n and starts the ones in `running`.
    pub async fn start(n: u64, running: &[u64], tune: fn(&mut MetaRaftConfig)) -> Self {
        let mut listeners = BTreeMap::new();
        let mut voters = BTreeMap::new();
        for id in 1..=n {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind port 0");
            voters.insert(id, l.local_addr().unwrap().to_string());
            listeners.insert(id, l);
        }
        let dirs = (1..=n).map(|id| (id, tempfile::tempdir().expect("temp dir"))).collect();
        let mut cluster = Self { voters, dirs, nodes: BTreeMap::new(), tune };
        for id in running {
            let l = listeners.remove(id).expect("node id within 1..=n");
            cluster.start_node(*id, l).await;
        }
        cluster
    }

    fn config(&self, id: u64) -> MetaRaftConfig {
        let mut cfg =
            MetaRaftConfig::new(id, self.voters.clone(), RaftStorage::Path(self.dirs[&id].path().into()));
        cfg.heartbeat_ms = TEST_HEARTBEAT_MS;
        cfg.election_timeout_min_ms = TEST_ELECTION_MIN_MS;
        cfg.election_timeout_max_ms = TEST_ELECTION_MAX_MS;
        cfg.secret = Some(tally_raft::RaftSecret::new("raft-test-secret"));
        (self.tune)(&mut cfg);
        cfg
    }

    async fn start_node(&mut self, id: u64, listener: TcpListener) {
        let node = MetaRaft::start_with_listener(self.config(id), listener).await.expect("node starts");
        self.nodes.insert(id, node);
    }

    /// The running node `id`.
    pub fn node(&self, id: u64) -> &MetaRaft {
        self.nodes.get(&id).unwrap_or_else(|| panic!("node {id} is not running"))
    }

    /// Ids of the running nodes.
    pub fn running(&self) -> Vec<u64> {
        self.nodes.keys().copied().collect()
    }

    /// Stops node `id` (raft and its endpoints); its directory stays.
    pub async fn kill(&mut self, id: u64) {
        let node = self.nodes.remove(&id).unwrap_or_else(|| panic!("node {id} is not running"));
        node.shutdown().await;
    }

    /// Starts node `id` again from its directory, on its old address.
    pub async fn restart(&mut self, id: u64) {
        let addr = self.voters[&id].clone();
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(&addr).await {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("rebinding {addr}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("cannot rebind {addr}: {e}"),
            }
        };
        self.start_node(id, listener).await;
    }

    /// Stops every running node.
    pub async fn kill_all(&mut self) {
        for id in self.running() {
            self.kill(id).await;
        }
    }

    /// Waits until every running node knows the same leader, which is running, and
    /// has registered its store incarnation (so request counts stay predictable).
    pub async fn wait_leader(&self) -> u64 {
        let deadline = Instant::now() + Duration::from_millis(SETTLE_TIMEOUT_MS);
        loop {
            let leaders: Vec<Option<u64>> = self.nodes.values().map(|n| n.leader()).collect();
            let registered =
                self.nodes.values().all(|n| n.store_of(n.node_id()).is_some_and(|r| r.store == n.store_id()));
            if let Some(Some(l)) = leaders.first() {
                if leaders.iter().all(|x| *x == Some(*l)) && self.nodes.contains_key(l) && registered {
                    return *l;
                }
            }
            assert!(Instant::now() < deadline, "no agreed leader within {SETTLE_TIMEOUT_MS} ms: {leaders:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every running node has applied the same state, and returns it.
    pub async fn wait_converged(&self) -> MetaState {
        let deadline = Instant::now() + Duration::from_millis(SETTLE_TIMEOUT_MS);
        loop {
            let states: Vec<MetaState> = self.nodes.values().map(|n| n.state()).collect();
            if states.windows(2).all(|w| w[0] == w[1]) {
                return states.into_iter().next().expect("a running node");
            }
            if Instant::now() >= deadline {
                let counts: Vec<u64> = states.iter().map(|s| s.applied_requests).collect();
                panic!(
                    "replicas did not converge within {SETTLE_TIMEOUT_MS} ms; applied requests: {counts:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A counter name.
pub fn name(s: &str) -> CounterName {
    CounterName::new(s).expect("valid test name")
}

/// A `Counter` request at a fixed clock.
pub fn counter(n: &str, cmd: MetaCommand) -> Request {
    Request::Counter { name: name(n), cmd, now_ms: 1_700_000_000_000 }
}
