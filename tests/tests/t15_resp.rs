//! t15: the Redis protocol with real clients. What `INCR` answers is checked first:
//! one client's increments answer 1, 2, 3, … (alone, in a pipeline of a thousand,
//! mixed with `INCRBY`/`DECR`), and a `sync` counter of one shard answers unique,
//! gap-free values to many concurrent clients. Transactions (`MULTI`/`EXEC`, which
//! redis-py's `pipeline()` sends by default) count each increment once, and a
//! fixed-window rate limiter's counters expire as Redis's would, and a namespace
//! keeps a bounded counter bounded across `DEL`. A real `tallyd` is driven by
//! `redis-cli` (one command per call — a windowed counter's `TALLY.WINDOW` among them —
//! `--pipe` for a pipeline of 1,000 `INCRBY`, `-3` for RESP3) and by the Python `redis`
//! package (a pipeline, idempotent `TALLY.INCRBY` retries, `PFADD`/`PFCOUNT`, the
//! errors of bad input); totals must be exact. Then raw sockets check what no client library sends: a RESP3 session
//! after `HELLO 3`, garbage and a 1 GB bulk length (each answered with an error and
//! its connection closed), and the connection limit — and the node still serves
//! everyone else with its data intact.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tally_tests::{python_redis, require_tool, TestCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The node's RESP connection limit, small so the test can reach it.
const CONNECTIONS_MAX: usize = 16;
/// Increments sent through `redis-cli --pipe`.
const PIPE_INCREMENTS: usize = 1000;
/// How long a raw exchange may take.
const EXCHANGE_TIMEOUT_MS: u64 = 10_000;

/// `redis-cli -p PORT ARGS...`: its standard output, trimmed; fails if it fails.
fn cli(port: u16, args: &[&str]) -> Result<String> {
    let out = Command::new("redis-cli").arg("-p").arg(port.to_string()).args(args).output()?;
    if !out.status.success() {
        bail!("redis-cli {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The RESP encoding of one command.
fn resp(args: &[&str]) -> String {
    let mut s = format!("*{}\r\n", args.len());
    for a in args {
        s += &format!("${}\r\n{a}\r\n", a.len());
    }
    s
}

/// Sends `bytes` on a fresh connection and reads until the reply holds `expect`
/// (or the connection closes): (what was read, whether the node closed it).
async fn exchange(port: u16, bytes: &[u8], expect: &str) -> Result<(String, bool)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(bytes).await?;
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_millis(EXCHANGE_TIMEOUT_MS);
    let mut closed = false;
    while !String::from_utf8_lossy(&got).contains(expect) || !closed {
        let mut chunk = [0u8; 4096];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
        if String::from_utf8_lossy(&got).contains(expect) && !expect.is_empty() {
            // Give the node a moment to close, if it is going to.
            match tokio::time::timeout(Duration::from_millis(500), s.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => closed = true,
                Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
                Err(_) => {}
            }
            break;
        }
    }
    Ok((String::from_utf8_lossy(&got).into_owned(), closed))
}

/// The Python client's part: every check is an `assert`, so a wrong answer fails
/// the script with its traceback.
const PYTHON: &str = r#"
import sys, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
assert r.ping()

# A pipeline of 500 INCRBY on a batched counter: every reply an integer, exact total.
p = r.pipeline(transaction=False)
for _ in range(500):
    p.incrby("views:1", 3)
replies = p.execute()
assert len(replies) == 500 and all(isinstance(x, int) for x in replies), replies[:5]
got = r.execute_command("TALLY.GET", "views:1", "FRESH")
fields = dict(zip(got[::2], got[1::2]))
assert fields[b"value"] == 1500 and fields[b"complete"] == 1, fields

# Idempotent increments: the retry of an event id is a duplicate.
assert r.execute_command("TALLY.CREATE", "credits:7", "DURABILITY", "sync", "SHARDS", "4") == b"created"
assert r.execute_command("TALLY.INCRBY", "credits:7", "500", "ID", "purchase-1", "WRITER", "w1") == b"applied"
for _ in range(3):
    assert r.execute_command("TALLY.INCRBY", "credits:7", "500", "ID", "purchase-1") == b"duplicate"
assert r.incrby("credits:7", 1) == 501, "INCR on a sync counter answers the fresh total"
assert r.get("credits:7") is not None

# Distinct members.
assert r.pfadd("uniq:1", *["u%d" % i for i in range(1000)]) == 1
assert r.pfadd("uniq:1", "u1") == 0
n = r.pfcount("uniq:1")
assert abs(n - 1000) <= 30, n
assert r.pfcount("never:seen") == 0

# Unknown keys, EXISTS and DEL.
assert r.get("never:seen") is None
assert r.mget("views:1", "never:seen")[1] is None
assert r.exists("views:1", "never:seen") == 1
assert r.delete("uniq:1", "never:seen") == 1

# Bad input gets the HTTP error codes.
def refused(code, f, *args):
    try:
        f(*args)
    except redis.ResponseError as e:
        assert code in str(e), (code, str(e))
    else:
        raise AssertionError("expected %s from %s%r" % (code, f.__name__, args))

refused("invalid_name", r.incrby, "", 1)
refused("invalid_name", r.get, "x" * 513)
# Redis's own texts for Redis's commands; INCRBY 0 answers the value, as in Redis.
refused("value is not an integer or out of range", r.incrby, "views:1", "abc")
assert r.incrby("views:1", 0) == 1500
refused("value is not an integer or out of range", r.incrby, "views:1", "9223372036854775808")
refused("invalid_spec", r.execute_command, "TALLY.CREATE", "c:2", "SHARDS", "5000")
refused("counter_not_found", r.execute_command, "TALLY.GET", "never:seen")
refused("event_id_conflict", r.execute_command, "TALLY.INCRBY", "credits:7", "7", "ID", "purchase-1")
assert r.execute_command("TALLY.CREATE", "big:1", "SHARDS", "1", "DURABILITY", "sync") == b"created"
assert r.incrby("big:1", 8000000000000000000) == 8000000000000000000
refused("increment or decrement would overflow", r.incrby, "big:1", 8000000000000000000)
refused("increment or decrement would overflow", r.incrby, "big:1", 9223372036854775807)
refused("unknown command", r.execute_command, "NOSUCH", "a")
refused("wrong number of arguments", r.execute_command, "INCR")
print("python ok")
"#;

/// What `INCR` answers, through the Python client: every answer includes its own
/// increment and every one before it.
const PYTHON_INCR: &str = r#"
import sys, threading, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))

