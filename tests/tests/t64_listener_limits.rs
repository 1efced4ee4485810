//! t64: what a client without a token can hold of a node, and for how long. Sockets
//! that say nothing — more than each listener's connection cap, on RESP, HTTP and
//! raft — must not lock well-behaved clients out: a full listener closes one that
//! serves nobody to make room. A RESP connection that does not authenticate in
//! time, trickles a command (slowloris) or idles past `resp.idle_timeout_ms` is
//! closed; a silent raft connection is closed after the raft header timeout. A
//! client that sends hundreds of wrong tokens a second gets every one refused and
//! counted, while the log gets a bounded number of lines.

use anyhow::{Context, Result};
use serde_json::json;
use std::time::{Duration, Instant};
use tally_auth::Scope;
use tally_tests::TestCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const OPS: &str = "tly_t64-ops-000000000000000000000000000000000000000000000000000000";
/// Silent sockets opened on each client listener: more than the default caps
/// (`connections_max` = 1024 on HTTP and RESP).
const FLOOD: usize = 1100;
/// Silent sockets opened on the raft listener: more than `RAFT_CONNECTIONS_MAX`.
const RAFT_FLOOD: usize = 300;
/// The RESP deadlines of the test's nodes, in ms.
const AUTH_TIMEOUT_MS: u64 = 1500;
const READ_TIMEOUT_MS: u64 = 1500;
const IDLE_TIMEOUT_MS: u64 = 3000;
/// How long a well-behaved client may wait for an answer during a flood, in ms.
const ANSWER_WAIT_MS: u128 = 1000;
/// Wrong tokens sent in a burst.
const WRONG_TOKENS: usize = 400;

fn config() -> String {
    let ops = tally_auth::config_lines(OPS, "ops", &[Scope::Admin], &[]).expect("entry");
    format!(
        "{ops}\n[resp]\nauth_timeout_ms = {AUTH_TIMEOUT_MS}\nread_timeout_ms = {READ_TIMEOUT_MS}\n\
         idle_timeout_ms = {IDLE_TIMEOUT_MS}\n"
    )
}

/// `n` connections to `port` that send nothing.
async fn silent(port: u16, n: usize) -> Result<Vec<TcpStream>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(TcpStream::connect(("127.0.0.1", port)).await.context("connecting a silent socket")?);
    }
    Ok(out)
}

/// How long until the server closes `s` (reads EOF or an error), at most `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(limit.saturating_sub(started.elapsed()), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => continue,
        }
    }
}

