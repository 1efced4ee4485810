//! t49: quotas on a real node. A client that may write can otherwise create
//! counters without end, make a counter keep event ids without end, or ask for
//! sketches of gigabytes: each has a named, configurable cap, and what would pass
//! it is refused with 507 `quota_exceeded` (over HTTP and RESP), counted on
//! `/metrics`, and leaves nothing behind; what stays within is served as before.

use anyhow::Result;
use serde_json::json;
use tally_tests::TestCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The node's quotas in this test.
const COUNTERS_MAX: u64 = 6;
const LIKES_MAX: u64 = 2;
const IDS_MAX: u64 = 8;

/// Lines for the end of the fixture's config, which ends inside its `[engine]`.
fn config() -> String {
    format!(
        "counters_max = {COUNTERS_MAX}\nevent_ids_per_counter_max = {IDS_MAX}\n\
         sketch_bytes_per_counter_max = 4194304\n\n[[quotas]]\nprefix = \"likes:\"\ncounters_max = {LIKES_MAX}\n"
    )
}

async fn metric(c: &TestCluster, series: &str) -> Result<u64> {
    let text = reqwest::get(format!("{}/metrics", c.node(1).url())).await?.text().await?;
    Ok(text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_would_pass_a_quota_is_refused_with_507_and_leaves_nothing() -> Result<()> {
    let c = TestCluster::start_configured(1, &[], &config()).await?;
    let quota = |body: &serde_json::Value| body["error"]["code"] == "quota_exceeded";

    // Counters under a prefix: two likes:, then refused, by increment and by PUT.
    for i in 1..=LIKES_MAX {
        let (status, body) = c.incr(1, &format!("likes:{i}"), json!({"delta": 1})).await?;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = c.incr(1, "likes:3", json!({"delta": 1})).await?;
    assert!(status == 507 && quota(&body), "{status} {body}");
    assert!(body["error"]["message"].as_str().unwrap_or("").contains("quotas.counters_max"), "{body}");
    let (status, body) = c.send(1, "PUT", "/v1/counters/likes:4", json!({})).await?;
    assert!(status == 507 && quota(&body), "{status} {body}");
    assert_eq!(c.send(1, "GET", "/v1/counters/likes:3", json!(null)).await?.0, 404, "nothing was created");
    // An existing counter under the prefix still counts.
    assert_eq!(c.incr(1, "likes:1", json!({"delta": 1})).await?.0, 200);
    // Over RESP the same refusal, in Redis's words.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", c.node(1).ports.resp)).await?;
    s.write_all(b"*2\r\n$4\r\nINCR\r\n$7\r\nlikes:5\r\n").await?;
    let mut reply = [0u8; 256];
    let n = s.read(&mut reply).await?;
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("-ERR quota_exceeded"), "{reply}");

    // Counters on the node: six in all (two likes: made above).
    for i in 1..=COUNTERS_MAX - LIKES_MAX {
        let (status, body) = c.incr(1, &format!("views:{i}"), json!({"delta": 1})).await?;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = c.incr(1, "views:99", json!({"delta": 1})).await?;
    assert!(status == 507 && quota(&body), "{status} {body}");
    assert!(body["error"]["message"].as_str().unwrap_or("").contains("engine.counters_max"), "{body}");

    // Event ids a counter keeps: views:1 has the default 8 shards, one id each.
    let mut applied = 0;
    let mut refused = 0;
    for i in 0..(4 * IDS_MAX) {
        let (status, body) = c.incr(1, "views:1", json!({"delta": 1, "event_id": format!("e-{i}")})).await?;
        match status {
            200 => applied += 1,
            507 if quota(&body) => refused += 1,
            _ => anyhow::bail!("{status} {body}"),
        }
    }
    assert!(applied <= IDS_MAX && refused >= 3 * IDS_MAX, "applied {applied}, refused {refused}");
    // A kept id is still judged: a retry is a duplicate, not a refusal.
    let (status, body) = c.incr(1, "views:1", json!({"delta": 1, "event_id": "e-0"})).await?;
    assert!(status == 200 || quota(&body), "{status} {body}");
    // Increments without an id go on.
    assert_eq!(c.incr(1, "views:1", json!({"delta": 5})).await?.0, 200);
    assert_eq!(c.value(1, "views:1").await?, 1 + applied as i64 + 5, "nothing refused was counted");

    // Sketch bytes: a count-min table of about 0.7 MiB a shard on 16 shards is 11 MiB.
    let big = json!({"shards": 16, "frequency": {"epsilon": 0.0003, "delta": 0.0001}});
    let (status, body) = c.send(1, "PUT", "/v1/counters/views:2", big).await?;
    assert!(status == 507 && quota(&body), "{status} {body}");
    let small = json!({"shards": 4, "frequency": {"epsilon": 0.01, "delta": 0.01}});
    assert_eq!(c.send(1, "PUT", "/v1/counters/views:2", small).await?.0, 200);

    let counted = |q: &str| format!("tally_quota_refusals_total{{quota=\"{q}\"}}");
    assert_eq!(metric(&c, &counted("counters")).await?, 4);
    assert_eq!(metric(&c, &counted("event_ids")).await?, refused);
    assert_eq!(metric(&c, &counted("sketch_bytes")).await?, 1);
    Ok(())
}
