//! t50: membership changes while increments stream in. A fourth node joins the
//! placement ring, then one of the original nodes leaves it and is killed. Shards
//! move with their values and dedup records: every acknowledged increment is counted
//! exactly once on every node, and every event id stays a duplicate after the moves.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tally_tests::TestCluster;

/// How long a membership change may take to hand off every shard.
const SETTLE_WAIT_MS: u64 = 60_000;

/// What the writers saw.
#[derive(Default)]
struct Ledger {
    /// Event ids acknowledged on the sync counter, with their deltas.
    sync_acked: Vec<(String, i64)>,
    /// Event ids whose last attempt had no answer (applied or not).
    sync_unknown: Vec<(String, i64)>,
    /// Batched increments acknowledged, and ones with no answer.
    batched_acked: i64,
    batched_unknown: i64,
}

/// Writers through the nodes in `through` until `stop`; sync increments retry with
/// the same event id until acknowledged.
fn start_writers(
    c: &Arc<TestCluster>,
    through: Vec<usize>,
    tag: &str,
    stop: &Arc<AtomicBool>,
    ledger: &Arc<Mutex<Ledger>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut writers = Vec::new();
    for w in 0..6usize {
        let (c, stop, ledger, through) = (c.clone(), stop.clone(), ledger.clone(), through.clone());
        let tag = format!("{tag}{w}");
        writers.push(tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.load(SeqCst) {
                let node = through[(w + i) % through.len()];
                if w % 3 == 2 {
                    match c.incr(node, "views", json!({"delta": 1})).await {
                        Ok((200, _)) => ledger.lock().unwrap().batched_acked += 1,
                        Ok((503, _)) | Err(_) => ledger.lock().unwrap().batched_unknown += 1,
                        Ok((status, body)) => panic!("unexpected {status} {body}"),
                    }
                } else {
                    let (id, delta) = (format!("{tag}-{i}"), (i % 3) as i64 + 1);
                    let mut answered = false;
                    for attempt in 0..200usize {
                        if stop.load(SeqCst) && attempt > 0 {
                            break;
                        }
                        let via = through[(w + i + attempt) % through.len()];
                        match c.incr(via, "credits", json!({"delta": delta, "event_id": id})).await {
                            Ok((200, _)) => {
                                answered = true;
                                break;
                            }
                            Ok((503, _)) | Err(_) => tokio::time::sleep(Duration::from_millis(30)).await,
                            Ok((status, body)) => panic!("unexpected {status} {body}"),
                        }
                    }
                    let mut l = ledger.lock().unwrap();
                    if answered {
                        l.sync_acked.push((id, delta));
                    } else {
                        l.sync_unknown.push((id, delta));
                    }
                }
                i += 1;
            }
        }));
    }
    writers
}

/// Runs writers through `through` for `ms` milliseconds while `during` runs.
async fn write_while<F: std::future::Future<Output = Result<()>>>(
    c: &Arc<TestCluster>,
    through: Vec<usize>,
    tag: &str,
    ledger: &Arc<Mutex<Ledger>>,
    during: F,
) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let writers = start_writers(c, through, tag, &stop, ledger);
    let result = during.await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    result
}

