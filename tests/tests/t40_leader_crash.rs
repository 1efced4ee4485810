//! t40: `kill -9` the metadata leader. A new leader is elected, counters can still be
//! created through any node, and when the old leader returns it has every counter; a
//! full cluster restart keeps all metadata and values.

use serde_json::json;
use std::time::Duration;
use tally_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_survives_the_leader_and_a_full_restart() -> anyhow::Result<()> {
    let c = TestCluster::start(3).await?;
    c.put_counter(1, "before", json!({"shards": 6, "durability": "sync"})).await?;
    c.incr(2, "before", json!({"delta": 5, "event_id": "a"})).await?;
    let leader: usize = c.wait_leader().await?.trim_start_matches("node").parse()?;
    c.node(leader).kill();
    let other = if leader == 1 { 2 } else { 1 };
    // Metadata writes go on once a new leader is elected (forwarded from any node).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) =
            c.send(other, "PUT", "/v1/counters/after", json!({"shards": 4, "durability": "sync"})).await?;
        if status == 201 || status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no metadata writes after the leader died: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let new_leader = c.wait_leader().await?;
    assert_ne!(new_leader, format!("node{leader}"));
    c.restart(leader).await?;
    // The returning node knows both counters.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while c.get(leader, "/v1/counters/after").await.is_err() {
        assert!(std::time::Instant::now() < deadline, "node{leader} never learned of the new counter");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, _) = c.incr(leader, "after", json!({"delta": 3, "event_id": "b"})).await?;
    assert_eq!(status, 200);
    // A full restart keeps everything.
    for i in 1..=3 {
        assert_eq!(c.node(i).stop(), Some(0), "node{i} did not stop cleanly");
    }
    // A node is healthy only once the group has a leader, which takes two of three.
    for i in 1..=3 {
        c.spawn(i)?;
    }
    for i in 1..=3 {
        c.wait_healthy(i).await?;
    }
    c.wait_connected().await?;
    c.wait_leader().await?;
    for i in 1..=3 {
        assert_eq!(c.value(i, "before").await?, 5);
        assert_eq!(c.value(i, "after").await?, 3);
    }
    Ok(())
}
