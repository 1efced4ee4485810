//! t30: `kill -9` a node while sync increments stream in through the other nodes;
//! clients retry failures with the same event id. After the node restarts, every
//! acknowledged increment is counted exactly once on every node (invariants 1, 2).

use std::sync::Arc;
use tally_tests::{stories, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_loses_no_acknowledged_sync_increment() -> anyhow::Result<()> {
    stories::kill_one_node_under_sync_writes(Arc::new(TestCluster::start(3).await?)).await
}