/// One RESP exchange: sends `request`, reads one reply.
async fn resp(s: &mut TcpStream, request: &str) -> Result<String> {
    s.write_all(request.as_bytes()).await?;
    let mut buf = [0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await??;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn command(args: &[&str]) -> String {
    let mut out = format!("*{}\r\n", args.len());
    for a in args {
        out += &format!("${}\r\n{a}\r\n", a.len());
    }
    out
}

async fn metric(c: &TestCluster, series: &str) -> Result<u64> {
    let text = reqwest::Client::new()
        .get(format!("{}/metrics", c.node(1).url()))
        .bearer_auth(OPS)
        .send()
        .await?
        .text()
        .await?;
    Ok(text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_slow_and_unauthenticated_clients_hold_nothing_for_long() -> Result<()> {
    let c = TestCluster::start_secured(2, &[], &config(), OPS).await?;
    let (http, resp_port, raft) = (c.node(1).ports.http, c.node(1).ports.resp, c.node(1).ports.raft);

    // A silent raft connection, watched while the rest runs.
    let mut raft_silent = TcpStream::connect(("127.0.0.1", raft)).await?;
    let raft_watch =
        tokio::spawn(async move { closed_within(&mut raft_silent, Duration::from_secs(30)).await });

    // Floods of silent sockets, over every cap.
    let _resp_flood = silent(resp_port, FLOOD).await?;
    let _http_flood = silent(http, FLOOD).await?;
    let _raft_flood = silent(raft, RAFT_FLOOD).await?;

    // A well-behaved RESP client: connects, authenticates, counts.
    let started = Instant::now();
    let mut client = TcpStream::connect(("127.0.0.1", resp_port)).await?;
    let auth = resp(&mut client, &command(&["AUTH", OPS])).await?;
    assert_eq!(auth, "+OK\r\n", "AUTH during a flood of silent sockets");
    let counted = resp(&mut client, &command(&["INCR", "likes:1"])).await?;
    let took = started.elapsed().as_millis();
    assert!(counted.starts_with(':'), "INCR during the flood: {counted}");
    assert!(took < ANSWER_WAIT_MS, "the RESP client waited {took} ms");

    // A well-behaved HTTP client on a new connection.
    let fresh = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
    let started = Instant::now();
    let r = fresh
        .post(format!("{}/v1/counters/likes:1/increments", c.node(1).url()))
        .bearer_auth(OPS)
        .json(&json!({"delta": 1}))
        .timeout(Duration::from_secs(10))
        .send()
        .await?;
    let took = started.elapsed().as_millis();
    assert_eq!(r.status(), 200);
    assert!(took < ANSWER_WAIT_MS, "the HTTP client waited {took} ms behind silent sockets");
    // Metadata writes go through raft: a new counter on each node.
    for i in 1..=2 {
        c.put_counter(i, &format!("made-during-flood:{i}"), json!({"shards": 2})).await?;
    }

    // Deadlines. A connection that never authenticates:
    let mut lurker = TcpStream::connect(("127.0.0.1", resp_port)).await?;
    let gone = closed_within(&mut lurker, Duration::from_millis(AUTH_TIMEOUT_MS * 3)).await;
    assert!(gone.is_some(), "an unauthenticated RESP connection stayed open past resp.auth_timeout_ms");
    // One that trickles a command after authenticating (slowloris):
    let mut slow = TcpStream::connect(("127.0.0.1", resp_port)).await?;
    assert_eq!(resp(&mut slow, &command(&["AUTH", OPS])).await?, "+OK\r\n");
    slow.write_all(b"*2\r\n$4\r\nINCR\r\n$7\r\nlik").await?;
    let gone = closed_within(&mut slow, Duration::from_millis(READ_TIMEOUT_MS * 3)).await;
    assert!(gone.is_some(), "a trickled RESP command held its connection past resp.read_timeout_ms");
    // One that authenticates and idles:
    let mut idle = TcpStream::connect(("127.0.0.1", resp_port)).await?;
    assert_eq!(resp(&mut idle, &command(&["AUTH", OPS])).await?, "+OK\r\n");
    let gone = closed_within(&mut idle, Duration::from_millis(IDLE_TIMEOUT_MS * 3)).await;
    let gone = gone.context("an idle RESP connection stayed open past resp.idle_timeout_ms")?;
    assert!(gone >= Duration::from_millis(IDLE_TIMEOUT_MS - 200), "closed after {gone:?}");
    // The first client, idle as long by now, went the same way.
    assert!(closed_within(&mut client, Duration::from_millis(IDLE_TIMEOUT_MS)).await.is_some());

    // Wrong tokens: all refused and counted, few lines logged.
    let lines_before = c.log(1).matches("request refused").count();
    let started = Instant::now();
    let pool = reqwest::Client::new();
    let wrong = futures::future::join_all((0..WRONG_TOKENS).map(|i| {
        pool.get(format!("{}/v1/counters/likes:1/value", c.node(1).url()))
            .bearer_auth(format!("tly_wrong-{i}"))
            .timeout(Duration::from_secs(10))
            .send()
    }))
    .await;
    let seconds = started.elapsed().as_secs() + 2;
    assert!(wrong.iter().all(|r| r.as_ref().is_ok_and(|r| r.status() == 401)));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let lines = c.log(1).matches("request refused").count() - lines_before;
    let bound = tally_tls::refusals::REFUSAL_LOG_LINES_PER_S_MAX as usize * seconds as usize;
    assert!(lines <= bound, "{WRONG_TOKENS} refusals wrote {lines} log lines (bound {bound})");
    assert!(metric(&c, "tally_auth_refusals_total{reason=\"unknown_token\"}").await? >= WRONG_TOKENS as u64);

    // The raft listener closed its silent connection.
    let raft_gone = raft_watch.await?;
    assert!(raft_gone.is_some(), "a silent raft connection stayed open for 30 s");

    for (listener, reason) in [
        ("resp", "evicted"),
        ("http", "evicted"),
        ("raft", "evicted"),
        ("resp", "auth_timeout"),
        ("resp", "read_timeout"),
    ] {
        let series = format!("tally_listener_refusals_total{{listener=\"{listener}\",reason=\"{reason}\"}}");
        assert!(metric(&c, &series).await? > 0, "{series} is 0");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_do_not_lock_clients_out_of_an_open_node() -> Result<()> {
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp;
    let _flood = silent(port, FLOOD).await?;
    let started = Instant::now();
    let mut client = TcpStream::connect(("127.0.0.1", port)).await?;
    let reply = resp(&mut client, &command(&["INCR", "likes:1"])).await?;
    assert_eq!(reply, ":1\r\n", "INCR on an open node behind {FLOOD} silent sockets");
    assert!(started.elapsed().as_millis() < ANSWER_WAIT_MS, "waited {:?}", started.elapsed());
    Ok(())
}
