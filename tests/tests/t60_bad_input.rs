//! t60: bad input against real nodes — bad names, overflow, zero and non-integer
//! deltas, malformed and deeply nested JSON, oversized bodies, unknown counters and
//! slow clients — gets the right 4xx with the JSON error shape, and leaves every node
//! healthy and its data intact.

use anyhow::Result;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tally_tests::TestCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Tight HTTP limits, so the slow-client cases finish quickly.
const HTTP: &str =
    "\n[http]\nheader_read_timeout_ms = 1000\nrequest_timeout_ms = 4000\nbody_bytes_max = 65536\n";

/// One raw HTTP/1.1 exchange on a fresh connection: (status, JSON body).
async fn raw(addr: &str, head: &str, body: &[u8]) -> Result<(u16, Value)> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(head.as_bytes()).await?;
    s.write_all(body).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut out)).await??;
    let text = String::from_utf8_lossy(&out);
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

fn post(path: &str, content_type: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    )
}

/// Sends `body` and checks the answer's status and error code.
async fn expect(addr: &str, method: &str, path: &str, body: &str, status: u16, code: &str) -> Result<()> {
    let head = post(path, "application/json", body.len()).replacen("POST", method, 1);
    let (got, answer) = raw(addr, &head, body.as_bytes()).await?;
    let shown: String = body.chars().take(50).collect();
    assert_eq!(
        (got, answer["error"]["code"].as_str().unwrap_or("")),
        (status, code),
        "{method} {path} {shown:?} answered {answer}"
    );
    assert!(answer["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{answer}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_4xx_and_leaves_nodes_healthy() -> Result<()> {
    let c = TestCluster::start_configured(3, &[], HTTP).await?;
    c.put_counter(1, "good", json!({"shards": 8, "durability": "sync"})).await?;
    for i in 0..30 {
        let (status, _) = c.incr(1 + i % 3, "good", json!({"delta": 2, "event_id": format!("g{i}")})).await?;
        assert_eq!(status, 200);
    }
    let addr = format!("127.0.0.1:{}", c.node(2).ports.http);
    let a = addr.as_str();
    let incr = "/v1/counters/good/increments";

    // Deltas: zero, fractions, strings, exponents and 64-bit overflow.
    for (body, status, code) in [
        (r#"{"delta": 0}"#, 400, "invalid_delta"),
        (r#"{"delta": 1.5}"#, 400, "invalid_delta"),
        (r#"{"delta": "1"}"#, 400, "invalid_delta"),
        (r#"{"delta": 1e3}"#, 400, "invalid_delta"),
        (r#"{"delta": null}"#, 400, "invalid_delta"),
        (r#"{"delta": 9223372036854775808}"#, 422, "out_of_range"),
        (r#"{"delta": -9223372036854775809}"#, 422, "out_of_range"),
        (r#"{"delta": 1, "event_id": "has space"}"#, 400, "invalid_name"),
        (r#"{"delta": 1, "colour": "red"}"#, 400, "invalid_body"),
        (r#"{"delta": 1"#, 400, "malformed_json"),
        ("not json at all", 400, "malformed_json"),
    ] {
        expect(a, "POST", incr, body, status, code).await?;
    }
    // Deeply nested JSON is refused without a stack overflow.
    let nested = format!("{{\"delta\": {}1{}}}", "[".repeat(20_000), "]".repeat(20_000));
    let (status, answer) = raw(a, &post(incr, "application/json", nested.len()), nested.as_bytes()).await?;
    assert_eq!(status, 400, "{answer}");
    // An oversized body is refused from its Content-Length, before it is read...
    let big = format!("{{\"delta\": 1, \"pad\": \"{}\"}}", "x".repeat(70_000));
    expect(a, "POST", incr, &big, 413, "body_too_large").await?;
    // ...and a chunked one once it passes the limit.
    let chunk = "x".repeat(8_192);
    let mut chunked = String::new();
    for _ in 0..10 {
        chunked += &format!("{:x}\r\n{chunk}\r\n", chunk.len());
    }
    chunked += "0\r\n\r\n";
    let head = format!(
        "POST {incr} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let (status, answer) = raw(a, &head, chunked.as_bytes()).await?;
    assert_eq!((status, &answer["error"]["code"]), (413, &json!("body_too_large")), "{answer}");
    // The wrong content type.
    let (status, answer) = raw(a, &post(incr, "text/plain", 12), b"{\"delta\": 1}").await?;
    assert_eq!((status, &answer["error"]["code"]), (415, &json!("unsupported_media_type")), "{answer}");

    // Names, unknown counters, specs, paths and methods.
    let long = format!("/v1/counters/{}", "n".repeat(513));
    expect(a, "PUT", &long, "{}", 400, "invalid_name").await?;
    expect(a, "PUT", "/v1/counters/has%zzescape", "{}", 400, "invalid_path").await?;
    expect(a, "PUT", "/v1/counters/x", r#"{"shards": 0}"#, 422, "invalid_spec").await?;
    expect(a, "PUT", "/v1/counters/x", r#"{"shards": 70000}"#, 422, "invalid_spec").await?;
    expect(a, "GET", "/v1/counters/never-made/value", "", 404, "counter_not_found").await?;
    expect(a, "GET", "/v1/counters/never-made/shards", "", 404, "counter_not_found").await?;
    expect(a, "DELETE", "/v1/counters/never-made", "", 404, "counter_not_found").await?;
    expect(a, "GET", "/v1/counters/good/value?consistency=sometimes", "", 400, "invalid_query").await?;
    expect(a, "PATCH", "/v1/counters/good", "{}", 405, "method_not_allowed").await?;
    expect(a, "GET", "/v1/nothing-here", "", 404, "not_found").await?;
    expect(a, "PUT", "/v1/cluster/members/node9", "", 404, "node_not_found").await?;

    // Totals never wrap: a shard refuses a delta that would leave its range (422
    // `overflow`, nothing applied), and the total of the shards goes past 64 bits
    // exactly.
    c.put_counter(3, "huge", json!({"shards": 4, "durability": "sync"})).await?;
    let (mut acked, mut refused) = (0i128, 0);
    for i in 0..40 {
        let delta = 4_000_000_000_000_000_000i64;
        let (status, body) =
            c.incr(1 + i % 3, "huge", json!({"delta": delta, "event_id": format!("h{i}")})).await?;
        match status {
            200 => acked += i128::from(delta),
            422 => {
                assert_eq!(body["error"]["code"], "overflow", "{body}");
                refused += 1;
            }
            _ => panic!("{status} {body}"),
        }
    }
    assert!(acked > i128::from(i64::MAX) && refused > 0, "acked {acked}, refused {refused}");
    // Read the raw text: a JSON number past 64 bits is exact on the wire.
    let mut s = TcpStream::connect(a).await?;
    let get =
        "GET /v1/counters/huge/value?consistency=fresh HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    s.write_all(get.as_bytes()).await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    assert!(out.contains(&format!("\"value\":{acked}")), "acked {acked}: {out}");

    // Reconciliation: a total past 128 bits is malformed; a drift no correction can
    // take (past 128 bits when subtracted, or past the bound) is refused whole, and
    // the reconciler keeps serving on every node.
    c.put_counter(1, "c1", json!({"shards": 4, "durability": "sync"})).await?;
    let (status, _) = c.incr(1, "c1", json!({"delta": -5, "event_id": "minus5"})).await?;
    assert_eq!(status, 200);
    let reconcile = "/v1/counters/c1/reconcile";
    for (body, status, code) in [
        (r#"{"authoritative": 170141183460469231731687303715884105727}"#, 422, "drift_out_of_range"),
        (r#"{"authoritative": -170141183460469231731687303715884105728}"#, 422, "drift_out_of_range"),
        (r#"{"authoritative": 1000000000000000000000000000000}"#, 422, "drift_out_of_range"),
        (r#"{"authoritative": 170141183460469231731687303715884105728}"#, 422, "out_of_range"),
        (r#"{"authoritative": 1.5}"#, 400, "invalid_body"),
        (r#"{}"#, 400, "invalid_body"),
    ] {
        expect(a, "POST", reconcile, body, status, code).await?;
    }
    for i in 1..=3 {
        assert_eq!(c.value(i, "c1").await?, -5, "node{i}: a refused reconciliation wrote nothing");
        let (status, body) = c.send(i, "POST", reconcile, json!({"authoritative": -5})).await?;
        assert_eq!((status, &body["corrected"]), (200, &json!(false)), "node{i}: {body}");
    }
    let (status, body) = c.send(3, "POST", reconcile, json!({"authoritative": 10})).await?;
    assert_eq!((status, &body["drift"]), (200, &json!(15)), "{body}");
    assert_eq!(c.value(1, "c1").await?, 10);

    // Slow clients: headers that never finish are dropped after the header timeout,
    // a body that stalls gets 408, and meanwhile everyone else is served.
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(a).await?;
        s.write_all(b"POST /v1/counters/good/increments HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le").await?;
        slow.push(s);
    }
    let stalled_body = tokio::spawn({
        let a = a.to_string();
        async move {
            let started = Instant::now();
            let mut s = TcpStream::connect(&a).await?;
            s.write_all(post(incr, "application/json", 100).as_bytes()).await?;
            s.write_all(b"{\"delta\":").await?;
            let mut out = Vec::new();
            tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut out)).await??;
            anyhow::Ok((String::from_utf8_lossy(&out).into_owned(), started.elapsed()))
        }
    });
    assert_eq!(c.value(2, "good").await?, 60, "served while slow clients hold connections");
    for mut s in slow {
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await?.unwrap_or(0);
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "a slow header was answered {text:?}");
    }
    let (answer, took) = stalled_body.await??;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(took < Duration::from_secs(10), "{took:?}");

    // Every node is healthy, and the data is intact and unchanged.
    for i in 1..=3 {
        assert_eq!(c.get(i, "/healthz").await?, json!({"status": "ok"}));
        assert_eq!(c.value(i, "good").await?, 60, "node{i}");
        let log = std::fs::read_to_string(c.dir().join(format!("node{i}.log")))?;
        assert!(!log.contains("panicked"), "node{i} panicked:\n{}", c.node(i).log_tail());
    }
    let (status, _) = c.send(1, "GET", "/v1/counters/x", json!(null)).await?;
    assert_eq!(status, 404, "refused specs created nothing");
    Ok(())
}
