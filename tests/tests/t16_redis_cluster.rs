//! t16: the Redis protocol on three real nodes. What one node declares or sets is
//! metadata every node applies: a namespace declared through node 1 gives a counter
//! created through node 2 its bounds, enforced through node 3; a deadline set
//! through one node is the one `TTL` answers on another, an expired counter is
//! missing on every node and reclaimed by the metadata leader; the cluster's
//! `default_spec` reaches counters created under no namespace; and a node's `INCR`
//! answers include other nodes' increments once its ledger read the shards; and
//! `INCREX`'s bound holds for connections on every node racing for the last slots.

use anyhow::{bail, Result};
use std::time::{Duration, Instant};
use tally_tests::TestCluster;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// How long metadata may take to reach every node, or a reclaim to run.
const SETTLE_MS: u64 = 10_000;

/// One RESP connection that sends a command and reads its one-line (or bulk) reply.
struct Conn(BufReader<TcpStream>);

impl Conn {
    async fn open(port: u16) -> Result<Self> {
        Ok(Self(BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?)))
    }

    /// The reply to `args`: `+OK`, `-ERR …`, `:5`, the text of a bulk string, or `nil`.
    async fn call(&mut self, args: &[&str]) -> Result<String> {
        let mut s = format!("*{}\r\n", args.len());
        for a in args {
            s += &format!("${}\r\n{a}\r\n", a.len());
        }
        self.0.get_mut().write_all(s.as_bytes()).await?;
        tokio::time::timeout(Duration::from_secs(10), self.reply()).await?
    }

    /// One reply; an array's elements joined by spaces after `*n`.
    async fn reply(&mut self) -> Result<String> {
        let mut line = String::new();
        self.0.read_line(&mut line).await?;
        let line = line.trim_end().to_string();
        if let Some(len) = line.strip_prefix('$') {
            let Ok(len) = len.parse::<usize>() else { return Ok("nil".into()) };
            let mut bulk = vec![0; len + 2];
            self.0.read_exact(&mut bulk).await?;
            return Ok(String::from_utf8_lossy(&bulk[..len]).into_owned());
        }
        if let Some(n) = line.strip_prefix('*').and_then(|n| n.parse::<usize>().ok()) {
            let mut all = line.clone();
            for _ in 0..n {
                all += " ";
                all += &Box::pin(self.reply()).await?;
            }
            return Ok(all);
        }
        Ok(line)
    }
}

