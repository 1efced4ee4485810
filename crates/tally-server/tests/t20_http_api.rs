//! t20: the public HTTP interface, driven through the router without sockets.
//! Every endpoint's happy path with the JSON shapes of DESIGN.md, then every way a
//! request can be wrong — each must get its status and the `{"error": {...}}`
//! shape (invariant 8: no input crashes a node; it gets a clear error).

mod common;

use axum::body::Body;
use axum::http::Request;
use common::*;
use futures::StreamExt as _;
use serde_json::{json, Value};
use std::time::Duration;
use tally_server::{router, HttpConfig, SingleNode};

async fn app() -> (axum::Router, SingleNode) {
    let limits = HttpConfig::default();
    let node = mem_node(&limits).await;
    (router(node.clone(), &limits), node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_are_created_updated_read_and_deleted() {
    let (app, node) = app().await;
    let a = call(&app, "PUT", "/v1/counters/likes:1", Some(r#"{"shards": 4, "durability": "sync"}"#)).await;
    assert_eq!(a.status, 201, "{}", a.text);
    assert_eq!(a.headers["location"], "/v1/counters/likes:1");
    let j = a.json();
    assert_eq!(j["name"], "likes:1");
    assert_eq!(j["spec"]["shards"], 4);
    assert_eq!(j["spec"]["durability"], "sync");
    assert_eq!(j["spec"]["flush_ms"], 200, "unnamed fields keep their defaults");

    let a =
        call(&app, "PUT", "/v1/counters/likes:1", Some(r#"{"rollup_ms": 0, "router": "round_robin"}"#)).await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.json()["spec"]["router"], "round_robin");
    assert_eq!(a.json()["spec"]["durability"], "sync", "an update keeps what it does not name");

    // An empty body (no content type at all) is an empty patch.
    let a = call(&app, "PUT", "/v1/counters/plain", None).await;
    assert_eq!(a.status, 201, "{}", a.text);
    assert_eq!(a.json()["spec"]["shards"], 8);

    let a = call(&app, "GET", "/v1/counters/likes:1", None).await;
    assert_eq!(a.status, 200);
    let j = a.json();
    assert_eq!((j["spec"]["rollup_ms"].clone(), j["layout_shards"].clone()), (json!(0), json!(4)));
    assert!(j["created_at_ms"].as_u64().is_some_and(|t| t > 0), "{j}");

    let a = call(&app, "DELETE", "/v1/counters/likes:1", None).await;
    assert_eq!((a.status.as_u16(), a.text.as_str()), (204, ""));
    call(&app, "GET", "/v1/counters/likes:1", None).await.assert_error(404, "counter_not_found");
    call(&app, "DELETE", "/v1/counters/likes:1", None).await.assert_error(404, "counter_not_found");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_is_set_read_and_removed_and_a_passed_one_deletes() {
    let (app, node) = app().await;
    let a = call(&app, "PUT", "/v1/counters/w", Some(r#"{"durability": "sync", "ttl_ms": 60000}"#)).await;
    assert_eq!(a.status, 201, "{}", a.text);
    let at = a.json()["expires_at_ms"].as_u64().expect("a deadline");
    let j = call(&app, "GET", "/v1/counters/w/expiry", None).await.json();
    assert_eq!(j["expires_at_ms"], at);
    assert!(j["ttl_ms"].as_i64().is_some_and(|t| (1..=60_000).contains(&t)), "{j}");
    let later = r#"{"ttl_ms": 120000, "when": "gt"}"#;
    let j = call(&app, "PUT", "/v1/counters/w/expiry", Some(later)).await.json();
    assert_eq!(j["changed"], true, "{j}");
    let j =
        call(&app, "PUT", "/v1/counters/w/expiry", Some(r#"{"ttl_ms": 5000, "when": "nx"}"#)).await.json();
    assert_eq!(j["changed"], false, "{j}");
    let j = call(&app, "DELETE", "/v1/counters/w/expiry", None).await.json();
    assert_eq!(
        (j["changed"].clone(), j["ttl_ms"].clone(), j["expires_at_ms"].clone()),
        (json!(true), json!(-1), Value::Null)
    );
    call(&app, "PUT", "/v1/counters/w/expiry", Some(r#"{"ttl_ms": 0}"#))
        .await
        .assert_error(422, "invalid_spec");
    call(&app, "PUT", "/v1/counters/w/expiry", Some(r#"{}"#)).await.assert_error(400, "invalid_body");
    call(&app, "PUT", "/v1/counters/w/expiry", Some(r#"{"ttl_ms": 5, "when": "often"}"#))
        .await
        .assert_error(400, "invalid_body");
    call(&app, "GET", "/v1/counters/nope/expiry", None).await.assert_error(404, "counter_not_found");
    // A deadline already passed deletes the counter at once.
    let j = call(&app, "PUT", "/v1/counters/w/expiry", Some(r#"{"expires_at_ms": 1}"#)).await.json();
    assert_eq!(j["changed"], true);
    call(&app, "GET", "/v1/counters/w", None).await.assert_error(404, "counter_not_found");
    call(&app, "GET", "/v1/counters/w/value", None).await.assert_error(404, "counter_not_found");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_are_declared_listed_used_and_dropped() {
    let (app, node) = app().await;
    let body = r#"{"durability": "sync", "min": 0, "shards": 2, "ttl_ms": 60000}"#;
    let a = call(&app, "PUT", "/v1/namespaces/stock:", Some(body)).await;
    assert_eq!(a.status, 201, "{}", a.text);
    assert_eq!((a.json()["spec"]["min"].clone(), a.json()["ttl_ms"].clone()), (json!(0), json!(60000)));
    assert_eq!(call(&app, "PUT", "/v1/namespaces/stock:", Some(body)).await.status, 200);
    let auto = r#"{"shards": "auto", "min_shards": 2, "max_shards": 8}"#;
    assert_eq!(call(&app, "PUT", "/v1/namespaces/hot%3A", Some(auto)).await.status, 201, "percent-encoded");
    let list = call(&app, "GET", "/v1/namespaces", None).await.json();
    let prefixes: Vec<&str> =
        list["namespaces"].as_array().unwrap().iter().map(|n| n["prefix"].as_str().unwrap()).collect();
    assert_eq!(prefixes, ["hot:", "stock:"]);
    assert_eq!(call(&app, "GET", "/v1/namespaces/hot:", None).await.json()["auto"]["max_shards"], 8);
    // A counter created by its first increment takes the namespace's spec.
    call(&app, "POST", "/v1/counters/stock:1/increments", Some(r#"{"delta": 1}"#)).await;
    let c = call(&app, "GET", "/v1/counters/stock:1", None).await.json();
    assert_eq!((c["spec"]["min"].clone(), c["spec"]["shards"].clone()), (json!(0), json!(2)));
    assert!(c["expires_at_ms"].as_u64().is_some(), "{c}");
    call(&app, "PUT", "/v1/namespaces/bad:", Some(r#"{"min": 1, "durability": "sync"}"#))
        .await
        .assert_error(422, "invalid_spec");
    call(&app, "PUT", "/v1/namespaces/bad:", Some(r#"{"ttl_ms": 0}"#))
        .await
        .assert_error(422, "invalid_spec");
    assert_eq!(call(&app, "DELETE", "/v1/namespaces/stock:", None).await.status, 204);
    call(&app, "GET", "/v1/namespaces/stock:", None).await.assert_error(404, "namespace_not_found");
    call(&app, "DELETE", "/v1/namespaces/stock:", None).await.assert_error(404, "namespace_not_found");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn increments_count_once_per_event_id_and_reads_report_their_freshness() {
    let (app, node) = app().await;
    call(&app, "PUT", "/v1/counters/c", Some(r#"{"durability": "sync", "rollup_ms": 10}"#)).await;
    let a = call(&app, "POST", "/v1/counters/c/increments", Some(r#"{"delta": 5}"#)).await;
    assert_eq!((a.status.as_u16(), a.json()), (200, json!({"applied": true})));
    let body = r#"{"delta": -2, "event_id": "e-1", "writer": "w-7", "member": "user-42"}"#;
    assert_eq!(
        call(&app, "POST", "/v1/counters/c/increments", Some(body)).await.json(),
        json!({"applied": true})
    );
    let again = call(&app, "POST", "/v1/counters/c/increments", Some(body)).await;
    assert_eq!((again.status.as_u16(), again.json()), (200, json!({"applied": false, "duplicate": true})));
    let conflict = r#"{"delta": 9, "event_id": "e-1"}"#;
    call(&app, "POST", "/v1/counters/c/increments", Some(conflict))
        .await
        .assert_error(409, "event_id_conflict");

    let a = call(&app, "GET", "/v1/counters/c/value?consistency=fresh", None).await;
    assert_eq!(a.status, 200, "{}", a.text);
    let j = a.json();
    assert_eq!(j["value"], 3);
    assert_eq!(j["consistency"], "fresh");
    assert_eq!((j["staleness_ms"].clone(), j["complete"].clone()), (json!(0), json!(true)));
    assert_eq!(j["missing_shards"], json!([]));
    assert!(j["as_of_ms"].as_u64().is_some_and(|t| t > 1_600_000_000_000), "{j}");

    // Cached is the default; within a few refreshes it catches up.
    let mut cached = Value::Null;
    for _ in 0..200 {
        cached = call(&app, "GET", "/v1/counters/c/value", None).await.json();
        if cached["value"] == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cached["value"], 3, "{cached}");
    assert!(cached["staleness_ms"].is_u64() && cached["consistency"].is_string(), "{cached}");

    // Increments create unknown counters, like Redis INCR; reads of unknown ones are 404.
    call(&app, "POST", "/v1/counters/fresh:new/increments", Some(r#"{"delta": 1}"#)).await;
    assert_eq!(call(&app, "GET", "/v1/counters/fresh:new", None).await.status, 200);
    for path in ["value", "value?consistency=fresh", "distinct", "shards"] {
        call(&app, "GET", &format!("/v1/counters/nope/{path}"), None)
            .await
            .assert_error(404, "counter_not_found");
    }
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_beyond_64_bits_are_json_numbers() {
    let (app, node) = app().await;
    call(&app, "PUT", "/v1/counters/wide", Some(r#"{"shards": 4, "durability": "sync"}"#)).await;
    let huge = tally_core::limits::SHARD_VALUE_ABS_MAX;
    // One event id per shard, so each shard takes one huge delta.
    let mut ids: Vec<String> = Vec::new();
    for i in 0.. {
        let id = format!("e{i}");
        let shard = tally_core::router::shard_of_event(&id, 4);
        if !ids.iter().any(|x| tally_core::router::shard_of_event(x, 4) == shard) {
            ids.push(id);
        }
        if ids.len() == 4 {
            break;
        }
    }
    for id in &ids {
        let body = format!(r#"{{"delta": {huge}, "event_id": "{id}"}}"#);
        let a = call(&app, "POST", "/v1/counters/wide/increments", Some(&body)).await;
        assert_eq!(a.status, 200, "{}", a.text);
    }
    let a = call(&app, "GET", "/v1/counters/wide/value?consistency=fresh", None).await;
    let want = 4 * i128::from(huge);
    assert!(a.text.contains(&format!("\"value\":{want}")), "{}", a.text);
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_one_result_per_item_in_order() {
    let (app, node) = app().await;
    let body = json!({"increments": [
        {"counter": "likes:42", "delta": 1, "event_id": "x"},
        {"counter": "likes:42", "delta": 2, "writer": "w"},
        {"counter": "", "delta": 1},
        {"counter": "likes:43", "delta": 0},
        {"counter": "likes:43", "delta": 4, "member": "m"},
    ]});
    let a = call(&app, "POST", "/v1/increments", Some(&body.to_string())).await;
    assert_eq!(a.status, 200, "{}", a.text);
    let results = a.json()["results"].as_array().cloned().expect("results");
    assert_eq!(results.len(), 5);
    assert_eq!(results[0], json!({"applied": true}));
    assert_eq!(results[1], json!({"applied": true}));
    assert_eq!(results[2]["error"]["code"], "invalid_name");
    assert_eq!(results[3]["error"]["code"], "invalid_delta");
    assert!(results[3]["error"]["message"].is_string());
    assert_eq!(results[4], json!({"applied": true}));
    // A retried batch is deduplicated by event id.
    let retry = json!({"increments": [{"counter": "likes:42", "delta": 1, "event_id": "x"}]});
    let a = call(&app, "POST", "/v1/increments", Some(&retry.to_string())).await;
    assert_eq!(a.json()["results"][0], json!({"applied": false, "duplicate": true}));
    let v = call(&app, "GET", "/v1/counters/likes:42/value?consistency=fresh", None).await.json();
    assert_eq!(v["value"], 3);
    let empty = call(&app, "POST", "/v1/increments", Some(r#"{"increments": []}"#)).await;
    assert_eq!((empty.status.as_u16(), empty.json()), (200, json!({"results": []})));
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_malformed_delta_or_too_many_items_is_refused_whole() {
    let limits = HttpConfig { batch_items_max: 3, ..HttpConfig::default() };
    let node = mem_node(&limits).await;
    let app = router(node.clone(), &limits);
    let bad = json!({"increments": [
        {"counter": "a", "delta": 1},
        {"counter": "a", "delta": 1.5},
    ]});
    let a = call(&app, "POST", "/v1/increments", Some(&bad.to_string())).await;
    a.assert_error(400, "invalid_delta");
    assert!(a.json()["error"]["message"].as_str().is_some_and(|m| m.contains("increments[1]")), "{}", a.text);
    call(&app, "GET", "/v1/counters/a", None).await.assert_error(404, "counter_not_found");

    let four = json!({"increments": (0..4).map(|_| json!({"counter": "a", "delta": 1})).collect::<Vec<_>>()});
    call(&app, "POST", "/v1/increments", Some(&four.to_string())).await.assert_error(413, "batch_too_large");
    call(&app, "GET", "/v1/counters/a", None).await.assert_error(404, "counter_not_found");
    let three =
        json!({"increments": (0..3).map(|_| json!({"counter": "a", "delta": 1})).collect::<Vec<_>>()});
    assert_eq!(call(&app, "POST", "/v1/increments", Some(&three.to_string())).await.status, 200);
    let shape = call(&app, "POST", "/v1/increments", Some(r#"{"increments": [{"delta": 1}]}"#)).await;
    shape.assert_error(400, "invalid_body");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_shards_reconcile_and_cluster_answer_their_documented_shapes() {
    let (app, node) = app().await;
    call(&app, "PUT", "/v1/counters/u", Some(r#"{"distinct": true, "shards": 2, "durability": "sync"}"#))
        .await;
    for i in 0..50 {
        let body = format!(r#"{{"delta": 1, "member": "user-{}", "writer": "w{i}"}}"#, i % 10);
        assert_eq!(call(&app, "POST", "/v1/counters/u/increments", Some(&body)).await.status, 200);
    }
    let d = call(&app, "GET", "/v1/counters/u/distinct", None).await;
    assert_eq!(d.status, 200, "{}", d.text);
    assert_eq!(d.json()["estimate"], 10);
    assert!(d.json()["relative_error"].as_f64().is_some_and(|e| e > 0.0 && e < 0.05));
    // Ten members cost a few dozen bytes, not a dense sketch; the counter's shards
    // together cost at least the merged sketch.
    let sketch_bytes = d.json()["sketch_bytes"].as_u64().expect("sketch_bytes");
    let counter_bytes = d.json()["counter_bytes"].as_u64().expect("counter_bytes");
    assert!((20..100).contains(&sketch_bytes), "{}", d.text);
    assert!(counter_bytes >= sketch_bytes && counter_bytes < 200, "{}", d.text);

    let s = call(&app, "GET", "/v1/counters/u/shards", None).await.json();
    let shards = s["shards"].as_array().cloned().expect("shards");
    assert_eq!(shards.len(), 2);
    assert_eq!(shards[0]["index"], 0);
    assert_eq!(shards[0]["node"], "node1");
    let sum: i64 = shards.iter().filter_map(|x| x["value"].as_i64()).sum();
    assert_eq!(sum, 50);
    assert!(s["skew"].as_f64().is_some_and(|k| k >= 1.0), "{s}");

    let r = call(&app, "POST", "/v1/counters/u/reconcile", Some(r#"{"authoritative": 55}"#)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json(), json!({"before": 50, "drift": 5, "corrected": true}));
    let again = call(&app, "POST", "/v1/counters/u/reconcile", Some(r#"{"authoritative": 55}"#)).await;
    assert_eq!(again.json(), json!({"before": 55, "drift": 0, "corrected": false}));
    let v = call(&app, "GET", "/v1/counters/u/value?consistency=fresh", None).await.json();
    assert_eq!(v["value"], 55);

    let c = call(&app, "GET", "/v1/cluster", None).await;
    assert_eq!(c.status, 200);
    assert_eq!(
        c.json(),
        json!({
            "nodes": [{"id": "node1", "state": "up", "http": "127.0.0.1:7070", "member": true}],
            "leader": "node1", "term": 0, "placement_epoch": 0, "handoff": [], "data_lost": []
        })
    );
    // A single node has no membership to change.
    call(&app, "PUT", "/v1/cluster/members/node2", None).await.assert_error(409, "not_a_cluster");
    call(&app, "DELETE", "/v1/cluster/members/node1", None).await.assert_error(409, "not_a_cluster");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_turns_503_when_the_node_drains() {
    let (app, node) = app().await;
    let a = call(&app, "GET", "/healthz", None).await;
    assert_eq!((a.status.as_u16(), a.json()), (200, json!({"status": "ok"})));
    node.begin_shutdown();
    let a = call(&app, "GET", "/healthz", None).await;
    a.assert_error(503, "shutting_down");
    assert_eq!(a.headers["retry-after"], "1");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_valid_prometheus_text_with_engine_and_http_signals() {
    let (app, node) = app().await;
    call(&app, "PUT", "/v1/counters/s", Some(r#"{"durability": "sync"}"#)).await;
    for i in 0..3 {
        let body = format!(r#"{{"delta": 1, "event_id": "e{i}"}}"#);
        call(&app, "POST", "/v1/counters/s/increments", Some(&body)).await;
    }
    call(&app, "POST", "/v1/counters/s/increments", Some(r#"{"delta": 1, "event_id": "e0"}"#)).await;
    call(&app, "POST", "/v1/counters/b/increments", Some(r#"{"delta": 1}"#)).await;
    call(&app, "GET", "/v1/counters/s/value?consistency=fresh", None).await;
    call(&app, "GET", "/nope", None).await;
    // A batched increment is counted once its drain is answered (within `flush_ms`).
    let batched = "tally_increments_total{durability=\"batched\"} 1";
    let mut a = call(&app, "GET", "/metrics", None).await;
    for _ in 0..50 {
        if a.text.lines().any(|l| l == batched) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        a = call(&app, "GET", "/metrics", None).await;
    }
    assert_eq!(a.status, 200);
    assert_eq!(a.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    let samples = check_prometheus(&a.text);
    let get = |k: &str| samples.get(k).copied().unwrap_or_else(|| panic!("no sample {k} in\n{}", a.text));
    assert_eq!(get("tally_increments_total{durability=\"sync\"}"), 3.0);
    assert_eq!(get("tally_increments_total{durability=\"batched\"}"), 1.0);
    assert_eq!(get("tally_dedup_hits_total"), 1.0);
    assert!(get("tally_flushes_total") >= 1.0);
    assert!(get("tally_flush_waiters_count") >= 1.0);
    assert!(get("tally_commit_batch_submissions_count") >= 1.0);
    assert_eq!(get("tally_reads_total{consistency=\"fresh\"}"), 1.0);
    assert_eq!(get("tally_read_duration_seconds_count{consistency=\"fresh\"}"), 1.0);
    assert!(samples.contains_key("tally_drift_last"));
    assert!(get("tally_active_counters") >= 2.0);
    assert!(samples.contains_key("tally_active_shard_actors"));
    assert!(get("tally_commit_cycle_writes_count") >= 1.0);
    // The gauge agrees with the counter's own shards report.
    let skew_b =
        call(&app, "GET", "/v1/counters/b/shards", None).await.json()["skew"].as_f64().expect("skew");
    assert!(skew_b > 1.0, "one write on a sharded counter: {skew_b}");
    assert_eq!(get("tally_shard_skew{counter=\"b\"}"), skew_b);
    assert!(get("tally_shard_skew{counter=\"s\"}") >= 1.0);
    assert_eq!(get("tally_node_info{node=\"node1\"}"), 1.0);
    assert!(get("tally_http_responses_total{class=\"2xx\"}") >= 7.0);
    assert_eq!(get("tally_http_responses_total{class=\"4xx\"}"), 1.0);
    assert!(get("tally_http_request_duration_seconds_count") >= 8.0);
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_the_wrong_shape_is_answered_with_the_field_and_what_it_takes() {
    let (app, node) = app().await;
    let cases: [(&str, &str, &str); 8] = [
        (
            "/v1/counters/c",
            r#"{"shards": -4}"#,
            r#"shards must be a whole number from 1 to 1024, or "auto" (got -4)"#,
        ),
        ("/v1/counters/c", "[]", "the body must be a JSON object of the documented fields (got an array)"),
        ("/v1/counters/c", r#"{"durability": 5}"#, r#"durability must be "sync" or "batched" (got 5)"#),
        (
            "/v1/counters/c",
            r#"{"frequency": {"epsilon": "x", "delta": 0.1}}"#,
            r#"frequency.epsilon must be a number (got "x")"#,
        ),
        ("/v1/counters/c", r#"{"colour": 1}"#, r#"unknown field "colour"; the fields are "#),
        (
            "/v1/counters/c/increments",
            r#"{"delta": 1, "seq": -1}"#,
            "seq must be a whole number from 0 to 9223372036854775807 (got -1)",
        ),
        (
            "/v1/increments",
            r#"{"increments": [{"counter": 5, "delta": 1}]}"#,
            "increments[0].counter must be a string (got 5)",
        ),
        (
            "/v1/namespaces/ns:",
            r#"{"ttl_ms": "soon"}"#,
            r#"ttl_ms must be a whole number of milliseconds, at least 1 (got "soon")"#,
        ),
    ];
    for (path, body, message) in cases {
        let method = if path.ends_with("increments") { "POST" } else { "PUT" };
        let a = call(&app, method, path, Some(body)).await;
        assert_eq!(a.status, 400, "{body}: {}", a.text);
        let got = a.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(got.starts_with(message), "{body}: {got:?}");
        for internal in ["untagged", "struct", "u64", "i64", "expected "] {
            assert!(!got.contains(internal), "{body}: the parser's words in {got:?}");
        }
    }
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_get_400_415_or_413_and_change_nothing() {
    let limits = HttpConfig { body_bytes_max: 4096, ..HttpConfig::default() };
    let node = mem_node(&limits).await;
    let app = router(node.clone(), &limits);
    let incr = "/v1/counters/c/increments";
    let json_cases: Vec<(&str, String, u16, &str)> = vec![
        (incr, "{\"delta\": ".into(), 400, "malformed_json"),
        (incr, "not json".into(), 400, "malformed_json"),
        (incr, "".into(), 400, "malformed_json"),
        (incr, "{\"delta\": 1} trailing".into(), 400, "malformed_json"),
        (incr, "{\"delta\": 1, \"colour\": 2}".into(), 400, "invalid_body"),
        (incr, "{\"delta\": 1, \"event_id\": 7}".into(), 400, "invalid_body"),
        (incr, "[1, 2]".into(), 400, "invalid_body"),
        (incr, "{\"delta\": 1.5}".into(), 400, "invalid_delta"),
        (incr, "{\"delta\": \"1\"}".into(), 400, "invalid_delta"),
        (incr, "{\"delta\": 1e3}".into(), 400, "invalid_delta"),
        (incr, "{\"delta\": 1.0}".into(), 400, "invalid_delta"),
        (incr, "{\"delta\": true}".into(), 400, "invalid_delta"),
        (incr, "{\"delta\": null}".into(), 400, "invalid_delta"),
        (incr, "{}".into(), 400, "invalid_delta"),
        (incr, "{\"delta\": 0}".into(), 400, "invalid_delta"),
        (incr, "{\"delta\": 9223372036854775808}".into(), 422, "out_of_range"),
        (incr, "{\"delta\": -9223372036854775809}".into(), 422, "out_of_range"),
        (incr, format!("{{\"delta\": 1{}}}", "0".repeat(400)), 422, "out_of_range"),
        (incr, "{\"delta\": 1, \"event_id\": \"has space\"}".into(), 400, "invalid_name"),
        (incr, format!("{{\"delta\": 1, \"event_id\": \"{}\"}}", "e".repeat(256)), 400, "invalid_name"),
        (incr, "{\"delta\": 1, \"event_id\": \"\\u0000\"}".into(), 400, "invalid_name"),
        ("/v1/counters/c", "{\"shards\": 0}".into(), 422, "invalid_spec"),
        ("/v1/counters/c", "{\"shards\": 70000}".into(), 422, "invalid_spec"),
        ("/v1/counters/c", "{\"durability\": \"fast\"}".into(), 422, "invalid_spec"),
        ("/v1/counters/c", "{\"rollup_ms\": 5}".into(), 422, "invalid_spec"),
        ("/v1/counters/c", "{\"shards\": -1}".into(), 400, "invalid_body"),
        ("/v1/counters/c", "{\"shardz\": 3}".into(), 400, "invalid_body"),
        ("/v1/counters/c", "{\"shards\": ".into(), 400, "malformed_json"),
        ("/v1/counters/c/reconcile", "{}".into(), 400, "invalid_body"),
        ("/v1/counters/c/reconcile", "{\"authoritative\": 1.5}".into(), 400, "invalid_body"),
        ("/v1/counters/c/reconcile", "{\"authoritative\": \"12\"}".into(), 400, "invalid_body"),
        (
            "/v1/counters/c/reconcile",
            format!("{{\"authoritative\": {}}}", "9".repeat(40)),
            422,
            "out_of_range",
        ),
        ("/v1/increments", "{\"increments\": {}}".into(), 400, "invalid_body"),
        ("/v1/increments", "{\"items\": []}".into(), 400, "invalid_body"),
        ("/v1/increments", "[".into(), 400, "malformed_json"),
    ];
    for (path, body, status, code) in &json_cases {
        let method = if path.ends_with("/c") { "PUT" } else { "POST" };
        let a = call(&app, method, path, Some(body)).await;
        let shown: String = body.chars().take(60).collect();
        assert_eq!(
            (a.status.as_u16(), a.json()["error"]["code"].as_str().unwrap_or("")),
            (*status, *code),
            "{method} {path} {shown:?} → {}",
            a.text
        );
        a.assert_error(*status, code);
    }
    // Nothing above was counted or created.
    call(&app, "GET", "/v1/counters/c", None).await.assert_error(404, "counter_not_found");

    // Content types.
    for ct in [Some("text/plain"), Some("application/x-www-form-urlencoded"), None] {
        let mut b = Request::builder().method("POST").uri(incr);
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        let a = send(&app, b.body(Body::from("{\"delta\": 1}")).expect("request")).await;
        a.assert_error(415, "unsupported_media_type");
    }
    let ok = Request::builder()
        .method("POST")
        .uri(incr)
        .header("content-type", "application/json; charset=utf-8")
        .body(Body::from("{\"delta\": 1}"))
        .expect("request");
    assert_eq!(send(&app, ok).await.status, 200);

    // Too large: declared, and streamed without a declared length.
    let big = format!("{{\"delta\": 1, \"writer\": \"{}\"}}", "w".repeat(5000));
    call(&app, "POST", incr, Some(&big)).await.assert_error(413, "body_too_large");
    let chunks: Vec<Result<String, std::io::Error>> = (0..10).map(|_| Ok("x".repeat(1000))).collect();
    let streamed = Request::builder()
        .method("POST")
        .uri(incr)
        .header("content-type", "application/json")
        .body(Body::from_stream(futures::stream::iter(chunks)))
        .expect("request");
    send(&app, streamed).await.assert_error(413, "body_too_large");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_json_is_a_400_not_a_crash() {
    // Far beyond serde_json's recursion limit of 128, anywhere in a body, up to the
    // 1 MiB default body limit.
    let (app, node) = app().await;
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    for body in [
        deep(200_000),
        format!("{{\"delta\": {}}}", deep(100_000)),
        format!("{{\"delta\": 1, \"writer\": {}}}", deep(1000)),
        format!("{{\"increments\": [{}]}}", deep(100_000)),
        format!("{{\"authoritative\": {}}}", deep(1000)),
        "[".repeat(500_000),
        "{\"a\":".repeat(100_000),
    ] {
        for path in
            ["/v1/counters/c/increments", "/v1/increments", "/v1/counters/c/reconcile", "/v1/counters/c"]
        {
            let method = if path.ends_with("/c") { "PUT" } else { "POST" };
            let a = call(&app, method, path, Some(&body)).await;
            assert_eq!(a.status, 400, "{path} nested {} bytes → {}", body.len(), a.text);
            a.assert_error(400, a.json()["error"]["code"].as_str().unwrap_or("?"));
        }
    }
    assert_eq!(call(&app, "GET", "/healthz", None).await.status, 200);
    call(&app, "GET", "/v1/counters/c", None).await.assert_error(404, "counter_not_found");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_paths_methods_and_queries_get_json_errors() {
    let (app, node) = app().await;
    call(&app, "GET", "/nope", None).await.assert_error(404, "not_found");
    // `GET /v1/counters` lists counters; other methods on it are refused.
    assert_eq!(call(&app, "GET", "/v1/counters", None).await.status, 200);
    call(&app, "POST", "/v1/counters", None).await.assert_error(405, "method_not_allowed");
    call(&app, "GET", "/v1/counters/", None).await.assert_error(404, "not_found");
    call(&app, "GET", "/v1/counters/a/b/c", None).await.assert_error(404, "not_found");
    let a = call(&app, "PATCH", "/v1/counters/x", None).await;
    a.assert_error(405, "method_not_allowed");
    assert!(a.headers.contains_key("allow"), "{:?}", a.headers);
    call(&app, "GET", "/v1/increments", None).await.assert_error(405, "method_not_allowed");
    call(&app, "DELETE", "/healthz", None).await.assert_error(405, "method_not_allowed");

    call(&app, "POST", "/v1/counters/x/increments", Some(r#"{"delta": 1}"#)).await;
    call(&app, "GET", "/v1/counters/x/value?consistency=eventual", None)
        .await
        .assert_error(400, "invalid_query");
    call(&app, "GET", "/v1/counters/x/value?consistency=", None).await.assert_error(400, "invalid_query");
    call(&app, "GET", "/v1/counters/x/value?fresh=1", None).await.assert_error(400, "invalid_query");
    assert_eq!(call(&app, "GET", "/v1/counters/x/value?consistency=cached", None).await.status, 200);

    // A name is any bytes, percent-encoded; a `%` must start an escape.
    call(&app, "GET", "/v1/counters/has%20space", None).await.assert_error(404, "counter_not_found");
    call(&app, "GET", "/v1/counters/a%2Fb", None).await.assert_error(404, "counter_not_found");
    call(&app, "GET", "/v1/counters/%FF%FE", None).await.assert_error(404, "counter_not_found");
    call(&app, "GET", "/v1/counters/bad%zz", None).await.assert_error(400, "invalid_path");
    call(&app, "GET", "/v1/counters/bad%2", None).await.assert_error(400, "invalid_path");
    let long = format!("/v1/counters/{}", "n".repeat(tally_core::name::NAME_BYTES_MAX + 1));
    call(&app, "PUT", &long, None).await.assert_error(400, "invalid_name");
    call(&app, "POST", &format!("{long}/increments"), Some(r#"{"delta": 1}"#))
        .await
        .assert_error(400, "invalid_name");
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_panics_become_json_answers_and_the_router_keeps_serving() {
    let limits = HttpConfig { request_timeout_ms: 300, ..HttpConfig::default() };
    let inner = mem_node(&limits).await;
    let app = router(Faulty { inner: inner.clone(), incr_delay: Duration::from_millis(2_000) }, &limits);

    // The node is slow: 503 `timeout`, retryable.
    let a = call(&app, "POST", "/v1/counters/c/increments", Some(r#"{"delta": 1, "event_id": "e"}"#)).await;
    a.assert_error(503, "timeout");
    assert_eq!(a.headers["retry-after"], "1");

    // The client is slow: its body never finishes. 408 `request_timeout`, and the
    // connection is not reused.
    let stalled = futures::stream::iter(vec![Ok::<_, std::io::Error>("{\"delta\":".to_string())])
        .chain(futures::stream::pending());
    let req = Request::builder()
        .method("POST")
        .uri("/v1/counters/c/increments")
        .header("content-type", "application/json")
        .header("content-length", "100")
        .body(Body::from_stream(stalled))
        .expect("request");
    let started = std::time::Instant::now();
    let a = send(&app, req).await;
    a.assert_error(408, "request_timeout");
    assert_eq!(a.headers["connection"], "close");
    assert!(started.elapsed() < Duration::from_secs(5));

    // A handler panics: 500 `internal`, and the next request is served. The panic's
    // text (source paths, values, internals) stays in the node's log.
    let a = call(&app, "GET", "/v1/counters/boom/value", None).await;
    a.assert_error(500, "internal");
    assert!(!a.text.contains("read of boom") && !a.text.contains("panick"), "{}", a.text);
    assert!(a.text.contains("panic 1"), "the answer names the log line to look for: {}", a.text);
    assert_eq!(call(&app, "GET", "/healthz", None).await.status, 200);
    let m = call(&app, "GET", "/metrics", None).await;
    let samples = check_prometheus(&m.text);
    assert_eq!(samples.get("tally_http_request_timeouts_total"), Some(&2.0));
    assert_eq!(samples.get("tally_http_panics_total"), Some(&1.0));
    inner.shutdown().await.expect("shutdown");
}
