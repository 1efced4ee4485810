//! t20: a three-node metadata group in one process, over real HTTP on 127.0.0.1.
//!
//! * t21 — writes through every node (followers forward to the leader) converge on
//!   every replica; followers read linearizably; subscribers hear every change.
//! * t22 — killing the leader elects a new one within a few seconds, writes go on,
//!   and the old leader restarted from its directory catches up.
//! * t23 — a full-cluster restart keeps all metadata and applies no entry twice.
//! * t24 — with a small snapshot policy the log is purged, and a node that missed
//!   it all is brought up by installing a snapshot.

mod common;

use common::{counter, name, phase, TestCluster, SERIAL};
use std::time::{Duration, Instant};
use tally_core::meta::{MetaCommand, MetaEffect};
use tally_core::spec::SpecPatch;
use tally_raft::{Effect, MetaChange, MetaRaftConfig, Rejection, Request, Response};

fn defaults(_: &mut MetaRaftConfig) {}

fn put_shards(shards: u16) -> MetaCommand {
    MetaCommand::Put(SpecPatch { shards: Some(shards), ..Default::default() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t21_writes_through_every_node_converge() {
    let _serial = SERIAL.lock().await;
    let cluster = TestCluster::start(3, &[1, 2, 3], defaults).await;
    let leader = cluster.wait_leader().await;
    phase(&format!("leader is node {leader}"));
    let follower = cluster.running().into_iter().find(|id| *id != leader).unwrap();
    let mut changes = cluster.node(follower).subscribe();

    phase("every node proposes a counter and a member");
    for id in cluster.running() {
        let node = cluster.node(id);
        let created = node.write(counter(&format!("c-{id}"), MetaCommand::Ensure)).await.unwrap();
        let (meta, effect) = created.into_counter_result().unwrap().unwrap();
        assert_eq!(effect, MetaEffect::Created);
        assert_eq!(meta.unwrap().version, 1);
        let now = node.membership();
        let mut members = now.members.clone();
        members.push(format!("node{id}"));
        let set = Request::SetMembers { from_epoch: now.placement_epoch, previous: vec![], members };
        let added = node.write(set).await.unwrap();
        assert!(matches!(added, Response::Members(Ok(ref v)) if v.changed), "{added:?}");
        for node_id in now.members {
            let done = Request::HandoffDone { node: node_id, epoch: now.placement_epoch + 1 };
            node.write(done).await.unwrap();
        }
    }

    phase("a refusal is an applied result, not an error");
    let refused = cluster.node(follower).write(counter("c-1", put_shards(0))).await.unwrap();
    assert!(matches!(refused, Response::Counter(Err(Rejection::OutOfRange { .. }))), "{refused:?}");

    phase("replicas converge");
    let state = cluster.wait_converged().await;
    assert_eq!(state.counters.len(), 3);
    assert_eq!(state.members, vec!["node1", "node2", "node3"]);
    assert_eq!(state.placement_epoch, 3);
    // Besides the writes, every node registered its store once.
    assert_eq!(state.applied_requests, 10 + 3);
    for id in cluster.running() {
        assert!(cluster.node(id).counter("c-2").is_some());
        assert_eq!(cluster.node(id).members(), (state.members.clone(), 3));
        assert_eq!(cluster.node(id).leader(), Some(leader));
        assert!(cluster.node(id).term() >= 1);
    }

    phase("a follower reads linearizably through the leader");
    let read = cluster.node(follower).counter_linearizable("c-3").await.unwrap();
    assert_eq!(read, state.counters.get("c-3").cloned());
    assert_eq!(cluster.node(follower).counter_linearizable("nope").await.unwrap(), None);

    phase("malformed input to the raft endpoints is refused, and the node goes on");
    let http = reqwest::Client::new();
    let addr = cluster.node(follower).addr();
    for (path, body) in [
        ("/raft/append", "{not json"),
        ("/raft/vote", "{}"),
        ("/raft/snapshot", "[1,2,3]"),
        ("/raft/client-write", r#"{"Counter":{"name":"bad name","cmd":"Ensure","now_ms":1}}"#),
        ("/raft/read", r#"{"name":""}"#),
    ] {
        let resp = http
            .post(format!("http://{addr}{path}"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_client_error(), "{path} answered {}", resp.status());
    }
    assert!(cluster.node(follower).write(counter("c-1", MetaCommand::Ensure)).await.is_ok());

    phase("the follower's subscriber heard every change");
    let mut heard = Vec::new();
    while let Ok(c) = changes.try_recv() {
        heard.push(c);
    }
    assert_eq!(heard.iter().filter(|c| matches!(c, MetaChange::Counter(_))).count(), 3, "{heard:?}");
    assert!(heard.iter().any(|c| matches!(c, MetaChange::Members(v)
        if v.members == state.members && v.placement_epoch == 3)));

    cluster.node(1).shutdown().await;
    cluster.node(2).shutdown().await;
    cluster.node(3).shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t22_leader_failover_and_catch_up() {
    let _serial = SERIAL.lock().await;
    let mut cluster = TestCluster::start(3, &[1, 2, 3], defaults).await;
    let old = cluster.wait_leader().await;
    for i in 0..5 {
        cluster.node(old).write(counter(&format!("before-{i}"), MetaCommand::Ensure)).await.unwrap();
    }
    cluster.wait_converged().await;

    phase(&format!("kill leader {old}"));
    let killed_at = Instant::now();
    cluster.kill(old).await;
    let new = cluster.wait_leader().await;
    let failover = killed_at.elapsed();
    phase(&format!("node {new} leads after {failover:?}"));
    assert_ne!(new, old);
    assert!(failover < Duration::from_secs(8), "failover took {failover:?}");

    phase("writes go on through both survivors");
    for id in cluster.running() {
        for i in 0..3 {
            let r = cluster
                .node(id)
                .write(counter(&format!("after-{id}-{i}"), MetaCommand::Ensure))
                .await
                .unwrap();
            assert!(matches!(r, Response::Counter(Ok((Some(_), Effect::Created)))), "{r:?}");
        }
    }

    phase(&format!("restart {old}; it catches up"));
    cluster.restart(old).await;
    let state = cluster.wait_converged().await;
    assert_eq!(state.counters.len(), 5 + 6);
    assert!(cluster.node(old).counter("after-1-0").or(cluster.node(old).counter("after-2-0")).is_some());
    assert_eq!(cluster.wait_leader().await, new, "a caught-up restart does not disturb the leader");

    cluster.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t23_full_restart_keeps_everything_and_applies_nothing_twice() {
    let _serial = SERIAL.lock().await;
    let mut cluster = TestCluster::start(3, &[1, 2, 3], defaults).await;
    cluster.wait_leader().await;

    phase("reshard a counter to completion, delete another, add members");
    let n = cluster.node(2);
    n.write(counter("r", put_shards(2))).await.unwrap();
    n.write(counter("r", put_shards(4))).await.unwrap();
    assert_eq!(n.pending_reshards(), vec![name("r")]);
    let done =
        n.write(counter("r", MetaCommand::CompleteReshard { generation: 0, sealed_sum: 7 })).await.unwrap();
    assert!(matches!(done, Response::Counter(Ok(_))), "{done:?}");
    n.write(counter("gone", MetaCommand::Ensure)).await.unwrap();
    n.write(counter("gone", MetaCommand::Delete)).await.unwrap();
    let set = |from_epoch, members: &[&str]| Request::SetMembers {
        from_epoch,
        previous: vec![],
        members: members.iter().map(|m| m.to_string()).collect(),
    };
    n.write(set(0, &["node-a", "node-b"])).await.unwrap();
    n.write(set(1, &["node-b"])).await.unwrap();
    n.write(Request::HandoffDone { node: "node-a".into(), epoch: 2 }).await.unwrap();
    let before = cluster.wait_converged().await;
    assert_eq!(before.applied_requests, 8 + 3);
    assert_eq!(before.counters["r"].layout.base, 7);
    assert_eq!(before.tombstones.get("gone"), Some(&vec![(0, 8)]));
    assert_eq!(n.tombstones().len(), 1);

    phase("restart every node");
    cluster.kill_all().await;
    for id in [3, 2, 1] {
        cluster.restart(id).await;
    }
    for id in cluster.running() {
        assert_eq!(cluster.node(id).state(), before, "node {id} reloaded its applied state as it was");
    }
    cluster.wait_leader().await;
    let after = cluster.wait_converged().await;
    assert_eq!(after, before, "no entry was applied a second time");
    assert!(cluster.node(1).pending_reshards().is_empty());

    phase("the group still takes writes, and a repeated completion is refused");
    let again = cluster
        .node(3)
        .write(counter("r", MetaCommand::CompleteReshard { generation: 0, sealed_sum: 7 }))
        .await;
    assert!(
        matches!(again, Ok(Response::Counter(Err(Rejection::StaleGeneration { current: 1, got: 0 })))),
        "{again:?}"
    );
    let cleared = cluster.node(1).write(Request::ClearTombstone { name: name("gone") }).await.unwrap();
    assert_eq!(cleared, Response::TombstoneCleared { existed: true });
    let last = cluster.wait_converged().await;
    assert_eq!(last.applied_requests, 10 + 3);
    assert_eq!(last.counters["r"].layout.base, 7);
    assert!(last.tombstones.is_empty());

    cluster.kill_all().await;
}

fn small_snapshots(cfg: &mut MetaRaftConfig) {
    cfg.snapshot_logs_since_last = 50;
    cfg.snapshot_logs_kept = 0;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t24_lagging_node_installs_a_snapshot() {
    let _serial = SERIAL.lock().await;
    phase("nodes 1 and 2 form a quorum of 3; node 3 stays down");
    let mut cluster = TestCluster::start(3, &[1, 2], small_snapshots).await;
    let leader = cluster.wait_leader().await;

    phase("write 120 entries in batches");
    const WRITES: usize = 120;
    const BATCH: usize = 10;
    for b in 0..WRITES / BATCH {
        let writes = (0..BATCH).map(|i| {
            let via = cluster.node(if i % 2 == 0 { 1 } else { 2 });
            via.write(counter(&format!("s-{b}-{i}"), MetaCommand::Ensure))
        });
        for r in futures::future::join_all(writes).await {
            r.unwrap();
        }
    }
    cluster.wait_converged().await;
    // The purge follows the snapshot asynchronously.
    let mut m = cluster.node(leader).raft().metrics().borrow().clone();
    for _ in 0..100 {
        if m.purged.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        m = cluster.node(leader).raft().metrics().borrow().clone();
    }
    phase(&format!("leader snapshot {:?}, purged {:?}", m.snapshot, m.purged));
    assert!(m.snapshot.is_some_and(|s| s.index >= 100), "a snapshot was built: {:?}", m.snapshot);
    assert!(m.purged.is_some(), "the log behind it was purged");

    phase("start node 3 from an empty directory");
    cluster.restart(3).await;
    let state = cluster.wait_converged().await;
    assert_eq!(state.counters.len(), WRITES);
    let m3 = cluster.node(3).raft().metrics().borrow().clone();
    assert!(m3.snapshot.is_some(), "node 3 installed a snapshot: {m3:?}");
    assert!(cluster.node(3).counter("s-0-0").is_some());

    phase("node 3 keeps up with new writes after the snapshot");
    cluster.node(3).write(counter("post-snapshot", MetaCommand::Ensure)).await.unwrap();
    assert!(cluster.wait_converged().await.counters.contains_key("post-snapshot"));

    cluster.kill_all().await;
}
