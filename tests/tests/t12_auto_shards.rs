//! t12: a counter created with `"shards": "auto"` on a real single-node `tallyd`
//! follows its contention. One HTTP writer leaves it at `min_shards`; 64 concurrent
//! writers get it resharded up within 10 s; once they stop it is resharded back down
//! after the quiet period. The total is exact after each phase (every increment
//! carries an event id and is retried with it until its outcome is known), and
//! `GET /shards` and `/metrics` show each change and its reason. The same story runs
//! on a three-node cluster, the writers spread over the nodes: each node samples only
//! what it routes, any of them may raise the count, and a lowering waits until every
//! node has been quiet for the quiet period.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_tests::{openapi, TestCluster};

const NAME: &str = "auto:hot";
const WRITERS: usize = 64;

/// Short timers for a test, the thresholds at their defaults.
const TIMERS: &str = "auto_sample_ms = 250\nauto_change_interval_ms = 1000\nauto_quiet_ms = 2000\n";

struct Load {
    active: AtomicUsize,
    idle: AtomicUsize,
    stop: AtomicBool,
    acked: AtomicI64,
}

async fn layout(c: &TestCluster) -> Result<(u64, bool)> {
    let info = c.get(1, &format!("/v1/counters/{NAME}")).await?;
    Ok((info["layout_shards"].as_u64().unwrap_or(0), !info["resharding"].is_null()))
}

