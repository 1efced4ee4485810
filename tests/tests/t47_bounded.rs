//! t47: a bounded counter (`min: 0`, sync) holds an inventory of [`STOCK`] units
//! while [`WRITERS`] writers take one unit at a time through all three nodes, and
//! one node is killed with `kill -9` and restarted with its data directory.
//!
//! Every decrement carries an event id. An attempt whose outcome is unknown (a
//! timeout, a 503, a connection error) is sent again with the same id, through the
//! next node; a 409 `bound_exceeded` is a definite "not counted", after which the
//! writer pauses and takes a new id. Writers go on until a fresh read on every node
//! shows 0. A reader samples fresh reads (and the unclamped sum of the shards)
//! through every node all along.
//!
//! Checks: at no moment more than [`STOCK`] decrements are acknowledged, and exactly
//! [`STOCK`] once the cluster has healed and the stock is gone; every fresh read (and
//! every sum of the shards) is at least 0; at the end every node reads 0 and every
//! acknowledged id answers `duplicate` when sent again. The figures (attempts,
//! refusals while stock remained, unknown outcomes, how long the drain took, escrow
//! grants) are printed. Run with one copy of every shard and with three
//! (`cluster.replicas = 3`).

use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tally_tests::{openapi, TestCluster};

/// Units of inventory.
const STOCK: i64 = 1_000;
/// The increments that put the stock in (each lands on the shard its event id names;
/// the other shards borrow from those).
const DELIVERIES: i64 = 4;
/// Concurrent writers taking one unit each time.
const WRITERS: usize = 64;
/// Shards of the counter.
const SHARDS: u16 = 8;
/// Node 3 is killed once this many units are taken.
const KILL_AFTER_TAKEN: i64 = 250;
/// How long node 3 stays down.
const OUTAGE: Duration = Duration::from_secs(3);
/// A writer's pause after a unit it took (clients do other work too).
const THINK: Duration = Duration::from_millis(20);
/// Pause before an attempt with an unknown outcome is sent again.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Pause after a refusal before the next attempt.
const REFUSAL_PAUSE: Duration = Duration::from_millis(50);
/// Timeout of one attempt: beyond it, its outcome is unknown.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest the run may take from the first decrement until the stock is gone on
/// every node; beyond it the test fails as a hang.
const DRAIN_MAX: Duration = Duration::from_secs(40);
/// The counter.
const COUNTER: &str = "inventory";

/// Held by each test while its cluster runs: the two clusters would otherwise share
/// the two cores and the figures of each would describe both.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the writers saw.
#[derive(Default)]
struct Tallies {
    attempts: AtomicU64,
    /// Decrements acknowledged (answered applied, or a duplicate of an earlier
    /// attempt of the same id).
    taken: AtomicI64,
    /// The most decrements acknowledged at any moment beyond [`STOCK`] (0 if never).
    over: AtomicI64,
    /// Refusals (`bound_exceeded`) answered while fewer than [`STOCK`] units were taken.
    refused_early: AtomicU64,
    /// All refusals.
    refused: AtomicU64,
    /// Attempts whose outcome was unknown (timeout, 503/504, connection error).
    unknown: AtomicU64,
    /// Acknowledged ids, in order.
    acked: Mutex<Vec<String>>,
    /// When the last unit was taken, since the start of the writers.
    last_taken: Mutex<Option<Duration>>,
    /// Anything the writers did not expect.
    unexpected: Mutex<Vec<String>>,
}

/// What the reader saw.
#[derive(Default)]
struct Reads {
    /// Fresh reads that were complete, and their lowest value.
    complete: AtomicU64,
    lowest: AtomicI64,
    /// Fresh reads that failed or were incomplete.
    incomplete: AtomicU64,
    /// Sums of the shard report (`base` + every shard's value, not brought within
    /// the bounds) and their lowest value.
    sums: AtomicU64,
    lowest_sum: AtomicI64,
    /// Reads below 0, with the node and when.
    below_zero: Mutex<Vec<String>>,
}

/// The stock is gone: every node's fresh read is complete and 0.
async fn drained(c: &TestCluster) -> bool {
    for node in 1..=c.len() {
        match c.value(node, COUNTER).await {
            Ok(0) => {}
            _ => return false,
        }
    }
    true
}

