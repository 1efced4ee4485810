//! t10: the built `tally` binary against a real node on a loopback port: every
//! command's happy path in text and `--json`, the server's errors and the client's
//! own (unreachable node, bad arguments) with their exit codes, and `tally load`
//! in single and batch mode with verification.

mod common;

use common::*;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_incr_get_info_and_delete() {
    let node = Node::start().await;

    let created =
        node.tally(&["create", "likes", "--shards", "4", "--durability", "sync", "--rollup-ms", "0"]).await;
    let text = created.ok();
    assert!(text.starts_with("created likes\n"), "{text}");
    assert!(text.contains("shards          4") && text.contains("durability      sync"), "{text}");
    let updated =
        node.tally(&["--json", "create", "likes", "--router", "round_robin", "--dedup-window-s", "60"]).await;
    let spec = &updated.json()["spec"];
    assert_eq!((spec["router"].as_str(), spec["shards"].as_u64()), (Some("round_robin"), Some(4)));
    assert_eq!(spec["dedup_window_s"], 60);
    let again = node.tally(&["create", "likes", "--flush-ms", "50"]).await;
    assert!(again.ok().starts_with("updated likes\n"), "{again:?}");

    assert_eq!(node.tally(&["incr", "likes"]).await.ok(), "applied +1 to likes\n");
    assert_eq!(
        node.tally(&["incr", "likes", "--by", "-3", "--writer", "w1"]).await.ok(),
        "applied -3 to likes\n"
    );
    let first = node.tally(&["--json", "incr", "likes", "--by", "10", "--event-id", "e-1"]).await;
    assert_eq!(first.json(), serde_json::json!({"applied": true}));
    let retry = node.tally(&["incr", "likes", "--by", "10", "--event-id", "e-1"]).await;
    assert!(retry.ok().starts_with("duplicate"), "{retry:?}");

    let value = node.tally(&["get", "likes", "--fresh"]).await;
    let text = value.ok();
    assert!(text.starts_with("likes = 8\n"), "{text}");
    assert!(text.contains("consistency  fresh") && text.contains("complete     yes"), "{text}");
    let json = node.tally(&["--json", "get", "likes"]).await.json();
    assert_eq!((json["value"].as_i64(), json["complete"].as_bool()), (Some(8), Some(true)));
    assert!(json["missing_shards"].as_array().is_some_and(Vec::is_empty), "{json}");

    let info = node.tally(&["info", "likes"]).await;
    assert!(
        info.ok().starts_with("likes\n") && info.stdout.contains("router          round_robin"),
        "{info:?}"
    );
    assert_eq!(node.tally(&["--json", "info", "likes"]).await.json()["name"], "likes");

    assert_eq!(node.tally(&["delete", "likes"]).await.ok(), "deleted likes\n");
    let gone = node.tally(&["--json", "get", "likes"]).await;
    assert_eq!(gone.code, Some(1), "{gone:?}");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_shards_cluster_and_reconcile() {
    let node = Node::start().await;
    node.tally(&["create", "visitors", "--distinct", "--shards", "3", "--router", "round_robin"]).await.ok();
    for member in ["ann", "bob", "cat", "ann", "bob", "dan"] {
        node.tally(&["incr", "visitors", "--member", member]).await.ok();
    }

    let distinct = node.tally(&["distinct", "visitors"]).await;
    assert!(distinct.ok().starts_with("visitors: ~4 distinct members (±"), "{distinct:?}");
    assert!(distinct.ok().contains(" bytes, counter "), "{distinct:?}");
    let json = node.tally(&["--json", "distinct", "visitors"]).await.json();
    assert_eq!(json["estimate"], 4);

    let shards = node.tally(&["shards", "visitors"]).await;
    let text = shards.ok();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "shard  node   value  writes", "{text}");
    assert_eq!(lines.len(), 5, "header, three shards, summary: {text}");
    assert!(lines[1..4].iter().all(|l| l.contains("node1")), "{text}");
    assert!(lines[4].contains("total 6") && lines[4].contains("skew"), "{text}");
    let json = node.tally(&["--json", "shards", "visitors"]).await.json();
    let sum: i64 =
        json["shards"].as_array().expect("shards").iter().filter_map(|s| s["value"].as_i64()).sum();
    assert_eq!(sum, 6);

    let cluster = node.tally(&["cluster"]).await;
    let expected = format!(
        "node   state  shards  http\nnode1  up     member  {}\nleader node1, term 0, placement epoch 0\n",
        node.addr
    );
    assert_eq!(cluster.ok(), expected);
    let json = node.tally(&["--json", "cluster"]).await.json();
    assert_eq!(json["leader"], "node1");
    // A single node has no membership to change; the error names why.
    let refused = node.tally(&["cluster", "add", "node2"]).await;
    assert_ne!(refused.code, Some(0), "{refused:?}");
    assert!(refused.stderr.contains("not_a_cluster"), "{refused:?}");

    let fixed = node.tally(&["reconcile", "visitors", "--authoritative", "10"]).await;
    assert_eq!(fixed.ok(), "visitors: sum of shards was 6, drift +4: corrected\n");
    let json = node.tally(&["--json", "reconcile", "visitors", "--authoritative", "10"]).await.json();
    assert_eq!(json, serde_json::json!({"before": 10, "drift": 0, "corrected": false}));
    let value = node.tally(&["--json", "get", "visitors", "--fresh"]).await.json();
    assert_eq!(value["value"], 10);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_windows_are_read_with_get_and_distinct() {
    let node = Node::start().await;
    let create = ["create", "visits", "--distinct", "--durability", "sync", "--windows", "1m,1h"];
    node.tally(&create).await.ok();
    for (delta, member) in [("3", "ann"), ("4", "bob"), ("5", "ann")] {
        node.tally(&["incr", "visits", "--by", delta, "--member", member]).await.ok();
    }
    let text = node.tally(&["get", "visits", "--window", "1h"]).await;
    assert!(text.ok().starts_with("visits over the last 1h = 12\n"), "{text:?}");
    assert!(text.ok().contains("60000 ms buckets") && text.ok().contains("complete"), "{text:?}");
    let json = node.tally(&["--json", "get", "visits", "--window", "1m"]).await.json();
    assert_eq!((json["value"].as_i64(), json["bucket_ms"].as_u64()), (Some(12), Some(1_000)), "{json}");
    let json = node.tally(&["--json", "distinct", "visits", "--window", "1h"]).await.json();
    assert_eq!(json["estimate"], 2, "{json}");
    let text = node.tally(&["distinct", "visits", "--window", "1m"]).await;
    assert!(text.ok().contains("distinct") && text.ok().contains("~2 (±"), "{text:?}");
    let unknown = node.tally(&["get", "visits", "--window", "24h"]).await;
    assert_ne!(unknown.code, Some(0), "{unknown:?}");
    assert!(unknown.stderr.contains("unknown_window"), "{unknown:?}");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_exit_non_zero_with_their_code() {
    let node = Node::start().await;
    let text = node.tally(&["get", "nope"]).await;
    assert_eq!(text.code, Some(1), "{text:?}");
    assert!(text.stdout.is_empty(), "{text:?}");
    assert!(text.stderr.starts_with("error: counter_not_found (HTTP 404): "), "{text:?}");

    let json = node.tally(&["--json", "info", "nope"]).await;
    assert_eq!(json.code, Some(1), "{json:?}");
    let body: Value = serde_json::from_str(&json.stdout).expect("JSON error");
    assert_eq!(body["error"]["code"], "counter_not_found");
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("nope")), "{body}");

    for args in [&["delete", "nope"][..], &["shards", "nope"], &["distinct", "nope"]] {
        let run = node.tally(args).await;
        assert_eq!(run.code, Some(1), "{args:?}: {run:?}");
        assert!(run.stderr.contains("counter_not_found"), "{args:?}: {run:?}");
    }
    let zero = node.tally(&["incr", "x", "--by", "0"]).await;
    assert_eq!(zero.code, Some(1), "{zero:?}");
    assert!(zero.stderr.contains("invalid_delta"), "{zero:?}");
    let spec = node.tally(&["create", "x", "--shards", "5000"]).await;
    assert!(spec.code == Some(1) && spec.stderr.contains("invalid_spec"), "{spec:?}");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_side_failures_have_their_own_codes() {
    // A port nothing listens on: bound, read, released.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let node = format!("127.0.0.1:{port}");
    let down = tally(&["--node", &node, "cluster"]).await;
    assert_eq!(down.code, Some(3), "{down:?}");
    assert!(down.stderr.starts_with("error: unreachable: "), "{down:?}");
    let json = tally(&["--node", &node, "--json", "get", "x"]).await;
    assert_eq!(json.code, Some(3), "{json:?}");
    assert!(json.stdout.contains(r#""code":"unreachable""#), "{json:?}");

    let scheme = tally(&["--node", "ftp://127.0.0.1:7070", "cluster"]).await;
    assert_eq!(scheme.code, Some(2), "{scheme:?}");
    assert!(scheme.stderr.contains("invalid_node_url"), "{scheme:?}");
    let cacert =
        tally(&["--node", "https://127.0.0.1:7070", "--cacert", "/nonexistent/ca.pem", "cluster"]).await;
    assert_eq!(cacert.code, Some(2), "{cacert:?}");
    assert!(cacert.stderr.contains("invalid_cacert"), "{cacert:?}");
    let word = tally(&["create", "x", "--durability", "fast"]).await;
    assert_eq!(word.code, Some(2), "{word:?}");
    let writers = tally(&["load", "x", "--writers", "0"]).await;
    assert_eq!(writers.code, Some(2), "{writers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_may_come_from_the_environment() {
    let node = Node::start().await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["--json", "cluster"])
        .env("TALLY_NODE", node.url())
        .output()
        .await
        .expect("tally runs");
    let run: Run = out.into();
    assert_eq!(run.json()["nodes"][0]["http"], node.addr.to_string());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_of_single_increments_verifies() {
    let node = Node::start().await;
    let run = node
        .tally(&[
            "--json",
            "load",
            "storm",
            "--duration",
            "2s",
            "--writers",
            "8",
            "--event-ids",
            "--verify",
            "--create-shards",
            "4",
            "--durability",
            "batched",
            "--flush-ms",
            "50",
        ])
        .await;
    let report = run.json();
    assert_eq!((report["writers"].as_u64(), report["batch"].as_u64()), (Some(8), Some(1)), "{report}");
    let acked = report["acknowledged"].as_u64().expect("acknowledged");
    assert!(acked > 0, "{report}");
    assert!(report["increments_per_s"].as_f64().is_some_and(|r| r > 0.0), "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(report["duplicates"], 0, "{report}");
    let latency = &report["latency_us"]["per_request"];
    assert_eq!(latency["count"], report["requests"], "{report}");
    assert!(latency["p50"].as_u64() <= latency["p99"].as_u64(), "{report}");
    assert!(latency["p99"].as_u64() <= latency["max"].as_u64(), "{report}");
    let verify = &report["verify"];
    assert_eq!(verify["pass"], true, "{report}");
    assert_eq!((verify["grew"].as_u64(), verify["waited_ms"].as_u64()), (Some(acked), Some(150)), "{report}");
    assert!(report["elapsed_ms"].as_u64().is_some_and(|ms| (2000..12_000).contains(&ms)), "{report}");

    // The spec it was created with, and the total it left.
    let info = node.tally(&["--json", "info", "storm"]).await.json();
    assert_eq!((info["spec"]["shards"].as_u64(), info["spec"]["flush_ms"].as_u64()), (Some(4), Some(50)));
    let value = node.tally(&["--json", "get", "storm", "--fresh"]).await.json();
    assert_eq!(value["value"].as_u64(), Some(acked));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_of_batches_over_several_node_urls_verifies() {
    let node = Node::start().await;
    // Two URLs of the same node: the writers alternate between them.
    let nodes = format!("{},{}", node.url(), node.addr);
    let run = tally(&[
        "--json",
        "load",
        "batched-storm",
        "--nodes",
        &nodes,
        "--duration",
        "1s",
        "--writers",
        "4",
        "--batch",
        "25",
        "--event-ids",
        "--durability",
        "sync",
        "--verify",
    ])
    .await;
    let report = run.json();
    assert_eq!(report["nodes"].as_array().map(Vec::len), Some(2), "{report}");
    let acked = report["acknowledged"].as_u64().expect("acknowledged");
    let requests = report["requests"].as_u64().expect("requests");
    assert!(acked > 0 && acked == requests * 25, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    let per_request = report["latency_us"]["per_request"]["p50"].as_u64().expect("p50");
    let per_increment = report["latency_us"]["per_increment"]["p50"].as_u64().expect("p50");
    assert!(per_increment * 10 <= per_request, "amortized over 25 increments: {report}");
    assert_eq!(report["verify"]["pass"], true, "{report}");
    assert_eq!(report["verify"]["waited_ms"], 0, "a sync counter needs no wait: {report}");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_prints_a_text_summary() {
    let node = Node::start().await;
    let run = node
        .tally(&["load", "text", "--duration", "1s", "--writers", "2", "--verify", "--no-progress"])
        .await;
    let text = run.ok();
    assert!(text.starts_with("load text: 2 writers on "), "{text}");
    for needle in
        ["acknowledged", "increments/s", "errors         none", "per request", "per increment", "PASS"]
    {
        assert!(text.contains(needle), "{needle:?} in {text}");
    }
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_against_a_dead_node_fails_within_its_duration() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let node = format!("http://127.0.0.1:{port}");
    let started = std::time::Instant::now();
    let run = tally(&["--node", &node, "--json", "load", "x", "--duration", "500ms", "--writers", "2"]).await;
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "{:?}", started.elapsed());
    assert_eq!(run.code, Some(4), "{run:?}");
    let report: Value = serde_json::from_str(&run.stdout).expect("one JSON report");
    assert_eq!(report["acknowledged"], 0, "{report}");
    assert!(report["errors"]["unreachable"].as_u64().is_some_and(|n| n > 0), "{report}");
    assert_eq!(run.stdout.trim().lines().count(), 1, "one JSON object on stdout: {run:?}");
    assert!(run.stderr.contains("nothing_acknowledged"), "{run:?}");
}
