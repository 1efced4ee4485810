//! t37: windowed counters on three real nodes. A counter with `windows: ["1m", "1h"]`,
//! `distinct` and 12 shards spread over every node takes increments with members
//! through all three nodes. Every node then answers `?window=1m` and `?window=1h` on
//! `/value` and `/distinct` — merged from the buckets of all three nodes' shards
//! (remote shards answer through the node-to-node read path), with the bucket width
//! and span stated and the buckets' bytes within their bound. Everything was written
//! well inside one minute, so both windows hold every increment (the test refuses to
//! judge if writing took longer). An empty or unknown window is refused with 400
//! `unknown_window`, a bad `windows` option with 422. A node killed and restarted
//! serves its shards' buckets from disk. The answers match the OpenAPI document.

use anyhow::Result;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;
use tally_tests::{openapi, TestCluster};

const WRITERS: usize = 6;
const PER_WRITER: usize = 50;
/// Writing must end this long before a one-minute window would lose its first bucket.
const WRITE_BUDGET_S: u64 = 40;

async fn read(c: &TestCluster, node: usize, what: &str, window: &str) -> Result<(u16, Value)> {
    let url = format!("{}/v1/counters/visits/{what}?window={window}", c.node(node).url());
    let r = reqwest::get(url).await?;
    let (status, body): (u16, Value) = (r.status().as_u16(), r.json().await?);
    openapi::check("GET", &format!("/v1/counters/{{name}}/{what}"), status, &body)?;
    Ok((status, body))
}

async fn check_everywhere(c: &TestCluster, total: i64, members: u64, phase: &str) -> Result<()> {
    for node in 1..=3 {
        for (window, window_ms) in [("1m", 60_000u64), ("1h", 3_600_000)] {
            for what in ["value", "distinct"] {
                let (status, r) = read(c, node, what, window).await?;
                assert_eq!(status, 200, "{phase} node{node} {what} {window}: {r}");
                assert_eq!(r["complete"], json!(true), "{phase} node{node}: {r}");
                assert_eq!(
                    (r["window"].as_str(), r["window_ms"].as_u64()),
                    (Some(window), Some(window_ms)),
                    "{r}"
                );
                assert_eq!(r["bucket_ms"].as_u64(), Some(window_ms / 60), "{r}");
                let (start, end) = (r["start_ms"].as_u64().unwrap(), r["end_ms"].as_u64().unwrap());
                // The span is inclusive: a read on a bucket boundary covers 59 buckets and one ms.
                assert!(end - start <= window_ms && end - start + window_ms / 60 >= window_ms, "{r}");
                assert_eq!(r["value"], json!(total), "{phase} node{node} {what} {window}: {r}");
                let estimate = r["estimate"].as_u64().unwrap() as f64;
                let error = r["relative_error"].as_f64().unwrap();
                assert!((estimate - members as f64).abs() <= 4.0 * error * members as f64, "{r}");
                let (bytes, bound) =
                    (r["window_bytes"].as_u64().unwrap(), r["window_bytes_bound"].as_u64().unwrap());
                assert!(bytes > 0 && bytes <= bound, "{r}");
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_merge_over_three_nodes_and_survive_a_kill() -> Result<()> {
    let c = Arc::new(TestCluster::start(3).await?);
    let spec = json!({"shards": 12, "durability": "sync", "distinct": true, "windows": ["1h", "1m"]});
    let (status, body) = c.send(1, "PUT", "/v1/counters/visits", spec).await?;
    assert_eq!(status, 201, "{body}");
    openapi::check("PUT", "/v1/counters/{name}", 201, &body)?;
    assert_eq!(body["spec"]["windows"], json!(["1m", "1h"]), "shortest first");

    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let c = c.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..PER_WRITER {
                let inc = json!({"delta": 1 + (i % 3) as i64, "member": format!("user-{}", (w * PER_WRITER + i) % 200)});
                let (status, body) = c.incr(1 + w % 3, "visits", inc).await.unwrap();
                assert_eq!((status, body), (200, json!({"applied": true})));
            }
        }));
    }
    for w in writers {
        w.await?;
    }
    let took = started.elapsed().as_secs();
    assert!(took < WRITE_BUDGET_S, "writing took {took} s: the one-minute window cannot be judged");
    let total: i64 = (0..WRITERS).map(|_| (0..PER_WRITER).map(|i| 1 + (i % 3) as i64).sum::<i64>()).sum();
    let shards = c.get(2, "/v1/counters/visits/shards").await?;
    let owners: BTreeSet<&str> =
        shards["shards"].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap()).collect();
    assert_eq!(owners.len(), 3, "12 shards should spread over all 3 nodes: {shards}");
    check_everywhere(&c, total, 200, "written").await?;
    assert_eq!(c.fresh(1, "visits").await?["value"], json!(total), "the plain total counts the same");

    // Refusals, in the documented shapes.
    for window in ["", "24h", "1w"] {
        for what in ["value", "distinct"] {
            let (status, body) = read(&c, 2, what, window).await?;
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (400, Some("unknown_window")),
                "{window:?}: {body}"
            );
        }
    }
    for bad in [json!(["1w"]), json!(["59s"]), json!(["1m", "60s"]), json!(["1m", "2m", "3m", "4m", "5m"])] {
        let (status, body) = c.send(1, "PUT", "/v1/counters/visits", json!({"windows": bad})).await?;
        assert_eq!((status, body["error"]["code"].as_str()), (422, Some("invalid_spec")), "{bad}: {body}");
        openapi::check("PUT", "/v1/counters/{name}", 422, &body)?;
    }

    // A node killed and restarted serves its shards' buckets from disk.
    c.node(3).kill();
    c.restart(3).await?;
    let took = started.elapsed().as_secs();
    assert!(
        took < WRITE_BUDGET_S + 15,
        "the restart took until {took} s: the one-minute window cannot be judged"
    );
    check_everywhere(&c, total, 200, "after node3 was killed").await?;
    Ok(())
}
