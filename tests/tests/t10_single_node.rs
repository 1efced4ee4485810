//! t10: one `tallyd` node (a one-node config runs the embedded engine with its
//! metadata in its own store): the API works and data survives a restart.

use serde_json::json;
use tally_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_serves_and_keeps_its_data_across_a_restart() -> anyhow::Result<()> {
    let c = TestCluster::start(1).await?;
    c.put_counter(1, "likes:1", json!({"shards": 8, "durability": "sync"})).await?;
    for i in 0..50 {
        let (status, body) = c.incr(1, "likes:1", json!({"delta": 2, "event_id": format!("e{i}")})).await?;
        assert_eq!((status, body), (200, json!({"applied": true})));
    }
    let (_, dup) = c.incr(1, "likes:1", json!({"delta": 2, "event_id": "e7"})).await?;
    assert_eq!(dup, json!({"applied": false, "duplicate": true}));
    assert_eq!(c.value(1, "likes:1").await?, 100);
    assert_eq!(c.node(1).stop(), Some(0), "SIGTERM must exit cleanly");
    c.restart(1).await?;
    assert_eq!(c.value(1, "likes:1").await?, 100);
    let cluster = c.get(1, "/v1/cluster").await?;
    assert_eq!(cluster["nodes"].as_array().map(Vec::len), Some(1));
    Ok(())
}
