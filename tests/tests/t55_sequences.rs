//! t55: writer sequences against a real `tallyd`. Writers stream sequenced `sync`
//! increments over HTTP while the node is killed with SIGKILL and restarted; each
//! writer resends an unanswered sequence until it is answered. Afterwards every
//! retried sequence answers duplicate, a gap is refused, and the total is exactly the
//! number of sequences sent. Then the batch endpoint, `redis-cli` and a Python
//! `redis` pipeline of one writer's sequences.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_tests::{python_redis, require_tool, TestCluster};

/// Concurrent writers.
const WRITERS: u64 = 8;
/// Sequences each writer sends.
const SEQS: u64 = 400;
/// How long a writer keeps resending one sequence.
const RESEND_FOR_MS: u64 = 60_000;

/// Sends `writer`'s sequence `seq` until the node answers it (through a SIGKILL and
/// restart): true if applied, false if a duplicate.
async fn send_until_answered(c: &TestCluster, name: &str, writer: &str, seq: u64) -> Result<bool> {
    let deadline = Instant::now() + Duration::from_millis(RESEND_FOR_MS);
    loop {
        match c.incr(1, name, json!({"delta": 1, "writer": writer, "seq": seq})).await {
            Ok((200, body)) => return Ok(body["applied"] == json!(true)),
            Ok((status, body)) if status >= 500 => {
                if Instant::now() > deadline {
                    bail!("{writer} seq {seq}: still {status} {body}");
                }
            }
            Ok((status, body)) => bail!("{writer} seq {seq}: {status} {body}"),
            Err(e) if Instant::now() > deadline => bail!("{writer} seq {seq}: {e}"),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequenced_increments_count_once_through_a_sigkill() -> Result<()> {
    let c = Arc::new(TestCluster::start(1).await?);
    c.put_counter(1, "credits:seq", json!({"durability": "sync", "shards": 4})).await?;
    let killed = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (c, killed, answered) = (c.clone(), killed.clone(), answered.clone());
        writers.push(tokio::spawn(async move {
            let writer = format!("writer-{w}");
            let mut duplicates_after_kill = 0u64;
            for seq in 1..=SEQS {
                let applied = send_until_answered(&c, "credits:seq", &writer, seq).await?;
                answered.fetch_add(1, SeqCst);
                if !applied {
                    // Only a resend of a sequence whose answer the kill swallowed.
                    assert!(killed.load(SeqCst), "{writer} seq {seq} a duplicate before any kill");
                    duplicates_after_kill += 1;
                }
            }
            anyhow::Ok(duplicates_after_kill)
        }));
    }
    // SIGKILL once a quarter of the sequences are answered.
    let deadline = Instant::now() + Duration::from_millis(RESEND_FOR_MS);
    while answered.load(SeqCst) < WRITERS * SEQS / 4 {
        if Instant::now() > deadline {
            bail!("the writers did not get going: {} answered", answered.load(SeqCst));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    killed.store(true, SeqCst);
    c.node(1).kill();
    c.restart(1).await?;
    let mut resent_duplicates = 0;
    for w in writers {
        resent_duplicates += w.await??;
    }
    eprintln!("{resent_duplicates} sequences were answered duplicate after the kill");
    assert!(answered.load(SeqCst) == WRITERS * SEQS);
    assert_eq!(c.value(1, "credits:seq").await?, (WRITERS * SEQS) as i64, "every sequence once");

    for w in 0..WRITERS {
        let writer = format!("writer-{w}");
        for seq in [SEQS, 1] {
            let (status, body) =
                c.incr(1, "credits:seq", json!({"delta": 1, "writer": writer, "seq": seq})).await?;
            assert_eq!((status, &body["duplicate"]), (200, &json!(true)), "{writer} {seq}: {body}");
        }
        let gap = json!({"delta": 1, "writer": writer, "seq": SEQS + 2});
        let (status, body) = c.incr(1, "credits:seq", gap).await?;
        assert_eq!((status, &body["error"]["code"]), (409, &json!("out_of_order_sequence")), "{body}");
    }
    let (status, body) = c.incr(1, "credits:seq", json!({"delta": 1, "seq": 1})).await?;
    assert_eq!((status, &body["error"]["code"]), (400, &json!("invalid_sequence")), "{body}");
    assert_eq!(c.value(1, "credits:seq").await?, (WRITERS * SEQS) as i64);

    // One batch of a writer's sequences, with a retry of the first inside it.
    let mut items: Vec<Value> = (1..=20)
        .map(|n| json!({"counter": "credits:seq", "delta": 1, "writer": "batcher", "seq": n}))
        .collect();
    items.push(json!({"counter": "credits:seq", "delta": 1, "writer": "batcher", "seq": 1}));
    let (status, body) = c.send(1, "POST", "/v1/increments", json!({ "increments": items })).await?;
    assert_eq!(status, 200, "{body}");
    let results = body["results"].as_array().cloned().unwrap_or_default();
    assert_eq!(results.len(), 21, "{body}");
    assert!(results[..20].iter().all(|r| r["applied"] == json!(true)), "{body}");
    assert_eq!(results[20]["duplicate"], json!(true), "{body}");
    let mut want = (WRITERS * SEQS + 20) as i64;
    assert_eq!(c.value(1, "credits:seq").await?, want);

    let port = c.node(1).ports.resp;
    if require_tool("redis-cli", "apt-get install redis-tools")?.is_some() {
        let cli = |args: &[&str]| -> Result<String> {
            let out = Command::new("redis-cli").arg("-p").arg(port.to_string()).args(args).output()?;
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        let inc = |seq: &str| cli(&["TALLY.INCRBY", "credits:seq", "1", "WRITER", "cli-1", "SEQ", seq]);
        assert_eq!(inc("1")?, "applied");
        assert_eq!(inc("1")?, "duplicate");
        assert!(inc("3")?.starts_with("ERR out_of_order_sequence"), "{}", inc("3")?);
        assert_eq!(inc("2")?, "applied");
        let both = cli(&["TALLY.INCRBY", "credits:seq", "1", "ID", "e", "WRITER", "cli-1", "SEQ", "3"])?;
        assert!(both.starts_with("ERR invalid_sequence"), "{both}");
        want += 2;
    }
    if let Some(python) = python_redis()? {
        // A pipeline of one writer's 200 sequences is applied in order.
        let script = r#"
import sys, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
p = r.pipeline(transaction=False)
for n in range(1, 201):
    p.execute_command("TALLY.INCRBY", "credits:seq", "1", "WRITER", "py-1", "SEQ", str(n))
got = p.execute()
assert got == [b"applied"] * 200, got[:10]
assert r.execute_command("TALLY.INCRBY", "credits:seq", "1", "WRITER", "py-1", "SEQ", "200") == b"duplicate"
"#;
        let out = Command::new(python).args(["-c", script, &port.to_string()]).output()?;
        assert!(out.status.success(), "python: {}", String::from_utf8_lossy(&out.stderr));
        want += 200;
    }
    assert_eq!(c.value(1, "credits:seq").await?, want);
    Ok(())
}
