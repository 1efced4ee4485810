//! t20: three nodes. Writers increment through every node, resending each event id
//! (a flaky client), and every node reports the exact total: nothing lost, nothing
//! counted twice, for `sync` and `batched` counters.

use serde_json::json;
use std::sync::Arc;
use tally_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn increments_through_all_nodes_with_resends_sum_exactly_everywhere() -> anyhow::Result<()> {
    let c = Arc::new(TestCluster::start(3).await?);
    // Each shard has one copy here: a counter may not ask for more.
    let (status, body) = c.send(2, "PUT", "/v1/counters/wide", json!({"replicas": 3})).await?;
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("replicas 3"), "{body}");
    for durability in ["sync", "batched"] {
        let name = format!("likes-{durability}");
        c.put_counter(1, &name, json!({"shards": 16, "durability": durability, "flush_ms": 50})).await?;
        let mut writers = Vec::new();
        for w in 0..12usize {
            let (c, name) = (c.clone(), name.clone());
            writers.push(tokio::spawn(async move {
                let node = 1 + w % 3;
                for i in 0..40 {
                    let inc = json!({"delta": 1, "event_id": format!("w{w}-{i}"), "writer": format!("w{w}")});
                    let (status, body) = c.incr(node, &name, inc.clone()).await.unwrap();
                    assert_eq!((status, &body), (200, &json!({"applied": true})));
                    // The same event again, through another node.
                    let (status, body) = c.incr(1 + (node % 3), &name, inc).await.unwrap();
                    assert_eq!((status, body), (200, json!({"applied": false, "duplicate": true})));
                    // And an anonymous one.
                    let (status, _) = c.incr(node, &name, json!({"delta": 1})).await.unwrap();
                    assert_eq!(status, 200);
                }
            }));
        }
        for w in writers {
            w.await?;
        }
        // Batched increments buffered on each node reach their shards within flush_ms.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        for node in 1..=3 {
            assert_eq!(c.value(node, &name).await?, 12 * 40 * 2, "{name} on node{node}");
        }
        let shards = c.get(2, &format!("/v1/counters/{name}/shards")).await?;
        let owners: std::collections::BTreeSet<String> = shards["shards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["node"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(owners.len(), 3, "16 shards should spread over all 3 nodes: {shards}");
    }
    Ok(())
}
