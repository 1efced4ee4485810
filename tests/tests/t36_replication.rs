//! t36: shards replicated on three nodes (`cluster.replicas = 3`).

use serde_json::json;
use tally_tests::TestCluster;

/// What every node of a replicated cluster adds to its config.
const REPLICATED: &str = "cluster.replicas = 3\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_counts_and_reads_a_replicated_counter() -> anyhow::Result<()> {
    let c = TestCluster::start_configured(3, &[], REPLICATED).await?;
    c.put_counter(1, "likes", json!({"shards": 8, "durability": "sync"})).await?;
    for i in 0..60 {
        let (status, body) =
            c.incr(1 + i % 3, "likes", json!({"delta": 1, "event_id": format!("e{i}")})).await?;
        assert_eq!(status, 200, "{body}");
    }
    for node in 1..=3 {
        let read = c.fresh(node, "likes").await?;
        assert_eq!(read["value"], json!(60), "node{node}: {read}");
        assert_eq!(read["complete"], json!(true), "node{node}: {read}");
    }
    let (_, body) = c.incr(2, "likes", json!({"delta": 1, "event_id": "e7"})).await?;
    assert_eq!(body, json!({"applied": false, "duplicate": true}));
    Ok(())
}

/// How long the range leader stays frozen.
const FROZEN: std::time::Duration = std::time::Duration::from_secs(10);
/// Writers during the silent failure.
const WRITERS: usize = 8;

/// A silent failure of a range leader: node 3 (the preferred leader of a third of
/// the ranges) is frozen with `SIGSTOP` for [`FROZEN`] while writers go on through
/// all nodes, then thawed. The others elect new leaders; when node 3 wakes it still
/// believes it leads, and its shard actors still hold what they held, but nothing
/// they commit can overwrite what the new leaders acknowledged: every node's total
/// is the acknowledged sum and every acknowledged id is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_range_leader_never_makes_an_acknowledged_increment_disappear() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    let c = Arc::new(TestCluster::start_configured(3, &[], REPLICATED).await?);
    c.put_counter(1, "stock", json!({"shards": 12, "durability": "sync"})).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let frozen = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (c, stop, frozen, acked) = (c.clone(), stop.clone(), frozen.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(SeqCst) {
                let id = format!("w{w}-{i}");
                let mut attempt = 0;
                while !stop.load(SeqCst) {
                    // Through every node, node 3 too except while it is frozen.
                    let node =
                        if frozen.load(SeqCst) { 1 + (w + attempt) % 2 } else { 1 + (w + attempt) % 3 };
                    match c.incr(node, "stock", json!({"delta": 1, "event_id": id})).await {
                        Ok((200, _)) => {
                            acked.lock().unwrap().push(id.clone());
                            break;
                        }
                        Ok((503 | 504, _)) | Err(_) => {
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await
                        }
                        Ok((status, body)) => panic!("unexpected {status} {body}"),
                    }
                    attempt += 1;
                }
                i += 1;
            }
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    frozen.store(true, SeqCst);
    c.node(3).pause();
    let before = acked.lock().unwrap().len();
    tokio::time::sleep(FROZEN).await;
    let during = acked.lock().unwrap().len() - before;
    c.node(3).resume();
    frozen.store(false, SeqCst);
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    let acked = acked.lock().unwrap().clone();
    println!(
        "range leader frozen {} s: {during} increments acknowledged meanwhile, {} in all",
        FROZEN.as_secs(),
        acked.len()
    );
    if during <= 100 {
        for n in 1..=3 {
            for line in c.log(n).lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).take(12) {
                println!("node{n}: {}", &line[..line.len().min(300)]);
            }
        }
    }
    assert!(during > 100, "writes did not go on around the frozen leader: {during}");
    tally_tests::stories::assert_counted_once(&c, "stock", &acked, WRITERS, 11).await
}