/// One decrement: the HTTP status and body, or `None` when the outcome is unknown
/// (no answer within [`ATTEMPT_TIMEOUT`]).
async fn take(http: &reqwest::Client, c: &TestCluster, node: usize, id: &str) -> Option<(u16, Value)> {
    let url = format!("{}/v1/counters/{COUNTER}/increments", c.node(node).url());
    let r = http.post(url).json(&json!({"delta": -1, "event_id": id})).send().await.ok()?;
    let status = r.status().as_u16();
    let body = r.json().await.unwrap_or(Value::Null);
    Some((status, body))
}

/// Writer `w`: takes units through its home node until the stock is gone everywhere.
async fn writer(
    w: usize,
    c: Arc<TestCluster>,
    http: reqwest::Client,
    start: Instant,
    t: Arc<Tallies>,
    done: Arc<AtomicBool>,
) {
    let nodes = c.len();
    let mut node = 1 + w % nodes;
    let mut i = 0;
    while !done.load(SeqCst) {
        let id = format!("take-{w}-{i}");
        i += 1;
        // Until the outcome of `id` is known, whatever else happens.
        loop {
            t.attempts.fetch_add(1, SeqCst);
            match take(&http, &c, node, &id).await {
                Some((200, body)) if body["applied"] == json!(true) || body["duplicate"] == json!(true) => {
                    let n = t.taken.fetch_add(1, SeqCst) + 1;
                    if n > STOCK {
                        t.over.fetch_max(n - STOCK, SeqCst);
                    }
                    if n == STOCK {
                        *t.last_taken.lock().unwrap() = Some(start.elapsed());
                    }
                    t.acked.lock().unwrap().push(id.clone());
                    tokio::time::sleep(THINK).await;
                    break;
                }
                Some((409, body)) if body["error"]["code"] == json!("bound_exceeded") => {
                    t.refused.fetch_add(1, SeqCst);
                    if t.taken.load(SeqCst) < STOCK {
                        t.refused_early.fetch_add(1, SeqCst);
                    }
                    tokio::time::sleep(REFUSAL_PAUSE).await;
                    break;
                }
                Some((503 | 504, _)) | None => {
                    t.unknown.fetch_add(1, SeqCst);
                    node = 1 + node % nodes;
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Some((status, body)) => {
                    t.unexpected.lock().unwrap().push(format!("{id} through node{node}: {status} {body}"));
                    return;
                }
            }
            if start.elapsed() > DRAIN_MAX + Duration::from_secs(10) {
                t.unexpected.lock().unwrap().push(format!("{id}: outcome still unknown at the end"));
                return;
            }
        }
    }
}

/// The reader: fresh reads and shard sums through every node in turn, until `stop`.
async fn reader(c: Arc<TestCluster>, start: Instant, reads: Arc<Reads>, stop: Arc<AtomicBool>) {
    let mut n = 0;
    while !stop.load(SeqCst) {
        let node = 1 + n % c.len();
        n += 1;
        match c.fresh(node, COUNTER).await {
            Ok(v) if v["complete"] == json!(true) => {
                let value = v["value"].as_i64().unwrap_or(i64::MIN);
                reads.complete.fetch_add(1, SeqCst);
                reads.lowest.fetch_min(value, SeqCst);
                if value < 0 {
                    let at = start.elapsed().as_millis();
                    reads.below_zero.lock().unwrap().push(format!("node{node} at {at} ms: fresh read {v}"));
                }
            }
            _ => {
                reads.incomplete.fetch_add(1, SeqCst);
            }
        }
        if let Ok(report) = c.get(node, &format!("/v1/counters/{COUNTER}/shards")).await {
            let values: Option<Vec<i64>> =
                report["shards"].as_array().map(|s| s.iter().filter_map(|s| s["value"].as_i64()).collect());
            if let (Some(values), Some(base)) = (values, report["base"].as_i64()) {
                if values.len() == usize::from(SHARDS) {
                    let sum = base + values.iter().sum::<i64>();
                    reads.sums.fetch_add(1, SeqCst);
                    reads.lowest_sum.fetch_min(sum, SeqCst);
                    if sum < 0 {
                        let at = start.elapsed().as_millis();
                        reads
                            .below_zero
                            .lock()
                            .unwrap()
                            .push(format!("node{node} at {at} ms: shards {values:?}"));
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The sample of an unlabelled metric in Prometheus text.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A metric summed over the nodes (node 3's count restarts with its process).
async fn metric_sum(c: &TestCluster, name: &str) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for node in 1..=c.len() {
        let text = reqwest::get(format!("{}/metrics", c.node(node).url())).await?.text().await?;
        sum += sample(&text, name).unwrap_or(0.0);
    }
    Ok(sum)
}

/// The story on a running three-node cluster `c`.
async fn inventory(c: Arc<TestCluster>, label: &str) -> anyhow::Result<()> {
    let spec = json!({"shards": SHARDS, "durability": "sync", "min": 0});
    let (status, created) = c.send(1, "PUT", &format!("/v1/counters/{COUNTER}"), spec).await?;
    anyhow::ensure!(status == 201 && created["spec"]["min"] == json!(0), "{status} {created}");
    openapi::check("PUT", "/v1/counters/{name}", status, &created)?;
    for d in 0..DELIVERIES {
        let (status, body) = c
            .incr(
                1 + d as usize % 3,
                COUNTER,
                json!({"delta": STOCK / DELIVERIES, "event_id": format!("delivery-{d}")}),
            )
            .await?;
        anyhow::ensure!(status == 200 && body["applied"] == json!(true), "delivery {d}: {status} {body}");
    }
    for node in 1..=3 {
        anyhow::ensure!(c.value(node, COUNTER).await? == STOCK, "node{node} does not read the stock");
    }

    let http = reqwest::Client::builder().timeout(ATTEMPT_TIMEOUT).build()?;
    let start = Instant::now();
    let tallies = Arc::new(Tallies::default());
    let reads = Arc::new(Reads {
        lowest: AtomicI64::new(i64::MAX),
        lowest_sum: AtomicI64::new(i64::MAX),
        ..Default::default()
    });
    let done = Arc::new(AtomicBool::new(false));
    let stop_reader = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| tokio::spawn(writer(w, c.clone(), http.clone(), start, tallies.clone(), done.clone())))
        .collect();
    let reader = tokio::spawn(reader(c.clone(), start, reads.clone(), stop_reader.clone()));

    // Kill node 3 part-way through the stock, and bring it back with its data.
    while tallies.taken.load(SeqCst) < KILL_AFTER_TAKEN && start.elapsed() < DRAIN_MAX {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed_at = start.elapsed();
    let taken_at_kill = tallies.taken.load(SeqCst);
    c.node(3).kill();
    tokio::time::sleep(OUTAGE).await;
    let restarting_at = start.elapsed();
    let taken_while_down = tallies.taken.load(SeqCst) - taken_at_kill;
    c.restart(3).await?;
    let restarted_at = start.elapsed();

    // Until the stock is gone on every node (or the run is taken for a hang).
    let mut hung = false;
    // Gone on every node while fewer were acknowledged: writers still resolving
    // unknown outcomes acknowledge the rest, or the checks below fail.
    loop {
        if drained(&c).await {
            break;
        }
        if start.elapsed() > DRAIN_MAX {
            hung = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained_at = start.elapsed();
    done.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    stop_reader.store(true, SeqCst);
    reader.await?;

    let t = &tallies;
    let grants = metric_sum(&c, "tally_escrow_grants_total").await?;
    let messages = metric_sum(&c, "tally_escrow_messages_total").await?;
    let refusals = metric_sum(&c, "tally_bound_refusals_total").await?;
    let last = t.last_taken.lock().unwrap().map_or("never".to_string(), |d| format!("{} ms", d.as_millis()));
    println!("{label}: {STOCK} units (min 0, sync, {SHARDS} shards), {WRITERS} writers through 3 nodes:");
    println!(
        "  node3 killed at {} ms ({taken_at_kill} taken), restarted at {} ms (healthy at {} ms); {taken_while_down} taken while it was down",
        killed_at.as_millis(),
        restarting_at.as_millis(),
        restarted_at.as_millis()
    );
    println!("  attempts:                          {}", t.attempts.load(SeqCst));
    println!("  acknowledged:                      {}", t.taken.load(SeqCst));
    println!("  refused while stock remained:      {}", t.refused_early.load(SeqCst));
    println!("  refused in all:                    {}", t.refused.load(SeqCst));
    println!("  unknown outcomes (retried):        {}", t.unknown.load(SeqCst));
    println!("  last unit taken after:             {last}");
    println!("  stock gone on every node after:    {} ms", drained_at.as_millis());
    println!(
        "  fresh reads: {} complete (lowest {}), {} failed or incomplete; shard sums: {} (lowest {})",
        reads.complete.load(SeqCst),
        reads.lowest.load(SeqCst),
        reads.incomplete.load(SeqCst),
        reads.sums.load(SeqCst),
        reads.lowest_sum.load(SeqCst)
    );
    println!(
        "  /metrics, summed over the nodes (node3's since its restart): tally_escrow_grants_total {grants}, \
         tally_escrow_messages_total {messages}, tally_bound_refusals_total {refusals}"
    );

    let unexpected = t.unexpected.lock().unwrap().clone();
    if hung || !unexpected.is_empty() {
        for n in 1..=3 {
            for line in c.log(n).lines().filter(|l| l.contains("panicked") || l.contains("ERROR")).take(10) {
                println!("  node{n}: {}", &line[..line.len().min(300)]);
            }
        }
    }
    assert!(unexpected.is_empty(), "unexpected answers: {unexpected:?}");
    assert!(!hung, "the stock was not gone on every node within {} s", DRAIN_MAX.as_secs());
    // (a) Never more than the stock, and all of it once healed and drained.
    assert_eq!(t.over.load(SeqCst), 0, "more than {STOCK} decrements acknowledged");
    assert_eq!(t.taken.load(SeqCst), STOCK, "acknowledged decrements once the stock is gone");
    // (b) No read below the floor.
    let below = reads.below_zero.lock().unwrap().clone();
    assert!(below.is_empty(), "reads below 0: {below:?}");
    assert!(reads.complete.load(SeqCst) > 0, "no complete fresh read during the run");
    // (c) Every node reads 0; every acknowledged id is remembered.
    for node in 1..=3 {
        assert_eq!(c.value(node, COUNTER).await?, 0, "node{node}");
    }
    let acked = t.acked.lock().unwrap().clone();
    let mut checks = Vec::new();
    for (k, chunk) in acked.chunks(acked.len().div_ceil(16).max(1)).enumerate() {
        let (c, chunk) = (c.clone(), chunk.to_vec());
        checks.push(tokio::spawn(async move {
            for id in chunk {
                let (status, body) = c.incr(1 + k % 3, COUNTER, json!({"delta": -1, "event_id": id})).await?;
                anyhow::ensure!(
                    status == 200 && body == json!({"applied": false, "duplicate": true}),
                    "{id} sent again: {status} {body}"
                );
            }
            anyhow::Ok(())
        }));
    }
    for check in checks {
        check.await??;
    }
    // And a new one is refused: nothing is left.
    let (status, body) = c.incr(2, COUNTER, json!({"delta": -1, "event_id": "one-more"})).await?;
    assert_eq!((status, &body["error"]["code"]), (409, &json!("bound_exceeded")), "{body}");
    openapi::check("POST", "/v1/counters/{name}/increments", status, &body)?;
    for node in 1..=3 {
        assert_eq!(c.value(node, COUNTER).await?, 0, "node{node} after the duplicates");
    }
    Ok(())
}

/// One copy of every shard: while node 3 is down, the shares of its shards are out
/// of reach (their decrements wait for it, the other shards refuse once their own
/// shares are spent), and once it is back the rest of the stock is taken, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_copy_a_killed_node_never_lets_the_stock_go_below_zero() -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let c = Arc::new(TestCluster::start(3).await?);
    inventory(c, "one copy").await
}

/// Three copies of every shard (`cluster.replicas = 3`): the killed node's ranges
/// fail over, and the stock is taken exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_copies_a_killed_node_never_lets_the_stock_go_below_zero() -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let c = Arc::new(TestCluster::start_configured(3, &[], "cluster.replicas = 3\n").await?);
    inventory(c, "three copies").await
}
