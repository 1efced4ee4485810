//! t68: the raft endpoints of a plaintext cluster answer only callers that prove
//! they hold the cluster secret. Raw HTTP requests to every node's raft port — the
//! identity probe, a forwarded write deleting a counter, a vote — without the
//! secret's proof or with a wrong one are refused with 401, logged and counted by
//! reason on `/metrics`; the counter survives and the cluster goes on serving. A
//! request signed as a node signs it, seen on the wire, cannot be sent again nor
//! with another body.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tally_core::format::RAFT_PROTOCOL;
use tally_tests::TestCluster;

/// The header every raft RPC names its protocol version in.
const PROTOCOL_HEADER: &str = "tally-raft-protocol";
/// The header every raft RPC carries its proof of the cluster secret in.
const AUTH_HEADER: &str = "tally-raft-auth";

/// POSTs `body` to `path` on node `i`'s raft port, with the right protocol version
/// and, when given, `auth` as the proof; (status, body text).
async fn raw(
    c: &TestCluster,
    i: usize,
    path: &str,
    body: &Value,
    auth: Option<&str>,
) -> Result<(u16, String)> {
    let url = format!("http://127.0.0.1:{}{path}", c.node(i).ports.raft);
    let mut request = reqwest::Client::new()
        .post(url)
        .header(PROTOCOL_HEADER, RAFT_PROTOCOL.to_string())
        .json(body)
        .timeout(Duration::from_secs(10));
    if let Some(auth) = auth {
        request = request.header(AUTH_HEADER, auth);
    }
    let resp = request.send().await?;
    Ok((resp.status().as_u16(), resp.text().await.unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_rpcs_without_the_cluster_secret_are_refused() -> Result<()> {
    let c = TestCluster::start(3).await?;
    c.put_counter(1, "credits", json!({"shards": 4, "durability": "sync"})).await?;
    c.incr(1, "credits", json!({"delta": 100})).await?;
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64;
    let delete = json!({"Counter": {"name": "credits", "cmd": "Delete", "now_ms": now_ms}});
    let vote = json!({"from": 9, "from_store": "0", "to_store": null,
                      "rpc": {"vote": {"leader_id": {"term": 1000, "node_id": 9}, "committed": false},
                              "last_log_id": null}});
    for i in 1..=3 {
        for auth in [None, Some("0".repeat(64).as_str()), Some("not even hex")] {
            let (status, text) = raw(&c, i, "/raft/identity", &json!({}), auth).await?;
            assert_eq!(status, 401, "node{i} answered /raft/identity to {auth:?}: {text}");
            let (status, text) = raw(&c, i, "/raft/client-write", &delete, auth).await?;
            assert_eq!(status, 401, "node{i} took a forwarded delete with {auth:?}: {text}");
            let (status, text) = raw(&c, i, "/raft/vote", &vote, auth).await?;
            assert_eq!(status, 401, "node{i} answered a vote with {auth:?}: {text}");
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(1..=3).all(|i| c.log(i).contains("refused a raft RPC: no proof of the cluster secret")) {
        if Instant::now() > deadline {
            bail!("a refusal was not logged; node1's log:\n{}", c.node(1).log_tail());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(c.log(1).contains("refused a raft RPC: wrong proof of the cluster secret"));
    // Each node counts what it refused: three calls without a proof, six with a wrong one.
    for i in 1..=3 {
        let metrics = reqwest::get(format!("{}/metrics", c.node(i).url())).await?.text().await?;
        for (reason, n) in [("proof_missing", 3), ("proof_wrong", 6)] {
            let line =
                format!("tally_listener_refusals_total{{listener=\"raft\",reason=\"{reason}\"}} {n}\n");
            assert!(metrics.contains(&line), "node{i} lacks {line:?}:\n{metrics}");
        }
    }
    // The counter is intact and the cluster serves.
    assert_eq!(c.fresh(2, "credits").await?["value"], 100);
    let (status, body) = c.incr(3, "credits", json!({"delta": 1})).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(c.fresh(1, "credits").await?["value"], 101);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_request_seen_on_the_wire_cannot_be_replayed_or_altered() -> Result<()> {
    let c = TestCluster::start(3).await?;
    c.put_counter(1, "credits", json!({"shards": 4})).await?;
    // What an observer of the plaintext link captures: a request with its proof.
    let secret = tally_raft::auth::RaftSecret::new("tally-test-secret");
    let now_ms = tally_raft::auth::unix_ms();
    let identity = serde_json::to_vec(&json!({}))?;
    let proof = secret.sign("/raft/identity", &identity, now_ms);
    let raft = c.node(2).ports.raft;
    let send = |path: &'static str, body: Vec<u8>, proof: reqwest::header::HeaderValue| async move {
        let r = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{raft}{path}"))
            .header(PROTOCOL_HEADER, RAFT_PROTOCOL.to_string())
            .header(AUTH_HEADER, proof)
            .header("content-type", "application/json")
            .body(body)
            .timeout(Duration::from_secs(10))
            .send()
            .await?;
        anyhow::Ok((r.status().as_u16(), r.text().await.unwrap_or_default()))
    };
    let (status, text) = send("/raft/identity", identity.clone(), proof.clone()).await?;
    assert_eq!(status, 200, "the original request: {text}");
    // Sent again, as captured.
    let (status, text) = send("/raft/identity", identity, proof.clone()).await?;
    assert_eq!(status, 401, "a replayed request was served: {text}");
    // Its proof on another request: a forwarded delete.
    let delete = json!({"Counter": {"name": "credits", "cmd": "Delete", "now_ms": now_ms}});
    let (status, text) = send("/raft/client-write", serde_json::to_vec(&delete)?, proof).await?;
    assert_eq!(status, 401, "a captured proof carried another request: {text}");
    let metrics = reqwest::get(format!("{}/metrics", c.node(2).url())).await?.text().await?;
    for (reason, n) in [("proof_replayed", 2), ("proof_wrong", 0)] {
        let line = format!("tally_listener_refusals_total{{listener=\"raft\",reason=\"{reason}\"}} {n}\n");
        assert!(metrics.contains(&line), "node2 lacks {line:?}");
    }
    assert!(c.log(2).contains("its proof was seen before or is out of time"));
    assert_eq!(c.get(1, "/v1/counters/credits").await?["name"], "credits", "the counter survived");
    Ok(())
}
