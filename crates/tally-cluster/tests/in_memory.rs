//! A cluster node started in memory (`NodeWiring::InMemory`), as a simulation or an
//! embedding starts several in one process.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tally_cluster::{ClusterError, ClusterNode, ClusterNodeConfig, InMemoryWiring, Member, NodeWiring};
use tally_engine::{MemStore, SystemClock, TallyConfig};

/// Every message arrives at once.
struct Open;

impl tally_raft::RaftLinks for Open {
    fn fate(&self, _: u64, _: u64, _: tally_raft::RaftMessage<'_>) -> tally_raft::LinkFate {
        tally_raft::LinkFate::Deliver(Duration::ZERO)
    }
}

impl tally_transport::Links for Open {
    fn fate(&self, _: &str, _: &str) -> tally_transport::LinkFate {
        tally_transport::LinkFate::Deliver(Duration::ZERO)
    }
}

fn config() -> ClusterNodeConfig {
    let addr = |port| SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 77, 0, 1)), port);
    ClusterNodeConfig {
        node_id: "node1".into(),
        data_dir: "/in-memory/node1".into(),
        members: vec![Member {
            id: "node1".into(),
            raft_id: 1,
            http: addr(8080),
            peer: addr(7100),
            raft: addr(7000),
            initial: true,
        }],
        secret: "in memory: no other party".into(),
        fingerprint: 1,
        vnodes_per_node: 16,
        heartbeat_ms: 100,
        heartbeat_misses_max: 3,
        raft_heartbeat_ms: 50,
        raft_election_timeout_ms: (150, 300),
        engine: TallyConfig::default(),
        tls: None,
        replicas: 1,
        ranges_per_node: 1,
        groups: tally_cluster::GroupsConfig::default(),
    }
}

fn wiring(
    store: MemStore,
    raft_db: &sled::Db,
    raft: &tally_raft::MemRaftNet,
    peers: &tally_transport::MemNetwork,
) -> NodeWiring {
    NodeWiring::InMemory(InMemoryWiring {
        raft_db: raft_db.clone(),
        store: Arc::new(store),
        replica: None,
        clock: Arc::new(SystemClock),
        raft_net: raft.clone(),
        peers: peers.clone(),
    })
}

/// A node whose engine cannot open stops the metadata member and the transport it
/// had started: its next start finds its addresses free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_start_stops_what_it_started() {
    let raft = tally_raft::MemRaftNet::new(Arc::new(Open));
    let peers = tally_transport::MemNetwork::new(Arc::new(Open));
    let raft_db = sled::Config::new().temporary(true).open().unwrap();

    let failing = MemStore::new();
    failing.fail_next_flushes(u64::MAX);
    let err = ClusterNode::start_with(config(), wiring(failing, &raft_db, &raft, &peers)).await.err();
    assert!(matches!(err, Some(ClusterError::Engine(_))), "{err:?}");

    let node = ClusterNode::start_with(config(), wiring(MemStore::new(), &raft_db, &raft, &peers))
        .await
        .expect("the second start finds the node's addresses free");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !node.ready() {
        assert!(tokio::time::Instant::now() < deadline, "the node never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    node.tally().put_counter("c", Default::default()).await.unwrap();
    node.tally().incr("c", tally_engine::Increment::new(3)).await.unwrap();
    node.shutdown().await.unwrap();
}
