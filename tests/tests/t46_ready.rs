//! t46: `/healthz` means ready. Right after three nodes start, as soon as each
//! answers `/healthz` with 200, plain increments to new counters through every node
//! succeed at once: no 503 while the metadata group or the node-to-node sessions are
//! still coming up.

use serde_json::json;
use tally_tests::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn increments_succeed_as_soon_as_healthz_answers() -> anyhow::Result<()> {
    let c = TestCluster::start_until_healthy(3, &[], "").await?;
    for round in 0..4 {
        for node in 1..=3 {
            let name = format!("fresh-{round}-{node}");
            for n in 0..8 {
                let (status, body) =
                    c.incr(node, &name, json!({"delta": 1, "writer": format!("w{n}")})).await?;
                assert_eq!(status, 200, "increment {n} to {name} through node{node}: {body}");
            }
        }
    }
    for node in 1..=3 {
        assert_eq!(c.value(node, "fresh-0-1").await?, 8);
    }
    Ok(())
}