/// Asks `conn` with `args` until the reply is `want` (metadata reaching the node),
/// within [`SETTLE_MS`].
async fn until(conn: &mut Conn, args: &[&str], want: impl Fn(&str) -> bool) -> Result<String> {
    let deadline = Instant::now() + Duration::from_millis(SETTLE_MS);
    loop {
        let got = conn.call(args).await?;
        if want(&got) {
            return Ok(got);
        }
        if Instant::now() > deadline {
            bail!("{args:?} still answers {got:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_deadlines_and_answers_hold_across_nodes() -> Result<()> {
    let c = TestCluster::start_configured(3, &[], "cluster.default_spec = { shards = 4 }").await?;
    let mut n: Vec<Conn> = Vec::new();
    for i in 1..=3 {
        n.push(Conn::open(c.node(i).ports.resp).await?);
    }

    eprintln!("phase: a namespace declared on node 1 bounds a counter created on node 2");
    let set = ["TALLY.NAMESPACE", "SET", "stock:", "DURABILITY", "sync", "FLOOR", "0"];
    assert_eq!(n[0].call(&set).await?, "+created");
    until(&mut n[1], &["TALLY.NAMESPACE", "LIST"], |r| r == "*1 stock:").await?;
    assert_eq!(n[1].call(&["INCRBY", "stock:1", "3"]).await?, ":3");
    let spec = c.get(3, "/v1/counters/stock:1").await?;
    assert_eq!(spec["spec"]["min"].as_i64(), Some(0), "{spec}");
    for want in [":2", ":1", ":0"] {
        assert_eq!(n[2].call(&["DECR", "stock:1"]).await?, want);
    }
    assert!(n[2].call(&["DECR", "stock:1"]).await?.starts_with("-ERR bound_exceeded"));

    eprintln!("phase: the cluster's default_spec reaches a counter under no namespace");
    assert_eq!(n[2].call(&["INCR", "plain:1"]).await?, ":1");
    assert_eq!(c.get(1, "/v1/counters/plain:1").await?["spec"]["shards"].as_u64(), Some(4));

    eprintln!("phase: a deadline set on node 1 is the one node 2 answers");
    assert_eq!(n[0].call(&["EXPIRE", "stock:1", "100"]).await?, ":1");
    until(&mut n[1], &["TTL", "stock:1"], |r| r == ":100" || r == ":99").await?;
    assert_eq!(n[2].call(&["PERSIST", "stock:1"]).await?, ":1");
    until(&mut n[0], &["TTL", "stock:1"], |r| r == ":-1").await?;

    eprintln!("phase: an expired counter is missing everywhere and reclaimed");
    assert_eq!(n[0].call(&["INCRBY", "gone", "7"]).await?, ":7");
    assert_eq!(n[0].call(&["PEXPIRE", "gone", "500"]).await?, ":1");
    tokio::time::sleep(Duration::from_millis(800)).await;
    for conn in n.iter_mut() {
        assert_eq!(conn.call(&["GET", "gone"]).await?, "nil");
        assert_eq!(conn.call(&["EXISTS", "gone"]).await?, ":0");
    }
    let deadline = Instant::now() + Duration::from_millis(SETTLE_MS);
    loop {
        let page = c.get(2, "/v1/counters?prefix=gone").await?;
        if page["counters"].as_array().is_some_and(|a| a.is_empty()) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the expired counter is still listed: {page}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(n[1].call(&["INCR", "gone"]).await?, ":1", "created anew from zero");

    eprintln!("phase: INCR answers include other nodes' increments once the ledger read them");
    for i in 1..=10 {
        assert_eq!(n[0].call(&["INCR", "hits"]).await?, format!(":{i}"));
    }
    // Node 1's buffered increments reach their shards within flush_ms.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(n[1].call(&["INCR", "hits"]).await?, ":11", "node 2's first answer reads the shards");
    // Node 1 reads them again in the background while its base is older than a second.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    n[0].call(&["INCR", "hits"]).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(n[0].call(&["INCR", "hits"]).await?, ":13", "node 1 counts node 2's increment");

    eprintln!("phase: INCREX's bound holds for writers on every node at once");
    // The first call creates the counter with the bound as its own; then three
    // connections per node race for 20 slots.
    assert_eq!(n[0].call(&["INCREX", "rl:1", "UBOUND", "20", "EX", "60", "ENX"]).await?, "*2 :1 :1");
    let mut racers = Vec::new();
    for node in 1..=3 {
        for _ in 0..3 {
            let port = c.node(node).ports.resp;
            racers.push(tokio::spawn(async move {
                let mut conn = Conn::open(port).await?;
                let mut applied = 0;
                for _ in 0..10 {
                    let reply = conn.call(&["INCREX", "rl:1", "UBOUND", "20", "EX", "60", "ENX"]).await?;
                    applied += i64::from(reply.ends_with(" :1"));
                }
                anyhow::Ok(applied)
            }));
        }
    }
    let mut applied = 0;
    for r in racers {
        applied += r.await??;
    }
    assert_eq!(applied, 19, "90 tries, 19 slots left");
    let read = c.get(2, "/v1/counters/rl:1/value?consistency=fresh").await?;
    assert_eq!(read["value"].as_i64(), Some(20), "{read}");
    let ttl = |r: &str| r.strip_prefix(':').and_then(|t| t.parse::<i64>().ok());
    until(&mut n[2], &["TTL", "rl:1"], |r| ttl(r).is_some_and(|t| (50..=60).contains(&t))).await?;
    Ok(())
}
