//! t92: per-item frequencies on three real nodes. A counter with
//! `frequency: {"epsilon": 0.001, "delta": 0.01}` and 12 shards spread over every node
//! takes weighted increments with items (and some with members only) through all
//! three nodes. Every node then answers `/frequency` for every item — complete, never
//! below the truth, within `epsilon × total` — and `/top?k=10` with the exact top 10,
//! merged from the shards of all three nodes (remote shards answer through the
//! node-to-node read path). The answers match the OpenAPI document. A negative delta
//! with an item is refused with 422; a read of a counter without frequencies with 409.
//! Finally one node is killed and restarted: its shards' sketches come back from disk.

use anyhow::Result;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tally_tests::{openapi, TestCluster};

/// Items written, and how often item `k` is written per writer: `ITEMS / (k + 1)`.
const ITEMS: u64 = 60;
/// Concurrent writers, each through node `1 + w % 3`.
const WRITERS: usize = 6;

/// The true weight of every item one writer adds (the same for every writer).
fn plan() -> Vec<(String, i64, bool)> {
    let mut out = Vec::new();
    for k in 0..ITEMS {
        for j in 0..(ITEMS / (k + 1)) {
            // Weights 1..=3; every fifth increment names its item as a member only.
            out.push((format!("page-{k}"), 1 + (k % 3) as i64, j % 5 == 4));
        }
    }
    out
}

async fn frequency(c: &TestCluster, node: usize, item: &str) -> Result<Value> {
    let v = c.get(node, &format!("/v1/counters/pages/frequency?item={item}")).await?;
    openapi::check("GET", "/v1/counters/{name}/frequency", 200, &v)?;
    Ok(v)
}

/// Every node answers every item within its bound, and the exact top 10.
async fn check_everywhere(c: &TestCluster, truth: &BTreeMap<String, u64>, phase: &str) -> Result<()> {
    let total: u64 = truth.values().sum();
    let mut exact: Vec<(&String, &u64)> = truth.iter().collect();
    exact.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let want: Vec<&str> = exact.iter().take(10).map(|(i, _)| i.as_str()).collect();
    for node in 1..=3 {
        for (item, &weight) in truth {
            let f = frequency(c, node, item).await?;
            assert_eq!(f["complete"], json!(true), "{phase} node{node}: {f}");
            assert_eq!(f["total"], json!(total), "{phase} node{node}: {f}");
            let (estimate, bound) = (f["estimate"].as_u64().unwrap(), f["error_bound"].as_u64().unwrap());
            assert!(
                estimate >= weight && estimate - weight <= bound,
                "{phase} node{node} {item}: {f} vs {weight}"
            );
            assert!(f["lower_bound"].as_u64().unwrap() <= weight, "{phase} node{node} {item}: {f}");
            assert_eq!(f["confidence"], json!(0.99));
        }
        let absent = frequency(c, node, "never-written").await?;
        assert!(absent["estimate"].as_u64().unwrap() <= absent["error_bound"].as_u64().unwrap(), "{absent}");
        let top = c.get(node, "/v1/counters/pages/top?k=10").await?;
        openapi::check("GET", "/v1/counters/{name}/top", 200, &top)?;
        assert_eq!(top["complete"], json!(true), "{phase} node{node}: {top}");
        let got: Vec<&str> =
            top["items"].as_array().unwrap().iter().map(|e| e["item"].as_str().unwrap()).collect();
        assert_eq!(got, want, "{phase} node{node}: top 10");
        for e in top["items"].as_array().unwrap() {
            let weight = truth[e["item"].as_str().unwrap()];
            assert!(
                e["lower_bound"].as_u64().unwrap() <= weight && weight <= e["estimate"].as_u64().unwrap(),
                "{e}"
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frequencies_merge_over_three_nodes_and_survive_a_kill() -> Result<()> {
    let c = Arc::new(TestCluster::start(3).await?);
    let spec = json!({"shards": 12, "durability": "sync", "frequency": {"epsilon": 0.001, "delta": 0.01}});
    let (status, body) = c.send(1, "PUT", "/v1/counters/pages", spec).await?;
    assert_eq!(status, 201, "{body}");
    openapi::check("PUT", "/v1/counters/{name}", 201, &body)?;
    assert_eq!(body["spec"]["frequency"], json!({"epsilon": 0.001, "delta": 0.01}));

    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let c = c.clone();
        writers.push(tokio::spawn(async move {
            let node = 1 + w % 3;
            for (i, (item, delta, member_only)) in plan().into_iter().enumerate() {
                let inc = if member_only {
                    json!({"delta": delta, "member": item, "writer": format!("w{w}-{i}")})
                } else {
                    json!({"delta": delta, "item": item, "writer": format!("w{w}-{i}")})
                };
                let (status, body) = c.incr(node, "pages", inc).await.unwrap();
                assert_eq!((status, body), (200, json!({"applied": true})));
            }
        }));
    }
    for w in writers {
        w.await?;
    }
    let mut truth: BTreeMap<String, u64> = BTreeMap::new();
    for (item, delta, _) in plan() {
        *truth.entry(item).or_default() += delta as u64 * WRITERS as u64;
    }
    let shards = c.get(2, "/v1/counters/pages/shards").await?;
    let owners: BTreeSet<&str> =
        shards["shards"].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap()).collect();
    assert_eq!(owners.len(), 3, "12 shards should spread over all 3 nodes: {shards}");
    check_everywhere(&c, &truth, "written").await?;

    // Refusals, in the documented shapes.
    let (status, body) = c.incr(2, "pages", json!({"delta": -1, "item": "page-0"})).await?;
    assert_eq!((status, body["error"]["code"].as_str()), (422, Some("negative_frequency_weight")), "{body}");
    openapi::check("POST", "/v1/counters/{name}/increments", 422, &body)?;
    c.put_counter(1, "plain", json!({})).await?;
    let r = reqwest::get(format!("{}/v1/counters/plain/top", c.node(3).url())).await?;
    let (status, body): (u16, Value) = (r.status().as_u16(), r.json().await?);
    assert_eq!((status, body["error"]["code"].as_str()), (409, Some("frequency_off")), "{body}");
    openapi::check("GET", "/v1/counters/{name}/top", 409, &body)?;
    let r = reqwest::get(format!("{}/v1/counters/pages/frequency", c.node(1).url())).await?;
    assert_eq!(r.status().as_u16(), 400, "item is required");

    // A node killed and restarted serves its shards' sketches from disk.
    c.node(3).kill();
    c.restart(3).await?;
    check_everywhere(&c, &truth, "after node3 was killed").await?;
    Ok(())
}
