//! t50: membership changes while increments stream in. A fourth node joins the
//! placement ring, then one of the original nodes leaves it and is killed. With one
//! copy, shards move with their values and dedup records; with three, the range
//! groups add the newcomer's replicas and replace the leaver's. Either way every
//! acknowledged increment is counted exactly once on every node, and every event id
//! stays a duplicate after the moves.

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

/// Whether every range's group, as its leader reports it in node `i`'s
/// `/v1/cluster`, has exactly `replicas` voters, no learner and no directory node
/// without a replica; answers the voters' nodes of every range, or why not.
fn ranges_converged(views: &[Value], replicas: usize) -> std::result::Result<Vec<Vec<String>>, String> {
    let count = views.first().and_then(|v| v["ranges"].as_array()).map_or(0, Vec::len);
    if count == 0 {
        return Err("no range reported".into());
    }
    let mut out = Vec::new();
    for r in 0..count {
        let led = views.iter().map(|v| &v["ranges"][r]).find(|range| {
            range["replicated_here"] == json!(true)
                && range["leader_last_log"].is_u64()
                && range["replicas"].as_array().is_some()
        });
        let Some(range) = led else { return Err(format!("range {r}: no leader reports it")) };
        let roles: Vec<(String, String)> = range["replicas"]
            .as_array()
            .expect("replicas")
            .iter()
            .map(|x| {
                (x["node"].as_str().unwrap_or("").to_string(), x["role"].as_str().unwrap_or("").to_string())
            })
            .collect();
        let voters: Vec<String> =
            roles.iter().filter(|(_, role)| role == "voter").map(|(n, _)| n.clone()).collect();
        let settled = range["joint"] == json!(false)
            && range["excluded"].as_array().is_some_and(|e| e.is_empty())
            && voters.len() == replicas
            && roles.len() == replicas;
        if !settled {
            return Err(format!("range {r}: {range}"));
        }
        out.push(voters);
    }
    Ok(out)
}

/// Waits until every range's group has settled on the directory of the current
/// members (see [`ranges_converged`]), as the nodes of `nodes` report them;
/// answers every range's voters.
async fn wait_ranges(c: &TestCluster, nodes: &[usize], replicas: usize) -> Result<Vec<Vec<String>>> {
    let deadline = Instant::now() + Duration::from_millis(SETTLE_WAIT_MS);
    loop {
        let mut views = Vec::new();
        for &i in nodes {
            views.push(c.get(i, "/v1/cluster").await.unwrap_or(Value::Null));
        }
        match ranges_converged(&views, replicas) {
            Ok(voters) => return Ok(voters),
            Err(why) if Instant::now() > deadline => bail!("the range groups did not settle: {why}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// The sample of an unlabelled metric in Prometheus text.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Waits until the nodes in `nodes` run `copies` range groups between them, no
/// more: every node the directory moved a range away from closed its group,
/// followers included (which their group never tells of their removal).
async fn wait_groups_retired(c: &TestCluster, nodes: &[usize], copies: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_millis(SETTLE_WAIT_MS);
    loop {
        let (mut open, mut retired) = (Vec::new(), 0.0);
        for &i in nodes {
            let metrics = reqwest::get(format!("{}/metrics", c.node(i).url())).await?.text().await?;
            open.push(sample(&metrics, "tally_replica_ranges").unwrap_or(f64::NAN));
            retired += sample(&metrics, "tally_replica_groups_retired_total").unwrap_or(0.0);
        }
        if open.iter().sum::<f64>() == copies as f64 {
            println!("range groups per node {open:?}, groups retired {retired}");
            assert!(retired > 0.0, "ranges moved, yet no group was retired");
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("range groups per node {open:?}, not {copies} in all");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How shards are kept in the cluster under test.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Copies {
    /// One copy per shard, on its ring owner: shards are handed off.
    One,
    /// Three copies in range groups (`cluster.replicas = 3`): the groups' voters
    /// follow the directory of the current members.
    Three,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_then_removing_a_node_loses_and_doubles_nothing() -> Result<()> {
    join_then_leave(Copies::One).await
}

/// The same changes with three copies of every shard: node4's replicas are added
/// as learners and promoted once caught up; node2's replicas are replaced, so it
/// can be killed without any range losing a quorum or anything acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_ranges_follow_a_join_and_a_leave_and_lose_nothing() -> Result<()> {
    join_then_leave(Copies::Three).await
}

async fn join_then_leave(copies: Copies) -> Result<()> {
    let extra = match copies {
        Copies::One => "",
        Copies::Three => "cluster.replicas = 3\n",
    };
    let c = Arc::new(TestCluster::start_configured(4, &[4], extra).await?);
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
    if copies == Copies::Three {
        let voters = wait_ranges(&c, &[1, 2, 3], 3).await?;
        assert!(voters.iter().flatten().all(|n| n != "node4"), "{voters:?}");
    }

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
    match copies {
        Copies::One => {
            assert!(owners(&c, 3, "credits").await?.contains(&"node4".to_string()), "node4 took shards over")
        }
        Copies::Three => {
            let voters = wait_ranges(&c, &[1, 2, 3, 4], 3).await?;
            let on4 = voters.iter().filter(|v| v.iter().any(|n| n == "node4")).count();
            assert!(on4 >= voters.len() / 2, "node4 replicates {on4} of {} ranges: {voters:?}", voters.len());
        }
    }
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
        if copies == Copies::Three {
            let voters = wait_ranges(&c, &[1, 2, 3, 4], 3).await?;
            assert!(voters.iter().flatten().all(|n| n != "node2"), "{voters:?}");
            wait_groups_retired(&c, &[1, 2, 3, 4], 3 * voters.len()).await?;
        }
        Ok(())
    })
    .await?;
    c.node(2).kill();
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let holders = owners(&c, 1, "credits").await?;
    assert!(!holders.contains(&"node2".to_string()), "{holders:?}");
    for node in [1, 3, 4] {
        for name in ["credits", "views"] {
            let read = c.fresh(node, name).await?;
            assert_eq!(read["complete"], json!(true), "node{node} {name}: {read}");
        }
    }
    check_totals(&c, &[1, 3, 4], &ledger).await?;
    check_duplicates(&c, &[1, 3, 4], &ledger).await?;
    Ok(())
}