got = [r.incr("fresh:a") for _ in range(5)]
assert got == [1, 2, 3, 4, 5], got
got = [r.incr("mixed"), r.incrby("mixed", 10), r.decr("mixed"), r.decrby("mixed", 3)]
assert got == [1, 11, 10, 7], got

# A thousand INCR in one pipeline, on a batched counter and on a sync one.
assert r.execute_command("TALLY.CREATE", "pipe:sync", "DURABILITY", "sync") == b"created"
for key in ["pipe:batched", "pipe:sync"]:
    p = r.pipeline(transaction=False)
    for _ in range(1000):
        p.incr(key)
    got = p.execute()
    assert got == list(range(1, 1001)), (key, got[:5], got[-5:], len(set(got)))

# A sync counter of one shard issues ids: 8 clients, 100 INCR each, every value once.
assert r.execute_command("TALLY.CREATE", "ids", "DURABILITY", "sync", "SHARDS", "1") == b"created"
seen, lock = [], threading.Lock()
def client():
    c = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
    mine = [c.incr("ids") for _ in range(100)]
    assert mine == sorted(mine), mine
    with lock:
        seen.extend(mine)
threads = [threading.Thread(target=client) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert sorted(seen) == list(range(1, 801)), (len(seen), len(set(seen)), min(seen), max(seen))

# TALLY.INCRBY ... WITHVALUE says whether the value is exact (a single node: it is).
got = r.execute_command("TALLY.INCRBY", "ids", "1", "ID", "e-1", "WITHVALUE")
assert got == [b"outcome", b"applied", b"value", 801, b"exact", 1], got
got = r.execute_command("TALLY.INCRBY", "ids", "1", "ID", "e-1", "WITHVALUE")
assert got[:2] == [b"outcome", b"duplicate"] and got[3] == 801, got
print("python incr ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incr_answers_count_one_two_three() -> Result<()> {
    let Some(python) = python_redis()? else { return Ok(()) };
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp;
    let out = Command::new(python).args(["-c", PYTHON_INCR, &port.to_string()]).output()?;
    assert!(
        out.status.success(),
        "python: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The answers were the totals: the counters hold them.
    assert_eq!(c.value(1, "pipe:batched").await?, 1000);
    assert_eq!(c.value(1, "mixed").await?, 7);
    Ok(())
}

/// Transactions through the Python client: `pipeline()` wraps its commands in
/// `MULTI`/`EXEC` by default; each increment counts once, and a transaction with a
/// command refused while queueing counts nothing.
const PYTHON_MULTI: &str = r#"
import sys, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
p = r.pipeline()
p.incr("tx:a").incr("tx:a").incrby("tx:a", 5).get("tx:a")
assert p.execute() == [1, 2, 7, b"7"]
assert r.get("tx:a") == b"7"
p = r.pipeline()
p.incr("tx:a").execute_command("NOSUCH", "x").incr("tx:a")
try:
    p.execute()
except redis.exceptions.ResponseError as e:
    assert "EXECABORT" in str(e) or "unknown command" in str(e), str(e)
else:
    raise AssertionError("a transaction with an unknown command ran")
assert r.get("tx:a") == b"7", r.get("tx:a")
with r.pipeline() as p:
    try:
        p.watch("tx:a")
    except redis.exceptions.ResponseError as e:
        assert "WATCH is not supported" in str(e), str(e)
    else:
        raise AssertionError("WATCH answered as if it worked")
print("python multi ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_count_each_increment_once() -> Result<()> {
    let Some(python) = python_redis()? else { return Ok(()) };
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp;
    let out = Command::new(python).args(["-c", PYTHON_MULTI, &port.to_string()]).output()?;
    assert!(
        out.status.success(),
        "python: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(c.value(1, "tx:a").await?, 7);
    Ok(())
}

/// Expiry and absolute writes through the Python client: the fixed-window rate
/// limiter (`INCR`, then `EXPIRE` on the first hit), its pipelined form, and
/// `SET`/`GETSET`/`GETDEL`/`PERSIST`.
const PYTHON_EXPIRY: &str = r#"
import sys, time, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
def allowed(user, limit=3):
    key = "rl:" + user
    n = r.incr(key)
    if n == 1:
        r.expire(key, 60)
    return n <= limit
assert [allowed("u1") for _ in range(5)] == [True, True, True, False, False]
assert 55 <= r.ttl("rl:u1") <= 60, r.ttl("rl:u1")
p = r.pipeline()
p.incr("rl:u2").expire("rl:u2", 1)
assert p.execute() == [1, True]
time.sleep(1.5)
assert r.get("rl:u2") is None and r.ttl("rl:u2") == -2
assert r.incr("rl:u2") == 1, "a new window starts from 1"
assert r.set("s", 10) is True and r.get("s") == b"10"
assert r.getset("s", 3) == b"10" and r.getdel("s") == b"3" and r.get("s") is None
assert r.set("s", 5, ex=100) and 95 <= r.ttl("s") <= 100
assert r.persist("s") and r.ttl("s") == -1
print("python expiry ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_window_limiter_expires_its_counters() -> Result<()> {
    let Some(python) = python_redis()? else { return Ok(()) };
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp;
    let out = Command::new(python).args(["-c", PYTHON_EXPIRY, &port.to_string()]).output()?;
    assert!(
        out.status.success(),
        "python: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The deadline is metadata: HTTP shows it too.
    let info = c.get(1, "/v1/counters/rl:u1").await?;
    assert!(info["expires_at_ms"].as_u64().is_some(), "{info}");
    let expiry = c.get(1, "/v1/counters/rl:u1/expiry").await?;
    assert!(expiry["ttl_ms"].as_i64().is_some_and(|t| t > 50_000), "{expiry}");
    Ok(())
}

/// A namespace keeps a counter's contract across `DEL`: a bounded sync counter
/// deleted and decremented again is still bounded at 0.
const PYTHON_NAMESPACE: &str = r#"
import sys, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
assert r.execute_command("TALLY.NAMESPACE", "SET", "stock:", "DURABILITY", "sync", "FLOOR", "0") == b"created"
def decrements(key, n):
    done = 0
    for _ in range(n):
        try:
            r.decr(key)
            done += 1
        except redis.ResponseError as e:
            assert "bound_exceeded" in str(e), str(e)
    return done
assert r.incrby("stock:sku-1", 5) == 5
assert decrements("stock:sku-1", 8) == 5
assert r.get("stock:sku-1") == b"0"
assert r.delete("stock:sku-1") == 1
assert decrements("stock:sku-1", 20) == 0, "a deleted counter comes back with its namespace's floor"
assert r.get("stock:sku-1") == b"0"
assert r.incr("stock:sku-1") == 1
got = r.execute_command("TALLY.NAMESPACE", "GET", "stock:")
fields = dict(zip(got[::2], got[1::2]))
assert fields[b"durability"] == b"sync" and fields[b"floor"] == 0, fields
assert r.execute_command("TALLY.NAMESPACE", "LIST") == [b"stock:"]
print("python namespace ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_keeps_a_counters_contract_across_del() -> Result<()> {
    let Some(python) = python_redis()? else { return Ok(()) };
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp;
    let out = Command::new(python).args(["-c", PYTHON_NAMESPACE, &port.to_string()]).output()?;
    assert!(
        out.status.success(),
        "python: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let spec = c.get(1, "/v1/counters/stock:sku-1").await?;
    assert_eq!((spec["spec"]["min"].as_i64(), spec["spec"]["durability"].as_str()), (Some(0), Some("sync")));
    let ns = c.get(1, "/v1/namespaces/stock:").await?;
    assert_eq!(ns["spec"]["min"].as_i64(), Some(0), "{ns}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_redis_clients_drive_a_node() -> Result<()> {
    if require_tool("redis-cli", "apt-get install redis-tools")?.is_none() {
        return Ok(());
    }
    let c =
        TestCluster::start_configured(1, &[], &format!("\n[resp]\nconnections_max = {CONNECTIONS_MAX}\n"))
            .await?;
    let port = c.node(1).ports.resp;

    eprintln!("phase: redis-cli, one command per call");
    assert_eq!(cli(port, &["PING"])?, "PONG");
    assert_eq!(cli(port, &["ECHO", "hi"])?, "hi");
    assert_eq!(cli(port, &["SELECT", "0"])?, "OK");
    assert!(cli(port, &["SELECT", "1"])?.contains("DB index is out of range"));
    assert!(cli(port, &["AUTH", "pw"])?.contains("without any password configured"));
    assert_eq!(cli(port, &["TALLY.CREATE", "likes:1", "SHARDS", "8", "DURABILITY", "sync"])?, "created");
    assert_eq!(cli(port, &["TALLY.CREATE", "likes:1", "SHARDS", "8"])?, "updated");
    assert_eq!(cli(port, &["INCR", "likes:1"])?, "1");
    assert_eq!(cli(port, &["DECRBY", "likes:1", "1"])?, "0");
    assert!(cli(port, &["INFO", "server"])?.contains("node_id:node1"));
    let count: usize = cli(port, &["COMMAND", "COUNT"])?.parse()?;
    assert!(count >= 20, "{count}");

    eprintln!("phase: redis-cli, a windowed counter");
    let create = ["TALLY.CREATE", "visits", "WINDOWS", "1h,1m", "DISTINCT", "true", "DURABILITY", "sync"];
    assert_eq!(cli(port, &create)?, "created");
    for (delta, member) in [("3", "u1"), ("4", "u2"), ("5", "u1")] {
        assert_eq!(cli(port, &["TALLY.INCRBY", "visits", delta, "MEMBER", member])?, "applied");
    }
    for (window, window_ms) in [("1m", "60000"), ("1h", "3600000")] {
        let out = cli(port, &["TALLY.WINDOW", "visits", window])?;
        let lines: Vec<&str> = out.lines().collect();
        let field =
            |name: &str| lines.iter().position(|l| *l == name).and_then(|i| lines.get(i + 1)).copied();
        assert_eq!(field("window"), Some(window), "{out}");
        assert_eq!(field("window_ms"), Some(window_ms), "{out}");
        assert_eq!(field("value"), Some("12"), "{out}");
        assert_eq!(field("estimate"), Some("2"), "{out}");
        assert_eq!(field("complete"), Some("1"), "{out}");
    }
    assert!(cli(port, &["TALLY.WINDOW", "visits", "24h"])?.starts_with("ERR unknown_window"));
    assert!(cli(port, &["TALLY.WINDOW", "likes:1", "1h"])?.starts_with("ERR unknown_window"));

    eprintln!("phase: redis-cli --pipe, {PIPE_INCREMENTS} INCRBY in one stream");
    let mut pipe = String::new();
    for _ in 0..PIPE_INCREMENTS {
        pipe += &resp(&["INCRBY", "likes:1", "2"]);
    }
    let mut child = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "--pipe"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(pipe.as_bytes())?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("errors: 0, replies: {PIPE_INCREMENTS}")), "{text}");
    let fresh = cli(port, &["TALLY.GET", "likes:1", "FRESH"])?;
    let lines: Vec<&str> = fresh.lines().collect();
    assert_eq!(&lines[..2], &["value", &(2 * PIPE_INCREMENTS).to_string()], "{fresh}");
    assert_eq!(
        cli(port, &["GET", "likes:1"])?,
        (2 * PIPE_INCREMENTS).to_string(),
        "sync INCR totals are exact"
    );

    eprintln!("phase: redis-cli -3, a RESP3 session");
    let hello = cli(port, &["-3", "HELLO", "3"])?;
    assert!(hello.contains("proto") && hello.contains('3') && hello.contains("tally"), "{hello}");
    let (raw3, _) = exchange(
        port,
        format!("{}{}", resp(&["HELLO", "3"]), resp(&["TALLY.GET", "likes:1", "FRESH"])).as_bytes(),
        "missing_shards",
    )
    .await?;
    assert!(raw3.starts_with("%7\r\n"), "HELLO 3 answers a map of seven: {raw3:?}");
    assert!(raw3.contains("%6\r\n$5\r\nvalue\r\n:2000\r\n"), "TALLY.GET answers a RESP3 map: {raw3:?}");
    assert!(raw3.contains("$8\r\ncomplete\r\n#t\r\n"), "booleans are RESP3 booleans: {raw3:?}");

    if let Some(python) = python_redis()? {
        eprintln!("phase: Python redis");
        let out = Command::new(python).args(["-c", PYTHON, &port.to_string()]).output()?;
        assert!(
            out.status.success(),
            "python: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    eprintln!("phase: garbage and a 1 GB bulk length get errors and a closed connection");
    let (answer, closed) = exchange(port, b"*abc\r\n", "\r\n").await?;
    assert!(answer.starts_with("-ERR protocol_error"), "{answer:?}");
    assert!(closed, "a connection that sent garbage is closed");
    let (answer, closed) = exchange(port, b"*2\r\n$4\r\nECHO\r\n$1000000000\r\n", "\r\n").await?;
    assert!(answer.starts_with("-ERR request_too_large"), "{answer:?}");
    assert!(answer.contains("1000000000"), "{answer:?}");
    assert!(closed, "a connection that announced 1 GB is closed");
    let (answer, _) = exchange(port, &[0x00, 0xff, 0x13, b'\n'], "\r\n").await?;
    assert!(
        answer.starts_with("-ERR unknown command"),
        "an inline line of bytes is an unknown command: {answer:?}"
    );

    eprintln!("phase: the node still serves, data intact");
    assert_eq!(cli(port, &["PING"])?, "PONG");
    assert_eq!(c.value(1, "likes:1").await?, 2 * PIPE_INCREMENTS as i64);

    eprintln!("phase: connection limit of {CONNECTIONS_MAX}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cli(port, &["INFO", "clients"])?.lines().any(|l| l.trim() == "connected_clients:1") {
        if Instant::now() > deadline {
            bail!("earlier connections still counted: {}", cli(port, &["INFO", "clients"])?);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut held = Vec::new();
    for _ in 0..CONNECTIONS_MAX {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"PING\r\n").await?;
        let mut pong = [0u8; 7];
        s.read_exact(&mut pong).await?;
        assert_eq!(&pong, b"+PONG\r\n");
        held.push(s);
    }
    let (answer, closed) = exchange(port, b"PING\r\n", "\r\n").await?;
    assert_eq!(answer, "-ERR max number of clients reached\r\n");
    assert!(closed);
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match cli(port, &["PING"]) {
            Ok(p) if p == "PONG" => break,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            other => bail!("the node does not serve after the limit was released: {other:?}"),
        }
    }
    Ok(())
}
