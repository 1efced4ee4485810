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
