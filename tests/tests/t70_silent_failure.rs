//! t70: a silent failure. `SIGSTOP` freezes a node with its sockets open; its peers
//! must notice within the heartbeat bound (200 ms × 4 misses, plus the ping timeout),
//! writes to other nodes' shards go on, reads say which shards are missing, and after
//! `SIGCONT` the node rejoins with nothing lost.

use serde_json::json;
use std::time::{Duration, Instant};
use tally_tests::TestCluster;

/// Detection bound asserted here: well above the configured 200 ms × 4 misses plus
/// one ping timeout, for a loaded 2-core machine.
const DETECTION_BOUND_MS: u64 = 6_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_is_detected_worked_around_and_rejoins() -> anyhow::Result<()> {
    let c = TestCluster::start(3).await?;
    c.put_counter(1, "views", json!({"shards": 12, "durability": "sync"})).await?;
    for i in 0..60 {
        let (status, _) =
            c.incr(1 + i % 3, "views", json!({"delta": 1, "event_id": format!("a{i}")})).await?;
        assert_eq!(status, 200);
    }
    c.node(3).pause();
    let paused_at = Instant::now();
    loop {
        let view = c.get(1, "/v1/cluster").await?;
        let state =
            view["nodes"].as_array().unwrap().iter().find(|n| n["id"] == "node3").unwrap()["state"].clone();
        if state == json!("down") {
            break;
        }
        assert!(
            paused_at.elapsed() < Duration::from_millis(DETECTION_BOUND_MS),
            "node3 not detected as down: {view}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("detected after {} ms", paused_at.elapsed().as_millis());
    // Reads say what is missing instead of a silent partial sum.
    let read = c.fresh(1, "views").await?;
    assert_eq!(read["complete"], json!(false), "{read}");
    // Writes go on: every id is either counted or refused with 503 (retry later).
    let mut refused = Vec::new();
    let mut counted = 0;
    for i in 0..60 {
        let id = format!("b{i}");
        let (status, body) = c.incr(1 + i % 2, "views", json!({"delta": 1, "event_id": id})).await?;
        match status {
            200 => counted += 1,
            503 => refused.push(id),
            _ => panic!("{status} {body}"),
        }
    }
    assert!(counted > 0, "no writes went around the paused node");
    c.node(3).resume();
    // Retry what was refused, now that node3 is back.
    let deadline = Instant::now() + Duration::from_secs(30);
    for id in refused {
        loop {
            let (status, _) = c.incr(1, "views", json!({"delta": 1, "event_id": id})).await?;
            if status == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "{id} still refused after node3 resumed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Node 1 took the retries, but each node's failure detector sees node3 back on its
    // own heartbeat: until then its fresh read says it is incomplete, as it should.
    let deadline = Instant::now() + Duration::from_secs(10);
    for node in 1..=3 {
        let read = loop {
            let read = c.fresh(node, "views").await?;
            if read["complete"] == json!(true) || Instant::now() > deadline {
                break read;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            (read["complete"].clone(), read["value"].clone()),
            (json!(true), json!(120)),
            "node{node}: {read}"
        );
    }
    Ok(())
}
