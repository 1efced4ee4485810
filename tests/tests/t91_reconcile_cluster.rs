//! t91: a scheduled reconciliation from a source of truth on three real nodes. A
//! `batched` counter with 12 shards spread over every node takes increments through
//! all three, each also written as an event to a JSON-lines event log. Node 3 is
//! killed with SIGKILL right after its last increments, losing its buffered window,
//! and restarted. Node 1 is then given the event log as a `[[reconcile]]` source: its
//! first scheduled run reads the complete sum from all three nodes, finds a drift equal
//! to what the kill lost, and corrects it, so every node reads the event log's total;
//! the next run finds nothing to do. Both runs are visible in
//! `GET /v1/counters/{name}/reconciliations` and in the node's metrics.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::Write as _;
use std::time::{Duration, Instant};
use tally_tests::{openapi, TestCluster};

/// Rounds of increments, and increments per round and node.
const ROUNDS: i64 = 10;
const PER_ROUND: i64 = 10;
/// The counter's aggregation window: long enough that the kill loses some of it.
const FLUSH_MS: u64 = 1_000;
/// How long the test waits for a scheduled run.
const RUN_WAIT_MS: u64 = 30_000;
const NAME: &str = "views:7";

/// The recorded runs of the counter on node 1, newest first.
async fn runs(c: &TestCluster) -> Result<Vec<Value>> {
    let v = c.get(1, &format!("/v1/counters/{NAME}/reconciliations")).await?;
    openapi::check("GET", "/v1/counters/{name}/reconciliations", 200, &v)?;
    Ok(v["runs"].as_array().cloned().unwrap_or_default())
}

/// The newest run of the event-log source made after `after_ms`.
async fn next_run(c: &TestCluster, after_ms: u64) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_millis(RUN_WAIT_MS);
    loop {
        let found = runs(c)
            .await?
            .into_iter()
            .find(|r| r["source"] == "views-log" && r["at_ms"].as_u64().is_some_and(|t| t > after_ms));
        if let Some(run) = found {
            return Ok(run);
        }
        if Instant::now() > deadline {
            bail!("no run after {after_ms}; log:\n{}", c.node(1).log_tail());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `n` anonymous increments of 1 through `node`, in one batch (buffered).
async fn incr_batch(c: &TestCluster, node: usize, n: i64) -> Result<()> {
    let items: Vec<Value> = (0..n).map(|_| json!({"counter": NAME, "delta": 1})).collect();
    let (status, body) = c.send(node, "POST", "/v1/increments", json!({"increments": items})).await?;
    if status != 200 || body["results"].as_array().is_none_or(|r| r.iter().any(|x| x["applied"] != true)) {
        bail!("batch refused on node{node}: {status} {body}");
    }
    Ok(())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_log_source_corrects_drift_on_a_counter_spread_over_three_nodes() -> Result<()> {
    let c = TestCluster::start(3).await?;
    let dir = c.dir().join("events");
    std::fs::create_dir_all(&dir)?;
    c.put_counter(1, NAME, json!({"shards": 12, "flush_ms": FLUSH_MS})).await?;
    let shards = c.get(1, &format!("/v1/counters/{NAME}/shards")).await?;
    let owners: BTreeSet<&str> =
        shards["shards"].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap()).collect();
    assert_eq!(owners.len(), 3, "12 shards should spread over all 3 nodes: {shards}");

    let mut log = std::fs::File::create(dir.join("events-0000.jsonl"))?;
    let mut next_id = 0;
    for round in 0..ROUNDS {
        for node in 1..=3 {
            for _ in 0..PER_ROUND {
                writeln!(
                    log,
                    "{}",
                    json!({"event_id": format!("ev-{next_id}"), "counter": NAME, "delta": 1})
                )?;
                next_id += 1;
            }
            log.flush()?;
            incr_batch(&c, node, PER_ROUND).await?;
        }
        if round + 1 < ROUNDS {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let truth = ROUNDS * PER_ROUND * 3;
    // Node 3's last increments are still in its accumulator.
    c.node(3).kill();
    c.restart(3).await?;

    // Node 1 stops cleanly (its buffers are delivered), takes the source, and starts.
    c.node(1).stop();
    let mut config = std::fs::OpenOptions::new().append(true).open(c.dir().join("node1.toml"))?;
    writeln!(
        config,
        "\n[[reconcile]]\nname = \"views-log\"\ncounters = \"views:{{id}}\"\nevery = \"2s\"\n\
         [reconcile.event_log]\ndir = {:?}\n",
        dir.display().to_string()
    )?;
    let restarted_ms = now_ms();
    c.restart(1).await?;

    let run = next_run(&c, restarted_ms).await?;
    assert_eq!((&run["outcome"], &run["corrected"]), (&json!("corrected"), &json!(true)), "{run}");
    assert_eq!(run["authoritative"], json!(truth), "{run}");
    let before = run["before"].as_i64().expect("before");
    assert!(before < truth, "the kill lost nothing ({before} of {truth}): {run}");
    assert_eq!(run["drift"], json!(truth - before), "the drift is what the kill lost: {run}");
    assert_eq!(run["node"], json!("node1"), "{run}");
    for node in 1..=3 {
        assert_eq!(c.value(node, NAME).await?, truth, "node{node} after the correction");
    }

    let again = next_run(&c, run["at_ms"].as_u64().unwrap_or(0)).await?;
    assert_eq!(
        (&again["outcome"], &again["corrected"], &again["drift"]),
        (&json!("in_sync"), &json!(false), &json!(0)),
        "{again}"
    );
    for node in 1..=3 {
        assert_eq!(c.value(node, NAME).await?, truth, "node{node} after the second run");
    }
    let history = runs(&c).await?;
    assert!(history.len() >= 2, "{history:?}");
    let metrics = reqwest::get(format!("{}/metrics", c.node(1).url())).await?.text().await?;
    assert!(metrics.contains(&format!("tally_drift{{counter=\"{NAME}\"}} 0\n")), "{metrics}");
    assert!(metrics.contains("tally_reconcile_runs_total{outcome=\"corrected\"} 1\n"), "{metrics}");
    Ok(())
}