async fn wait_for(c: &TestCluster, within: Duration, pred: impl Fn(u64) -> bool) -> Result<Duration> {
    let start = Instant::now();
    loop {
        let (shards, resharding) = layout(c).await?;
        if !resharding && pred(shards) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            bail!("still {shards} shards (resharding {resharding}) after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Pauses every writer, then the fresh total on every node must equal the
/// acknowledged sum.
async fn check_exact(c: &TestCluster, load: &Load, resume: usize) -> Result<i64> {
    load.active.store(0, SeqCst);
    while load.idle.load(SeqCst) < WRITERS {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let value = c.value(1, NAME).await?;
    for i in 1..=c.len() {
        assert_eq!(c.value(i, NAME).await?, load.acked.load(SeqCst), "node {i}: a read after a drain");
    }
    load.active.store(resume, SeqCst);
    Ok(value)
}

/// Every node's report once it shows the change to `to` shards complete (in a
/// cluster, each node's report merges the last change any node decided), returned
/// from node 1.
async fn seen_change(c: &TestCluster, to: u64) -> Result<Value> {
    let start = Instant::now();
    'poll: loop {
        let mut first = None;
        for i in 1..=c.len() {
            let report = c.get(i, &format!("/v1/counters/{NAME}/shards")).await?;
            openapi::check("GET", "/v1/counters/{name}/shards", 200, &report)?;
            let auto = &report["auto"];
            let shards = report["shards"].as_array().map_or(0, Vec::len) as u64;
            if !(auto["pending"].is_null()
                && auto["last_change"]["to"].as_u64() == Some(shards)
                && shards == to)
            {
                if start.elapsed() > Duration::from_secs(5) {
                    bail!("node {i} never showed the change to {to} shards complete: {report}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue 'poll;
            }
            first.get_or_insert(report);
        }
        return Ok(first.expect("at least one node"));
    }
}

/// A metric summed over every node.
async fn metric(c: &TestCluster, series: &str) -> Result<u64> {
    let mut sum = 0;
    for i in 1..=c.len() {
        let metrics = reqwest::get(format!("{}/metrics", c.node(i).url())).await?.text().await?;
        sum += sample(&metrics, series);
    }
    Ok(sum)
}

fn sample(metrics: &str, series: &str) -> u64 {
    metrics.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_writers_reshard_up_and_quiet_reshards_down() -> Result<()> {
    up_and_down(1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_three_nodes_any_node_raises_and_all_agree_to_lower() -> Result<()> {
    up_and_down(3).await
}

/// The whole story on a cluster of `nodes`; writer `w` sends to node `w % nodes + 1`.
async fn up_and_down(nodes: usize) -> Result<()> {
    let c = Arc::new(TestCluster::start_configured(nodes, &[], TIMERS).await?);
    let (status, body) = c
        .send(
            1,
            "PUT",
            &format!("/v1/counters/{NAME}"),
            json!({"shards": "auto", "min_shards": 1, "max_shards": 64, "durability": "sync"}),
        )
        .await?;
    assert_eq!(status, 201, "{body}");
    openapi::check("PUT", "/v1/counters/{name}", status, &body)?;
    assert_eq!(body["layout_shards"], 1, "an auto counter starts at min_shards: {body}");
    assert_eq!(body["auto"], json!({"min_shards": 1, "max_shards": 64}));

    let load = Arc::new(Load {
        active: AtomicUsize::new(1),
        idle: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        acked: AtomicI64::new(0),
    });
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (c, load) = (c.clone(), load.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            let mut idle = false;
            while !load.stop.load(SeqCst) {
                if w >= load.active.load(SeqCst) {
                    if !idle {
                        load.idle.fetch_add(1, SeqCst);
                        idle = true;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                if idle {
                    load.idle.fetch_sub(1, SeqCst);
                    idle = false;
                }
                let inc = json!({"delta": 1, "event_id": format!("{w}-{i}"), "writer": format!("w{w}")});
                match c.incr(w % nodes + 1, NAME, inc).await {
                    Ok((200, body)) if body["applied"] == true => {
                        load.acked.fetch_add(1, SeqCst);
                        i += 1;
                    }
                    // Unknown outcome (a shard unavailable mid-resharding, a timeout):
                    // retry with the same event id until it is known.
                    Ok((503, _)) | Err(_) => continue,
                    Ok((status, body)) => panic!("increment {w}-{i}: {status} {body}"),
                }
            }
        }));
    }

    // One writer: no queue at its shard, no change.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(layout(&c).await?, (1, false), "one writer never queues");
    check_exact(&c, &load, WRITERS).await?;

    // 64 writers: resharded up within 10 s.
    let up = wait_for(&c, Duration::from_secs(10), |s| s > 1).await?;
    let first = layout(&c).await?.0;
    eprintln!("t12: {nodes} node(s), 64 writers: 1 -> {first} shards after {:.1} s", up.as_secs_f64());
    let report = seen_change(&c, first).await?;
    let change = &report["auto"]["last_change"];
    assert_eq!(
        (change["from"].as_u64(), change["reason"].as_str()),
        (Some(1), Some("queue_depth")),
        "{report}"
    );
    assert!(change["figures"]["queue_depth_max"].as_u64() >= Some(8), "{report}");
    // Let it climb for a while, exact at each stop.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        check_exact(&c, &load, WRITERS).await?;
    }
    let total = check_exact(&c, &load, 0).await?;
    let peak = layout(&c).await?.0;
    eprintln!("t12: {nodes} node(s): peak {peak} shards; {total} increments acknowledged");
    assert!((4..=64).contains(&peak), "{peak}");

    // Quiet: back down to min_shards after the quiet period.
    let down = wait_for(&c, Duration::from_secs(15), |s| s == 1).await?;
    eprintln!("t12: {nodes} node(s): quiet: {peak} -> 1 shards after {:.1} s", down.as_secs_f64());
    let report = seen_change(&c, 1).await?;
    let change = &report["auto"]["last_change"];
    // A raise proposed before the writers paused may complete after `peak` was read.
    let from = change["from"].as_u64().unwrap_or(0);
    assert!((peak..=64).contains(&from), "lowered from {from} after a peak of {peak}: {report}");
    assert_eq!((change["to"].as_u64(), change["reason"].as_str()), (Some(1), Some("quiet")), "{report}");
    load.stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    for i in 1..=nodes {
        assert_eq!(c.value(i, NAME).await?, load.acked.load(SeqCst), "node {i}");
    }

    // The metrics count the changes by direction and reason (each on the node that
    // made it); every node follows the counter.
    assert!(metric(&c, r#"tally_auto_reshards_total{direction="up",reason="queue_depth"}"#).await? >= 1);
    assert_eq!(metric(&c, r#"tally_auto_reshards_total{direction="down",reason="quiet"}"#).await?, 1);
    assert_eq!(metric(&c, "tally_auto_counters").await?, nodes as u64);

    // Fixed again by a number, as every node sees.
    // Other nodes apply the committed change shortly after node 1 answers.
    c.put_counter(1, NAME, json!({"shards": 2})).await?;
    for i in 1..=nodes {
        let start = Instant::now();
        loop {
            let info = c.get(i, &format!("/v1/counters/{NAME}")).await?;
            if info["auto"].is_null() {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(5), "node {i}: {info}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bounds_are_422() -> Result<()> {
    let c = TestCluster::start(1).await?;
    for body in [
        json!({"shards": "auto", "min_shards": 0}),
        json!({"shards": "auto", "min_shards": 8, "max_shards": 4}),
        json!({"shards": "auto", "max_shards": 2000}),
        json!({"shards": "many"}),
        json!({"shards": 4, "max_shards": 8}),
        json!({"min_shards": 2}),
    ] {
        let (status, answer) = c.send(1, "PUT", "/v1/counters/bad", body.clone()).await?;
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (422, Some("invalid_spec")),
            "{body}: {answer}"
        );
        openapi::check("PUT", "/v1/counters/{name}", status, &answer)?;
    }
    Ok(())
}

/// Writers on one node of three keep the count up: the two idle nodes are quiet and
/// ask to lower it, the busy one refuses every time; once it stops too, the count
/// comes down. The total is exact on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_busy_node_holds_a_lowering_back() -> Result<()> {
    const NAME: &str = "auto:one-node";
    // A low threshold (quiet below 2 increments/s per shard), so that what 8 writers
    // send through one node is far from quiet even on a slow machine.
    let config = format!("{TIMERS}auto_rate_up_per_shard = 8\n");
    let c = Arc::new(TestCluster::start_configured(3, &[], &config).await?);
    c.put_counter(1, NAME, json!({"shards": "auto", "min_shards": 1, "max_shards": 8, "durability": "sync"}))
        .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicI64::new(0));
    let mut writers = Vec::new();
    for w in 0..8 {
        let (c, stop, acked) = (c.clone(), stop.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(SeqCst) {
                let inc = json!({"delta": 1, "event_id": format!("{w}-{i}")});
                match c.incr(3, NAME, inc).await {
                    Ok((200, body)) if body["applied"] == true => {
                        acked.fetch_add(1, SeqCst);
                        i += 1;
                    }
                    Ok((503, _)) | Err(_) => continue,
                    Ok((status, body)) => panic!("increment {w}-{i}: {status} {body}"),
                }
            }
        }));
    }
    let shards = |c: Arc<TestCluster>| async move {
        let info = c.get(1, &format!("/v1/counters/{NAME}")).await?;
        anyhow::Ok((info["layout_shards"].as_u64().unwrap_or(0), !info["resharding"].is_null()))
    };
    let start = Instant::now();
    while shards(c.clone()).await? != (8, false) {
        if start.elapsed() > Duration::from_secs(10) {
            bail!("not raised to 8 shards within 10 s: {:?}", shards(c.clone()).await?);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Three quiet periods with node 3 busy: never lowered.
    let held = Instant::now();
    while held.elapsed() < Duration::from_secs(6) {
        assert_eq!(shards(c.clone()).await?.0, 8, "lowered while node 3 was busy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut refused = Vec::new();
    for i in 1..=2 {
        let report = c.get(i, &format!("/v1/counters/{NAME}/shards")).await?;
        refused.push(report["auto"]["last_dropped"]["reason"].as_str().unwrap_or_default().to_string());
    }
    eprintln!("t12: the idle nodes' last lowering was refused: {refused:?}");
    assert!(refused.iter().any(|r| r.contains("is not quiet")), "{refused:?}");
    stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    let start = Instant::now();
    while shards(c.clone()).await? != (1, false) {
        if start.elapsed() > Duration::from_secs(15) {
            bail!("not lowered within 15 s of going quiet: {:?}", shards(c.clone()).await?);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("t12: lowered to 1 shard {:.1} s after the last writer stopped", start.elapsed().as_secs_f64());
    for i in 1..=3 {
        assert_eq!(c.value(i, NAME).await?, acked.load(SeqCst), "node {i}");
    }
    Ok(())
}

/// Load spread over three nodes that is hot only in sum: each node routes a paced
/// 120 increments/s to a `batched` counter (nothing queues at its shard), below the
/// 200/s threshold, so no node is hot on its own. Sent through one node only, the
/// nodes ask each other and find the sum is not hot: no change. Spread over all three
/// (360/s together), they raise it (reason `write_rate`). The total is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_spread_over_three_nodes_raises_on_the_summed_rate() -> Result<()> {
    const NAME: &str = "auto:spread";
    const PER_NODE_PER_S: u64 = 120;
    let config = format!("{TIMERS}auto_rate_up_per_shard = 200\n");
    let c = Arc::new(TestCluster::start_configured(3, &[], &config).await?);
    let spec =
        json!({"shards": "auto", "min_shards": 1, "max_shards": 8, "durability": "batched", "flush_ms": 20});
    c.put_counter(1, NAME, spec).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicI64::new(0));
    // One paced writer per node; `through` says which nodes it may send to now.
    let through = Arc::new(AtomicUsize::new(1));
    let mut writers = Vec::new();
    for node in 1..=3usize {
        let (c, stop, acked, through) = (c.clone(), stop.clone(), acked.clone(), through.clone());
        writers.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / PER_NODE_PER_S));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut i = 0u64;
            while !stop.load(SeqCst) {
                tick.tick().await;
                if node > through.load(SeqCst) {
                    continue;
                }
                let inc = json!({"delta": 1, "event_id": format!("{node}-{i}")});
                loop {
                    match c.incr(node, NAME, inc.clone()).await {
                        Ok((200, body)) if body["applied"] == true => break,
                        Ok((503, _)) | Err(_) => continue,
                        Ok((status, body)) => panic!("increment {node}-{i}: {status} {body}"),
                    }
                }
                acked.fetch_add(1, SeqCst);
                i += 1;
            }
        }));
    }
    let layout = |c: Arc<TestCluster>| async move {
        let info = c.get(1, &format!("/v1/counters/{NAME}")).await?;
        anyhow::Ok((info["layout_shards"].as_u64().unwrap_or(0), !info["resharding"].is_null()))
    };
    // Through node 1 alone: asked, not hot together, never raised.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(4) {
        assert_eq!(layout(c.clone()).await?, (1, false), "raised with one node's 120/s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = c.get(1, &format!("/v1/counters/{NAME}/shards")).await?;
    let dropped = report["auto"]["last_dropped"]["reason"].as_str().unwrap_or_default().to_string();
    eprintln!("t12: one node at {PER_NODE_PER_S}/s: {dropped:?}");
    assert!(dropped.contains("not hot"), "{report}");
    // Through all three: raised within 10 s.
    through.store(3, SeqCst);
    let start = Instant::now();
    loop {
        let (shards, resharding) = layout(c.clone()).await?;
        if shards > 1 && !resharding {
            eprintln!(
                "t12: three nodes at {PER_NODE_PER_S}/s each: 1 -> {shards} shards after {:.1} s",
                start.elapsed().as_secs_f64()
            );
            break;
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("not raised within 10 s of spreading the load");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = seen_change_of(&c, NAME).await?;
    assert_eq!(report["auto"]["last_change"]["reason"], "write_rate", "{report}");
    stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    // A batched sum reaches its shard within flush_ms.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 1..=3 {
        assert_eq!(c.value(i, NAME).await?, acked.load(SeqCst), "node {i}");
    }
    Ok(())
}

/// Node 1's report of `name` once its last change shows complete.
async fn seen_change_of(c: &TestCluster, name: &str) -> Result<Value> {
    let start = Instant::now();
    loop {
        let report = c.get(1, &format!("/v1/counters/{name}/shards")).await?;
        let shards = report["shards"].as_array().map_or(0, Vec::len) as u64;
        if report["auto"]["last_change"]["to"].as_u64() == Some(shards) {
            return Ok(report);
        }
        if start.elapsed() > Duration::from_secs(5) {
            bail!("the change was never seen complete: {report}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
