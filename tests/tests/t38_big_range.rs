//! t38: a node restarts whatever its range holds. Three nodes keep three copies of
//! one sync counter of one shard; thousands of increments with unique 200-byte event
//! ids go to it, one at a time, so its range's log grows past the point where every
//! replica builds a snapshot and purges its log. Then node 2 is killed with SIGKILL
//! and started again: it must come back, take part in its group, and the retained
//! ids must still answer as duplicates through it.
//!
//! Why: a replica once held its whole range as one value (its snapshot), decoded at
//! start with a cap of 64 MiB, so a node whose range had grown past the cap exited at
//! start and never came back. The cap is lowered for this test
//! (`TALLY_TEST_REPLICA_VALUE_BYTES_MAX`, read once when `tallyd` starts) so that a
//! few megabytes of ids stand for the gigabytes of a real range: the range here is
//! several times the lowered cap, and no value a replica stores may need more.

use serde_json::json;
use std::time::{Duration, Instant};
use tally_tests::TestCluster;

/// Increments written: enough entries for every replica to build a snapshot (each
/// one-at-a-time increment is one log entry; a group snapshots every 5,000).
const INCREMENTS: usize = 5_600;
/// Bytes of each event id.
const ID_BYTES: usize = 200;
/// The lowered cap on one stored value: the range holds about 1.3 MB of ids.
const VALUE_BYTES_MAX: usize = 256 << 10;
/// How long one increment may be retried (a leader may change under the load).
const RETRY_MS: u64 = 20_000;

fn event_id(n: usize) -> String {
    let head = format!("ev-{n:08}-");
    format!("{head}{}", "x".repeat(ID_BYTES - head.len()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarts_with_a_range_larger_than_any_one_value() -> anyhow::Result<()> {
    // Inherited by every tallyd this test starts (its own binary: no other test
    // shares the environment).
    std::env::set_var("TALLY_TEST_REPLICA_VALUE_BYTES_MAX", VALUE_BYTES_MAX.to_string());
    let c =
        TestCluster::start_configured(3, &[], "cluster.replicas = 3\ncluster.ranges_per_node = 1\n").await?;
    c.put_counter(1, "big:r", json!({"shards": 1, "durability": "sync"})).await?;

    eprintln!("phase: {INCREMENTS} increments of {ID_BYTES}-byte ids, one at a time");
    let started = Instant::now();
    for n in 0..INCREMENTS {
        let deadline = Instant::now() + Duration::from_millis(RETRY_MS);
        loop {
            match c.incr(1 + n % 3, "big:r", json!({"delta": 1, "event_id": event_id(n)})).await {
                Ok((200, body)) => {
                    anyhow::ensure!(body == json!({"applied": true}), "increment {n}: {body}");
                    break;
                }
                other if Instant::now() < deadline => {
                    eprintln!("increment {n}: {other:?}; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => anyhow::bail!("increment {n} never acknowledged: {other:?}"),
            }
        }
    }
    eprintln!("phase: written in {:.1} s", started.elapsed().as_secs_f64());
    let range_bytes = INCREMENTS * ID_BYTES;
    anyhow::ensure!(range_bytes > 4 * VALUE_BYTES_MAX, "the range must be well past the lowered cap");

    eprintln!("phase: node2 killed and started again");
    c.node(2).kill();
    c.restart(2)
        .await
        .map_err(|e| anyhow::anyhow!("node2 did not come back: {e}\n{}", c.node(2).log_tail()))?;

    eprintln!("phase: node2 serves the range: totals and duplicates");
    let deadline = Instant::now() + Duration::from_millis(RETRY_MS);
    loop {
        let read = c.fresh(2, "big:r").await;
        match read {
            Ok(v) if v["complete"] == json!(true) => {
                anyhow::ensure!(v["value"] == json!(INCREMENTS), "node2 read {v}");
                break;
            }
            other if Instant::now() < deadline => {
                eprintln!("fresh read through node2: {other:?}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => anyhow::bail!("no complete read through node2: {other:?}"),
        }
    }
    for n in [0, INCREMENTS / 2, INCREMENTS - 1] {
        let (status, body) = c.incr(2, "big:r", json!({"delta": 1, "event_id": event_id(n)})).await?;
        anyhow::ensure!(
            (status, &body) == (200, &json!({"applied": false, "duplicate": true})),
            "id {n} again: {status} {body}"
        );
    }
    anyhow::ensure!(c.node(2).pid().is_some(), "node2 exited:\n{}", c.node(2).log_tail());
    Ok(())
}
