//! t30: `kill -9` a node while sync increments stream in through the other nodes;
//! clients retry failures with the same event id. After the node restarts, every
//! acknowledged increment is counted exactly once on every node (invariants 1, 2).

use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tally_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_loses_no_acknowledged_sync_increment() -> anyhow::Result<()> {
    let c = Arc::new(TestCluster::start(3).await?);
    c.put_counter(1, "credits", json!({"shards": 12, "durability": "sync"})).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let mut writers = Vec::new();
    for w in 0..8usize {
        let (c, stop, acked) = (c.clone(), stop.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            let node = if w % 2 == 0 { 1 } else { 2 };
            let mut i = 0;
            while !stop.load(SeqCst) {
                let id = format!("w{w}-{i}");
                // Retry with the same id until acknowledged (or the test ends).
                while !stop.load(SeqCst) {
                    match c.incr(node, "credits", json!({"delta": 1, "event_id": id})).await {
                        Ok((200, _)) => {
                            acked.lock().unwrap().push(id.clone());
                            break;
                        }
                        Ok((503, _)) | Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                        Ok((status, body)) => panic!("unexpected {status} {body}"),
                    }
                }
                i += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    c.node(3).kill();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    c.restart(3).await?;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() > 100, "writers made little progress: {}", acked.len());
    // An id that was refused and then retried may have been applied by the refused
    // attempt; its id makes that count once. An id still in flight when the writers
    // stopped is the only unknown: at most one per writer.
    for node in 1..=3 {
        let value = c.value(node, "credits").await?;
        let acked = acked.len() as i64;
        assert!((acked..=acked + 8).contains(&value), "node{node}: value {value}, acknowledged {acked}");
    }
    for id in acked.iter().step_by(17) {
        let (_, body) = c.incr(3, "credits", json!({"delta": 1, "event_id": id})).await?;
        assert_eq!(body, json!({"applied": false, "duplicate": true}), "{id}");
    }
    Ok(())
}
