//! t48: a distributed rate limiter on three real nodes. A counter with `windows:
//! ["1m"]` and `limit: {"window": "1m", "max": LIMIT}` over [`SHARDS`] shards takes
//! `+1` requests from [`WRITERS`] clients through all three nodes; its shards spend
//! their shares of the limit and borrow each other's across nodes.
//!
//! Every request carries an event id; one whose outcome is unknown (a timeout, a
//! 503, a connection error) is sent again with the same id through the next node, a
//! 409 `bound_exceeded` is a definite "not counted". Two bursts of [`BURST`]: the
//! first starts on an empty window; the second once every bucket of the first has
//! left the window, when the whole limit is headroom again.
//!
//! Checks: requests submitted at or after an instant and acknowledged within 59 s of
//! it (a window less one bucket: all of them sat in kept buckets together) never
//! number more than the limit; each burst is admitted up to the limit (every shard
//! borrowed what it lacked); every node's window read says so (`limit`, `remaining`,
//! never above the limit); a decrement is refused with 422 `invalid_delta`; the
//! spec's checks answer 422 `invalid_spec`. The answers match the OpenAPI document.
//! The figures are printed.

use anyhow::Result;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tally_tests::{openapi, TestCluster};

/// Requests admitted per minute.
const LIMIT: u64 = 150;
/// Shards of the counter (spread over the three nodes).
const SHARDS: u16 = 6;
/// Concurrent clients.
const WRITERS: usize = 24;
/// How long each burst sends requests.
const BURST: Duration = Duration::from_secs(4);
/// The window, and its bucket width.
const WINDOW: Duration = Duration::from_secs(60);
const BUCKET: Duration = Duration::from_secs(1);
/// Pause after an admitted request, and after a refusal or an unknown outcome.
const THINK: Duration = Duration::from_millis(10);
const PAUSE: Duration = Duration::from_millis(50);
const COUNTER: &str = "api";

/// One request's fate: when it was first sent and when it was acknowledged (since
/// the test's start), or refused.
#[derive(Default)]
struct Seen {
    acked: Vec<(Duration, Duration)>,
    refused: u64,
    unknown: u64,
    unexpected: Vec<String>,
}

async fn request(http: &reqwest::Client, c: &TestCluster, node: usize, body: &Value) -> Option<(u16, Value)> {
    let url = format!("{}/v1/counters/{COUNTER}/increments", c.node(node).url());
    let r = http.post(url).json(body).send().await.ok()?;
    let status = r.status().as_u16();
    Some((status, r.json().await.unwrap_or(Value::Null)))
}

/// Client `w` of burst `burst`: requests until `until`, each until its outcome is known.
async fn client(
    w: usize,
    burst: u32,
    c: Arc<TestCluster>,
    http: reqwest::Client,
    start: Instant,
    until: Instant,
    seen: Arc<Mutex<Seen>>,
) {
    let mut node = 1 + w % c.len();
    let mut i = 0;
    while Instant::now() < until {
        let body = json!({"delta": 1, "event_id": format!("req-{burst}-{w}-{i}")});
        i += 1;
        let sent = start.elapsed();
        loop {
            match request(&http, &c, node, &body).await {
                Some((200, b)) if b["applied"] == json!(true) || b["duplicate"] == json!(true) => {
                    seen.lock().unwrap().acked.push((sent, start.elapsed()));
                    tokio::time::sleep(THINK).await;
                    break;
                }
                Some((409, b)) if b["error"]["code"] == json!("bound_exceeded") => {
                    seen.lock().unwrap().refused += 1;
                    tokio::time::sleep(PAUSE).await;
                    break;
                }
                Some((503 | 504, _)) | None => {
                    seen.lock().unwrap().unknown += 1;
                    node = 1 + node % c.len();
                    tokio::time::sleep(PAUSE).await;
                }
                Some((status, b)) => {
                    seen.lock().unwrap().unexpected.push(format!("{body} through node{node}: {status} {b}"));
                    return;
                }
            }
        }
    }
}

async fn burst(
    c: &Arc<TestCluster>,
    http: &reqwest::Client,
    start: Instant,
    n: u32,
    seen: &Arc<Mutex<Seen>>,
) {
    let until = Instant::now() + BURST;
    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| tokio::spawn(client(w, n, c.clone(), http.clone(), start, until, seen.clone())))
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// The most requests acknowledged within one span of the window less a bucket.
fn most_in_a_span(acked: &[(Duration, Duration)]) -> usize {
    let span = WINDOW - BUCKET;
    let count = |t: Duration| acked.iter().filter(|(s, a)| *s >= t && *a <= t + span).count();
    acked.iter().map(|(s, _)| count(*s)).max().unwrap_or(0)
}