/// Waits until node `i` reports no hand-off under way at epoch `epoch` or later.
async fn wait_settled(c: &TestCluster, nodes: &[usize], epoch: u64) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_millis(SETTLE_WAIT_MS);
    loop {
        let mut last = Value::Null;
        let mut settled = true;
        for &i in nodes {
            let view = c.get(i, "/v1/cluster").await.unwrap_or(Value::Null);
            let done = view["placement_epoch"].as_u64().is_some_and(|e| e >= epoch)
                && view["handoff"].as_array().is_some_and(|h| h.is_empty());
            settled &= done;
            last = view;
        }
        if settled {
            return Ok(last);
        }
        if Instant::now() > deadline {
            bail!("the membership change did not settle: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every node in `nodes` reads the exact totals; batched increments may take a
/// flush window to arrive from other nodes' buffers.
async fn check_totals(c: &TestCluster, nodes: &[usize], ledger: &Ledger) -> Result<()> {
    let acked: i64 = ledger.sync_acked.iter().map(|(_, d)| d).sum();
    let unknown: i64 = ledger.sync_unknown.iter().map(|(_, d)| d).sum();
    let (b_acked, b_unknown) = (ledger.batched_acked, ledger.batched_unknown);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut problems = Vec::new();
        for &i in nodes {
            let credits = c.value(i, "credits").await?;
            if !(acked..=acked + unknown).contains(&credits) {
                problems
                    .push(format!("node{i}: credits {credits}, acknowledged {acked} (+{unknown} unknown)"));
            }
            let views = c.value(i, "views").await?;
            if !(b_acked..=b_acked + b_unknown).contains(&views) {
                problems
                    .push(format!("node{i}: views {views}, acknowledged {b_acked} (+{b_unknown} unknown)"));
            }
        }
        if problems.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("totals are off: {problems:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every acknowledged event id is still recognised, through every node in `nodes`.
async fn check_duplicates(c: &TestCluster, nodes: &[usize], ledger: &Ledger) -> Result<()> {
    for (k, (id, delta)) in ledger.sync_acked.iter().enumerate().step_by(7) {
        let node = nodes[k % nodes.len()];
        let (status, body) = c.incr(node, "credits", json!({"delta": delta, "event_id": id})).await?;
        if (status, &body) != (200, &json!({"applied": false, "duplicate": true})) {
            bail!("event id {id} through node{node}: {status} {body}");
        }
    }
    Ok(())
}

/// Which nodes hold the counter's shards, as node `i` reports them.
async fn owners(c: &TestCluster, i: usize, name: &str) -> Result<Vec<String>> {
    let report = c.get(i, &format!("/v1/counters/{name}/shards")).await?;
    let mut nodes: Vec<String> = report["shards"]
        .as_array()
        .map(|s| s.iter().filter_map(|s| s["node"].as_str().map(String::from)).collect())
        .unwrap_or_default();
    nodes.sort();
    nodes.dedup();
    Ok(nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_then_removing_a_node_loses_and_doubles_nothing() -> Result<()> {
    let c = Arc::new(TestCluster::start_with_spares(4, &[4]).await?);
    c.put_counter(1, "credits", json!({"shards": 24, "durability": "sync"})).await?;
    c.put_counter(2, "views", json!({"shards": 24, "durability": "batched", "flush_ms": 50})).await?;
    let ledger = Arc::new(Mutex::new(Ledger::default()));

    // Before any change: the spare holds nothing.
    let view = c.get(1, "/v1/cluster").await?;
    assert_eq!(view["nodes"][3]["member"], json!(false), "{view}");
    write_while(&c, vec![1, 2, 3], "a", &ledger, async {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        Ok(())
    })
    .await?;
    assert!(!owners(&c, 1, "credits").await?.contains(&"node4".to_string()));

    // node4 joins while writes go on through every node.
    write_while(&c, vec![1, 2, 3, 4], "b", &ledger, async {
        let (status, view) = c.send(1, "PUT", "/v1/cluster/members/node4", json!(null)).await?;
        if status != 200 {
            bail!("add node4: {status} {view}");
        }
        assert_eq!(view["nodes"][3]["member"], json!(true), "{view}");
        // A second change waits for the first to settle (or finds it settled).
        let (status, body) = c.send(2, "PUT", "/v1/cluster/members/node4", json!(null)).await?;
        assert!(status == 200 || status == 409, "{status} {body}");
        wait_settled(&c, &[1, 2, 3, 4], 1).await?;
        Ok(())
    })
    .await?;
    {
        let l = ledger.lock().unwrap();
        assert!(l.sync_acked.len() > 50, "writers made little progress: {}", l.sync_acked.len());
    }
    assert!(owners(&c, 3, "credits").await?.contains(&"node4".to_string()), "node4 took shards over");
    let snapshot = std::mem::take(&mut *ledger.lock().unwrap());
    check_totals(&c, &[1, 2, 3, 4], &snapshot).await?;
    check_duplicates(&c, &[1, 2, 3, 4], &snapshot).await?;
    *ledger.lock().unwrap() = snapshot;

    // node2 leaves while writes go on through the others, then is killed: nothing
    // may depend on it any more.
    write_while(&c, vec![1, 3, 4], "c", &ledger, async {
        let (status, view) = c.send(3, "DELETE", "/v1/cluster/members/node2", json!(null)).await?;
        if status != 200 {
            bail!("remove node2: {status} {view}");
        }
        wait_settled(&c, &[1, 3, 4], 2).await?;
        Ok(())
    })
    .await?;
    c.node(2).kill();
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let holders = owners(&c, 1, "credits").await?;
    assert!(!holders.contains(&"node2".to_string()), "{holders:?}");
    check_totals(&c, &[1, 3, 4], &ledger).await?;
    check_duplicates(&c, &[1, 3, 4], &ledger).await?;
    Ok(())
}