/// Every node's read of the limited window: complete, never above the limit, with
/// what is left stated. Returns the values read.
async fn window_reads(c: &TestCluster) -> Result<Vec<u64>> {
    let mut values = Vec::new();
    for node in 1..=c.len() {
        let r = c.get(node, &format!("/v1/counters/{COUNTER}/value?window=1m")).await?;
        openapi::check("GET", "/v1/counters/{name}/value", 200, &r)?;
        let value = r["value"].as_u64().expect("a value");
        assert!(value <= LIMIT && r["complete"] == json!(true), "node{node}: {r}");
        assert_eq!((r["limit"].as_u64(), r["remaining"].as_u64()), (Some(LIMIT), Some(LIMIT - value)), "{r}");
        values.push(value);
    }
    Ok(values)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_across_three_nodes_and_comes_back_with_the_window() -> Result<()> {
    let c = Arc::new(TestCluster::start(3).await?);
    // The spec's checks.
    for (spec, why) in [
        (json!({"durability": "sync", "limit": {"window": "1m", "max": 10}}), "a window not kept"),
        (json!({"windows": ["1m"], "limit": {"window": "1m", "max": 10}}), "batched"),
        (
            json!({"durability": "sync", "windows": ["1m"], "max": 5, "limit": {"window": "1m", "max": 10}}),
            "with max",
        ),
        (json!({"durability": "sync", "windows": ["1m"], "limit": {"window": "1m", "max": 0}}), "max 0"),
    ] {
        let (status, body) = c.send(1, "PUT", "/v1/counters/bad", spec).await?;
        assert_eq!((status, &body["error"]["code"]), (422, &json!("invalid_spec")), "{why}: {body}");
    }
    let spec = json!({"shards": SHARDS, "durability": "sync", "windows": ["1m"], "rollup_ms": 0,
                      "limit": {"window": "1m", "max": LIMIT}});
    let (status, body) = c.send(1, "PUT", &format!("/v1/counters/{COUNTER}"), spec).await?;
    assert_eq!(status, 201, "{body}");
    openapi::check("PUT", "/v1/counters/{name}", 201, &body)?;
    assert_eq!(body["spec"]["limit"], json!({"window": "1m", "max": LIMIT}), "{body}");
    let (status, body) = c.incr(2, COUNTER, json!({"delta": -1})).await?;
    assert_eq!((status, &body["error"]["code"]), (422, &json!("invalid_delta")), "{body}");
    let (status, body) = c.send(3, "PUT", &format!("/v1/counters/{COUNTER}"), json!({"shards": 3})).await?;
    assert_eq!((status, &body["error"]["code"]), (422, &json!("invalid_spec")), "{body}");

    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Seen::default()));
    burst(&c, &http, start, 1, &seen).await;
    let first = seen.lock().unwrap().acked.len();
    let first_last_ack = seen.lock().unwrap().acked.iter().map(|(_, a)| *a).max().unwrap_or_default();
    let after_first = window_reads(&c).await?;
    // Every bucket of the first burst leaves the window.
    let wait = (first_last_ack + WINDOW + BUCKET).saturating_sub(start.elapsed());
    tokio::time::sleep(wait).await;
    let emptied = window_reads(&c).await?;
    burst(&c, &http, start, 2, &seen).await;
    let after_second = window_reads(&c).await?;

    let seen = seen.lock().unwrap();
    let second = seen.acked.len() - first;
    let most = most_in_a_span(&seen.acked);
    println!(
        "rate limit {LIMIT}/1m over {SHARDS} shards on 3 nodes, {WRITERS} clients: burst 1 admitted {first}, burst 2 \
         admitted {second}; {} refused, {} unknown outcomes retried; at most {most} in one 59 s span; window reads \
         {after_first:?} after burst 1, {emptied:?} a window later, {after_second:?} after burst 2",
        seen.refused, seen.unknown
    );
    assert!(seen.unexpected.is_empty(), "{:?}", seen.unexpected);
    assert!(most as u64 <= LIMIT, "{most} acknowledged within one span of the window");
    // Each burst is admitted up to the limit: the shards borrowed what they lacked.
    for (n, admitted) in [(1, first), (2, second)] {
        assert_eq!(admitted as u64, LIMIT, "burst {n}: admitted {admitted} of {LIMIT}");
    }
    assert!(after_first.iter().all(|v| *v == LIMIT), "{after_first:?}");
    assert!(emptied.iter().all(|v| *v == 0), "{emptied:?}");
    assert!(after_second.iter().all(|v| *v == LIMIT), "{after_second:?}");
    Ok(())
}
